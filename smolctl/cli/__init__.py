"""The smolctl command line: the only package that knows Typer. Each command parses its arguments, calls one
module, and renders the result (on stdout: rich tables, or one JSON object with --json; progress on stderr).

One module per family, each command beside its renderer: data (train-tokenizer, dedup, mix, pack), train
(pretrain, midtrain, export, report), posttrain (sft, dpo, ppo, grpo, generate, merge), estimate, cluster
(benchmark-nccl, stress-gpu) and inspect; options several commands share live in options.py."""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import typer

from smolctl.cli import cluster, data, estimate, inspect, posttrain, train  # noqa: F401  (each registers its commands)
from smolctl.cli.app import Command, app
from smolctl.cli.common import QUIET_RANK_GRACE_S
from smolctl.console import error_line
from smolctl.errors import (
    COMMITTED_BEFORE_THE_INTERRUPT,
    NOTHING_HALF_WRITTEN,
    CheckFailed,
    Interrupted,
    UserError,
    committed_output,
    environment_error,
    writing_to,
)
from smolctl.launcher import rank_from_env

# `smolctl --help` lists the commands in pipeline order, grouped by what they work on.
PIPELINE_ORDER = {
    "Data": ["train-tokenizer", "dedup", "mix", "pack"],
    "Training": ["pretrain", "midtrain", "export", "sft", "dpo", "ppo", "grpo", "generate", "merge", "report"],
    "Cluster": ["estimate", "benchmark-nccl", "stress-gpu"],
    "Any folder": ["inspect"],
}
_position = {name: i for i, name in enumerate(n for names in PIPELINE_ORDER.values() for n in names)}
for _command in app.registered_commands:
    _command.cls = Command
    _command.rich_help_panel = next(panel for panel, names in PIPELINE_ORDER.items() if _command.name in names)
app.registered_commands.sort(key=lambda command: _position[command.name])


def _report_unexpected(exc: Exception) -> int:
    if (line := environment_error(exc)) is not None:
        error_line("error", line)
        return 2
    error_line("internal error", f"{type(exc).__name__}: {exc} — please report it; SMOLCTL_DEBUG=1 shows the traceback")
    return 1


@contextmanager
def _only_the_invoked_command(args: list[str]) -> Iterator[None]:
    """Typer makes every registered command's click command (its parameters, from the function's type hints)
    before it parses anything, ~10 ms for all of them; `smolctl pack ...` needs pack's alone. Anything else
    (`smolctl --help`, a mistyped name, shell completion) still finds every command."""
    commands = app.registered_commands
    if args and args[0] in {command.name for command in commands}:
        app.registered_commands = [command for command in commands if command.name == args[0]]
    try:
        yield
    finally:
        app.registered_commands = commands


def _report_usage_error(exc: typer.TyperException) -> None:
    """A mistyped command line as one line, like any other bad input. Click prints its usage, a hint and the
    error over four lines; the usage is kept where it is the answer (an argument missing or one too many), the
    rest points at -h. A command run without its arguments still shows its help."""
    from typer._click.exceptions import BadArgumentUsage, MissingParameter, NoArgsIsHelpError, UsageError

    if isinstance(exc, NoArgsIsHelpError) or not hasattr(exc, "format_message"):
        exc.show()
        return
    context = exc.ctx if isinstance(exc, UsageError) else None
    if context is None:
        error_line("error", exc.format_message().rstrip("."))
        return
    message = exc.format_message().rstrip(".")
    arguments = (
        isinstance(exc, BadArgumentUsage)
        or (isinstance(exc, MissingParameter) and getattr(exc.param, "param_type_name", None) == "argument")
        or message.startswith("Got unexpected extra argument")
    )
    usage = " ".join(context.get_usage().removeprefix("Usage: ").split())  # click wraps it to the terminal
    fix = f"usage: {usage}" if arguments else f"see '{context.command_path} -h'"
    error_line("error", f"{context.command_path}: {message} — {fix}")


def _what_the_interrupt_left(message: str) -> str:
    """The interrupted line: to run the command again, unless it had committed its OUTPUT when Ctrl-C came (the
    last moment of a run), when a re-run would only be refused for a full OUTPUT."""
    if message == NOTHING_HALF_WRITTEN and (output := committed_output()) is not None:
        return f"{output}: {COMMITTED_BEFORE_THE_INTERRUPT}"
    return message


def _refuse_empty_arguments(args: list[str]) -> None:
    """No smolctl argument means anything empty, and an empty one is nearly always an unset shell variable:
    `smolctl export CKPT "$OUT" --overwrite` would otherwise take "" as the working folder and replace it."""
    for index, arg in enumerate(args):
        if arg.startswith("--") and arg.find("=") == len(arg) - 1:  # --set=key= is a value, key=
            what = f"{arg[:-1]} is given an empty value"
        elif arg == "":
            what = f"argument {index + 1}{f' (after {args[index - 1]})' if index else ''} is empty"
        else:
            continue
        where = f"smolctl {args[0]}" if index else "smolctl"
        raise UserError(where, f"{what} (an unset shell variable?)", "give it a value")


def _speaks_for_the_launch() -> bool:
    """Under torchrun a terminal's Ctrl-C reaches every rank: rank 0 says what the interrupt left, once."""
    try:
        return rank_from_env() == 0
    except UserError:  # a launcher variable it cannot read: speak rather than say nothing
        return True


def _quiet_unless_rank_zero(code: int) -> None:
    """A command line every rank of a torchrun launch was given alike: rank 0 says what is wrong with it, the
    other ranks leave after it, silently, with the same exit code."""
    if not _speaks_for_the_launch():
        time.sleep(QUIET_RANK_GRACE_S)
        sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    """Run the CLI: user mistakes are one line and exit 2, failed checks exit 1, bugs exit 1 with a hint."""
    debug = os.environ.get("SMOLCTL_DEBUG") == "1"
    writing_to(None)  # this command names its own output (in-process callers run several)
    args = sys.argv[1:] if argv is None else argv
    try:
        try:
            _refuse_empty_arguments(args)
        except UserError as exc:
            _quiet_unless_rank_zero(exc.exit_code)
            raise
        with _only_the_invoked_command(args):
            code = app(args=argv, prog_name="smolctl", standalone_mode=False)
    except Interrupted as exc:
        if _speaks_for_the_launch():
            error_line("interrupted", _what_the_interrupt_left(str(exc)))
        code = exc.exit_code
    except typer.TyperException as exc:  # found while parsing the command line
        _quiet_unless_rank_zero(getattr(exc, "exit_code", 2))
        _report_usage_error(exc)
        code = getattr(exc, "exit_code", 2)
    except UserError as exc:
        if debug:
            traceback.print_exc()
        error_line("error", exc.line())
        code = exc.exit_code
    except CheckFailed as exc:
        if debug:
            traceback.print_exc()
        error_line("failed", str(exc))
        code = exc.exit_code
    except (KeyboardInterrupt, typer.Abort):  # Ctrl-C elsewhere: outputs are written atomically, nothing half-made
        if _speaks_for_the_launch():
            error_line("interrupted", _what_the_interrupt_left(NOTHING_HALF_WRITTEN))
        code = 130
    except Exception as exc:  # the file system refusing a write, or a bug in smolctl
        if debug:
            traceback.print_exc()
        code = _report_unexpected(exc)
    sys.exit(code if isinstance(code, int) else 0)

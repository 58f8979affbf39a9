"""The Typer app every command registers on, with help that reads as written (see `_ReadableHelp`)."""

from __future__ import annotations

import contextlib
import sys
from typing import Annotated

import typer
from typer.core import TyperCommand, TyperGroup

from smolctl import __version__
from smolctl.console import escape, stderr_console
from smolctl.errors import NOTHING_HALF_WRITTEN, Interrupted

PIPELINE = """\
[bold]smolctl[/] — train small language models the SmolLM3 way, one composable stage at a time.

  [bold]data[/]      train-tokenizer → dedup → mix → pack        (parquet folders → packed safetensors)
  [bold]train[/]     pretrain → midtrain → sft → dpo → ppo|grpo  (HF model folders, resumable; report RUN)
            generate (completions, preference pairs) · merge (MergeKit: linear, soups, SLERP, TIES)
  [bold]cluster[/]   estimate · benchmark-nccl · stress-gpu     (size the run, validate the machines)
  [bold]any[/]       inspect PATH                               (what a folder holds, its lineage, checksums)

Every stage reads the previous stage's output folder and writes one with a manifest.json.
Run `smolctl COMMAND --help` for examples; `make demo` runs the whole pipeline on the sample corpus.
"""


class _ReadableHelp:
    """Help that reads as written. Docstrings and argument/option help are plain text, so `[model]` or
    `[rows, seq_len]` are shown, not taken for Rich markup (epilogs keep their markup: `[bold]Examples[/]`).
    Usage lines and option columns read as values: `smolctl pretrain [OPTIONS] RECIPE [RUN]` (Typer writes
    required arguments as `{recipe}`), no `<bool>` after a flag."""

    def format_help(self, ctx, formatter):
        self.escape_shown_help(ctx)
        super().format_help(ctx, formatter)

    def parse_args(self, ctx, args):
        # Click's option parser raises some usage errors ("requires an argument") without the command they are
        # about; the CLI's one line names the command and where its -h is.
        try:
            return super().parse_args(ctx, args)
        except typer.TyperException as exc:
            if getattr(exc, "ctx", False) is None:
                exc.ctx, exc.cmd = ctx, ctx.command
            raise

    def shell_complete(self, ctx, incomplete):
        # Typer renders completion descriptions as Rich markup too (to strip it).
        self.escape_shown_help(ctx)
        return super().shell_complete(ctx, incomplete)

    def escape_shown_help(self, ctx) -> None:
        self.escape_help()

    def escape_help(self) -> None:
        """Escape the help texts once, when help or completions are shown: escaping imports Rich, which a run that
        draws nothing (`--json` in a pipe) does not otherwise import."""
        if getattr(self, "_help_escaped", False):
            return
        self._help_escaped = True
        self.help = escape(self.help) if self.help else self.help
        for param in self.params:
            if getattr(param, "help", None):
                param.help = escape(param.help)

    def collect_usage_pieces(self, ctx):
        pieces = super().collect_usage_pieces(ctx)  # [OPTIONS], one piece per argument, a group's COMMAND
        arguments = [param for param in self.get_params(ctx) if param.param_type_name == "argument"]
        start = 1 if self.options_metavar else 0
        return pieces[:start] + [self._usage_name(param) for param in arguments] + pieces[start + len(arguments) :]

    @staticmethod
    def _usage_name(argument) -> str:
        if argument.metavar:  # written out by the command, e.g. "[RECIPE] OUTPUT"
            return argument.metavar
        name = argument.name.upper() + ("..." if argument.nargs != 1 else "")
        return name if argument.required else f"[{name}]"

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for param in params:
            if param.param_type_name != "option" or param.metavar is not None:
                continue
            if param.is_flag:
                param.metavar = ""
        return params


class Command(_ReadableHelp, TyperCommand):
    def invoke(self, ctx):
        # Typer turns Ctrl-C into a silent exit 130; a command that has no more to say (a training command names
        # the run to resume) still ends with its one line.
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise Interrupted(NOTHING_HALF_WRITTEN) from None


class Group(_ReadableHelp, TyperGroup):
    def escape_shown_help(self, ctx) -> None:
        self.escape_help()
        for name in self.list_commands(ctx):  # the command list shows each command's help
            self.get_command(ctx, name).escape_help()


app = typer.Typer(
    name="smolctl",
    cls=Group,
    help="Train small language models the SmolLM3 way, one composable stage at a time. Run with no arguments "
    "for the pipeline at a glance.",
    rich_markup_mode="rich",
    no_args_is_help=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"smolctl {__version__}")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def root(
    ctx: typer.Context,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    if ctx.invoked_subcommand is None:
        # Both on stderr, as any help without a command: rich prints the help to stdout itself and returns "".
        stderr_console().print(PIPELINE)
        with contextlib.redirect_stdout(sys.stderr):
            typer.echo(ctx.get_help(), err=True)

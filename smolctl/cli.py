"""The smolctl command line: the only module that knows Typer. Each command parses its arguments, calls one
module, and renders the result (rich on stderr, or one JSON object on stdout with --json)."""

from __future__ import annotations

import errno
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Optional

import typer
from typer._click import exceptions as click_exceptions

from smolctl import __version__
from smolctl.console import console, emit_json, human_count, key_values, progress, show, table
from smolctl.errors import CheckFailed, UserError

PIPELINE = """\
[bold]smolctl[/] — train small language models the SmolLM3 way, one composable stage at a time.

  [bold]data[/]      train-tokenizer → dedup → mix → pack        (parquet folders → packed safetensors)
  [bold]train[/]     pretrain → midtrain → sft → dpo → ppo       (HF model folders, resumable)
  [bold]cluster[/]   estimate · benchmark-nccl · stress-gpu     (size the run, validate the machines)
  [bold]any[/]       inspect PATH                               (what a folder holds, its lineage, checksums)

Every stage reads the previous stage's output folder and writes one with a manifest.json.
Run `smolctl COMMAND --help` for examples; `make demo` runs the whole pipeline on the sample corpus.
"""

app = typer.Typer(
    name="smolctl",
    help="Train small language models the SmolLM3 way, one composable stage at a time. Run with no arguments "
    "for the pipeline at a glance.",
    rich_markup_mode="rich",
    no_args_is_help=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

JSON_OPTION = typer.Option(False, "--json", help="Print one JSON object with the result on stdout.")
OVERWRITE_OPTION = typer.Option(False, "--overwrite", help="Replace OUTPUT if it already holds files.")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"smolctl {__version__}")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def root(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    if ctx.invoked_subcommand is None:
        console.print(PIPELINE)
        typer.echo(ctx.get_help(), err=True)


# ---------------------------------------------------------------------------------------------------------------
# Foundation commands


@app.command("train-tokenizer", epilog="""[bold]Examples[/]

  smolctl train-tokenizer data/sample/web tok/ --vocab-size 8192

  smolctl train-tokenizer 'corpus/*.parquet' tok/ --vocab-size 49152 --text-column content --json
""")
def train_tokenizer_command(
    input: str = typer.Argument(..., help="Dataset folder, folder of parquet files, a .parquet file or a glob."),
    output: Path = typer.Argument(..., help="Tokenizer folder to write (loads with AutoTokenizer.from_pretrained)."),
    vocab_size: int = typer.Option(8192, "--vocab-size", help="Vocabulary size, special tokens included."),
    text_column: str = typer.Option("text", "--text-column", help="Column holding the documents."),
    min_frequency: int = typer.Option(2, "--min-frequency", help="Merges rarer than this are not learned."),
    overwrite: bool = OVERWRITE_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Train a byte-level BPE tokenizer with ChatML chat template and special tokens for document end and padding."""
    from smolctl.data.tokenizer import train_tokenizer

    with progress(not json_out) as bar:
        task = bar.add_task("reading documents", total=None, rate="", visible=False)
        result = train_tokenizer(input, str(output), vocab_size=vocab_size, text_column=text_column,
                                 min_frequency=min_frequency, overwrite=overwrite,
                                 on_start=lambda total: bar.update(task, total=total, visible=True),
                                 on_batch=lambda n: bar.advance(task, n))
    if json_out:
        emit_json(result.__dict__)
        return
    show(key_values("train-tokenizer", [
        ("output", result.output), ("vocab size", result.vocab_size), ("documents", human_count(result.documents)),
        ("characters", human_count(result.characters)), ("chars/token", f"{result.chars_per_token:.2f}"),
        ("time", f"{result.seconds:.1f}s"),
    ]))


@app.command("inspect", epilog="""[bold]Examples[/]

  smolctl inspect demo-out/dedup                 what a dataset folder holds, with sample rows

  smolctl inspect demo-out/packed --samples 2    packed rows decoded, documents separated by ⟂

  smolctl inspect demo-out/ppo --lineage         the chain of folders back to the raw corpus

  smolctl inspect demo-out/dedup --verify        re-hash every shard; exit 1 on a mismatch
""")
def inspect_command(
    path: str = typer.Argument(..., help="A smolctl folder, a folder of parquet files, a .parquet file or a glob."),
    samples: int = typer.Option(3, "--samples", min=0, help="How many rows to show."),
    verify: bool = typer.Option(False, "--verify", help="Check every shard's size and sha256 against the manifest."),
    lineage: bool = typer.Option(False, "--lineage", help="Follow the inputs back to the raw data."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="Decode packed rows with this tokenizer (default: the one recorded)."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Show what a folder holds (kind, shards, rows/tokens, schema, lineage, sample rows) and verify checksums."""
    from smolctl.inspect import inspect_path

    result = inspect_path(path, samples=samples, verify=verify, lineage=lineage, tokenizer=tokenizer)
    if json_out:
        emit_json(result)
    else:
        _render_inspect(result)
    if verify and not result.get("verified", True):
        raise CheckFailed(f"{path}: {len(result['problems'])} shard(s) do not match the manifest")


def _render_inspect(result: dict) -> None:
    facts = [("kind", result["kind"]), ("rows", human_count(result["rows"]) if result.get("rows") is not None else "?")]
    if result.get("tokens"):
        facts.append(("tokens", human_count(result["tokens"])))
    facts.append(("shards", result.get("shards")))
    for key in ("seq_len", "strategy", "command", "smolctl_version", "created_at"):
        if result.get(key):
            facts.append((key, result[key]))
    if result.get("tokenizer"):
        facts.append(("tokenizer", result["tokenizer"].get("path", result["tokenizer"])))
    for key, value in (result.get("stats") or {}).items():
        if not isinstance(value, (dict, list)):
            facts.append((key, value))
    if result.get("inputs"):
        facts.append(("inputs", "\n".join(result["inputs"])))
    show(key_values(result["path"], facts))
    if result.get("schema"):
        show(table("schema", ["column", "type"], result["schema"].items()))
    if result.get("samples"):
        columns = list(result["samples"][0].keys())
        show(table("samples", columns, ([row[c] for c in columns] for row in result["samples"]), justify="left"))
    if "lineage" in result:
        show(table("lineage", ["", "folder", "kind", "rows", "status"],
                   (("  " * e["depth"] + "└" if e["depth"] else "•", e["path"], e["kind"] or "-",
                     e["rows"] if e["rows"] is not None else "-", e["status"]) for e in result["lineage"])))
    if "problems" in result:
        if result["problems"]:
            for problem in result["problems"]:
                console.print(f"[red]mismatch[/] {problem}")
        else:
            console.print(f"[green]verified[/]: {result['shards']} shard(s) match the manifest")


# ---------------------------------------------------------------------------------------------------------------
# Entry point


# The file system refusing a write is the user's environment, not a bug: name the file and what to do.
ENVIRONMENT_ERRNOS = {
    errno.ENOSPC: "free some space (or point the output elsewhere) and run again; earlier outputs are intact",
    errno.EDQUOT: "free some quota (or point the output elsewhere) and run again; earlier outputs are intact",
    errno.EACCES: "check the permissions of that path",
    errno.EROFS: "the file system is read-only; write the output elsewhere",
}


def _report_unexpected(exc: Exception) -> int:
    # Rust-backed libraries (tokenizers, safetensors) report OS errors as plain exceptions: "(os error 28)".
    number = exc.errno if isinstance(exc, OSError) else None
    if number is None and (match := re.search(r"\(os error (\d+)\)", str(exc))):
        number = int(match.group(1))
    if number in ENVIRONMENT_ERRNOS:
        where = getattr(exc, "filename", None) or "output"
        console.print(f"[red]error:[/] {where}: {os.strerror(number)} — {ENVIRONMENT_ERRNOS[number]}", soft_wrap=True)
        return 2
    console.print(f"[red]internal error:[/] {type(exc).__name__}: {exc} — please report it; "
                  "SMOLCTL_DEBUG=1 shows the traceback", soft_wrap=True)
    return 1


def main(argv: list[str] | None = None) -> None:
    """Run the CLI: user mistakes are one line and exit 2, failed checks exit 1, bugs exit 1 with a hint."""
    debug = os.environ.get("SMOLCTL_DEBUG") == "1"
    try:
        code = app(args=argv, prog_name="smolctl", standalone_mode=False)
    except typer.Abort:
        console.print("aborted")
        code = 130
    except click_exceptions.ClickException as exc:
        exc.show()
        code = exc.exit_code
    except UserError as exc:
        if debug:
            traceback.print_exc()
        console.print(f"[red]error:[/] {exc.line()}", soft_wrap=True)
        code = exc.exit_code
    except CheckFailed as exc:
        if debug:
            traceback.print_exc()
        console.print(f"[red]failed:[/] {exc}", soft_wrap=True)
        code = exc.exit_code
    except KeyboardInterrupt:
        console.print("interrupted")
        code = 130
    except Exception as exc:  # the file system refusing a write, or a bug in smolctl
        if debug:
            traceback.print_exc()
        code = _report_unexpected(exc)
    sys.exit(code if isinstance(code, int) else 0)

"""`smolctl inspect PATH`: what any folder holds, its lineage and checksums."""

from __future__ import annotations

import typer
from rich.markup import escape

from smolctl.cli.app import app
from smolctl.cli.options import JsonOpt
from smolctl.console import emit_json, human_count, key_values, show, styled, table
from smolctl.errors import CheckFailed


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
    tokenizer: str | None = typer.Option(None, "--tokenizer", help="Decode packed rows with this tokenizer (default: the one recorded)."),
    json_out: JsonOpt = False,
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
    from smolctl.inspect import KIND_COLLECTION

    counts = [(key, human_count(result[key]) if key != "shards" else result[key])
              for key in ("rows", "tokens", "shards") if result.get(key) is not None]
    if result["kind"] == KIND_COLLECTION:
        show(table(f"{result['path']}: smolctl folders", ["folder", "kind", "rows", "tokens", "shards"],
                   [(f["path"], f["kind"], *(human_count(f[k]) if k in f and k != "shards" else f.get(k, "-")
                                              for k in ("rows", "tokens", "shards"))) for f in result["folders"]]))
        _render_verification(result)
        return
    facts = [("kind", result["kind"]), *counts]
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
    if result.get("folders"):
        facts.append(("holds", "\n".join(f"{f['path']}/ ({f['kind']}"
                                         + "".join(f", {f[k]:,} {k}" for k in ("rows", "tokens") if k in f) + ")"
                                         for f in result["folders"])))
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
    _render_verification(result)


def _render_verification(result: dict) -> None:
    if "problems" not in result:
        return
    for problem in result["problems"]:
        show(styled(f"[red]mismatch[/] {escape(problem)}"), soft_wrap=True)
    if not result["problems"]:
        folders = len(result["verified_folders"])
        show(styled(f"[green]verified[/]: every shard of {folders} folder{'s' if folders > 1 else ''} "
                    "matches its manifest"))


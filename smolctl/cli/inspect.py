"""`smolctl inspect PATH`: what any folder holds, its lineage and checksums."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import typer

from smolctl.cli.app import app
from smolctl.cli.options import JsonOpt
from smolctl.console import emit_json, escape, human_count, key_values, show, styled, table, warn
from smolctl.errors import CheckFailed

if TYPE_CHECKING:
    from smolctl.inspect import Inspection  # the renderer's type; the module itself loads pyarrow


@app.command(
    "inspect",
    epilog="""[bold]Examples[/]

  smolctl inspect demo-out/dedup                 what a dataset folder holds, with sample rows

  smolctl inspect demo-out/packed --samples 2    packed rows decoded, documents separated by ⟂

  smolctl inspect demo-out/ppo --lineage         the chain of folders back to the raw corpus

  smolctl inspect demo-out/dedup --verify        re-hash every shard; exit 1 on a mismatch
""",
)
def inspect_command(
    path: str = typer.Argument(..., help="A smolctl folder, a folder of parquet files, a .parquet file or a glob."),
    samples: int = typer.Option(3, "--samples", min=0, help="How many rows to show."),
    verify: bool = typer.Option(False, "--verify", help="Check every shard's size and sha256 against the manifest."),
    lineage: bool = typer.Option(False, "--lineage", help="Follow the inputs back to the raw data."),
    tokenizer: str | None = typer.Option(
        None, "--tokenizer", help="Decode packed rows with this tokenizer (default: the one recorded)."
    ),
    json_out: JsonOpt = False,
) -> None:
    """Show what a folder holds (kind, shards, rows/tokens, schema, lineage, sample rows) and verify checksums."""
    from smolctl.inspect import inspect_path

    result = inspect_path(path, samples=samples, verify=verify, lineage=lineage, tokenizer=tokenizer)
    for note in result.notes or []:
        warn(note)
    if json_out:
        emit_json(result.to_dict())
    else:
        _render_inspect(result)
    if verify and result.verified is False:
        raise CheckFailed(f"{path}: {len(result.problems)} file(s) do not match the manifest")


def _render_inspect(result: Inspection) -> None:
    from smolctl.inspect import KIND_COLLECTION

    counts = [
        (key, human_count(value) if key != "shards" else value)
        for key, value in (("rows", result.rows), ("tokens", result.tokens), ("shards", result.shards))
        if value is not None
    ]
    if result.kind == KIND_COLLECTION:
        show(
            table(
                f"{result.path}: smolctl folders",
                ["folder", "kind", "rows", "tokens", "shards"],
                [
                    (
                        f["path"],
                        f["kind"],
                        *(
                            human_count(f[k]) if k in f and k != "shards" else f.get(k, "-")
                            for k in ("rows", "tokens", "shards")
                        ),
                    )
                    for f in result.folders
                ],
            )
        )
        _render_verification(result)
        return
    facts = [("kind", result.kind), *counts]
    for key in ("seq_len", "strategy", "command", "smolctl_version", "created_at"):
        if getattr(result, key):
            facts.append((key, getattr(result, key)))
    if result.tokenizer:
        tokenizer = result.tokenizer
        facts.append(("tokenizer", tokenizer.get("path", tokenizer) if isinstance(tokenizer, dict) else tokenizer))
    for key, value in (result.stats or {}).items():
        if not isinstance(value, (dict, list)):
            facts.append((key, value))
    if result.inputs:
        facts.append(("inputs", "\n".join(result.inputs)))
    if result.folders:
        facts.append(
            (
                "holds",
                "\n".join(
                    f"{f['path']}/ ({f['kind']}"
                    + "".join(f", {f[k]:,} {k}" for k in ("rows", "tokens") if k in f)
                    + ")"
                    for f in result.folders
                ),
            )
        )
    show(key_values(result.path, facts))
    if result.schema:
        show(table("schema", ["column", "type"], result.schema.items()))
    if result.samples:
        columns = list(result.samples[0].keys())
        cells = ([_as_text(row[c]) for c in columns] for row in result.samples)
        show(table("samples", columns, cells, justify="left"))
    if result.lineage is not None:
        show(
            table(
                "lineage",
                ["", "folder", "kind", "rows", "status"],
                (
                    (
                        "  " * e["depth"] + "└" if e["depth"] else "•",
                        e["path"],
                        e["kind"] or "-",
                        e["rows"] if e["rows"] is not None else "-",
                        e["status"],
                    )
                    for e in result.lineage
                ),
            )
        )
    _render_verification(result)


def _render_verification(result: Inspection) -> None:
    if result.problems is None:
        return
    for problem in result.problems:
        show(styled(f"[red]mismatch[/] {escape(problem)}"), soft_wrap=True)
    if not result.problems:
        folders = len(result.verified_folders)
        show(
            styled(
                f"[green]verified[/]: every shard of {folders} folder{'s' if folders > 1 else ''} matches its manifest"
            )
        )


def _as_text(value) -> str:
    """A sample cell in the terminal: text as it is, anything else as its JSON (null, [1, 2], {"k": 1})."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 240 else text[:239] + "…"

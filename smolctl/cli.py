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
# pack


@app.command("pack", epilog="""[bold]Examples[/]

  smolctl pack demo-out/mix/stage-1 demo-out/packed --tokenizer demo-out/tokenizer --seq-len 256

  smolctl pack mix/ packed/ --tokenizer HuggingFaceTB/SmolLM3-3B --seq-len 4096 --workers 8

  smolctl pack 'corpus/*.parquet' packed/ --tokenizer tok/ --seq-len 2048 --strategy concat --json
""")
def pack_command(
    input: str = typer.Argument(..., help="Dataset folder (a mix stage, or a whole mix output: all stages in order), "
                                "folder of parquet files, a .parquet file or a glob."),
    output: Path = typer.Argument(..., help="Packed folder to write (input_ids and position_ids, [rows, seq_len])."),
    tokenizer: str = typer.Option(..., "--tokenizer", help="Tokenizer folder (or hub id) with a fast tokenizer."),
    seq_len: int = typer.Option(4096, "--seq-len", help="Tokens per row: the training context length."),
    strategy: str = typer.Option("bfd", "--strategy", help="bfd: best-fit-decreasing, pads only row ends; "
                                 "concat: concatenate and cut, no padding."),
    long_docs: str = typer.Option("split", "--long-docs", help="Documents longer than seq_len: split (keep every "
                                  "token) or truncate."),
    workers: int = typer.Option(1, "--workers", help="Tokeniser processes (1: in-process, Rust threads still used)."),
    text_column: str = typer.Option("text", "--text-column", help="Column holding the documents."),
    buffer_tokens: int = typer.Option(8_000_000, "--buffer-tokens", help="Tokens packed together by bfd: more "
                                      "means less padding and more memory (about 20 bytes per token)."),
    shard_size: str = typer.Option("256MB", "--shard-size", help="Shard size in bytes (256MB) or rows (8192rows)."),
    seed: int = typer.Option(0, "--seed", help="Seeds the shuffle of each bfd buffer's rows."),
    overwrite: bool = OVERWRITE_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Tokenise documents and pack them into fixed-length rows with document-masked position ids."""
    import time

    from smolctl.data.pack import PackConfig, prepare_pack

    config = PackConfig(seq_len=seq_len, strategy=strategy, long_docs=long_docs, text_column=text_column,
                        workers=workers, buffer_tokens=buffer_tokens, shard_size=shard_size, seed=seed)
    job = prepare_pack(input, output, tokenizer_spec=tokenizer, config=config, overwrite=overwrite)
    with progress(not json_out) as bar:
        task = bar.add_task("packing", total=job.total_documents, rate="")
        started, tokens = time.perf_counter(), [0]

        def advance(documents: int, new_tokens: int) -> None:
            tokens[0] += new_tokens
            rate = tokens[0] / max(1e-9, time.perf_counter() - started)
            bar.update(task, advance=documents, rate=f"{human_count(rate)} tok/s")

        result = job.run(advance)
    if json_out:
        emit_json(result.to_dict())
        return
    stats = result.stats
    show(key_values("pack", [
        ("output", result.output), ("tokenizer", f"{result.tokenizer['name']} ({result.tokenizer['fingerprint']})"),
        ("strategy", f"{result.strategy}, long documents {result.long_docs}"), ("seq_len", result.seq_len),
        ("documents", human_count(stats.documents)), ("rows", human_count(stats.rows)),
        ("tokens", human_count(stats.tokens)),
        ("padding", f"{human_count(stats.padding_tokens)} tokens ({stats.padding_fraction:.3%})"),
        ("split / truncated", f"{stats.split_documents} / {stats.truncated_documents} documents "
                              f"({human_count(stats.truncated_tokens)} tokens cut)"),
        ("skipped empty", stats.skipped_empty), ("shards", result.shards),
        ("time", f"{result.seconds:.1f}s ({human_count(result.tokens_per_second)} tokens/s)"),
    ]))


# ---------------------------------------------------------------------------------------------------------------
# Cluster validation: benchmark-nccl, stress-gpu


def _quiet_on_other_ranks(rank: int, exc: Exception) -> None:
    """Every rank raises the same error; only rank 0 says it, the others leave with the same exit code."""
    if rank != 0:
        raise typer.Exit(exc.exit_code)
    raise exc


@app.command("benchmark-nccl", epilog="""[bold]Examples[/]

  torchrun --nproc_per_node 8 -m smolctl benchmark-nccl --expect-busbw 300

  torchrun --nproc_per_node 2 -m smolctl benchmark-nccl --max-bytes 1M --iters 5 --warmup 1    (CPU, gloo)

  torchrun --nproc_per_node 8 -m smolctl benchmark-nccl --ops all_reduce,all_to_all --min-bytes 1M --max-bytes 8G

  sbatch --nodes 4 recipes/slurm/benchmark-nccl.sbatch    (multi-node: adds intra vs inter-node and the slowest pair)
""")
def benchmark_nccl_command(
    ops: str = typer.Option("all_reduce,all_gather,reduce_scatter,all_to_all,broadcast,send_recv", "--ops",
                            help="Comma-separated ops (or 'all')."),
    min_bytes: str = typer.Option("8", "--min-bytes", help="Smallest message (K/M/G = powers of 1024, as nccl-tests -b)."),
    max_bytes: Optional[str] = typer.Option(None, "--max-bytes", help="Largest message [default: 8G with NCCL, 64M with gloo]."),
    factor: float = typer.Option(2.0, "--factor", help="Size multiplier between steps (nccl-tests -f)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="bf16, fp16, fp32, fp64 or int32 [default: bf16 with NCCL, fp32 with gloo]."),
    iters: int = typer.Option(20, "--iters", help="Timed calls per size."),
    warmup: int = typer.Option(5, "--warmup", help="Untimed calls per size before timing."),
    backend: str = typer.Option("auto", "--backend", help="auto (nccl when GPUs are visible, else gloo), nccl or gloo."),
    expect_busbw: Optional[float] = typer.Option(None, "--expect-busbw", help="GB/s each op's busbw at the largest size must reach; exit 1 below it."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Collective bandwidth like nccl-tests (time, algbw, busbw, #wrong per size) for every op, under torchrun."""
    from smolctl.infra.collectives import build_config, launch_environment, run_benchmark

    rank = int(os.environ.get("RANK", "0"))
    try:
        config = build_config(ops=ops, min_bytes=min_bytes, max_bytes=max_bytes, factor=factor, dtype=dtype,
                              iters=iters, warmup=warmup, backend=backend, expect_busbw=expect_busbw)
        launch_environment()
        with progress(rank == 0 and not json_out) as bar:
            task = bar.add_task("benchmark-nccl", total=None, rate="")
            report = run_benchmark(config, on_plan=lambda total: bar.update(task, total=total),
                                   on_size=lambda op, size: bar.update(task, advance=1, rate=f"{op} {size} B"))
    except UserError as exc:
        _quiet_on_other_ranks(rank, exc)
    if rank == 0:
        emit_json(report.to_dict()) if json_out else _render_nccl(report)
    if not report.passed:
        _quiet_on_other_ranks(rank, CheckFailed(_nccl_failure(report)))


def _nccl_failure(report) -> str:
    problems = [f"{report.wrong} wrong element(s)"] if report.wrong else []
    problems += [f"{r.op} busbw {r.peak.busbw:.2f} GB/s < {report.expect_busbw:g}" if r.peak else f"{r.op}: no size ran"
                 for r in report.below_expectation()]
    return "benchmark-nccl: " + "; ".join(problems)


def _render_nccl(report) -> None:
    from smolctl.console import human_bytes

    topo = report.topology
    facts = [("world size", topo["world_size"]), ("nodes", topo["nodes"]),
             ("GPUs per node" if topo["backend"] == "nccl" else "ranks per node", topo["ranks_per_node"]),
             ("hosts", ", ".join(topo["hosts"][:4]) + (" …" if len(topo["hosts"]) > 4 else "")),
             ("device", topo["device"]), ("backend", topo["backend"]), ("torch", topo["torch"]),
             ("NCCL", topo["nccl"] or "-"),
             ("NCCL_* env", "\n".join(f"{k}={v}" for k, v in topo["nccl_env"].items()) or "(none set)")]
    if topo["env_mismatch"]:
        facts.append(("[red]differs across ranks[/]", ", ".join(topo["env_mismatch"])))
    show(key_values("benchmark-nccl", facts))
    # nccl-tests' own layout, so that its users read it at once (and plain text never gets truncated)
    head = f"{'size':>12} {'count':>12} {'type':>9} {'redop':>6} {'root':>5} {'time':>10} {'algbw':>8} {'busbw':>8} {'#wrong':>7}"
    units = f"{'(B)':>12} {'(elements)':>12} {'':>9} {'':>6} {'':>5} {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8} {'':>7}"
    for result in report.results:
        placement = "in-place" if result.op in ("all_reduce", "broadcast") else "out-of-place"
        lines = [f"# {result.op}: {topo['world_size']} ranks, {topo['backend']}, {placement}", "#" + head[1:],
                 "#" + units[1:]]
        lines += [f"{r.size:>12} {r.count:>12} {r.type:>9} {r.redop:>6} {r.root:>5} {r.time_us:>10.2f} "
                  f"{r.algbw:>8.2f} {r.busbw:>8.2f} {r.wrong:>7}" for r in result.rows]
        lines.append(f"# {result.op} avg bus bandwidth: {result.avg_busbw:.3f} GB/s\n")
        console.print("\n".join(lines), markup=False, soft_wrap=True)
    if report.multinode:
        split = report.multinode
        rows = [(name.replace("_", "-"), split[name]["groups"], split[name]["ranks_per_group"],
                 f"{split[name]['busbw_min']:.2f}" if split[name]["busbw_min"] is not None else "-",
                 f"{split[name]['busbw_median']:.2f}" if split[name]["busbw_median"] is not None else "-")
                for name in ("intra_node", "inter_node")]
        show(table(f"all_reduce at {human_bytes(split['size'])}: inside vs across nodes",
                   ["scope", "groups", "ranks/group", "busbw min (GB/s)", "busbw median (GB/s)"], rows))
        pairs = split["send_recv"]
        slow = pairs["slowest"]
        console.print(f"send/recv to the same local rank on the next node ({pairs['pairs']} pairs, "
                      f"{human_bytes(pairs['size'])}): median {pairs['busbw_median']:.2f} GB/s; slowest pair rank "
                      f"{slow['rank']} → rank {slow['peer']} at {slow['busbw']:.2f} GB/s", soft_wrap=True)
    console.print(f"# Out of bounds values : {report.wrong} {'OK' if not report.wrong else 'FAILED'}")
    console.print(f"# Avg bus bandwidth    : {report.avg_busbw:.3f} GB/s (all ops, all sizes)")
    if report.expect_busbw is not None:
        below = {r.op for r in report.below_expectation()}
        for result in report.results:
            verdict = "[red]FAIL[/]" if result.op in below else "[green]PASS[/]"
            peak = f"{result.peak.busbw:.2f} GB/s at {human_bytes(result.peak.size)}" if result.peak else "no size ran"
            console.print(f"{verdict} {result.op}: busbw {peak} (expected ≥ {report.expect_busbw:g})")


# ---------------------------------------------------------------------------------------------------------------
# dedup


@app.command("dedup", epilog="""[bold]Examples[/]

  smolctl dedup data/sample/web demo-out/dedup/web --minhash          exact + near duplicates, all cores

  smolctl dedup crawl/ deduped/ --minhash --threshold 0.7 --keep longest --json

  smolctl dedup new-crawl/ fresh/ --minhash --against last-release/   drop what the reference already has

  smolctl dedup crawl/ out/ --minhash --stage signatures --tasks 64 --task-id $SLURM_ARRAY_TASK_ID
  (see recipes/slurm/dedup.sbatch: signatures → buckets → components → filter, chained with afterok)
""")
def dedup_command(
    input: str = typer.Argument(..., help="Dataset folder, folder of parquet files, a .parquet file or a glob."),
    output: Path = typer.Argument(..., help="Dataset folder to write: kept documents (same schema and order), "
                                  "duplicates/ (id, duplicate_of, cluster, reason, jaccard) and the manifest."),
    exact: bool = typer.Option(True, "--exact/--no-exact", help="Remove identical texts (NFKC, case-folded, "
                               "whitespace collapsed)."),
    use_minhash: bool = typer.Option(False, "--minhash", help="Also remove near duplicates (MinHash LSH, verified)."),
    threshold: Optional[float] = typer.Option(None, "--threshold", help="Jaccard of the shingle sets at or above "
                                              "which documents are duplicates [default: 0.8]."),
    num_perm: Optional[int] = typer.Option(None, "--num-perm", help="Signature length [default: 100]."),
    bands: Optional[int] = typer.Option(None, "--bands", help="LSH bands (bands x rows = num-perm) "
                                        "[default: derived from the threshold, leaning to recall]."),
    rows: Optional[int] = typer.Option(None, "--rows", help="Signature values per band."),
    ngram: Optional[int] = typer.Option(None, "--ngram", help="Shingle length in words or characters [default: 5]."),
    shingle: Optional[str] = typer.Option(None, "--shingle", help="word, or char for languages written without "
                                          "spaces [default: word]."),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Check candidates by exact Jaccard (grey zone "
                                "only); --no-verify trusts the signature estimate."),
    text_column: str = typer.Option("text", "--text-column", help="Column holding the documents."),
    id_column: Optional[str] = typer.Option(None, "--id-column", help="Column of unique ids [default: id if "
                                            "present, else shard:row]."),
    against: Optional[str] = typer.Option(None, "--against", help="Reference dataset: drop INPUT documents that "
                                          "duplicate it; the reference is never changed."),
    keep: str = typer.Option("first", "--keep", help="Survivor of each cluster: first (input order) or longest."),
    workers: Optional[int] = typer.Option(None, "--workers", min=1, help="Processes [default: the CPUs available]."),
    stage: Optional[str] = typer.Option(None, "--stage", help="Run one stage only: signatures, buckets, "
                                        "components or filter (Slurm arrays); default: all stages."),
    tasks: int = typer.Option(1, "--tasks", help="Array size for --stage (units are split round-robin)."),
    task_id: int = typer.Option(0, "--task-id", help="This task's index in 0..tasks-1 ($SLURM_ARRAY_TASK_ID)."),
    overwrite: bool = OVERWRITE_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Remove exact and near-duplicate documents; the same result on one core, many, or a Slurm array."""
    from smolctl.data.dedup import DedupConfig, run
    from smolctl.data.minhash import MinHashParams

    given = {"--threshold": threshold, "--num-perm": num_perm, "--bands": bands, "--rows": rows, "--ngram": ngram,
             "--shingle": shingle}
    if not use_minhash and any(v is not None for v in given.values()):
        flag = next(k for k, v in given.items() if v is not None)
        raise UserError(flag, "applies to near-duplicate removal only", "add --minhash")
    params = MinHashParams.for_threshold(
        0.8 if threshold is None else threshold, 100 if num_perm is None else num_perm, bands, rows,
        5 if ngram is None else ngram, shingle or "word") if use_minhash else None
    config = DedupConfig(input=input, output=str(output), exact=exact, minhash=params, verify=verify,
                         text_column=text_column, id_column=id_column, against=against, keep=keep, overwrite=overwrite)
    with progress(not json_out) as bar:
        result = run(config, stage=stage, tasks=tasks, task_id=task_id,
                     workers=workers or len(os.sched_getaffinity(0)), report=_stage_progress(bar))
    if json_out:
        emit_json(result.__dict__)
        return
    _render_dedup(result, tasks, task_id)


def _stage_progress(bar):
    """Progress callback: one bar per stage, created when the stage announces its total."""
    import time

    bars: dict[str, tuple[int, float]] = {}
    units = {"signatures": "docs", "filter": "docs", "buckets": "bands", "verify": "pairs"}

    def report(stage: str, advance: int, total: int | None = None) -> None:
        if stage not in bars:
            if not total:
                return
            bars[stage] = (bar.add_task(stage, total=total, rate=""), time.perf_counter())
        task, started = bars[stage]
        done = bar.tasks[task].completed + advance
        rate = done / max(1e-9, time.perf_counter() - started)
        bar.update(task, advance=advance, rate=f"{human_count(rate)} {units.get(stage, '')}/s")

    return report


def _render_dedup(result, tasks: int, task_id: int) -> None:
    if not result.finished:
        where = f"task {task_id} of {tasks}, " if tasks > 1 else ""
        show(key_values(f"dedup --stage {result.stage}", [
            ("units", f"{where}{result.units_done} done, {result.units_skipped} already finished (skipped)"),
            ("time", f"{result.seconds:.1f}s"),
            ("output", f"{result.output} (committed by the filter task that finishes last)")]))
        return
    removed = result.exact_removed + result.near_removed
    rate = result.documents / max(result.seconds, 1e-9)
    facts = [("documents in", f"{result.documents:,}")]
    if result.null_text:
        facts.append(("null texts", f"{result.null_text} (kept as they are, not deduplicated)"))
    facts += [("exact removed", f"{result.exact_removed:,}"),
              ("near removed", f"{result.near_removed:,}" if result.params["minhash"] else "- (no --minhash)"),
              ("kept", f"{result.kept:,} ({result.kept / max(result.documents, 1):.1%})"),
              ("clusters", f"{result.clusters} ({removed} removed, see duplicates/)")]
    if result.params["minhash"]:
        mh = result.params["minhash"]
        facts.append(("candidates", f"{result.candidate_pairs} pairs, {result.verified_pairs} by exact Jaccard "
                      f"({mh['bands']} bands x {mh['rows']} rows, threshold {mh['threshold']})"))
    facts += [("throughput", f"{human_count(rate)} docs/s, {result.bytes / max(result.seconds, 1e-9) / 1e6:.1f} MB/s"
               + (f" ({result.units_skipped} unit(s) resumed)" if result.units_skipped else "")),
              ("time", f"{result.seconds:.1f}s"), ("output", result.output)]
    show(key_values("dedup", facts))


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

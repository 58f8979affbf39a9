"""The smolctl command line: the only module that knows Typer. Each command parses its arguments, calls one
module, and renders the result (on stdout: rich tables, or one JSON object with --json; progress on stderr)."""

from __future__ import annotations

import errno
import os
import re
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Iterator, Optional

import typer
from rich.markup import escape
from typer.core import TyperCommand, TyperGroup

from smolctl import __version__
from smolctl.console import console, emit_json, error_line, human_count, key_values, progress, show, styled, table
from smolctl.errors import CheckFailed, Interrupted, UserError

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
    required arguments as `{recipe}`), no `<bool>` after a flag, `--set <str>` for a repeatable option."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.help = escape(self.help) if self.help else self.help
        for param in self.params:
            if getattr(param, "help", None):
                param.help = escape(param.help)

    def collect_usage_pieces(self, ctx):
        pieces = super().collect_usage_pieces(ctx)  # [OPTIONS], one piece per argument, a group's COMMAND
        arguments = [param for param in self.get_params(ctx) if param.param_type_name == "argument"]
        start = 1 if self.options_metavar else 0
        return pieces[:start] + [self._usage_name(param) for param in arguments] + pieces[start + len(arguments):]

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
            elif param.multiple and (label := param.display_type_rich(ctx) or "").startswith("<list["):
                param.metavar = "<" + label[len("<list["):-len("]>")] + ">"
        return params


class _Command(_ReadableHelp, TyperCommand):
    pass


class _Group(_ReadableHelp, TyperGroup):
    pass


app = typer.Typer(
    name="smolctl",
    cls=_Group,
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

  smolctl train-tokenizer 'crawl/*.parquet' tok/ --vocab-size 49152 --sample-bytes 2GB      any corpus size, one node
""")
def train_tokenizer_command(
    input: str = typer.Argument(..., help="Dataset folder, folder of parquet files, a .parquet file or a glob."),
    output: Path = typer.Argument(..., help="Tokenizer folder to write (loads with AutoTokenizer.from_pretrained)."),
    vocab_size: int = typer.Option(8192, "--vocab-size", help="Vocabulary size, special tokens included."),
    text_column: str = typer.Option("text", "--text-column", help="Column holding the documents."),
    min_frequency: int = typer.Option(2, "--min-frequency", help="Merges rarer than this are not learned."),
    sample_documents: Optional[str] = typer.Option(None, "--sample-documents", help="Train on a seeded uniform "
                                                   "sample of this many documents, e.g. 1M (streamed: any corpus size)."),
    sample_bytes: Optional[str] = typer.Option(None, "--sample-bytes", help="Train on a seeded uniform sample of "
                                               "this much text, e.g. 2GB (with --sample-documents: both limits)."),
    seed: int = typer.Option(0, "--seed", help="Seeds the sample."),
    overwrite: bool = OVERWRITE_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Train a byte-level BPE tokenizer with ChatML chat template and special tokens for document end and padding."""
    from smolctl.data.mix_schedule import parse_amount
    from smolctl.data.tokenizer import train_tokenizer

    documents = parse_amount(sample_documents, "--sample-documents") if sample_documents is not None else None
    size = parse_amount(sample_bytes, "--sample-bytes") if sample_bytes is not None else None
    with progress(not json_out) as bar:
        task = bar.add_task("reading documents", total=None, rate="", visible=False)
        result = train_tokenizer(input, str(output), vocab_size=vocab_size, text_column=text_column,
                                 min_frequency=min_frequency, overwrite=overwrite, sample_documents=documents,
                                 sample_bytes=size, seed=seed,
                                 on_start=lambda total: bar.update(task, total=total, visible=True),
                                 on_batch=lambda n: bar.advance(task, n))
    if json_out:
        emit_json(result.__dict__)
        return
    sampled = f" (sampled from {human_count(result.corpus_documents)})" if result.corpus_documents is not None else ""
    show(key_values("train-tokenizer", [
        ("output", result.output), ("vocab size", result.vocab_size),
        ("documents", human_count(result.documents) + sampled),
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


# ---------------------------------------------------------------------------------------------------------------
# pack


@app.command("pack", epilog="""[bold]Examples[/]

  smolctl pack demo-out/mix/stage-1 demo-out/packed --tokenizer demo-out/tokenizer --seq-len 256

  smolctl pack mix/ packed/ --tokenizer HuggingFaceTB/SmolLM3-3B --seq-len 4096 --workers 8

  smolctl pack 'corpus/*.parquet' packed/ --tokenizer tok/ --seq-len 2048 --strategy concat --json

  smolctl pack mix/stage-1 tokens/ --tokenizer tok/ --format datatrove      for nanotron's DatatroveFolderDataset

  smolctl pack mix/ packed/ --tokenizer tok/ --tasks 64 --task-id $SLURM_ARRAY_TASK_ID
  (one task of a Slurm array, see recipes/slurm/pack.sbatch; the same bytes as a plain run)
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
    format: str = typer.Option("safetensors", "--format", help="safetensors: packed rows for pretrain; datatrove: "
                               "nanotron/datatrove .ds token files (documents + EOS back to back, no packing)."),
    tasks: Optional[int] = typer.Option(None, "--tasks", help="Run as one task of an array of this size: input "
                                        "shards are split round-robin; the last task to finish writes OUTPUT."),
    task_id: int = typer.Option(0, "--task-id", help="This task's index in 0..tasks-1 ($SLURM_ARRAY_TASK_ID)."),
    overwrite: bool = OVERWRITE_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Tokenise documents and pack them into fixed-length rows with document-masked position ids."""
    import time

    from smolctl.data.pack import PackConfig, prepare_pack

    config = PackConfig(seq_len=seq_len, strategy=strategy, long_docs=long_docs, text_column=text_column,
                        workers=workers, buffer_tokens=buffer_tokens, shard_size=shard_size, seed=seed, format=format)
    job = prepare_pack(input, output, tokenizer_spec=tokenizer, config=config, overwrite=overwrite)
    with progress(not json_out) as bar:
        # Shown from the first batch on: a task refused before any work prints its one-line error alone.
        task = bar.add_task("packing", total=job.total_documents, rate="", visible=False)
        started, tokens = time.perf_counter(), [0]

        def advance(documents: int, new_tokens: int) -> None:
            tokens[0] += new_tokens
            rate = tokens[0] / max(1e-9, time.perf_counter() - started)
            bar.update(task, advance=documents, rate=f"{human_count(rate)} tok/s", visible=True)

        result = job.run(advance, tasks=tasks, task_id=task_id)
    if json_out:
        emit_json(result.to_dict())
        return
    if _render_array_task("pack", result, tasks, task_id):
        return
    stats = result.stats
    packed = result.format == "safetensors"
    show(key_values("pack", [
        ("output", result.output), ("tokenizer", f"{result.tokenizer['name']} ({result.tokenizer['fingerprint']})"),
        ("layout", f"{result.strategy}, long documents {result.long_docs}, seq_len {result.seq_len}"
                   if packed else "datatrove token files (.ds + .ds.index), unpacked"),
        ("documents", human_count(stats.documents)), ("tokens", human_count(stats.tokens)),
        *([("rows", human_count(stats.rows)),
           ("padding", f"{human_count(stats.padding_tokens)} tokens ({stats.padding_fraction:.3%})"),
           ("split / truncated", f"{stats.split_documents} / {stats.truncated_documents} documents "
                                 f"({human_count(stats.truncated_tokens)} tokens cut)")] if packed else []),
        ("skipped empty", stats.skipped_empty), ("shards", result.shards),
        ("time", f"{result.seconds:.1f}s ({human_count(result.tokens_per_second)} tokens/s)"),
    ]))


def _render_array_task(command: str, result, tasks: int | None, task_id: int) -> bool:
    """The summary of an array task that did not commit OUTPUT (True when it printed one)."""
    if result.already_committed:
        show(f"{command}: {result.output} is already committed by this run; nothing to do")
        return True
    if result.finished:
        return False
    units = (f"{result.units_done} done, {result.units_skipped} already finished (skipped)"
             if result.units_done + result.units_skipped else "no units for this task: nothing to do")
    show(key_values(command, [("units", f"task {task_id} of {tasks}: {units}"), ("time", f"{result.seconds:.1f}s"),
                              ("output", f"{result.output} (committed by the task that finishes the last unit)")]))
    return True


# ---------------------------------------------------------------------------------------------------------------
# Cluster validation: benchmark-nccl, stress-gpu


@contextmanager
def _resume_hint_on_interrupt(stage: str, recipe, run) -> Iterator[None]:
    """Ctrl-C in a training command: one line on what is kept and the command that continues (exit 130)."""
    try:
        yield
    except KeyboardInterrupt:
        if int(os.environ.get("RANK", "0")) != 0:  # under torchrun every rank gets the signal; rank 0 speaks
            raise typer.Exit(130) from None
        raise Interrupted(f"{run}: continue with `smolctl {stage} {recipe} {run} --resume auto` and the same "
                          "options (from the newest complete checkpoint, or afresh when there is none)") from None


def _quiet_on_other_ranks(rank: int, exc: Exception) -> None:
    """Every rank raises the same error; only rank 0 says it, the others leave with the same exit code."""
    if rank != 0:
        raise typer.Exit(exc.exit_code)
    raise exc


@app.command("benchmark-nccl", epilog="""[bold]Examples[/]

  torchrun --nproc_per_node 8 -m smolctl benchmark-nccl --expect-busbw all_reduce=350,all_to_all=40

  torchrun --nproc_per_node 2 -m smolctl benchmark-nccl --max-bytes 1M --iters 5 --warmup 1    (CPU, gloo)

  torchrun --nproc_per_node 8 -m smolctl benchmark-nccl --ops all_reduce,all_to_all --min-bytes 1M --max-bytes 8G

  sbatch --nodes 4 recipes/slurm/benchmark-nccl.sbatch    (multi-node: intra vs inter-node, slowest host and link)
""")
def benchmark_nccl_command(
    ops: str = typer.Option("all_reduce,all_gather,reduce_scatter,all_to_all,broadcast,send_recv", "--ops",
                            help="Comma-separated ops (or 'all')."),
    min_bytes: str = typer.Option("8", "--min-bytes", help="Smallest message (K/M/G = powers of 1024, as nccl-tests -b)."),
    max_bytes: Optional[str] = typer.Option(None, "--max-bytes", help="Largest message (default: 8G with NCCL, 64M with gloo)."),
    factor: float = typer.Option(2.0, "--factor", help="Size multiplier between steps (nccl-tests -f)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="bf16, fp16, fp32, fp64 or int32 (default: bf16 with NCCL, fp32 with gloo)."),
    iters: int = typer.Option(20, "--iters", help="Timed calls per size."),
    warmup: int = typer.Option(5, "--warmup", help="Untimed calls per size before timing."),
    backend: str = typer.Option("auto", "--backend", help="auto (nccl when GPUs are visible, else gloo), nccl or gloo."),
    expect_busbw: Optional[str] = typer.Option(None, "--expect-busbw", help="GB/s the busbw at the largest size must reach, per op (all_reduce=350,all_to_all=40) or one number for all; exit 1 below it."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Collective bandwidth like nccl-tests (time, algbw, busbw, #wrong per size) for every op, under torchrun."""
    from smolctl.console import human_bytes
    from smolctl.infra.collective_runner import run_benchmark
    from smolctl.infra.collectives import build_config, launch_environment

    rank = int(os.environ.get("RANK", "0"))
    try:
        config = build_config(ops=ops, min_bytes=min_bytes, max_bytes=max_bytes, factor=factor, dtype=dtype,
                              iters=iters, warmup=warmup, backend=backend, expect_busbw=expect_busbw)
        launch_environment()
        with progress(rank == 0 and not json_out) as bar:
            task = bar.add_task("benchmark-nccl", total=None, rate="")
            report = run_benchmark(config, on_plan=lambda total: bar.update(task, total=total),
                                   on_size=lambda op, size: bar.update(task, advance=1, rate=f"{op} {human_bytes(size)}"))
    except UserError as exc:
        _quiet_on_other_ranks(rank, exc)
    if rank == 0:
        emit_json(report.to_dict()) if json_out else _render_nccl(report)
    if not report.passed:
        _quiet_on_other_ranks(rank, CheckFailed(_nccl_failure(report)))


def _nccl_failure(report) -> str:
    problems = [f"{report.wrong} wrong element(s)"] if report.wrong else []
    problems += [f"{r.op} busbw {r.peak.busbw:.2f} GB/s < {report.expect_busbw[r.op]:g}" if r.peak else f"{r.op}: no size ran"
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
        facts.append((styled("[red]differs across ranks[/]"), ", ".join(topo["env_mismatch"])))
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
        show("\n".join(lines), soft_wrap=True)
    if report.multinode:
        _render_multinode(report.multinode, topo)
    show(f"# Out of bounds values : {report.wrong} {'OK' if not report.wrong else 'FAILED'}")
    show(f"# Avg bus bandwidth    : {report.avg_busbw:.3f} GB/s (all ops, all sizes)")
    below = {r.op for r in report.below_expectation()}
    for result in report.results:
        if result.op in report.expect_busbw:
            verdict = "[red]FAIL[/]" if result.op in below else "[green]PASS[/]"
            peak = f"{result.peak.busbw:.2f} GB/s at {human_bytes(result.peak.size)}" if result.peak else "no size ran"
            show(styled(f"{verdict} {result.op}: busbw {peak} (expected ≥ {report.expect_busbw[result.op]:g})"))


def _render_multinode(split: dict, topo: dict) -> None:
    from smolctl.console import human_bytes

    def gbps(value) -> str:
        return "-" if value is None else f"{value:.2f}"

    rows = [(name.replace("_", "-"), split[name]["groups"], split[name]["ranks_per_group"],
             gbps(split[name]["busbw_min"]), gbps(split[name]["busbw_median"]),
             f"{split[name]['slowest']['name']}" if split[name]["slowest"] else "-")
            for name in ("intra_node", "inter_node")]
    show(table(f"all_reduce at {human_bytes(split['size'])}: inside vs across nodes",
               ["scope", "groups", "ranks/group", "busbw min (GB/s)", "busbw median (GB/s)", "slowest"], rows))
    links = split["links"]
    if links:
        slow = links["slowest"]
        show(f"one-way transfers to the same local rank {', '.join(map(str, links['shifts']))} node(s) on "
                      f"({links['count']} links, {human_bytes(split['size'])}): median send "
                      f"{links['send_busbw_median']:.2f} GB/s, receive {links['recv_busbw_median']:.2f} GB/s; slowest "
                      f"link rank {slow['from_rank']} ({slow['from_host']}) → rank {slow['to_rank']} "
                      f"({slow['to_host']}) at {slow['busbw']:.2f} GB/s (send {slow['send_busbw']:.2f}, receive "
                      f"{slow['recv_busbw']:.2f})", soft_wrap=True)
        show("hosts by their links' median busbw, slowest first: " + ", ".join(
            f"{h['host']} {h['busbw_median']:.2f} GB/s ({h['links']} links)" for h in links["slowest_hosts"]),
            soft_wrap=True)
    ranks: dict[str, list[int]] = {}
    for rank, host in enumerate(topo["rank_hosts"]):
        ranks.setdefault(host, []).append(rank)
    show("rank → host: " + "; ".join(f"{host} {_rank_ranges(found)}" for host, found in ranks.items()),
         soft_wrap=True)


def _rank_ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 3, 8] → '0-3,8'."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)


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
                                              "which documents are duplicates (default: 0.8)."),
    num_perm: Optional[int] = typer.Option(None, "--num-perm", help="Signature length (default: 100)."),
    bands: Optional[int] = typer.Option(None, "--bands", help="LSH bands (bands x rows = num-perm) "
                                        "(default: derived from the threshold, leaning to recall)."),
    rows: Optional[int] = typer.Option(None, "--rows", help="Signature values per band."),
    ngram: Optional[int] = typer.Option(None, "--ngram", help="Shingle length in words or characters (default: 5)."),
    shingle: Optional[str] = typer.Option(None, "--shingle", help="word, or char for languages written without "
                                          "spaces (default: word)."),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Check candidates by exact Jaccard (grey zone "
                                "only); --no-verify trusts the signature estimate."),
    text_column: str = typer.Option("text", "--text-column", help="Column holding the documents."),
    id_column: Optional[str] = typer.Option(None, "--id-column", help="Column of unique ids (default: id if "
                                            "present, else shard:row)."),
    against: Optional[str] = typer.Option(None, "--against", help="Reference dataset: drop INPUT documents that "
                                          "duplicate it; the reference is never changed."),
    keep: str = typer.Option("first", "--keep", help="Survivor of each cluster: first (input order) or longest."),
    workers: Optional[int] = typer.Option(None, "--workers", min=1, help="Processes (default: the CPUs available)."),
    stage: Optional[str] = typer.Option(None, "--stage", help="Run one stage only: signatures, buckets, "
                                        "components or filter (Slurm arrays); default: all stages."),
    tasks: int = typer.Option(1, "--tasks", help="Array size for --stage (units are split round-robin)."),
    task_id: int = typer.Option(0, "--task-id", help="This task's index in 0..tasks-1 ($SLURM_ARRAY_TASK_ID)."),
    overwrite: bool = OVERWRITE_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Remove exact and near-duplicate documents; the same result on one core, many, or a Slurm array."""
    from smolctl.data.dedup import DedupConfig, run
    from smolctl.data.minhash.params import MinHashParams

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
    if result.already_committed:
        show(f"dedup: {result.output} is already committed by this run; nothing to do")
        return
    if not result.finished:
        where = f"task {task_id} of {tasks}, " if tasks > 1 else ""
        units = (f"{where}{result.units_done} done, {result.units_skipped} already finished (skipped)"
                 if result.units_done + result.units_skipped else f"{where}no units for this task: nothing to do")
        show(key_values(f"dedup --stage {result.stage}", [
            ("units", units),
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
              ("clusters", f"{result.clusters:,} ({removed:,} removed, see duplicates/)")]
    if result.params["minhash"]:
        mh = result.params["minhash"]
        facts.append(("candidates", f"{result.candidate_pairs:,} pairs, {result.verified_pairs:,} by exact Jaccard "
                      f"({mh['bands']} bands x {mh['rows']} rows, threshold {mh['threshold']})"))
    if result.stage == "all":
        facts.append(("throughput", f"{human_count(rate)} docs/s, {result.bytes / max(result.seconds, 1e-9) / 1e6:.1f} MB/s"
                      + (f" ({result.units_skipped} finished unit(s) reused)" if result.units_skipped else "")))
    facts += [("time", f"{result.seconds:.1f}s" + ("" if result.stage == "all" else f" (this {result.stage} task)")),
              ("output", result.output)]
    show(key_values("dedup", facts))


@app.command("stress-gpu", epilog="""[bold]Examples[/]

  smolctl stress-gpu                                   60 s on every GPU: bf16 8192² matmuls, all results checked

  smolctl stress-gpu --duration 10m --expect-tflops 600 --json     H100: also fail a GPU below 600 TFLOPS

  smolctl stress-gpu --duration 3s --devices cpu       the tool itself on the CPU (fp32 512²), no GPU needed
""")
def stress_gpu_command(
    duration: str = typer.Option("60", "--duration", help="Seconds, or 30s, 5m, 1h."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="bf16, fp16 or fp32 (default: bf16 on GPUs, fp32 on CPU)."),
    size: Optional[int] = typer.Option(None, "--size", help="n of the n×n matmuls (default: 8192 on GPUs, 512 on CPU)."),
    memory_fraction: float = typer.Option(0.9, "--memory-fraction", help="Share of each GPU's memory to fill and pattern-test, in (0, 1)."),
    tolerance: float = typer.Option(0.10, "--tolerance", help="A device more than this fraction slower than the best fails."),
    expect_tflops: Optional[float] = typer.Option(None, "--expect-tflops", help="Fail a device whose median TFLOPS is below this."),
    expect_gpus: Optional[int] = typer.Option(None, "--expect-gpus", help="Fail when torch sees fewer GPUs (default with --devices all: what nvidia-smi lists)."),
    devices: str = typer.Option("all", "--devices", help="all (fails when torch sees no GPU), GPU indices like 0,1, or cpu."),
    launch: str = typer.Option("auto", "--launch", help="process per device, thread, or auto (processes for GPUs)."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Burn every GPU with checked matmuls and a memory pattern test; OK/FAULTY per device like gpu-burn."""
    from smolctl.infra.stress import build_config, run_stress

    config = build_config(duration=duration, dtype=dtype, size=size, memory_fraction=memory_fraction,
                          tolerance=tolerance, devices=devices, expect_tflops=expect_tflops,
                          expect_gpus=expect_gpus, launch=launch)

    def tick(elapsed: float, reports) -> None:
        latest = " · ".join(f"{r.device} {r.tflops[-1]:.3g}" for r in reports if r.tflops)
        bar.update(task, completed=min(elapsed, config.duration_s), rate=f"TFLOPS {latest}" if latest else "setting up")

    with progress(not json_out) as bar:
        task = bar.add_task(f"stress {config.dtype} {config.size}²", total=config.duration_s, rate="")
        reports = run_stress(config, on_tick=tick)
    if json_out:
        emit_json({"config": config.__dict__, "devices": [r.to_dict() for r in reports]})
    else:
        _render_stress(config, reports)
    faulty = [r for r in reports if r.verdict != "OK"]
    if faulty:
        raise CheckFailed("stress-gpu: " + "; ".join(f"{r.device} FAULTY ({', '.join(r.reasons)})" for r in faulty))


def _render_stress(config, reports) -> None:
    from smolctl.console import human_bytes

    def number(value, fmt: str = ".3g") -> str:
        return "-" if value is None else format(value, fmt)

    rows = [(r.device, f"{number(r.tflops_min)} / {number(r.tflops_median)}", r.mismatches,
             (r.result_hash or "-")[:12], r.memory_errors,
             number(r.telemetry.get("max_temp_c"), "d"), ", ".join(r.telemetry.get("throttle") or []) or "-",
             styled("[green]OK[/]" if r.verdict == "OK" else "[red]FAULTY[/]")) for r in reports]
    names = ", ".join(dict.fromkeys(r.name for r in reports if r.name)) or "?"
    show(table(f"stress-gpu: {names}, {config.dtype} {config.size}² matmuls, {config.duration_s:g}s",
               ["device", "TFLOPS min / median", "mismatches", "product sha256", "memory errors", "max °C",
                "throttling", "result"], rows))
    for r in reports:
        show(styled(f"{r.device}: {r.matmuls} matmuls checked, {human_bytes(r.memory_tested_bytes)} pattern-tested "
                    f"in {r.pattern_passes} passes" + (f" — [red]{escape('; '.join(r.reasons))}[/]" if r.reasons else "")
                    + (f" [yellow]warning: {escape('; '.join(r.warnings))}[/]" if r.warnings else "")), soft_wrap=True)
    ok = sum(r.verdict == "OK" for r in reports)
    floor = f", below --expect-tflops {config.expect_tflops:g}" if config.expect_tflops else ""
    show(f"{ok}/{len(reports)} device(s) OK (FAULTY: any mismatch, a product differing from the other "
         f"devices', a memory error, hardware throttling, row remapping, ECC or Xid errors, a degraded "
         f"PCIe link, or median TFLOPS more than {config.tolerance:.0%} below the best device{floor})", soft_wrap=True)
    if unchecked := [r.device for r in reports if "missing" in r.telemetry]:
        show(styled(f"[yellow]telemetry missing on {escape(', '.join(unchecked))}:[/] "
                    f"{escape(str(reports[0].telemetry.get('missing', '')))}"
                    " — throttling, ECC, row remapping, Xid and PCIe were not checked"), soft_wrap=True)


# ---------------------------------------------------------------------------------------------------------------
# mix


@app.command("mix", epilog="""[bold]Examples[/]

  smolctl mix demo-out/mix --recipe recipes/demo-mix.toml --set sources.web.path=demo-out/dedup/web

  smolctl mix out/ --source web=data/sample/web:0.7 --source code=data/sample/code:0.3 --bytes 1MB

  smolctl mix out/ --source web=web/:85 --source code=code/:12 --source math=math/:3 --tokens 2B --tokenizer tok/

  smolctl mix out/ --recipe recipes/smollm3-mix.toml --set stages.0.tokens=1_000_000_000 --json

  smolctl mix out/ --recipe recipes/demo-mix.toml --stage measure --tasks 64 --task-id $SLURM_ARRAY_TASK_ID
  (then --stage write; see recipes/slurm/mix.sbatch)
""")
def mix_command(
    output: Path = typer.Argument(..., help="Dataset folder to write; with a recipe, one subfolder per stage."),
    source: Optional[list[str]] = typer.Option(None, "--source", help="NAME=PATH:WEIGHT (repeat). PATH: any dataset "
                                               "folder, parquet file or glob; weights are normalised."),
    recipe: Optional[Path] = typer.Option(None, "--recipe", help="TOML recipe with [sources.NAME] and [[stages]]."),
    overrides: Optional[list[str]] = typer.Option(None, "--set", help="Override a recipe key, e.g. sources.web.path=x."),
    tokens: Optional[str] = typer.Option(None, "--tokens", help="Budget in tokens (needs --tokenizer), e.g. 2.5M."),
    bytes_: Optional[str] = typer.Option(None, "--bytes", help="Budget in UTF-8 bytes of text, e.g. 100MB."),
    documents: Optional[str] = typer.Option(None, "--documents", help="Budget in documents, e.g. 100K."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="Weigh by tokens with this tokenizer "
                                            "(else by bytes)."),
    token_estimate: Optional[str] = typer.Option(None, "--token-estimate", metavar="auto|sample|exact", help="How "
                                                 "tokens are counted. exact: tokenize every document. sample: tokenize "
                                                 "a seeded sample of ~10,000 documents per source (recipe key "
                                                 "token_sample), calibrate its bytes per token, estimate the rest from "
                                                 "UTF-8 bytes. auto (default): sample a source of more than 100,000 "
                                                 "documents, count smaller ones exactly."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seeds sampling and shuffling (default 0)."),
    max_repeat: Optional[float] = typer.Option(None, "--max-repeat", help="How many times a source may be used "
                                               "across all stages (default 1: each document at most once)."),
    text_column: str = typer.Option("text", "--text-column", help="Column holding the documents."),
    shuffle_buffer: int = typer.Option(20_000, "--shuffle-buffer", help="Rows per shuffled block (bounds memory)."),
    stage: Optional[str] = typer.Option(None, "--stage", help="Run one pass only, as Slurm array tasks: measure "
                                        "(one unit per source shard), then write (one unit per output block)."),
    tasks: Optional[int] = typer.Option(None, "--tasks", help="Array size for --stage (units are split round-robin)."),
    task_id: int = typer.Option(0, "--task-id", help="This task's index in 0..tasks-1 ($SLURM_ARRAY_TASK_ID)."),
    overwrite: bool = OVERWRITE_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Mix document sources by weight (tokens or bytes) in stages, with repetition limits and a seeded shuffle."""
    from smolctl.data.mix import prepare_mix
    from smolctl.data.mix_schedule import schedule_from_flags, schedule_from_recipe

    if recipe is not None:
        if source:
            raise UserError("--source", "cannot be combined with --recipe", "put the sources in the recipe, or "
                            "override their paths with --set sources.NAME.path=PATH")
        if tokens or bytes_ or documents:
            raise UserError("--tokens/--bytes/--documents", "budgets of a recipe live in its stages",
                            "override them with --set stages.0.tokens=N")
        import json

        # Options given with a recipe override its keys; json.dumps writes a valid TOML string or number.
        extra = [f"{key}={json.dumps(value)}"
                 for key, value in (("seed", seed), ("max_repeat", max_repeat), ("tokenizer", tokenizer),
                                    ("token_estimate", token_estimate),
                                    ("shuffle_buffer", shuffle_buffer if shuffle_buffer != 20_000 else None),
                                    ("text_column", text_column if text_column != "text" else None))
                 if value is not None]
        plan = schedule_from_recipe(recipe, [*(overrides or []), *extra])
    else:
        if overrides:
            raise UserError("--set", "overrides a recipe", "pass --recipe, or set options directly")
        plan = schedule_from_flags(source or [], tokens=tokens, bytes_=bytes_, documents=documents, tokenizer=tokenizer,
                               seed=seed or 0, max_repeat=1.0 if max_repeat is None else max_repeat,
                               text_column=text_column, shuffle_buffer=shuffle_buffer,
                               token_estimate=token_estimate or "auto")
    job = prepare_mix(plan, output, overwrite=overwrite)
    with progress(not json_out) as bar:
        measuring = bar.add_task(f"measuring sources ({plan.unit})", total=job.total_rows, rate="", visible=False)

        def stage_task(name: str, rows: int):
            task = bar.add_task(f"writing {name}", total=rows, rate="")
            return lambda n: bar.advance(task, n)

        result = job.run(on_measure=lambda n: bar.update(measuring, advance=n, visible=True), on_stage=stage_task,
                         stage=stage, tasks=tasks, task_id=task_id)
    if json_out:
        emit_json(result.to_dict())
        return
    if _render_array_task(f"mix --stage {stage}" if stage else "mix", result, tasks or 1, task_id):
        return
    for report in result.stages:
        show(table(f"{report.name} → {report.path}  ({human_count(report.units)} {report.unit}, "
                   f"{human_count(report.documents)} documents)",
                   ["source", "target weight", "achieved", report.unit, "documents", "repeat", "repeat so far"],
                   ([s.name, f"{s.start_weight:.3f}→{s.end_weight:.3f} (mean {s.target_weight:.3f})" if s.start_weight != s.end_weight
                     else f"{s.target_weight:.3f}", f"{s.achieved_weight:.3f}", human_count(s.units),
                     human_count(s.documents), f"{s.repeat:.2f}x", f"{s.cumulative_repeat:.2f}x"]
                    for s in report.sources)))
    for name, estimate in (result.token_estimates or {}).items():
        if estimate["mode"] == "sample":
            show(f"{name}: tokens estimated at {estimate['bytes_per_token']:.3f} bytes/token, calibrated on "
                 f"{estimate['sample_documents']:,} sampled documents (split-half error {estimate['holdout_error'] or 0:.2%})")
    show(styled(f"weights are fractions of [bold]{result.unit}[/]"
                + ("" if result.unit == "tokens" else " (pass --tokenizer to weigh by tokens)")
                + f"; seed {result.seed}, max repeat {result.max_repeat:g}; {result.seconds:.1f}s"))


# ---------------------------------------------------------------------------------------------------------------
# Training: pretrain, midtrain, sft, dpo, ppo, grpo share these options, the recipe schema and the run layout

RecipeArg = Annotated[Path, typer.Argument(metavar="RECIPE", help="TOML recipe: [model] [data] [optimizer] [schedule] "
                                           "[training] ... (one schema for every training command: README, \"One recipe schema\").",
                                           show_default=False)]
RunArg = Annotated[Optional[Path], typer.Argument(metavar="[RUN]", help="Run folder: run.json, metrics.jsonl, events.jsonl, "
                                                  "checkpoints/step-N/, final/ (the HF model).", show_default=False)]
FromOpt = Annotated[Optional[str], typer.Option("--from", metavar="PATH", help="Starting checkpoint: a model folder or a run folder "
                                                "(its final/); overrides the recipe's model.from.")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", metavar="KEY=VALUE", help="Override a recipe key, e.g. --set "
                                                     "training.steps=200 (repeatable; values are TOML).")]
ResumeOpt = Annotated[str, typer.Option("--resume", metavar="auto|none|PATH", help="auto: continue from the newest checkpoint in "
                                        "RUN/checkpoints (a no-op when the run finished, a fresh start when there is "
                                        "none); none: start fresh; or a RUN/checkpoints/step-N folder.")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Delete RUN first if it already holds a run.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object with the result on stdout.")]


def _require_run(run: Optional[Path], stage: str, recipe: Path) -> Path:
    if run is None:
        raise UserError("RUN", "is required to train", f"e.g. smolctl {stage} {recipe} runs/my-run")
    return run


def _post_train(stage: str, run_stage, recipe: Path, run: Optional[Path], from_: Optional[str],
                overrides: Optional[list[str]], resume: str, overwrite: bool, json_out: bool) -> None:
    """Shared by sft, dpo, ppo and grpo: validate the recipe, train with a live bar, print the summary."""
    from contextlib import ExitStack

    from smolctl.console import human_duration
    from smolctl.train.config import load_command_recipe

    rank = int(os.environ.get("RANK", "0"))
    try:
        config = load_command_recipe(stage, recipe, overrides or [])
        with ExitStack() as stack:
            live: dict = {}

            def on_step(step: int, total: int, metrics: dict) -> None:
                # The bar opens at the first step, so that an input error is one line with no bar above it.
                if not live:
                    live["bar"] = stack.enter_context(progress(not json_out))
                    live["task"] = live["bar"].add_task(stage, total=total, rate="")
                shown = [f"{label} {metrics[key]:.4g}" for key, label in (
                    ("loss", "loss"), ("reward", "reward"), ("rewards/accuracies", "acc"), ("kl", "kl")) if key in metrics]
                live["bar"].update(live["task"], completed=step, total=total, rate="  ".join(shown))

            with _resume_hint_on_interrupt(stage, recipe, run or "RUN"):
                result = run_stage(config, _require_run(run, stage, recipe), start=from_, resume=resume,
                                   overwrite=overwrite, on_step=on_step)
    except (UserError, CheckFailed, Interrupted) as exc:
        _quiet_on_other_ranks(rank, exc)  # under torchrun every rank refuses; rank 0 says it once
    if rank != 0:
        return
    if json_out:
        emit_json(result.__dict__)
        return
    if result.nothing_to_do:
        console.print(f"nothing to do: {result.run} finished at step {result.steps}; {result.final} is unchanged "
                      "(raise training.steps to train longer)")
    facts = [("model", result.final), ("from", result.parent), ("steps", result.steps),
             ("time", human_duration(result.seconds))]
    if result.parameters:
        share = result.parameters["trainable"] / max(1, result.parameters["total"])
        facts.append(("parameters", f"{human_count(result.parameters['trainable'])} trainable of "
                                    f"{human_count(result.parameters['total'])} ({share:.2%})"))
    if result.adapter:
        facts.append(("adapter", f"{result.adapter} (final/ holds it merged)"))
    if result.resumed_from:
        facts.append(("resumed from", result.resumed_from))
    facts += [(key, f"{value:.4g}" if isinstance(value, float) else value) for key, value in result.metrics.items()]
    facts += [(key, ", ".join(f"{k} {v}" for k, v in value.items()) if isinstance(value, dict) else value)
              for key, value in result.data.items()]
    facts.append(("metrics", str(Path(result.run) / "metrics.jsonl")))
    show(key_values(f"{result.stage} → {result.run}", facts))


@app.command("sft", epilog="""[bold]Examples[/]

  smolctl sft recipes/sft-tiny.toml demo-out/sft --from demo-out/pretrain/final

  smolctl sft recipes/smollm3-sft.toml runs/sft --from runs/midtrain --resume auto

  smolctl sft recipes/sft-tiny.toml out/ --from ckpt/ --set sft.packing=padding_free --set training.steps=10

  smolctl sft recipes/sft-lora-tiny.toml demo-out/sft-lora --from demo-out/midtrain     (LoRA: [peft] table)

  torchrun --nproc_per_node 8 -m smolctl sft recipes/smollm3-sft.toml runs/sft --from runs/midtrain
""")
def sft_command(recipe: RecipeArg, run: RunArg = None, from_: FromOpt = None, set_: SetOpt = None,
                resume: ResumeOpt = "none", overwrite: OverwriteOpt = False, json_out: JsonOpt = False) -> None:
    """Supervised fine-tuning on chat data with TRL's SFTTrainer: assistant-only loss, BFD packing or padding-free,
    task-balanced sampling, LoRA adapters through peft."""
    from smolctl.train.posttrain import run_sft

    _post_train("sft", run_sft, recipe, run, from_, set_, resume, overwrite, json_out)


@app.command("dpo", epilog="""[bold]Examples[/]

  smolctl dpo recipes/dpo-tiny.toml demo-out/dpo --from demo-out/sft

  smolctl dpo recipes/smollm3-dpo.toml runs/apo --from runs/sft --set dpo.loss_type=apo_zero --set dpo.beta=0.05

  smolctl dpo recipes/dpo-tiny.toml demo-out/dpo --from demo-out/sft --resume auto --json
""")
def dpo_command(recipe: RecipeArg, run: RunArg = None, from_: FromOpt = None, set_: SetOpt = None,
                resume: ResumeOpt = "none", overwrite: OverwriteOpt = False, json_out: JsonOpt = False) -> None:
    """Preference optimisation (DPO, APO-zero, IPO, ...) with TRL's DPOTrainer against the starting checkpoint as
    reference; reports reward accuracy and margins."""
    from smolctl.train.posttrain import run_dpo

    _post_train("dpo", run_dpo, recipe, run, from_, set_, resume, overwrite, json_out)


@app.command("ppo", epilog="""[bold]Examples[/]

  smolctl ppo recipes/ppo-tiny.toml demo-out/ppo --from demo-out/dpo

  smolctl ppo recipes/smollm3-ppo.toml runs/ppo --from runs/apo --resume auto

  torchrun --nproc_per_node 8 -m smolctl ppo recipes/smollm3-ppo.toml runs/ppo --from runs/apo
""")
def ppo_command(recipe: RecipeArg, run: RunArg = None, from_: FromOpt = None, set_: SetOpt = None,
                resume: ResumeOpt = "none", overwrite: OverwriteOpt = False, json_out: JsonOpt = False) -> None:
    """PPO on composable rewards (task match, length penalty, n-gram diversity): value head, KL to the reference,
    GAE, clipped losses; data-parallel under torchrun (each process generates its share of ppo.batch_size)."""
    from smolctl.train.ppo import run_ppo

    _post_train("ppo", run_ppo, recipe, run, from_, set_, resume, overwrite, json_out)


@app.command("grpo", epilog="""[bold]Examples[/]

  smolctl grpo recipes/grpo-tiny.toml demo-out/grpo --from demo-out/dpo

  torchrun --nproc_per_node 8 -m smolctl grpo recipes/smollm3-grpo.toml runs/grpo --from runs/apo
""")
def grpo_command(recipe: RecipeArg, run: RunArg = None, from_: FromOpt = None, set_: SetOpt = None,
                 resume: ResumeOpt = "none", overwrite: OverwriteOpt = False, json_out: JsonOpt = False) -> None:
    """GRPO with TRL's GRPOTrainer on the same rewards as ppo: groups of completions per prompt, rewards
    normalised within each group, no value model."""
    from smolctl.train.grpo import run_grpo

    _post_train("grpo", run_grpo, recipe, run, from_, set_, resume, overwrite, json_out)


@app.command("generate", epilog="""[bold]Examples[/]

  smolctl generate data/sample/prompts demo-out/completions --model demo-out/sft --num-completions 2

  smolctl generate data/sample/prompts demo-out/pairs --pairs --chosen demo-out/dpo --rejected demo-out/sft

  smolctl generate data/sample/prompts demo-out/ranked --model demo-out/sft -k 4 --rank-by recipes/ppo-tiny.toml

  smolctl generate prompts/ runs/synthetic --model runs/sft --max-new-tokens 1024 --backend vllm --json
""")
def generate_command(
    prompts: str = typer.Argument(..., help="Dataset folder (or parquet file/glob) with a column of prompt strings."),
    output: Path = typer.Argument(..., help="Dataset folder to write (a rerun of a killed run continues it)."),
    model: Optional[str] = typer.Option(None, "--model", help="Model or run folder to sample (not with --pairs)."),
    pairs: bool = typer.Option(False, "--pairs", help="Preference pairs: --chosen's answer vs --rejected's."),
    chosen: Optional[str] = typer.Option(None, "--chosen", help="--pairs: the strong model (its answers are chosen)."),
    rejected: Optional[str] = typer.Option(None, "--rejected", help="--pairs: the weak model (answers rejected)."),
    rank_by: Optional[Path] = typer.Option(None, "--rank-by", help="Recipe whose [[rewards]] tables (as ppo/grpo "
                                           "use) rank K completions: best chosen, worst rejected."),
    num_completions: int = typer.Option(1, "--num-completions", "-k", help="Completions per prompt."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Most tokens sampled per completion."),
    temperature: float = typer.Option(0.6, "--temperature", help="0 is greedy (SmolLM3 suggests 0.6)."),
    top_p: float = typer.Option(0.95, "--top-p", help="Nucleus sampling mass (SmolLM3 suggests 0.95)."),
    seed: int = typer.Option(0, "--seed", help="Seeds the sampling of every batch."),
    prompt_column: str = typer.Option("prompt", "--prompt-column", help="Column holding the prompts."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Use only the first N prompts."),
    batch_size: int = typer.Option(16, "--batch-size", help="Prompts per generate call."),
    shard_prompts: int = typer.Option(256, "--shard-prompts", help="Prompts per output shard (a killed run "
                                      "resumes from the last whole shard)."),
    backend: str = typer.Option("auto", "--backend", help="auto (vLLM when installed and on a GPU), transformers "
                                "or vllm."),
    overwrite: bool = OVERWRITE_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Sample a model on prompts (chat template applied): completions for SFT data, or preference pairs for dpo
    from a strong and a weak model or from K completions ranked by rewards."""
    from smolctl.train.generate import GenerateJob, Sampling, run_generate

    if pairs:
        if model or not (chosen and rejected):
            raise UserError("--pairs", "takes --chosen STRONG and --rejected WEAK (and no --model)",
                            "e.g. --pairs --chosen runs/dpo --rejected runs/sft")
        if rank_by:
            raise UserError("--rank-by", "ranks K completions of one --model, not --pairs", "use one of the two")
        models, mode = [chosen, rejected], "pairs"
    else:
        if chosen or rejected:
            raise UserError("--chosen/--rejected", "are the two models of --pairs", "add --pairs, or use --model")
        if not model:
            raise UserError("--model", "no model to sample", "pass --model PATH (a model folder or a run folder)")
        models, mode = [model], "ranked" if rank_by else "completions"
    reward, reference_column = None, "reference"
    if rank_by:
        from smolctl.train.rewards import load_reward_tables

        reward, reference_column = load_reward_tables(rank_by)
    job = GenerateJob(prompts=prompts, output=output, models=[Path(m) for m in models], mode=mode,
                      sampling=Sampling(num_completions=num_completions, max_new_tokens=max_new_tokens,
                                        temperature=temperature, top_p=top_p, seed=seed),
                      prompt_column=prompt_column, limit=limit, batch_size=batch_size, shard_prompts=shard_prompts,
                      backend=backend, reward=reward, reward_recipe=str(rank_by) if rank_by else None,
                      reference_column=reference_column, overwrite=overwrite)
    with progress(not json_out) as bar:
        task = bar.add_task(f"generating ({mode})", total=None, rate="", visible=False)

        def on_progress(done: int, total: int, rate: float) -> None:
            bar.update(task, completed=done, total=total, visible=True, rate=f"{human_count(rate)} tok/s")

        result = run_generate(job, on_progress=on_progress)
    if json_out:
        emit_json(result.to_dict())
        return
    facts = [("mode", result.mode), ("models", ", ".join(result.models)), ("backend", result.backend),
             ("prompts", result.prompts), ("rows", result.rows), ("shards", result.shards),
             ("tokens sampled", f"{human_count(result.completion_tokens)} ({result.tokens_per_second:.0f} tok/s)")]
    if result.resumed_shards:
        facts.append(("resumed", f"{result.resumed_shards} shards were already done"))
    if result.mode == "ranked":
        facts.append(("dropped (all K tied)", result.dropped_tied))
    show(key_values(f"generate → {result.output}", facts))


@app.command("merge", epilog="""[bold]Examples[/]

  smolctl merge recipes/smollm3-merge.toml runs/merged

  smolctl merge --method linear --model demo-out/dpo:0.9 --model demo-out/midtrain:0.1 demo-out/merged

  smolctl merge --method linear --model runs/apo-a --model runs/apo-b --model runs/apo-c runs/soup

  smolctl merge --method slerp --model runs/a --model runs/b --set options.t=0.3 runs/slerp
""")
def merge_command(
    arguments: list[str] = typer.Argument(..., help="[RECIPE] OUTPUT: a TOML recipe (method, models, options) "
                                          "and the model folder to write; OUTPUT alone with --method/--model.",
                                          metavar="[RECIPE] OUTPUT"),
    method: Optional[str] = typer.Option(None, "--method", help="linear, slerp, ties or dare_ties (without a "
                                         "recipe)."),
    model: Optional[list[str]] = typer.Option(None, "--model", help="PATH[:WEIGHT] (repeat): a model folder or "
                                              "a run folder (its final/). Linear without weights: a model soup."),
    base: Optional[str] = typer.Option(None, "--base", help="ties, dare_ties: the model task vectors are taken "
                                       "against."),
    overrides: Optional[list[str]] = typer.Option(None, "--set", help="Set a recipe key, e.g. options.t=0.3 "
                                                  "or dtype=bfloat16 (repeat)."),
    overwrite: bool = OVERWRITE_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Merge checkpoints in weight space with MergeKit (linear, model soups, SLERP, TIES, DARE-TIES) into a model
    folder whose lineage lists every parent."""
    from smolctl.train.merge import load_merge_recipe, run_merge

    if len(arguments) > 2:
        raise UserError("merge", f"takes [RECIPE] OUTPUT, got {len(arguments)} arguments",
                        "pass the models with --model, or list them in the recipe")
    recipe_path, output = (arguments[0], arguments[1]) if len(arguments) == 2 else (None, arguments[0])
    recipe, where = load_merge_recipe(recipe_path, overrides or [], method, model or [], base)
    with console.status(f"merging {len(recipe.models)} model entries ({recipe.method})", spinner="dots"):
        result = run_merge(recipe, output, where=where, overwrite=overwrite)
    if json_out:
        emit_json(result.__dict__)
        return
    show(table(f"merge ({result.method}) → {result.output}  ({human_count(result.parameters)} parameters, "
               f"{result.seconds:.1f}s)", ["parent", "weight", "density"],
               ([p["path"], "" if p["weight"] is None else f"{p['weight']:.4g}",
                 "" if p["density"] is None else f"{p['density']:.3g}"] for p in result.parents)))
    if result.base:
        show(f"base: {result.base}")


# ---------------------------------------------------------------------------------------------------------------
# pretrain, midtrain

DataOpt = Annotated[list[str], typer.Option("--data", metavar="PACKED", help="Packed folder(s) to train on, replacing the recipe's "
                                            "[data] paths/stages (repeatable).")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Validate, print the resolved recipe, parameter count and "
                                         "a memory/time estimate; build the model on the meta device; train nothing.")]
WorldSizeOpt = Annotated[Optional[int], typer.Option("--world-size", metavar="N", help="--dry-run only: plan for this many "
                                                     "processes (default: WORLD_SIZE or 1).")]
GpuOpt = Annotated[str, typer.Option("--gpu", metavar="GPU", help="--dry-run only: the GPU whose memory the plan must fit "
                                     "(h100, h200, a100-80, ... as in `smolctl estimate`).")]


@app.command("pretrain", epilog="""[bold]Examples[/]

  smolctl pretrain recipes/smollm3-tiny.toml demo-out/pretrain --data demo-out/packed

  smolctl pretrain recipes/smollm3.toml --dry-run --world-size 384

  torchrun --nproc_per_node 8 -m smolctl pretrain recipes/smollm3.toml runs/3b --resume auto

  smolctl pretrain recipes/smollm3-tiny.toml runs/t --data demo-out/packed --set training.steps=50 --set optimizer.lr=1e-3 --json
""")
def pretrain_command(recipe: RecipeArg, run: RunArg = None, data: DataOpt = [], set_: SetOpt = None,
                     resume: ResumeOpt = "none", dry_run: DryRunOpt = False, world_size: WorldSizeOpt = None, gpu: GpuOpt = "h100",
                     overwrite: OverwriteOpt = False, json_out: JsonOpt = False) -> None:
    """Pretrain a causal LM from a recipe on packed folders: resumable bit for bit, guarded, single process or torchrun."""
    _train_command("pretrain", recipe, run, data=data, overrides=set_ or [], resume=resume, dry_run=dry_run,
                   world_size=world_size, gpu=gpu, overwrite=overwrite, json_out=json_out)


@app.command("midtrain", epilog="""[bold]Examples[/]

  smolctl midtrain recipes/smollm3-tiny-midtrain.toml demo-out/midtrain --from demo-out/pretrain/final --data demo-out/packed-long

  smolctl midtrain recipes/smollm3-tiny-midtrain.toml runs/m --from runs/t/checkpoints/step-0000200 --keep-optimizer
""")
def midtrain_command(recipe: RecipeArg, run: RunArg = None, from_: FromOpt = None,
                     keep_optimizer: bool = typer.Option(False, "--keep-optimizer", help="Carry the AdamW state over "
                                                         "(needs a checkpoints/step-N folder)."),
                     data: DataOpt = [], set_: SetOpt = None, resume: ResumeOpt = "none", dry_run: DryRunOpt = False,
                     world_size: WorldSizeOpt = None, gpu: GpuOpt = "h100", overwrite: OverwriteOpt = False, json_out: JsonOpt = False) -> None:
    """Continue pretraining from a checkpoint: annealing or long-context extension, recorded as the parent in the manifest."""
    _train_command("midtrain", recipe, run, data=data, overrides=set_ or [], resume=resume, dry_run=dry_run,
                   world_size=world_size, gpu=gpu, overwrite=overwrite, json_out=json_out, init_from=from_,
                   keep_optimizer=keep_optimizer)


@app.command("export", epilog="""[bold]Examples[/]

  smolctl export runs/3b/checkpoints/step-0020000 runs/3b-step20k

  smolctl export runs/t/checkpoints/step-0000200 /tmp/t-200 --overwrite --json
""")
def export_command(
    checkpoint: Path = typer.Argument(..., help="A complete training checkpoint: RUN/checkpoints/step-NNNNNNN."),
    out: Path = typer.Argument(..., help="Output Hugging Face folder (config, tokenizer, safetensors, manifest)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT if it already holds files."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Turn a sharded checkpoint into a Hugging Face folder on CPU, tensor group by tensor group (any model size)."""
    from smolctl.train.checkpoint import export_checkpoint

    manifest = export_checkpoint(checkpoint, out, overwrite=overwrite)
    if json_out:
        emit_json({"output": str(out), "checkpoint": str(checkpoint), "step": manifest.get("step"),
                   "shards": [s["name"] for s in manifest["shards"]], "bytes": sum(s["bytes"] for s in manifest["shards"])})
        return
    show(key_values(f"export {out}", [
        ("from", f"{checkpoint} (step {manifest.get('step')})"),
        ("weights", f"{len(manifest['shards'])} safetensors file(s), {sum(s['bytes'] for s in manifest['shards']):,} bytes"),
        ("load", f"AutoModelForCausalLM.from_pretrained({str(out)!r})"),
    ]))


def _train_command(stage: str, recipe: Path, run: Path | None, *, data, overrides, resume: str, dry_run: bool,
                   world_size: int | None, overwrite: bool, json_out: bool, init_from: str | None = None,
                   keep_optimizer: bool = False, gpu: str = "h100") -> None:
    from smolctl.train.distributed import world_size_from_env
    from smolctl.train.pretrain import load_train_recipe, train

    rank = int(os.environ.get("RANK", "0"))
    try:
        if dry_run:
            from smolctl.train.dryrun import dry_run as plan_run

            result = plan_run(load_train_recipe(recipe, overrides, data, stage), world_size=world_size or world_size_from_env(), gpu=gpu)
            emit_json(result) if json_out else _render_dry_run(recipe, result)
            return
        with _resume_hint_on_interrupt(stage, recipe, run):
            outcome = train(recipe, _require_run(run, stage, recipe), overrides=overrides, data=data, stage=stage,
                            resume=resume, overwrite=overwrite, init_from=init_from, keep_optimizer=keep_optimizer,
                            show=not json_out and rank == 0)
    except (UserError, CheckFailed, Interrupted) as exc:
        _quiet_on_other_ranks(rank, exc)
    if rank == 0:
        emit_json(outcome.__dict__) if json_out else _render_train(outcome)
    if outcome.preempted:
        from smolctl.train.pretrain import PREEMPTED_EXIT

        raise typer.Exit(PREEMPTED_EXIT)  # recipes/slurm/pretrain.sbatch requeues the job on this code


def _render_dry_run(recipe: Path, r: dict) -> None:
    from smolctl.console import human_bytes

    model, training = r["recipe"]["model"], r["recipe"]["training"]
    mem, layout = r["memory"], r["layout"]
    fsdp = layout["dp_shard"] > 1
    rows = [
        ("model", f"{model['architecture']}: {model['num_hidden_layers']} layers, hidden {model['hidden_size']}, "
                  f"FFN {model['intermediate_size']}, {model['num_attention_heads']} heads / {model['num_key_value_heads'] or model['num_attention_heads']} KV, "
                  f"vocab {r['vocab_size']:,}, rope θ {model['rope_theta']:g}"),
        ("parameters", f"{human_count(r['parameters'])} ({r['parameters']:,}; {human_count(r['non_embedding_parameters'])} non-embedding)"),
        ("layout", f"world {r['world_size']} = tp {layout['tp']} × dp {r['data_parallel']} (dp_replicate {layout['dp_replicate']} × "
                   f"dp_shard {layout['dp_shard']}){'; FSDP2 over dp' if fsdp else ''}"),
        ("batch", f"{r['global_batch']} sequences × {training['seq_len']} = {r['tokens_per_step']:,} tokens/step; micro batch "
                  f"{r['micro_batch']} × dp {r['data_parallel']} × accumulation {r['grad_accum']}"),
        ("budget", f"{r['steps']:,} steps = {human_count(r['total_tokens'])} tokens, {r['total_flops']:.3g} FLOPs "
                   f"({r['flops_per_token']:.3g} per token)"),
        ("memory / GPU", f"{human_bytes(mem['total'])} of {human_bytes(mem['capacity'])} on {mem['gpu']}: "
                         f"{'fits' if mem['fits'] else 'does NOT fit'} ({human_bytes(mem['activations'])} activations, "
                         f"checkpointing {training['activation_checkpointing']}; same model as `smolctl estimate`)"),
        ("time", f"{r['estimate']['gpu_hours']:,.0f} {r['estimate']['gpu']} GPU-hours at {r['estimate']['assumed_mfu']:.0%} MFU"
                 f" = {r['estimate']['days']:,.1f} days on {r['world_size']}"),
    ]
    if "would_fit" in r:
        options = [f"micro_batch {r['would_fit']['largest_micro_batch']}"] if r["would_fit"]["largest_micro_batch"] else []
        options += [", ".join(f"{k} = {str(v).lower()}" for k, v in o.items() if k != "total") + f" ({human_bytes(o['total'])})"
                    for o in r["would_fit"]["layouts"]]
        rows.append(("would fit", "\n".join(options) or "nothing on this many GPUs: add GPUs or pick a larger one (--gpu)"))
    show(key_values(f"{recipe} (dry run: nothing trained, model built on the meta device)", rows))
    show(table("data", ["folder", "status"], r["data"].items(), justify="left"))
    show(styled("resolved recipe: [bold]--json[/] prints it in full"))


def _render_train(r) -> None:
    from smolctl.train.monitor import flops_text

    from smolctl.train.monitor import CHECKPOINT_BUDGET_S_PER_1000_STEPS

    if r.nothing_to_do:
        console.print(f"nothing to do: {r.run} finished at step {r.steps:,}; {r.final} left as it was")
    elif r.preempted:
        console.print(f"[yellow]{r.preempted}[/]: stopped after saving step {r.steps:,}; continue with --resume auto")
    speed = r.speed
    rate = f"{human_count(speed['tokens_per_s'])} tokens/s, " + (
        f"MFU {speed['mfu']:.1%}" if speed["mfu"] is not None else f"{flops_text(speed['flops_per_s'])} (no MFU: no known peak)")
    loss = f"{r.first_loss:.4f} → {r.final_loss:.4f}" if r.first_loss is not None else "-"
    show(key_values(f"{r.stage} {r.run}", [
        ("final model", f"{r.final}  (AutoModelForCausalLM.from_pretrained loads it; next stage: --from)"),
        ("steps", f"{r.steps:,} ({speed['steps_run']:,} run now{', resumed from ' + r.resumed_from if r.resumed_from else ''})"),
        ("tokens seen", human_count(r.tokens_seen)), ("parameters", human_count(r.parameters)),
        ("loss", loss + (f"  (validation {r.val_loss:.4f})" if r.val_loss is not None else "")),
        ("batch", f"{r.plan['global_batch']} seq × {r.plan['seq_len']} = {r.plan['tokens_per_step']:,} tokens/step "
                  f"(micro {r.plan['micro_batch']} × world {r.plan['world_size']} × accumulation {r.plan['grad_accum']})"),
        ("speed", f"{rate}; data wait {speed['data_wait']:.2%} of step time"),
        ("checkpoint cost", f"{speed['checkpoints_saved']} saves, {speed['checkpoint_s_each']:.2f} s blocking each, "
                            f"{speed['checkpoint_share']:.2%} of wall time, {speed['checkpoint_s_per_1000_steps']:.0f} s per 1,000 steps "
                            f"(yardstick < {CHECKPOINT_BUDGET_S_PER_1000_STEPS:.0f})"),
        ("guards", f"{r.skipped_steps} skipped (non-finite), {r.spikes} spikes, {r.rollbacks} rollbacks"
                   + (f" — see {r.run}/events.jsonl" if r.events else "")),
        ("parent", r.parent or "-"), ("checkpoints", "\n".join(r.checkpoints) or "-"),
    ]))


@app.command("report", epilog="""[bold]Examples[/]

  smolctl report demo-out/pretrain

  smolctl report runs/lr-3e-3 runs/lr-1e-3 --html compare.html

  smolctl report demo-out/sft --json
""")
def report_command(
    runs: list[Path] = typer.Argument(..., help="Run folders of any training command (they hold metrics.jsonl)."),
    html: Optional[Path] = typer.Option(None, "--html", help="Also write one self-contained HTML file (plots inline, no network)."),
    json_out: bool = JSON_OPTION,
) -> None:
    """A run in the playbook's terms: loss/lr/grad-norm/throughput plots, KPIs against targets, and a diagnosis."""
    from smolctl.train.report import build_reports

    reports = build_reports(runs)
    if html is not None:
        from smolctl.shards import atomic_write_bytes
        from smolctl.train.report_views import html_report

        atomic_write_bytes(html, html_report(reports).encode())
    if json_out:
        emit_json({"runs": [r.to_dict() for r in reports], "html": str(html) if html else None})
    else:
        _render_report(reports, html)


def _render_report(reports, html_path: Path | None) -> None:
    from smolctl.train.report_views import legend, plotted_metrics, rows_text, text_plot, when

    colors = {"pass": "green", "warn": "yellow", "n/a": "dim"}
    for report in reports:
        s = report.summary
        loss = f"{s['first_loss']:.4f} → {s['last_loss']:.4f} (min {s['min_loss']:.4f})" if s["first_loss"] is not None else "-"
        show(key_values(f"{report.stage} {report.run}", [
            ("steps", f"{s['steps']:,}" + (f" on {s['world_size']} process{'es' if s['world_size'] > 1 else ''}"
                                            if s["world_size"] else "")),
            ("loss", loss + (f"  (validation {s['val_loss']:.4f})" if s["val_loss"] is not None else "")),
            ("tokens/s", human_count(s["tokens_per_s"]) + " (median)" if s["tokens_per_s"] is not None else "-"),
            ("guards", f"{s['skipped']} skipped, {s['spikes']} spikes, {s['rollbacks']} rollbacks"),
        ]))
    if len(reports) > 1:
        show(styled(legend(reports)))
    for metric in plotted_metrics(reports):
        show(styled(text_plot(reports, metric, width=min(72, max(32, console.width - 16)))))
    for report in reports:
        show(table(f"KPIs · {report.run}", ["KPI", "target", "value", "status", "what to do"],
                   [(k.name, k.target, k.shown, styled(f"[{colors[k.status]}]{k.status}[/]"), k.advice) for k in report.kpis],
                   justify="left"))
        if report.findings:
            show(table(f"diagnosis · {report.run}", ["what", "when", "detail", "likely cause", "what to do"],
                       [(f.kind, when(f), f.detail + (f"\n{rows_text(f.rows)}" if f.rows else ""), f.cause, f.remedy)
                        for f in report.findings], justify="left"))
        else:
            show(styled(f"diagnosis · {escape(report.run)}: [green]no spike, drift, plateau, slowdown or guard event[/]"))
    if html_path is not None:
        show(f"HTML report: {html_path}")


# ---------------------------------------------------------------------------------------------------------------
# estimate


@app.command("estimate", epilog="""[bold]Examples[/]

  smolctl estimate recipes/smollm3.toml --gpus 384 --tp 2 --tokens 11.2T     the published SmolLM3 run

  smolctl estimate --model smollm3-3b --seq-len 4096 --micro-batch 3 --gpus 384 --gpu h100 --tp 2 --zero 1
  --tokens 11.2T --mfu 0.30 --price-per-gpu-hour 2.5

  smolctl estimate --model llama3-8b --gpus 64 --gpu a100-80 --tokens 1T --find     what fits: layouts, micro batch

  smolctl estimate --model llama3-405b --gpus 16384 --tp 8 --pp 16 --zero 1 --seq-len 8192 --recompute full
  --global-batch-tokens 16777216 --tokens 15.6T --mfu 0.38          Llama 3 405B: ~33M GPU-hours (Meta: 30.84M)

  smolctl estimate --model smollm3-3b --inference --context 8192 --batch 8 --compare-attention     serving memory

  smolctl estimate recipes/smollm3-tiny.toml --validate                       estimate vs measured, side by side

  smolctl estimate path/to/model-folder --tokens 1T --target-days 14 --json     any HF config
""")
def estimate_command(
    recipe: Optional[str] = typer.Argument(None, help="A pretrain recipe (.toml), or a model as --model takes it."),
    model: Optional[str] = typer.Option(None, "--model", help="Preset (smollm3-3b, llama3-8b, ...) or a config.json / model folder."),
    overrides: Optional[list[str]] = typer.Option(None, "--set", help="Override a recipe key, e.g. model.vocab_size=49152."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens per sequence (default: the recipe's, else 4096)."),
    micro_batch: Optional[int] = typer.Option(None, "--micro-batch", help="Sequences per GPU per forward (default: the recipe's, else 1)."),
    global_batch_tokens: Optional[str] = typer.Option(None, "--global-batch-tokens", help="Tokens per optimizer step, e.g. 2359296 or 2.36M."),
    tokens: Optional[str] = typer.Option(None, "--tokens", help="Training tokens: 11.2T, 100B, 5e9."),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="GPUs in the run (default: global batch ÷ micro batch × tp·pp·cp)."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="h100 (default), h200, a100-80, a100-40, l40s, b200, mi300x, ..."),
    tp: Optional[int] = typer.Option(None, "--tp", help="Tensor parallel size (with sequence parallelism)."),
    pp: Optional[int] = typer.Option(None, "--pp", help="Pipeline stages (1F1B schedule)."),
    cp: Optional[int] = typer.Option(None, "--cp", help="Context parallel size (splits the sequence)."),
    zero: Optional[int] = typer.Option(None, "--zero", help="ZeRO stage 0-3 over data parallel (recipe shard=true: 3)."),
    dp_shard: Optional[int] = typer.Option(None, "--dp-shard", help="With --zero 3: shard over this many data-parallel ranks, replicate over the rest (HSDP)."),
    recompute: Optional[str] = typer.Option(None, "--recompute", help="none | selective | full activation recomputation."),
    attention: Optional[str] = typer.Option(None, "--attention", help="flash | sdpa | eager."),
    precision: Optional[str] = typer.Option(None, "--precision", help="bf16 (bf16 weights + fp32 master) | amp (fp32 weights, bf16 autocast) | fp32."),
    optimizer: Optional[str] = typer.Option(None, "--optimizer", help="adamw | adamw8bit | sgd."),
    mfu: Optional[float] = typer.Option(None, "--mfu", help="Achieved model FLOPs utilisation (default 0.30)."),
    price: Optional[float] = typer.Option(None, "--price-per-gpu-hour", help="Cost of one GPU-hour, for the total."),
    target_days: Optional[float] = typer.Option(None, "--target-days", help="Also report the GPUs needed to finish in this many days."),
    tf32: Optional[bool] = typer.Option(None, "--tf32", help="fp32 matmuls run as TF32 on tensor cores (off in PyTorch unless enabled)."),
    checkpoint_gbps: Optional[float] = typer.Option(None, "--checkpoint-gbps", help="Checkpoint write bandwidth per node, GB/s (default 1)."),
    checkpoint_hours: Optional[float] = typer.Option(None, "--checkpoint-hours", help="Hours between checkpoints (default: Young/Daly's optimum)."),
    sync_checkpoint: bool = typer.Option(False, "--sync-checkpoint", help="Training waits for each checkpoint write (default: async, waits only for the copy to host memory)."),
    overhead: Optional[float] = typer.Option(None, "--overhead", help="Use this wall-clock overhead factor instead of the computed one."),
    find: bool = typer.Option(False, "--find", help="Also search the layouts and the largest micro batch that fit."),
    framework: Optional[str] = typer.Option(None, "--framework", help="What --find proposes: smolctl (tp × FSDP2/HSDP, the trainer's layouts; default) or megatron (tp, pp, cp, ZeRO)."),
    require_fit: bool = typer.Option(False, "--require-fit", help="Exit 1 when the run does not fit the GPU."),
    inference_mode: bool = typer.Option(False, "--inference", help="Size serving instead: weights, KV cache, activations, decode tokens/s."),
    context: int = typer.Option(8192, "--context", help="--inference: tokens per sequence in the KV cache."),
    batch: int = typer.Option(1, "--batch", help="--inference: sequences decoded together."),
    kv_dtype: str = typer.Option("bf16", "--kv-dtype", help="--inference: bf16 or fp8 KV cache."),
    compare_attention: bool = typer.Option(False, "--compare-attention", help="--inference: the same model with multi-head attention beside it."),
    validate: bool = typer.Option(False, "--validate", help="Run a (scaled-down) copy here and print estimate vs measured."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Parameters, memory per GPU, FLOPs, time and cost of a training run; --find what fits; --validate against
    a measured forward + backward."""
    from smolctl.infra.estimate import InferenceScenario, estimate, estimate_inference, transformers_config
    from smolctl.infra.scenario import scenario_from_sources

    if recipe is not None and model is not None:
        raise UserError("estimate", "got both RECIPE and --model", "pass one (flags override the recipe's values)")
    if recipe is not None and not recipe.endswith(".toml"):
        recipe, model = None, recipe  # a preset, config.json or model folder in the recipe's place
    flags = dict(model=model, seq_len=seq_len, micro_batch=micro_batch, global_batch_tokens=global_batch_tokens,
                 tokens=tokens, gpus=gpus, gpu=gpu, tp=tp, pp=pp, cp=cp, zero=zero, dp_shard=dp_shard, recompute=recompute,
                 attention=attention, precision=precision, optimizer=optimizer, mfu=mfu, price_per_gpu_hour=price,
                 target_days=target_days, checkpoint_gbps=checkpoint_gbps, checkpoint_hours=checkpoint_hours,
                 overhead=overhead, tf32=tf32, framework=framework, async_checkpoint=False if sync_checkpoint else None)
    plan = scenario_from_sources(recipe=recipe, overrides=overrides, flags=flags)
    if inference_mode:
        served = estimate_inference(plan, InferenceScenario(context, batch, kv_dtype.lower(), compare_attention))
        emit_json(served) if json_out else _render_inference(served)
        if require_fit and not served["inference"]["model"]["fits"]:
            raise CheckFailed(f"estimate: {served['model']['name']} does not fit {plan.gpu} for inference at "
                              f"batch {batch} × {context} tokens")
        return
    result = estimate(plan, find=find)
    if validate:
        from smolctl.infra.measure import validate as run_validation

        with console.status("validating: forward + backward on this machine", spinner="dots"):
            result["validate"] = run_validation(plan, transformers_config(plan))
    if json_out:
        emit_json(result)
    else:
        _render_estimate(result)
    if require_fit and not result["memory"]["fits"]:
        raise CheckFailed(f"estimate: does not fit {plan.gpu} ({result['memory']['total'] / 2**30:.1f} GiB per GPU)")


def _render_headlines(r: dict) -> None:
    for line in r["headlines"]:
        colour = "red" if line["level"] == "error" else "yellow"
        show(styled(f"[bold {colour}]{line['level']}:[/] {escape(line['text'])}"), soft_wrap=True)


def _render_estimate(r: dict) -> None:
    from smolctl.console import human_bytes

    m, lay, mem, comp = r["model"], r["layout"], r["memory"], r["compute"]
    act = mem["activations_detail"]
    p = m["params"]
    show(key_values(f"model: {m['name']} ({m['model_type']})", [
        ("parameters", f"{human_count(p['total'])} ({p['total']:,}; closed form "
                       f"{'n/a' if p['closed_form'] is None else format(p['closed_form'], ',')})"),
        ("embedding / LM head", f"{human_count(p['embedding'])} / {'tied' if m['tied'] else human_count(p['lm_head'])}"),
        ("non-embedding / per layer", f"{human_count(p['non_embedding'])} / {human_count(p['per_layer'])}"),
        ("shape", f"{m['layers']} layers, hidden {m['hidden']}, FFN {m['ffn']}, {m['heads']} heads "
                  f"({m['kv_heads']} KV) × {m['head_dim']}, vocab {m['vocab']}"),
    ]))
    _render_headlines(r)
    show(key_values("layout", [
        ("GPUs", f"{lay['gpus']} × {lay['gpu']} = tp {lay['tp']} × pp {lay['pp']} × cp {lay['cp']} × dp {lay['dp']}"
                 + (f" (FSDP2 shard {lay['dp_shard']} × replicate {lay['dp'] // lay['dp_shard']})" if lay["dp_shard"] else "")),
        ("batch", f"micro {lay['micro_batch']} × {lay['seq_len']} tokens, accumulation {lay['gradient_accumulation']}, "
                  f"global {human_count(lay['global_batch_tokens'])} tokens/step"),
        ("training", f"{lay['precision']}, {lay['optimizer']}, ZeRO-{lay['zero']}, recompute {lay['recompute']}, "
                     f"{lay['attention']} attention"),
    ]))
    rows = [(name, human_bytes(mem[key]), f"{mem[key] / mem['capacity']:.1%}") for name, key in [
        ("weights", "weights"), ("gradients", "grads"), ("fp32 master weights", "master"),
        ("optimizer states", "optimizer"), ("ZeRO-3 gather buffers", "gather"),
        (f"activations: {human_bytes(act['per_layer'])}/layer, head {human_bytes(act['head'])}", "activations"),
        ("logits gradient (transient)", "logits_grad"), ("allocator headroom", "allocator_headroom"),
        ("CUDA context + NCCL", "runtime_reserved")] if mem[key]]
    verdict = "[green]fits[/]" if mem["fits"] else "[red]does not fit[/]"
    rows.append((styled(f"total — {verdict} {escape(mem['gpu'])}"), human_bytes(mem["total"]), f"{mem['total'] / mem['capacity']:.1%}"))
    stage = "" if mem["stage"] == "all" else f", {mem['stage']} pipeline stage"
    show(table(f"memory per GPU ({human_bytes(mem['capacity'])}{stage})", ["", "bytes", "of GPU"], rows))
    _render_compute(comp, lay["mfu"])
    for note in [comp["overhead"]["why"], *r["notes"]]:
        show(styled(f"[dim]note:[/] {escape(note)}"), soft_wrap=False)
    if "find" in r:
        _render_find(r["find"], lay)
    if "validate" in r:
        _render_validation(r["validate"])


def _render_compute(comp: dict, mfu: float) -> None:
    from smolctl.console import human_bytes, human_duration

    t = comp["time"]
    facts = [
        ("FLOPs per token", f"{comp['flops_per_token']:.3e} = 6N {comp['six_n']:.3e} + attention "
                            f"{comp['attention_flops_per_token']:.3e}"),
        ("tokens / total FLOPs", f"{human_count(comp['tokens'])} / {comp['total_flops']:.3e}"),
        ("throughput", f"{comp['tokens_per_second_per_gpu']:,.0f} tokens/s/GPU at MFU {mfu:.0%}; "
                       f"{comp['step_seconds']:.2f} s/step, {comp['steps']:,} steps"),
        ("compute time", human_duration(comp["compute_time"]["seconds"])),
        ("overhead", f"× {comp['overhead']['factor']:.3f} ({comp['overhead']['effective_training_time']:.1%} of "
                     "the wall-clock time trains)"),
        ("time", f"{human_duration(t['seconds'])} = {t['hours']:,.1f} h = {t['days']:.2f} days"),
        ("GPU-hours", f"{comp['gpu_hours']:,.0f}" + (f"  cost {comp['cost']:,.0f}" if comp["cost"] else "")),
        ("checkpoint", f"{human_bytes(comp['checkpoint']['bytes'])} (model only "
                       f"{human_bytes(comp['checkpoint']['model_bytes'])}) every "
                       f"{human_duration(comp['checkpoint']['interval_seconds'])}: "
                       + (f"{comp['checkpoint']['stall_seconds']:.2g} s stall, then " if comp['checkpoint']['async'] else "")
                       + f"{comp['checkpoint']['write_seconds']:.1f} s to write at "
                       f"{comp['checkpoint']['gbps_per_node']:g} GB/s per node"),
    ]
    if comp.get("gpus_for_target"):
        target = comp["gpus_for_target"]
        facts.append((f"GPUs for {target['days']:g} days", f"{target['gpus']}"))
    if comp["pipeline_bubble"]:
        facts.append(("pipeline bubble", f"{comp['pipeline_bubble']:.1%} of each step (inside the MFU)"))
    show(key_values("compute and time", facts))


def _render_find(found: dict, lay: dict) -> None:
    from smolctl.console import human_bytes

    show(styled(f"largest micro batch that fits this layout: [bold]{found['largest_micro_batch'] or 'none'}[/]"))
    if found["framework"] == "smolctl":
        columns = ["tp", "dp shard (FSDP2)", "dp replicate", "recompute", "accumulation", "total", "free"]
        rows = [(x["tp"], x["dp_shard"], x["dp_replicate"], x["recompute"], x["gradient_accumulation"],
                 human_bytes(x["total"]), human_bytes(x["free"])) for x in found["layouts"]]
    else:
        columns = ["tp", "pp", "cp", "dp", "zero", "recompute", "accumulation", "total", "free"]
        rows = [(x["tp"], x["pp"], x["cp"], x["dp"], x["zero"], x["recompute"], x["gradient_accumulation"],
                 human_bytes(x["total"]), human_bytes(x["free"])) for x in found["layouts"]]
    show(table(f"{found['framework']} layouts that fit {lay['gpus']} × {lay['gpu']} at micro batch "
               f"{lay['micro_batch']} and global batch {found['global_batch_tokens']:,} tokens, fastest first",
               columns, rows or [("none fit",) + ("",) * (len(columns) - 1)]))
    skipped = found["skipped"]
    show(styled(f"[dim]left out: {skipped['batch']} layout(s) whose data parallel × micro batch does not divide "
                f"the global batch, {skipped['pipeline']} pipeline(s) with fewer micro batches than stages[/]"),
         soft_wrap=True)


def _render_inference(r: dict) -> None:
    from smolctl.console import human_bytes

    inf = r["inference"]
    sides = [("this model", inf["model"])] + ([("multi-head attention", inf["multi_head"])] if "multi_head" in inf else [])
    rows = [("KV heads", *(str(x["kv_heads"]) for _, x in sides)),
            ("weights (bf16)", *(human_bytes(x["weights"]) for _, x in sides)),
            (f"KV cache per token ({inf['kv_dtype']})", *(human_bytes(x["kv_per_token"]) for _, x in sides)),
            (f"KV cache per sequence ({inf['context']:,} tokens)", *(human_bytes(x["kv_per_sequence"]) for _, x in sides)),
            (f"KV cache for the batch ({inf['batch']})", *(human_bytes(x["kv_cache"]) for _, x in sides)),
            ("prefill activations", *(human_bytes(x["activations"]) for _, x in sides)),
            ("CUDA context + workspaces", *(human_bytes(x["runtime_reserved"]) for _, x in sides)),
            ("total", *(styled(f"{human_bytes(x['total'])} — " + ("[green]fits[/]" if x["fits"] else "[red]does not fit[/]"))
                        for _, x in sides)),
            (f"largest batch at {inf['context']:,} tokens", *(str(x["max_batch"]) for _, x in sides)),
            (f"longest context at batch {inf['batch']}", *(f"{x['max_context']:,}" for _, x in sides)),
            (f"decode bound ({inf['model']['memory_tbps']:g} TB/s)",
             *(f"{x['decode_tokens_per_second']:,.0f} tokens/s ({x['decode_tokens_per_second_per_sequence']:,.0f} per "
               "sequence)" for _, x in sides))]
    gpus = f"{inf['tp']} × {inf['gpu']}" if inf["tp"] > 1 else inf["gpu"]
    show(table(f"inference: {r['model']['name']} on {gpus} (per GPU)", ["", *(name for name, _ in sides)], rows))
    show(styled("[dim]note: decoding reads every weight and the batch's KV cache once per token, so memory "
                "bandwidth bounds tokens/s; real servers reach 60–80% of it[/]"), soft_wrap=True)


def _render_validation(v: dict) -> None:
    from smolctl.console import human_bytes

    def fmt(row: dict, value: float) -> str:
        return {"bytes": human_bytes, "count": "{:,}".format}.get(row["unit"], "{:.4e}".format)(value)

    show(table(f"validate on {v['device']}: {v['ran']}, micro batch {v['micro_batch']} × {v['seq_len']}",
               ["", "estimate", "measured", "estimate/measured"],
               [(row["what"], fmt(row, row["estimate"]), fmt(row, row["measured"]),
                 f"{row['estimate'] / row['measured']:.3f}") for row in v["rows"]]))


# ---------------------------------------------------------------------------------------------------------------
# `smolctl --help` lists the commands in pipeline order, grouped by what they work on.

PIPELINE_ORDER = {
    "Data": ["train-tokenizer", "dedup", "mix", "pack"],
    "Training": ["pretrain", "midtrain", "export", "sft", "dpo", "ppo", "grpo", "generate", "merge", "report"],
    "Cluster": ["estimate", "benchmark-nccl", "stress-gpu"],
    "Any folder": ["inspect"],
}
_position = {name: i for i, name in enumerate(n for names in PIPELINE_ORDER.values() for n in names)}
for _command in app.registered_commands:
    _command.cls = _Command
    _command.rich_help_panel = next(panel for panel, names in PIPELINE_ORDER.items() if _command.name in names)
app.registered_commands.sort(key=lambda command: _position[command.name])


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
        error_line("error", f"{where}: {os.strerror(number)} — {ENVIRONMENT_ERRNOS[number]}")
        return 2
    error_line("internal error", f"{type(exc).__name__}: {exc} — please report it; SMOLCTL_DEBUG=1 shows the traceback")
    return 1


def main(argv: list[str] | None = None) -> None:
    """Run the CLI: user mistakes are one line and exit 2, failed checks exit 1, bugs exit 1 with a hint."""
    debug = os.environ.get("SMOLCTL_DEBUG") == "1"
    try:
        code = app(args=argv, prog_name="smolctl", standalone_mode=False)
    except Interrupted as exc:
        error_line("interrupted", str(exc))
        code = exc.exit_code
    except typer.TyperException as exc:  # a usage error found while parsing: Typer prints it with the usage line
        exc.show()
        code = exc.exit_code
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
        error_line("interrupted", "nothing half-written was left behind — run the command again")
        code = 130
    except Exception as exc:  # the file system refusing a write, or a bug in smolctl
        if debug:
            traceback.print_exc()
        code = _report_unexpected(exc)
    sys.exit(code if isinstance(code, int) else 0)

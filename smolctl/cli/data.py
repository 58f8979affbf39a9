"""Data commands: train-tokenizer, dedup, mix, pack (parquet folders in, dataset or packed folders out)."""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

import typer

from smolctl.cli.app import app
from smolctl.cli.common import render_array_task
from smolctl.cli.options import JsonOpt, OverwriteOpt, SetOpt, TaskIdOpt, TasksOpt, TextColumnOpt
from smolctl.console import (
    emit_json,
    human_count,
    key_values,
    progress,
    show,
    styled,
    table,
    warn,
)
from smolctl.errors import UserError
from smolctl.units import BYTES_HELP, COUNT_HELP, parse_bytes, parse_count


def _numpy_without_blas_threads() -> None:
    """The data commands bring their own parallelism (the tokenizer's threads, worker processes) and use numpy
    only to index and copy arrays, never for linear algebra; unless told otherwise, OpenBLAS would start a
    thread per core when numpy is imported, costing more CPU than the rest of the import. Called before the
    command's first numpy import; worker processes inherit it."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


@app.command(
    "train-tokenizer",
    epilog="""[bold]Examples[/]

  smolctl train-tokenizer data/sample/web tok/ --vocab-size 8192

  smolctl train-tokenizer 'corpus/*.parquet' tok/ --vocab-size 49152 --text-column content --json

  smolctl train-tokenizer 'crawl/*.parquet' tok/ --vocab-size 49152 --sample-bytes 2GB      any corpus size, one node
""",
)
def train_tokenizer_command(
    input: str = typer.Argument(..., help="Dataset folder, folder of parquet files, a .parquet file or a glob."),
    output: Path = typer.Argument(..., help="Tokenizer folder to write (loads with AutoTokenizer.from_pretrained)."),
    vocab_size: int = typer.Option(8192, "--vocab-size", help="Vocabulary size, special tokens included."),
    text_column: TextColumnOpt = "text",
    min_frequency: int = typer.Option(2, "--min-frequency", min=0, help="Merges rarer than this are not learned."),
    sample_documents: str | None = typer.Option(
        None,
        "--sample-documents",
        help="Train on a seeded uniform "
        "sample of this many documents, e.g. 1M (streamed: any corpus size; "
        f"{COUNT_HELP}).",
    ),
    sample_bytes: str | None = typer.Option(
        None,
        "--sample-bytes",
        help="Train on a seeded uniform sample of "
        "this much text, e.g. 2GB (with --sample-documents: both limits; "
        f"{BYTES_HELP}).",
    ),
    seed: int = typer.Option(0, "--seed", min=0, help="Seeds the sample."),
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Train a byte-level BPE tokenizer with ChatML chat template and special tokens for document end and padding."""
    _numpy_without_blas_threads()
    from smolctl.data.tokenizer import train_tokenizer

    documents = parse_count(sample_documents, "--sample-documents") if sample_documents is not None else None
    size = parse_bytes(sample_bytes, "--sample-bytes") if sample_bytes is not None else None
    with progress(not json_out) as bar:
        task = bar.add_task("reading documents", total=None, rate="", visible=False)
        result = train_tokenizer(
            input,
            str(output),
            vocab_size=vocab_size,
            text_column=text_column,
            min_frequency=min_frequency,
            overwrite=overwrite,
            sample_documents=documents,
            sample_bytes=size,
            seed=seed,
            on_start=lambda total: bar.update(task, total=total, visible=True),
            on_batch=lambda n: bar.advance(task, n),
        )
    if json_out:
        emit_json(result.to_dict())
    else:
        sampled = (
            f" (sampled from {human_count(result.corpus_documents)})" if result.corpus_documents is not None else ""
        )
        show(
            key_values(
                "train-tokenizer",
                [
                    ("output", result.output),
                    ("vocab size", result.vocab_size),
                    ("documents", human_count(result.documents) + sampled),
                    ("characters", human_count(result.characters)),
                    ("chars/token", f"{result.chars_per_token:.2f}"),
                    ("time", f"{result.seconds:.1f}s"),
                ],
            )
        )
    for message in result.warnings:  # on stderr with --json too: a script's log shows it
        warn(message)


@app.command(
    "dedup",
    epilog="""[bold]Examples[/]

  smolctl dedup data/sample/web demo-out/dedup/web --minhash          exact + near duplicates, all cores

  smolctl dedup crawl/ deduped/ --minhash --threshold 0.7 --keep longest --json

  smolctl dedup new-crawl/ fresh/ --minhash --against last-release/   drop what the reference already has

  smolctl dedup crawl/ out/ --minhash --stage signatures --tasks 64 --task-id $SLURM_ARRAY_TASK_ID
  (see recipes/slurm/dedup.sbatch: signatures → buckets → components → filter, chained with afterok)
""",
)
def dedup_command(
    input: str = typer.Argument(..., help="Dataset folder, folder of parquet files, a .parquet file or a glob."),
    output: Path = typer.Argument(
        ...,
        help="Dataset folder to write: kept documents (same schema and order), "
        "duplicates/ (id, duplicate_of, cluster, reason, jaccard) and the manifest.",
    ),
    exact: bool = typer.Option(
        True, "--exact/--no-exact", help="Remove identical texts (NFKC, case-folded, whitespace collapsed)."
    ),
    use_minhash: bool = typer.Option(
        False,
        "--minhash",
        help="Also remove near duplicates (MinHash LSH, verified); "
        "the parameters below default to smolctl.data.minhash.MinHashParams' and the "
        "summary prints the ones used.",
    ),
    threshold: float | None = typer.Option(
        None, "--threshold", help="Jaccard of the shingle sets at or above which documents are duplicates."
    ),
    num_perm: int | None = typer.Option(None, "--num-perm", help="Signature length."),
    bands: int | None = typer.Option(
        None,
        "--bands",
        help="LSH bands (bands x rows = num-perm) (default: derived from the threshold, leaning to recall).",
    ),
    rows: int | None = typer.Option(None, "--rows", help="Signature values per band."),
    ngram: int | None = typer.Option(None, "--ngram", help="Shingle length in words or characters."),
    shingle: str | None = typer.Option(None, "--shingle", help="word, or char for languages written without spaces."),
    verify: bool = typer.Option(
        True,
        "--verify/--no-verify",
        help="Check candidates by exact Jaccard (grey zone only); --no-verify trusts the signature estimate.",
    ),
    text_column: TextColumnOpt = "text",
    id_column: str | None = typer.Option(
        None,
        "--id-column",
        help="Column of unique ids (default: id if present, else shard:row); shard:row names documents by shard "
        "and row even where an id column exists (ids that repeat), the --against reference's too.",
    ),
    against: str | None = typer.Option(
        None,
        "--against",
        help="Reference dataset: drop INPUT documents that duplicate it; the reference is never changed.",
    ),
    keep: str = typer.Option("first", "--keep", help="Survivor of each cluster: first (input order) or longest."),
    workers: int | None = typer.Option(None, "--workers", min=1, help="Processes (default: the CPUs available)."),
    stage: str | None = typer.Option(
        None,
        "--stage",
        help="Run one stage only: signatures, buckets, components or filter (Slurm arrays); default: all stages.",
    ),
    tasks: TasksOpt = None,
    task_id: TaskIdOpt = 0,
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Remove exact and near-duplicate documents; the same result on one core, many, or a Slurm array."""
    _numpy_without_blas_threads()
    from smolctl.data.dedup import DedupConfig, run
    from smolctl.data.minhash.params import MinHashParams

    given = {
        "threshold": threshold,
        "num_perm": num_perm,
        "bands": bands,
        "rows": rows,
        "ngram": ngram,
        "shingle": shingle,
    }
    given = {key: value for key, value in given.items() if value is not None}
    if not use_minhash and given:
        raise UserError(
            f"--{next(iter(given)).replace('_', '-')}", "applies to near-duplicate removal only", "add --minhash"
        )
    params = MinHashParams.for_threshold(**given) if use_minhash else None  # the module's defaults for the rest
    config = DedupConfig(
        input=input,
        output=str(output),
        exact=exact,
        minhash=params,
        verify=verify,
        text_column=text_column,
        id_column=id_column,
        against=against,
        keep=keep,
        overwrite=overwrite,
    )
    with progress(not json_out) as bar:
        result = run(
            config,
            stage=stage,
            tasks=1 if tasks is None else tasks,
            task_id=task_id,
            workers=workers or len(os.sched_getaffinity(0)),
            report=_stage_progress(bar),
        )
    if json_out:
        emit_json(result.to_dict())
        return
    _render_dedup(result, tasks or 1, task_id)


def _stage_progress(bar):
    """Progress callback: one bar per stage, created when the stage announces its total."""

    bars: dict[str, tuple[int, float]] = {}  # stage -> (task, started)
    done: Counter[str] = Counter()
    units = {"signatures": "docs", "filter": "docs", "buckets": "bands", "verify": "pairs"}

    def report(stage: str, advance: int, total: int | None = None) -> None:
        if stage not in bars:
            if not total:
                return
            bars[stage] = (bar.add_task(stage, total=total, rate=""), time.perf_counter())
        task, started = bars[stage]
        done[stage] += advance
        rate = done[stage] / max(1e-9, time.perf_counter() - started)
        bar.update(task, advance=advance, rate=f"{human_count(rate)} {units.get(stage, '')}/s")

    return report


def _render_dedup(result, tasks: int, task_id: int) -> None:
    if result.already_committed:
        show(f"dedup: {result.output} is already committed by this run; nothing to do")
        return
    if not result.finished:
        where = f"task {task_id} of {tasks}, " if tasks > 1 else ""
        units = (
            f"{where}{result.units_done} done, {result.units_skipped} already finished (skipped)"
            if result.units_done + result.units_skipped
            else f"{where}no units for this task: nothing to do"
        )
        show(
            key_values(
                f"dedup --stage {result.stage}",
                [
                    ("units", units),
                    ("time", f"{result.seconds:.1f}s"),
                    ("output", f"{result.output} (committed by the filter task that finishes last)"),
                ],
            )
        )
        return
    removed = result.exact_removed + result.near_removed
    rate = result.documents / max(result.seconds, 1e-9)
    facts = [("documents in", f"{result.documents:,}")]
    if result.null_text:
        facts.append(("null texts", f"{result.null_text} (kept as they are, not deduplicated)"))
    facts += [
        ("exact removed", f"{result.exact_removed:,}"),
        ("near removed", f"{result.near_removed:,}" if result.params["minhash"] else "- (no --minhash)"),
        ("kept", f"{result.kept:,} ({result.kept / max(result.documents, 1):.1%})"),
        ("clusters", f"{result.clusters:,} ({removed:,} removed, see duplicates/)"),
    ]
    if result.params["minhash"]:
        mh = result.params["minhash"]
        facts.append(
            (
                "candidates",
                f"{result.candidate_pairs:,} pairs, {result.verified_pairs:,} by exact Jaccard "
                f"({mh['bands']} bands x {mh['rows']} rows, threshold {mh['threshold']})",
            )
        )
    if result.stage == "all":
        facts.append(
            (
                "throughput",
                f"{human_count(rate)} docs/s, {result.bytes / max(result.seconds, 1e-9) / 1e6:.1f} MB/s"
                + (f" ({result.units_skipped} finished unit(s) reused)" if result.units_skipped else ""),
            )
        )
    facts += [
        ("time", f"{result.seconds:.1f}s" + ("" if result.stage == "all" else f" (this {result.stage} task)")),
        ("output", result.output),
    ]
    show(key_values("dedup", facts))


@app.command(
    "mix",
    epilog="""[bold]Examples[/]

  smolctl mix demo-out/mix --recipe recipes/demo-mix.toml --set sources.web.path=demo-out/dedup/web

  smolctl mix out/ --source web=data/sample/web:0.7 --source code=data/sample/code:0.3 --bytes 1MB

  smolctl mix out/ --source web=web/:85 --source code=code/:12 --source math=math/:3 --tokens 2G --tokenizer tok/

  smolctl mix out/ --recipe recipes/smollm3-mix.toml --set stages.0.tokens=1_000_000_000 --json

  smolctl mix out/ --recipe recipes/demo-mix.toml --stage measure --tasks 64 --task-id $SLURM_ARRAY_TASK_ID
  (then --stage write; see recipes/slurm/mix.sbatch)
""",
)
def mix_command(
    output: Path = typer.Argument(..., help="Dataset folder to write; with a recipe, one subfolder per stage."),
    source: list[str] | None = typer.Option(
        None,
        "--source",
        help="NAME=PATH:WEIGHT (repeat). PATH: any dataset folder, parquet file or glob; weights are normalised.",
    ),
    recipe: Path | None = typer.Option(None, "--recipe", help="TOML recipe with [sources.NAME] and [[stages]]."),
    overrides: SetOpt = None,
    tokens: str | None = typer.Option(
        None, "--tokens", help=f"Budget in tokens (needs --tokenizer), e.g. 2.5M ({COUNT_HELP})."
    ),
    bytes_: str | None = typer.Option(
        None, "--bytes", help=f"Budget in UTF-8 bytes of text, e.g. 100MB ({BYTES_HELP})."
    ),
    documents: str | None = typer.Option(None, "--documents", help=f"Budget in documents, e.g. 100K ({COUNT_HELP})."),
    tokenizer: str | None = typer.Option(
        None, "--tokenizer", help="Weigh by tokens with this tokenizer (else by bytes)."
    ),
    # the numbers are mix_schedule's DEFAULT_TOKEN_SAMPLE and SAMPLE_ABOVE, written out: importing it costs pyarrow
    token_estimate: str | None = typer.Option(
        None,
        "--token-estimate",
        metavar="auto|sample|exact",
        help="How "
        "tokens are counted. exact: tokenize every document. sample: tokenize "
        "a seeded sample of ~10,000 documents per source "
        "(recipe key token_sample), and every document too large to sample (1/token_sample of its source's text), "
        "fit the sample's tokens to UTF-8 bytes (and to the "
        "extra bytes of non-ASCII characters), estimate the rest from theirs. auto (default): sample a source of more than "
        "ten times token_sample documents (100,000 by default), count smaller ones exactly.",
    ),
    seed: int | None = typer.Option(None, "--seed", min=0, help="Seeds sampling and shuffling (default 0)."),
    max_repeat: float | None = typer.Option(
        None,
        "--max-repeat",
        help="How many times a source may be used across all stages (default 1: each document at most once).",
    ),
    text_column: str | None = typer.Option(None, "--text-column", help="Column holding the documents (default: text)."),
    shuffle_buffer: int | None = typer.Option(
        None, "--shuffle-buffer", help="Rows per shuffled block, bounds memory (default: 20000)."
    ),
    stage: str | None = typer.Option(
        None,
        "--stage",
        help="Run one pass only, as Slurm array tasks: measure "
        "(one unit per source shard), then write (one unit per output block).",
    ),
    tasks: TasksOpt = None,
    task_id: TaskIdOpt = 0,
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Mix document sources by weight (tokens or bytes) in stages, with repetition limits and a seeded shuffle."""
    _numpy_without_blas_threads()
    from smolctl.data.mix import prepare_mix
    from smolctl.data.mix_schedule import schedule_from_flags, schedule_from_recipe

    # None: not given; given options override the recipe's keys (merged in mix_schedule)
    options = {
        "tokenizer": tokenizer,
        "seed": seed,
        "max_repeat": max_repeat,
        "text_column": text_column,
        "shuffle_buffer": shuffle_buffer,
        "token_estimate": token_estimate,
    }
    if recipe is not None:
        if source:
            raise UserError(
                "--source",
                "cannot be combined with --recipe",
                "put the sources in the recipe, or override their paths with --set sources.NAME.path=PATH",
            )
        if tokens or bytes_ or documents:
            raise UserError(
                "--tokens/--bytes/--documents",
                "budgets of a recipe live in its stages",
                "override them with --set stages.0.tokens=N",
            )
        plan = schedule_from_recipe(recipe, overrides or [], **options)
    else:
        if overrides:
            raise UserError("--set", "overrides a recipe", "pass --recipe, or set options directly")
        plan = schedule_from_flags(source or [], tokens=tokens, bytes_=bytes_, documents=documents, **options)
    job = prepare_mix(plan, output, overwrite=overwrite)
    with progress(not json_out) as bar:
        measuring = bar.add_task(f"measuring sources ({plan.unit})", total=job.total_rows, rate="", visible=False)

        def stage_task(name: str, rows: int):
            task = bar.add_task(f"writing {name}", total=rows, rate="")
            return lambda n: bar.advance(task, n)

        result = job.run(
            on_measure=lambda n: bar.update(measuring, advance=n, visible=True),
            on_stage=stage_task,
            stage=stage,
            tasks=tasks,
            task_id=task_id,
        )
    if json_out:
        emit_json(result.to_dict())
        for message in result.warnings():  # stderr too: a Slurm log or a script's reader sees them there
            warn(message)
        return
    if render_array_task(f"mix --stage {stage}" if stage else "mix", result, tasks or 1, task_id):
        return
    for report in result.stages:
        show(
            table(
                f"{report.name} → {report.path}  ({human_count(report.units)} {report.unit}, "
                f"{human_count(report.documents)} documents)",
                ["source", "target weight", "achieved", report.unit, "documents", "repeat", "repeat so far"],
                (
                    [
                        s.name,
                        f"{s.start_weight:.3f}→{s.end_weight:.3f} (mean {s.target_weight:.3f})"
                        if s.start_weight != s.end_weight
                        else f"{s.target_weight:.3f}",
                        f"{s.achieved_weight:.3f}",
                        human_count(s.units),
                        human_count(s.documents),
                        f"{s.repeat:.2f}x",
                        f"{s.cumulative_repeat:.2f}x",
                    ]
                    for s in report.sources
                ),
            )
        )
    for message in result.warnings():
        warn(message)
    for name, estimate in (result.token_estimates or {}).items():
        if estimate["mode"] == "sample" and not estimate["sample_documents"]:
            show(
                f"{name}: every document counted exactly ({estimate['large_documents']:,} of "
                f"{estimate['large_document_bytes']:,.0f} bytes or more, as its parquet footers count its text column)"
            )
        elif estimate["mode"] == "sample":
            cost = (
                f"{estimate['tokens_per_byte']:.3f} tokens/byte {estimate['tokens_per_extra_byte']:+.3f} per extra "
                "byte (of a character beyond ASCII, after its first)"
                if estimate["tokens_per_extra_byte"]
                else f"{estimate['bytes_per_token']:.3f} bytes/token"
            )
            large = estimate["large_documents"]
            counted = (
                f"; {large:,} document{'s' * (large != 1)} of {estimate['large_document_bytes']:,.0f} bytes or more "
                "counted exactly"
                if large
                else ""
            )
            show(
                f"{name}: tokens estimated at {cost}, fitted on {estimate['sample_documents']:,} sampled documents "
                f"(split-half error {estimate['holdout_error'] or 0:.2%}){counted}"
            )
    show(
        styled(
            f"weights are fractions of [bold]{result.unit}[/]"
            + ("" if result.unit == "tokens" else " (pass --tokenizer to weigh by tokens)")
            + f"; seed {result.seed}, max repeat {result.max_repeat:g}; {result.seconds:.1f}s"
        )
    )


@app.command(
    "pack",
    epilog="""[bold]Examples[/]

  smolctl pack demo-out/mix/stage-1 demo-out/packed --tokenizer demo-out/tokenizer --seq-len 256

  smolctl pack mix/ packed/ --tokenizer HuggingFaceTB/SmolLM3-3B --seq-len 4096 --workers 8

  smolctl pack 'corpus/*.parquet' packed/ --tokenizer tok/ --seq-len 2048 --strategy concat --json

  smolctl pack mix/stage-1 tokens/ --tokenizer tok/ --format datatrove      for nanotron's DatatroveFolderDataset

  smolctl pack mix/ packed/ --tokenizer tok/ --tasks 64 --task-id $SLURM_ARRAY_TASK_ID
  (one task of a Slurm array, see recipes/slurm/pack.sbatch; the same bytes as a plain run)
""",
)
def pack_command(
    input: str = typer.Argument(
        ...,
        help="Dataset folder (a mix stage, or a whole mix output: all stages in order), "
        "folder of parquet files, a .parquet file or a glob.",
    ),
    output: Path = typer.Argument(..., help="Packed folder to write (input_ids and position_ids, [rows, seq_len])."),
    tokenizer: str = typer.Option(..., "--tokenizer", help="Tokenizer folder (or hub id) with a fast tokenizer."),
    seq_len: int = typer.Option(4096, "--seq-len", help="Tokens per row: the training context length."),
    strategy: str = typer.Option(
        "bfd",
        "--strategy",
        help="bfd: best-fit-decreasing, pads only row ends; concat: concatenate and cut, no padding.",
    ),
    long_docs: str = typer.Option(
        "split", "--long-docs", help="Documents longer than seq_len: split (keep every token) or truncate."
    ),
    workers: int = typer.Option(1, "--workers", help="Tokeniser processes (1: in-process, Rust threads still used)."),
    text_column: TextColumnOpt = "text",
    buffer_tokens: str = typer.Option(
        "8M",
        "--buffer-tokens",
        help="Tokens packed together by bfd: more means "
        f"less padding and more memory (about 20 bytes per token; {COUNT_HELP}).",
    ),
    shard_size: str = typer.Option(
        "256MB",
        "--shard-size",
        help=f"Shard size in bytes, e.g. 256MB ({BYTES_HELP}), or in rows, e.g. 8192rows or 8Krows.",
    ),
    seed: int = typer.Option(0, "--seed", min=0, help="Seeds the shuffle of each bfd buffer's rows."),
    format: str = typer.Option(
        "safetensors",
        "--format",
        help="safetensors: packed rows for pretrain; datatrove: "
        "nanotron/datatrove .ds token files (documents + EOS back to back, no packing).",
    ),
    tasks: TasksOpt = None,
    task_id: TaskIdOpt = 0,
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Tokenise documents and pack them into fixed-length rows with document-masked position ids."""
    _numpy_without_blas_threads()
    from smolctl.data.pack import PackConfig, prepare_pack

    config = PackConfig(
        seq_len=seq_len,
        strategy=strategy,
        long_docs=long_docs,
        text_column=text_column,
        workers=workers,
        buffer_tokens=parse_count(buffer_tokens, "--buffer-tokens"),
        shard_size=shard_size,
        seed=seed,
        format=format,
    )
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
    if render_array_task("pack", result, tasks, task_id):
        return
    stats = result.stats
    packed = result.format == "safetensors"
    show(
        key_values(
            "pack",
            [
                ("output", result.output),
                ("tokenizer", f"{result.tokenizer['name']} ({result.tokenizer['fingerprint']})"),
                (
                    "layout",
                    f"{result.strategy}, long documents {result.long_docs}, seq_len {result.seq_len}"
                    if packed
                    else "datatrove token files (.ds + .ds.index), unpacked",
                ),
                ("documents", human_count(stats.documents)),
                ("tokens", human_count(stats.tokens)),
                *(
                    [
                        ("rows", human_count(stats.rows)),
                        ("padding", f"{human_count(stats.padding_tokens)} tokens ({stats.padding_fraction:.3%})"),
                        (
                            "split / truncated",
                            f"{stats.split_documents} / {stats.truncated_documents} documents "
                            f"({human_count(stats.truncated_tokens)} tokens cut)",
                        ),
                    ]
                    if packed
                    else []
                ),
                ("skipped empty", stats.skipped_empty),
                ("shards", result.shards),
                ("time", f"{result.seconds:.1f}s ({human_count(result.tokens_per_second)} tokens/s)"),
            ],
        )
    )

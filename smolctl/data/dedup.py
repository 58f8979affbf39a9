"""Exact and MinHash near-duplicate removal over dataset shards, as four restartable stages.

    smolctl dedup data/sample/web out/web --minhash

1. signatures  (one unit per input/reference shard): normalised-text hash, MinHash signature, band keys
2. buckets     (one unit per band, or per few bands of a small input): candidate pairs among documents sharing
               a band's key
3. components  (one unit): verify candidates (exact Jaccard in the grey zone), union-find with exact groups,
               one kept document per component
4. filter      (one unit per input shard): drop the removed rows; the task that completes the set assembles
               OUTPUT (kept documents + duplicates/ report + manifest) and commits it atomically

This module chains the stages and assembles OUTPUT; the plan (settings, inputs, units) is in dedup_plan.py,
the units themselves in dedup_stages.py.

Intermediates live in OUTPUT/_work/<run>/<stage>/, each unit finished by an atomic `.done` marker
(smolctl/data/array_tasks.py), so any split of units into Slurm array tasks (`--tasks N --task-id I`), a local
process pool, or a re-run after a kill gives the same bytes: documents are identified by their global position
(input shards in order, then reference shards), and every choice (kept document, cluster number, report order)
is a function of that order only.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from smolctl.arrow_arrays import cast
from smolctl.child_processes import exit_with_parent, leave_quietly_on_ctrl_c
from smolctl.data.array_tasks import (
    FINGERPRINT_KEY,
    START_AGAIN,
    AlreadyCommitted,
    check_task,
    link_or_copy,
    task_units,
    unless_committed,
)
from smolctl.data.dedup_plan import POSITIONAL_IDS, STAGES, DedupConfig, DedupPlan, Report, plan
from smolctl.data.dedup_stages import (
    DECODED_INPUT_BYTES,
    bucket_unit,
    check_reference_ids,
    check_unique_ids,
    components_unit,
    filter_unit,
    id_chunks,
    read_parquet,
    signature_unit,
)
from smolctl.errors import UserError, WriteRefused
from smolctl.heap import reuse_freed_memory
from smolctl.results import Result
from smolctl.shards import KIND_DOCUMENTS, DatasetWriter, OutputFolder, home_expanded, schema_to_dict

# Below this many documents a process pool costs more to start than it saves (the sample corpus runs in 1 s).
POOL_MIN_DOCUMENTS = 20_000
DUPLICATES_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("duplicate_of", pa.string()),
        ("cluster", pa.int64()),
        ("reason", pa.string()),
        ("jaccard", pa.float32()),
    ]
)


@dataclass
class DedupResult(Result):
    output: str
    stage: str
    finished: bool
    already_committed: bool = False
    """OUTPUT was committed by an earlier task of this same run: nothing was done."""
    documents: int = 0
    null_text: int = 0
    exact_removed: int = 0
    near_removed: int = 0
    kept: int = 0
    clusters: int = 0
    candidate_pairs: int = 0
    verified_pairs: int = 0
    bytes: int = 0
    seconds: float = 0.0
    units_done: int = 0
    units_skipped: int = 0
    params: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------------
# Assembly of OUTPUT


def assemble(plan_: DedupPlan, stats: dict) -> dict:
    """Link the filtered shards into a staging folder, write duplicates/ and the manifest, swap into place."""
    config = plan_.config
    inputs = plan_.source.lineage() + (plan_.reference.lineage() if plan_.reference else [])
    with OutputFolder(config.output, kind=KIND_DOCUMENTS, overwrite=True, inputs=inputs) as folder:
        for unit in range(len(plan_.source.files)):
            marker = plan_.area.read_marker("filter", unit)
            if not marker["kept"]:  # a unit whose every document was removed writes no piece
                continue
            piece = plan_.work / "filter" / f"{unit:05d}.parquet"
            name = f"part-{len(folder.shards):05d}.parquet"
            # A piece lost or damaged under OUTPUT/_work is refused, not committed as a smaller output.
            link_or_copy(piece, folder.file(name), marker.get("bytes"))
            try:
                rows = pq.read_metadata(folder.file(name)).num_rows
            except (OSError, pa.ArrowException) as exc:
                raise UserError(piece, f"is not readable parquet ({exc})", START_AGAIN) from exc
            if rows != marker["kept"]:
                raise UserError(piece, f"holds {rows} rows, not the {marker['kept']} its unit kept", START_AGAIN)
            folder.add_shard(name, rows)
        removed = read_parquet(plan_.work / "components" / "removed.parquet").drop_columns(["index"])
        with OutputFolder(folder.file("duplicates"), kind=KIND_DOCUMENTS, inputs=[]) as report_folder:
            writer = DatasetWriter(report_folder, schema=DUPLICATES_SCHEMA)
            writer.write(cast(removed, DUPLICATES_SCHEMA))
            writer.close()
            report_folder.commit(schema=schema_to_dict(DUPLICATES_SCHEMA), stats={"removed": removed.num_rows})
        return folder.commit(
            schema=schema_to_dict(plan_.source.schema),
            stats=stats,
            dedup=_settings(plan_),
            **{FINGERPRINT_KEY: plan_.area.digest},
        )


def _settings(plan_: DedupPlan) -> dict:
    config = plan_.config
    return {
        "exact": config.exact,
        "minhash": asdict(config.minhash) if config.minhash else None,
        "verify": config.verify,
        "keep": config.keep,
        "text_column": config.text_column,
        "id_column": plan_.id_column or POSITIONAL_IDS,
        "against": str(Path(home_expanded(config.against)).resolve()) if config.against else None,
    }


# ---------------------------------------------------------------------------------------------------------------
# Running stages: in this process, in a local pool, or as one task of a Slurm array


UNIT_RUNNERS = {
    "signatures": signature_unit,
    "buckets": bucket_unit,
    "components": components_unit,
    "filter": filter_unit,
}


def run(
    config: DedupConfig,
    *,
    stage: str | None = None,
    tasks: int = 1,
    task_id: int = 0,
    workers: int = 1,
    report: Report = lambda stage, advance, total=None: None,
) -> DedupResult:
    """Run every stage (stage=None) or one stage's share for task `task_id` of `tasks`; skip finished units.

    The output is committed by whichever call completes the last filter unit; `finished` says if this one did.
    """
    if stage is not None and stage not in STAGES:
        raise UserError("--stage", f"unknown stage {stage!r}", f"use one of {', '.join(STAGES)}")
    check_task(tasks, task_id)
    if stage is None and tasks > 1:
        # Without a stage each task would start the later stages before the other tasks finished the earlier ones.
        raise UserError(
            "--tasks",
            "dedup runs as one array per stage, each after the one before",
            "add --stage signatures (then buckets, components with --tasks 1, and filter)",
        )
    if stage == "components" and tasks != 1:
        raise UserError("--tasks", "the components stage is a single task", "run it with --tasks 1 --task-id 0")
    reuse_freed_memory()  # every stage makes and frees large numpy temporaries (forked workers inherit it)
    plan_ = plan(config)
    # A task of an array (not a plain local run, which refuses a full OUTPUT) finds a committed run done, with
    # --overwrite too: that replaces another run's OUTPUT, and the same run would write the same bytes again.
    array_task = stage is not None
    if array_task and plan_.area.committed():
        return DedupResult(
            output=str(config.output),
            stage=stage or "all",
            finished=True,
            already_committed=True,
            params=_settings(plan_),
        )
    if not array_task:
        with plan_.area.alone():
            return _run_units(plan_, stage, tasks, task_id, workers, report)
    try:
        with unless_committed(plan_.area):
            return _run_units(plan_, stage, tasks, task_id, workers, report)
    except AlreadyCommitted:
        return DedupResult(
            output=str(config.output),
            stage=stage or "all",
            finished=True,
            already_committed=True,
            params=_settings(plan_),
        )


def _run_units(
    plan_: DedupPlan, stage: str | None, tasks: int, task_id: int, workers: int, report: Report
) -> DedupResult:
    config = plan_.config
    if stage is None:
        # Locally the ids are checked before anything is written; an array checks them in the components task.
        check_unique_ids(
            pa.chunked_array([c for i in range(len(plan_.source.files)) for c in id_chunks(plan_, i)], pa.string())
            if plan_.id_column
            else None,
            plan_.source,
            plan_.id_column,
        )
        check_reference_ids(plan_)
        plan_.ids_checked = True
    plan_.area.check(config.overwrite)
    started = time.perf_counter()  # after the checks (and the imports they trigger): the time the work takes
    stages = STAGES if stage is None else (stage,)
    if stage is not None:
        plan_.area.check_ready(stage, plan_.unit_count)
    mine = {name: task_units(plan_.unit_count(name), tasks, task_id) for name in stages}
    todo = {name: plan_.area.pending(name, units) for name, units in mine.items()}
    if stage is None or todo[stage]:  # a task with nothing left to do writes nothing
        plan_.area.prepare()
    try:
        result = _run_stages(plan_, stage, mine, todo, workers, report)
    except UserError as exc:
        if stage is None:
            plan_.area.clean_up_after(exc)
        raise
    result.seconds = time.perf_counter() - started
    return result


def _run_stages(
    plan_: DedupPlan,
    stage: str | None,
    mine: dict[str, list[int]],
    todo: dict[str, list[int]],
    workers: int,
    report: Report,
) -> DedupResult:
    """The units left to do of each stage (`todo`, of this task's share `mine`), then the commit where the filter
    stage is complete."""
    config = plan_.config
    done = skipped = 0
    with _Workers(workers) as pool:
        if (
            stage is None
            and all(pool.runs_here(plan_, todo[name]) for name in ("signatures", "filter"))
            and sum(plan_.source.file_bytes) <= DECODED_INPUT_BYTES
        ):
            plan_.decoded_room = DECODED_INPUT_BYTES
        for name in mine:  # the stages of this call, in order
            report(name, 0, total=_stage_total(plan_, name, todo[name]))
            skipped += len(mine[name]) - len(todo[name])
            pool.run(plan_, name, todo[name], report)
            done += len(todo[name])
    result = DedupResult(
        output=str(config.output),
        stage=stage or "all",
        finished=False,
        units_done=done,
        units_skipped=skipped,
        params=_settings(plan_),
    )
    if plan_.done("filter"):
        stats = _final_stats(plan_)
        manifest = plan_.area.commit_once(lambda: assemble(plan_, stats), wait=stage is not None)
        result.finished = manifest is not None
        if not result.finished and stage is None:
            raise plan_.area.busy_error()
        for key, value in stats.items():
            setattr(result, key, value)
    return result


def _stage_total(plan_: DedupPlan, stage: str, units: list[int]) -> int:
    """Progress units: documents for the shard stages, bands for buckets, nothing for components (verify has its own)."""
    if stage == "signatures":
        return sum(source.file_rows[i] for source, i in (plan_.units[u] for u in units))
    if stage == "filter":
        return sum(plan_.source.file_rows[u] for u in units)
    return sum(len(plan_.bucket_bands(u)) for u in units) if stage == "buckets" else 0


def _final_stats(plan_: DedupPlan) -> dict:
    components = json.loads(plan_.marker("components", 0).read_text())
    kept = sum(json.loads(plan_.marker("filter", u).read_text())["kept"] for u in range(plan_.unit_count("filter")))
    keys = (
        "documents",
        "null_text",
        "exact_removed",
        "near_removed",
        "clusters",
        "candidate_pairs",
        "verified_pairs",
        "bytes",
    )
    stats = {k: components[k] for k in keys} | {"kept": kept}
    if stats["documents"] != kept + stats["exact_removed"] + stats["near_removed"]:
        raise RuntimeError(f"dedup accounting broken: {stats}")
    return stats


class _Workers:
    """A process pool started on first use and shared by the stages of one run. Forked, not spawned: a spawned
    worker re-imports the caller's main module (`python -m smolctl` would start the CLI again) and pays the
    imports again; arrow's thread pools restart themselves in a forked child."""

    def __init__(self, size: int):
        self.size, self.pool, self.queue = size, None, None

    def runs_here(self, plan_: DedupPlan, units: list[int]) -> bool:
        """Whether these units of a stage run in this process rather than in the pool."""
        documents = plan_.source.num_rows + (plan_.reference.num_rows if plan_.reference else 0)
        return self.size <= 1 or len(units) <= 1 or documents < POOL_MIN_DOCUMENTS

    def run(self, plan_: DedupPlan, stage: str, units: list[int], report: Report) -> None:
        if self.runs_here(plan_, units):
            for unit in units:
                plan_.area.mark_done(stage, unit, UNIT_RUNNERS[stage](plan_, unit, report))
            return
        from concurrent.futures import FIRST_COMPLETED, wait

        pending = {self._pool(plan_).submit(_unit_in_worker, stage, unit) for unit in units}
        while pending:
            finished, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            _drain(self.queue, report)
            for future in finished:
                error = future.result()
                if error is not None:
                    kind, *parts = error
                    raise (WriteRefused if kind == "refused" else UserError)(*parts)
        _drain(self.queue, report)

    def _pool(self, plan_: DedupPlan):
        """The pool, its workers forked with the run's plan: a plan sent with every unit would be pickled once per
        unit, and it lists every input file (quadratic in the shards: 2,000 of them took minutes)."""
        if self.pool is None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            context = multiprocessing.get_context("fork")
            self.queue = context.Queue()
            self.pool = ProcessPoolExecutor(
                self.size, mp_context=context, initializer=_init_worker, initargs=(self.queue, plan_, os.getpid())
            )
        return self.pool

    def __enter__(self) -> _Workers:
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)


_WORKER_QUEUE = None
_WORKER_PLAN: DedupPlan | None = None  # the run a forked pool process works for (set by _init_worker)


def _init_worker(queue, plan_: DedupPlan, parent: int) -> None:
    global _WORKER_QUEUE, _WORKER_PLAN
    leave_quietly_on_ctrl_c()  # first: a Ctrl-C while the rest starts up must not print a traceback either
    exit_with_parent(parent)
    _WORKER_QUEUE, _WORKER_PLAN = queue, plan_


def _unit_in_worker(stage: str, unit: int) -> tuple | None:
    """Run one unit of the run's plan in a pool process; a UserError comes back as its kind and parts (it does
    not pickle as raised): a refused write must stay one, or the parent would discard the finished units."""
    plan_ = _WORKER_PLAN
    try:
        plan_.area.mark_done(stage, unit, UNIT_RUNNERS[stage](plan_, unit, _report_to_parent))
    except UserError as exc:
        return "refused" if isinstance(exc, WriteRefused) else "input", exc.where, exc.what, exc.fix
    return None


def _report_to_parent(stage: str, advance: int, total: int | None = None) -> None:
    _WORKER_QUEUE.put((stage, advance, total))


def _drain(queue, report: Report) -> None:
    import queue as queues

    while True:
        try:
            stage, advance, total = queue.get_nowait()
        except queues.Empty:
            return
        report(stage, advance, total=total)

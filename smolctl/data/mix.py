"""`smolctl mix`: weighted, staged mixtures of document sources, streamed, with a deterministic shuffle.

    smolctl mix demo-out/mix --recipe recipes/demo-mix.toml
    smolctl mix out/ --source web=data/sample/web:0.7 --source code=data/sample/code:0.3 --bytes 1MB
    smolctl mix out/ --recipe mix.toml --stage measure --tasks 64 --task-id $SLURM_ARRAY_TASK_ID   (then --stage write)

How it works, streaming each source once to measure it and once per stage that uses it (memory: two arrays of
2**16 bins per source, the shuffle buffer, and one batch per source; never a whole source):
1. Measure. Every document gets a bin from a hash of (seed, source name, row index) and its size (tokens with
   EOS, as `pack` will count them, when a tokenizer is given; UTF-8 bytes otherwise) is added to that bin. The
   bins order each source randomly; an "epoch" walks the bins 0..65535. Tokens are counted exactly, or
   estimated from bytes with the source's tokens per byte calibrated on a seeded sample (mix_tokens.py).
2. Allocate. Each stage's budget is split by weight; each source's share is a slice of its endless, repeating
   walk through the bins, continuing where the previous stage stopped (so stages see fresh documents first).
   The slice ends at the bin boundary nearest the target, so achieved weights are exact to a bin (1/65536 of a
   source) or a document, whichever is larger, and are computed from the bins without re-reading anything.
   A slice that walks the source more than `max_repeat` times is an error that says what weight it can carry.
3. Write. Each source's slice is a sequence of rows (bin ranges one pass each, files in a seeded order). Each
   row is due at the point of the stage where the (possibly interpolated) schedule wants it; rows are merged by
   due point and cut into blocks of `shuffle_buffer` rows, each block shuffled with a seeded generator and
   written as one shard: every block holds the sources in proportion, and the same seed gives the same bytes.

Both passes are units of work (smolctl/data/array_tasks.py): `measure` has one unit per source shard, `write`
one per output block (smolctl/data/mix_blocks.py finds a block's rows on its own). A plain run does them all in
order; `--stage measure|write --tasks N --task-id I` does a share as one task of a Slurm array, and whichever
call writes the last block assembles OUTPUT. The bytes are the same for any split. A curriculum stage
(`order = "ascending:SCORE"`, see mix_schedule.py) sorts each source's whole slice by score, so it is one writing
unit (its blocks sorted by score instead of shuffled).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from smolctl.data.array_tasks import (
    FINGERPRINT_KEY,
    AlreadyCommitted,
    WorkArea,
    check_task,
    file_identity,
    link_or_copy,
    read_work_file,
    task_units,
    unless_committed,
)
from smolctl.data.mix_blocks import (
    BINS,
    SOURCE_COLUMN,
    file_rows_in_ranges,
    save_arrays,
    slice_pieces,
    source_key,
    write_block,
    write_curriculum,
)
from smolctl.data.mix_schedule import MixSchedule, Stage, check_order_columns
from smolctl.data.mix_tokens import (
    HALF_A_POINT,
    HOLDOUT_WARNING,
    MEASUREMENTS_VERSION,
    TokenCalibration,
    TokenSample,
    calibrate,
    document_sizes,
    measure_file,
    sample_key,
)
from smolctl.errors import UserError
from smolctl.shards import (
    KIND_DOCUMENTS,
    DocumentSource,
    OutputFolder,
    atomic_write_json,
    lineage_ref,
    open_documents,
    read_manifest,
    schema_to_dict,
    widest_types,
)

STAGES = ("measure", "write")

# ---------------------------------------------------------------------------------------------------------------
# Pass 1: measure every source into hash bins


@dataclass
class SourceProfile:
    name: str
    source: DocumentSource
    key: int
    units: np.ndarray
    """Units (tokens or bytes) per bin."""
    documents: np.ndarray
    """Documents per bin."""

    @property
    def total_units(self) -> int:
        return int(self.units.sum())

    @property
    def total_documents(self) -> int:
        return int(self.documents.sum())


# ---------------------------------------------------------------------------------------------------------------
# Allocation: each stage takes a slice of every source's repeating walk through its bins


@dataclass
class SourceReport:
    name: str
    start_weight: float
    end_weight: float
    target_weight: float
    achieved_weight: float = 0.0
    units: int = 0
    documents: int = 0
    repeat: float = 0.0
    """How many times this stage's slice covers the source."""
    cumulative_repeat: float = 0.0
    """How many times this and all earlier stages together cover the source."""
    source_units: int = 0
    source_documents: int = 0
    ranges: list[tuple[int, int]] = field(default_factory=list)
    """Bin ranges [lo, hi) read in this stage, one pass each (a range repeats when the slice wraps)."""


OFF_TARGET_POINTS = 0.02
"""How far (2 points) an achieved weight may be from its target before the summary warns."""


@dataclass
class StageReport:
    name: str
    path: str
    unit: str
    budget: int | None
    budget_kind: str | None
    units: int
    documents: int
    sources: list[SourceReport]
    shards: int = 0
    order: str = "shuffle"

    def short_of_target(self, points: float = OFF_TARGET_POINTS) -> list[SourceReport]:
        """Sources whose achieved weight is more than `points` (a fraction) below their target: a slice ends at a
        whole document (or bin), and a budget that holds only a few of a source's documents cannot split finer.
        (The others then carry more than theirs.)"""
        return [s for s in self.sources if s.target_weight - s.achieved_weight > points]


def bin_boundary(cumulative: np.ndarray, position: float) -> int:
    """The global bin boundary (epochs × BINS + bin) whose walk position is nearest `position` units (or
    documents, walking the cumulative documents)."""
    total = int(cumulative[-1])
    epoch, within = divmod(position, total)
    right = int(np.searchsorted(cumulative, within))
    left = max(0, right - 1)
    best = left if abs(cumulative[left] - within) <= abs(cumulative[min(right, BINS)] - within) else min(right, BINS)
    return int(epoch) * BINS + best


def floor_boundary(cumulative: np.ndarray, position: float) -> int:
    """The furthest global bin boundary whose walk position is at most `position` units: where max_repeat stops."""
    epoch, within = divmod(position, int(cumulative[-1]))
    return int(epoch) * BINS + int(np.searchsorted(cumulative, within, side="right")) - 1


def slice_end(cumulative: np.ndarray, begin: int, amount: float) -> int:
    """The bin boundary that ends a slice starting at `begin` and holding nearest `amount` of what `cumulative`
    counts (units, or documents)."""
    return max(begin, bin_boundary(cumulative, walk_units(cumulative, begin) + amount))


def walk_units(cumulative: np.ndarray, boundary: int) -> int:
    epoch, index = divmod(boundary, BINS)
    return epoch * int(cumulative[-1]) + int(cumulative[index])


def allocate(plan: MixSchedule, profiles: dict[str, SourceProfile]) -> list[list[SourceReport]]:
    """Each stage's per-source slices. Raises a UserError for a weight that needs more than max_repeat."""
    cumulative = {n: np.concatenate([[0], np.cumsum(p.units)]) for n, p in profiles.items()}
    cumulative_documents = {n: np.concatenate([[0], np.cumsum(p.documents)]) for n, p in profiles.items()}
    position = {name: 0 for name in profiles}  # global bin boundary reached by earlier stages
    allocations = []
    for stage in plan.stages:
        used = {n: s for n in profiles if (s := stage.share(n)) > 0}
        for name in used:
            if profiles[name].total_units == 0:
                raise UserError(
                    f"source {name!r}", f"has no {plan.unit} (every document is empty)", "drop it or give it weight 0"
                )
        room = {n: plan.max_repeat * profiles[n].total_units - walk_units(cumulative[n], position[n]) for n in used}
        documents = None  # per source, with a budget in documents: each slice ends at a document count
        if stage.budget_kind == "documents":
            units_per_doc = {n: profiles[n].total_units / max(1, profiles[n].total_documents) for n in used}
            total = stage.budget / sum(share / units_per_doc[n] for n, share in used.items())
            # Slices that match the weights hold about the budget in documents; scaled to hold exactly it, each
            # source keeps its share of the documents of the weighted slices.
            weighted = {
                n: walk_units(cumulative_documents[n], slice_end(cumulative[n], position[n], share * total))
                - walk_units(cumulative_documents[n], position[n])
                for n, share in used.items()
            }
            counted = max(1, sum(weighted.values()))
            documents = whole_documents(stage.budget, {n: d * stage.budget / counted for n, d in weighted.items()})
        elif stage.budget is not None:
            total = float(stage.budget)
        else:
            total = min(room[n] / share for n, share in used.items())
            if total <= 0:
                raise UserError(
                    f"stage {stage.name!r}",
                    f"has no budget and earlier stages used its sources up to max_repeat {plan.max_repeat:g}",
                    "give the stage a budget, or raise --max-repeat",
                )
        reports = []
        for name in profiles:
            profile, share = profiles[name], stage.share(name)
            report = SourceReport(
                name,
                stage.start[name],
                stage.end[name],
                share,
                source_units=profile.total_units,
                source_documents=profile.total_documents,
            )
            if share > 0:
                begin = position[name]
                # The nearest bin boundary to a slice's amount may lie past the max_repeat limit: it stops there.
                limit = floor_boundary(cumulative[name], walk_units(cumulative[name], begin) + room[name] * (1 + 1e-9))
                if documents is None:
                    check_room(plan, stage, profile, share, total, room[name])
                    end = slice_end(cumulative[name], begin, share * total)
                else:  # the documents themselves must fit (an average document size would misjudge a few)
                    left = walk_units(cumulative_documents[name], limit) - walk_units(cumulative_documents[name], begin)
                    check_document_room(plan, stage, profile, documents[name], left)
                    end = slice_end(cumulative_documents[name], begin, documents[name])
                end = max(begin, min(end, limit))
                report.ranges = bin_ranges(begin, end)
                report.units = sum(int(profile.units[lo:hi].sum()) for lo, hi in report.ranges)
                report.documents = sum(int(profile.documents[lo:hi].sum()) for lo, hi in report.ranges)
                report.repeat = report.units / profile.total_units
                position[name] = end
            report.cumulative_repeat = walk_units(cumulative[name], position[name]) / max(1, profile.total_units)
            reports.append(report)
        stage_units = sum(r.units for r in reports)
        for report in reports:
            report.achieved_weight = report.units / stage_units if stage_units else 0.0
        allocations.append(reports)
    return allocations


def whole_documents(budget: int, shares: dict[str, float]) -> dict[str, int]:
    """Each source's documents, `shares` (which add up to `budget`) rounded so that they still add up to it:
    the largest remainders round up."""
    counts = {name: int(share) for name, share in shares.items()}
    for name in sorted(shares, key=lambda n: counts[n] - shares[n])[: budget - sum(counts.values())]:
        counts[name] += 1
    return counts


def check_room(
    plan: MixSchedule, stage: Stage, profile: SourceProfile, share: float, total: float, room: float
) -> None:
    need = share * total
    if need <= room * (1 + 1e-9):
        return
    earlier = (plan.max_repeat * profile.total_units - room) / profile.total_units
    used_before = f", of which earlier stages already used {earlier:.2f}x" if earlier > 0 else ""
    raise UserError(
        f"stage {stage.name!r}, source {profile.name!r}",
        f"has {profile.total_units:,} {plan.unit} in {profile.total_documents:,} documents; weight {share:.4g} of "
        f"{total:,.0f} {plan.unit} needs {need:,.0f}, {need / profile.total_units:.2f}x the source, beyond "
        f"max_repeat {plan.max_repeat:g}{used_before}: it can carry a weight of at most {max(0.0, room) / total:.4g}",
        "lower its weight or the budget, or raise --max-repeat (max_repeat in a recipe)",
    )


def check_document_room(plan: MixSchedule, stage: Stage, profile: SourceProfile, wanted: int, left: int) -> None:
    if wanted <= left:
        return
    raise UserError(
        f"stage {stage.name!r}, source {profile.name!r}",
        f"has {profile.total_documents:,} documents; the stage's budget gives it {wanted:,}, but only {left:,} more "
        f"fit max_repeat {plan.max_repeat:g} after the earlier stages",
        "lower its weight or the budget, or raise --max-repeat (max_repeat in a recipe)",
    )


def bin_ranges(begin: int, end: int) -> list[tuple[int, int]]:
    """Global bin boundaries [begin, end) as per-epoch ranges [lo, hi) of bins."""
    ranges = []
    while begin < end:
        epoch, lo = divmod(begin, BINS)
        hi = min(BINS, end - epoch * BINS)
        ranges.append((lo, hi))
        begin = epoch * BINS + hi
    return ranges


# ---------------------------------------------------------------------------------------------------------------
# Pass 2: stream each stage's rows, merged by due point, in shuffled blocks


def output_schema(schemas: dict[str, pa.Schema]) -> pa.Schema:
    """The union of the sources' columns (a column a source lacks is null in its rows), plus `source`.

    A `source` column already in a source (e.g. an earlier mix) is replaced by the name given here. Sources
    written by different tools may store the same values in types of different widths: those widen to the widest
    (`widest_types`); any other difference is an error.
    """
    widest = widest_types(schemas)
    widened = {
        name: pa.schema([f.with_type(widest.get(f.name, f.type)) for f in schema if f.name != SOURCE_COLUMN])
        for name, schema in schemas.items()
    }
    try:
        merged = pa.unify_schemas(list(widened.values()))
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        first: dict[str, tuple[str, pa.DataType]] = {}
        for name, schema in widened.items():  # a column that widens is not the one to blame
            for column in schema:
                seen = first.setdefault(column.name, (name, column.type))
                if seen[1] != column.type:
                    raise UserError(
                        f"source {name!r}",
                        f"column '{column.name}' is {column.type} but {seen[1]} in source {seen[0]!r}",
                        "cast it to one type in every source",
                    ) from exc
        raise UserError(
            "--source", f"the sources' schemas do not combine ({exc})", "give them compatible columns"
        ) from exc
    return merged.append(pa.field(SOURCE_COLUMN, pa.string()))


# ---------------------------------------------------------------------------------------------------------------
# The command


@dataclass
class MixResult:
    output: str
    unit: str
    seed: int
    max_repeat: float
    stages: list[StageReport]
    seconds: float
    finished: bool = True
    """OUTPUT was committed by this call (`stages` is filled only then)."""
    already_committed: bool = False
    """An array task of a run committed earlier: nothing was done."""
    stage: str = "all"
    units_done: int = 0
    units_skipped: int = 0
    token_estimates: dict[str, dict] | None = None
    """How each source's tokens were counted ({"mode": "exact"} or its sample calibration); None without a
    tokenizer."""

    def warnings(self) -> list[str]:
        """What the run did not reach: each source of a stage that fell short of its target weight, and each token
        estimate that may miss its shares by more than half a point."""
        short = [
            f"stage {report.name!r}, source {s.name!r}: achieved weight {s.achieved_weight:.3f} against "
            f"{s.target_weight:.3f}: slices end at whole documents, and the stage's budget holds too few of its "
            f"({s.source_units:,} {report.unit} in {s.source_documents:,} document{'s' * (s.source_documents != 1)}) "
            "to come closer; a larger budget (or --max-repeat, with none) does"
            for report in self.stages
            for s in report.short_of_target()
        ]
        sampled = {
            name: estimate
            for name, estimate in (self.token_estimates or {}).items()
            if estimate["mode"] == "sample" and estimate["estimated_documents"]
        }
        unsure = [
            f"source {name!r}: its token estimate misses one half of its sample by {estimate['holdout_error']:.1%} "
            f"when fitted on the other ({estimate['sample_documents']:,} documents sampled{_large_note(estimate)}): "
            "the achieved weights count estimated tokens and may be off by more than half a point; raise "
            "token_sample (a recipe key), or pass --token-estimate exact"
            if _holdout_share_error(estimate) > HOLDOUT_WARNING
            else f"source {name!r}: two standard errors of its token estimate (2 x "
            f"{estimate['relative_standard_error']:.1%}, {estimate['sample_documents']:,} documents sampled"
            f"{_large_note(estimate)}) move "
            f"its share by {100 * self._share_error(name, estimate):.2f} points: the achieved weights may be off "
            "by more than half a point; raise token_sample (a recipe key), or pass --token-estimate exact"
            for name, estimate in sampled.items()
            if _holdout_share_error(estimate) > HOLDOUT_WARNING or self._share_error(name, estimate) > HALF_A_POINT
        ]
        unseen = [
            f"source {name!r}: {estimate['estimated_extra_share']:.1%} of the bytes it estimates are extra bytes of "
            "characters beyond ASCII (all but each character's first), "
            f"{estimate['sample_extra_bytes'] / estimate['sample_bytes']:.1%} of its sample's: the estimate cannot "
            "know what that text costs in tokens, and the achieved weights may be off by more than half a point; "
            "raise token_sample (a recipe key), or pass --token-estimate exact"
            for name, estimate in (self.token_estimates or {}).items()
            if estimate["mode"] == "sample" and estimate["extra_bytes_unsampled"]
        ]
        return short + unsure + unseen

    def _share_error(self, name: str, estimate: dict) -> float:
        """How far two standard errors of a source's token estimate (about a 95% bound) move its share: a
        relative error e in its tokens moves a share w by w(1 - w)e (at its largest target weight over the stages).
        The error is the fit's, on the documents it prices; the large ones are counted exactly, so it is scaled
        by the share of the source's tokens outside them (TokenCalibration.priced_share)."""
        weights = [s.target_weight for report in self.stages for s in report.sources if s.name == name]
        relative_error = (estimate["relative_standard_error"] or 0) * estimate["priced_share"]
        return max((w * (1 - w) for w in weights), default=0.25) * 2 * relative_error

    def to_dict(self) -> dict:
        out = asdict(self)
        for stage in out["stages"]:
            for source in stage["sources"]:
                source.pop("ranges")
        return out | {"warnings": self.warnings()}


def _holdout_share_error(estimate: dict) -> float:
    """The split-half error as it bears on the whole source: the fit's, on the share of its tokens it prices."""
    return (estimate["holdout_error"] or 0) * estimate["priced_share"]


def _large_note(estimate: dict) -> str:
    if not estimate["large_documents"]:
        return ""
    return f", on the {estimate['priced_share']:.0%} of its tokens outside the large documents counted exactly"


@dataclass
class MixJob:
    """A validated mix (sources opened, schemas unified, tokenizer loaded): see `prepare_mix`."""

    plan: MixSchedule
    output: Path
    overwrite: bool
    sources: dict[str, DocumentSource]
    schema: pa.Schema
    backend: object
    area: WorkArea
    sample_fractions: dict[str, float | None]
    """Per source, the fraction of rows tokenized to calibrate its token estimate; None: count exactly."""

    @property
    def total_rows(self) -> int:
        return sum(source.num_rows for source in self.sources.values())

    @property
    def measure_units(self) -> list[tuple[str, int]]:
        """(source, file) of every measuring unit: the sources in order, each file in order."""
        return [(name, index) for name, source in self.sources.items() for index in range(len(source.files))]

    def token_sample(self, name: str) -> TokenSample | None:
        """The documents of source `name` whose tokens `sample` mode counts (TokenSample); None: all of them."""
        fraction = self.sample_fractions[name]
        if fraction is None:
            return None
        text_bytes = self.sources[name].column_bytes(self.plan.text_column)
        return TokenSample.of(sample_key(self.plan.seed, name), fraction, text_bytes, self.plan.token_sample)

    def unit_count(self, stage: str) -> int:
        return len(self.measure_units) if stage == "measure" else len(self.blocks())

    def run(
        self,
        on_measure: Callable[[int], None] | None = None,
        on_stage: Callable[[str, int], Callable[[int], None]] | None = None,
        *,
        stage: str | None = None,
        tasks: int | None = None,
        task_id: int = 0,
    ) -> MixResult:
        """Measure, allocate, write: everything, or one stage's share for task `task_id` of `tasks`.
        `on_stage(name, rows)` returns the per-block callback for that stage."""
        if stage is not None and stage not in STAGES:
            raise UserError("--stage", f"unknown stage {stage!r}", f"use one of {', '.join(STAGES)}")
        if tasks is not None and stage is None:
            raise UserError(
                "--tasks",
                "mix runs as two arrays, the writing one after the measuring one",
                "add --stage measure (and, once every task has finished, --stage write)",
            )
        check_task(tasks, task_id)
        if stage is None:
            with self.area.alone():
                return self._run(STAGES, 1, 0, on_measure, on_stage, array_task=False)
        if self.area.committed():  # this very run, even with --overwrite (see dedup's run)
            return self._result([], 0.0, already_committed=True, stage=stage)
        try:
            with unless_committed(self.area):
                return self._run((stage,), tasks or 1, task_id, on_measure, on_stage, array_task=True)
        except AlreadyCommitted:
            return self._result([], 0.0, already_committed=True, stage=stage)

    def _run(
        self, stages: tuple[str, ...], tasks: int, task_id: int, on_measure, on_stage, array_task: bool
    ) -> MixResult:
        self.area.check(self.overwrite)
        if array_task:
            self.area.check_ready(stages[0], self.unit_count)
        started = time.perf_counter()
        done = skipped = 0
        try:
            for name in stages:
                mine = task_units(self.unit_count(name), tasks, task_id)
                todo = self.area.pending(name, mine)
                if todo or not array_task:  # a task with nothing left to do writes nothing
                    self.area.prepare()
                self._run_units(name, todo, on_measure, on_stage)
                done, skipped = done + len(todo), skipped + len(mine) - len(todo)
            result = self._result(
                [],
                0.0,
                finished=False,
                stage=stages[0] if array_task else "all",
                units_done=done,
                units_skipped=skipped,
            )
            if self.area.stage_done("measure", self.unit_count("measure")) and self.area.stage_done(
                "write", self.unit_count("write")
            ):
                stage_reports = self.area.commit_once(self._assemble, wait=array_task)
                if stage_reports is None and not array_task:
                    raise self.area.busy_error()
                result.finished, result.stages = stage_reports is not None, stage_reports or []
                if result.finished and self.backend is not None:  # the work area is gone: read what was recorded
                    result.token_estimates = read_manifest(self.output)["mix"]["token_estimate"]["sources"]
        except UserError as exc:
            if not array_task:
                self.area.clean_up_after(exc)
            raise
        result.seconds = time.perf_counter() - started
        return result

    def _run_units(self, stage: str, units: list[int], on_measure, on_stage) -> None:
        if stage == "measure":
            for unit in units:
                name, file_index = self.measure_units[unit]
                measured = measure_file(
                    self.sources[name],
                    file_index,
                    source_key(self.plan.seed, name),
                    self.plan.text_column,
                    self.backend,
                    self.token_sample(name),
                    on_measure,
                )
                save_arrays(self.area.stage_dir("measure") / f"{unit:05d}.npz", **measured)
                self.area.mark_done("measure", unit, {"rows": int(measured["documents"].sum())})
            return
        blocks, progress = self.blocks(), {}
        for unit in units:
            stage_index, block = blocks[unit]
            name = self.plan.stages[stage_index].name
            if name not in progress and on_stage:
                progress[name] = on_stage(
                    name, sum(self.block_rows(*blocks[u]) for u in units if blocks[u][0] == stage_index)
                )
            folder = self.area.stage_dir("write")
            if block is None:
                shards = write_curriculum(
                    self.plan, self.schema, self.sources, self.allocation(), stage_index, self.sizes, folder, unit
                )
            else:
                shards = write_block(
                    self.plan, self.schema, self.sources, self.allocation(), stage_index, block, folder, unit
                )
            rows = sum(shard["rows"] for shard in shards)
            self.area.mark_done("write", unit, {"rows": rows, "shards": shards})
            if progress.get(name):
                progress[name](rows)

    # -- the allocation, computed once from the measuring units ---------------------------------------------

    def allocation(self) -> dict:
        """Each stage's per-source reports and the pieces (pass, bin range, file, rows) of each slice, in reading
        order. Computed by the first task that needs it and kept in the work area (the same bytes whoever does)."""
        path = self.area.root / "allocation.json"
        if path.is_file():
            saved = read_work_file(path, lambda p: json.loads(p.read_text()))
            return {
                "reports": [
                    [SourceReport(**{**r, "ranges": [tuple(x) for x in r["ranges"]]}) for r in stage]
                    for stage in saved["reports"]
                ],
                "pieces": saved["pieces"],
                "calibrations": {n: TokenCalibration(**c) for n, c in saved["calibrations"].items()},
            }
        # Each source's files are read one at a time, twice (their sums, then their rows in each slice's ranges):
        # memory holds a few bin arrays, not every file's (1.6 MB each: 2,000 small shards took 3 GB).
        files = {name: [u for u, (owner, _) in enumerate(self.measure_units) if owner == name] for name in self.sources}

        def measured(unit: int, read=lambda p: dict(np.load(p))):
            return read_work_file(self.area.stage_dir("measure") / f"{unit:05d}.npz", read)

        profiles, calibrations = {}, {}
        for name, source in self.sources.items():
            totals: dict[str, np.ndarray] = {}
            samples: dict[str, list[np.ndarray]] = {"sample_bytes": [], "sample_extra": [], "sample_tokens": []}
            for unit in files[name]:
                for key, value in measured(unit).items():
                    if key in samples:
                        samples[key].append(value)
                    else:
                        totals[key] = totals[key] + value if key in totals else value
            units, documents = totals["units"], totals["documents"]
            if samples["sample_bytes"]:  # units are bytes outside the sample: estimate their tokens from it
                sample = {key: np.concatenate(parts) for key, parts in samples.items()}
                large_bytes, large_extra = int(totals["large_bytes"]), int(totals["large_extra"])
                calibrations[name] = calibrate(
                    name,
                    sample["sample_bytes"],
                    sample["sample_extra"],
                    sample["sample_tokens"],
                    source_documents=int(documents.sum()),
                    source_bytes=int(units.sum() + sample["sample_bytes"].sum()) + large_bytes,
                    source_extra_bytes=int(totals["extra"].sum() + sample["sample_extra"].sum()) + large_extra,
                    estimated_documents=int(totals["nonempty"].sum()),
                    large_document_bytes=self.token_sample(name).large_bytes,
                    large_documents=int(totals["large_documents"]),
                    large_bytes=large_bytes,
                    large_extra_bytes=large_extra,
                    large_tokens=int(totals["large_tokens"]),
                )
                units = calibrations[name].estimate(units, totals["extra"], totals["nonempty"]) + totals["sampled"]
            profiles[name] = SourceProfile(name, source, source_key(self.plan.seed, name), units, documents)
        reports = allocate(self.plan, profiles)
        ranges: dict[str, set] = {}
        for report in (r for stage in reports for r in stage):
            ranges.setdefault(report.name, set()).update(report.ranges)
        rows_in = {
            name: file_rows_in_ranges(
                (measured(u, lambda p: np.load(p)["documents"]) for u in files[name]), sorted(spans)
            )
            for name, spans in ranges.items()
            if spans
        }
        pieces = [
            {
                r.name: slice_pieces(self.plan, index, r.ranges, profiles[r.name].key, rows_in[r.name])
                for r in stage_reports
                if r.ranges
            }
            for index, stage_reports in enumerate(reports)
        ]
        atomic_write_json(
            path,
            {
                "reports": [[asdict(r) for r in stage] for stage in reports],
                "pieces": pieces,
                "calibrations": {n: asdict(c) for n, c in calibrations.items()},
            },
        )
        return self.allocation()

    def sizes(self, name: str, texts) -> np.ndarray:
        """A source's document sizes in the mix's unit: estimated from bytes for a sampled source."""
        calibration = self.allocation()["calibrations"].get(name)
        return calibration.sizes(texts, self.backend) if calibration else document_sizes(texts, self.backend)

    def token_estimates(self) -> dict[str, dict] | None:
        if self.backend is None:
            return None
        calibrations = self.allocation()["calibrations"]
        return {
            name: calibrations[name].to_dict() if name in calibrations else {"mode": "exact"} for name in self.sources
        }

    def blocks(self) -> list[tuple[int, int | None]]:
        """(stage, block) of every writing unit: the stages in order, each stage's blocks in order; a curriculum
        stage is one unit (stage, None)."""
        rows = [sum(r.documents for r in stage) for stage in self.allocation()["reports"]]
        size = self.plan.shuffle_buffer
        return [
            (index, None if self.plan.stages[index].ascending_by else block)
            for index, total in enumerate(rows)
            for block in range(min(1, total) if self.plan.stages[index].ascending_by else -(-total // size))
        ]

    def block_rows(self, stage_index: int, block: int | None) -> int:
        total = sum(r.documents for r in self.allocation()["reports"][stage_index])
        return total if block is None else min(self.plan.shuffle_buffer, total - block * self.plan.shuffle_buffer)

    # -- the commit ------------------------------------------------------------------------------------------

    def _assemble(self) -> list[StageReport]:
        """Link each stage's blocks into OUTPUT (one shard per block) with the manifests; swap it into place."""
        plan, blocks, allocation = self.plan, self.blocks(), self.allocation()
        inputs = [ref for source in self.sources.values() for ref in source.lineage()]
        if self.backend is not None and Path(plan.tokenizer).is_dir():  # it set the token weights
            inputs.append(lineage_ref(Path(plan.tokenizer)))
        stages: list[StageReport] = []
        with OutputFolder(self.output, kind=KIND_DOCUMENTS, overwrite=True, inputs=inputs) as top:
            for index, (stage, reports) in enumerate(zip(plan.stages, allocation["reports"])):
                units = [unit for unit, (owner, _) in enumerate(blocks) if owner == index]
                report = StageReport(
                    stage.name,
                    str(self.output / stage.name if plan.staged else self.output),
                    plan.unit,
                    stage.budget,
                    stage.budget_kind,
                    sum(r.units for r in reports),
                    sum(r.documents for r in reports),
                    reports,
                    sum(len(self.area.read_marker("write", unit)["shards"]) for unit in units),
                    stage.order,
                )
                stages.append(report)
                if not plan.staged:
                    self._link_blocks(top, units)
                    continue
                with OutputFolder(top.staging / stage.name, kind=KIND_DOCUMENTS, inputs=inputs) as folder:
                    self._link_blocks(folder, units)
                    folder.commit(
                        schema=schema_to_dict(self.schema),
                        stats=totals([report], plan.unit),
                        mix=self._mix_field([report]),
                    )
                top.shards += [{**shard, "name": f"{stage.name}/{shard['name']}"} for shard in folder.shards]
            top.commit(
                schema=schema_to_dict(self.schema),
                stats=totals(stages, plan.unit),
                mix=self._mix_field(stages),
                stages=[s.name for s in stages] if plan.staged else None,
                **{FINGERPRINT_KEY: self.area.digest},
            )
        return stages

    def _link_blocks(self, folder: OutputFolder, units: list[int]) -> None:
        for unit in units:
            for shard in self.area.read_marker("write", unit)["shards"]:
                name = f"part-{len(folder.shards):05d}.parquet"
                link_or_copy(self.area.stage_dir("write") / shard["file"], folder.file(name), shard.get("bytes"))
                folder.add_shard(name, shard["rows"], sha256=shard["sha256"])

    def _result(self, stages: list[StageReport], seconds: float, **fields) -> MixResult:
        plan = self.plan
        return MixResult(str(self.output), plan.unit, plan.seed, plan.max_repeat, stages, seconds, **fields)

    def _mix_field(self, stages: list[StageReport]) -> dict:
        """The manifest's record of the mix: unit, seed, max_repeat, tokenizer, how tokens were counted (the
        requested mode and each source's calibration) and per stage and source numbers."""
        plan = self.plan
        return {
            "unit": plan.unit,
            "seed": plan.seed,
            "max_repeat": plan.max_repeat,
            # Named as pack names it: resolved where it is a local folder, and by what it tokenizes.
            "tokenizer": None
            if self.backend is None
            else {
                "path": str(Path(plan.tokenizer).resolve()) if Path(plan.tokenizer).exists() else plan.tokenizer,
                "fingerprint": self.area.fingerprint["tokenizer"],
            },
            "token_estimate": None
            if self.backend is None
            else {
                "requested": plan.token_estimate,
                "token_sample": plan.token_sample,
                "sources": self.token_estimates(),
            },
            "stages": [stage_manifest(stage) for stage in stages],
        }


def stage_manifest(stage: StageReport) -> dict:
    return {
        "name": stage.name,
        "order": stage.order,
        "budget": stage.budget,
        "budget_kind": stage.budget_kind,
        "units": stage.units,
        "documents": stage.documents,
        "sources": [{k: v for k, v in asdict(s).items() if k != "ranges"} for s in stage.sources],
    }


def totals(stages: list[StageReport], unit: str) -> dict:
    return {unit: sum(s.units for s in stages), "documents": sum(s.documents for s in stages)}


def prepare_mix(plan: MixSchedule, output: str | Path, *, overwrite: bool = False) -> MixJob:
    """Open and check every source, unify their schemas, load the tokenizer: before any work. The output folder
    is checked by `MixJob.run` (an array task may find it already committed by its own run)."""
    if plan.text_column == SOURCE_COLUMN:
        raise UserError(
            "--text-column",
            f"'{SOURCE_COLUMN}' is where mix writes each document's source name, so the text would be lost",
            "rename the sources' text column (e.g. to text)",
        )
    used = [name for name in plan.sources if any(stage.share(name) > 0 for stage in plan.stages)]
    sources = {}
    read_by: dict[Path, str] = {}
    # The shards a mix writes, each stage's in a folder of its own when it has stages.
    shards = [f"{stage.name}/part-00000.parquet" for stage in plan.stages] if plan.staged else ["part-00000.parquet"]
    for name in used:
        source = open_documents(plan.sources[name], sized_columns=[plan.text_column])  # for TokenSample
        source.require(text=[plan.text_column])
        source.check_output_spares(output, shards=shards)
        for file in source.files:
            if (first := read_by.setdefault(file.resolve(), name)) != name:
                raise UserError(
                    f"source '{name}'",
                    f"reads {file}, as source '{first}' does: its documents would be mixed under both names",
                    "give each file to one source (--max-repeat samples a source more than once)",
                )
        sources[name] = source
    schema = output_schema({name: source.schema for name, source in sources.items()})
    check_order_columns(plan, {name: source.schema for name, source in sources.items()})
    backend, tokenizer = None, None
    if plan.tokenizer:
        from smolctl.data.tokenizer import document_end_id, load_rust_tokenizer

        loaded = load_rust_tokenizer(plan.tokenizer)
        document_end_id(plan.tokenizer, loaded)  # counted after every document, as pack appends it
        backend, tokenizer = loaded.backend, loaded.fingerprint
    fingerprint = {
        "measurements": MEASUREMENTS_VERSION,
        "plan": asdict(plan),
        "input_files": {name: file_identity(s.files) for name, s in sources.items()},
        "tokenizer": tokenizer,
    }
    return MixJob(
        plan,
        Path(output),
        overwrite,
        sources,
        schema,
        backend,
        WorkArea(Path(output), STAGES, fingerprint),
        {name: plan.sample_fraction(source.num_rows) for name, source in sources.items()},
    )

"""`smolctl mix`: weighted, staged mixtures of document sources, streamed, with a deterministic shuffle.

    smolctl mix demo-out/mix --recipe recipes/demo-mix.toml
    smolctl mix out/ --source web=data/sample/web:0.7 --source code=data/sample/code:0.3 --bytes 1MB

How it works, streaming each source once to measure it and once per stage that uses it (memory: two arrays of
2**16 bins per source, the shuffle buffer, and one batch per source; never a whole source):
1. Measure. Every document gets a bin from a hash of (seed, source name, row index) and its size (tokens with
   EOS, as `pack` will count them, when a tokenizer is given; UTF-8 bytes otherwise) is added to that bin. The
   bins order each source randomly; an "epoch" walks the bins 0..65535.
2. Allocate. Each stage's budget is split by weight; each source's share is a slice of its endless, repeating
   walk through the bins, continuing where the previous stage stopped (so stages see fresh documents first).
   The slice ends at the bin boundary nearest the target, so achieved weights are exact to a bin (1/65536 of a
   source) or a document, whichever is larger, and are computed from the bins without re-reading anything.
   A slice that walks the source more than `max_repeat` times is an error that says what weight it can carry.
3. Write. Each source streams the rows of its slice (files in a seeded order). Each row is due at the point of
   the stage where the (possibly interpolated) schedule wants it; rows are merged by due point and written in
   blocks of `shuffle_buffer` rows, each block shuffled with a seeded generator: every block holds the sources in
   proportion, and the same seed gives the same bytes. A curriculum stage (`order = "ascending:SCORE"`) sorts
   each source's slice and each block by score instead (see mix_plan.py).
"""

from __future__ import annotations

import hashlib
import heapq
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from smolctl.data.mix_plan import (
    ORDER_COLUMN,
    MixPlan,
    Stage,
    ascending_stream,
    block_order,
    check_order_columns,
)
from smolctl.errors import UserError
from smolctl.shards import (
    KIND_DOCUMENTS,
    DatasetWriter,
    DocumentSource,
    OutputFolder,
    check_output_path,
    open_documents,
    schema_to_dict,
)

BIN_BITS = 16
BINS = 1 << BIN_BITS
SOURCE_COLUMN = "source"

# ---------------------------------------------------------------------------------------------------------------
# Pass 1: measure every source into hash bins


def source_key(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}\0{name}".encode()).digest()[:8], "little")


def row_bins(key: int, rows: np.ndarray) -> np.ndarray:
    """A bin in [0, BINS) for each global row index: splitmix64 of (row, key), top bits. Pure, vectorised."""
    z = (rows.astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(key)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return (z >> np.uint64(64 - BIN_BITS)).astype(np.int64)


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

    def file_offsets(self) -> list[int]:
        return np.concatenate([[0], np.cumsum(self.source.file_rows)]).astype(int).tolist()


def document_sizes(texts: pa.Array, backend) -> np.ndarray:
    """Tokens (ids + the EOS `pack` appends; 0 for an empty document) or UTF-8 bytes of each document."""
    if backend is None:
        return pc.fill_null(pc.binary_length(texts), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    from smolctl.data.pack import encode_texts

    lengths = encode_texts(backend, [t if t is not None else "" for t in texts.to_pylist()]).lengths
    return np.where(lengths > 0, lengths + 1, 0)


def measure(name: str, source: DocumentSource, key: int, text_column: str, backend,
            on_rows: Callable[[int], None] | None = None) -> SourceProfile:
    units = np.zeros(BINS, dtype=np.int64)
    documents = np.zeros(BINS, dtype=np.int64)
    row = 0
    for batch in source.iter_batches(columns=[text_column], batch_size=4096):
        bins = row_bins(key, np.arange(row, row + batch.num_rows))
        units += np.bincount(bins, weights=document_sizes(batch.column(0), backend), minlength=BINS).astype(np.int64)
        documents += np.bincount(bins, minlength=BINS)
        row += batch.num_rows
        if on_rows:
            on_rows(batch.num_rows)
    return SourceProfile(name, source, key, units, documents)


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


def bin_boundary(cumulative: np.ndarray, position: float) -> int:
    """The global bin boundary (epochs × BINS + bin) whose walk position is nearest `position` units."""
    total = int(cumulative[-1])
    epoch, within = divmod(position, total)
    right = int(np.searchsorted(cumulative, within))
    left = max(0, right - 1)
    best = left if abs(cumulative[left] - within) <= abs(cumulative[min(right, BINS)] - within) else min(right, BINS)
    return int(epoch) * BINS + best


def walk_units(cumulative: np.ndarray, boundary: int) -> int:
    epoch, index = divmod(boundary, BINS)
    return epoch * int(cumulative[-1]) + int(cumulative[index])


def allocate(plan: MixPlan, profiles: dict[str, SourceProfile]) -> list[list[SourceReport]]:
    """Each stage's per-source slices. Raises a UserError for a weight that needs more than max_repeat."""
    cumulative = {n: np.concatenate([[0], np.cumsum(p.units)]) for n, p in profiles.items()}
    position = {name: 0 for name in profiles}  # global bin boundary reached by earlier stages
    allocations = []
    for stage in plan.stages:
        used = {n: s for n in profiles if (s := stage.share(n)) > 0}
        for name in used:
            if profiles[name].total_units == 0:
                raise UserError(f"source {name!r}", f"has no {plan.unit} (every document is empty)", "drop it or give it weight 0")
        room = {n: plan.max_repeat * profiles[n].total_units - walk_units(cumulative[n], position[n]) for n in used}
        if stage.budget_kind == "documents":
            units_per_doc = {n: profiles[n].total_units / max(1, profiles[n].total_documents) for n in used}
            total = stage.budget / sum(share / units_per_doc[n] for n, share in used.items())
        elif stage.budget is not None:
            total = float(stage.budget)
        else:
            total = min(room[n] / share for n, share in used.items())
            if total <= 0:
                raise UserError(f"stage {stage.name!r}", f"has no budget and earlier stages used its sources up to max_repeat {plan.max_repeat:g}",
                                "give the stage a budget, or raise --max-repeat")
        reports = []
        for name in profiles:
            profile, share = profiles[name], stage.share(name)
            report = SourceReport(name, stage.start[name], stage.end[name], share,
                                  source_units=profile.total_units, source_documents=profile.total_documents)
            if share > 0:
                check_room(plan, stage, profile, share, total, room[name])
                begin = position[name]
                end = max(begin, bin_boundary(cumulative[name], walk_units(cumulative[name], begin) + share * total))
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


def check_room(plan: MixPlan, stage: Stage, profile: SourceProfile, share: float, total: float, room: float) -> None:
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

    A `source` column already in a source (e.g. an earlier mix) is replaced by the name given here.
    """
    try:
        merged = pa.unify_schemas([pa.schema([f for f in s if f.name != SOURCE_COLUMN]) for s in schemas.values()])
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        first: dict[str, tuple[str, pa.DataType]] = {}
        for name, schema in schemas.items():
            for column in schema:
                seen = first.setdefault(column.name, (name, column.type))
                if seen[1] != column.type:
                    raise UserError(f"source {name!r}", f"column '{column.name}' is {column.type} but {seen[1]} in "
                                    f"source {seen[0]!r}", "cast it to one type in every source") from exc
        raise UserError("--source", f"the sources' schemas do not combine ({exc})", "give them compatible columns") from exc
    return merged.append(pa.field(SOURCE_COLUMN, pa.string()))


def conform(batch: pa.RecordBatch, schema: pa.Schema, name: str) -> pa.Table:
    columns = [batch.column(f.name) if f.name in batch.schema.names else pa.nulls(batch.num_rows, f.type)
               for f in schema if f.name != SOURCE_COLUMN]
    columns.append(pa.array([name] * batch.num_rows, pa.string()))
    return pa.Table.from_arrays(columns, schema=schema)


def due_points(stage: Stage, name: str, progress: np.ndarray) -> np.ndarray:
    """Where in the stage (0..1) a source's rows belong, given how far through its slice each row is (0..1).

    With weights moving linearly from a to b, the source's cumulative share at stage point x is
    a·x + (b - a)·x²/2, normalised by its total (a + b)/2; this solves that for x.
    """
    a, b = stage.start[name], stage.end[name]
    curve = (b - a) / 2
    if abs(curve) < 1e-12:
        return progress
    target = progress * (a + b) / 2
    return (-a + np.sqrt(np.maximum(a * a + 4 * curve * target, 0.0))) / (2 * curve)


def stream_rows(profile: SourceProfile, report: SourceReport, stage: Stage, plan: MixPlan, schema: pa.Schema,
                stage_index: int) -> Iterator[tuple[pa.Table, np.ndarray]]:
    """(rows, due points) of one source's slice, one read pass per bin range, files in a seeded order."""
    offsets = profile.file_offsets()
    emitted = 0
    for pass_index, (lo, hi) in enumerate(report.ranges):
        rng = np.random.default_rng([plan.seed, profile.key % 2**32, stage_index, pass_index])
        for file_index in rng.permutation(len(profile.source.files)).tolist():
            row = offsets[file_index]
            for batch in profile.source.iter_file_batches(file_index, batch_size=1024):
                bins = row_bins(profile.key, np.arange(row, row + batch.num_rows))
                row += batch.num_rows
                keep = (bins >= lo) & (bins < hi)
                if not keep.any():
                    continue
                rows = conform(batch.filter(pa.array(keep)), schema, profile.name)
                progress = (emitted + np.arange(rows.num_rows) + 0.5) / max(1, report.documents)
                emitted += rows.num_rows
                yield rows, due_points(stage, profile.name, progress)


def merged_blocks(streams: list[Iterator[tuple[pa.Table, np.ndarray]]], block_rows: int, seed: int,
                  stage_index: int) -> Iterator[pa.Table]:
    """Merge the streams by due point; emit blocks of `block_rows` rows, each shuffled by a seeded generator.

    A row is ready once no stream can still produce an earlier due point (each stream's points only grow), so
    the buffer never holds more than a block plus one batch per source.
    """
    heap: list[tuple[float, int, pa.Table, np.ndarray]] = []
    buffer: list[tuple[pa.Table, np.ndarray]] = []
    blocks = 0

    def pull(index: int) -> None:
        for rows, due in streams[index]:
            heapq.heappush(heap, (float(due[0]), index, rows, due))
            return

    def ready_blocks(final: bool) -> Iterator[pa.Table]:
        nonlocal buffer, blocks
        rows = pa.concat_tables([t for t, _ in buffer]) if len(buffer) > 1 else buffer[0][0]
        points = np.concatenate([d for _, d in buffer])
        order = np.argsort(points, kind="stable")
        ready = len(order) if final else int(np.searchsorted(points[order], heap[0][0], side="right"))
        while ready >= block_rows or (final and ready > 0):
            take = min(block_rows, ready)
            block = rows.take(pa.array(block_order(rows, order[:take], seed, stage_index, blocks)))
            yield block.drop_columns([ORDER_COLUMN]) if ORDER_COLUMN in block.column_names else block
            blocks += 1
            order, ready = order[take:], ready - take
        buffer = [(rows.take(pa.array(order)), points[order])] if len(order) else []

    for index in range(len(streams)):
        pull(index)
    buffered = 0
    while heap:
        _, index, rows, due = heapq.heappop(heap)
        buffer.append((rows, due))
        buffered += rows.num_rows
        pull(index)
        if heap and buffered >= block_rows:
            yield from ready_blocks(final=False)
            buffered = sum(t.num_rows for t, _ in buffer)
    if buffer:
        yield from ready_blocks(final=True)


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

    def to_dict(self) -> dict:
        out = asdict(self)
        for stage in out["stages"]:
            for source in stage["sources"]:
                source.pop("ranges")
        return out


@dataclass
class MixJob:
    """A validated mix (sources opened, schemas unified, tokenizer loaded, output checked): see `prepare_mix`."""

    plan: MixPlan
    output: Path
    overwrite: bool
    sources: dict[str, DocumentSource]
    schema: pa.Schema
    backend: object

    @property
    def total_rows(self) -> int:
        return sum(source.num_rows for source in self.sources.values())

    def run(self, on_measure: Callable[[int], None] | None = None,
            on_stage: Callable[[str, int], Callable[[int], None]] | None = None) -> MixResult:
        """Measure, allocate, write. `on_stage(name, rows)` returns the per-block callback for that stage."""
        started = time.perf_counter()
        plan = self.plan
        profiles = {name: measure(name, source, source_key(plan.seed, name), plan.text_column, self.backend, on_measure)
                    for name, source in self.sources.items()}
        allocations = allocate(plan, profiles)
        inputs = [ref for source in self.sources.values() for ref in source.lineage()]
        stages: list[StageReport] = []
        with OutputFolder(self.output, kind=KIND_DOCUMENTS, overwrite=self.overwrite, inputs=inputs) as top:
            for index, (stage, reports) in enumerate(zip(plan.stages, allocations)):
                on_rows = on_stage(stage.name, sum(r.documents for r in reports)) if on_stage else None
                if not plan.staged:
                    stages.append(self._write_stage(top, self.output, index, stage, reports, profiles, on_rows))
                    continue
                with OutputFolder(top.staging / stage.name, kind=KIND_DOCUMENTS, inputs=inputs) as folder:
                    report = self._write_stage(folder, self.output / stage.name, index, stage, reports, profiles, on_rows)
                    folder.commit(schema=schema_to_dict(self.schema), stats=totals([report], plan.unit),
                                  mix=self._mix_field([report]))
                top.shards += [{**shard, "name": f"{stage.name}/{shard['name']}"} for shard in folder.shards]
                stages.append(report)
            top.commit(schema=schema_to_dict(self.schema), stats=totals(stages, plan.unit),
                       mix=self._mix_field(stages), stages=[s.name for s in stages] if plan.staged else None)
        return MixResult(str(self.output), plan.unit, plan.seed, plan.max_repeat, stages, time.perf_counter() - started)

    def _write_stage(self, folder: OutputFolder, path: Path, index: int, stage: Stage, reports: list[SourceReport],
                     profiles: dict[str, SourceProfile], on_rows: Callable[[int], None] | None) -> StageReport:
        plan = self.plan
        streams = [stream_rows(profiles[r.name], r, stage, plan, self.schema, index) for r in reports if r.ranges]
        if stage.ascending_by:
            streams = [ascending_stream(stream, stage, plan.text_column, lambda texts: document_sizes(texts, self.backend),
                                        lambda progress, name=r.name: due_points(stage, name, progress))
                       for stream, r in zip(streams, [r for r in reports if r.ranges])]
        writer = DatasetWriter(folder, schema=self.schema)
        for block in merged_blocks(streams, plan.shuffle_buffer, plan.seed, index):
            writer.write(block)
            if on_rows:
                on_rows(block.num_rows)
        writer.close()
        return StageReport(stage.name, str(path), plan.unit, stage.budget, stage.budget_kind,
                           sum(r.units for r in reports), sum(r.documents for r in reports), reports,
                           len(folder.shards), stage.order)

    def _mix_field(self, stages: list[StageReport]) -> dict:
        """The manifest's record of the mix: unit, seed, max_repeat, tokenizer and per stage and source numbers."""
        plan = self.plan
        return {"unit": plan.unit, "seed": plan.seed, "max_repeat": plan.max_repeat, "tokenizer": plan.tokenizer,
                "stages": [stage_manifest(stage) for stage in stages]}


def stage_manifest(stage: StageReport) -> dict:
    return {"name": stage.name, "order": stage.order, "budget": stage.budget, "budget_kind": stage.budget_kind,
            "units": stage.units, "documents": stage.documents,
            "sources": [{k: v for k, v in asdict(s).items() if k != "ranges"} for s in stage.sources]}


def totals(stages: list[StageReport], unit: str) -> dict:
    return {unit: sum(s.units for s in stages), "documents": sum(s.documents for s in stages)}


def prepare_mix(plan: MixPlan, output: str | Path, *, overwrite: bool = False) -> MixJob:
    """Open and check every source, unify their schemas, load the tokenizer, check the output: before any work."""
    used = [name for name in plan.sources if any(stage.share(name) > 0 for stage in plan.stages)]
    sources = {}
    for name in used:
        source = open_documents(plan.sources[name])
        source.require(text=[plan.text_column])
        sources[name] = source
    schema = output_schema({name: source.schema for name, source in sources.items()})
    check_order_columns(plan, {name: source.schema for name, source in sources.items()})
    check_output_path(Path(output), overwrite)
    backend = None
    if plan.tokenizer:
        from smolctl.data.tokenizer import load_tokenizer

        backend = load_tokenizer(plan.tokenizer).backend_tokenizer
    return MixJob(plan, Path(output), overwrite, sources, schema, backend)

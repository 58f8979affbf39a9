"""The writing pass of `smolctl mix`, one output block at a time (see smolctl/data/mix.py for the whole).

A stage's rows are ordered by due point, then source, then rank: a source's slice is a sequence of rows (bin
ranges one pass each, files in a seeded order, rows in file order) whose due points grow with their rank. That
order is defined without reading any text, so any block of it can be found on its own:
1. Where the block starts in each source: the number of the source's rows whose merged position is below the
   block's first position, by binary search over ranks (a rank's position counts the rows of the other sources
   due before it); the due points are computed, never stored.
2. Which rows those ranks are: the slice's pieces (pass, bin range, file, row count) from the measuring pass
   give the file; hashing that file's row indices (no read) gives the positions; only the row groups holding
   them are read.
3. The block's rows in merged order, shuffled by a generator seeded with (seed, stage, block).
So a block is the same bytes whether one process writes them all or each is a task of a Slurm array.

A curriculum stage (`order = "ascending:SCORE"`) orders each source's slice by score, which needs the whole
slice: it is written as one unit, its rows merged by due point (`merged_blocks`) and each block sorted by score.
"""

from __future__ import annotations

import hashlib
import heapq
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from smolctl.data.mix_schedule import ORDER_COLUMN, MixSchedule, Stage, ascending_stream, block_order
from smolctl.shards import check_valid_values, readable, sha256_file, unreadable_parquet

BIN_BITS = 16
BINS = 1 << BIN_BITS
SOURCE_COLUMN = "source"


def source_key(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}\0{name}".encode()).digest()[:8], "little")


def row_hash(key: int, rows: np.ndarray) -> np.ndarray:
    """A uniform 64-bit hash of each global row index: splitmix64 of (row, key). Pure, vectorised."""
    z = (rows.astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(key)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def row_bins(key: int, rows: np.ndarray) -> np.ndarray:
    """A bin in [0, BINS) for each global row index: the top bits of its hash."""
    return (row_hash(key, rows) >> np.uint64(64 - BIN_BITS)).astype(np.int64)


def conform(batch: pa.RecordBatch, schema: pa.Schema, name: str) -> pa.Table:
    """A source's rows in the output schema: its columns widened to the output's types, the ones it lacks null."""
    columns = [widened(batch, f) for f in schema if f.name != SOURCE_COLUMN]
    columns.append(pa.array([name] * batch.num_rows, pa.string()))
    return pa.Table.from_arrays(columns, schema=schema)


def widened(batch: pa.RecordBatch, field: pa.Field):
    if field.name not in batch.schema.names:
        return pa.nulls(batch.num_rows, field.type)
    column = batch.column(field.name)
    return column if column.type == field.type else column.cast(field.type)


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


@dataclass
class SliceOrder:
    """One source's slice of one stage: `documents` rows in rank order, and when each is due in the stage."""

    stage: Stage
    name: str
    documents: int

    def due(self, ranks: np.ndarray) -> np.ndarray:
        return due_points(self.stage, self.name, (ranks + 0.5) / max(1, self.documents))

    def due_at(self, rank: int) -> float:
        # Through the same vectorised arithmetic as whole blocks, so a rank's due point is the same bits here.
        return float(self.due(np.array([rank], dtype=np.int64))[0])

    def count_due_before(self, point: float, inclusive: bool) -> int:
        """How many of the slice's rows are due before `point` (or at it, when inclusive); due points never fall
        as the rank grows, so a binary search over ranks."""
        lo, hi = 0, self.documents
        while lo < hi:
            mid = (lo + hi) // 2
            due = self.due_at(mid)
            if due < point or (inclusive and due == point):
                lo = mid + 1
            else:
                hi = mid
        return lo


def rows_before(slices: list[SliceOrder], position: int) -> list[int]:
    """For each slice, how many of its rows come before `position` in the stage's merged order (due point,
    then slice index, then rank)."""
    if position >= sum(s.documents for s in slices):
        return [s.documents for s in slices]
    counts = []
    for j, own in enumerate(slices):
        lo, hi = 0, own.documents
        while lo < hi:  # the smallest rank whose merged position is at or past `position`
            mid = (lo + hi) // 2
            due = own.due_at(mid)
            merged = mid + sum(other.count_due_before(due, inclusive=i < j) for i, other in enumerate(slices) if i != j)
            if merged >= position:
                hi = mid
            else:
                lo = mid + 1
        counts.append(lo)
    return counts


def read_rows(path, positions: np.ndarray) -> pa.Table:
    """Rows at the given sorted positions of one parquet file, reading only the row groups that hold them."""
    try:
        handle = pq.ParquetFile(path)
        sizes = [handle.metadata.row_group(i).num_rows for i in range(handle.num_row_groups)]
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        first = int(np.searchsorted(bounds, positions[0], side="right")) - 1
        last = int(np.searchsorted(bounds, positions[-1], side="right")) - 1
        table = handle.read_row_groups(list(range(first, last + 1)), use_threads=False)
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
        raise unreadable_parquet(path, exc) from exc
    rows = readable(table).take(pa.array(positions - bounds[first]))
    check_valid_values(rows, path, positions)
    return rows


def slice_rows(source, key: int, pieces: list[list[int]], begin: int, end: int) -> list[pa.Table]:
    """Ranks [begin, end) of a source's slice as tables, in rank order. `pieces` are the slice's
    [pass, lo, hi, file, rows] runs in reading order."""
    offsets = np.concatenate([[0], np.cumsum(source.file_rows)]).astype(np.int64)
    tables, start = [], 0
    for _, lo, hi, file_index, rows in pieces:
        first, stop = max(begin, start) - start, min(end, start + rows) - start
        if first < stop:
            bins = row_bins(key, np.arange(offsets[file_index], offsets[file_index + 1]))
            positions = np.flatnonzero((bins >= lo) & (bins < hi))[first:stop]
            picked = read_rows(source.files[file_index], positions)
            tables.append(source.with_partitions(picked, file_index) if source.partitions else picked)
        start += rows
        if start >= end:
            break
    return tables


def file_rows_in_ranges(file_documents: Iterable[np.ndarray], ranges: list[tuple[int, int]]) -> dict:
    """{(lo, hi): each file's documents in bins [lo, hi)}, from each file's documents per bin, read one at a time."""
    rows: dict[tuple[int, int], list[int]] = {span: [] for span in ranges}
    for documents in file_documents:
        cumulative = np.concatenate([[0], np.cumsum(documents)])
        for lo, hi in ranges:
            rows[(lo, hi)].append(int(cumulative[hi] - cumulative[lo]))
    return rows


def slice_pieces(
    plan: MixSchedule, stage_index: int, ranges: list, key: int, rows_in: dict[tuple[int, int], list[int]]
) -> list[list[int]]:
    """A source's slice as [pass, lo, hi, file, rows] runs in reading order: each bin range one pass, the files of
    a pass in a seeded order, the rows of a file in the range in file order. `rows_in`: `file_rows_in_ranges`."""
    pieces = []
    for pass_index, (lo, hi) in enumerate(ranges):
        rng = np.random.default_rng([plan.seed, key % 2**32, stage_index, pass_index])
        in_range = rows_in[(lo, hi)]
        for file_index in rng.permutation(len(in_range)).tolist():
            if in_range[file_index]:
                pieces.append([pass_index, lo, hi, file_index, in_range[file_index]])
    return pieces


def write_block(
    plan: MixSchedule,
    schema: pa.Schema,
    sources: dict,
    allocation: dict,
    stage_index: int,
    block: int,
    folder: Path,
    unit: int,
) -> list[dict]:
    """One output block: its rows from every source, in merged order, shuffled; written as one parquet shard."""
    stage = plan.stages[stage_index]
    reports = [r for r in allocation["reports"][stage_index] if r.documents]
    slices = [SliceOrder(stage, r.name, r.documents) for r in reports]
    begin = rows_before(slices, block * plan.shuffle_buffer)
    end = rows_before(slices, (block + 1) * plan.shuffle_buffer)
    tables, due, owner, rank = [], [], [], []
    for index, (report, order, first, stop) in enumerate(zip(reports, slices, begin, end)):
        if first == stop:
            continue
        pieces = allocation["pieces"][stage_index][report.name]
        key = source_key(plan.seed, report.name)
        tables += [conform(t, schema, report.name) for t in slice_rows(sources[report.name], key, pieces, first, stop)]
        due.append(order.due(np.arange(first, stop)))
        owner.append(np.full(stop - first, index))
        rank.append(np.arange(first, stop))
    order = np.lexsort((np.concatenate(rank), np.concatenate(owner), np.concatenate(due)))
    shuffle = np.random.default_rng([plan.seed, stage_index, block]).permutation(len(order))
    return [write_shard(pa.concat_tables(tables).take(pa.array(order[shuffle])), folder / f"{unit:05d}.parquet")]


def write_curriculum(
    plan: MixSchedule,
    schema: pa.Schema,
    sources: dict,
    allocation: dict,
    stage_index: int,
    sizes: Callable[[str, pa.Array], np.ndarray],
    folder: Path,
    unit: int,
) -> list[dict]:
    """A curriculum stage as one unit: each source's whole slice sorted by score (mix_schedule.ascending_stream),
    merged by due point, each block sorted by score; one shard per block. `sizes(source, texts)` sizes the
    documents in the mix's unit."""
    stage = plan.stages[stage_index]
    streams = []
    for report in [r for r in allocation["reports"][stage_index] if r.documents]:
        key, pieces = source_key(plan.seed, report.name), allocation["pieces"][stage_index][report.name]
        rows = pa.concat_tables(
            conform(t, schema, report.name) for t in slice_rows(sources[report.name], key, pieces, 0, report.documents)
        )
        order = SliceOrder(stage, report.name, report.documents)
        streams.append(
            ascending_stream(
                iter([(rows, order.due(np.arange(report.documents)))]),
                stage,
                plan.text_column,
                partial(sizes, report.name),
                lambda progress, name=report.name: due_points(stage, name, progress),
            )
        )
    return [
        write_shard(block, folder / f"{unit:05d}-{index:05d}.parquet")
        for index, block in enumerate(merged_blocks(streams, plan.shuffle_buffer, plan.seed, stage_index))
    ]


def write_shard(table: pa.Table, path: Path) -> dict:
    # The process's own temporary name: a requeued task may run while its first copy still does.
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table.combine_chunks(), tmp, compression="zstd")
    tmp.replace(path)
    return {"file": path.name, "rows": table.num_rows, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def merged_blocks(
    streams: list[Iterator[tuple[pa.Table, np.ndarray]]], block_rows: int, seed: int, stage_index: int
) -> Iterator[pa.Table]:
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


def save_arrays(path: Path, **arrays: np.ndarray) -> None:
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}.npz")  # a copy of the same task may be writing it too
    np.savez_compressed(tmp, **arrays)
    tmp.replace(path)

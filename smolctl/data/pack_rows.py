"""Packing token batches into fixed-length rows: numpy and the optional C kernels of _pack.c, no I/O.

Every document arrives with its EOS. Position ids restart at 0 at each document start (and at each row start),
so the trainer and transformers' packed-sequence masking keep attention inside a document. Padding slots hold
the pad id and position -1.

- `bfd`: documents longer than seq_len are first split into full rows (or truncated), then the rest are placed
  best-fit-decreasing over a bounded buffer of tokens: each document, longest first, goes into the open row with
  the least room that still fits it. Open rows are bucketed by free room and a bitmask of non-empty buckets finds
  the best fit in O(seq_len / 64) machine words, so the loop is per document, never per token. Every slot of
  the rows is written once (each document's span copied to its place, then the padding); the buffer's rows come
  out in a seeded random order. The per-document loops run in C (_pack.c) where the extension was built, and
  in Python and numpy otherwise (the definitions here; same rows).
- `concat`: the documents are concatenated and cut every seq_len tokens; only the very last row is padded.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

try:
    from smolctl.data import _pack
except ImportError:  # built without a C compiler: the Python and numpy definitions below give the same rows
    _pack = None

PADDING_POSITION = -1


@dataclass
class PackStats:
    documents: int = 0
    """Non-empty documents packed (a split document counts once)."""
    tokens: int = 0
    """Real tokens written, EOS included, padding excluded."""
    rows: int = 0
    padding_tokens: int = 0
    skipped_empty: int = 0
    split_documents: int = 0
    truncated_documents: int = 0
    truncated_tokens: int = 0

    @property
    def padding_fraction(self) -> float:
        total = self.tokens + self.padding_tokens
        return self.padding_tokens / total if total else 0.0


@dataclass
class TokenBatch:
    """Documents as one flat int32 array of ids and their lengths (documents are contiguous, in order)."""

    ids: np.ndarray
    lengths: np.ndarray

    @property
    def starts(self) -> np.ndarray:
        return np.cumsum(self.lengths) - self.lengths


@dataclass
class Rows:
    input_ids: np.ndarray
    position_ids: np.ndarray
    row_tokens: np.ndarray


def segment_positions(starts_mask: np.ndarray) -> np.ndarray:
    """Positions that count up from 0 at every True in `starts_mask` (index 0 must be True)."""
    index = np.arange(len(starts_mask), dtype=np.int64)
    last_start = np.maximum.accumulate(np.where(starts_mask, index, 0))
    return (index - last_start).astype(np.int32)


def split_long_documents(
    batch: TokenBatch, seq_len: int, mode: str, stats: PackStats
) -> tuple[TokenBatch, list[TokenBatch]]:
    """Documents longer than seq_len: `split` cuts their leading full rows off (returned as batches of
    seq_len-token documents, one per long document), the remainder stays a document; `truncate` keeps their
    first seq_len tokens. Copies the kept spans, not tokens one by one.

    The full rows are views of the batch's ids where they are most of its tokens (a piece of books: copying
    them would double it), else copies: a view keeps the whole batch alive beside the kept copy, so a few long
    documents among many short ones would make a buffer hold its tokens twice."""
    long = np.flatnonzero(batch.lengths > seq_len)
    if len(long) == 0:
        return batch, []
    starts, long_lengths = batch.starts[long], batch.lengths[long]
    if mode == "truncate":
        stats.truncated_documents += len(long)
        stats.truncated_tokens += int((long_lengths - seq_len).sum())
        removed_from, removed_to = starts + seq_len, starts + long_lengths
        lengths = np.minimum(batch.lengths, seq_len)
    else:
        stats.split_documents += len(long)
        whole = long_lengths // seq_len * seq_len
        removed_from, removed_to = starts, starts + whole
        lengths = batch.lengths.copy()
        lengths[long] -= whole
        lengths = lengths[lengths > 0]
    keep_from = [0, *removed_to.tolist()]
    keep_to = [*removed_from.tolist(), len(batch.ids)]
    kept = np.concatenate([batch.ids[a:b] for a, b in zip(keep_from, keep_to)])
    if mode == "truncate":
        return TokenBatch(kept, lengths), []
    as_views = len(kept) <= len(batch.ids) - len(kept)
    full_rows = []
    for a, b in zip(removed_from.tolist(), removed_to.tolist()):
        ids = batch.ids[a:b] if as_views else batch.ids[a:b].copy()
        full_rows.append(TokenBatch(ids, np.full((b - a) // seq_len, seq_len, dtype=np.int64)))
    return TokenBatch(kept, lengths), full_rows


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Place items (each <= capacity), longest first, into the open bin with the least room that fits.

    Returns (bin of each item, offset of each item in its bin, number of bins): _pack.c's kernel, or
    `best_fit_decreasing_python` (its definition) without the extension.
    """
    if _pack is None:
        return best_fit_decreasing_python(lengths, capacity)
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable").astype(np.int64)
    bin_of, offset = np.empty(len(lengths), dtype=np.int64), np.empty(len(lengths), dtype=np.int64)
    bins = _pack.best_fit_decreasing(lengths, order, capacity, bin_of, offset)
    return bin_of, offset, bins


def best_fit_decreasing_python(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray, int]:
    """`best_fit_decreasing` one item at a time in Python. Items are taken in stable order of decreasing length;
    open bins are kept in stacks by free room (of bins with equal room, the last to reach it is used first);
    bit r of `rooms` is set when some open bin has exactly r free slots, so the best fit for an item of length n
    is the lowest set bit at or above n.
    """
    sizes = lengths.tolist()
    order = np.argsort(-lengths, kind="stable").tolist()
    by_room: list[list[int]] = [[] for _ in range(capacity + 1)]
    rooms = 0
    used: list[int] = []
    bin_of = [0] * len(sizes)
    offset = [0] * len(sizes)
    for item in order:
        need = sizes[item]
        above = rooms >> need
        if above:
            room = need + (above & -above).bit_length() - 1
            stack = by_room[room]
            target = stack.pop()
            if not stack:
                rooms ^= 1 << room
        else:
            target, room = len(used), capacity
            used.append(0)
        bin_of[item] = target
        offset[item] = used[target]
        used[target] += need
        left = room - need
        if left:
            if not by_room[left]:
                rooms |= 1 << left
            by_room[left].append(target)
    return np.asarray(bin_of, dtype=np.int64), np.asarray(offset, dtype=np.int64), len(used)


def span_indices(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """start, start + 1, ..., start + n - 1 for each (start, n), concatenated: one repeat and one arange."""
    ends = np.cumsum(lengths)
    return np.repeat(starts - (ends - lengths), lengths) + np.arange(int(ends[-1]) if len(ends) else 0)


def place_documents_numpy(
    batch: TokenBatch, slots: np.ndarray, flat_ids: np.ndarray, flat_positions: np.ndarray
) -> None:
    """_pack.place in numpy: document i goes to flat_ids[slots[i]:] and gets positions 0, 1, ... there (one
    scatter of the flat token array, whose documents are contiguous spans)."""
    targets = span_indices(slots, batch.lengths)
    flat_ids[targets] = batch.ids
    # Position of a token in its document: its index in the flat array minus its document's start.
    flat_positions[targets] = np.arange(len(batch.ids), dtype=np.int32) - np.repeat(
        batch.starts.astype(np.int32), batch.lengths
    )


def assemble_rows(
    batches: list[TokenBatch],
    row_of: np.ndarray,
    offset: np.ndarray,
    rows: int,
    seq_len: int,
    pad_id: int,
) -> Rows:
    """Lay out documents (document i of the batches, in order, at `offset[i]` of row `row_of[i]`) as `rows` rows;
    each row's documents fill it from slot 0 without gaps, the rest is padding. A full row cut from a long
    document is a document of seq_len tokens at offset 0: its positions run 0..seq_len-1 like any document's.

    Every slot is written exactly once: the documents' spans straight from each batch (no concatenated copy of
    the buffer), and only the padding slots with the pad id.
    """
    input_ids = np.empty((rows, seq_len), dtype=np.int32)
    position_ids = np.empty((rows, seq_len), dtype=np.int32)
    flat_ids, flat_positions = input_ids.reshape(-1), position_ids.reshape(-1)
    slots = (row_of * seq_len + offset).astype(np.int64, copy=False)  # the kernel takes int64 slots
    # Batch i's documents are slots[first[i]:first[i + 1]].
    first = np.concatenate([[0], np.cumsum([len(batch.lengths) for batch in batches])])
    if _pack is None:
        for i, batch in enumerate(batches):
            place_documents_numpy(batch, slots[first[i] : first[i + 1]], flat_ids, flat_positions)
    else:
        # The kernel releases the GIL: two threads place half of the tokens each. The last buffer is packed after
        # the tokenizer has finished, when a core would otherwise idle, and most of the time goes to the kernel
        # handing out the fresh pages of the rows, which it does for both threads at once.
        tokens = np.cumsum([len(batch.ids) for batch in batches])
        half = int(np.argmin(np.abs(tokens[:-1] - tokens[-1] / 2))) + 1 if len(batches) > 1 else 1

        def place(start: int, stop: int) -> None:
            for i in range(start, stop):
                _pack.place(
                    np.ascontiguousarray(batches[i].ids, dtype=np.int32),
                    np.ascontiguousarray(batches[i].lengths, dtype=np.int64),
                    slots[first[i] : first[i + 1]],
                    flat_ids,
                    flat_positions,
                )

        with ThreadPoolExecutor(1, thread_name_prefix="place") as helper:
            second_half = helper.submit(place, half, len(batches))
            place(0, half)
            second_half.result()
    lengths = np.concatenate([batch.lengths for batch in batches])
    fill = np.bincount(row_of, weights=lengths, minlength=rows).astype(np.int64)
    short = np.flatnonzero(fill < seq_len)
    padding = span_indices(short * seq_len + fill[short], seq_len - fill[short])
    flat_ids[padding] = pad_id
    flat_positions[padding] = PADDING_POSITION
    return Rows(input_ids, position_ids, fill)


class BfdPacker:
    """Buffers documents up to `buffer_tokens`, packs the buffer best-fit-decreasing, and emits its rows shuffled.

    The shuffle (seeded, per buffer) matters: BFD creates rows in order of decreasing document length, and the
    full rows cut from long documents come in runs; a trainer reading rows in order would see that drift.
    """

    def __init__(
        self,
        *,
        seq_len: int,
        long_docs: str,
        buffer_tokens: int,
        seed: int,
        pad_id: int,
        stats: PackStats,
        stream: int = 0,
    ):
        # `stream` (the unit being packed) joins the seed: each unit's buffers get their own shuffles.
        self.seq_len, self.long_docs, self.buffer_tokens, self.seed = seq_len, long_docs, buffer_tokens, seed
        self.stream = stream
        self.pad_id, self.stats = pad_id, stats
        self.pending: list[TokenBatch] = []
        self.pending_full: list[TokenBatch] = []  # full rows cut from long documents, one row each
        self.pending_tokens = 0
        self.buffers = 0
        # numpy imports numpy.random on first use (~20 ms): here, while the tokenizer runs, not after the last batch.
        self.shuffles = np.random.default_rng

    def add(self, batch: TokenBatch, batch_ends: bool = True) -> Iterator[Rows]:
        """Buffer a batch of documents, or a piece of one. The buffer is packed only where an input batch ends
        (`batch_ends`), so the rows do not depend on how a batch was cut into pieces for the tokenizer."""
        batch, full_rows = split_long_documents(batch, self.seq_len, self.long_docs, self.stats)
        self.pending.append(batch)
        self.pending_full.extend(full_rows)
        self.pending_tokens += len(batch.ids) + sum(len(rows.ids) for rows in full_rows)
        if batch_ends and self.pending_tokens >= self.buffer_tokens:
            yield from self.finish()

    def finish(self) -> Iterator[Rows]:
        if not self.pending_tokens:
            return
        batches, full_rows = self.pending, self.pending_full
        self.pending, self.pending_full, self.pending_tokens = [], [], 0
        bin_of, offset, bins = best_fit_decreasing(np.concatenate([b.lengths for b in batches]), self.seq_len)
        whole = sum(len(rows.lengths) for rows in full_rows)
        # Shuffle by sending each BFD bin and each full row to a random output row.
        destination = self.shuffles([self.seed, self.stream, self.buffers]).permutation(bins + whole)
        self.buffers += 1
        yield assemble_rows(
            batches + full_rows,
            np.concatenate([destination[bin_of], destination[bins:]]),
            np.concatenate([offset, np.zeros(whole, dtype=np.int64)]),
            bins + whole,
            self.seq_len,
            self.pad_id,
        )


class ConcatPacker:
    """Concatenates documents and cuts every seq_len tokens; the tail waits for the next batch."""

    def __init__(self, *, seq_len: int, long_docs: str, pad_id: int, stats: PackStats):
        self.seq_len, self.long_docs, self.pad_id, self.stats = seq_len, long_docs, pad_id, stats
        self.tail_ids = np.empty(0, dtype=np.int32)
        self.tail_starts = np.empty(0, dtype=bool)

    def add(self, batch: TokenBatch, batch_ends: bool = True) -> Iterator[Rows]:
        """Rows are cut every seq_len tokens of the stream, wherever its batches (or their pieces) end."""
        if self.long_docs == "truncate":
            batch, _ = split_long_documents(batch, self.seq_len, "truncate", self.stats)
        else:
            self.stats.split_documents += int((batch.lengths > self.seq_len).sum())
        starts = np.zeros(len(batch.ids), dtype=bool)
        starts[batch.starts] = True
        ids = np.concatenate([self.tail_ids, batch.ids])
        is_start = np.concatenate([self.tail_starts, starts])
        cut = len(ids) // self.seq_len * self.seq_len
        self.tail_ids, self.tail_starts = ids[cut:], is_start[cut:]
        if cut:
            yield self._rows(ids[:cut], is_start[:cut])

    def _rows(self, ids: np.ndarray, is_start: np.ndarray) -> Rows:
        seq_len = self.seq_len
        is_start = is_start.copy()
        is_start[::seq_len] = True  # a document continuing from the previous row starts afresh: it cannot see it
        rows = len(ids) // seq_len
        return Rows(
            ids.reshape(rows, seq_len),
            segment_positions(is_start).reshape(rows, seq_len),
            np.full(rows, seq_len, dtype=np.int64),
        )

    def finish(self) -> Iterator[Rows]:
        if not len(self.tail_ids):
            return
        real = len(self.tail_ids)
        padding = self.seq_len - real
        rows = self._rows(
            np.concatenate([self.tail_ids, np.full(padding, self.pad_id, dtype=np.int32)]),
            np.concatenate([self.tail_starts, np.zeros(padding, dtype=bool)]),
        )
        rows.position_ids[0, real:] = PADDING_POSITION
        rows.row_tokens[0] = real
        self.tail_ids, self.tail_starts = np.empty(0, dtype=np.int32), np.empty(0, dtype=bool)
        yield rows

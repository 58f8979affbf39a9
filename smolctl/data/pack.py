"""Tokenise documents with the fast (Rust) tokenizer and pack them into fixed-length rows with position ids.

    smolctl pack demo-out/mix/stage-1 demo-out/packed --tokenizer demo-out/tokenizer --seq-len 256

Every document gets the tokenizer's EOS appended. Position ids restart at 0 at each document start (and at each
row start), so the trainer and transformers' packed-sequence masking keep attention inside a document. Padding
slots hold `pad_token_id` (EOS when the tokenizer has no pad) and position -1.

- `bfd`: documents longer than seq_len are first split into full rows (or truncated), then the rest are placed
  best-fit-decreasing over a bounded buffer of tokens: each document, longest first, goes into the open row with
  the least room that still fits it. Open rows are bucketed by free room and a bitmask of non-empty buckets finds
  the best fit in O(seq_len / 64) machine words, so the loop is per document, never per token; rows are
  assembled with numpy scatter.
- `concat`: the documents are concatenated and cut every seq_len tokens; only the very last row is padded.
"""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import asdict, dataclass, field
from itertools import chain
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from smolctl.errors import UserError
from smolctl.shards import (
    KIND_PACKED,
    OutputFolder,
    PackedWriter,
    check_output_path,
    lineage_ref,
    open_documents,
    parse_shard_size,
)

STRATEGIES = ("bfd", "concat")
LONG_DOCS = ("split", "truncate")
PADDING_POSITION = -1


@dataclass(kw_only=True)
class PackConfig:
    seq_len: int
    """Tokens per row (the training context length)."""
    strategy: str = "bfd"
    """`bfd` (best-fit-decreasing, pads only the rest of a row) or `concat` (concatenate and cut, no padding)."""
    long_docs: str = "split"
    """Documents longer than seq_len: `split` into seq_len pieces (no token lost) or `truncate` to seq_len."""
    text_column: str = "text"
    workers: int = 1
    """Tokeniser processes. 1 tokenises in this process (the Rust tokenizer still uses every core per batch)."""
    batch_documents: int = 1000
    """Documents per tokenizer call: large enough to amortise the call, small enough to stream."""
    buffer_tokens: int = 8_000_000
    """BFD packs this many tokens at a time (32 MB of int32 ids); a larger buffer leaves less padding."""
    shard_size: str = "256MB"
    seed: int = 0
    """Seeds the shuffle of each BFD buffer's rows (same seed, same output)."""

    def validate(self) -> None:
        if self.seq_len < 2:
            raise UserError("--seq-len", f"{self.seq_len} is too short", "use at least 2 (typically 2048-8192)")
        if self.strategy not in STRATEGIES:
            raise UserError("--strategy", f"unknown strategy {self.strategy!r}", f"use one of {', '.join(STRATEGIES)}")
        if self.long_docs not in LONG_DOCS:
            raise UserError("--long-docs", f"unknown choice {self.long_docs!r}", f"use one of {', '.join(LONG_DOCS)}")
        if self.workers < 1:
            raise UserError("--workers", f"{self.workers} is not a worker count", "use 1 or more")
        if self.buffer_tokens < self.seq_len:
            raise UserError("--buffer-tokens", f"{self.buffer_tokens} is smaller than seq_len {self.seq_len}",
                            "use a buffer of many rows (the default is 8M tokens)")

    def rows_per_shard(self) -> int:
        shard_bytes, shard_rows = parse_shard_size(self.shard_size)
        if shard_rows:
            return shard_rows
        return max(1, shard_bytes // (2 * 4 * self.seq_len))  # input_ids + position_ids, int32 each


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
class PackResult:
    output: str
    seq_len: int
    strategy: str
    long_docs: str
    tokenizer: dict
    stats: PackStats
    seconds: float
    shards: int = 0
    tokens_per_second: float = field(init=False)

    def __post_init__(self) -> None:
        self.tokens_per_second = self.stats.tokens / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["stats"]["padding_fraction"] = self.stats.padding_fraction
        return out


# ---------------------------------------------------------------------------------------------------------------
# Tokenising


@dataclass
class TokenBatch:
    """Documents as one flat int32 array of ids and their lengths (documents are contiguous, in order)."""

    ids: np.ndarray
    lengths: np.ndarray

    @property
    def starts(self) -> np.ndarray:
        return np.cumsum(self.lengths) - self.lengths

    @staticmethod
    def concat(batches: list["TokenBatch"]) -> "TokenBatch":
        if len(batches) == 1:
            return batches[0]
        return TokenBatch(np.concatenate([b.ids for b in batches]), np.concatenate([b.lengths for b in batches]))


def encode_texts(backend, texts: list[str]) -> TokenBatch:
    """Token ids of each text, no special tokens, via the Rust tokenizer's batch encoder (no offsets computed)."""
    encodings = backend.encode_batch_fast(texts, add_special_tokens=False)
    ids = [encoding.ids for encoding in encodings]
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
    return TokenBatch(flat, lengths)


def append_document_end(batch: TokenBatch, eos_id: int) -> tuple[TokenBatch, int]:
    """Drop empty documents and append EOS to the rest. Returns (batch, number of empty documents dropped)."""
    keep = batch.lengths > 0
    lengths = batch.lengths[keep] + 1
    ends = np.cumsum(lengths) - 1
    ids = np.empty(int(lengths.sum()), dtype=np.int32)
    is_text = np.ones(len(ids), dtype=bool)
    is_text[ends] = False
    ids[is_text] = batch.ids
    ids[ends] = eos_id
    return TokenBatch(ids, lengths), int((~keep).sum())


_worker_backend = None


def _init_worker(tokenizer_json: str) -> None:
    global _worker_backend
    import os

    # One Rust thread per worker process: the processes are the parallelism, threads would oversubscribe.
    os.environ["RAYON_NUM_THREADS"] = "1"
    from tokenizers import Tokenizer

    _worker_backend = Tokenizer.from_str(tokenizer_json)


def _encode_in_worker(item: tuple[int, list[str]]) -> tuple[int, TokenBatch]:
    group, texts = item
    return group, encode_texts(_worker_backend, texts)


def file_groups(source) -> list[list[int]]:
    """Input files grouped by mix stage (a whole `smolctl mix` output lists its stages' shards in order), so that
    packing never mixes two stages in one row or one shuffled buffer. Any other input is one group."""
    stages = (source.manifest or {}).get("stages")
    if not stages:
        return [list(range(len(source.files)))]
    groups: dict[str, list[int]] = {}
    for index, shard in enumerate(source.manifest["shards"]):
        groups.setdefault(shard["name"].split("/")[0], []).append(index)
    return list(groups.values())


def tokenised_batches(source, tokenizer, config: PackConfig) -> Iterator[tuple[int, int, TokenBatch]]:
    """(file group, documents read, token batch) in input order, tokenised here or by `workers` processes."""
    texts = ((group, [t if t is not None else "" for t in batch.column(0).to_pylist()])
             for group, files in enumerate(file_groups(source)) for index in files
             for batch in source.iter_file_batches(index, columns=[config.text_column],
                                                   batch_size=config.batch_documents))
    if config.workers == 1:
        backend = tokenizer.backend_tokenizer
        for group, chunk in texts:
            yield group, len(chunk), encode_texts(backend, chunk)
        return
    context = multiprocessing.get_context("spawn")  # fork after Rust threads have started can deadlock
    with context.Pool(config.workers, initializer=_init_worker, initargs=(tokenizer.backend_tokenizer.to_str(),)) as pool:
        for group, batch in pool.imap(_encode_in_worker, texts, chunksize=1):
            yield group, len(batch.lengths), batch


# ---------------------------------------------------------------------------------------------------------------
# Packing


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


def split_long_documents(batch: TokenBatch, seq_len: int, mode: str, stats: PackStats) -> tuple[TokenBatch, np.ndarray]:
    """Documents longer than seq_len: `split` cuts their leading full rows off (returned as an array of full rows,
    the remainder stays a document); `truncate` keeps their first seq_len tokens. Copies spans, not tokens one
    by one."""
    long = np.flatnonzero(batch.lengths > seq_len)
    if len(long) == 0:
        return batch, np.empty((0, seq_len), dtype=np.int32)
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
        return TokenBatch(kept, lengths), np.empty((0, seq_len), dtype=np.int32)
    rows = np.concatenate([batch.ids[a:b] for a, b in zip(removed_from.tolist(), removed_to.tolist())])
    return TokenBatch(kept, lengths), rows.reshape(-1, seq_len)


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Place items (each <= capacity), longest first, into the open bin with the least room that fits.

    Returns (bin of each item, offset of each item in its bin, number of bins). Open bins are kept in stacks
    by free room; bit r of `rooms` is set when some open bin has exactly r free slots, so the best fit for an item
    of length n is the lowest set bit at or above n.
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


def document_positions(lengths: np.ndarray) -> np.ndarray:
    """0..n-1 for each length n, concatenated: a cumulative sum of ones that drops back at each start."""
    steps = np.ones(int(lengths.sum()), dtype=np.int32)
    starts = np.cumsum(lengths)[:-1]
    steps[0] = 0
    steps[starts] = 1 - lengths[:-1]
    return np.cumsum(steps, dtype=np.int32)


def assemble_rows(pieces: list[np.ndarray], row_of: np.ndarray, rows: int, seq_len: int, pad_id: int) -> Rows:
    """Lay out pieces (already in row order, each row's pieces in order) as rows padded at the end.

    Filling the first `fill[r]` slots of each row in row-major order is one boolean-mask assignment, so every
    token is copied once (into `flat`) and once more into place.
    """
    lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
    fill = np.bincount(row_of, weights=lengths, minlength=rows).astype(np.int64)
    real = np.arange(seq_len) < fill[:, None]  # [rows, seq_len]
    input_ids = np.full((rows, seq_len), pad_id, dtype=np.int32)
    position_ids = np.full((rows, seq_len), PADDING_POSITION, dtype=np.int32)
    input_ids[real] = np.concatenate(pieces)
    position_ids[real] = document_positions(lengths)
    return Rows(input_ids, position_ids, fill)


class BfdPacker:
    """Buffers documents up to `buffer_tokens`, packs the buffer best-fit-decreasing, and emits its rows shuffled.

    The shuffle (seeded, per buffer) matters: BFD creates rows in order of decreasing document length, and the
    full rows cut from long documents come in runs; a trainer reading rows in order would see that drift.
    """

    def __init__(self, config: PackConfig, pad_id: int, stats: PackStats):
        self.config, self.pad_id, self.stats = config, pad_id, stats
        self.pending: list[TokenBatch] = []
        self.pending_full: list[np.ndarray] = []
        self.pending_tokens = 0
        self.buffers = 0

    def add(self, batch: TokenBatch) -> Iterator[Rows]:
        batch, whole = split_long_documents(batch, self.config.seq_len, self.config.long_docs, self.stats)
        self.pending.append(batch)
        self.pending_full.append(whole)
        self.pending_tokens += len(batch.ids) + whole.size
        if self.pending_tokens >= self.config.buffer_tokens:
            yield from self.finish()

    def finish(self) -> Iterator[Rows]:
        if not self.pending_tokens:
            return
        batch = TokenBatch.concat(self.pending)
        whole = np.concatenate(self.pending_full)
        self.pending, self.pending_full, self.pending_tokens = [], [], 0
        bin_of, offset, bins = best_fit_decreasing(batch.lengths, self.config.seq_len)
        # Shuffle by sending each BFD bin and each whole row to a random output row, then lay pieces out in
        # (output row, offset) order.
        destination = np.random.default_rng([self.config.seed, self.buffers]).permutation(bins + len(whole))
        self.buffers += 1
        row_of = np.concatenate([destination[bin_of], destination[bins:]])
        order = np.lexsort((np.concatenate([offset, np.zeros(len(whole), dtype=np.int64)]), row_of))
        starts, lengths, documents = batch.starts.tolist(), batch.lengths.tolist(), len(batch.lengths)
        pieces = [batch.ids[starts[i]:starts[i] + lengths[i]] if i < documents else whole[i - documents]
                  for i in order.tolist()]
        yield assemble_rows(pieces, row_of[order], bins + len(whole), self.config.seq_len, self.pad_id)


class ConcatPacker:
    """Concatenates documents and cuts every seq_len tokens; the tail waits for the next batch."""

    def __init__(self, config: PackConfig, pad_id: int, stats: PackStats):
        self.config, self.pad_id, self.stats = config, pad_id, stats
        self.tail_ids = np.empty(0, dtype=np.int32)
        self.tail_starts = np.empty(0, dtype=bool)

    def add(self, batch: TokenBatch) -> Iterator[Rows]:
        if self.config.long_docs == "truncate":
            batch, _ = split_long_documents(batch, self.config.seq_len, "truncate", self.stats)
        else:
            self.stats.split_documents += int((batch.lengths > self.config.seq_len).sum())
        starts = np.zeros(len(batch.ids), dtype=bool)
        starts[batch.starts] = True
        ids = np.concatenate([self.tail_ids, batch.ids])
        is_start = np.concatenate([self.tail_starts, starts])
        cut = len(ids) // self.config.seq_len * self.config.seq_len
        self.tail_ids, self.tail_starts = ids[cut:], is_start[cut:]
        if cut:
            yield self._rows(ids[:cut], is_start[:cut])

    def _rows(self, ids: np.ndarray, is_start: np.ndarray) -> Rows:
        seq_len = self.config.seq_len
        is_start = is_start.copy()
        is_start[::seq_len] = True  # a document continuing from the previous row starts afresh: it cannot see it
        rows = len(ids) // seq_len
        return Rows(ids.reshape(rows, seq_len), segment_positions(is_start).reshape(rows, seq_len),
                    np.full(rows, seq_len, dtype=np.int64))

    def finish(self) -> Iterator[Rows]:
        if not len(self.tail_ids):
            return
        real = len(self.tail_ids)
        padding = self.config.seq_len - real
        rows = self._rows(np.concatenate([self.tail_ids, np.full(padding, self.pad_id, dtype=np.int32)]),
                          np.concatenate([self.tail_starts, np.zeros(padding, dtype=bool)]))
        rows.position_ids[0, real:] = PADDING_POSITION
        rows.row_tokens[0] = real
        self.tail_ids, self.tail_starts = np.empty(0, dtype=np.int32), np.empty(0, dtype=bool)
        yield rows


# ---------------------------------------------------------------------------------------------------------------
# The command


def tokenizer_record(spec: str, tokenizer) -> dict:
    """How the packed manifest names its tokenizer (the convention `pretrain` and `inspect` read)."""
    from smolctl.data.tokenizer import document_end_id, tokenizer_fingerprint

    local = Path(spec).exists()
    eos = document_end_id(tokenizer)
    return {
        "path": str(Path(spec).resolve()) if local else spec,
        "name": Path(spec).resolve().name if local else spec,
        "fingerprint": tokenizer_fingerprint(tokenizer),
        "vocab_size": len(tokenizer),
        "eos_token_id": eos,
        "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
    }


@dataclass
class PackJob:
    """A validated pack: the input, tokenizer and output were checked before any work (see `prepare_pack`)."""

    input_spec: str
    output: Path
    config: PackConfig
    source: object
    tokenizer: object
    record: dict
    inputs: list[dict]
    overwrite: bool

    @property
    def total_documents(self) -> int:
        return self.source.num_rows

    def run(self, on_progress: Callable[[int, int], None] | None = None) -> PackResult:
        """Tokenise and pack; `on_progress(documents read, tokens packed)` is called after every batch."""
        config, stats = self.config, PackStats()
        started = time.perf_counter()
        packer_type = BfdPacker if config.strategy == "bfd" else ConcatPacker
        with OutputFolder(self.output, kind=KIND_PACKED, overwrite=self.overwrite, inputs=self.inputs) as folder:
            writer = PackedWriter(folder, rows_per_shard=config.rows_per_shard())
            packer = packer_type(config, self.record["pad_token_id"], stats)

            def write(all_rows: Iterator[Rows]) -> None:
                for rows in all_rows:
                    writer.write({"input_ids": rows.input_ids, "position_ids": rows.position_ids}, rows.row_tokens)
                    real = int(rows.row_tokens.sum())
                    stats.rows += len(rows.row_tokens)
                    stats.tokens += real
                    stats.padding_tokens += len(rows.row_tokens) * config.seq_len - real

            current_group = 0
            for group, read, batch in tokenised_batches(self.source, self.tokenizer, config):
                if group != current_group:
                    write(packer.finish())
                    current_group = group
                batch, empty = append_document_end(batch, self.record["eos_token_id"])
                stats.skipped_empty += empty
                stats.documents += len(batch.lengths)
                write(packer.add(batch))
                if on_progress:
                    on_progress(read, int(batch.lengths.sum()))
            write(packer.finish())
            if stats.documents == 0:
                raise UserError(self.input_spec, f"column '{config.text_column}' holds no non-empty documents "
                                f"({stats.skipped_empty} empty)", "pass a dataset with text")
            writer.close()
            folder.commit(
                schema={"input_ids": f"int32[{config.seq_len}]", "position_ids": f"int32[{config.seq_len}]"},
                stats=asdict(stats) | {"padding_fraction": stats.padding_fraction},
                seq_len=config.seq_len, strategy=config.strategy, long_docs=config.long_docs, tokenizer=self.record,
                documents=stats.documents, padding_tokens=stats.padding_tokens,
                padding_fraction=stats.padding_fraction, skipped_empty=stats.skipped_empty,
            )
            shards = len(folder.shards)
        return PackResult(str(self.output), config.seq_len, config.strategy, config.long_docs, self.record, stats,
                          time.perf_counter() - started, shards)


def prepare_pack(input_spec: str, output: str | Path, *, tokenizer_spec: str, config: PackConfig,
                 overwrite: bool = False) -> PackJob:
    """Check everything a pack needs (options, input columns, tokenizer, output folder) before any work."""
    from smolctl.data.tokenizer import load_tokenizer

    config.validate()
    config.rows_per_shard()
    source = open_documents(input_spec)
    source.require(text=[config.text_column])
    check_output_path(Path(output), overwrite)
    tokenizer = load_tokenizer(tokenizer_spec)
    record = tokenizer_record(tokenizer_spec, tokenizer)
    inputs = source.lineage() + ([lineage_ref(Path(tokenizer_spec))] if Path(tokenizer_spec).is_dir() else [])
    return PackJob(input_spec, Path(output), config, source, tokenizer, record, inputs, overwrite)


def pack(input_spec: str, output: str | Path, *, tokenizer_spec: str, config: PackConfig, overwrite: bool = False,
         on_progress: Callable[[int, int], None] | None = None) -> PackResult:
    """Tokenise and pack INPUT (any documents folder, parquet file or glob) into a packed folder at OUTPUT."""
    job = prepare_pack(input_spec, output, tokenizer_spec=tokenizer_spec, config=config, overwrite=overwrite)
    return job.run(on_progress)

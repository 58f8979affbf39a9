"""Packed training data: which rows make batch number n, and the labels that keep documents apart.

The order is a pure function of (seed, batch number) plus a small position (rows consumed per folder), so a
checkpoint holds a few integers and resume continues with exactly the batch the killed run would have drawn.
Every rank computes the same global batch and reads only its own slice of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from smolctl.errors import UserError
from smolctl.shards import PackedSource, open_packed
from smolctl.train.config import DataStage

IGNORE_INDEX = -100  # cross-entropy skips these labels (PyTorch's default ignore_index)


_MIX_1, _MIX_2 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)


def permuted_index(index: np.ndarray, n: int, key: Sequence[int]) -> np.ndarray:
    """Element `index` of a seeded random permutation of [0, n), computed pointwise in O(1) memory: a 4-round
    Feistel network over the next power of 4 with cycle walking (values >= n are encrypted again). A folder of
    billions of rows needs no permutation array, and any position of any epoch is one call away."""
    half = max(1, (max(1, n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    shift = np.uint64(half)
    round_keys = np.random.default_rng(list(key)).integers(0, 2**63, size=4, dtype=np.uint64)
    x = np.asarray(index, dtype=np.uint64).copy()
    todo = np.ones(x.shape, dtype=bool)
    while todo.any():
        left, right = x[todo] >> shift, x[todo] & mask
        for round_key in round_keys:
            mixed = (right ^ round_key) * _MIX_1
            mixed ^= mixed >> np.uint64(33)
            mixed *= _MIX_2
            mixed ^= mixed >> np.uint64(29)
            left, right = right, left ^ (mixed & mask)
        x[todo] = (left << shift) | right
        todo = x >= np.uint64(n)
    return x.astype(np.int64)


def fill_padding_positions(position_ids: np.ndarray) -> np.ndarray:
    """Padding (-1) runs become their own 0..k-1 pseudo-documents, so the packed-sequence mask that transformers
    derives from position ids keeps real tokens from attending to padding (and rotary sees valid positions)."""
    pad = position_ids < 0
    index = np.broadcast_to(np.arange(position_ids.shape[1]), position_ids.shape)
    run_starts = pad & ~np.pad(pad, ((0, 0), (1, 0)))[:, :-1]
    start_index = np.maximum.accumulate(np.where(run_starts, index, 0), axis=1)
    return np.where(pad, index - start_index, position_ids)


def make_labels(input_ids: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
    """Next-token labels, -100 where the next token starts a new document, is padding, or lies past the row end,
    and at padding itself: nothing is ever trained to predict across a document boundary."""
    labels = np.full_like(input_ids, IGNORE_INDEX, dtype=np.int64)
    labels[:, :-1] = input_ids[:, 1:]
    next_position = position_ids[:, 1:]
    crosses = (next_position <= 0) | (position_ids[:, :-1] < 0)
    labels[:, :-1][crosses] = IGNORE_INDEX
    return labels


def check_rows_start_documents(position_ids: np.ndarray) -> None:
    """flash_attention_2 runs a micro batch as one row of B·T tokens, finding documents where positions restart
    at 0: a row that began mid-document would attend to the previous row's last document."""
    if (position_ids[:, 0] != 0).any():
        raise UserError(
            "training.attention",
            "flash_attention_2 with micro_batch > 1 would let tokens attend across "
            "documents: some packed rows do not start at position 0",
            'pack the data with `smolctl pack`, set training.attention = "sdpa", or training.micro_batch = 1',
        )


@dataclass
class DataPosition:
    """Everything the stream needs to resume: batches drawn, rows consumed per folder, batches to skip."""

    batches_drawn: int = 0
    consumed: list[int] = field(default_factory=list)
    skip: list[int] = field(default_factory=list)

    def state_dict(self) -> dict:
        return {"batches_drawn": self.batches_drawn, "consumed": list(self.consumed), "skip": sorted(self.skip)}

    @classmethod
    def from_state(cls, state: dict) -> DataPosition:
        return cls(int(state["batches_drawn"]), [int(c) for c in state["consumed"]], [int(s) for s in state["skip"]])


class _RowReader:
    """Random access to rows of one packed folder through memory-mapped safetensors (nothing read whole)."""

    def __init__(self, source: PackedSource):
        self.source = source
        self.offsets = np.cumsum([0] + source.shard_rows)
        self._handles: dict[int, object] = {}

    def _handle(self, shard: int):
        from safetensors import safe_open

        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self.source.files[shard]), framework="numpy")
        return self._handles[shard]

    def read(self, rows: np.ndarray, key: str) -> np.ndarray:
        shards = np.searchsorted(self.offsets, rows, side="right") - 1
        out = []
        for row, shard in zip(rows.tolist(), shards.tolist()):
            local = row - int(self.offsets[shard])
            out.append(self._handle(shard).get_slice(key)[local : local + 1])
        return np.concatenate(out).astype(np.int64)


class PackedStream:
    """The batches of a run: stage mixtures over packed folders, sampled by a seeded generator per batch."""

    def __init__(self, stages: list[DataStage], *, seed: int, seq_len: int):
        self.seed = seed
        self.paths = list(dict.fromkeys(p for stage in stages for p in stage.paths))
        self.sources = [open_packed(p) for p in self.paths]
        for path, source in zip(self.paths, self.sources):
            if source.seq_len != seq_len:
                raise UserError(
                    path,
                    f"is packed at seq_len {source.seq_len} but training.seq_len is {seq_len}",
                    f"set training.seq_len = {source.seq_len} or re-pack with --seq-len {seq_len}",
                )
            if source.num_rows == 0:
                raise UserError(path, "holds no rows", "re-run `smolctl pack` on a non-empty dataset")
        self.stages = [(s.start_step, [self.paths.index(p) for p in s.paths], self._weights(s)) for s in stages]
        self.readers = [_RowReader(s) for s in self.sources]
        self.position = DataPosition(consumed=[0] * len(self.sources))
        self._last_drawn: list[tuple[int, int]] = []

    def _weights(self, stage: DataStage) -> np.ndarray:
        if stage.weights is not None:
            weights = np.asarray(stage.weights, dtype=np.float64)
        else:
            weights = np.asarray([self.sources[self.paths.index(p)].num_rows for p in stage.paths], dtype=np.float64)
        return weights / weights.sum()

    def tokenizer_info(self) -> dict:
        """The tokenizer record shared by all folders (UserError when two folders disagree)."""
        first = self.sources[0].manifest.get("tokenizer") or {}
        for path, source in zip(self.paths[1:], self.sources[1:]):
            other = source.manifest.get("tokenizer") or {}
            if other.get("fingerprint") != first.get("fingerprint"):
                raise UserError(
                    path,
                    f"was tokenised with {other.get('path')} but {self.paths[0]} with {first.get('path')}",
                    "re-pack every folder with the same tokenizer",
                )
            for key in ("eos_token_id", "pad_token_id"):  # one tokenizer.json, another EOS (base vs Instruct)
                if other.get(key) != first.get(key):
                    raise UserError(
                        path,
                        f"was packed with {key} {other.get(key)} ({other.get('path')}) but {self.paths[0]} with "
                        f"{first.get(key)} ({first.get('path')})",
                        "re-pack every folder with the same tokenizer folder",
                    )
        return first

    def _stage_at(self, step: int) -> tuple[list[int], np.ndarray]:
        current = self.stages[0]
        for stage in self.stages:
            if stage[0] <= step:
                current = stage
        return current[1], current[2]

    def _draw(self, step: int, global_batch: int) -> list[tuple[int, int]]:
        """(folder, row) for each sequence of the next global batch, advancing the position."""
        members, weights = self._stage_at(step)
        batch_number = self.position.batches_drawn
        self.position.batches_drawn += 1
        rng = np.random.default_rng([self.seed, 1_000_003, batch_number])
        choices = rng.choice(len(members), size=global_batch, p=weights)
        rows = np.empty(global_batch, dtype=np.int64)
        for k, source in enumerate(members):
            slots = np.flatnonzero(choices == k)
            start = self.position.consumed[source]
            self.position.consumed[source] += len(slots)
            # the n-th row read from a folder: epoch n // rows, position n % rows of that epoch's permutation
            counts = start + np.arange(len(slots))
            size = self.sources[source].num_rows
            for epoch in np.unique(counts // size).tolist():
                in_epoch = counts // size == epoch
                rows[slots[in_epoch]] = permuted_index(counts[in_epoch] % size, size, (self.seed, source, epoch))
        return [(members[k], int(row)) for k, row in zip(choices.tolist(), rows.tolist())]

    def next_batch(
        self, step: int, *, global_batch: int, rank: int, world_size: int
    ) -> tuple[int, np.ndarray, np.ndarray]:
        """This rank's slice of the next global batch, skipping batches a rollback marked as poisoned.
        Returns (batch number, input_ids, position_ids), arrays [global_batch / world_size, seq_len]."""
        while self.position.batches_drawn + 1 in self.position.skip:
            self._draw(step, global_batch)
        number = self.position.batches_drawn + 1
        picked = self._last_drawn = self._draw(step, global_batch)
        local = global_batch // world_size
        mine = picked[rank * local : (rank + 1) * local]
        return number, *self._read(mine)

    @property
    def last_drawn(self) -> list[tuple[int, int]]:
        """(folder, row) of every sequence of the last global batch drawn."""
        return list(self._last_drawn)

    def rows_of(self, drawn: list[tuple[int, int]]) -> list[dict]:
        """Where a drawn global batch came from, per shard file: the rows to look at when a guard fires on it
        (batches are drawn ahead by the prefetch thread, so the caller keeps `last_drawn` with its batch)."""
        by_shard: dict[tuple[int, int], list[int]] = {}
        for source, row in drawn:
            offsets = self.readers[source].offsets
            shard = int(np.searchsorted(offsets, row, side="right") - 1)
            by_shard.setdefault((source, shard), []).append(row - int(offsets[shard]))
        return [
            {"folder": self.paths[source], "shard": self.sources[source].files[shard].name, "rows": sorted(rows)}
            for (source, shard), rows in sorted(by_shard.items())
        ]

    def _read(self, picked: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        ids = np.empty((len(picked), self.sources[0].seq_len), dtype=np.int64)
        positions = np.empty_like(ids)
        for source in sorted({s for s, _ in picked}):
            slots = [i for i, (s, _) in enumerate(picked) if s == source]
            rows = np.asarray([picked[i][1] for i in slots])
            ids[slots] = self.readers[source].read(rows, "input_ids")
            positions[slots] = self.readers[source].read(rows, "position_ids")
        return ids, positions


def validation_batches(path: str, *, seq_len: int, micro_batch: int, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The first `count` micro batches of a held-out packed folder, in file order, so evaluations compare."""
    source = open_packed(path)
    if source.seq_len != seq_len:
        raise UserError(
            path,
            f"is packed at seq_len {source.seq_len} but training.seq_len is {seq_len}",
            "pack the validation folder with the training seq_len",
        )
    reader = _RowReader(source)
    rows = np.arange(min(source.num_rows, micro_batch * count))
    return [
        (reader.read(chunk, "input_ids"), reader.read(chunk, "position_ids"))
        for chunk in np.array_split(rows, max(1, -(-len(rows) // micro_batch)))
        if len(chunk)
    ]


@dataclass
class HostBatch:
    """One step's rows for this rank, ready to copy to the device (pinned when the device is a GPU)."""

    number: int
    input_ids: object  # torch (local_batch, T) int64
    position_ids: object
    labels: object
    position: dict
    """The stream position once this batch is consumed: what a checkpoint taken after this step records."""
    drawn: list
    """(folder, row) of every sequence of the global batch, for guard events (the stream has moved on)."""


class Prefetcher:
    """Prepares step n+1's batch on a background thread while step n computes. The stream's position moves
    ahead with it, so checkpoints record `HostBatch.position` (the consumed position), and `reset()` waits for
    the thread before anything rewinds the stream (resume, rollback)."""

    def __init__(self, produce):
        from concurrent.futures import ThreadPoolExecutor

        self._produce = produce
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="smolctl-prefetch")
        self._pending: tuple[int, object] | None = None

    def get(self, step: int) -> HostBatch:
        if self._pending is not None and self._pending[0] == step:
            batch = self._pending[1].result()
        else:
            self.reset()
            batch = self._produce(step)
        self._pending = (step + 1, self._pool.submit(self._produce, step + 1))
        return batch

    def reset(self) -> None:
        if self._pending is not None:
            try:
                self._pending[1].result()
            except Exception:  # an error in a batch nobody will consume is not this step's error
                pass
            self._pending = None

    def close(self) -> None:
        self.reset()
        self._pool.shutdown(wait=True)

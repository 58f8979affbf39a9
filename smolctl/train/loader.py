"""Packed training data: which rows make batch number n, and the labels that keep documents apart.

The order is a pure function of (seed, batch number) plus a small position (rows consumed per folder), so a
checkpoint holds a few integers and resume continues with exactly the batch the killed run would have drawn.
Every rank computes the same global batch and reads only its own slice of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from smolctl.errors import UserError
from smolctl.shards import PackedSource, open_packed
from smolctl.train.config import DataStage

IGNORE_INDEX = -100  # cross-entropy skips these labels (PyTorch's default ignore_index)


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


@dataclass
class DataPosition:
    """Everything the stream needs to resume: batches drawn, rows consumed per folder, batches to skip."""

    batches_drawn: int = 0
    consumed: list[int] = field(default_factory=list)
    skip: list[int] = field(default_factory=list)

    def state_dict(self) -> dict:
        return {"batches_drawn": self.batches_drawn, "consumed": list(self.consumed), "skip": sorted(self.skip)}

    @classmethod
    def from_state(cls, state: dict) -> "DataPosition":
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
            out.append(self._handle(shard).get_slice(key)[local:local + 1])
        return np.concatenate(out).astype(np.int64)


class PackedStream:
    """The batches of a run: stage mixtures over packed folders, sampled by a seeded generator per batch."""

    def __init__(self, stages: list[DataStage], *, seed: int, seq_len: int):
        self.seed = seed
        self.paths = list(dict.fromkeys(p for stage in stages for p in stage.paths))
        self.sources = [open_packed(p) for p in self.paths]
        for path, source in zip(self.paths, self.sources):
            if source.seq_len != seq_len:
                raise UserError(path, f"is packed at seq_len {source.seq_len} but training.seq_len is {seq_len}",
                                f"set training.seq_len = {source.seq_len} or re-pack with --seq-len {seq_len}")
            if source.num_rows == 0:
                raise UserError(path, "holds no rows", "re-run `smolctl pack` on a non-empty dataset")
        self.stages = [(s.start_step, [self.paths.index(p) for p in s.paths], self._weights(s)) for s in stages]
        self.readers = [_RowReader(s) for s in self.sources]
        self.position = DataPosition(consumed=[0] * len(self.sources))
        self._permutations: dict[tuple[int, int], np.ndarray] = {}

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
                raise UserError(path, f"was tokenised with {other.get('path')} but {self.paths[0]} with {first.get('path')}",
                                "re-pack every folder with the same tokenizer")
        return first

    def _permutation(self, source: int, epoch: int) -> np.ndarray:
        """Each pass over a folder visits its rows in a fresh seeded order (an epoch ends, the next reshuffles)."""
        key = (source, epoch)
        if key not in self._permutations:
            self._permutations = {k: v for k, v in self._permutations.items() if k[0] != source}
            rng = np.random.default_rng([self.seed, source, epoch])
            self._permutations[key] = rng.permutation(self.sources[source].num_rows)
        return self._permutations[key]

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
        picked = []
        for choice in choices.tolist():
            source = members[choice]
            count = self.position.consumed[source]
            self.position.consumed[source] += 1
            rows = self.sources[source].num_rows
            picked.append((source, int(self._permutation(source, count // rows)[count % rows])))
        return picked

    def next_batch(self, step: int, *, global_batch: int, rank: int, world_size: int) -> tuple[int, np.ndarray, np.ndarray]:
        """This rank's slice of the next global batch, skipping batches a rollback marked as poisoned.
        Returns (batch number, input_ids, position_ids), arrays [global_batch / world_size, seq_len]."""
        while self.position.batches_drawn + 1 in self.position.skip:
            self._draw(step, global_batch)
        number = self.position.batches_drawn + 1
        picked = self._draw(step, global_batch)
        local = global_batch // world_size
        mine = picked[rank * local:(rank + 1) * local]
        return number, *self._read(mine)

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
        raise UserError(path, f"is packed at seq_len {source.seq_len} but training.seq_len is {seq_len}",
                        "pack the validation folder with the training seq_len")
    reader = _RowReader(source)
    rows = np.arange(min(source.num_rows, micro_batch * count))
    return [(reader.read(chunk, "input_ids"), reader.read(chunk, "position_ids"))
            for chunk in np.array_split(rows, max(1, -(-len(rows) // micro_batch))) if len(chunk)]

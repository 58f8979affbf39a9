"""Where `smolctl pack` writes a unit's tokens: packed safetensors rows, or datatrove/nanotron token files."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict

import numpy as np

from smolctl.data.pack_config import PackConfig
from smolctl.data.pack_rows import BfdPacker, ConcatPacker, PackStats, Rows, TokenBatch
from smolctl.shards import OutputFolder, PackedWriter
from smolctl.units import parse_shard_size

DEFAULT_TOKEN_FILE_BYTES = 2**30  # token files roll at this size when --shard-size gives none


class RowSink:
    """Packs token batches into rows and writes them as safetensors shards (the packed folder)."""

    def __init__(self, folder: OutputFolder, config: PackConfig, record: dict, stats: PackStats, unit: int):
        self.config, self.record, self.stats = config, record, stats
        self.writer = PackedWriter(folder, rows_per_shard=config.rows_per_shard())
        pad_id = record["pad_token_id"]
        self.packer = (
            BfdPacker(
                seq_len=config.seq_len,
                long_docs=config.long_docs,
                buffer_tokens=config.buffer_tokens,
                seed=config.seed,
                pad_id=pad_id,
                stats=stats,
                stream=unit,
            )
            if config.strategy == "bfd"
            else ConcatPacker(seq_len=config.seq_len, long_docs=config.long_docs, pad_id=pad_id, stats=stats)
        )

    def add(self, batch: TokenBatch, batch_ends: bool) -> None:
        """Pack a batch of documents, or a piece of one (`batch_ends` on its last piece)."""
        self._write(self.packer.add(batch, batch_ends))

    def _write(self, all_rows: Iterator[Rows]) -> None:
        for rows in all_rows:
            self.writer.write({"input_ids": rows.input_ids, "position_ids": rows.position_ids}, rows.row_tokens)
            real = int(rows.row_tokens.sum())
            self.stats.rows += len(rows.row_tokens)
            self.stats.tokens += real
            self.stats.padding_tokens += len(rows.row_tokens) * self.config.seq_len - real

    def close(self) -> None:
        self._write(self.packer.finish())
        self.writer.close()


class DatatroveSink:
    """Token files as datatrove's DocumentTokenizer writes them and nanotron's DatatroveFolderDataset reads them:
    NAME.ds (little-endian uint16 ids, uint32 past 65,536 tokens, documents back to back, each ending in EOS),
    NAME.ds.index (little-endian uint64 end of each document, in tokens) and NAME.ds.metadata
    (`tokenizer|token_size`, token count, human count). A file rolls at the shard size and at each unit."""

    def __init__(self, folder: OutputFolder, config: PackConfig, record: dict, stats: PackStats, unit: int):
        self.folder, self.record, self.stats = folder, record, stats
        self.token_size = token_size(record)
        shard_bytes, shard_documents = parse_shard_size(config.shard_size)
        # A file rolls after the document that reaches its size, in tokens, or after so many documents ("rows").
        self.file_tokens = (shard_bytes or DEFAULT_TOKEN_FILE_BYTES) // self.token_size if not shard_documents else None
        self.file_documents = shard_documents
        self.handle = None

    def add(self, batch: TokenBatch, batch_ends: bool) -> None:
        """Write the batch's documents, rolling to a new file wherever the current one fills (whole documents,
        at least one per file): per document, so wherever batches (or their pieces) end."""
        ends = np.cumsum(batch.lengths)
        first = 0
        while first < len(ends):
            if self.handle is None:
                self.name = f"part-{len(self.folder.shards):05d}.ds"
                self.handle = open(self.folder.file(self.name), "wb")  # noqa: SIM115  (open across calls; close() ends it)
                self.ends, self.tokens, self.documents = [], 0, 0
            done = int(ends[first - 1]) if first else 0
            if self.file_documents:
                last = min(len(ends), first + self.file_documents - self.documents)
            else:  # the first document that reaches the size ends the file
                last = int(np.searchsorted(ends, done + self.file_tokens - self.tokens, side="left")) + 1
            last = min(len(ends), max(first + 1, last))
            self._write(TokenBatch(batch.ids[done : ends[last - 1]], batch.lengths[first:last]))
            if (self.file_documents and self.documents >= self.file_documents) or (
                not self.file_documents and self.tokens >= self.file_tokens
            ):
                self._close_file()
            first = last

    def _write(self, batch: TokenBatch) -> None:
        self.handle.write(batch.ids.astype("<u2" if self.token_size == 2 else "<u4").tobytes())
        self.ends.append(self.tokens + np.cumsum(batch.lengths))
        self.tokens += len(batch.ids)
        self.documents += len(batch.lengths)
        self.stats.tokens += len(batch.ids)

    def _close_file(self) -> None:
        if self.handle is None:
            return
        self.handle.close()
        self.handle = None
        ends = np.concatenate(self.ends).astype("<u8")
        ends.tofile(self.folder.file(f"{self.name}.index"))
        self.folder.file(f"{self.name}.metadata").write_text(
            f"{self.record['path']}|{self.token_size}\n{self.tokens}\n{self.tokens / 1e9:.2f}B tokens"
        )
        self.folder.add_shard(
            self.name, len(ends), tokens=self.tokens, index=f"{self.name}.index", metadata=f"{self.name}.metadata"
        )

    def close(self) -> None:
        self._close_file()


def token_size(record: dict) -> int:
    return 2 if record["vocab_size"] <= 2**16 else 4


TOKEN_FILE_STATS = ("documents", "tokens", "skipped_empty")
"""The statistics token files have: rows, padding, split and truncated documents are the packed rows'."""


def recorded_stats(form: str, stats: PackStats) -> dict:
    """The statistics a folder of this format records (manifest, --json)."""
    if form == "datatrove":
        return {key: getattr(stats, key) for key in TOKEN_FILE_STATS}
    return asdict(stats) | {"padding_fraction": stats.padding_fraction}


def manifest_fields(config: PackConfig, record: dict, stats: PackStats) -> dict:
    """The fields of a packed (or token-file) folder's manifest beyond shards and stats."""
    if config.format == "datatrove":
        dtype = "uint16" if token_size(record) == 2 else "uint32"
        return dict(
            schema={"ds": f"{dtype} token ids", "ds.index": "uint64 document ends"},
            format="datatrove",
            token_size=token_size(record),
        )
    return dict(
        schema={"input_ids": f"int32[{config.seq_len}]", "position_ids": f"int32[{config.seq_len}]"},
        seq_len=config.seq_len,
        strategy=config.strategy,
        long_docs=config.long_docs,
        padding_tokens=stats.padding_tokens,
        padding_fraction=stats.padding_fraction,
    )

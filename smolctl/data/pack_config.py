"""What a `smolctl pack` is asked to do: its settings, checked before any document is read."""

from __future__ import annotations

from dataclasses import dataclass

from smolctl.errors import UserError
from smolctl.units import parse_shard_size

STRATEGIES = ("bfd", "concat")
LONG_DOCS = ("split", "truncate")
FORMATS = ("safetensors", "datatrove")


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
    format: str = "safetensors"
    """`safetensors`: packed rows for `pretrain`; `datatrove`: nanotron/datatrove token files (no packing)."""

    def validate(self) -> None:
        if self.seq_len < 2:
            raise UserError("--seq-len", f"{self.seq_len} is too short", "use at least 2 (typically 2048-8192)")
        if self.strategy not in STRATEGIES:
            raise UserError("--strategy", f"unknown strategy {self.strategy!r}", f"use one of {', '.join(STRATEGIES)}")
        if self.long_docs not in LONG_DOCS:
            raise UserError("--long-docs", f"unknown choice {self.long_docs!r}", f"use one of {', '.join(LONG_DOCS)}")
        if self.format not in FORMATS:
            raise UserError("--format", f"unknown format {self.format!r}", f"use one of {', '.join(FORMATS)}")
        if self.workers < 1:
            raise UserError("--workers", f"{self.workers} is not a worker count", "use 1 or more")
        if self.format == "datatrove" and (self.long_docs, self.strategy) != ("split", "bfd"):
            # Token files hold whole documents, unpacked: a truncation or a packing strategy would be ignored.
            flag = "--long-docs truncate" if self.long_docs != "split" else f"--strategy {self.strategy}"
            raise UserError(
                flag, "does not apply to --format datatrove (whole documents, not rows)", "leave it out, or pack rows"
            )
        if self.packs_by_buffer and self.buffer_tokens < self.seq_len:
            raise UserError(
                "--buffer-tokens",
                f"{self.buffer_tokens} is smaller than seq_len {self.seq_len}",
                "use a buffer of many rows (the default is 8M tokens)",
            )

    @property
    def packs_by_buffer(self) -> bool:
        """Only best-fit-decreasing rows are packed a buffer at a time."""
        return self.format == "safetensors" and self.strategy == "bfd"

    def rows_per_shard(self) -> int:
        shard_bytes, shard_rows = parse_shard_size(self.shard_size)
        if shard_rows:
            return shard_rows
        return max(1, shard_bytes // (2 * 4 * self.seq_len))  # input_ids + position_ids, int32 each

"""How `smolctl mix` sizes documents: UTF-8 bytes, tokens counted exactly, or tokens estimated from bytes.

    smolctl mix out/ --source web=web/:85 --source code=code/:15 --tokens 2G --tokenizer tok/ --token-estimate sample

Exact counting tokenizes every document of every source, and `pack` tokenizes the chosen ones again: a second
full tokenizer pass at corpus scale. The estimate tokenizes only a seeded sample of each source instead:
1. Sample. A row is in its source's sample when a hash of (seed, source, row index) falls below the fraction
   token_sample / documents of the source (all rows when that is 1): about `token_sample` documents, spread over
   every file, chosen without reading anything, so each measuring unit (one file) finds its own share.
2. Calibrate. tokens per byte = the sample's token ids / its UTF-8 bytes (a ratio estimator: long documents weigh
   more, as they do in a token share). Its relative standard error and a split-half check are recorded.
3. Estimate. A bin's tokens = tokens per byte x the bytes of its documents outside the sample + one EOS per
   such non-empty document that tokenizes to something (`pack` appends none to a document of no ids, e.g.
   whitespace under a SentencePiece tokenizer: the sample measures that share), + the sampled documents'
   tokens, counted exactly (they are known: a sample that is a large part of a small source leaves little to
   estimate).
A source whose estimate is off by a relative error e moves its share s by about s x (1 - s) x e (less the
others' errors), so calibrations within 1% keep the shares within about half a point, and usually well inside.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from smolctl.arrow_arrays import ENCODER_CALLS_IN_FLIGHT, plain_strings, text_pieces
from smolctl.data.mix_blocks import BINS, row_bins, row_hash, source_key
from smolctl.errors import UserError

Arrays = dict[str, np.ndarray]


def text_bytes(texts: pa.Array) -> np.ndarray:
    """UTF-8 bytes of each document (0 for a null)."""
    return pc.fill_null(pc.binary_length(plain_strings(texts)), 0).to_numpy(zero_copy_only=False).astype(np.int64)


def text_tokens(texts: pa.Array, backend) -> np.ndarray:
    """Token ids of each document without the EOS `pack` appends (0 for an empty one), as `pack` encodes them
    (no special tokens), in pieces of at most TEXT_BYTES_PER_CALL bytes of text; only counted, so the ids never
    leave the tokenizer as Python lists. Pieces are counted two at a time, as `pack` encodes them: a piece that
    is one book is one document, which the Rust pool cannot spread over its threads."""
    pieces = [piece for piece, _ in text_pieces(texts)]
    if len(pieces) == 1:
        return piece_tokens(backend, pieces[0])
    with ThreadPoolExecutor(ENCODER_CALLS_IN_FLIGHT, thread_name_prefix="count") as pool:
        return np.concatenate(list(pool.map(partial(piece_tokens, backend), pieces)))


def piece_tokens(backend, piece: pa.Array) -> np.ndarray:
    encodings = backend.encode_batch_fast(
        [t if t is not None else "" for t in piece.to_pylist()], add_special_tokens=False
    )
    return np.fromiter(map(len, encodings), dtype=np.int64, count=len(encodings))


def document_sizes(texts: pa.Array, backend) -> np.ndarray:
    """Tokens (ids + the EOS `pack` appends; 0 for an empty document) or UTF-8 bytes of each document."""
    if backend is None:
        return text_bytes(texts)
    lengths = text_tokens(texts, backend)
    return np.where(lengths > 0, lengths + 1, 0)


def sample_key(seed: int, name: str) -> int:
    """The sample's own hash key: which rows calibrate a source is independent of the bins that order it."""
    return source_key(seed, f"{name}\0token-sample")


def in_sample(key: int, fraction: float, rows: np.ndarray) -> np.ndarray:
    if fraction >= 1:
        return np.ones(len(rows), dtype=bool)
    return row_hash(key, rows) < np.uint64(int(fraction * 2.0**64))


def measure_file(
    source,
    file_index: int,
    key: int,
    text_column: str,
    backend,
    sample: tuple[int, float] | None,
    on_rows: Callable[[int], None] | None = None,
) -> Arrays:
    """Per bin of one file of a source (rows numbered across the whole source): `units` and `documents`.

    `units` are tokens with a tokenizer and no `sample` (key, fraction), else UTF-8 bytes. With a sample, `units`
    are the bytes of the documents outside it, `nonempty` counts those that are not empty and `sampled` holds
    the sampled documents' tokens (EOS included); `sample_bytes` and `sample_tokens` (ids, no EOS) list the
    sampled documents in row order. Only those documents are tokenized.
    """
    estimating = backend is not None and sample is not None
    units = np.zeros(BINS, dtype=np.int64)
    documents = np.zeros(BINS, dtype=np.int64)
    nonempty = np.zeros(BINS, dtype=np.int64)
    sampled = np.zeros(BINS, dtype=np.int64)
    sampled_bytes, sampled_tokens = [], []
    row = sum(source.file_rows[:file_index])
    for batch in source.iter_file_batches(file_index, columns=[text_column], batch_size=4096, threads=False):
        rows = np.arange(row, row + batch.num_rows)
        bins = row_bins(key, rows)
        texts = batch.column(0)
        if estimating:
            picked = in_sample(sample[0], sample[1], rows)
            sizes = text_bytes(texts)
            tokens = text_tokens(texts.filter(pa.array(picked)), backend)
            sampled += np.bincount(bins[picked], weights=np.where(tokens > 0, tokens + 1, 0), minlength=BINS).astype(
                np.int64
            )
            sampled_bytes.append(sizes[picked])
            sampled_tokens.append(tokens)
            sizes[picked] = 0  # counted exactly above: `units` and `nonempty` hold only what is left to estimate
            nonempty += np.bincount(bins, weights=sizes > 0, minlength=BINS).astype(np.int64)
        else:
            sizes = document_sizes(texts, backend)
        units += np.bincount(bins, weights=sizes, minlength=BINS).astype(np.int64)
        documents += np.bincount(bins, minlength=BINS)
        row += batch.num_rows
        if on_rows:
            on_rows(batch.num_rows)
    measured = {"units": units, "documents": documents}
    if estimating:
        empty = np.zeros(0, dtype=np.int64)
        measured |= {
            "nonempty": nonempty,
            "sampled": sampled,
            "sample_bytes": np.concatenate([empty, *sampled_bytes]),
            "sample_tokens": np.concatenate([empty, *sampled_tokens]).astype(np.int64),
        }
    return measured


@dataclass
class TokenCalibration:
    """A source's tokens per UTF-8 byte, measured on its seeded sample; recorded in the mix manifest."""

    source_documents: int
    sample_documents: int
    """Non-empty documents tokenized (empty ones have no tokens and no bytes)."""
    sample_bytes: int
    sample_tokens: int
    """Token ids of the sample, without EOS."""
    sample_documents_with_tokens: int
    """Sampled documents that tokenize to at least one id: `pack` appends EOS to those only."""
    relative_standard_error: float | None
    """Standard error of tokens per byte over its value (ratio estimator, finite-population corrected); None
    with fewer than two documents."""
    holdout_error: float | None
    """Calibrate on every other sampled document, estimate the rest's tokens (EOS included) from their bytes:
    the larger relative error of the two ways round. None with fewer than two documents."""
    mode: str = "sample"

    @property
    def tokens_per_byte(self) -> float:
        return self.sample_tokens / self.sample_bytes

    @property
    def bytes_per_token(self) -> float:
        return self.sample_bytes / self.sample_tokens if self.sample_tokens else math.inf

    @property
    def ends_per_document(self) -> float:
        """EOS tokens `pack` appends per non-empty document, estimated on the sample."""
        return self.sample_documents_with_tokens / self.sample_documents

    def estimate(self, text_bytes: np.ndarray, nonempty: np.ndarray) -> np.ndarray:
        """Tokens, EOS included, of documents (or bins of them) holding `text_bytes` in `nonempty` documents.

        Whole tokens, rounded along the running total: each item is within one token of its estimate and any
        run of them sums to its estimate. Rounding each item alone is biased where items are alike (bins of one
        short document each: every whitespace-only one rounded 1.7 up to 2)."""
        running = np.rint(np.cumsum(text_bytes * self.tokens_per_byte + nonempty * self.ends_per_document))
        return np.diff(running, prepend=0).astype(np.int64)

    def sizes(self, texts: pa.Array) -> np.ndarray:
        """Each document's estimated tokens, EOS included (0 for an empty one)."""
        sizes = text_bytes(texts)
        return self.estimate(sizes, (sizes > 0).astype(np.int64))

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "bytes_per_token": self.bytes_per_token,
            "source_documents": self.source_documents,
            "sample_documents": self.sample_documents,
            "sample_bytes": self.sample_bytes,
            "sample_tokens": self.sample_tokens,
            "sample_documents_with_tokens": self.sample_documents_with_tokens,
            "relative_standard_error": self.relative_standard_error,
            "holdout_error": self.holdout_error,
        }


def calibrate(
    name: str, source_documents: int, sample_bytes: np.ndarray, sample_tokens: np.ndarray
) -> TokenCalibration:
    """Tokens per byte of a source from its sampled documents' bytes and token ids (in row order)."""
    keep = sample_bytes > 0
    b, t = sample_bytes[keep].astype(np.float64), sample_tokens[keep].astype(np.float64)
    if b.sum() == 0 or t.sum() == 0:
        raise UserError(
            f"source {name!r}",
            f"the token sample ({len(sample_bytes)} documents) holds no tokens",
            "raise token_sample in the recipe, or pass --token-estimate exact",
        )
    n, ratio = len(b), t.sum() / b.sum()
    standard_error = holdout = None
    if n >= 2:
        residual = t - ratio * b
        population = max(1.0 - n / max(n, source_documents), 0.0)
        variance = population * (residual @ residual) / (n - 1) / (n * b.mean() ** 2)
        standard_error = float(math.sqrt(variance) / ratio)
        halves = [(b[i::2], t[i::2]) for i in (0, 1)]
        if all(hb.sum() > 0 and ht.sum() > 0 for hb, ht in halves):
            holdout = max(
                abs((ft.sum() / fb.sum() * hb.sum() + (ft > 0).mean() * len(hb)) / (ht.sum() + (ht > 0).sum()) - 1)
                for (fb, ft), (hb, ht) in (halves, halves[::-1])
            )
    return TokenCalibration(
        source_documents,
        n,
        int(b.sum()),
        int(t.sum()),
        int((t > 0).sum()),
        standard_error,
        None if holdout is None else float(holdout),
    )

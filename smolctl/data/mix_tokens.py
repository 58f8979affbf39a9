"""How `smolctl mix` sizes documents: UTF-8 bytes, tokens counted exactly, or tokens estimated from bytes.

    smolctl mix out/ --source web=web/:85 --source code=code/:15 --tokens 2G --tokenizer tok/ --token-estimate sample

Exact counting tokenizes every document of every source, and `pack` tokenizes the chosen ones again: a second
full tokenizer pass at corpus scale. The estimate tokenizes only a seeded sample of each source instead:
1. Sample. A row is in its source's sample when a hash of (seed, source, row index) falls below the fraction
   token_sample / documents of the source (all rows when that is 1): about `token_sample` documents, spread over
   every file, chosen without reading anything, so each measuring unit (one file) finds its own share. A document
   holding at least 1/token_sample of the source's text (its column's bytes as the files' footers count them) is
   tokenized whatever its hash: a uniform sample of documents misses most such outliers (a minified bundle, a
   base64 blob, a book in a crawl), and one of them priced at the others' cost moved a share by points with no
   warning. There are at most token_sample of them (and none under ten times the mean document), counted exactly
   and left out of the fit, which prices the population the sample was drawn from.
2. Calibrate. A document's token ids ~ a x its UTF-8 bytes + b x its extra bytes (those beyond the first of each
   character: none in ASCII), fitted on the sample by least squares weighted by 1 / bytes. Without extra bytes
   that is the ratio estimator, the sample's ids / its bytes (long documents weigh more, as they do in a token
   share); with them, scripts of different cost each get theirs: a source of English pages and a few long CJK
   books is estimated right for the pages a mix picks, where one ratio, pulled toward the books' cost,
   overcounted them. Its relative standard error and a split-half check are recorded.
3. Estimate. A bin's tokens = the fit over the bytes and extra bytes of its documents outside the sample + one
   EOS per such non-empty document that tokenizes to something (`pack` appends none to a document of no ids,
   e.g. whitespace under a SentencePiece tokenizer: the sample measures that share), + the sampled documents'
   tokens, counted exactly (they are known: a sample that is a large part of a small source leaves little to
   estimate).
A source whose estimate is off by a relative error e moves its share s by about s x (1 - s) x e (less the
others' errors), so calibrations within 1% keep the shares within about half a point, and usually well inside.
A split-half error above HOLDOUT_WARNING is reported as a warning: the sample does not predict its own halves
well enough for that (documents of very different cost per byte, too few of them sampled). So is a source whose
two standard errors would move its share by more than HALF_A_POINT, and one whose sample holds too little of its
text beyond ASCII to price it (TokenCalibration.extra_bytes_unsampled). Both errors are the fit's: each counts
for the share of the source's tokens the fit prices (TokenCalibration.priced_share), not the large documents'.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from smolctl.arrow_arrays import ENCODER_CALLS_IN_FLIGHT, plain_strings, text_pieces
from smolctl.data.long_documents import LONG_DOCUMENT_CHARS, texts_ids
from smolctl.data.mix_blocks import BINS, row_bins, row_hash, source_key
from smolctl.errors import UserError

Arrays = dict[str, np.ndarray]
MEASUREMENTS_VERSION = 5
"""Bumped whenever what a measuring unit records changes (2: extra bytes, 3: large documents counted apart, 4:
large by the text column's bytes, 5: the large documents' tokens): a work area measured by another version is
measured again, not resumed."""
HOLDOUT_WARNING = 0.04
"""A split-half error that suggests the whole sample's estimate is off by 2%, which can move a share of one half
by half a point (s x (1 - s) x e): fitted on half the documents and checked against the other half's own noise,
the split-half error runs at about twice the whole sample's."""
HALF_A_POINT = 0.005
"""The share error a sample may cost (issue 23): two standard errors of a source's token estimate that move its
share further (s x (1 - s) x e) are a warning."""
EXTRA_FITTED_FROM = 0.01
"""Extra bytes get their own coefficient where they are at least 1% of the sample's bytes: a few accented letters
would otherwise set it at random (+6 or -7 tokens per byte on the English sample corpus)."""
LARGE_FLOOR_MEANS = 10
"""A large document (TokenSample) is at least this many times its source's mean document."""
COLLINEAR = 0.01
"""The fit keeps one ratio where the sample's extra bytes are (nearly) a fixed share of its bytes (one script):
two coefficients would then only fit the sample's noise."""


def text_bytes(texts: pa.Array) -> np.ndarray:
    """UTF-8 bytes of each document (0 for a null)."""
    return pc.fill_null(pc.binary_length(plain_strings(texts)), 0).to_numpy(zero_copy_only=False).astype(np.int64)


def extra_bytes(texts: pa.Array, sizes: np.ndarray) -> np.ndarray:
    """UTF-8 bytes beyond the first of each character of each document, given their `sizes` in bytes."""
    characters = pc.fill_null(pc.utf8_length(plain_strings(texts)), 0).to_numpy(zero_copy_only=False)
    return sizes - characters.astype(np.int64)


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
    texts = [t if t is not None else "" for t in piece.to_pylist()]
    if max(map(len, texts), default=0) > LONG_DOCUMENT_CHARS:  # as pack encodes a book-dump-sized document
        encodings = texts_ids(backend, texts)
    else:
        encodings = backend.encode_batch_fast(texts, add_special_tokens=False)
    return np.fromiter(map(len, encodings), dtype=np.int64, count=len(encodings))


def document_sizes(texts: pa.Array, backend) -> np.ndarray:
    """Tokens (ids + the EOS `pack` appends; 0 for an empty document) or UTF-8 bytes of each document."""
    if backend is None:
        return text_bytes(texts)
    return with_end(text_tokens(texts, backend))


def with_end(ids: np.ndarray) -> np.ndarray:
    """Documents' token ids and the EOS `pack` appends to each that has any."""
    return np.where(ids > 0, ids + 1, 0)


def sample_key(seed: int, name: str) -> int:
    """The sample's own hash key: which rows calibrate a source is independent of the bins that order it."""
    return source_key(seed, f"{name}\0token-sample")


def in_sample(key: int, fraction: float, rows: np.ndarray) -> np.ndarray:
    if fraction >= 1:
        return np.ones(len(rows), dtype=bool)
    return row_hash(key, rows) < np.uint64(int(fraction * 2.0**64))


@dataclass(frozen=True)
class TokenSample:
    """Which documents of a source are tokenized in `sample` mode: those whose row hash (`key`) falls below
    `fraction`, and every one of at least `large_bytes` UTF-8 bytes."""

    key: int
    fraction: float
    large_bytes: float

    @classmethod
    def of(cls, key: int, fraction: float, text_bytes: int, token_sample: int) -> TokenSample:
        """Documents of 1/token_sample of the source's `text_bytes` or more are large, and of ten times its mean
        document at least: where the sample is a tenth of the source or more (`sample` asked for on a source
        `auto` would count exactly), one document in ten or more is tokenized anyway, and the bound alone took a
        third of a source's bytes as large. None are large where the sample is the whole source (nothing is left
        to estimate), or where the files' footers record no bytes."""
        if fraction >= 1 or text_bytes <= 0:
            return cls(key, fraction, math.inf)
        return cls(key, fraction, text_bytes / token_sample * max(1.0, LARGE_FLOOR_MEANS * fraction))


def measure_file(
    source,
    file_index: int,
    key: int,
    text_column: str,
    backend,
    sample: TokenSample | None,
    on_rows: Callable[[int], None] | None = None,
) -> Arrays:
    """Per bin of one file of a source (rows numbered across the whole source): `units` and `documents`.

    `units` are tokens with a tokenizer and no `sample`, else UTF-8 bytes. With a sample, `units` are the bytes of
    the documents outside it and not large, `extra` their extra bytes (extra_bytes), `nonempty` counts those that
    are not empty and `sampled` holds the tokens (EOS included) of the sampled and the large ones; `sample_bytes`,
    `sample_extra` and `sample_tokens` (ids, no EOS) list the sampled documents that are not large in row order,
    and `large_documents`, `large_bytes`, `large_extra` and `large_tokens` (EOS included) total the large ones.
    Only the sampled and the large documents are tokenized.
    """
    estimating = backend is not None and sample is not None
    units = np.zeros(BINS, dtype=np.int64)
    documents = np.zeros(BINS, dtype=np.int64)
    extra = np.zeros(BINS, dtype=np.int64)
    nonempty = np.zeros(BINS, dtype=np.int64)
    sampled = np.zeros(BINS, dtype=np.int64)
    sampled_bytes, sampled_extra, sampled_tokens = [], [], []
    large_documents = large_bytes = large_extra = large_tokens = 0
    row = sum(source.file_rows[:file_index])
    for batch in source.iter_file_batches(file_index, columns=[text_column], batch_size=4096, threads=False):
        rows = np.arange(row, row + batch.num_rows)
        bins = row_bins(key, rows)
        texts = batch.column(0)
        if estimating:
            texts = plain_strings(texts)  # once for both counts, where views or dictionaries need converting
            sizes = text_bytes(texts)
            beyond = extra_bytes(texts, sizes)
            large = sizes >= sample.large_bytes
            picked = in_sample(sample.key, sample.fraction, rows) & ~large
            counted = picked | large
            tokens = text_tokens(texts.filter(pa.array(counted)), backend)
            counted_tokens = with_end(tokens)
            sampled += np.bincount(bins[counted], weights=counted_tokens, minlength=BINS).astype(np.int64)
            sampled_bytes.append(sizes[picked])
            sampled_extra.append(beyond[picked])
            sampled_tokens.append(tokens[picked[counted]])
            large_documents += int(large.sum())
            large_bytes += int(sizes[large].sum())
            large_extra += int(beyond[large].sum())
            large_tokens += int(counted_tokens[large[counted]].sum())
            # Counted exactly above: `units`, `extra` and `nonempty` hold only what is left to estimate.
            sizes[counted] = beyond[counted] = 0
            extra += np.bincount(bins, weights=beyond, minlength=BINS).astype(np.int64)
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
            "extra": extra,
            "nonempty": nonempty,
            "sampled": sampled,
            "sample_bytes": np.concatenate([empty, *sampled_bytes]),
            "sample_extra": np.concatenate([empty, *sampled_extra]),
            "sample_tokens": np.concatenate([empty, *sampled_tokens]).astype(np.int64),
            "large_documents": np.int64(large_documents),
            "large_bytes": np.int64(large_bytes),
            "large_extra": np.int64(large_extra),
            "large_tokens": np.int64(large_tokens),
        }
    return measured


@dataclass
class TokenCalibration:
    """A source's token ids per UTF-8 byte and per extra byte, fitted on its seeded sample; recorded in the mix
    manifest."""

    source_documents: int
    source_bytes: int
    source_extra_bytes: int
    estimated_documents: int
    """Non-empty documents outside the sample and not large, whose tokens are estimated: none where the sample is
    the whole source."""
    large_document_bytes: float
    """Documents of this many UTF-8 bytes or more (1/token_sample of the source's) are large: tokenized and
    counted exactly, outside the fit (inf: none are)."""
    large_documents: int
    large_bytes: int
    large_extra_bytes: int
    large_tokens: int
    """Tokens of the large documents, EOS included, counted."""
    sample_documents: int
    """Non-empty documents tokenized (empty ones have no tokens and no bytes)."""
    sample_bytes: int
    sample_extra_bytes: int
    sample_tokens: int
    """Token ids of the sample, without EOS."""
    sample_documents_with_tokens: int
    """Sampled documents that tokenize to at least one id: `pack` appends EOS to those only."""
    tokens_per_byte: float
    tokens_per_extra_byte: float
    """0 where the fit keeps one ratio (COLLINEAR)."""
    relative_standard_error: float | None
    """Standard error of the fit's estimate of the sample's mean tokens over that mean (finite-population
    corrected); None with fewer documents than coefficients + 1."""
    holdout_error: float | None
    """Fit on every other sampled document, estimate the rest's tokens (EOS included) from their bytes and extra
    bytes: the larger relative error of the two ways round. None with fewer than two documents."""
    mode: str = "sample"

    @property
    def bytes_per_token(self) -> float:
        """The sample's bytes over its token ids: what one ratio would have used."""
        return self.sample_bytes / self.sample_tokens if self.sample_tokens else math.inf

    @property
    def estimated_extra_share(self) -> float:
        """Extra bytes over all bytes of the documents that are not large: the text the fit prices."""
        return (self.source_extra_bytes - self.large_extra_bytes) / max(self.source_bytes - self.large_bytes, 1)

    @property
    def priced_share(self) -> float:
        """The share of the source's tokens that the fit prices: its estimate for the documents that are not
        large (EOS included), against that and the large ones' count. The fit's errors bear on the source's
        tokens in this proportion."""
        ids = self.tokens_per_byte * (self.source_bytes - self.large_bytes) + self.tokens_per_extra_byte * (
            self.source_extra_bytes - self.large_extra_bytes
        )
        priced = max(ids, 0.0) + self.ends_per_document * (self.sample_documents + self.estimated_documents)
        return priced / (priced + self.large_tokens) if priced + self.large_tokens > 0 else 1.0

    @property
    def extra_bytes_unsampled(self) -> bool:
        """Whether the text beyond ASCII the fit prices is too rare in its sample for it to know its cost: at
        least 1% of the bytes of the documents that are not large are extra bytes, and the sample's share of them
        is under a quarter of that."""
        return (
            self.estimated_documents > 0
            and self.estimated_extra_share >= 0.01
            and self.sample_extra_bytes / self.sample_bytes < self.estimated_extra_share / 4
        )

    @property
    def ends_per_document(self) -> float:
        """EOS tokens `pack` appends per non-empty document, estimated on the sample."""
        return self.sample_documents_with_tokens / self.sample_documents if self.sample_documents else 0.0

    def estimate(self, text_bytes: np.ndarray, extra: np.ndarray, nonempty: np.ndarray) -> np.ndarray:
        """Tokens, EOS included, of documents (or bins of them) holding `text_bytes` with `extra` extra bytes in
        `nonempty` documents. The fit's ids are floored at 0 per item: only a negative extra-byte coefficient
        (a script that costs less per byte than ASCII) can reach below, on text made mostly of that script.

        Whole tokens, rounded along the running total: each item is within one token of its estimate and any
        run of them sums to its estimate. Rounding each item alone is biased where items are alike (bins of one
        short document each: every whitespace-only one rounded 1.7 up to 2)."""
        ids = np.maximum(text_bytes * self.tokens_per_byte + extra * self.tokens_per_extra_byte, 0.0)
        running = np.rint(np.cumsum(ids + nonempty * self.ends_per_document))
        return np.diff(running, prepend=0).astype(np.int64)

    def sizes(self, texts: pa.Array, backend) -> np.ndarray:
        """Each document's tokens, EOS included (0 for an empty one): estimated, but counted by `backend` for a
        large one, as the measuring path counted it."""
        texts = plain_strings(texts)
        sizes = text_bytes(texts)
        estimated = self.estimate(sizes, extra_bytes(texts, sizes), (sizes > 0).astype(np.int64))
        large = sizes >= self.large_document_bytes
        if large.any():
            estimated[large] = document_sizes(texts.filter(pa.array(large)), backend)
        return estimated

    def to_dict(self) -> dict:
        """As the manifest records it: JSON has no infinity, so "no document is large" and the bytes per token of
        a sample without tokens are null."""
        derived = {
            "bytes_per_token": self.bytes_per_token,
            "estimated_extra_share": self.estimated_extra_share,
            "extra_bytes_unsampled": self.extra_bytes_unsampled,
            "priced_share": self.priced_share,
        }
        fields = {key: value for key, value in asdict(self).items() if key != "mode"}
        for values in (derived, fields):
            for key, value in values.items():
                if isinstance(value, float) and math.isinf(value):
                    values[key] = None
        return {"mode": self.mode} | derived | fields


def fit_tokens(b: np.ndarray, m: np.ndarray, t: np.ndarray) -> tuple[float, float]:
    """(a, c) minimising sum (t - a b - c m)^2 / b over documents of b > 0 bytes, m extra bytes and t ids; (t / b
    summed, 0) where m is too little of b (EXTRA_FITTED_FROM) or (nearly) a fixed share of it (COLLINEAR)."""
    sb, sm, smm, st, stm = b.sum(), m.sum(), (m * m / b).sum(), t.sum(), (t * m / b).sum()
    if sm < EXTRA_FITTED_FROM * sb or sb * smm - sm * sm <= COLLINEAR * sb * smm:
        return float(st / sb), 0.0
    determinant = sb * smm - sm * sm
    return float((st * smm - sm * stm) / determinant), float((sb * stm - sm * st) / determinant)


def calibrate(
    name: str,
    sample_bytes: np.ndarray,
    sample_extra: np.ndarray,
    sample_tokens: np.ndarray,
    *,
    source_documents: int,
    source_bytes: int,
    source_extra_bytes: int,
    estimated_documents: int,
    large_document_bytes: float = math.inf,
    large_documents: int = 0,
    large_bytes: int = 0,
    large_extra_bytes: int = 0,
    large_tokens: int = 0,
) -> TokenCalibration:
    """The fit of a source's sampled documents' ids on their bytes and extra bytes (listed in row order), with
    the whole source's documents, bytes and extra bytes, its non-empty documents left to estimate, and what its
    large documents (TokenSample) hold."""
    keep = sample_bytes > 0
    b, m = sample_bytes[keep].astype(np.float64), sample_extra[keep].astype(np.float64)
    t = sample_tokens[keep].astype(np.float64)
    n = len(b)
    per_byte = per_extra = 0.0
    standard_error = holdout = None
    if b.sum() == 0 or t.sum() == 0:
        if estimated_documents:
            raise UserError(
                f"source {name!r}",
                f"the token sample ({len(sample_bytes)} documents) holds no tokens",
                "raise token_sample in the recipe, or pass --token-estimate exact",
            )
        # Nothing is left to price: every document was sampled or large (footers that under-count a source's
        # text, as dictionary encoding of repeated documents makes them, make many documents large).
    else:
        per_byte, per_extra = fit_tokens(b, m, t)
        coefficients = 1 + (per_extra != 0)
        if n > coefficients:
            residual = t - per_byte * b - per_extra * m
            population = max(1.0 - n / max(n, source_documents), 0.0)
            standard_error = float(math.sqrt(population * (residual @ residual) / (n - coefficients) / n) / t.mean())
        if n >= 2:
            halves = [(b[i::2], m[i::2], t[i::2]) for i in (0, 1)]
            if all(hb.sum() > 0 and ht.sum() > 0 for hb, _, ht in halves):

                def miss(fitted, held) -> float:
                    fit_per_byte, fit_per_extra = fit_tokens(*fitted)
                    ends = (fitted[2] > 0).mean()
                    hb, hm, ht = held
                    estimate = max(fit_per_byte * hb.sum() + fit_per_extra * hm.sum(), 0.0) + ends * len(hb)
                    return abs(estimate / (ht.sum() + (ht > 0).sum()) - 1)

                holdout = max(miss(halves[0], halves[1]), miss(halves[1], halves[0]))
    return TokenCalibration(
        source_documents,
        source_bytes,
        source_extra_bytes,
        estimated_documents,
        large_document_bytes,
        large_documents,
        large_bytes,
        large_extra_bytes,
        large_tokens,
        n,
        int(b.sum()),
        int(m.sum()),
        int(t.sum()),
        int((t > 0).sum()),
        per_byte,
        per_extra,
        standard_error,
        None if holdout is None else float(holdout),
    )

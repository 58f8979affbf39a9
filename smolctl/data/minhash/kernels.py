"""The C kernels of _minhash.c behind numpy signatures: tokens and exact hashes, n-gram shingles, signatures,
set intersections and signature agreements over whole batches. Every buffer is allocated and checked here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from smolctl.arrow_arrays import compute, from_numpy, plain_strings, to_numpy_filled
from smolctl.data.minhash.arrays import odd_constants, offsets_from_counts
from smolctl.data.minhash.normalization import normalization_tables, normalize

try:
    from smolctl.data import _minhash
except ImportError:  # installed where no C compiler was found: the same kernels in numpy, slower
    from smolctl.data import minhash_fallback as _minhash

    _minhash.warn_slow()

# Weights of the positions of an n-gram (and of the rows of an LSH band): fixed odd constants, so order matters.
NGRAM_WEIGHTS = odd_constants(64, 0x5EED0002)


@dataclass
class Tokens:
    """A batch of documents as hashes."""

    exact: np.ndarray
    """(docs, 2) uint64: a 128-bit hash of each document's sequence of whitespace-separated tokens (= of its
    normalised, whitespace-collapsed text): two polynomials sum_i t_i * R^i mod 2^64 of the token hashes t_i
    with different odd R, each finished with the token count and mix64. What exact dedup compares."""
    words: np.ndarray
    """uint64 hash of every word, documents end to end (document i owns [word_offsets[i], word_offsets[i+1])): a
    token without its leading and trailing ASCII punctuation (dropped if nothing is left), so that "word," and
    "(word" are "word" and punctuation edits barely move the shingles."""
    word_offsets: np.ndarray


def tokenize(texts: Sequence[str] | pa.Array | pa.ChunkedArray) -> Tokens:
    """Exact hashes and words of every document's normalised text (normalize(); nulls are empty), in one call
    over the UTF-8 bytes of the batch (_minhash.c).

    Documents are hashed straight from the arrow buffer when normalize() would only lower-case their ASCII
    letters, which the kernel does as it reads: ASCII documents, and those whose other characters are all
    left alone by NFKC and case folding (curly quotes, dashes, accented lower-case letters, most scripts).
    The rest go to a second buffer that the kernel reads instead: folded in C where normalize() makes the
    same of each of their other characters wherever it stands (capitals, no-break spaces, full-width forms,
    marks that compose with nothing, in canonical order: NormalizationTables.folds), else normalised in Python.

    A token is a run of bytes other than ASCII whitespace; its hash (and a word's) is sum_m c_m * R^(8m + 1)
    mod 2^64 over its 8-byte little-endian chunks c_m, finished with its length and a multiply-xorshift, so
    the same token hashes alike wherever it lies.
    """
    texts = plain_strings(texts)
    width = np.int64 if pa.types.is_large_string(texts.type) else np.int32
    offsets = np.frombuffer(texts.buffers()[1], dtype=width)[texts.offset : texts.offset + len(texts) + 1].astype(
        np.int64
    )
    data = texts.buffers()[2] if texts.buffers()[2] is not None else pa.py_buffer(b"")
    starts, ends = offsets[:-1].copy(), offsets[1:].copy()
    if texts.null_count:
        empty = to_numpy_filled(compute("is_null", texts))
        ends[empty] = starts[empty]
    extra = b""
    tables = normalization_tables()
    changing = np.empty(len(texts), np.uint8)
    _minhash.changing_documents(data, starts, ends, tables.changing, changing)
    others = np.flatnonzero(changing)
    if len(others):
        # Positions from len(data) on address the second buffer: first the documents folded in C, then those
        # normalised in Python. Folds shrink or keep most characters (a no-break space, a full-width comma, a
        # capital): a document whose folding outgrows this room is left to Python.
        changing_bytes = int((ends[others] - starts[others]).sum())
        folded = np.empty(changing_bytes + changing_bytes // 4 + 64, np.uint8)
        folded_ends = np.empty(len(others), np.int64)
        _minhash.fold_documents(
            data, starts[others], ends[others], tables.changing, tables.folds, tables.classes, folded, folded_ends
        )
        in_c, folded_size = others[folded_ends >= 0], int(folded_ends.max(initial=0))
        ends[in_c] = data.size + folded_ends[folded_ends >= 0]
        starts[in_c] = np.concatenate([[data.size], ends[in_c][:-1]])
        by_python, normalised = others[folded_ends < 0], b""
        if len(by_python):
            pieces = [normalize(t).encode() for t in compute("take", texts, from_numpy(by_python)).to_pylist()]
            ends[by_python] = data.size + folded_size + np.cumsum([len(p) for p in pieces], dtype=np.int64)
            starts[by_python] = np.concatenate([[data.size + folded_size], ends[by_python][:-1]])
            normalised = b"".join(pieces)
        extra = np.concatenate([folded[:folded_size], np.frombuffer(normalised, np.uint8)])
    # A word takes at least one byte and a separator: a document of n bytes has at most (n + 1) // 2 of them.
    room = (int((ends - starts).sum()) + len(texts)) // 2 + 1
    exact, word_hashes, word_counts = (
        np.empty((len(texts), 2), np.uint64),
        np.empty(room, np.uint64),
        np.empty(len(texts), np.int64),
    )
    words = _minhash.tokenize(data, extra, starts, ends, exact, word_hashes, word_counts)
    return Tokens(exact, word_hashes[:words], offsets_from_counts(word_counts))


def ngrams(tokens: np.ndarray, offsets: np.ndarray, ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """(hashes, offsets) of the n-grams of consecutive tokens of each document: mix64(sum_k t[j + k] * W[k]),
    W being NGRAM_WEIGHTS (so order matters); a document with 1 to ngram - 1 tokens has one, of all its
    tokens."""
    out = np.empty(len(tokens), np.uint64)
    counts = np.empty(len(offsets) - 1, np.int64)
    total = _minhash.shingles(
        np.ascontiguousarray(tokens, np.uint64),
        np.ascontiguousarray(offsets, np.int64),
        NGRAM_WEIGHTS[np.arange(ngram) % len(NGRAM_WEIGHTS)],
        out,
        counts,
    )
    return out[:total], offsets_from_counts(counts)


def signatures(shingles: np.ndarray, offsets: np.ndarray, multipliers: np.ndarray) -> np.ndarray:
    """(docs, num_perm) uint32 MinHash signatures: value p of document i is the minimum over its shingles s of
    multipliers[p] * (s >> 32) mod 2^32; a document without shingles gets all 0xFFFFFFFF (_minhash.c)."""
    out = np.empty((len(offsets) - 1, len(multipliers)), dtype=np.uint32)
    _minhash.signatures(
        np.ascontiguousarray(shingles, np.uint64),
        np.ascontiguousarray(offsets, np.int64),
        np.ascontiguousarray(multipliers, np.uint32),
        out,
    )
    return out


def keys_behind(sigs: np.ndarray, multipliers: np.ndarray) -> np.ndarray:
    """For each row of (docs, num_perm) signatures, how many different 32-bit keys its minima come from: never
    more than the document's shingles, and for a document of a few shingles all of them, each being some
    permutation's minimum. Value p is multipliers[p] * key mod 2^32 with multipliers[p] odd, so the inverse
    of multipliers[p] gives the key back."""
    multipliers = np.asarray(multipliers, np.uint32)
    inverse = multipliers.copy()  # right in 3 bits (a * a = 1 mod 8 for odd a); each step doubles them
    for _ in range(4):
        inverse *= np.uint32(2) - multipliers * inverse
    keys = np.sort(np.asarray(sigs, np.uint32) * inverse, axis=1)
    return 1 + (keys[:, 1:] != keys[:, :-1]).sum(axis=1)


def sorted_sets(values: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(values, bounds) of each document's sorted unique values, from (values, offsets) end to end: set i is
    values[bounds[i]:bounds[i + 1]] (_minhash.c)."""
    out, bounds = np.empty(len(values), np.uint64), np.empty(len(offsets), np.int64)
    total = _minhash.sorted_sets(
        np.ascontiguousarray(values, np.uint64), np.ascontiguousarray(offsets, np.int64), out, bounds
    )
    return out[:total], bounds


def shared_positions(values: np.ndarray) -> np.ndarray:
    """The positions i of the values occurring more than once, ordered by (values[i], i): each group of equal
    values together, in position order (_minhash.c: sorted by buckets of their top bits, which are uniform for
    hashes)."""
    values = np.ascontiguousarray(values, np.uint64)
    out = np.empty(len(values), np.int64)
    return out[: _minhash.shared_positions(values, np.empty(2 * len(values), np.uint64), out)]


def jaccard_many(values: np.ndarray, bounds: np.ndarray, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """Exact Jaccard of many pairs of sets stored end to end (set i = values[bounds[i]:bounds[i+1]], sorted
    unique): one merge of the two sorted sets per pair (_minhash.c); two empty sets are identical."""
    left, right = np.ascontiguousarray(left, np.int64), np.ascontiguousarray(right, np.int64)
    common = np.empty(len(left), np.int64)
    _minhash.intersections(
        np.ascontiguousarray(values, np.uint64), np.ascontiguousarray(bounds, np.int64), left, right, common
    )
    sizes = np.diff(bounds)
    union = sizes[left] + sizes[right] - common
    return np.where(union > 0, common / np.maximum(union, 1), 1.0)


def estimate_jaccard(sigs: np.ndarray, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """The MinHash estimate of the Jaccard of each pair of documents (rows left[k] and right[k] of the
    (docs, num_perm) signatures): the fraction of equal values, counted without gathering the rows (_minhash.c)."""
    left, right = np.ascontiguousarray(left, np.int64), np.ascontiguousarray(right, np.int64)
    equal = np.empty(len(left), np.int64)
    _minhash.agreements(np.ascontiguousarray(sigs, np.uint32), sigs.shape[1], left, right, equal)
    return equal / sigs.shape[1]

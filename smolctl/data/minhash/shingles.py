"""Shingle sets of texts (word or character n-grams of the normalised text) and their exact Jaccard: what
verification compares, and the plain statement the signatures approximate."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from smolctl.arrow_arrays import plain_strings
from smolctl.data.minhash.arrays import mix64
from smolctl.data.minhash.kernels import Tokens, ngrams, tokenize
from smolctl.data.minhash.normalization import normalize_array

# Characters kept for char shingles: letters, combining marks (Indic and Arabic letters stay whole), digits, '_'.
NON_WORD = r"[^\p{L}\p{M}\p{N}_]+"
# Shingle sets are sorted as (document << 52 | top 52 bits of the hash) keys, this many documents at a time.
SET_DOC_BITS = 12
SET_SORT_DOCS = 1 << SET_DOC_BITS


def char_tokens(texts: Sequence[str] | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Word-class characters of the normalised texts as tokens (code points), for languages without spaces
    (Chinese, Japanese, Thai)."""
    kept = pc.replace_substring_regex(normalize_array(plain_strings(texts)), NON_WORD, "").to_pylist()
    points = [np.frombuffer(t.encode("utf-32-le", "surrogatepass"), dtype="<u4") for t in kept]
    counts = np.array([len(p) for p in points], dtype=np.int64)
    joined = np.concatenate(points).astype(np.uint64) if points else np.zeros(0, np.uint64)
    return mix64(joined), np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def shingle_hashes(
    texts: Sequence[str] | pa.Array, ngram: int = 5, shingle: str = "word", tokens: Tokens | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(hashes, offsets) of the n-gram shingles of each document's normalised text (duplicates included; a min
    does not mind); `tokens` = tokenize(texts) when the caller has it already.

    A document with fewer than `ngram` tokens (but at least one) has one shingle of all its tokens; a document
    without tokens has none.
    """
    if shingle == "char":
        return ngrams(*char_tokens(texts), ngram)
    tokens = tokens or tokenize(texts)
    return ngrams(tokens.words, tokens.word_offsets, ngram)


def shingle_sets(texts: Sequence[str] | pa.Array, ngram: int = 5, shingle: str = "word") -> list[np.ndarray]:
    """Each document's shingle set as sorted unique uint64: what exact Jaccard verification compares."""
    values, bounds = sets_from_hashes(*shingle_hashes(texts, ngram, shingle))
    return [values[bounds[i] : bounds[i + 1]] for i in range(len(bounds) - 1)]


def sets_from_hashes(hashes: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(values, bounds) of each document's sorted unique shingle hashes, from shingle_hashes' (hashes, offsets).

    Hashes keep their top 52 bits (the low 12 are cleared) so that a key of the document number (top 12 bits)
    and the hash fits in 64: one plain sort per SET_SORT_DOCS documents instead of a lexsort.
    """
    counts = np.diff(offsets)
    values, bounds, total = [], [np.zeros(1, np.int64)], 0
    for first in range(0, len(counts), SET_SORT_DOCS):
        last = min(first + SET_SORT_DOCS, len(counts))
        local = np.repeat(np.arange(last - first, dtype=np.uint64), counts[first:last])
        keys = (local << np.uint64(64 - SET_DOC_BITS)) | (
            hashes[offsets[first] : offsets[last]] >> np.uint64(SET_DOC_BITS)
        )
        keys.sort()
        keys = keys[np.concatenate([[True], keys[1:] != keys[:-1]])] if len(keys) else keys
        values.append(keys << np.uint64(SET_DOC_BITS))
        starts = np.searchsorted(keys >> np.uint64(64 - SET_DOC_BITS), np.arange(1, last - first + 1, dtype=np.uint64))
        bounds.append(starts.astype(np.int64) + total)
        total += len(keys)
    return (np.concatenate(values) if values else np.zeros(0, np.uint64)), np.concatenate(bounds)


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Exact Jaccard of two sorted unique hash sets (two empty sets are identical)."""
    if len(a) == 0 or len(b) == 0:
        return float(len(a) == len(b))
    if len(a) > len(b):
        a, b = b, a
    found = np.searchsorted(b, a)  # each element of the smaller set looked up in the larger one
    common = int(np.count_nonzero(b[np.minimum(found, len(b) - 1)] == a))
    return common / (len(a) + len(b) - common)

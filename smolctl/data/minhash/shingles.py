"""Shingle sets of texts (word or character n-grams of the normalised text) and their exact Jaccard: what
verification compares, and the plain statement the signatures approximate."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from smolctl.arrow_arrays import plain_strings
from smolctl.data.minhash.arrays import mix64
from smolctl.data.minhash.kernels import Tokens, ngrams, sorted_sets, tokenize
from smolctl.data.minhash.normalization import normalize_array

# Characters kept for char shingles: letters, combining marks (Indic and Arabic letters stay whole), digits, '_'.
NON_WORD = r"[^\p{L}\p{M}\p{N}_]+"


def char_tokens(texts: Sequence[str] | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Word-class characters of the normalised texts as tokens (code points), for languages without spaces
    (Chinese, Japanese, Thai)."""
    import pyarrow.compute as pc  # character shingles only: word shingles never import it (see arrow_arrays)

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
    values, bounds = sorted_sets(*shingle_hashes(texts, ngram, shingle))
    return [values[bounds[i] : bounds[i + 1]] for i in range(len(bounds) - 1)]


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Exact Jaccard of two sorted unique hash sets (two empty sets are identical)."""
    if len(a) == 0 or len(b) == 0:
        return float(len(a) == len(b))
    if len(a) > len(b):
        a, b = b, a
    found = np.searchsorted(b, a)  # each element of the smaller set looked up in the larger one
    common = int(np.count_nonzero(b[np.minimum(found, len(b) - 1)] == a))
    return common / (len(a) + len(b) - common)

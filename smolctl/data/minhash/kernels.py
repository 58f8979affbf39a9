"""Vectorised MinHash: normalisation, shingle hashing, signatures and LSH banding over whole batches (no I/O).

    from smolctl.data import minhash
    params = minhash.MinHashParams.for_threshold(0.8)
    shingles, offsets = minhash.shingle_hashes(texts, params.ngram)          # of the normalised texts
    signatures = minhash.signatures(shingles, offsets, params.permutations())   # (docs, num_perm) uint32

The per-document Python loop of the usual implementations (datasketch hashes every shingle with sha1 in Python)
is replaced by passes over a whole batch: tokens and words are found and hashed in one pass over the UTF-8 bytes
(_minhash.c), shingles are combinations of consecutive word hashes (numpy), and every permutation of every
shingle is one uint32 multiply and minimum (_minhash.c, vectorised by the compiler).
"""

from __future__ import annotations

import functools
import math
import unicodedata
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from smolctl.data import _minhash
from smolctl.errors import UserError

# Bumped whenever a hash definition changes: a dedup work area made under another version is not resumed.
HASHING_VERSION = 2
MAX_HASH = np.uint32(0xFFFFFFFF)
# Characters kept for char shingles: letters, combining marks (Indic and Arabic letters stay whole), digits, '_'.
NON_WORD = r"[^\p{L}\p{M}\p{N}_]+"
SHINGLE_KINDS = ("word", "char")
# A band bucket larger than this yields pairs only between near neighbours in document order plus a star from
# its first member: a bucket of k documents would otherwise cost k²/2 verifications.
MAX_BUCKET_PAIRS_SPAN = 64
# Shingle sets are sorted as (document << 52 | top 52 bits of the hash) keys, this many documents at a time.
SET_DOC_BITS = 12
SET_SORT_DOCS = 1 << SET_DOC_BITS


# Random odd constants drawn once (splitmix64 of the position): fixed forever, so hashes never change across
# releases, machines or processes (Python's hash() is salted per process, which would break determinism).
def _constants(count: int, salt: int) -> np.ndarray:
    return mix64(np.arange(count, dtype=np.uint64) + np.uint64(salt)) | np.uint64(1)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection on uint64 whose every output bit depends on every input bit."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


_NGRAM_WEIGHTS = _constants(64, 0x5EED0002)


# ---------------------------------------------------------------------------------------------------------------
# Parameters


def band_collision_probability(similarity: float, bands: int, rows: int) -> float:
    """Chance that two documents of this Jaccard similarity share at least one band: 1 - (1 - s^r)^b."""
    return 1.0 - (1.0 - similarity**rows) ** bands


def choose_bands(threshold: float, num_perm: int, max_miss: float = 0.005) -> tuple[int, int]:
    """Bands x rows (= num_perm) that lean to recall, since every candidate is verified afterwards.

    Among the factorisations of num_perm, take those that miss at most `max_miss` of the pairs lying exactly at
    the threshold, and of those the one with the fewest false candidates (the area under the collision curve
    below the threshold). datasketch's balanced choice for 0.8 at 112 permutations (9 x 12) misses about half the
    pairs at 0.8; 20 x 5 at 100 misses 0.04%.
    """
    options = [(b, num_perm // b) for b in range(1, num_perm + 1) if num_perm % b == 0]
    grid = np.linspace(0.0, threshold, 200)

    def false_area(option: tuple[int, int]) -> float:
        return float(np.mean([band_collision_probability(s, *option) for s in grid]))

    recalling = [o for o in options if 1 - band_collision_probability(threshold, *o) <= max_miss]
    if recalling:
        return min(recalling, key=false_area)
    return max(options, key=lambda o: band_collision_probability(threshold, *o))


@dataclass(frozen=True)
class MinHashParams:
    """Everything that decides which documents are near duplicates; recorded in the output manifest."""

    threshold: float = 0.8
    """Jaccard similarity of the shingle sets at or above which two documents are duplicates."""
    num_perm: int = 100
    """Permutations (signature length). 100 = 20 bands x 5 rows at 0.8, recall 99.96% at the threshold."""
    bands: int = 20
    rows: int = 5
    ngram: int = 5
    """Shingle length: words (or characters with shingle='char')."""
    shingle: str = "word"
    """'word' n-grams, or 'char' n-grams for languages written without spaces."""
    seed: int = 1
    """Seeds the permutations; documents are only comparable under the same seed."""

    @classmethod
    def for_threshold(cls, threshold: float = 0.8, num_perm: int = 100, bands: int | None = None,
                      rows: int | None = None, ngram: int = 5, shingle: str = "word", seed: int = 1) -> "MinHashParams":
        """Validated parameters; bands/rows derived from the threshold unless both are given."""
        if not 0.0 < threshold < 1.0:
            raise UserError("--threshold", f"{threshold} is outside (0, 1)", "use a Jaccard threshold such as 0.8")
        if num_perm < 1 or num_perm > 4096:
            raise UserError("--num-perm", f"{num_perm} is out of range", "use between 1 and 4096 permutations (100 is a good default)")
        if ngram < 1:
            raise UserError("--ngram", f"{ngram} must be at least 1", "use e.g. 5 (word shingles) or 5 to 9 (character shingles)")
        if shingle not in SHINGLE_KINDS:
            raise UserError("--shingle", f"unknown shingle kind {shingle!r}", "use word or char")
        if (bands is None) != (rows is None):
            raise UserError("--bands/--rows", "only one of the two is given", "give both, or neither to derive them from --threshold")
        if bands is None:
            bands, rows = choose_bands(threshold, num_perm)
        if bands < 1 or rows < 1 or bands * rows != num_perm:
            raise UserError("--bands/--rows", f"{bands} bands x {rows} rows = {bands * rows}, not --num-perm {num_perm}",
                            f"choose bands x rows = {num_perm}, or omit both to derive them from --threshold")
        return cls(threshold, num_perm, bands, rows, ngram, shingle, seed)

    def permutations(self) -> np.ndarray:
        """Odd 32-bit multipliers a: the permutations x -> a*x mod 2^32 of the 32-bit shingle keys.

        The keys are already well-mixed hashes, so each multiplication is a fresh pseudo-random order of them; on
        real text the estimate's error matches ideal MinHash (the binomial spread: RMSE 0.042 measured vs 0.042
        predicted at 100 permutations on 3,000 pairs), and one multiply per value is all the work there is.
        """
        rng = np.random.Generator(np.random.PCG64(self.seed))
        return rng.integers(0, 2**32, size=self.num_perm, dtype=np.uint32) | np.uint32(1)


# ---------------------------------------------------------------------------------------------------------------
# Normalisation and tokens


def normalize(text: str) -> str:
    """Unicode NFKC and case folding. Whitespace runs are collapsed by tokenisation: documents are compared as
    their sequences of whitespace-separated tokens (exact dedup) or of words (shingles)."""
    folded = unicodedata.normalize("NFKC", text).casefold()
    # The tokeniser splits on ASCII whitespace; these are the only other str.split() separators NFKC leaves.
    if folded.isascii() or not any(space in folded for space in _OTHER_SPACES_TEXT):
        return folded
    return folded.translate(_OTHER_SPACES)


def normalize_array(texts: pa.Array | pa.ChunkedArray) -> pa.LargeStringArray:
    """normalize() over an arrow array of texts (nulls become ''): NFKC and case folding are plain ASCII
    lower-casing on ASCII text, which arrow does in bulk; only the other texts go through Python."""
    texts = pc.ascii_lower(pc.fill_null(_plain_strings(texts).cast(pa.large_string()), ""))
    is_ascii = np.asarray(pc.string_is_ascii(texts), dtype=bool)
    if is_ascii.all():
        return texts
    others = np.flatnonzero(~is_ascii)
    folded = pa.array([normalize(t) for t in texts.take(pa.array(others)).to_pylist()], pa.large_string())
    return pc.replace_with_mask(texts, pa.array(~is_ascii), folded)


def _plain_strings(texts: Sequence[str] | pa.Array | pa.ChunkedArray) -> pa.Array:
    """A string or large_string arrow array (offsets and one data buffer) of any texts."""
    if isinstance(texts, pa.ChunkedArray):
        texts = texts.combine_chunks()
    elif not isinstance(texts, pa.Array):
        texts = pa.array(list(texts), pa.large_string())
    if not (pa.types.is_string(texts.type) or pa.types.is_large_string(texts.type)):
        texts = texts.cast(pa.large_string())
    return texts


_OTHER_SPACES = {0x85: " ", 0x1680: " ", 0x2028: " ", 0x2029: " "}
_OTHER_SPACES_TEXT = [chr(c) for c in _OTHER_SPACES]


@functools.cache
def changing_characters() -> str:
    """An RE2 character class of the characters a document must hold for normalize() to do more than
    lower-case its ASCII letters: those that NFKC or case folding change, those that compose with or reorder
    around their neighbours (combining marks, the second characters of canonical compositions, Hangul vowel
    and final jamo), the extra spaces, and every character beyond plane 1 (not examined: rare, and always
    safe to normalise). Derived from this Python's Unicode tables once per process (0.02 s)."""
    changing = set(_OTHER_SPACES) | set(range(0x1161, 0x1176)) | set(range(0x11A8, 0x11C3))
    for block in range(0x80, 0x20000, 128):
        if 0xD800 <= block < 0xE000:
            continue  # surrogates: never in UTF-8 text
        chars = np.arange(block, block + 128, dtype="<u4").tobytes().decode("utf-32-le")
        changing.update(block + i for i, c in enumerate(chars) if unicodedata.combining(c))
        # A block that case folding and NFKD leave alone as a whole holds no character either changes.
        if chars.casefold() == chars and unicodedata.normalize("NFKD", chars) == chars:
            continue
        for i, c in enumerate(chars):
            if c.casefold() != c:
                changing.add(block + i)
            decomposition = unicodedata.decomposition(c)
            if not decomposition:
                continue
            if unicodedata.normalize("NFKC", c) != c:
                changing.add(block + i)
            parts = decomposition.split()
            if not decomposition.startswith("<") and len(parts) == 2:
                changing.add(int(parts[1], 16))  # may compose with the character before it
    ranges: list[list[int]] = []
    for c in sorted(changing):
        if ranges and ranges[-1][1] == c - 1:
            ranges[-1][1] = c
        else:
            ranges.append([c, c])
    spans = "".join(f"\\x{{{a:x}}}" if a == b else f"\\x{{{a:x}}}-\\x{{{b:x}}}" for a, b in ranges)
    return f"[{spans}\\x{{20000}}-\\x{{10ffff}}]"


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
    """Exact hashes and words of every document's normalised text (normalize(); nulls are empty), in one pass
    over the UTF-8 bytes of the batch (_minhash.c).

    Documents are hashed straight from the arrow buffer when normalize() would only lower-case their ASCII
    letters, which the kernel does as it reads: ASCII documents, and those whose other characters are all
    left alone by NFKC and case folding (curly quotes, dashes, accented lower-case letters, most scripts).
    The rest are normalised in Python into a second buffer that the kernel reads instead.

    A token is a run of bytes other than ASCII whitespace; its hash (and a word's) is sum_m c_m * R^(8m + 1)
    mod 2^64 over its 8-byte little-endian chunks c_m, finished with its length and a multiply-xorshift, so
    the same token hashes alike wherever it lies.
    """
    texts = _plain_strings(texts)
    width = np.int64 if pa.types.is_large_string(texts.type) else np.int32
    offsets = np.frombuffer(texts.buffers()[1], dtype=width)[texts.offset:texts.offset + len(texts) + 1].astype(np.int64)
    data = texts.buffers()[2] if texts.buffers()[2] is not None else pa.py_buffer(b"")
    starts, ends = offsets[:-1].copy(), offsets[1:].copy()
    if texts.null_count:
        empty = np.asarray(texts.is_null(), dtype=bool)
        ends[empty] = starts[empty]
    extra = b""
    others = np.flatnonzero(~np.asarray(pc.fill_null(pc.string_is_ascii(texts), True), dtype=bool))
    if len(others):
        changing = pc.match_substring_regex(texts.take(pa.array(others)), changing_characters())
        others = others[np.asarray(changing, dtype=bool)]
    if len(others):
        folded = [normalize(t).encode() for t in texts.take(pa.array(others)).to_pylist()]
        extra = b"".join(folded)
        # Positions from len(data) on address the second buffer.
        ends[others] = data.size + np.cumsum([len(f) for f in folded], dtype=np.int64)
        starts[others] = np.concatenate([[data.size], ends[others][:-1]])
    # A word takes at least one byte and a separator: a document of n bytes has at most (n + 1) // 2 of them.
    room = (int((ends - starts).sum()) + len(texts)) // 2 + 1
    exact, word_hashes, word_counts = np.empty((len(texts), 2), np.uint64), np.empty(room, np.uint64), np.empty(len(texts), np.int64)
    words = _minhash.tokenize(data, extra, starts, ends, exact, word_hashes, word_counts)
    return Tokens(exact, word_hashes[:words], _offsets(word_counts))


def _offsets(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=out[1:])
    return out


# ---------------------------------------------------------------------------------------------------------------
# Shingles


def char_tokens(texts: Sequence[str] | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Word-class characters of the normalised texts as tokens (code points), for languages without spaces
    (Chinese, Japanese, Thai)."""
    kept = pc.replace_substring_regex(normalize_array(_plain_strings(texts)), NON_WORD, "").to_pylist()
    points = [np.frombuffer(t.encode("utf-32-le", "surrogatepass"), dtype="<u4") for t in kept]
    counts = np.array([len(p) for p in points], dtype=np.int64)
    joined = np.concatenate(points).astype(np.uint64) if points else np.zeros(0, np.uint64)
    return mix64(joined), np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def shingle_hashes(texts: Sequence[str] | pa.Array, ngram: int = 5, shingle: str = "word",
                   tokens: Tokens | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(hashes, offsets) of the n-gram shingles of each document's normalised text (duplicates included; a min
    does not mind); `tokens` = tokenize(texts) when the caller has it already.

    A document with fewer than `ngram` tokens (but at least one) has one shingle of all its tokens; a document
    without tokens has none.
    """
    if shingle == "char":
        return ngrams(*char_tokens(texts), ngram)
    tokens = tokens or tokenize(texts)
    return ngrams(tokens.words, tokens.word_offsets, ngram)


def ngrams(tokens: np.ndarray, offsets: np.ndarray, ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """(hashes, offsets) of the n-grams of consecutive tokens of each document: mix64(sum_k t[j + k] * W[k]),
    W being fixed odd constants (so order matters); a document with 1 to ngram - 1 tokens has one, of all its
    tokens."""
    out = np.empty(len(tokens), np.uint64)
    counts = np.empty(len(offsets) - 1, np.int64)
    total = _minhash.shingles(np.ascontiguousarray(tokens, np.uint64), np.ascontiguousarray(offsets, np.int64),
                              _NGRAM_WEIGHTS[np.arange(ngram) % len(_NGRAM_WEIGHTS)], out, counts)
    return out[:total], _offsets(counts)


def shingle_sets(texts: Sequence[str] | pa.Array, ngram: int = 5, shingle: str = "word") -> list[np.ndarray]:
    """Each document's shingle set as sorted unique uint64: what exact Jaccard verification compares."""
    values, bounds = shingle_set_arrays(texts, ngram, shingle)
    return [values[bounds[i]:bounds[i + 1]] for i in range(len(bounds) - 1)]


def shingle_set_arrays(texts: Sequence[str] | pa.Array, ngram: int = 5, shingle: str = "word") -> tuple[np.ndarray, np.ndarray]:
    """The shingle sets of all documents end to end: set i = values[bounds[i]:bounds[i+1]], sorted unique."""
    return sets_from_hashes(*shingle_hashes(texts, ngram, shingle))


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
        keys = (local << np.uint64(64 - SET_DOC_BITS)) | (hashes[offsets[first]:offsets[last]] >> np.uint64(SET_DOC_BITS))
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


def jaccard_many(values: np.ndarray, bounds: np.ndarray, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """Exact Jaccard of many pairs of sets stored end to end (set i = values[bounds[i]:bounds[i+1]], sorted
    unique): one merge of the two sorted sets per pair (_minhash.c); two empty sets are identical."""
    left, right = np.ascontiguousarray(left, np.int64), np.ascontiguousarray(right, np.int64)
    common = np.empty(len(left), np.int64)
    _minhash.intersections(np.ascontiguousarray(values, np.uint64), np.ascontiguousarray(bounds, np.int64), left, right, common)
    sizes = np.diff(bounds)
    union = sizes[left] + sizes[right] - common
    return np.where(union > 0, common / np.maximum(union, 1), 1.0)


# ---------------------------------------------------------------------------------------------------------------
# Signatures and bands


def signatures(shingles: np.ndarray, offsets: np.ndarray, multipliers: np.ndarray) -> np.ndarray:
    """(docs, num_perm) uint32 MinHash signatures: value p of document i is the minimum over its shingles s of
    multipliers[p] * (s >> 32) mod 2^32; a document without shingles gets all 0xFFFFFFFF (_minhash.c)."""
    out = np.empty((len(offsets) - 1, len(multipliers)), dtype=np.uint32)
    _minhash.signatures(np.ascontiguousarray(shingles, np.uint64), np.ascontiguousarray(offsets, np.int64),
                        np.ascontiguousarray(multipliers, np.uint32), out)
    return out


def band_keys(sigs: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(docs, bands) uint64: one key per band of `rows` signature values; equal keys = same bucket."""
    keys = np.zeros((len(sigs), bands), dtype=np.uint64)
    for r in range(rows):
        keys += sigs[:, r::rows][:, :bands].astype(np.uint64) * _NGRAM_WEIGHTS[r % len(_NGRAM_WEIGHTS)]
    return mix64(keys)


def sorted_unique(values: np.ndarray, return_inverse: bool = False):
    """np.unique by sorting: numpy 2.4 answers np.unique of integers from a hash table that is up to 80 times
    slower than a sort (3.4 s against 0.04 s for 4 million uint64 here)."""
    order = np.argsort(values) if return_inverse else None
    ordered = values[order] if return_inverse else np.sort(values)
    first = np.ones(len(ordered), bool)
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    if not return_inverse:
        return ordered[first]
    inverse = np.empty(len(values), np.int64)
    inverse[order] = np.cumsum(first) - 1
    return ordered[first], inverse


def bucket_pairs(keys: np.ndarray, docs: np.ndarray) -> np.ndarray:
    """Candidate pairs (i < j, as i << 32 | j) among documents sharing a key of one band, sorted and unique.

    Buckets of up to MAX_BUCKET_PAIRS_SPAN documents give all their pairs; larger ones (templated pages) give
    each member's pairs with its next MAX_BUCKET_PAIRS_SPAN neighbours in document order plus a pair with the
    bucket's first document, enough to connect a true cluster while staying linear in its size.
    """
    if len(docs) < 2:
        return np.zeros(0, np.uint64)
    order = np.argsort(keys)  # unstable: the vectorised sort, several times faster than a stable one
    keys, docs = keys[order], docs[order].astype(np.uint64)
    # Members of a bucket in document order: only buckets of two or more (few) need sorting again.
    repeated = np.flatnonzero(keys[1:] == keys[:-1])
    if len(repeated):
        in_bucket = np.zeros(len(keys), bool)
        in_bucket[repeated] = in_bucket[repeated + 1] = True
        members = np.flatnonzero(in_bucket)
        docs[members] = docs[members][np.lexsort((docs[members], keys[members]))]
    first_of_group = np.flatnonzero(np.concatenate([[True], keys[1:] != keys[:-1]]))
    sizes = np.diff(np.concatenate([first_of_group, [len(docs)]]))
    # Member at position p of a bucket of n pairs with the next min(n - 1 - p, span) members, all in one go.
    position = np.arange(len(docs)) - np.repeat(first_of_group, sizes)
    ahead = np.minimum(np.repeat(sizes, sizes) - 1 - position, MAX_BUCKET_PAIRS_SPAN)
    member = np.flatnonzero(ahead > 0)
    counts = ahead[member]
    near = np.repeat(member, counts)
    step = np.arange(len(near)) - np.repeat(np.cumsum(counts) - counts, counts) + 1
    pieces = [(docs[near] << np.uint64(32)) | docs[near + step]]
    large = sizes > MAX_BUCKET_PAIRS_SPAN + 1
    if large.any():
        heads = np.repeat(docs[first_of_group[large]], sizes[large] - 1)
        members = np.concatenate([docs[s + 1:s + n] for s, n in zip(first_of_group[large], sizes[large])])
        pieces.append((heads << np.uint64(32)) | members)
    return sorted_unique(np.concatenate(pieces))


def estimate_jaccard(sigs: np.ndarray, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """The MinHash estimate of the Jaccard of each pair of documents (rows left[k] and right[k] of the
    (docs, num_perm) signatures): the fraction of equal values, counted without gathering the rows (_minhash.c)."""
    left, right = np.ascontiguousarray(left, np.int64), np.ascontiguousarray(right, np.int64)
    equal = np.empty(len(left), np.int64)
    _minhash.agreements(np.ascontiguousarray(sigs, np.uint32), sigs.shape[1], left, right, equal)
    return equal / sigs.shape[1]


def settle_margin(threshold: float, num_perm: int) -> float:
    """How far from the threshold a signature estimate must be to decide a pair without exact verification:
    five standard deviations of the estimate at the threshold (a wrong call about 1 in 3.5 million)."""
    return 5.0 * math.sqrt(threshold * (1.0 - threshold) / num_perm)


def connected_components(u: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union-find over the edges (u[k], v[k]), vectorised: (nodes, root) with root = the smallest node of each
    component, so the labelling depends on the graph only, never on edge order or on how work was split.

    Each round hooks every edge's larger root under its smaller one (parents only ever point to smaller nodes,
    so no cycle can form), then jumps pointers until every node points at its root.
    """
    nodes, inverse = sorted_unique(np.concatenate([u, v]), return_inverse=True)
    a, b = inverse[:len(u)], inverse[len(u):]
    parent = np.arange(len(nodes))
    while True:
        ra, rb = parent[a], parent[b]
        if np.array_equal(ra, rb):
            return nodes, nodes[parent]
        low = np.minimum(ra, rb)
        np.minimum.at(parent, ra, low)
        np.minimum.at(parent, rb, low)
        while True:
            jumped = parent[parent]
            if np.array_equal(jumped, parent):
                break
            parent = jumped

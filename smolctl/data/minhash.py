"""Vectorised MinHash: normalisation, shingle hashing, signatures and LSH banding over whole batches (no I/O).

    from smolctl.data import minhash
    params = minhash.MinHashParams.for_threshold(0.8)
    shingles, offsets = minhash.shingle_hashes([minhash.normalize(t) for t in texts], params.ngram)
    signatures = minhash.signatures(shingles, offsets, params.permutations())   # (docs, num_perm) uint32

The per-document Python loop of the usual implementations (datasketch hashes every shingle with sha1 in Python)
is replaced by numpy passes over the UTF-8 bytes of a whole batch: tokens are found from a byte classification
and hashed in O(1) each from prefix sums, shingles are combinations of consecutive word hashes, and every
permutation of every shingle is one uint32 multiply, reduced with a segmented minimum per document.
"""

from __future__ import annotations

import math
import unicodedata
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from smolctl.errors import UserError

MAX_HASH = np.uint32(0xFFFFFFFF)
# Characters kept for char shingles: letters, combining marks (Indic and Arabic letters stay whole), digits, '_'.
NON_WORD = r"[^\p{L}\p{M}\p{N}_]+"
SHINGLE_KINDS = ("word", "char")
# Signature work is done in blocks of this many shingles: a (num_perm, block) uint32 scratch of about 6 MiB at
# 100 permutations.
SIGNATURE_BLOCK = 16384
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
    if isinstance(texts, pa.ChunkedArray):
        texts = texts.combine_chunks()
    texts = pc.fill_null(texts.cast(pa.large_string()), "")
    is_ascii = np.asarray(pc.string_is_ascii(texts), dtype=bool)
    lowered = pc.ascii_lower(texts)
    if is_ascii.all():
        return lowered
    others = np.flatnonzero(~is_ascii)
    folded = pa.array([normalize(t) for t in texts.take(pa.array(others)).to_pylist()], pa.large_string())
    return pc.replace_with_mask(lowered, pa.array(~is_ascii), folded)


_OTHER_SPACES = {0x85: " ", 0x1680: " ", 0x2028: " ", 0x2029: " "}
_OTHER_SPACES_TEXT = [chr(c) for c in _OTHER_SPACES]
SPACE, WORD, PUNCT = 0, 1, 2
_BYTE_CLASS = np.full(256, WORD, np.uint8)
_BYTE_CLASS[[c for c in range(128) if not (chr(c).isalnum() or chr(c) == "_")]] = PUNCT
_BYTE_CLASS[list(b"\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f ")] = SPACE
# Tokenise about this many bytes at once: the temporaries are about 40 bytes per byte of text, and two
# cached tables of powers take 8 bytes per byte each. 256 KiB keeps them near the caches (20% faster than
# 1 MiB groups on the benchmark corpus, which touch five times the fresh memory).
TOKENIZE_BYTES = 256 * 1024
_BYTE_RADIX = np.uint64(0x100000001B3)
_BYTE_RADIX_INVERSE = np.uint64(pow(0x100000001B3, -1, 2**64))


@dataclass
class Tokens:
    """A batch of documents as hashes: all documents concatenated, document i owning [offsets[i], offsets[i+1])."""

    tokens: np.ndarray
    """uint64 hash of every whitespace-separated token (what exact dedup compares)."""
    token_offsets: np.ndarray
    words: np.ndarray
    """uint64 hash of every word: a token without its leading and trailing ASCII punctuation (dropped if nothing
    is left), so that "word," and "(word" are "word" and punctuation edits barely move the shingles."""
    word_offsets: np.ndarray


def tokenize(normalized: Sequence[str] | pa.Array) -> Tokens:
    """Tokens and words of every document, found and hashed with numpy over the UTF-8 bytes of the batch."""
    texts = normalized if isinstance(normalized, pa.Array) else pa.array(list(normalized), pa.large_string())
    texts = texts.cast(pa.large_string())
    offsets = _byte_offsets(texts)
    # Groups of about TOKENIZE_BYTES bytes (zero-copy slices): bounded temporaries, warm caches.
    group_of = (offsets[1:] - offsets[0]) // TOKENIZE_BYTES
    cuts = np.concatenate([[0], np.flatnonzero(np.diff(group_of)) + 1, [len(texts)]])
    parts = [_tokenize_group(texts.slice(a, b - a)) for a, b in zip(cuts[:-1], cuts[1:]) if b > a] or [_tokenize_group(texts)]

    def joined(column: int) -> tuple[np.ndarray, np.ndarray]:
        counts = np.concatenate([p[column + 1] for p in parts])
        return np.concatenate([p[column] for p in parts]), np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    return Tokens(*joined(0), *joined(2))


def _byte_offsets(texts: pa.LargeStringArray) -> np.ndarray:
    return np.frombuffer(texts.buffers()[1], dtype=np.int64)[texts.offset:texts.offset + len(texts) + 1]


def _tokenize_group(texts: pa.LargeStringArray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(token hashes, tokens per document, word hashes, words per document) for one group of documents.

    Classify every byte (whitespace, word character or any non-ASCII byte, ASCII punctuation), find the token
    spans as runs of non-whitespace that do not cross a document boundary, and hash each span in O(1) from a
    prefix sum: one pass of uint64 work over the bytes serves tokens and words alike. Every step is a fixed
    number of whole-array passes (no per-token rounds), and positions are found from boolean masks, whose
    nonzero() is several times faster than an integer array's.
    """
    offsets = _byte_offsets(texts)
    data = np.frombuffer(texts.buffers()[2], dtype=np.uint8)[offsets[0]:offsets[-1]] if offsets[-1] > offsets[0] else np.zeros(0, np.uint8)
    offsets = offsets - offsets[0]
    kind = np.take(_BYTE_CLASS, data)
    inside = kind != SPACE
    # Token edges: where a non-whitespace run starts or ends, plus document boundaries that fall inside a run.
    step = np.diff(inside.view(np.int8), prepend=np.int8(0), append=np.int8(0))
    changes = np.flatnonzero(step != 0)  # runs alternate: a start (+1), then its end (-1); bool: 7x faster nonzero
    starts, ends = changes[0::2], changes[1::2]
    inner = offsets[1:-1][(offsets[1:-1] > 0) & (offsets[1:-1] < len(data))]
    split = inner[inside[inner] & inside[inner - 1]]
    if len(split):
        starts, ends = np.insert(starts, np.searchsorted(starts, split), split), np.insert(ends, np.searchsorted(ends, split), split)
    per_doc = np.diff(np.searchsorted(starts, offsets))
    prefix = _prefix_sums(data)
    token_hashes = _span_hashes(prefix, starts, ends)
    # A word is its token from the first to the last word byte (tokens of punctuation only have none): with
    # word_count[k] = word bytes before byte k and word_at = the word bytes' positions, a token [s, e) holds
    # word_count[e] - word_count[s] of them, the first at word_at[word_count[s]], the last at
    # word_at[word_count[e] - 1]. Words are hashed from the same prefix sums.
    is_word = kind == WORD
    word_at = np.flatnonzero(is_word)
    word_count = np.zeros(len(data) + 1, np.int32 if len(data) < 2**31 else np.int64)
    np.cumsum(is_word, out=word_count[1:])
    before, through = word_count[starts], word_count[ends]
    present = through > before
    first = word_at[np.minimum(before, len(word_at) - 1)] if len(word_at) else starts
    last = word_at[np.maximum(through - 1, 0)] + 1 if len(word_at) else ends
    trimmed = np.flatnonzero(present & ((first != starts) | (last != ends)))
    word_hashes = token_hashes.copy()  # most words are their whole token: only trimmed ones are re-hashed
    word_hashes[trimmed] = _span_hashes(prefix, first[trimmed], last[trimmed])
    word_hashes = word_hashes[present]
    tokens_before = np.concatenate([[0], np.cumsum(per_doc)])
    present_before = np.concatenate([[0], np.cumsum(present)])
    words_per_doc = np.diff(present_before[tokens_before])
    return token_hashes, per_doc, word_hashes, words_per_doc


def _prefix_sums(data: np.ndarray) -> np.ndarray:
    """P[k] = sum of b_i * R^i over the first k bytes, modulo 2^64 (numpy's uint64 arithmetic wraps)."""
    prefix = np.zeros(len(data) + 1, np.uint64)
    weighted = np.multiply(data, _powers(_BYTE_RADIX, len(data))[:len(data)], dtype=np.uint64)
    np.cumsum(weighted, out=prefix[1:])
    return prefix


def _span_hashes(prefix: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each (non-empty) byte span, the same wherever the span lies.

    The sum over the span of b_i * R^(i - start) = (P[end] - P[start]) * R^-start, R being odd and so invertible
    modulo 2^64.
    """
    sums = (prefix[ends] - prefix[starts]) * _powers(_BYTE_RADIX_INVERSE, len(prefix))[starts]
    # A light multiply-xorshift finish: shingles and exact hashes mix these again.
    mixed = (sums + (ends - starts).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) * np.uint64(0xBF58476D1CE4E5B9)
    return (mixed ^ (mixed >> np.uint64(31))) | np.uint64(1)


def exact_hashes(tokens: Tokens) -> np.ndarray:
    """(docs, 2) uint64: a 128-bit hash of each document's token sequence (= of its whitespace-collapsed text).

    Two polynomial hashes sum_i h_i * R^i mod 2^64 of the (well-mixed) token hashes with different odd R: distinct
    sequences collide with probability about 2^-128.
    """
    counts = np.diff(tokens.token_offsets)
    position = np.arange(len(tokens.tokens), dtype=np.int64) - np.repeat(tokens.token_offsets[:-1], counts)
    out = np.zeros((len(counts), 2), np.uint64)
    filled = counts > 0
    for column, radix in enumerate((0x9E3779B97F4A7C15, 0xD6E8FEB86659FD93)):
        terms = tokens.tokens * _powers(np.uint64(radix), int(counts.max(initial=0)))[position]
        if filled.any():
            out[filled, column] = np.add.reduceat(terms, tokens.token_offsets[:-1][filled])
        out[:, column] = mix64(out[:, column] ^ counts.astype(np.uint64) * np.uint64(radix))
    return out


_POWERS: dict[int, np.ndarray] = {}


def _powers(radix: np.uint64, count: int) -> np.ndarray:
    """radix^i mod 2^64 for i < count (at least), grown by doubling and cached up to a group's worth."""
    cached = _POWERS.get(int(radix))
    if cached is not None and len(cached) >= count:
        return cached
    table = np.full(1 << max(10, int(count - 1).bit_length()), radix, np.uint64)
    table[0] = 1
    table = np.cumprod(table, dtype=np.uint64)
    if len(table) <= 4 * TOKENIZE_BYTES:
        _POWERS[int(radix)] = table
    return table


# ---------------------------------------------------------------------------------------------------------------
# Shingles


def char_tokens(normalized: Sequence[str] | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Word-class characters as tokens (code points), for languages without spaces (Chinese, Japanese, Thai)."""
    texts = normalized if isinstance(normalized, pa.Array) else pa.array(list(normalized), pa.large_string())
    kept = pc.replace_substring_regex(texts, NON_WORD, "").to_pylist()
    points = [np.frombuffer(t.encode("utf-32-le", "surrogatepass"), dtype="<u4") for t in kept]
    counts = np.array([len(p) for p in points], dtype=np.int64)
    joined = np.concatenate(points).astype(np.uint64) if points else np.zeros(0, np.uint64)
    return mix64(joined), np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def shingle_hashes(normalized: Sequence[str] | pa.Array, ngram: int = 5, shingle: str = "word",
                   tokens: Tokens | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(hashes, offsets) of each document's n-gram shingles (duplicates included; a min does not mind).

    A document with fewer than `ngram` tokens (but at least one) has one shingle of all its tokens; a document
    without tokens has none.
    """
    if shingle == "char":
        return ngrams(*char_tokens(normalized), ngram)
    tokens = tokens or tokenize(normalized)
    return ngrams(tokens.words, tokens.word_offsets, ngram)


def ngrams(tokens: np.ndarray, offsets: np.ndarray, ngram: int) -> tuple[np.ndarray, np.ndarray]:
    counts = np.diff(offsets)
    weights = _NGRAM_WEIGHTS[np.arange(ngram) % len(_NGRAM_WEIGHTS)]
    padded = np.concatenate([tokens, np.zeros(ngram, np.uint64)])
    combined = np.zeros(len(tokens), np.uint64)
    for k in range(ngram):
        combined += padded[k:k + len(tokens)] * weights[k]
    # Shingles that start at a document's token j and end inside it: j < count - ngram + 1.
    full = np.maximum(counts - ngram + 1, 0)
    short = np.flatnonzero((counts > 0) & (counts < ngram))
    keep = np.arange(len(tokens)) - np.repeat(offsets[:-1], counts) < np.repeat(full, counts)
    if len(short):
        # A short document's single shingle: its tokens only, none of the next document's.
        starts = offsets[short]
        fixed = np.zeros(len(short), np.uint64)
        for k in range(ngram):
            inside = k < counts[short]
            fixed += np.where(inside, padded[np.minimum(starts + k, len(tokens))] * weights[k], np.uint64(0))
        combined[starts] = fixed
        keep[starts] = True
    per_doc = np.where((counts > 0) & (counts < ngram), 1, full)
    return mix64(combined[keep]), np.concatenate([[0], np.cumsum(per_doc)]).astype(np.int64)


def shingle_sets(normalized: Sequence[str] | pa.Array, ngram: int = 5, shingle: str = "word") -> list[np.ndarray]:
    """Each document's shingle set as sorted unique uint64: what exact Jaccard verification compares."""
    values, bounds = shingle_set_arrays(normalized, ngram, shingle)
    return [values[bounds[i]:bounds[i + 1]] for i in range(len(bounds) - 1)]


def shingle_set_arrays(normalized: Sequence[str] | pa.Array, ngram: int = 5, shingle: str = "word") -> tuple[np.ndarray, np.ndarray]:
    """The shingle sets of all documents end to end: set i = values[bounds[i]:bounds[i+1]], sorted unique."""
    return sets_from_hashes(*shingle_hashes(normalized, ngram, shingle))


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
    unique), without a Python loop: both sets of every pair go into one array keyed by (pair, hash), sorted once,
    and an element of an intersection is an equal neighbour. Keys keep the top 44 bits of each hash, so two
    distinct shingles of a pair of 1,000-shingle documents look alike with probability 6e-8."""
    sizes = np.diff(bounds)
    out = np.ones(len(left))
    block = 1 << 20  # pairs per sort: the pair number takes the 20 bits above the 44 of hash
    for start in range(0, len(left), block):
        a, b = left[start:start + block], right[start:start + block]
        pair = np.arange(len(a), dtype=np.uint64)
        keys = np.concatenate([_keyed_members(values, bounds, sizes, a, pair), _keyed_members(values, bounds, sizes, b, pair)])
        keys.sort()
        equal = keys[1:] == keys[:-1]
        common = np.bincount((keys[1:][equal] >> np.uint64(44)).astype(np.int64), minlength=len(a))
        union = sizes[a] + sizes[b] - common
        out[start:start + block] = np.where(union > 0, common / np.maximum(union, 1), 1.0)
    return out


def _keyed_members(values: np.ndarray, bounds: np.ndarray, sizes: np.ndarray, sets: np.ndarray, pair: np.ndarray) -> np.ndarray:
    lengths = sizes[sets]
    index = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths - bounds[sets], lengths)
    return (np.repeat(pair, lengths) << np.uint64(44)) | (values[index] >> np.uint64(20))


# ---------------------------------------------------------------------------------------------------------------
# Signatures and bands


def signatures(shingles: np.ndarray, offsets: np.ndarray, multipliers: np.ndarray) -> np.ndarray:
    """(docs, num_perm) uint32 MinHash signatures; a document without shingles gets all 0xFFFFFFFF.

    Shingles are processed in blocks: a*x mod 2^32 over (num_perm, block) in uint32 (twice the SIMD width of
    uint64 and half the memory traffic), then a segmented minimum per document along the contiguous axis
    (np.minimum.reduceat), four times faster than reducing across rows.
    """
    num_docs = len(offsets) - 1
    out = np.full((len(multipliers), num_docs), MAX_HASH, dtype=np.uint32)
    keys = (shingles >> np.uint64(32)).astype(np.uint32)
    doc_of = np.repeat(np.arange(num_docs), np.diff(offsets))
    scratch = np.empty((len(multipliers), SIGNATURE_BLOCK), dtype=np.uint32)
    for start in range(0, len(keys), SIGNATURE_BLOCK):
        stop = min(start + SIGNATURE_BLOCK, len(keys))
        block = scratch[:, :stop - start]
        np.multiply(multipliers[:, None], keys[None, start:stop], out=block)
        docs = doc_of[start:stop]
        seg_starts = np.flatnonzero(np.concatenate([[True], docs[1:] != docs[:-1]]))
        seg_docs = docs[seg_starts]
        out[:, seg_docs] = np.minimum(out[:, seg_docs], np.minimum.reduceat(block, seg_starts, axis=1))
    return np.ascontiguousarray(out.T)


def band_keys(sigs: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(docs, bands) uint64: one key per band of `rows` signature values; equal keys = same bucket."""
    keys = np.zeros((len(sigs), bands), dtype=np.uint64)
    for r in range(rows):
        keys += sigs[:, r::rows][:, :bands].astype(np.uint64) * _NGRAM_WEIGHTS[r % len(_NGRAM_WEIGHTS)]
    return mix64(keys)


def bucket_pairs(keys: np.ndarray, docs: np.ndarray) -> np.ndarray:
    """Candidate pairs (i < j, as i << 32 | j) among documents sharing a key of one band, sorted and unique.

    Buckets of up to MAX_BUCKET_PAIRS_SPAN documents give all their pairs; larger ones (templated pages) give
    each member's pairs with its next MAX_BUCKET_PAIRS_SPAN neighbours in document order plus a pair with the
    bucket's first document, enough to connect a true cluster while staying linear in its size.
    """
    ascending = len(docs) < 2 or bool(np.all(docs[1:] > docs[:-1]))
    order = np.argsort(keys, kind="stable") if ascending else np.lexsort((docs, keys))
    keys, docs = keys[order], docs[order].astype(np.uint64)
    if len(docs) < 2:
        return np.zeros(0, np.uint64)
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
    return np.unique(np.concatenate(pieces))


def estimate_jaccard(sig_a: np.ndarray, sig_b: np.ndarray) -> np.ndarray:
    """Row-wise fraction of equal signature values: the MinHash estimate of each pair's Jaccard."""
    return (sig_a == sig_b).mean(axis=-1)


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
    nodes, inverse = np.unique(np.concatenate([u, v]), return_inverse=True)
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

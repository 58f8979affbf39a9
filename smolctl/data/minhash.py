"""Vectorised MinHash: normalisation, shingle hashing, signatures and LSH banding over whole batches (no I/O).

    from smolctl.data import minhash
    params = minhash.MinHashParams.for_threshold(0.8)
    shingles = minhash.shingle_hashes([minhash.normalize(t) for t in texts], params.ngram, params.shingle)
    signatures = minhash.signatures(shingles, params.permutations())        # (docs, num_perm) uint32

The per-document Python loop of the usual implementations (datasketch hashes every shingle with sha1 in Python)
is replaced by numpy passes over a whole batch: words are hashed with a position-weighted byte sum reduced per
word, shingles are combinations of consecutive word hashes, and all permutations of all shingles are one
multiply-add per element, reduced with a segmented minimum per document.
"""

from __future__ import annotations

import hashlib
import math
import unicodedata
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from smolctl.errors import UserError

MAX_HASH = np.uint32(0xFFFFFFFF)
# Word characters for shingles: letters, combining marks (so Indic and Arabic words stay whole), digits, '_'.
NON_WORD = r"[^\p{L}\p{M}\p{N}_]+"
SHINGLE_KINDS = ("word", "char")
# Signature work is done in blocks of this many shingles, so the (shingles, num_perm) uint64 scratch stays
# around 8 MiB at 128 permutations, inside the CPU caches' reach.
SIGNATURE_BLOCK = 8192
# A band bucket larger than this yields pairs only between near neighbours in document order plus a star from
# its first member: a bucket of k documents would otherwise cost k²/2 verifications.
MAX_BUCKET_PAIRS_SPAN = 64


def _u64(values: Sequence[int]) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


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


_BYTE_WEIGHTS = _constants(256, 0x5EED0001)
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
            raise UserError("--ngram", f"{ngram} must be at least 1", "use e.g. 5 for words or 5 for characters")
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

    def permutations(self) -> tuple[np.ndarray, np.ndarray]:
        """(a, b) of the multiply-add-shift family h(x) = (a*x + b mod 2^64) >> 32 over 32-bit keys x.

        Dietzfelbinger's scheme: strongly universal for w-bit keys with 2w-bit arithmetic, which numpy's wrapping
        uint64 multiply gives for free (datasketch's (a*x + b) mod p overflows uint64 the same way, unprotected).
        """
        rng = np.random.Generator(np.random.PCG64(self.seed))
        a = rng.integers(0, 2**64, size=self.num_perm, dtype=np.uint64) | np.uint64(1)
        b = rng.integers(0, 2**64, size=self.num_perm, dtype=np.uint64)
        return a, b


# ---------------------------------------------------------------------------------------------------------------
# Normalisation and exact hashes


def normalize(text: str) -> str:
    """Unicode NFKC, case-folded, whitespace runs collapsed to one space: the text exact dedup compares."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def exact_hashes(normalized: Sequence[str]) -> np.ndarray:
    """128-bit blake2b of each normalised text as (docs, 2) uint64: collisions are out of reach at any scale."""
    digests = b"".join(hashlib.blake2b(t.encode("utf-8", "surrogatepass"), digest_size=16).digest() for t in normalized)
    return np.frombuffer(digests, dtype=np.uint64).reshape(-1, 2).copy() if normalized else np.zeros((0, 2), np.uint64)


# ---------------------------------------------------------------------------------------------------------------
# Tokens and shingles


def words(normalized: Sequence[str]) -> pa.ListArray:
    """Each text's words (runs of letters, marks, digits and '_'), as an arrow list array (may hold '')."""
    spaced = pc.replace_substring_regex(pa.array(normalized, pa.large_string()), NON_WORD, " ")
    return pc.utf8_split_whitespace(spaced)


def _hash_strings(strings: pa.Array) -> np.ndarray:
    """A 64-bit hash of each (non-empty) string: byte i of a word weighted by a random odd constant, summed
    per word with one segmented reduction, then mixed. Vectorised over all words of a batch."""
    strings = strings.cast(pa.large_string()) if strings.type != pa.large_string() else strings
    offsets = np.frombuffer(strings.buffers()[1], dtype=np.int64)[strings.offset:strings.offset + len(strings) + 1]
    data = np.frombuffer(strings.buffers()[2], dtype=np.uint8) if strings.buffers()[2] is not None else np.zeros(0, np.uint8)
    starts, ends = offsets[:-1], offsets[1:]
    lengths = ends - starts
    body = data[offsets[0]:offsets[-1]]
    local_starts = starts - offsets[0]
    position = np.arange(len(body), dtype=np.int64) - np.repeat(local_starts, lengths)
    weighted = body.astype(np.uint64) * _BYTE_WEIGHTS[position & 255]
    sums = np.add.reduceat(weighted, local_starts) if len(body) else np.zeros(0, np.uint64)
    return mix64(sums ^ (lengths.astype(np.uint64) << np.uint64(56)))


def token_hashes(normalized: Sequence[str], shingle: str = "word") -> tuple[np.ndarray, np.ndarray]:
    """(hashes, offsets): all tokens of all documents concatenated; document i owns hashes[offsets[i]:offsets[i+1]]."""
    if shingle == "char":
        # Characters of the word class, as code points: no space to split on in Chinese, Japanese or Thai.
        kept = pc.replace_substring_regex(pa.array(normalized, pa.large_string()), NON_WORD, "").to_pylist()
        points = [np.frombuffer(t.encode("utf-32-le", "surrogatepass"), dtype="<u4") for t in kept]
        counts = np.array([len(p) for p in points], dtype=np.int64)
        joined = np.concatenate(points).astype(np.uint64) if points else np.zeros(0, np.uint64)
        return mix64(joined), np.concatenate([[0], np.cumsum(counts)])
    lists = words(normalized)
    flat = lists.flatten()
    offsets = np.asarray(lists.offsets, dtype=np.int64)
    counts = np.diff(offsets)
    # The whitespace split leaves an empty string where a text starts or ends with a non-word run.
    nonempty = np.asarray(pc.greater(pc.binary_length(flat), 0))
    if not nonempty.all():
        flat = flat.filter(pa.array(nonempty))
        counts = np.bincount(np.repeat(np.arange(len(counts)), counts)[nonempty], minlength=len(counts))
    # Hash each distinct word once: a batch has far fewer distinct words than words.
    encoded = pc.dictionary_encode(flat)
    vocabulary_hashes = _hash_strings(encoded.dictionary)
    hashes = vocabulary_hashes[np.asarray(encoded.indices, dtype=np.int64)] if len(flat) else np.zeros(0, np.uint64)
    return hashes, np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def shingle_hashes(normalized: Sequence[str], ngram: int = 5, shingle: str = "word") -> tuple[np.ndarray, np.ndarray]:
    """(hashes, offsets) of each document's n-gram shingles (duplicates included; a min does not mind).

    A document with fewer than `ngram` tokens (but at least one) has one shingle of all its tokens; a document
    without tokens has none.
    """
    tokens, offsets = token_hashes(normalized, shingle)
    return ngrams(tokens, offsets, ngram)


def ngrams(tokens: np.ndarray, offsets: np.ndarray, ngram: int) -> tuple[np.ndarray, np.ndarray]:
    counts = np.diff(offsets)
    doc_end = np.repeat(offsets[1:], counts)
    doc_start = np.repeat(offsets[:-1], counts)
    index = np.arange(len(tokens), dtype=np.int64)
    padded = np.concatenate([tokens, np.zeros(ngram, np.uint64)])
    combined = np.zeros(len(tokens), np.uint64)
    for k in range(ngram):
        term = padded[k:k + len(tokens)] * _NGRAM_WEIGHTS[k % len(_NGRAM_WEIGHTS)]
        combined += np.where(index + k < doc_end, term, np.uint64(0))
    valid = (index + ngram <= doc_end) | ((index == doc_start) & (counts[np.repeat(np.arange(len(counts)), counts)] < ngram))
    per_doc = np.bincount(np.repeat(np.arange(len(counts)), counts)[valid], minlength=len(counts))
    return mix64(combined[valid]), np.concatenate([[0], np.cumsum(per_doc)]).astype(np.int64)


def shingle_sets(normalized: Sequence[str], ngram: int = 5, shingle: str = "word") -> list[np.ndarray]:
    """Each document's shingle set as sorted unique uint64: what exact Jaccard verification compares."""
    hashes, offsets = shingle_hashes(normalized, ngram, shingle)
    return [np.unique(hashes[offsets[i]:offsets[i + 1]]) for i in range(len(offsets) - 1)]


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Exact Jaccard of two sorted unique hash sets (two empty sets are identical)."""
    if len(a) == 0 and len(b) == 0:
        return 1.0
    common = len(np.intersect1d(a, b, assume_unique=True))
    return common / (len(a) + len(b) - common)


# ---------------------------------------------------------------------------------------------------------------
# Signatures and bands


def signatures(shingles: np.ndarray, offsets: np.ndarray, permutations: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """(docs, num_perm) uint32 MinHash signatures; a document without shingles gets all 0xFFFFFFFF.

    Shingles are processed in blocks: h = a*x + b over (block, num_perm), then a segmented minimum per document
    (np.minimum.reduceat). The minimum of the full 64-bit values has the same top 32 bits as the minimum of the
    shifted ones, so the shift is applied to the (docs, num_perm) result only.
    """
    a, b = permutations
    num_docs = len(offsets) - 1
    out = np.full((num_docs, len(a)), np.iinfo(np.uint64).max, dtype=np.uint64)
    keys = shingles >> np.uint64(32)
    doc_of = np.repeat(np.arange(num_docs), np.diff(offsets))
    scratch = np.empty((SIGNATURE_BLOCK, len(a)), dtype=np.uint64)
    for start in range(0, len(keys), SIGNATURE_BLOCK):
        stop = min(start + SIGNATURE_BLOCK, len(keys))
        block = scratch[:stop - start]
        np.multiply(keys[start:stop, None], a[None, :], out=block)
        block += b
        docs = doc_of[start:stop]
        seg_starts = np.flatnonzero(np.concatenate([[True], docs[1:] != docs[:-1]]))
        mins = np.minimum.reduceat(block, seg_starts, axis=0)
        seg_docs = docs[seg_starts]
        out[seg_docs] = np.minimum(out[seg_docs], mins)
    return (out >> np.uint64(32)).astype(np.uint32)


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
    order = np.lexsort((docs, keys))
    keys, docs = keys[order], docs[order].astype(np.uint64)
    same = keys[1:] == keys[:-1]
    group = np.concatenate([[0], np.cumsum(~same)])
    pieces = []
    for span in range(1, MAX_BUCKET_PAIRS_SPAN + 1):
        if span >= len(docs):
            break
        hit = group[span:] == group[:-span]
        if not hit.any():
            break
        pieces.append((docs[:-span][hit] << np.uint64(32)) | docs[span:][hit])
    first_of_group = np.flatnonzero(np.concatenate([[True], ~same]))
    sizes = np.diff(np.concatenate([first_of_group, [len(docs)]]))
    large = sizes > MAX_BUCKET_PAIRS_SPAN + 1
    if large.any():
        heads = np.repeat(docs[first_of_group[large]], sizes[large] - 1)
        members = np.concatenate([docs[s + 1:s + n] for s, n in zip(first_of_group[large], sizes[large])])
        pieces.append((heads << np.uint64(32)) | members)
    return np.unique(np.concatenate(pieces)) if pieces else np.zeros(0, np.uint64)


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

"""Locality-sensitive hashing over signatures: one key per band, and the candidate pairs of documents that
share a band's key."""

from __future__ import annotations

import numpy as np

from smolctl.data.minhash.arrays import mix64, sorted_unique
from smolctl.data.minhash.kernels import NGRAM_WEIGHTS, repeated_values

# A band bucket larger than this yields pairs only between near neighbours in document order plus a star from
# its first member: a bucket of k documents would otherwise cost k²/2 verifications.
MAX_BUCKET_PAIRS_SPAN = 64
# Slots of the low-bits table that screens keys before their exact lookup (a power of two; 1 MiB of bools stays in
# cache and lets few unshared keys through while a band's shared keys are a small share of a million).
SHARED_KEY_TABLE_SIZE = 1 << 20


def band_keys(sigs: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(docs, bands) uint64: one key per band of `rows` signature values; equal keys = same bucket."""
    keys = np.zeros((len(sigs), bands), dtype=np.uint64)
    for r in range(rows):
        keys += sigs[:, r::rows][:, :bands].astype(np.uint64) * NGRAM_WEIGHTS[r % len(NGRAM_WEIGHTS)]
    return mix64(keys)


def bucket_pairs(keys: np.ndarray, docs: np.ndarray) -> np.ndarray:
    """Candidate pairs (i < j, as i << 32 | j) among documents sharing a key of one band, sorted and unique.

    Buckets of up to MAX_BUCKET_PAIRS_SPAN documents give all their pairs; larger ones (templated pages) give
    each member's pairs with its next MAX_BUCKET_PAIRS_SPAN neighbours in document order plus a pair with the
    bucket's first document, enough to connect a true cluster while staying linear in its size.
    """
    keys, docs = _shared_keys(keys, docs)
    if len(docs) < 2:
        return np.zeros(0, np.uint64)
    order = np.argsort(keys)  # unstable: the vectorised sort, several times faster than a stable one
    keys, docs = keys[order], docs[order].astype(np.uint64)
    # Members of a bucket in document order: only buckets of two or more (few) need sorting again.
    repeated = np.flatnonzero(keys[1:] == keys[:-1])
    starts_group = np.concatenate([[True], keys[1:] != keys[:-1]])
    if len(repeated):
        in_bucket = np.zeros(len(keys), bool)
        in_bucket[repeated] = in_bucket[repeated + 1] = True
        members = np.flatnonzero(in_bucket)
        # Buckets lie in key order already: one sort of (bucket rank, document) puts each bucket's documents in
        # order without moving any bucket (documents and ranks both fit 32 bits).
        rank = np.cumsum(starts_group)[members].astype(np.uint64)
        docs[members] = np.sort((rank << np.uint64(32)) | docs[members]) & np.uint64(0xFFFFFFFF)
    first_of_group = np.flatnonzero(starts_group)
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
        members = np.concatenate([docs[s + 1 : s + n] for s, n in zip(first_of_group[large], sizes[large])])
        pieces.append((heads << np.uint64(32)) | members)
    return sorted_unique(np.concatenate(pieces))


def _shared_keys(keys: np.ndarray, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (keys, docs) whose key another document shares: the only ones that pair. Nearly every key of a band is
    unique, so the repeated keys are found from the keys alone (no indices to carry; _minhash.repeated_values
    sorts them by buckets of their top bits) and a lookup leaves few documents to arrange.

    The lookup first tests each key's low bits against a table of the shared keys' low bits (keys are mix64
    outputs, so their low bits are uniform): a binary search of every key, cache miss after cache miss, is
    left to the few that pass."""
    shared = repeated_values(keys)
    if not len(shared):
        return keys[:0], docs[:0]
    low_bits = np.uint64(SHARED_KEY_TABLE_SIZE - 1)
    table = np.zeros(SHARED_KEY_TABLE_SIZE, bool)
    table[(shared & low_bits).astype(np.intp)] = True
    maybe = np.flatnonzero(table[(keys & low_bits).astype(np.intp)])
    found = np.minimum(np.searchsorted(shared, keys[maybe]), len(shared) - 1)
    member = maybe[shared[found] == keys[maybe]]
    return keys[member], docs[member]

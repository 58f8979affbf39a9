"""Locality-sensitive hashing over signatures: one key per band, and the candidate pairs of documents that
share a band's key."""

from __future__ import annotations

import numpy as np

from smolctl.data.minhash.arrays import mix64, sorted_unique
from smolctl.data.minhash.kernels import NGRAM_WEIGHTS, shared_positions

# A band bucket larger than this yields pairs only between near neighbours in document order plus a star from
# its first member: a bucket of k documents would otherwise cost k²/2 verifications.
MAX_BUCKET_PAIRS_SPAN = 64


def band_keys(sigs: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(docs, bands) uint64: one key per band of `rows` signature values; equal keys = same bucket."""
    keys = np.zeros((len(sigs), bands), dtype=np.uint64)
    for r in range(rows):
        keys += sigs[:, r::rows][:, :bands].astype(np.uint64) * NGRAM_WEIGHTS[r % len(NGRAM_WEIGHTS)]
    return mix64(keys)


def bucket_pairs(keys: np.ndarray, docs: np.ndarray) -> np.ndarray:
    """Candidate pairs (i < j, as i << 32 | j) among documents sharing a key of one band, sorted and unique;
    `docs` ascending (the band's documents in order).

    Buckets of up to MAX_BUCKET_PAIRS_SPAN documents give all their pairs; larger ones (templated pages) give
    each member's pairs with its next MAX_BUCKET_PAIRS_SPAN neighbours in document order plus a pair with the
    bucket's first document, enough to connect a true cluster while staying linear in its size.
    """
    # Nearly every key of a band is unique: the kernel finds the few documents whose key another holds, each
    # bucket together and in document order, in one pass over the keys by their top bits.
    members = shared_positions(keys)
    if len(members) < 2:
        return np.zeros(0, np.uint64)
    keys, docs = keys[members], docs[members].astype(np.uint64)
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
        members = np.concatenate([docs[s + 1 : s + n] for s, n in zip(first_of_group[large], sizes[large])])
        pieces.append((heads << np.uint64(32)) | members)
    return sorted_unique(np.concatenate(pieces))

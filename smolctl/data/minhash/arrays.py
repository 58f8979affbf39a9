"""Integer-array helpers of the MinHash code: a fixed 64-bit mixer, unique values by sorting, union-find."""

from __future__ import annotations

import numpy as np


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection on uint64 whose every output bit depends on every input bit."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def odd_constants(count: int, salt: int) -> np.ndarray:
    """Random odd uint64 constants, splitmix64 of their position: fixed forever, so hashes never change across
    releases, machines or processes (Python's hash() is salted per process, which would break determinism)."""
    return mix64(np.arange(count, dtype=np.uint64) + np.uint64(salt)) | np.uint64(1)


def offsets_from_counts(counts: np.ndarray) -> np.ndarray:
    """[0, c0, c0 + c1, ...]: where each of a run of variable-length pieces starts, plus the end."""
    out = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def sorted_unique(values: np.ndarray, return_inverse: bool = False):
    """np.unique by sorting: numpy 2.4 answers np.unique of integers from a hash table that is many times slower
    than a sort (see benchmarks/RESULTS.md, dedup)."""
    order = np.argsort(values) if return_inverse else None
    ordered = values[order] if return_inverse else np.sort(values)
    first = np.ones(len(ordered), bool)
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    if not return_inverse:
        return ordered[first]
    inverse = np.empty(len(values), np.int64)
    inverse[order] = np.cumsum(first) - 1
    return ordered[first], inverse


def connected_components(u: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union-find over the edges (u[k], v[k]), vectorised: (nodes, root) with root = the smallest node of each
    component, so the labelling depends on the graph only, never on edge order or on how work was split.

    Each round hooks every edge's larger root under its smaller one (parents only ever point to smaller nodes,
    so no cycle can form), then jumps pointers until every node points at its root.
    """
    nodes, inverse = sorted_unique(np.concatenate([u, v]), return_inverse=True)
    a, b = inverse[: len(u)], inverse[len(u) :]
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

"""MinHash parameters: what decides which documents are near duplicates, validated, and the band choice.

from smolctl.data.minhash.params import MinHashParams
MinHashParams.for_threshold(0.8)   # 100 permutations as 20 bands x 5 rows, word 5-grams
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from smolctl.errors import UserError
from smolctl.user_cache import cache_path, derived_bytes

# Bumped whenever a hash definition changes: a dedup work area made under another version is not resumed.
# 3: character shingles normalise a text that is not ASCII from the text itself, not its ASCII-lowered form.
HASHING_VERSION = 3
SHINGLE_KINDS = ("word", "char")


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


def settle_margin(threshold: float, num_perm: int) -> float:
    """How far from the threshold a signature estimate must be to decide a pair without exact verification:
    five standard deviations of the estimate at the threshold (a wrong call about 1 in 3.5 million)."""
    return 5.0 * math.sqrt(threshold * (1.0 - threshold) / num_perm)


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
    def for_threshold(
        cls,
        threshold: float = 0.8,
        num_perm: int = 100,
        bands: int | None = None,
        rows: int | None = None,
        ngram: int = 5,
        shingle: str = "word",
        seed: int = 1,
    ) -> MinHashParams:
        """Validated parameters; bands/rows derived from the threshold unless both are given."""
        if not 0.0 < threshold < 1.0:
            raise UserError("--threshold", f"{threshold} is outside (0, 1)", "use a Jaccard threshold such as 0.8")
        if num_perm < 1 or num_perm > 4096:
            raise UserError(
                "--num-perm",
                f"{num_perm} is out of range",
                "use between 1 and 4096 permutations (100 is a good default)",
            )
        if ngram < 1:
            raise UserError(
                "--ngram", f"{ngram} must be at least 1", "use e.g. 5 (word shingles) or 5 to 9 (character shingles)"
            )
        if shingle not in SHINGLE_KINDS:
            raise UserError("--shingle", f"unknown shingle kind {shingle!r}", "use word or char")
        if (bands is None) != (rows is None):
            raise UserError(
                "--bands/--rows",
                "only one of the two is given",
                "give both, or neither to derive them from --threshold",
            )
        if bands is None:
            bands, rows = choose_bands(threshold, num_perm)
        if bands < 1 or rows < 1:
            raise UserError(
                "--bands/--rows",
                f"{bands} bands x {rows} rows: each must be at least 1",
                f"choose bands x rows = {num_perm}, or omit both to derive them from --threshold",
            )
        if bands * rows != num_perm:
            raise UserError(
                "--bands/--rows",
                f"{bands} bands x {rows} rows = {bands * rows}, not --num-perm {num_perm}",
                f"choose bands x rows = {num_perm}, or omit both to derive them from --threshold",
            )
        return cls(threshold, num_perm, bands, rows, ngram, shingle, seed)

    def permutations(self) -> np.ndarray:
        """Odd 32-bit multipliers a: the permutations x -> a*x mod 2^32 of the 32-bit shingle keys.

        The keys are already well-mixed hashes, so each multiplication is a fresh pseudo-random order of them; on
        real text the estimate's error matches ideal MinHash (the binomial spread of a perfect MinHash, checked by
        tests/test_dedup.py), and one multiply per value is all the work there is.
        """
        return _permutations(self.seed, self.num_perm).copy()


@functools.cache
def _permutations(seed: int, num_perm: int) -> np.ndarray:
    # Every shard's signatures and the recomputed rows use the same multipliers: derived once per process, and
    # kept in smolctl's cache, since importing numpy.random is a noticeable part of a small run's start-up. The
    # entry is named by numpy's version (Generator's streams may change from one version to the next) and by
    # HASHING_VERSION, which a change to derive_multipliers bumps.
    entry = cache_path(
        "minhash-multipliers", f"hashing-{HASHING_VERSION}-numpy-{np.__version__}-seed-{seed}-{num_perm}.u32"
    )
    data = derived_bytes(entry, lambda: derive_multipliers(seed, num_perm).astype("<u4").tobytes(), 4 * num_perm)
    return np.frombuffer(data, "<u4").astype(np.uint32)


def derive_multipliers(seed: int, num_perm: int) -> np.ndarray:
    """Odd 32-bit multipliers drawn from numpy's PCG64 seeded with `seed`."""
    rng = np.random.Generator(np.random.PCG64(seed))
    return rng.integers(0, 2**32, size=num_perm, dtype=np.uint32) | np.uint32(1)

"""The C kernels of smolctl/data/_minhash.c (as built, and built with SMOLCTL_PORTABLE_KERNELS: the code CPUs without
SSE2 or AVX2 run), and their numpy fallback (smolctl/data/minhash_fallback.py, for installs without a compiler), against plain-Python statements of what they compute, bit for bit, on the awkward cases: empty
and whitespace-only documents, punctuation-only tokens, upper-case ASCII, non-ASCII bytes, every separator the
tokeniser knows, tokens of thousands of bytes, arrays sliced at an offset, documents shorter than the n-gram, and
malformed buffers."""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import itertools
import random
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import SAMPLE

from smolctl.data import minhash_fallback
from smolctl.data.minhash import arrays, kernels, normalization, params

try:
    from smolctl.data import _minhash
except ImportError:  # built without a compiler: only the fallback can be tested
    _minhash = None

MASK = (1 << 64) - 1
RADIX = 0x100000001B3
SPACES = b"\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f "


@pytest.fixture(scope="session")
def portable_minhash(tmp_path_factory):
    """_minhash.c compiled with SMOLCTL_PORTABLE_KERNELS (no SSE2, no x86-64-v3 clone, no AVX2) by the compiler
    Python was built with: on an x86-64 machine the tests would otherwise never run the code other CPUs take."""
    source = Path(__file__).resolve().parent.parent / "smolctl" / "data" / "_minhash.c"
    built = tmp_path_factory.mktemp("portable") / "_minhash.so"
    command = shlex.split(sysconfig.get_config_var("LDSHARED") or "cc -shared") + [
        "-O2",
        "-std=c11",
        "-fPIC",
        "-DSMOLCTL_PORTABLE_KERNELS",
        "-DPy_LIMITED_API=0x030B0000",
        f"-I{sysconfig.get_paths()['include']}",
        str(source),
        "-o",
        str(built),
    ]
    try:
        subprocess.run(command, check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"no C compiler to build the portable kernels ({exc})")
    loader = importlib.machinery.ExtensionFileLoader("portable._minhash", str(built))
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(loader.name, built, loader=loader))
    loader.exec_module(module)
    return module


@pytest.fixture(params=["c", "portable", "numpy"])
def kernel_impl(request, monkeypatch):
    """The kernels every smolctl module calls, for the length of one test: the C extension as built, built portable,
    or the numpy fallback."""
    if request.param == "c" and _minhash is None:
        pytest.skip("the C extension is not built")
    chosen = {"c": _minhash, "numpy": minhash_fallback}.get(request.param) or request.getfixturevalue(
        "portable_minhash"
    )
    for module in list(sys.modules.values()):
        if module.__name__.startswith("smolctl.") and getattr(module, "_minhash", None) in (_minhash, minhash_fallback):
            monkeypatch.setattr(module, "_minhash", chosen)
    return chosen


def test_the_portable_build_has_none_of_the_fast_paths(portable_minhash):
    """Were SMOLCTL_PORTABLE_KERNELS ignored, the portable runs would test the fast code twice and the code other
    CPUs take never: the AVX2 signatures and the x86-64-v3 clone leave their names in the library's symbols."""
    built = Path(portable_minhash.__file__).read_bytes()
    assert b"avx2" not in built and b"x86_64_v3" not in built
    if _minhash is not None and sys.platform == "linux" and "x86_64" in sysconfig.get_platform():
        assert b"signature_rows_avx2" in Path(_minhash.__file__).read_bytes()  # the names the check looks for


def is_word_byte(b: int) -> bool:
    return b >= 128 or chr(b).isalnum() or b == ord("_")


@functools.cache  # a token of megabytes is often its own word
def span_hash(data: bytes) -> int:
    """8-byte little-endian chunks of the lower-cased bytes (the last zero-padded) times R^(8m + 1), summed,
    then finished with the length."""
    data = data.lower()
    total = (
        sum(int.from_bytes(data[k : k + 8], "little") * pow(RADIX, k + 1, 1 << 64) for k in range(0, len(data), 8))
        & MASK
    )
    mixed = ((total + len(data) * 0x9E3779B97F4A7C15) & MASK) * 0xBF58476D1CE4E5B9 & MASK
    return (mixed ^ (mixed >> 31)) | 1


def mix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


@functools.cache  # each text is checked against both kernels
def reference_tokens(text: str) -> tuple[list[int], list[int]]:
    """Token and word hashes of one document's normalised text (reference_byte_tokens of its UTF-8)."""
    return reference_byte_tokens(normalization.normalize(text).encode())


def reference_byte_tokens(raw: bytes) -> tuple[list[int], list[int]]:
    """Token and word hashes of a document's bytes: tokens split on ASCII whitespace, words trimmed of the bytes
    that are neither ASCII whitespace nor word bytes (ASCII punctuation and control characters)."""
    for space in SPACES:
        raw = raw.replace(bytes([space]), b" ")
    tokens, words = [], []
    for token in (t for t in raw.split(b" ") if t):
        tokens.append(span_hash(token))
        first = next((i for i, b in enumerate(token) if is_word_byte(b)), None)
        if first is not None:
            last = next(i for i in reversed(range(len(token))) if is_word_byte(token[i]))
            words.append(span_hash(token[first : last + 1]))
    return tokens, words


AWKWARD = [
    "",
    "   ",
    "\t\n",
    "a",
    "...",
    "Hello, World!",
    "(x) [y] {z}",
    "UPPER lower MiXeD",
    "-- --- ---- x--y --z",
    "tab\tnew\nline\x0bvt\x0cff\rcr\x1cfs\x1dgs\x1ers\x1fus end",
    "ünïcode wörds — dash «quoted»",
    "机器学习 是 人工智能",
    "emoji 🙂🙂 ok",
    "STRASSE Straße ＡＢＣ ﬁne ÉCOLE\u2028next",
    "ctrl\x01char\x7fdel",
    "_under_score_",
    "'quote' \"double\"",
    "a" * 5000,
    "," + "b" * 4100 + ",",
    " lead",
    "trail ",
    "x y z w v u t",
]


def test_tokenize_matches_the_python_definition(kernel_impl):
    sample = pq.read_table(sorted((SAMPLE / "web").glob("part-*.parquet"))[0], columns=["text"]).column(0).to_pylist()
    texts = AWKWARD + sample[:40]
    for array in (pa.array(texts, pa.string()), pa.array(texts, pa.large_string()), pa.array(["pad"] + texts).slice(1)):
        check_against_reference(kernels.tokenize(array), texts)


def reference_exact(token_hashes: list[int]) -> list[int]:
    out = []
    for radix in (0x9E3779B97F4A7C15, 0xD6E8FEB86659FD93):
        total = sum(h * pow(radix, k, 1 << 64) for k, h in enumerate(token_hashes)) & MASK
        out.append(mix64(total ^ (len(token_hashes) * radix & MASK)))
    return out


def check_against_reference(tokens: kernels.Tokens, texts: list[str]) -> None:
    for i, text in enumerate(texts):
        want_tokens, want_words = reference_tokens(text)
        assert tokens.exact[i].tolist() == reference_exact(want_tokens), repr(text[:40])
        assert tokens.words[tokens.word_offsets[i] : tokens.word_offsets[i + 1]].tolist() == want_words, repr(text[:40])


def test_tokenize_matches_the_python_definition_on_random_byte_soup(kernel_impl):
    """Random documents over an alphabet of every byte class, with runs long enough to cross the kernel's
    8-byte chunks at every alignment (tokens of 7, 8, 9, 16 bytes, space runs of 8 and more)."""
    rng = random.Random(5)
    alphabet = ["a", "B", "z", "_", "9", " ", " ", "\t", "\n", "\x1c", ",", "-", "(", "é", "机", "\x01"]
    texts = [
        "".join(rng.choice(alphabet) * rng.choice([1, 1, 1, 2, 7, 8, 9, 16]) for _ in range(rng.randrange(0, 30)))
        for _ in range(400)
    ]
    check_against_reference(kernels.tokenize(pa.array(texts)), texts)


def test_tokenize_treats_null_documents_as_empty(kernel_impl):
    tokens = kernels.tokenize(pa.array(["a b", None, "c", ""]))
    assert np.diff(tokens.word_offsets).tolist() == [2, 0, 1, 0]
    assert np.array_equal(tokens.exact[1], tokens.exact[3])


def test_shingles_match_the_python_definition(kernel_impl):
    rng = random.Random(3)
    counts = [0, 1, 2, 4, 5, 6, 30, 0, 3]
    tokens = np.array([rng.getrandbits(64) for _ in range(sum(counts))], np.uint64)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    for n in (1, 3, 5):
        weights = [int(w) for w in kernels.NGRAM_WEIGHTS[:n]]
        hashes, shingle_offsets = kernels.ngrams(tokens, offsets, n)
        for i in range(len(counts)):
            doc = [int(t) for t in tokens[offsets[i] : offsets[i + 1]]]
            starts = range(len(doc) - n + 1) if len(doc) >= n else ([0] if doc else [])
            want = [mix64(sum(doc[j + k] * weights[k] for k in range(min(n, len(doc)))) & MASK) for j in starts]
            assert hashes[shingle_offsets[i] : shingle_offsets[i + 1]].tolist() == want


def test_signatures_read_only_the_shingles_their_offsets_cover(kernel_impl):
    """Offsets that start past the first hash and end before the last: the hashes outside (keys 1 and 2, whose
    products are small for most permutations) must not reach any row, and each row is that of its own hashes."""
    rng = np.random.default_rng(5)
    inside = rng.integers(2**40, 2**64, 60, dtype=np.uint64)
    smallest = np.array([1, 2], np.uint64) << np.uint64(32)
    shingles = np.concatenate([smallest[:1], inside, smallest[1:]])
    offsets = np.array([1, 21, 21, 61], np.int64)
    multipliers = params.MinHashParams().permutations()
    sigs = kernels.signatures(shingles, offsets, multipliers)
    assert np.array_equal(sigs[0], kernels.signatures(inside[:20], np.array([0, 20]), multipliers)[0])
    assert (sigs[1] == 0xFFFFFFFF).all()
    assert np.array_equal(sigs[2], kernels.signatures(inside[20:], np.array([0, 40]), multipliers)[0])


def test_signatures_are_the_minimum_over_shingles_of_each_permutation(kernel_impl):
    rng = np.random.default_rng(4)
    counts = [3, 0, 1, 50, 7]
    shingles = rng.integers(0, 2**63, sum(counts), dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    multipliers = params.MinHashParams().permutations()
    sigs = kernels.signatures(shingles, offsets, multipliers)
    keys = (shingles >> np.uint64(32)).astype(np.uint32)
    for i, count in enumerate(counts):
        want = (
            np.full(len(multipliers), 0xFFFFFFFF, np.uint32)
            if count == 0
            else (multipliers[:, None] * keys[None, offsets[i] : offsets[i + 1]]).min(axis=1)
        )
        assert np.array_equal(sigs[i], want)


@pytest.mark.parametrize("perms", [1, 3, 8, 13, 24, 56, 64, 100, 128, 203])
def test_signatures_of_any_number_of_permutations(kernel_impl, perms):
    """Every split of a row into the kernel's blocks (64, 32, 16 and 8 permutations at once, the rest one at a
    time) gives the minima of the definition."""
    rng = np.random.default_rng(perms)
    counts = [5, 0, 1, 40]
    shingles = rng.integers(0, 2**64, sum(counts), dtype=np.uint64)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    multipliers = rng.integers(0, 2**32, perms, dtype=np.uint32) | np.uint32(1)
    keys = (shingles >> np.uint64(32)).astype(np.uint32)
    want = np.full((len(counts), perms), 0xFFFFFFFF, np.uint32)
    for i in range(len(counts)):
        if counts[i]:
            want[i] = (multipliers[:, None] * keys[None, offsets[i] : offsets[i + 1]]).min(axis=1)
    assert np.array_equal(kernels.signatures(shingles, offsets, multipliers), want)


def test_keys_behind_a_signature_are_the_documents_keys_for_a_few_and_never_more(kernel_impl):
    """A document of k different keys (a repeat among them) has exactly k behind its signature while k is small
    (each key wins some permutation), and never more than k: the count verification trusts to find short
    documents, whose signature values are num_perm different numbers even for a single key."""
    rng = np.random.default_rng(5)
    counts = [1, 2, 3, 6, 12, 400]
    distinct = [rng.choice(2**32, c, replace=False).astype(np.uint64) << np.uint64(32) for c in counts]
    shingles = np.concatenate([np.concatenate([d, d[:1]]) for d in distinct])  # a repeated key counts once
    offsets = np.concatenate([[0], np.cumsum([c + 1 for c in counts])]).astype(np.int64)
    multipliers = params.MinHashParams().permutations()
    sigs = kernels.signatures(shingles, offsets, multipliers)
    behind = kernels.keys_behind(sigs, multipliers)
    assert behind[:5].tolist() == counts[:5]
    assert len(np.unique(sigs[0])) == len(multipliers)  # the values alone would not tell
    assert 12 < behind[5] <= len(multipliers)


def test_estimates_count_equal_signature_values(kernel_impl):
    sigs = np.random.default_rng(7).integers(0, 4, (6, 100)).astype(np.uint32)
    left, right = np.array([0, 1, 5, 3]), np.array([2, 1, 0, 4])
    want = [(sigs[a] == sigs[b]).mean() for a, b in zip(left, right)]
    assert kernels.estimate_jaccard(sigs, left, right).tolist() == want
    with pytest.raises(ValueError, match="do not fit"):
        kernels.estimate_jaccard(sigs, np.array([6]), np.array([0]))


def test_intersections_count_common_members(kernel_impl):
    sets = [np.array(s, np.uint64) for s in ([1, 3, 5, 7], [], [3, 4, 5], [2**63 + 1, 2**64 - 1], [2**64 - 1], [7])]
    values, bounds = np.concatenate(sets), np.concatenate([[0], np.cumsum([len(s) for s in sets])]).astype(np.int64)
    left, right = np.array([0, 0, 1, 3, 5, 1]), np.array([2, 1, 1, 4, 0, 3])
    want = [len(set(sets[a].tolist()) & set(sets[b].tolist())) for a, b in zip(left, right)]
    sizes = np.diff(bounds)
    union = sizes[left] + sizes[right] - np.array(want)
    assert kernels.jaccard_many(values, bounds, left, right).tolist() == [
        w / u if u else 1.0 for w, u in zip(want, union)
    ]
    common = np.empty(len(left), np.int64)
    kernel_impl.intersections(values, bounds, left, right, common)
    assert common.tolist() == want


def test_intersections_of_random_sets_of_every_size(kernel_impl):
    rng = np.random.default_rng(8)
    sets = [np.unique(rng.integers(0, 3 * size + 1, size, dtype=np.uint64)) for size in rng.integers(0, 300, 60)]
    values, bounds = np.concatenate(sets), np.concatenate([[0], np.cumsum([len(s) for s in sets])]).astype(np.int64)
    left, right = rng.integers(0, len(sets), 500), rng.integers(0, len(sets), 500)
    common = np.empty(len(left), np.int64)
    kernel_impl.intersections(values, bounds, left, right, common)
    assert common.tolist() == [len(set(sets[a].tolist()) & set(sets[b].tolist())) for a, b in zip(left, right)]


def quicksort_killer(n: int) -> tuple[list[int], bool]:
    """n values that drive _minhash.c's intro_sort (median-of-three pivots, Hoare partitions, insertion sort
    under 17) into its heapsort, found by McIlroy's adversary: the sort below, step for step the C one, runs on
    values that are fixed only as it compares them, each time so as to make the worst pivot. Returns the values
    and whether the sort ran out of depth (the heapsort was reached)."""
    gas, val = n, [n] * n
    state = {"solid": 0, "candidate": -1, "heapsort": False}

    def less(x: int, y: int) -> bool:
        if val[x] == gas and val[y] == gas:
            frozen = x if x == state["candidate"] else y
            val[frozen], state["solid"] = state["solid"], state["solid"] + 1
        if val[x] == gas:
            state["candidate"] = x
        elif val[y] == gas:
            state["candidate"] = y
        return val[x] < val[y]

    def intro_sort(a: list[int], lo: int, n: int, depth: int) -> None:
        while n > 16:
            if depth == 0:
                state["heapsort"] = True
                return
            depth -= 1
            x, y, z = a[lo], a[lo + n // 2], a[lo + n - 1]
            if less(x, y):
                pivot = y if less(y, z) else (z if less(x, z) else x)
            else:
                pivot = x if less(x, z) else (z if less(y, z) else y)
            i, j = lo - 1, lo + n
            while True:
                i += 1
                while less(a[i], pivot):
                    i += 1
                j -= 1
                while less(pivot, a[j]):
                    j -= 1
                if i >= j:
                    break
                a[i], a[j] = a[j], a[i]
            left = j + 1 - lo
            if left < n - left:
                intro_sort(a, lo, left, depth)
                lo, n = lo + left, n - left
            else:
                intro_sort(a, lo + left, n - left, depth)
                n = left
        for i in range(lo + 1, lo + n):  # insertion sort: the comparisons only matter before the depth runs out
            x, k = a[i], i
            while k > lo and less(x, a[k - 1]):
                a[k] = a[k - 1]
                k -= 1
            a[k] = x

    intro_sort(list(range(n)), 0, n, 2 * (n.bit_length() - 1))
    return [v if v != gas else gas + i for i, v in enumerate(val)], state["heapsort"]


def test_sorted_sets_are_each_documents_sorted_unique_values(kernel_impl):
    """Sizes around the insertion-sort cut-off and far past it, runs of one value, two values alternating (a
    quicksort's worst cases), values that differ only in their top or bottom bit, empty documents, and values
    that send the quicksort into its heapsort."""
    killer, reaches_heapsort = quicksort_killer(3000)
    assert reaches_heapsort
    rng = np.random.default_rng(9)
    top = 2**63
    documents = [
        [],
        [5],
        [top + 1, 1, top, top + 1, 0],
        [2**64 - 1, 0, 2**64 - 1],
        [7] * 1000,
        [3, 9] * 600,
        list(range(2000, 0, -1)),
        [],
        killer,
        *[rng.integers(0, 2**64, size, dtype=np.uint64, endpoint=False).tolist() for size in (15, 16, 17, 33, 300)],
        *[rng.integers(0, size // 3 + 1, size).tolist() for size in (17, 64, 5000)],
    ]
    values = np.array([v for d in documents for v in d], np.uint64)
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in documents])]).astype(np.int64)
    sets, bounds = kernels.sorted_sets(values, offsets)
    assert [sets[bounds[i] : bounds[i + 1]].tolist() for i in range(len(documents))] == [
        sorted(set(d)) for d in documents
    ]
    assert sets.dtype == np.uint64 and bounds[-1] == len(sets)
    with pytest.raises(ValueError, match="do not fit"):
        kernel_impl.sorted_sets(values, offsets, np.empty(len(values) - 1, np.uint64), np.empty(len(offsets), np.int64))
    with pytest.raises(ValueError, match="do not fit"):
        kernel_impl.sorted_sets(
            values, offsets[::-1].copy(), np.empty(len(values), np.uint64), np.empty(len(offsets), np.int64)
        )
    for lone in ([5], [-3]):  # no documents: the one offset must still lie inside the (empty) values
        with pytest.raises(ValueError, match="do not fit"):
            kernel_impl.sorted_sets(
                np.zeros(0, np.uint64), np.array(lone, np.int64), np.zeros(0, np.uint64), np.zeros(1, np.int64)
            )


@pytest.mark.parametrize("size", [0, 1, 2, 17, 40_000])
def test_shared_positions_are_the_positions_of_values_seen_more_than_once(kernel_impl, size):
    """Uniform hashes with planted repeats (a value three times, pairs that differ only in the lowest bit, so
    neighbours within one bucket), plus a skewed tail: one top-bits bucket holding thousands of values, two
    of them alternating (runs the merge must interleave), and the extremes 0 and 2^64 - 1. Each value's
    positions come together and in order, the values ascending."""
    rng = np.random.default_rng(size)
    values = rng.integers(0, 2**64, size, dtype=np.uint64, endpoint=False)
    if size >= 17:
        values[5] = values[9] = values[16] = values[0]
        values[2] = values[1] ^ np.uint64(1)
        skewed = np.array([3, 2**40 + 7] * 3000 + list(range(100, 3100)) + [0, 0, 2**64 - 1, 2**64 - 1], np.uint64)
        values = np.concatenate([values, skewed])
    positions = {}
    for position, value in enumerate(values.tolist()):
        positions.setdefault(value, []).append(position)
    expected = [p for v in sorted(positions) if len(positions[v]) > 1 for p in positions[v]]
    assert kernels.shared_positions(values).tolist() == expected
    if size:
        with pytest.raises(ValueError, match="shorter than 2 x values"):
            kernel_impl.shared_positions(
                values, np.empty(2 * len(values) - 1, np.uint64), np.empty(len(values), np.int64)
            )
        with pytest.raises(ValueError, match="out than values"):
            kernel_impl.shared_positions(
                values, np.empty(2 * len(values), np.uint64), np.empty(len(values) - 1, np.int64)
            )


def test_kernels_refuse_buffers_that_do_not_fit(kernel_impl):
    exact, room, counts = np.empty((2, 2), np.uint64), np.empty(8, np.uint64), np.empty(2, np.int64)
    for starts, ends in (
        ([0, 5], [5, 3]),
        ([0, 3], [4, 9]),
        ([-1, 0], [2, 2]),
    ):  # backwards, across both buffers, negative
        with pytest.raises(ValueError, match="inside data, or inside extra"):
            kernel_impl.tokenize(
                b"hello", b"abcd", np.array(starts, np.int64), np.array(ends, np.int64), exact, room, counts
            )
    with pytest.raises(ValueError, match="too small"):
        kernel_impl.tokenize(
            b"a b c d",
            b"",
            np.array([0], np.int64),
            np.array([7], np.int64),
            np.empty((1, 2), np.uint64),
            np.empty(2, np.uint64),
            np.empty(1, np.int64),
        )
    for offsets, rows in (([0, 4], 1), ([2, 1], 1), ([-1, 1], 1), ([0, 1, 2], 1), ([], 0)):  # past, reversed, short
        with pytest.raises(ValueError, match="do not fit"):
            kernel_impl.signatures(
                np.zeros(3, np.uint64),
                np.array(offsets, np.int64),
                np.ones(4, np.uint32),
                np.empty(4 * rows, np.uint32),
            )
    with pytest.raises(ValueError, match="do not fit"):
        kernel_impl.intersections(
            np.zeros(2, np.uint64), np.array([0, 2], np.int64), np.array([0]), np.array([1]), np.empty(1, np.int64)
        )


def changes(text: str) -> bool:
    """Whether normalization_tables().changing (or its beyond-the-table rule) catches a character of text."""
    bits = np.unpackbits(normalization.normalization_tables().changing, bitorder="little")
    return any(ord(c) >= len(bits) or bits[ord(c)] for c in text)


def test_characters_outside_the_changing_class_are_left_alone_by_normalisation():
    """The tokeniser hashes a non-ASCII document in place unless it holds a character of normalization_tables().changing:
    every other character of planes 0-1 must come out of normalize() unchanged, alone, doubled, and after an
    ASCII letter it could compose with, and the class must catch what does change."""
    bits = np.unpackbits(normalization.normalization_tables().changing, bitorder="little")
    assert len(bits) == normalization.TABLE_CODE_POINTS == 0x20000
    kept = [chr(c) for c in range(0x80, len(bits)) if not 0xD800 <= c < 0xE000 and not bits[c]]
    assert len(kept) > 100_000
    for c in kept:
        assert normalization.normalize(f"Ae{c}{c}x") == f"ae{c}{c}x", hex(ord(c))
    # ... and what does change: case, compatibility forms, composing and reordering marks, spaces, jamo.
    assert normalization.normalize("a\u0360\u0316") != "a\u0360\u0316"  # marks of different classes are reordered
    for c in ("É", "ß", "\u00a0", "…", "ﬁ", "\u0301", "\u0360\u0316", "\u2028", "Ａ", "\u1161", "\U00020000"):
        assert changes(f"a{c}b"), hex(ord(c[0]))
    for c in ("’", "“", "—", "é", "ñ", "机", "я", "a\tb"):
        assert not changes(c), c


def changing_by_definition(raw: bytes) -> bool:
    """changing_documents' definition, one sequence at a time: a lead byte says how many bytes to decode
    strictly (no overlong forms, surrogates or code points past U+10FFFF); a byte that does not start a
    well-formed sequence is skipped alone."""
    i = 0
    while i < len(raw):
        lead = raw[i]
        length = 1 if lead < 0x80 else 2 if 0xC2 <= lead < 0xE0 else 3 if 0xE0 <= lead < 0xF0 else 4
        if 0x80 <= lead < 0xC2 or lead >= 0xF5:
            i += 1
            continue
        try:
            character = raw[i : i + length].decode("utf-8")
        except UnicodeDecodeError:
            i += 1
            continue
        if changes(character):
            return True
        i += length
    return False


def test_changing_documents_match_the_definition_on_text_and_malformed_bytes(kernel_impl):
    rng = random.Random(7)
    pieces = [b"plain ascii ", b"x" * 9, "é".encode(), "É".encode(), "’".encode(), "ﬁ".encode(), "\u0301".encode()]
    pieces += ["机".encode(), "\U0001f642".encode(), "\U00020000".encode(), "\u2028".encode(), "я".encode()]
    # Malformed: lone continuation, truncated sequences, overlong, surrogate, past U+10FFFF, 0xC0/0xF5 leads.
    pieces += [
        b"\x80",
        b"\xc3",
        b"\xe2\x80",
        b"\xc0\xaf",
        b"\xe0\x80\x80",
        b"\xed\xa0\x80",
        b"\xf4\x90\x80\x80",
        b"\xf5",
    ]
    # Overlong forms of changing characters (É in three bytes, U+0301 in four): malformed, so not changing.
    pieces += [b"\xe0\x83\x89", b"\xf0\x80\x8c\x81"]
    # A malformed lead followed by a changing character's bytes: both skipping rules must agree on where it starts.
    pieces += [b"\xe2" + "É".encode(), b"\xf0\x9f" + "ﬁ".encode()]
    docs = [b"".join(rng.choice(pieces) for _ in range(rng.randrange(0, 12))) for _ in range(600)]
    data = b"".join(docs)
    ends = np.cumsum([len(d) for d in docs]).astype(np.int64)
    starts = ends - np.array([len(d) for d in docs], dtype=np.int64)
    out = np.full(len(docs), 7, np.uint8)
    kernel_impl.changing_documents(data, starts, ends, normalization.normalization_tables().changing, out)
    expected = [changing_by_definition(d) for d in docs]
    assert 100 < sum(expected) < 500
    assert out.tolist() == [int(e) for e in expected]
    with pytest.raises(ValueError, match="inside data"):
        kernel_impl.changing_documents(data, starts, ends + 1, normalization.normalization_tables().changing, out)
    # ASCII never counts, whatever the table says of it; a table must cover ASCII; past its end everything counts.
    everything = np.full(16, 0xFF, np.uint8)
    kernel_impl.changing_documents(b"plain" + "é".encode(), np.array([0, 0]), np.array([5, 7]), everything, out[:2])
    assert out[:2].tolist() == [0, 1]
    with pytest.raises(ValueError, match="128 ASCII"):
        kernel_impl.changing_documents(b"a", np.array([0]), np.array([1]), np.zeros(15, np.uint8), out[:1])


def folds() -> dict[str, bytes]:
    """Every character with a fold in C, and the fold's bytes as the table packs them."""
    table = normalization.normalization_tables().folds
    return {chr(c): int(table[c]).to_bytes(8, "little")[: int(table[c]) >> 56] for c in np.flatnonzero(table).tolist()}


def test_folds_are_what_normalisation_makes_of_those_characters_anywhere():
    """Every character with a fold in C comes out of normalize() as its fold wherever it stands: alone, after an
    ASCII letter it could compose with, doubled, beside every other foldable character, beside characters that
    normalisation leaves alone, and in random pairs and triples of all of these. Marks folded as themselves
    keep that only while the classes of consecutive marks never go down (the kernel refuses the rest)."""
    tables = normalization.normalization_tables()
    table = folds()
    assert len(table) > 5000
    wanted = {"Я", "Σ", "É", "ß", "Ա", "\U00010400", "\u00a0", "\u202f", "，", "（", "\u3000", "Ａ", "ﬁ", "…"}
    assert wanted | {"\u094d", "\u064e", "\u0651", "\u0e48", "\u05b4"} <= set(table)
    for c, folded in table.items():
        assert normalization.normalize(c).encode() == folded, hex(ord(c))
        assert normalization.normalize(f"Ae{c}{c}x") == f"ae{folded.decode() * 2}x", hex(ord(c))
        assert normalization.normalize(f"\u00c9{c}\u01c4{c}") == f"\u00e9{folded.decode()}d\u017e{folded.decode()}"
    marks = sorted((c for c in table if tables.classes[ord(c)]), key=lambda c: tables.classes[ord(c)])
    letters = [c for c in table if not tables.classes[ord(c)]]
    assert len(marks) > 500
    assert normalization.normalize("".join(letters)) == b"".join(table[c] for c in letters).decode()
    assert normalization.normalize("a" + "".join(marks)) == "a" + "".join(marks)  # classes in order: unmoved
    kept = "’机я—éaZ"
    mixed = "".join(c + kept[i % len(kept)] for i, c in enumerate(table))
    want = "".join(table[c].decode() + kept[i % len(kept)].lower() for i, c in enumerate(table))
    assert normalization.normalize(mixed) == want

    def class_of(c: str) -> int:
        return int(tables.classes[ord(c)]) if ord(c) < len(tables.classes) else 0

    rng = random.Random(12)
    pool = list(table) + list(kept) + ["가", "\u1100", "ก", "\u0915", "\u00ea", "\u1ec7", "\u01c5", "\u0928"]
    checked = 0
    for _ in range(100_000):
        text = "".join(rng.choice(pool) for _ in range(rng.choice([2, 3])))
        if any(0 < class_of(b) < class_of(a) for a, b in itertools.pairwise(text)):
            continue  # refused by the kernel: NFKC would reorder these marks
        assert normalization.normalize(text) == "".join(normalization.normalize(c) for c in text), text.encode()
        checked += 1
    assert checked > 90_000
    # Left to Python: marks that compose (the acute accent, the nukta after na), what NFKC turns into a mark
    # (the half-width voiced sound mark), Hangul vowel and final jamo, and the second character of a composition.
    for c in ("\u0301", "\u093c", "\uff9e", "\u1161", "\u11a8", "\u0dcf"):
        assert c not in table, hex(ord(c))
    assert normalization.normalize("\u0645\u0651\u064e") != "\u0645\u0651\u064e"  # shadda, then fatha: reordered


def test_normalisation_tables_are_derived_once_then_read_from_the_cache(tmp_path, monkeypatch):
    """The first process derives the tables and keeps them in smolctl's cache; later ones read the same arrays
    back instead of deriving them. A short or damaged entry is derived again and replaced; a cache that cannot
    be written costs only the time. The entry's name changes with this Python's Unicode version and with the
    module's source, which define the tables."""
    derived = normalization.derive_normalization_tables()
    monkeypatch.setenv("SMOLCTL_CACHE", str(tmp_path / "cache"))

    def fresh_tables() -> normalization.NormalizationTables:
        normalization.normalization_tables.cache_clear()
        return normalization.normalization_tables()

    def same(tables: normalization.NormalizationTables) -> bool:
        return all(
            np.array_equal(getattr(tables, name), getattr(derived, name)) and not getattr(tables, name).flags.writeable
            for name in ("changing", "folds", "classes")
        )

    try:
        assert same(fresh_tables())
        (entry,) = (tmp_path / "cache" / "unicode-tables").iterdir()
        with monkeypatch.context() as patched:
            patched.setattr(normalization, "derive_normalization_tables", lambda: pytest.fail("derived again"))
            assert same(fresh_tables())
        good = entry.read_bytes()
        for damaged in (good[:-1], good[:1000] + bytes([good[1000] ^ 1]) + good[1001:]):
            entry.write_bytes(damaged)
            assert same(fresh_tables()) and entry.read_bytes() == good
        monkeypatch.setenv("SMOLCTL_CACHE", str(entry))  # a file where the cache folder should be
        assert same(fresh_tables())

        monkeypatch.setenv("SMOLCTL_CACHE", str(tmp_path / "cache"))
        with monkeypatch.context() as patched:
            patched.setattr(normalization.unicodedata, "unidata_version", "0.0.0")
            assert normalization._tables_entry() != entry
        source = tmp_path / "normalization.py"
        source.write_bytes(normalization.Path(normalization.__file__).read_bytes() + b"# changed\n")
        with monkeypatch.context() as patched:
            patched.setattr(normalization, "__file__", str(source))
            assert normalization._tables_entry() not in (entry, None)
    finally:
        normalization.normalization_tables.cache_clear()


def test_fold_documents_match_the_definition(kernel_impl):
    """Documents of foldable characters, characters left alone, marks in canonical order, characters only Python
    normalises and malformed bytes (between characters: they must be copied, not decoded across): each document
    folded in C is normalize()'s bytes (ASCII aside, lowered as the tokeniser reads), and a document is refused
    exactly when it holds a changing character without a fold, or marks whose classes go down."""
    rng = random.Random(11)
    pieces = ["ASCII words ", "Я", "ЖЁЛТЫЙ", "Σ", "Ωμέγα", "ÉCOLE", "Straße", "ԱՐԵՎ", "\U00010400", "я", "机", "’"]
    pieces += ["é", "«\u00a0oui\u00a0»", "中文，（测试）：", "ﬁn", "…", "½", "\u3000", "ＡＢＣ", "\u2028", "™"]
    pieces += ["क्षत्रिय", "ที่นี่", "مَّدْرَسَة", "שָׁלוֹם", "Ꭰ"]
    pieces += ["\u0645\u0651 \u064e", "\u0645\u0651ASCII_8+\u064e"]  # after ASCII, a lower class starts afresh
    needs_python = ["\u0301", "\uff9e", "\u1161", "\U00020000", "न\u093c", "\u0645\u0651\u064e"]
    malformed = [b"\x80", b"\xc3", b"\xe2\x80", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf5"]
    docs, wanted = [], []
    for k in range(500):
        chosen = [rng.choice(pieces) for _ in range(rng.randrange(0, 10))]
        if k % 5 == 0:
            chosen.insert(rng.randrange(len(chosen) + 1), rng.choice(needs_python))
        raw = [c.encode() for c in chosen]
        folded = ["".join(normalization.normalize(x) if ord(x) >= 0x80 else x for x in c).encode() for c in chosen]
        if k % 7 == 0:
            at, bad = rng.randrange(len(raw) + 1), rng.choice(malformed)
            raw.insert(at, bad)
            folded.insert(at, bad)
        docs.append(b"".join(raw))
        wanted.append(None if k % 5 == 0 else b"".join(folded))
    data = b"".join(docs)
    ends = np.cumsum([len(d) for d in docs]).astype(np.int64)
    starts = ends - np.array([len(d) for d in docs], dtype=np.int64)
    tables = normalization.normalization_tables()
    out, out_ends = np.zeros(4 * len(data), np.uint8), np.full(len(docs), 7, np.int64)
    kernel_impl.fold_documents(data, starts, ends, tables.changing, tables.folds, tables.classes, out, out_ends)
    assert (out_ends < 0).tolist() == [w is None for w in wanted]
    position = 0
    for i, (raw, want) in enumerate(zip(docs, wanted)):
        if want is None:
            continue
        got = out[position : out_ends[i]].tobytes()
        position = out_ends[i]
        assert got == want, raw
        if i % 7:  # well-formed: what normalize() makes of the document, ASCII letters aside
            assert got.lower() == normalization.normalize(raw.decode()).encode(), raw
    # Room for part of them: the documents that fit are folded as before, the first that does not is refused,
    # and a later one that fits in what is left still goes in.
    cut = int(out_ends[np.flatnonzero(out_ends >= 0)[len(docs) // 8]])
    short, short_ends = np.zeros(cut + 3, np.uint8), np.zeros(len(docs), np.int64)
    kernel_impl.fold_documents(data, starts, ends, tables.changing, tables.folds, tables.classes, short, short_ends)
    fits = short_ends >= 0
    assert (short_ends[: len(docs) // 8 + 1] == out_ends[: len(docs) // 8 + 1]).all()
    assert 0 < fits.sum() < (out_ends >= 0).sum() and short_ends.max() <= len(short)
    kept = np.flatnonzero(fits)
    pieces = np.split(short[: short_ends[kept[-1]]], short_ends[kept][:-1])
    assert [p.tobytes() for p in pieces] == [wanted[i] for i in kept]
    with pytest.raises(ValueError, match="one entry per code point"):
        kernel_impl.fold_documents(
            data, starts, ends, tables.changing, tables.folds[:-1], tables.classes, out, out_ends
        )
    # A fold longer than the format's 7 bytes is no fold: never written past the 4x room out was given.
    long_folds = tables.folds.copy()
    long_folds[ord("É")] = np.uint64(20 << 56 | 0x41414141414141)
    room, room_ends = np.zeros(16, np.uint8), np.zeros(2, np.int64)
    data = "É".encode() + b"ax"
    kernel_impl.fold_documents(
        data, np.array([0, 2]), np.array([2, 4]), tables.changing, long_folds, tables.classes, room, room_ends
    )
    assert room_ends.tolist() == [-1, 2] and room[:2].tobytes() == b"ax" and not room[2:].any()


def test_tokenize_folds_capitals_as_python_does(kernel_impl):
    """Text that is mostly capitals of other scripts (folded in C) beside text that Python must normalise."""
    texts = [
        "МОСКВА Москва москва",
        "ΑΘΗΝΑ Αθήνα, ΣΟΦΙΑ",
        "ÉCOLE Élève — «\u00a0oui\u00a0»",
        "Straße STRASSE ẞ",
        "ԱՐԵՎ and ᏣᎳᎩ 𐐀𐐁",
        "İstanbul ǅemal ½ ﬁne ＡＢＣ™",
        "机器学习，是人工智能（AI）的一个分支：\u3000测试。",
        "e\u0301cole \uff76\uff9e 한\u1161",
        "",
        "ЖЁЛТЫЙ\tжёлтый\nЖЁЛТЫЙ",
    ]
    check_against_reference(kernels.tokenize(pa.array(texts)), texts)
    tokens = kernels.tokenize(pa.array(["МОСКВА ÉCOLE", "москва école"]))
    assert np.array_equal(tokens.exact[0], tokens.exact[1])


def test_sorted_unique_is_np_unique():
    rng = np.random.default_rng(6)
    for values in (
        rng.integers(0, 50, 1000).astype(np.uint64),
        rng.integers(-5, 5, 37),
        np.zeros(0, np.int64),
        np.array([7]),
    ):
        want, want_inverse = np.unique(values, return_inverse=True)
        assert np.array_equal(arrays.sorted_unique(values), want)
        got, inverse = arrays.sorted_unique(values, return_inverse=True)
        assert np.array_equal(got, want) and np.array_equal(inverse, want_inverse)


def test_a_token_of_megabytes_is_hashed_in_one_linear_pass(kernel_impl):
    """Minified code and base64 blobs hold tokens of megabytes: the chunk multipliers are a running product,
    so such a token costs a pass, not a quadratic recomputation of powers."""
    texts = ["Q" * 2_000_001 + " tail", "(" + "z" * 300_000 + ")"]
    check_against_reference(kernels.tokenize(pa.array(texts)), texts)


def random_bytes_document(rng: random.Random) -> bytes:
    """Tokens of every kind (word bytes, upper-case, non-ASCII bytes, punctuation at either end or inside, only
    punctuation; 1 to 16 bytes, and around 32, 64 and 128) between runs of every separator, so that tokens begin
    and end at every position of the kernel's 64-bit bitmap words and cross them, and its 1 KB windows."""
    word = b"aZq_09" + bytes(range(0x80, 0x100, 7))
    punctuation = b",.()-'\x01\x7f"
    parts = []
    for _ in range(rng.randrange(0, 120)):
        if rng.random() < 0.45:
            parts.append(bytes(rng.choice(SPACES) for _ in range(rng.choice([1, 1, 1, 2, 7, 8, 9, 63, 64, 65]))))
            continue
        length = rng.choice([*range(1, 17), 8, 16, 31, 32, 33, 63, 64, 65, 127, 128, 129, 700])
        token = bytearray(rng.choice(word) for _ in range(length))
        style = rng.random()
        if style < 0.15:
            token = bytearray(rng.choice(punctuation) for _ in range(length))
        elif style < 0.5:
            for _ in range(rng.randrange(1, 3)):
                token[rng.choice([0, -1, rng.randrange(length)])] = rng.choice(punctuation)
        parts.append(bytes(token))
    return b"".join(parts)


def test_tokenize_raw_bytes_matches_the_python_definition(kernel_impl):
    """The kernel on raw bytes against the definition: random documents (random_bytes_document) and the edges of
    the C kernel's layout: tokens of exactly 8, 16 and 64 bytes, a token filling a document to its end, empty
    documents, documents in `extra`, the last documents ending exactly where data and extra end. Word bytes lie
    between documents, so that a kernel reading past a document's end changes its hashes."""
    rng = random.Random(23)
    edges = [b"", b"a" * 8, b"B" * 16, b"," * 16, b" " * 63 + b"tok", b"w" * 64, b"(" + b"q" * 62 + b")", b"\xff\x80"]
    edges += [b"x" * 1023 + b" y", b" " * 1024, b"z" * 2000, b"a, b. (c) " * 200]
    documents = edges + [random_bytes_document(rng) for _ in range(300)]
    in_extra = [i % 4 == 3 for i in range(len(documents))]
    buffers, starts, ends = [bytearray(), bytearray()], [], []
    for document, extra in zip(documents, in_extra):
        buffer = buffers[extra]
        buffer += b"glue"[: rng.randrange(0, 5)]
        starts.append(len(buffer))
        buffer += document
        ends.append(len(buffer))
    data, extra_bytes = bytes(buffers[0]), bytes(buffers[1])
    starts = np.array([s + len(data) * e for s, e in zip(starts, in_extra)], np.int64)
    ends = np.array([e_ + len(data) * e for e_, e in zip(ends, in_extra)], np.int64)
    assert ends[in_extra].max() == len(data) + len(extra_bytes) and ends[~np.array(in_extra)].max() == len(data)
    exact, counts = np.empty((len(documents), 2), np.uint64), np.empty(len(documents), np.int64)
    word_hashes = np.empty((len(data) + len(extra_bytes) + len(documents)) // 2 + 1, np.uint64)
    words = kernel_impl.tokenize(data, extra_bytes, starts, ends, exact, word_hashes, counts)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    assert words == offsets[-1]
    for i, document in enumerate(documents):
        want_tokens, want_words = reference_byte_tokens(document)
        assert exact[i].tolist() == reference_exact(want_tokens), (i, document[:40])
        assert word_hashes[offsets[i] : offsets[i + 1]].tolist() == want_words, (i, document[:40])

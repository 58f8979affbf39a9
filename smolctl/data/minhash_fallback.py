"""The MinHash kernels of _minhash.c in numpy, for installs where the C extension could not be built.

    from smolctl.data import minhash_fallback as kernels
    kernels.signatures(shingles, offsets, multipliers, out)   # same arguments, results and errors as _minhash

Each function takes the same buffers as its C twin, fills the same outputs bit for bit (sorted_sets and
fold_documents: up to the end they report; past it the C kernels leave scratch) and refuses the same
malformed arguments with the same ValueError (tests/test_minhash_kernels.py runs every kernel test against both).
The definitions are stated in _minhash.c's header; here they are whole-array passes, processed a bounded slice at
a time so that the temporaries (several uint64 per input byte) stay small. Dedup gives identical output with
either; only its speed differs.
"""

from __future__ import annotations

import sys

import numpy as np

# Bytes (tokenize) or values (the others) handled per pass: bounds the per-byte uint64 temporaries to ~100 MB.
SLICE_BYTES = 1 << 22
SLICE_VALUES = 1 << 21

RADIX = np.uint64(0x100000001B3)
EXACT_RADIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xD6E8FEB86659FD93))
LENGTH_WEIGHT = np.uint64(0x9E3779B97F4A7C15)
FINISH_MULTIPLIER = np.uint64(0xBF58476D1CE4E5B9)
NO_SHINGLE = np.uint32(0xFFFFFFFF)

BYTES = np.arange(256)
# What str.split() splits on among ASCII bytes: \t \n \v \f \r, \x1c-\x1f and ' '.
SPACE_BYTES = ((BYTES >= 9) & (BYTES <= 13)) | ((BYTES >= 28) & (BYTES <= 32))
# Word bytes: non-ASCII, 0-9, A-Z, a-z and '_'; every other non-space byte is punctuation.
UPPER = (ord("A") <= BYTES) & (ord("Z") >= BYTES)
WORD_BYTES = (BYTES >= 128) | np.isin(BYTES, list(b"0123456789_abcdefghijklmnopqrstuvwxyz")) | UPPER
# ASCII letters lower-cased, every other byte kept, as uint64 (what a span's hash sums).
LOWERED = (BYTES | np.where(UPPER, 0x20, 0)).astype(np.uint64)


def warn_slow() -> None:
    """One line on stderr: the fallback is correct but several times slower than the C kernels."""
    print(
        "warning: smolctl's C MinHash kernels are not built (no C compiler at install time?); dedup uses the "
        "numpy fallback: same results, several times slower. Reinstall with a C compiler, or use a wheel.",
        file=sys.stderr,
    )


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, as _minhash.c's mix64."""
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


# ---------------------------------------------------------------------------------------------------------------
# Buffers: what _minhash.c's get_buffers accepts


def _array(obj, name: str, dtype, writable: bool = False) -> np.ndarray:
    """obj's C-contiguous buffer as a flat array of dtype (a view: outputs are written in place)."""
    view = memoryview(obj)
    if not view.c_contiguous:
        raise BufferError(f"{name}: the buffer is not C-contiguous")
    if writable and view.readonly:
        raise BufferError(f"{name}: the buffer is read-only")
    raw = np.frombuffer(view.cast("B"), np.uint8) if view.nbytes else np.zeros(0, np.uint8)
    size = np.dtype(dtype).itemsize
    if raw.nbytes % size:
        raise ValueError(f"{name}: {raw.nbytes} bytes is not a whole number of {size}-byte items")
    return raw.view(dtype)


def _offsets_fit(offsets: np.ndarray, items: int) -> bool:
    """docs + 1 offsets into `items` values: ascending, and inside (check_offsets)."""
    return len(offsets) >= 1 and offsets[0] >= 0 and bool(np.all(offsets[1:] >= offsets[:-1])) and offsets[-1] <= items


def _pairs_inside(left: np.ndarray, right: np.ndarray, count: int) -> bool:
    return bool(np.all((left >= 0) & (left < count) & (right >= 0) & (right < count)))


def _segment_sums(values: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """uint64 sums of values[starts[k]:ends[k]] mod 2^64 (differences of a wrapping cumulative sum are exact)."""
    cumulative = np.zeros(len(values) + 1, np.uint64)
    np.cumsum(values, out=cumulative[1:])
    return cumulative[ends] - cumulative[starts]


def _powers(base: np.uint64, count: int, first: int = 1) -> np.ndarray:
    """first * base^k mod 2^64 for k < count."""
    out = np.full(count, base, np.uint64)
    if count:
        out[0] = np.uint64(first)
    return np.cumprod(out, dtype=np.uint64)


# ---------------------------------------------------------------------------------------------------------------
# tokenize


def tokenize(data, extra, starts, ends, exact, word_hashes, word_counts) -> int:
    """Token and word hashes of a batch of documents; see _minhash.c's header for the definition."""
    data, extra = _array(data, "data", np.uint8), _array(extra, "extra", np.uint8)
    starts, ends = _array(starts, "starts", np.int64), _array(ends, "ends", np.int64)
    exact = _array(exact, "exact", np.uint64, writable=True)
    word_hashes = _array(word_hashes, "word_hashes", np.uint64, writable=True)
    word_counts = _array(word_counts, "word_counts", np.int64, writable=True)
    docs = len(starts)
    if len(ends) != docs or len(exact) != 2 * docs or len(word_counts) != docs:
        raise ValueError("starts, ends, exact and word_counts disagree on the number of documents")
    in_data = ends <= len(data)
    in_extra = (starts >= len(data)) & (ends <= len(data) + len(extra))
    if np.any((starts < 0) | (starts > ends) | ~(in_data | in_extra)):
        raise ValueError("each document must lie inside data, or inside extra (positions from len(data) on)")
    # Positions from len(data) on address extra: one buffer of both makes every document a plain slice.
    both = np.concatenate([data, extra]) if len(extra) else data
    exact_pairs = exact.reshape(docs, 2)
    words, first = 0, 0
    while first < docs:
        last = _slice_end(starts, ends, first)
        hashes, counts = _tokenize_slice(both, starts[first:last], ends[first:last], exact_pairs[first:last])
        if words + len(hashes) > len(word_hashes):
            raise ValueError("word_hashes is too small for the batch")
        word_hashes[words : words + len(hashes)] = hashes
        word_counts[first:last] = counts
        words += len(hashes)
        first = last
    return words


def _slice_end(starts: np.ndarray, ends: np.ndarray, first: int) -> int:
    """The end of the run of documents from `first` holding about SLICE_BYTES bytes (at least one document)."""
    sizes = np.cumsum(ends[first:] - starts[first:])
    return first + max(1, int(np.searchsorted(sizes, SLICE_BYTES, side="right")))


def _tokenize_slice(both: np.ndarray, starts: np.ndarray, ends: np.ndarray, exact: np.ndarray):
    """(word hashes, words per document) of some documents, their exact hashes written into exact."""
    lengths = ends - starts
    # The documents' bytes end to end, each followed by a space so that no token runs into the next document.
    sizes = lengths + 1
    doc_base = np.cumsum(sizes) - sizes
    position = np.arange(int(sizes.sum()), dtype=np.int64) - np.repeat(doc_base, sizes)
    inside = position < np.repeat(lengths, sizes)
    text = np.full(len(position), ord(" "), np.uint8)
    text[inside] = both[(np.repeat(starts, sizes) + position)[inside]]
    space = SPACE_BYTES[text]
    # Tokens: maximal runs of non-space bytes, as [token_starts, token_ends) of text.
    before = np.concatenate([[True], space[:-1]])
    token_starts = np.flatnonzero(~space & before)
    token_ends = np.flatnonzero(space & ~before)
    token_doc = np.searchsorted(doc_base, token_starts, side="right") - 1
    token_hashes = _span_hashes(text, token_starts, token_ends)
    _exact_hashes(token_hashes, token_doc, len(starts), exact)
    # Words: each token trimmed to its first and last word bytes; tokens without one have no word.
    word = WORD_BYTES[text]
    word_at = np.flatnonzero(word)
    first_word = np.searchsorted(word_at, token_starts)
    last_word = np.searchsorted(word_at, token_ends) - 1
    has_word = first_word <= last_word
    word_starts = word_at[first_word[has_word]]
    word_ends = word_at[last_word[has_word]] + 1
    word_hashes = _span_hashes(text, word_starts, word_ends)
    return word_hashes, np.bincount(token_doc[has_word], minlength=len(starts))


def _span_hashes(text: np.ndarray, span_starts: np.ndarray, span_ends: np.ndarray) -> np.ndarray:
    """The hash of each span [span_starts[k], span_ends[k]) of text (before its length is folded in): its lower-cased bytes as 8-byte
    little-endian chunks c_m summed as c_m * RADIX^(8m + 1); byte k of a span therefore weighs
    2^(8 (k mod 8)) * RADIX^(8 (k div 8) + 1)."""
    lengths = span_ends - span_starts
    if not len(lengths):
        return np.zeros(0, np.uint64)
    longest = int(lengths.max())
    chunk_weights = _powers(_powers(RADIX, 9)[8], (longest + 7) // 8, first=int(RADIX))
    offset_in_span = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    weights = chunk_weights[offset_in_span >> 3] << (np.uint64(8) * (offset_in_span & 7).astype(np.uint64))
    span_bytes = text[np.repeat(span_starts, lengths) + offset_in_span]
    ends = np.cumsum(lengths)
    sums = _segment_sums(LOWERED[span_bytes] * weights, ends - lengths, ends)
    mixed = (sums + lengths.astype(np.uint64) * LENGTH_WEIGHT) * FINISH_MULTIPLIER
    return (mixed ^ (mixed >> np.uint64(31))) | np.uint64(1)


def _exact_hashes(token_hashes: np.ndarray, token_doc: np.ndarray, docs: int, exact: np.ndarray) -> None:
    """exact[i, c] = mix64(sum_j t_j * R_c^j ^ tokens * R_c) over the token hashes t_j of document i."""
    counts = np.bincount(token_doc, minlength=docs)
    ends = np.cumsum(counts)
    rank = np.arange(len(token_hashes)) - np.repeat(ends - counts, counts)
    for column, radix in enumerate(EXACT_RADIX):
        sums = _segment_sums(token_hashes * _powers(radix, int(counts.max(initial=0)))[rank], ends - counts, ends)
        exact[:, column] = mix64(sums ^ (counts.astype(np.uint64) * radix))


# ---------------------------------------------------------------------------------------------------------------
# shingles, signatures, intersections, agreements


def shingles(tokens, offsets, weights, out, out_counts) -> int:
    """mix64(sum_k tokens[j + k] * weights[k]) of each n-gram of each document (of all its tokens if it has
    fewer than n); see _minhash.c's header."""
    tokens, offsets = _array(tokens, "tokens", np.uint64), _array(offsets, "offsets", np.int64)
    weights = _array(weights, "weights", np.uint64)
    out, out_counts = (
        _array(out, "out", np.uint64, writable=True),
        _array(out_counts, "out_counts", np.int64, writable=True),
    )
    docs, ngram = len(offsets) - 1, len(weights)
    if ngram < 1 or not _offsets_fit(offsets, len(tokens)) or len(out) < len(tokens) or len(out_counts) < docs:
        raise ValueError("shingles: tokens, offsets, weights and outputs do not fit together")
    counts = np.diff(offsets)
    made = np.where(counts >= ngram, counts - ngram + 1, np.minimum(counts, 1))
    # Shingle s of document i starts at token offsets[i] + s and sums min(ngram, counts[i]) weighted tokens.
    shingle_doc = np.repeat(np.arange(docs), made)
    first = offsets[shingle_doc] + np.arange(int(made.sum())) - np.repeat(np.cumsum(made) - made, made)
    width = np.minimum(counts[shingle_doc], ngram)
    sums = np.zeros(len(first), np.uint64)
    for k in range(ngram):
        taking = width > k
        sums[taking] += tokens[first[taking] + k] * weights[k]
    out[: len(sums)] = mix64(sums)
    out_counts[:docs] = made
    return len(sums)


def signatures(shingles, offsets, multipliers, out) -> None:
    """out[i, p] = min over document i's shingle hashes s, shingles[offsets[i]:offsets[i + 1]], of
    (uint32)(multipliers[p] * (s >> 32)), 0xFFFFFFFF for a document without shingles."""
    shingles, offsets = _array(shingles, "shingles", np.uint64), _array(offsets, "offsets", np.int64)
    multipliers, out = _array(multipliers, "multipliers", np.uint32), _array(out, "out", np.uint32, writable=True)
    docs, perms = len(offsets) - 1, len(multipliers)
    if perms <= 0 or not _offsets_fit(offsets, len(shingles)) or len(out) != docs * perms:
        raise ValueError("signatures: shingles, offsets, multipliers and out do not fit together")
    rows = out.reshape(docs, perms)
    rows[:] = NO_SHINGLE
    keys = (shingles[offsets[0] : offsets[-1]] >> np.uint64(32)).astype(np.uint32)
    filled = np.flatnonzero(np.diff(offsets) > 0)
    # reduceat over the starts of the non-empty documents: each runs to the next one's start, the last to the end.
    segment_starts = offsets[filled] - offsets[0]
    for p in range(perms):
        if len(filled):
            rows[filled, p] = np.minimum.reduceat(keys * multipliers[p], segment_starts)


def sorted_sets(values, offsets, out, out_bounds) -> int:
    """Each document's values sorted and without repeats, end to end in out; see _minhash.c's header."""
    values, offsets = _array(values, "values", np.uint64), _array(offsets, "offsets", np.int64)
    out = _array(out, "out", np.uint64, writable=True)
    out_bounds = _array(out_bounds, "out_bounds", np.int64, writable=True)
    docs = len(offsets) - 1
    if not _offsets_fit(offsets, len(values)) or len(out) < len(values) or len(out_bounds) != docs + 1:
        raise ValueError("sorted_sets: values, offsets and outputs do not fit together")
    counts = np.diff(offsets)
    owner = np.repeat(np.arange(docs), counts)
    members = values[np.arange(len(owner)) + np.repeat(offsets[:-1] - (np.cumsum(counts) - counts), counts)]
    order = np.lexsort((members, owner))
    members, owner = members[order], owner[order]
    first = np.ones(len(members), bool)
    first[1:] = (members[1:] != members[:-1]) | (owner[1:] != owner[:-1])
    total = int(first.sum())
    out[:total] = members[first]
    out_bounds[0] = 0
    np.cumsum(np.bincount(owner[first], minlength=docs), out=out_bounds[1:])
    return total


def shared_positions(values, scratch, out) -> int:
    """The positions of the values occurring more than once, ordered by (value, position), in out[:count]; see
    _minhash.c's header (scratch is the C kernel's room, unused here)."""
    values = _array(values, "values", np.uint64)
    scratch, out = _array(scratch, "scratch", np.uint64, writable=True), _array(out, "out", np.int64, writable=True)
    if len(scratch) < 2 * len(values) or len(out) < len(values):
        raise ValueError("shared_positions: scratch is shorter than 2 x values or out than values")
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    repeated = np.zeros(len(values), bool)
    same = ordered[1:] == ordered[:-1]
    repeated[1:] |= same
    repeated[:-1] |= same
    count = int(repeated.sum())
    out[:count] = order[repeated]
    return count


def intersections(values, bounds, left, right, out) -> None:
    """out[k] = |set left[k] & set right[k]|, set i being the sorted unique values[bounds[i]:bounds[i + 1]]."""
    values, bounds = _array(values, "values", np.uint64), _array(bounds, "bounds", np.int64)
    left, right = _array(left, "left", np.int64), _array(right, "right", np.int64)
    out = _array(out, "out", np.int64, writable=True)
    sets, pairs = len(bounds) - 1, len(left)
    if (
        not _offsets_fit(bounds, len(values))
        or len(right) != pairs
        or len(out) != pairs
        or not _pairs_inside(left, right, sets)
    ):
        raise ValueError("intersections: values, bounds, pairs and out do not fit together")
    sizes = np.diff(bounds)
    first = 0
    while first < pairs:
        members = np.cumsum(sizes[left[first:]] + sizes[right[first:]])
        last = first + max(1, int(np.searchsorted(members, SLICE_VALUES, side="right")))
        out[first:last] = _common_members(values, bounds, sizes, left[first:last], right[first:last])
        first = last


def _common_members(values: np.ndarray, bounds: np.ndarray, sizes: np.ndarray, left: np.ndarray, right: np.ndarray):
    """Per pair, how many members of its smaller set the larger one holds: a binary search in the larger set,
    run for every member of every pair at once (the sets are sorted and unique)."""
    small = np.where(sizes[left] <= sizes[right], left, right)
    large = left + right - small
    counts = sizes[small]
    pair = np.repeat(np.arange(len(left)), counts)
    member = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    wanted = values[bounds[small][pair] + member]
    low, end = bounds[large][pair], bounds[large + 1][pair]
    high = end.copy()
    # Lower bound: after these halvings low is the first position of the larger set not below the member.
    for _ in range(int(sizes.max(initial=0)).bit_length()):
        middle = (low + high) >> 1
        searching = low < high
        below = searching & (values[np.minimum(middle, len(values) - 1)] < wanted)
        low = np.where(below, middle + 1, low)
        high = np.where(searching & ~below, middle, high)
    found = (low < end) & (values[np.minimum(low, len(values) - 1)] == wanted)
    return np.bincount(pair[found], minlength=len(left))


def agreements(signatures, perms: int, left, right, out) -> None:
    """out[k] = how many of the perms values of rows left[k] and right[k] of signatures agree."""
    signatures = _array(signatures, "signatures", np.uint32)
    left, right = _array(left, "left", np.int64), _array(right, "right", np.int64)
    out = _array(out, "out", np.int64, writable=True)
    pairs = len(left)
    docs = len(signatures) // perms if perms > 0 else 0
    if (
        perms <= 0
        or len(signatures) != docs * perms
        or len(right) != pairs
        or len(out) != pairs
        or not _pairs_inside(left, right, docs)
    ):
        raise ValueError("agreements: signatures, pairs and out do not fit together")
    rows = signatures.reshape(docs, perms)
    step = max(1, SLICE_VALUES // perms)
    for first in range(0, pairs, step):
        last = first + step
        out[first:last] = np.count_nonzero(rows[left[first:last]] == rows[right[first:last]], axis=1)


# ---------------------------------------------------------------------------------------------------------------
# Documents that need Unicode normalisation


def changing_documents(data, starts, ends, table, out) -> None:
    """out[i] = 1 if the UTF-8 bytes [starts[i], ends[i]) of data hold a non-ASCII character whose bit is set in
    table (code points below 8 * len(table), len(table) >= 16) or a character at or above 8 * len(table);
    ASCII never counts; malformed bytes are skipped."""
    data = _array(data, "data", np.uint8)
    starts, ends = _array(starts, "starts", np.int64), _array(ends, "ends", np.int64)
    table = _array(table, "table", np.uint8)
    out = _array(out, "out", np.uint8, writable=True)
    if len(ends) != len(starts) or len(out) != len(starts):
        raise ValueError("changing_documents: starts, ends and out disagree on the number of documents")
    if len(table) < 16:
        raise ValueError("changing_documents: the table must cover the 128 ASCII code points")
    if ((starts < 0) | (starts > ends) | (ends > len(data))).any():
        raise ValueError("changing_documents: each document must lie inside data")
    bits = np.unpackbits(table, bitorder="little").astype(bool)
    bits[:0x80] = False
    for i, (start, end) in enumerate(zip(starts.tolist(), ends.tolist())):
        code_points = np.frombuffer(_well_formed_text(data[start:end].tobytes()).encode("utf-32-le"), "<u4")
        beyond = code_points >= len(bits)
        out[i] = bool(beyond.any() or bits[code_points[~beyond]].any())


def fold_documents(data, starts, ends, table, folds, classes, out, out_ends) -> None:
    """Each document's bytes end to end in out, the table's characters replaced by their folds; out_ends[i] = -1
    where one has none (or lies beyond the table), where a class goes down, or where the folding does not fit.
    See _minhash.c's header."""
    data = _array(data, "data", np.uint8)
    starts, ends = _array(starts, "starts", np.int64), _array(ends, "ends", np.int64)
    table, folds = _array(table, "table", np.uint8), _array(folds, "folds", np.uint64)
    classes = _array(classes, "classes", np.uint8)
    out, out_ends = _array(out, "out", np.uint8, writable=True), _array(out_ends, "out_ends", np.int64, writable=True)
    if len(ends) != len(starts) or len(out_ends) != len(starts):
        raise ValueError("fold_documents: starts, ends and out_ends disagree on the number of documents")
    if len(table) < 16 or len(folds) != 8 * len(table) or len(classes) != 8 * len(table):
        raise ValueError("fold_documents: folds and classes must hold one entry per code point of the table")
    if ((starts < 0) | (starts > ends) | (ends > len(data))).any():
        raise ValueError("fold_documents: each document must lie inside data")
    bits = np.unpackbits(table, bitorder="little").astype(bool)
    position = 0
    for i, (start, end) in enumerate(zip(starts.tolist(), ends.tolist())):
        folded = _folded(data[start:end].tobytes(), bits, folds, classes)
        if folded is not None and position + len(folded) <= len(out):
            out[position : position + len(folded)] = np.frombuffer(folded, np.uint8)
            position += len(folded)
            out_ends[i] = position
        else:
            out_ends[i] = -1


def _folded(raw: bytes, bits: np.ndarray, folds: np.ndarray, classes: np.ndarray) -> bytes | None:
    """raw with each well-formed character of the table replaced by its fold; None where one has none or
    where the classes of consecutive characters go down. Well-formed text is checked with numpy and each of its
    few distinct characters to replace replaced with str.replace (a document at about the cost of normalising
    it); malformed bytes one at a time."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return _folded_bytewise(raw, bits, folds, classes)
    points = np.frombuffer(text.encode("utf-32-le"), "<u4")
    if (points >= len(bits)).any():
        return None
    marked = bits[points] & (points >= 0x80)
    entries = folds[points[marked]]
    lengths = entries >> np.uint64(56)
    if ((lengths == 0) | (lengths > 7)).any():
        return None
    ranks = np.where(marked, classes[points], 0)
    if ((ranks[1:] > 0) & (ranks[1:] < ranks[:-1])).any():
        return None
    replacements = {}
    for point in np.unique(points[marked]).tolist():
        entry = int(folds[point])
        try:
            replacements[chr(point)] = entry.to_bytes(8, "little")[: entry >> 56].decode("utf-8")
        except UnicodeDecodeError:  # a table whose fold is not text: bytes, one at a time
            return _folded_bytewise(raw, bits, folds, classes)
    if any(source in folded for folded in replacements.values() for source in replacements):
        return text.translate({ord(source): folded for source, folded in replacements.items()}).encode()
    for source, folded in replacements.items():  # a few characters each time: str.replace runs in C
        text = text.replace(source, folded)
    return text.encode()


def _folded_bytewise(raw: bytes, bits: np.ndarray, folds: np.ndarray, classes: np.ndarray) -> bytes | None:
    """_folded one UTF-8 sequence at a time: a malformed byte is copied alone."""
    pieces, i, previous = [], 0, 0
    while i < len(raw):
        lead = raw[i]
        length = 1 if lead < 0x80 else 2 if 0xC2 <= lead < 0xE0 else 3 if 0xE0 <= lead < 0xF0 else 4
        sequence = raw[i : i + length]
        try:
            code_point = ord(sequence.decode("utf-8")) if 0xC2 <= lead < 0xF5 else None
        except UnicodeDecodeError:
            code_point = None
        if code_point is None:  # ASCII, or a malformed byte: copied alone
            pieces.append(raw[i : i + 1])
            i, previous = i + 1, 0
            continue
        if code_point >= len(bits):
            return None
        if bits[code_point]:
            folded, combining_class = int(folds[code_point]), int(classes[code_point])
            if not 0 < folded >> 56 <= 7 or 0 < combining_class < previous:
                return None
            pieces.append(folded.to_bytes(8, "little")[: folded >> 56])
            previous = combining_class
        else:
            pieces.append(sequence)
            previous = 0
        i += length
    return b"".join(pieces)


def _well_formed_text(raw: bytes) -> str:
    """The characters of raw's well-formed UTF-8 sequences, a malformed byte skipped on its own (as _minhash.c)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        pass
    characters, i = [], 0
    while i < len(raw):
        lead = raw[i]
        length = 1 if lead < 0x80 else 4 if 0xF0 <= lead < 0xF5 else 3 if 0xE0 <= lead < 0xF0 else 2
        if lead >= 0x80 and lead < 0xC2:
            i += 1
            continue
        try:
            characters.append(raw[i : i + length].decode("utf-8"))
            i += length
        except UnicodeDecodeError:
            i += 1
    return "".join(characters)

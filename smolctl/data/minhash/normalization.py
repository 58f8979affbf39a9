"""Unicode normalisation of documents: NFKC and case folding, and which documents need more than ASCII
lower-casing (the tokeniser lower-cases ASCII as it reads; only the others go through Python)."""

from __future__ import annotations

import functools
import hashlib
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from smolctl.arrow_arrays import plain_strings
from smolctl.user_cache import cache_path, derived_bytes

_OTHER_SPACES = {0x85: " ", 0x1680: " ", 0x2028: " ", 0x2029: " "}
_OTHER_SPACES_TEXT = [chr(c) for c in _OTHER_SPACES]


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
    import pyarrow.compute as pc  # character shingles only: word shingles never import it (see arrow_arrays)

    texts = pc.fill_null(plain_strings(texts).cast(pa.large_string()), "")
    lowered = pc.ascii_lower(texts)
    is_ascii = np.asarray(pc.string_is_ascii(texts), dtype=bool)
    if is_ascii.all():
        return lowered
    # The others from their own text: NFKC composes an ASCII capital with a mark that follows it apart from its
    # lower case (I + marks + U+0307 gives İ, whose fold puts the dot first; i + the same marks does not).
    others = np.flatnonzero(~is_ascii)
    folded = pa.array([normalize(t) for t in texts.take(pa.array(others)).to_pylist()], pa.large_string())
    return pc.replace_with_mask(lowered, pa.array(~is_ascii), folded)


# Code points below this are looked up in normalization_tables(); every one from here on counts as changing.
TABLE_CODE_POINTS = 0x20000


# A fold's UTF-8 bytes fill at most the low 7 bytes of its uint64 entry; the top byte holds their number.
FOLD_BYTES = 7


@dataclass(frozen=True)
class NormalizationTables:
    """What the kernels need to know of normalize(), per code point below TABLE_CODE_POINTS (read-only arrays)."""

    changing: np.ndarray
    """The characters a document must hold for normalize() to do more than lower-case its ASCII letters, as a
    bitmap (uint8, bit c & 7 of byte c >> 3; what the kernel `changing_documents` reads): those that NFKC or case
    folding change, those that compose with or reorder around their neighbours (combining marks, the second
    characters of canonical compositions, Hangul vowel and final jamo) and the extra spaces. Every character
    beyond plane 1 counts as changing (not examined: rare, and always safe to normalise)."""
    folds: np.ndarray
    """uint64 per code point: for a changing character that normalize() turns into the same text wherever it
    stands, that text's UTF-8 bytes packed little-endian with their number in the top byte (at most FOLD_BYTES);
    else 0. Such a character neither combines nor composes, nor does anything NFKC makes of it: capitals of
    Cyrillic, Greek, Armenian and accented Latin, ß, no-break and other spaces, ligatures, full-width forms and
    punctuation. Combining marks that compose with nothing and that NFKC and case folding leave alone have
    themselves as their fold (virama, harakat, Thai vowel and tone marks). A document whose changing characters
    all have one is folded in C (`fold_documents`)."""
    classes: np.ndarray
    """uint8 per code point: the canonical combining class of the marks folded as themselves, 0 elsewhere. Where
    the classes of consecutive marks go down, NFKC would reorder them: such a document goes to Python."""


@functools.cache
def normalization_tables() -> NormalizationTables:
    """Derived from this Python's Unicode tables once per machine. Deriving them is a Python pass over every code
    point, a large part of a small dedup's whole run, so they are kept in smolctl's cache (smolctl.user_cache),
    under a name that covers this module's source and this Python's Unicode version."""
    data = derived_bytes(_tables_entry(), lambda: _tables_to_bytes(derive_normalization_tables()), sum(_TABLE_SIZES))
    tables = _tables_from_bytes(data)
    for array in (tables.changing, tables.folds, tables.classes):
        array.flags.writeable = False  # cached for the whole process
    return tables


_TABLE_SIZES = (TABLE_CODE_POINTS // 8, TABLE_CODE_POINTS * 8, TABLE_CODE_POINTS)  # changing, folds, classes


def _tables_entry() -> Path | None:
    try:
        source = Path(__file__).read_bytes()
    except OSError:
        return None
    key = hashlib.sha256(source + f"|{unicodedata.unidata_version}|{sys.version}".encode()).hexdigest()[:24]
    return cache_path("unicode-tables", f"{key}.bin")


def _tables_to_bytes(tables: NormalizationTables) -> bytes:
    """The three arrays end to end (little-endian)."""
    return tables.changing.tobytes() + tables.folds.astype("<u8").tobytes() + tables.classes.tobytes()


def _tables_from_bytes(data: memoryview) -> NormalizationTables:
    changing_end, folds_end = _TABLE_SIZES[0], _TABLE_SIZES[0] + _TABLE_SIZES[1]
    return NormalizationTables(
        np.frombuffer(data[:changing_end], np.uint8),
        np.frombuffer(data[changing_end:folds_end], "<u8").astype(np.uint64, copy=False),
        np.frombuffer(data[folds_end:], np.uint8),
    )


def derive_normalization_tables() -> NormalizationTables:
    """The tables, from this Python's unicodedata and str.casefold (what normalize() uses)."""
    # Second characters of canonical compositions (and the Hangul vowel and final jamo): they may compose with
    # the character before them. With the combining marks, no rule per character holds beside them.
    seconds = set(range(0x1161, 0x1176)) | set(range(0x11A8, 0x11C3))
    composed = set()  # the seconds of the compositions NFKC makes (not of the excluded ones)
    marks = {}  # combining marks: their canonical combining class
    changed = set(_OTHER_SPACES)  # characters that normalize() changes on their own
    for block in range(0x80, TABLE_CODE_POINTS, 128):
        if 0xD800 <= block < 0xE000:
            continue  # surrogates: never in UTF-8 text
        chars = np.arange(block, block + 128, dtype="<u4").tobytes().decode("utf-32-le")
        marks.update((block + i, unicodedata.combining(c)) for i, c in enumerate(chars) if unicodedata.combining(c))
        # A block that case folding and NFKD leave alone as a whole holds no character either changes.
        if chars.casefold() == chars and unicodedata.normalize("NFKD", chars) == chars:
            continue
        for i, c in enumerate(chars):
            if c.casefold() != c:
                changed.add(block + i)
            decomposition = unicodedata.decomposition(c)
            if not decomposition:
                continue
            if unicodedata.normalize("NFKC", c) != c:
                changed.add(block + i)
            parts = decomposition.split()
            if not decomposition.startswith("<") and len(parts) == 2:
                seconds.add(int(parts[1], 16))
                if unicodedata.normalize("NFC", chr(int(parts[0], 16)) + chr(int(parts[1], 16))) == c:
                    composed.add(int(parts[1], 16))  # c is no composition exclusion: NFKC makes it
    composing = seconds | set(marks)
    folds, classes = np.zeros(TABLE_CODE_POINTS, np.uint64), np.zeros(TABLE_CODE_POINTS, np.uint8)
    for code_point in changed - composing:
        made = unicodedata.normalize("NFKC", chr(code_point))
        if any(ord(part) in composing or unicodedata.combining(part) for part in made):
            continue
        folded = normalize(chr(code_point)).encode()
        if len(folded) <= FOLD_BYTES:
            folds[code_point] = int.from_bytes(folded, "little") | len(folded) << 8 * FOLD_BYTES
    # A mark that composes with nothing and that NFKC and case folding leave alone stays where it is, unless
    # canonical ordering moves it: a document is folded in C only where its marks' classes never go down.
    for code_point, combining_class in marks.items():
        if code_point not in composed and code_point not in changed:
            itself = chr(code_point).encode()
            folds[code_point] = int.from_bytes(itself, "little") | len(itself) << 8 * FOLD_BYTES
            classes[code_point] = combining_class
    bits = np.zeros(TABLE_CODE_POINTS, bool)
    bits[sorted(changed | composing)] = True
    return NormalizationTables(np.packbits(bits, bitorder="little"), folds, classes)

"""Token ids of documents too long to encode in one call (a book dump, a concatenated code file), without ever
holding one call's worth of the tokenizer's bookkeeping for the whole document: the Rust encoder keeps ~180 bytes
per character while it encodes (a 104 MB document took 18 GB and 105 s on one thread), so such a document is
encoded in pieces, several pieces per call (spread over the encoder's threads), and only their int32 ids are kept.

The ids are those of encoding the whole document (no special tokens added). Pieces are cut at a single space
between two letters or digits, where every splitting pre-tokenizer in use splits anyway (GPT-2's and Llama 3's
patterns, Metaspace, whitespace): no pre-token holds a space after its first character, and none reads past the
space. That holds only for tokenizers that split there and whose normalizer does nothing at the edges of its
input, which is tried on the tokenizer (`splits_at_spaces`): one with no splitting pre-tokenizer, one that keeps
the space with the word before (Gemma's), or one with a Prepend or Strip normalizer (Llama 2's legacy files
prepend "▁" to every input), encodes the document whole, as before. Each cut is also checked on the text
around it (encoded whole, and as its two halves): one that changes the ids there, as an added token holding a
space would, has the document encoded whole too."""

from __future__ import annotations

import re
from itertools import pairwise

import numpy as np

from smolctl.arrow_arrays import TEXT_BYTES_PER_CALL

LONG_DOCUMENT_CHARS = 4 * 2**20
"""Documents longer than this are encoded in pieces."""
PIECE_CHARS = 2**20
"""The shortest piece: cuts are the first place to cut after each PIECE_CHARS characters."""
CHECK_CHARS = 2048
"""Characters each side of a cut that are encoded whole and in halves to check it."""

_CUT = re.compile(r"(?<=[^\W_]) (?=[^\W_])")
# Texts cut as _CUT cuts them (the space starts the right part), to try a tokenizer on: letters, digits, accents.
_PROBES = [("ab", " cd"), ("x7", " 9y"), ("é", " Ü"), ("the end", " of it")]


def texts_ids(backend, texts: list[str]) -> list[np.ndarray]:
    """The int32 ids of each text (no special tokens), in order: long ones as `document_ids` gives them, the rest
    in one batch call."""
    ids: list[np.ndarray | None] = [None] * len(texts)
    short = [i for i, text in enumerate(texts) if len(text) <= LONG_DOCUMENT_CHARS]
    for i, encoding in zip(short, backend.encode_batch_fast([texts[i] for i in short], add_special_tokens=False)):
        ids[i] = np.array(encoding.ids, dtype=np.int32)
    for i, text in enumerate(texts):
        if ids[i] is None:
            ids[i] = document_ids(backend, text)
    return ids


def document_ids(backend, text: str) -> np.ndarray:
    """The int32 ids of encoding `text` whole without special tokens, computed in pieces where that gives the
    same ids (see the module's docstring)."""
    pieces = _pieces(text) if len(text) > LONG_DOCUMENT_CHARS and splits_at_spaces(backend) else [text]
    if len(pieces) > 1 and not _cuts_keep_ids(backend, pieces):
        pieces = [text]
    parts, call, call_chars = [], [], 0
    for number, piece in enumerate(pieces, 1):
        call.append(piece)
        call_chars += len(piece)
        if call_chars >= TEXT_BYTES_PER_CALL or number == len(pieces):
            parts += [
                np.array(e.ids, dtype=np.int32) for e in backend.encode_batch_fast(call, add_special_tokens=False)
            ]
            call, call_chars = [], 0
    return np.concatenate(parts)


def splits_at_spaces(backend) -> bool:
    """Whether the tokenizer's normalizer and pre-tokenizer turn a text cut at a space between two words into the
    pre-tokens of the text whole (the model encodes pre-tokens one by one, so its ids are then those of the
    whole). Tried on the tokenizer itself rather than read from its type names: Gemma's `Split` on " " keeps the
    space with the word before it (and its normalizer has already made spaces "▁"), so it does not split there."""
    if backend.pre_tokenizer is None:
        return False

    def pre_tokens(text: str) -> list[str]:
        normalized = backend.normalizer.normalize_str(text) if backend.normalizer is not None else text
        return [token for token, _ in backend.pre_tokenizer.pre_tokenize_str(normalized)]

    return all(pre_tokens(left + right) == pre_tokens(left) + pre_tokens(right) for left, right in _PROBES)


def _pieces(text: str) -> list[str]:
    """`text` cut at the first single space between two letters or digits after every PIECE_CHARS characters
    (a stretch with no such space stays in one piece); the pieces join to `text`."""
    cuts, start = [], 0
    while len(text) - start > PIECE_CHARS:
        cut = _CUT.search(text, start + PIECE_CHARS)
        if cut is None:
            break
        cuts.append(cut.start())
        start = cut.start()
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in pairwise(bounds)]


def _cuts_keep_ids(backend, pieces: list[str]) -> bool:
    """Whether the text around each cut encodes to the same ids whole as in its two halves."""
    checks = []
    for left, right in pairwise(pieces):
        before, after = left[-CHECK_CHARS:], right[:CHECK_CHARS]
        checks += [before + after, before, after]
    encodings = backend.encode_batch_fast(checks, add_special_tokens=False)
    return all(
        whole.ids == first.ids + second.ids
        for whole, first, second in zip(encodings[0::3], encodings[1::3], encodings[2::3])
    )

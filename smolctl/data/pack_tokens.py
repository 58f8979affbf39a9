"""The tokenizing stage of `smolctl pack`: documents in, token batches (EOS appended) out, in input order.

Documents are read in batches, and a batch goes to the Rust batch encoder in pieces of at most
TEXT_BYTES_PER_CALL bytes of text (most batches are one piece). The encoder releases the GIL, so Python can
work beside it: while the tokenizer's threads encode one piece, the next is already submitted (two calls in
flight share the Rust thread pool, so the long last documents of one piece do not leave the other threads
idle), and the ids of a finished piece are turned into one numpy array (in C, _pack.c, where the extension was
built). With `--workers N`, N single-threaded tokenizer processes take the pieces instead.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from functools import partial
from itertools import chain

import numpy as np

from smolctl.arrow_arrays import ENCODER_CALLS_IN_FLIGHT, text_pieces
from smolctl.child_processes import exit_with_parent, leave_quietly_on_ctrl_c
from smolctl.data.long_documents import LONG_DOCUMENT_CHARS, texts_ids
from smolctl.data.pack_rows import TokenBatch
from smolctl.data.tokenizer import RustTokenizer

try:
    from smolctl.data import _pack
except ImportError:  # built without a C compiler: join_documents_python gives the same arrays
    _pack = None

YOUNG_COLLECTION_THRESHOLD = 10_000
"""Allocations between collections of the young generation while tokenising (Python's default: 700)."""

PIECES_AHEAD = 8
"""Pieces submitted ahead of the one being packed. Results come back in order, so with only a few ahead one
book-sized piece holds up the queue while the other encoder thread has nothing to take: the Rust pool runs
on one core. Memory stays bounded by this many pieces of text and their ids (a piece is at most
TEXT_BYTES_PER_CALL of text, or one document longer than that)."""


def join_encodings(encodings: list, eos_id: int) -> tuple[TokenBatch, int]:
    """The token ids of a batch of documents (the tokenizer's Encodings) as one int32 array with EOS after each;
    empty documents are dropped. Returns (batch, number of empty documents dropped). _pack.c's kernel, or
    `join_documents_python` of the id lists (its definition) without the extension."""
    lengths = np.fromiter(map(len, encodings), dtype=np.int64, count=len(encodings))
    if _pack is None:
        return join_documents_python([encoding.ids for encoding in encodings], lengths, eos_id)
    kept = lengths[lengths > 0] + 1
    ids = np.empty(int(kept.sum()), dtype=np.int32)
    _pack.join_encodings(encodings, eos_id, ids)
    return TokenBatch(ids, kept), len(encodings) - len(kept)


def join_documents_python(documents: list[list[int]], lengths: np.ndarray, eos_id: int) -> tuple[TokenBatch, int]:
    flat = np.fromiter(chain.from_iterable(documents), dtype=np.int32, count=int(lengths.sum()))
    return append_document_end(TokenBatch(flat, lengths), eos_id)


def append_document_end(batch: TokenBatch, eos_id: int) -> tuple[TokenBatch, int]:
    """Drop empty documents and append EOS to the rest. Returns (batch, number of empty documents dropped)."""
    keep = batch.lengths > 0
    lengths = batch.lengths[keep] + 1
    ends = np.cumsum(lengths) - 1
    ids = np.empty(int(lengths.sum()), dtype=np.int32)
    is_text = np.ones(len(ids), dtype=bool)
    is_text[ends] = False
    ids[is_text] = batch.ids
    ids[ends] = eos_id
    return TokenBatch(ids, lengths), int((~keep).sum())


def encode_documents(backend, texts: list[str], eos_id: int) -> tuple[TokenBatch, int, int]:
    """(the non-empty documents' ids, each + EOS; documents read; empty documents dropped), via the Rust
    tokenizer's batch encoder (no special tokens, no offsets computed); a document of book-dump size in pieces
    (long_documents.py), with the same ids."""
    if max(map(len, texts), default=0) > LONG_DOCUMENT_CHARS:
        documents = texts_ids(backend, texts)
        lengths = np.fromiter(map(len, documents), dtype=np.int64, count=len(documents))
        batch, empty = append_document_end(TokenBatch(np.concatenate(documents), lengths), eos_id)
    else:
        batch, empty = join_encodings(backend.encode_batch_fast(texts, add_special_tokens=False), eos_id)
    return batch, len(texts), empty


_worker_backend = None


def _init_worker(tokenizer_json: str, split_special_tokens: bool, parent: int) -> None:
    global _worker_backend
    leave_quietly_on_ctrl_c()  # first: a Ctrl-C while the rest starts up must not print a traceback either
    exit_with_parent(parent)
    # One Rust thread per worker process: the processes are the parallelism, threads would oversubscribe.
    os.environ["RAYON_NUM_THREADS"] = "1"
    from tokenizers import Tokenizer

    _worker_backend = Tokenizer.from_str(tokenizer_json)
    # Not in the serialised form: transformers sets it from the folder's split_special_tokens.
    _worker_backend.encode_special_tokens = split_special_tokens


def _encode_in_worker(texts: list[str], eos_id: int) -> tuple[TokenBatch, int, int]:
    return encode_documents(_worker_backend, texts, eos_id)


def document_texts(
    source, text_column: str, batch_documents: int, units: list[int]
) -> Iterator[tuple[int, list[str], bool]]:
    """(unit, texts, last) in batches of batch_documents, units (input files) in order, each batch in pieces of
    at most TEXT_BYTES_PER_CALL bytes of text (`last` ends the batch); a null text is an empty document."""
    for unit in units:
        for batch in source.iter_file_batches(unit, columns=[text_column], batch_size=batch_documents):
            for piece, last in text_pieces(batch.column(0)):
                texts = piece.to_pylist()
                # Not pyarrow's fill_null: its string scalar imports pandas (start-up the raw pass does not pay).
                yield unit, texts if not piece.null_count else [t if t is not None else "" for t in texts], last


def in_order(futures: Iterable[tuple[object, Future]], window: int) -> Iterator[tuple[object, object]]:
    """(tag, result) of each future in submission order, keeping at most `window` submitted ahead (memory stays
    bounded however fast the input is read)."""
    pending: deque = deque()
    for item in futures:
        pending.append(item)
        if len(pending) >= window:
            tag, future = pending.popleft()
            yield tag, future.result()
    while pending:
        tag, future = pending.popleft()
        yield tag, future.result()


def tokenised_pieces(
    source, tokenizer: RustTokenizer, text_column: str, batch_documents: int, workers: int, units: list[int]
) -> Iterator[tuple[int, TokenBatch, int, int, bool]]:
    """(unit, token batch with EOS, documents read, empty documents dropped, batch_ends) for the units in input
    order: a batch in the pieces it was encoded in, `batch_ends` on its last. The pieces are not joined again:
    that would be one more copy of every token of a batch of books, made after its last piece, while the
    packer only needs to know where batches end."""
    pieces = document_texts(source, text_column, batch_documents, units)
    executor, window = encoder(tokenizer, workers)
    encode = _encode_in_worker if workers > 1 else partial(encode_documents, tokenizer.backend)
    # A batch makes thousands of objects the collector tracks (Encodings, id lists) that all die with it, none in
    # a cycle; at the default threshold of 700 the young generation would be walked several times per batch.
    thresholds = gc.get_threshold()
    gc.set_threshold(max(thresholds[0], YOUNG_COLLECTION_THRESHOLD), *thresholds[1:])
    try:
        submitted = (
            ((unit, last), executor.submit(encode, texts, tokenizer.eos_token_id)) for unit, texts, last in pieces
        )
        for (unit, last), (batch, read, empty) in in_order(submitted, window):
            yield unit, batch, read, empty, last
    finally:
        gc.set_threshold(*thresholds)
        executor.shutdown(wait=True, cancel_futures=True)


def encoder(tokenizer: RustTokenizer, workers: int) -> tuple[Executor, int]:
    """Where pieces are encoded (threads of this process, or `workers` processes) and how many ahead."""
    if workers == 1:
        return ThreadPoolExecutor(ENCODER_CALLS_IN_FLIGHT, thread_name_prefix="encode"), PIECES_AHEAD
    context = multiprocessing.get_context("spawn")  # fork after Rust threads have started can deadlock
    return ProcessPoolExecutor(
        workers,
        mp_context=context,
        initializer=_init_worker,
        initargs=(tokenizer.backend.to_str(), tokenizer.backend.encode_special_tokens, os.getpid()),
    ), 2 * workers

"""Arrow arrays built from numpy and Python values without pyarrow's pandas probe.

pyarrow.array() and pyarrow.scalar() (and every compute call given a plain Python value) first ask whether
pandas is installed and import it to find out, which costs a command that never touches pandas more start-up
than everything else it imports (see benchmarks/RESULTS.md, dedup). These build the same arrays from their
buffers, which never asks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import pyarrow as pa

try:
    # arrow's compute functions without pyarrow.compute, whose import generates a Python wrapper for each of
    # ~300 functions: a share of a small dedup run's whole time. pyarrow.compute.call_function is this one.
    from pyarrow._compute import CastOptions, call_function
except ImportError:  # a pyarrow that moved its private module
    from pyarrow.compute import CastOptions, call_function


def from_numpy(values: np.ndarray) -> pa.Array:
    """A 1-D numpy array of numbers or bools as an arrow array without nulls (numbers share the memory)."""
    if values.dtype == np.bool_:
        bits = np.packbits(values, bitorder="little")
        return pa.Array.from_buffers(pa.bool_(), len(values), [None, pa.py_buffer(bits)])
    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)])


def compute(name: str, *args, options=None):
    """arrow's compute function `name` over arrow values (arrays, chunked arrays, batches, tables), as
    pyarrow.compute.<name> and the arrays' own take/filter/cast methods call it, all of which import
    pyarrow.compute."""
    return call_function(name, list(args), options)


def cast(values, target: pa.DataType | pa.Schema):
    """`values` (an array or chunked array) as the type `target`, or a table as the schema `target` column by
    column, checked as pyarrow.compute.cast checks (safe); the values themselves when they already are."""
    if isinstance(target, pa.Schema):
        return pa.Table.from_arrays([cast(values.column(f.name), f.type) for f in target], schema=target)
    return values if values.type == target else call_function("cast", [values], CastOptions(target_type=target))


def strings(texts: Sequence[str]) -> pa.StringArray:
    """Python strings as an arrow string array."""
    encoded = [t.encode() for t in texts]
    offsets = np.zeros(len(encoded) + 1, np.int32)
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    return pa.Array.from_buffers(
        pa.string(), len(encoded), [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded))]
    )


def to_numpy_filled(values: pa.Array | pa.ChunkedArray, fill: int | bool = 0) -> np.ndarray:
    """An arrow array of numbers or bools (or a chunked one) as a numpy copy, nulls replaced by `fill`."""
    if isinstance(values, pa.ChunkedArray):
        chunks = [to_numpy_filled(chunk, fill) for chunk in values.chunks]
        return np.concatenate(chunks) if chunks else np.zeros(0, values.type.to_pandas_dtype())
    start, stop = values.offset, values.offset + len(values)
    if pa.types.is_boolean(values.type):
        out = _bits(values.buffers()[1], start, stop).astype(bool)
    else:
        out = np.frombuffer(values.buffers()[1], dtype=values.type.to_pandas_dtype())[start:stop].copy()
    if values.null_count:
        out[_bits(values.buffers()[0], start, stop) == 0] = fill
    return out


def _bits(buffer: pa.Buffer, start: int, stop: int) -> np.ndarray:
    """Bits start..stop of an arrow bitmap (least significant bit first) as 0/1 bytes."""
    return np.unpackbits(np.frombuffer(buffer, np.uint8), bitorder="little", count=stop)[start:stop]


def plain_strings(texts: Sequence[str] | pa.Array | pa.ChunkedArray) -> pa.Array:
    """A string or large_string arrow array (offsets and one data buffer) of any texts: arrow's string kernels
    (binary_length, utf8_length, ...) and smolctl's C kernels take only these, while parquet writers also give
    string_view (Polars) and dictionary-encoded strings (pandas categoricals)."""
    if isinstance(texts, pa.ChunkedArray):
        texts = texts.combine_chunks()
    elif not isinstance(texts, pa.Array):
        texts = pa.array(list(texts), pa.large_string())
    if not (pa.types.is_string(texts.type) or pa.types.is_large_string(texts.type)):
        texts = cast(texts, pa.large_string())
    return texts


TEXT_BYTES_PER_CALL = 8 * 2**20
"""The most UTF-8 text one call of the Rust batch encoder is given (a longer document goes alone). Its Encodings
hold, per token, the id, type id, offsets, masks and the token's string: ~40 bytes of memory per byte of text
while a call runs, so a batch of 1,000 book-length documents (~700 MB of text) would need tens of GB at once."""

ENCODER_CALLS_IN_FLIGHT = 2
"""Pieces being encoded at once in one process (pack encodes them, mix counts them): one keeps the Rust threads
busy, the other overlaps its end, where a piece's last long documents (or a piece that is one book) leave threads
idle. Each holds up to TEXT_BYTES_PER_CALL of text in Encodings."""


def text_pieces(texts: pa.Array) -> Iterator[tuple[pa.Array, bool]]:
    """(piece, last) for consecutive slices of texts holding at most TEXT_BYTES_PER_CALL bytes of text each (a
    longer document alone); `last` marks the final one. Texts of web or code size fill one piece: a batch
    is split only where its documents are long."""
    offsets = text_offsets(texts) if len(texts) else None
    if offsets is None or offsets[-1] - offsets[0] <= TEXT_BYTES_PER_CALL:
        yield texts, True
        return
    start = 0
    while start < len(texts):
        stop = int(np.searchsorted(offsets, offsets[start] + TEXT_BYTES_PER_CALL, side="right")) - 1
        stop = max(stop, start + 1)
        yield texts.slice(start, stop - start), stop == len(texts)
        start = stop


def text_offsets(texts: pa.Array) -> np.ndarray:
    """Where each text starts in the UTF-8 bytes of all of them, and where the last ends (len(texts) + 1 values)."""
    texts = plain_strings(texts)
    width = np.int64 if pa.types.is_large_string(texts.type) else np.int32
    return np.frombuffer(texts.buffers()[1], width)[texts.offset : texts.offset + len(texts) + 1]

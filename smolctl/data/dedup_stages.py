"""The four dedup stages, one unit of work each (see smolctl/data/dedup.py for how they are chained).

A unit reads its inputs (input shards or the previous stage's files under OUTPUT/_work) and writes its own files
atomically; the caller marks it done. Documents are named by their global position: input shards in order, then
reference shards.
"""

from __future__ import annotations

import functools
import io
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from smolctl.arrow_arrays import cast, compute, from_numpy, plain_strings, strings, to_numpy_filled
from smolctl.data.array_tasks import file_identity, read_work_file
from smolctl.data.dedup_plan import ID_FIX, POSITIONAL_IDS, DedupPlan, Report
from smolctl.data.minhash.arrays import connected_components, sorted_unique
from smolctl.data.minhash.kernels import (
    estimate_jaccard,
    jaccard_many,
    keys_behind,
    signatures,
    sorted_sets,
    tokenize,
)
from smolctl.data.minhash.lsh import band_keys, bucket_pairs
from smolctl.data.minhash.params import settle_margin
from smolctl.data.minhash.shingles import shingle_hashes
from smolctl.errors import UserError
from smolctl.shards import DocumentSource, atomic_write_bytes, atomic_write_parts, write_refused

BATCH_ROWS = 4096
DECODED_INPUT_BYTES = 256 * 2**20
"""An input this small (decoded, as its footers record it) is kept decoded from the signatures stage to the
filter stage by a run that does every stage in one process: the filter stage then writes the kept documents
without decoding their shard a second time. A larger input is read twice: keeping part of it would cost as much
memory for a small share of the time. (Footers can understate: shards are kept in input order until one does
not fit, and the rest are read again.)"""
# Shards are read with threads=False: the stages run one process per core (--workers, array tasks), and
# arrow's machine-wide thread pool would only contend with them.
NO_BUCKET = np.uint64(0)


# ---------------------------------------------------------------------------------------------------------------
# Stage 1: signatures


def signature_unit(plan_: DedupPlan, unit: int, report: Report) -> dict:
    source, file_index = plan_.units[unit]
    params = plan_.config.minhash
    is_input = source is plan_.source
    id_column = plan_.id_column if is_input else plan_.reference_id_column
    columns = [plan_.config.text_column] + ([id_column] if id_column else [])
    # Made-up ids name the file as a reader finds it. The reference's ids, its own or made up, are marked, so a
    # report row's duplicate_of never reads as one of the input's own documents (both may hold an id "d0").
    shard_name = source.file_labels[file_index] if is_input else f"against:{source.file_labels[file_index]}"
    # As arrow scalars taken from an array: pa.scalar of a Python str would import pandas.
    reference_mark, no_separator = strings(["against:", ""])
    tables, key_parts, signature_parts, shingle_counts, exact_parts = [], [], [], [], []
    row = 0
    permutations = params.permutations() if params else None
    check_unchanged(plan_, source, file_index)
    # Kept for the filter stage, a shard is read with all its columns: the batches the filter stage would read.
    keep, kept, kept_bytes = is_input and plan_.decoded_room > 0, [], 0
    # Kept whole for the verified pairs' exact Jaccard (verification must not take two different shingles for
    # one, as their 32-bit keys may), and written as they come: 8 bytes a word would otherwise be held to the end.
    # Reading them back is far cheaper than re-reading and re-hashing the texts (only the pairs' are ever loaded).
    kept_shingles_path = plan_.work / "signatures" / f"{unit:05d}.shingles" if params and plan_.config.verify else None
    with _written_as_they_come(kept_shingles_path) as keep_shingles:
        for batch in source.iter_file_batches(file_index, None if keep else columns, BATCH_ROWS, threads=False):
            if keep:
                kept.append(batch)
                kept_bytes += batch.nbytes
                if kept_bytes > plan_.decoded_room:
                    keep, kept, plan_.decoded_room = False, [], 0
            texts = plain_strings(batch.column(plan_.config.text_column))
            if id_column:
                ids = id_strings(batch.column(id_column), source.files[file_index], id_column)
                if not is_input:
                    ids = compute("binary_join_element_wise", reference_mark, ids, no_separator)
            else:
                ids = strings([f"{shard_name}:{r}" for r in range(row, row + len(texts))])
            columns_out = {
                "id": ids,
                "null": compute("is_null", texts),
                "bytes": from_numpy(to_numpy_filled(compute("binary_length", texts)).astype(np.int64)),
            }
            if plan_.config.keep == "longest":  # counting characters is a pass over every byte: only when asked
                columns_out["chars"] = from_numpy(to_numpy_filled(compute("utf8_length", texts)).astype(np.int64))
            # Tokens give the exact hashes and the word shingles; character shingles make their own.
            tokens = tokenize(texts) if plan_.config.exact or (params and params.shingle == "word") else None
            if plan_.config.exact:
                exact = tokens.exact
                columns_out["exact_hi"], columns_out["exact_lo"] = from_numpy(exact[:, 0]), from_numpy(exact[:, 1])
                exact_parts.append(exact)
            if params:
                shingles, offsets = shingle_hashes(texts, params.ngram, params.shingle, tokens)
                sigs = signatures(shingles, offsets, permutations)
                keys = band_keys(sigs, params.bands, params.rows)
                keys[np.diff(offsets) == 0] = NO_BUCKET  # documents without shingles (empty, null) match nothing
                if plan_.config.verify:
                    keep_shingles(shingles)
                    shingle_counts.append(np.diff(offsets))
                key_parts.append(keys)
                if not plan_.config.verify:
                    signature_parts.append(sigs)
            tables.append(pa.table(columns_out))
            row += len(texts)
            report("signatures", len(texts))
    table = pa.concat_tables(tables)
    repeats = np.zeros(table.num_rows, bool)
    if params and exact_parts:
        # A later exact copy of a document of this shard joins it through its exact edge: it stays out of the
        # buckets (no pairs to verify). Its shingles are still kept: removed as a near duplicate of another
        # document of its cluster, its report row estimates from its own rows.
        exact = np.concatenate(exact_parts)
        order = np.lexsort((exact[:, 1], exact[:, 0]))  # stable: an exact group's first document comes first
        ordered = exact[order]
        repeats[order[1:]] = (ordered[1:] == ordered[:-1]).all(axis=1)
    if params:
        keys = np.concatenate(key_parts) if key_parts else np.zeros((0, params.bands), np.uint64)
        keys[repeats] = NO_BUCKET
        # (bands, docs) raw little-endian uint64: each bucket unit reads its bands' rows at a known offset, with
        # no header to parse (20 bands x every shard would parse thousands of .npy headers).
        atomic_write_bytes(
            plan_.work / "signatures" / f"{unit:05d}.bands",
            np.ascontiguousarray(keys.T, dtype="<u8").tobytes(),
            durable=False,
        )
    if params and not plan_.config.verify:
        # (docs, num_perm) raw little-endian uint32, written batch by batch: the components stage maps the file
        # and reads only the rows of candidate pairs and removed documents. Verifying, it recomputes those rows
        # from the shingle hashes below instead: cheaper than writing every document's signature.
        atomic_write_parts(
            plan_.work / "signatures" / f"{unit:05d}.signatures",
            [np.ascontiguousarray(part, "<u4") for part in signature_parts],
            durable=False,
        )
    if params and plan_.config.verify:
        counts = np.concatenate(shingle_counts) if shingle_counts else np.zeros(0, np.int64)
        _atomic_save(
            plan_.work / "signatures" / f"{unit:05d}.shingle_offsets.npy",
            np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        )
    _write_table(plan_.work / "signatures" / f"{unit:05d}.parquet", table)
    if keep:
        plan_.decoded[file_index], plan_.decoded_room = kept, plan_.decoded_room - kept_bytes
    return {"rows": table.num_rows}


# ---------------------------------------------------------------------------------------------------------------
# Stage 2: buckets


def bucket_unit(plan_: DedupPlan, unit: int, report: Report) -> dict:
    """The candidate pairs of the unit's bands (`DedupPlan.bucket_bands`), band after band in one file."""
    bands, pieces = plan_.bucket_bands(unit), []
    rows = [
        _band_rows(plan_.work / "signatures" / f"{u:05d}.bands", bands, plan_.config.minhash.bands, source.file_rows[i])
        for u, (source, i) in enumerate(plan_.units)
    ]
    for band in range(len(bands)):
        keys = np.concatenate([r[band] for r in rows])
        matchable = np.flatnonzero(keys != NO_BUCKET)  # the documents, by their position in the run
        pairs = bucket_pairs(keys[matchable], matchable)
        # Pairs inside the reference are never removed, so they need no verification (pairs are i < j).
        pieces.append(pairs[(pairs >> np.uint64(32)) < np.uint64(plan_.source.num_rows)])
        report("buckets", 1)
    pairs = np.concatenate(pieces)
    _atomic_save(plan_.work / "buckets" / f"{unit:05d}.npy", pairs)
    return {"pairs": len(pairs)}


# ---------------------------------------------------------------------------------------------------------------
# Stage 3: components


def components_unit(plan_: DedupPlan, unit: int, report: Report) -> dict:
    config, n_input = plan_.config, plan_.source.num_rows
    columns = (
        ["id", "null"]
        + (["chars"] if config.keep == "longest" else [])
        + (["exact_hi", "exact_lo"] if config.exact else [])
    )
    table = pa.concat_tables(
        read_parquet(plan_.work / "signatures" / f"{u:05d}.parquet", columns) for u in range(len(plan_.units))
    )
    ids = table.column("id")
    if not plan_.ids_checked:
        check_unique_ids(ids.slice(0, n_input), plan_.source, plan_.id_column)
        check_reference_ids(plan_)
    null = to_numpy_filled(table.column("null"))
    edges = [np.zeros((0, 2), np.int64)]
    exact = (
        np.stack([to_numpy_filled(table.column("exact_hi")), to_numpy_filled(table.column("exact_lo"))], 1)
        if config.exact
        else None
    )
    representative = np.arange(len(null))
    if exact is not None:
        edges.append(exact_edges(exact, null, n_input))
        representative[edges[-1][:, 1]] = edges[-1][:, 0]
    stats = {"candidate_pairs": 0, "verified_pairs": 0}
    if config.minhash:
        pairs = sorted_unique(
            np.concatenate(
                [
                    read_work_file(plan_.work / "buckets" / f"{u:05d}.npy", np.load)
                    for u in range(plan_.unit_count("buckets"))
                ]
            )
        )
        accepted, stats = verify_pairs(plan_, pairs, report, representative)
        edges.append(accepted)
    edges = np.concatenate(edges)
    chars = to_numpy_filled(table.column("chars")) if config.keep == "longest" else None
    removed = choose_kept(edges, n_input, chars, config.keep)
    same_text = np.zeros(len(removed), bool)
    if exact is not None:
        same_text = np.all(exact[removed[:, 0]] == exact[removed[:, 1]], axis=1)
    similarity = np.ones(len(removed))
    if config.minhash:
        # Exact copies are reported as 1: their signatures are recomputed only for the near duplicates.
        near = ~same_text
        similarity[near] = estimated_jaccard(plan_, removed[near, 0], removed[near, 1])
    report_table = removal_report(removed, ids, same_text, similarity)
    _write_table(plan_.work / "components" / "removed.parquet", report_table)
    reasons = report_table.column("reason").to_pylist()
    return {
        "documents": n_input,
        "null_text": int(null[:n_input].sum()),
        "exact_removed": reasons.count("exact"),
        "near_removed": reasons.count("minhash"),
        "clusters": len(set(report_table.column("cluster").to_pylist())),
        "bytes": _input_bytes(plan_),
        **stats,
    }


def _input_bytes(plan_: DedupPlan) -> int:
    return sum(
        int(to_numpy_filled(read_parquet(plan_.work / "signatures" / f"{u:05d}.parquet", ["bytes"]).column(0)).sum())
        for u in range(len(plan_.source.files))
    )


def check_reference_ids(plan_: DedupPlan) -> None:
    """The reference's own ids name the kept document of report rows: unique and not null, as the input's."""
    if plan_.reference_id_column:
        ids = [chunk for i in range(len(plan_.reference.files)) for chunk in id_chunks(plan_, i, plan_.reference)]
        check_unique_ids(pa.chunked_array(ids, pa.string()), plan_.reference, plan_.reference_id_column, reference=True)


def check_unique_ids(ids: pa.ChunkedArray, source, id_column: str | None, reference: bool = False) -> None:
    """The ids of `source`, the input or the reference (in its order), must be unique and not null; the error
    names where the first bad one is."""
    if id_column is None:
        return
    nulls = ids.null_count
    if nulls:
        first = int(np.argmax(to_numpy_filled(compute("is_null", ids))))
        raise UserError(
            source.spec,
            f"column '{id_column}' has {nulls} null id(s), the first at {_place(source, first)}",
            f"give every document an id, or pass --id-column {POSITIONAL_IDS} to name documents by shard and row",
        )
    if len(compute("unique", ids)) == len(ids):  # a hash set alone: half the time of counting every id
        return
    counts = compute("value_counts", ids)
    repeated = np.flatnonzero(to_numpy_filled(counts.field("counts")) > 1)
    if len(repeated):
        first = counts[int(repeated[0])].as_py()
        at = np.flatnonzero(to_numpy_filled(compute("equal", ids, strings([first["values"]])[0])))[:2]
        # --id-column picks the input's column; the reference's is always its `id`.
        other_column = "pass " if reference else "pass --id-column with a unique column, or "
        raise UserError(
            source.spec,
            f"column '{id_column}' holds {len(repeated)} repeated id(s), e.g. {first['values']!r} x{first['counts']} "
            f"(at {_place(source, int(at[0]))} and {_place(source, int(at[1]))})",
            f"make ids unique, {other_column}--id-column {POSITIONAL_IDS} to name documents by shard and row",
        )


def _place(source, document: int) -> str:
    """Where an input document is, as a reader finds it: its file (under the input folder) and row."""
    ends = np.cumsum(source.file_rows)
    file = int(np.searchsorted(ends, document, side="right"))
    path = source.files[file]
    folder = Path(source.folder).absolute() if source.folder else None  # the files are absolute
    shown = path.relative_to(folder) if folder and path.is_relative_to(folder) else path
    return f"{shown} row {document - (ends[file] - source.file_rows[file])}"


def id_chunks(plan_: DedupPlan, file_index: int, source: DocumentSource | None = None) -> list[pa.Array]:
    """The ids of one file of the input (or of `source`, the reference) as text."""
    source = source or plan_.source
    column = plan_.id_column if source is plan_.source else plan_.reference_id_column
    return [
        id_strings(batch.column(0), source.files[file_index], column)
        for batch in source.iter_file_batches(file_index, [column], 65536, threads=False)
    ]


def id_strings(ids: pa.Array, file: Path, column: str) -> pa.Array:
    """The ids as text (the plan checked that the column's type casts); binary ids must be UTF-8."""
    try:
        return cast(ids, pa.string())
    except pa.ArrowInvalid as exc:
        raise UserError(file, f"column '{column}' holds ids that are not UTF-8 text ({exc})", ID_FIX) from None


def estimated_jaccard(plan_: DedupPlan, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """The MinHash estimate for each pair of global documents (left[k], right[k]), from the signature rows of
    just those documents."""
    return estimate_jaccard(*pair_signatures(plan_, left, right))


def pair_signatures(plan_: DedupPlan, left: np.ndarray, right: np.ndarray) -> tuple[np.ndarray, ...]:
    """(signature rows of the documents of the pairs (left[k], right[k]), each pair's left row, its right row)."""
    docs = sorted_unique(np.concatenate([left, right]).astype(np.int64))
    return signatures_of(plan_, docs), np.searchsorted(docs, left), np.searchsorted(docs, right)


def signatures_of(plan_: DedupPlan, docs: np.ndarray) -> np.ndarray:
    """(len(docs), num_perm) signature rows of the given sorted global documents, in their order: recomputed
    from their kept shingle hashes when verifying, else read from the raw files the signatures stage wrote
    (memory-mapped: only these rows are read)."""
    params, num_perm = plan_.config.minhash, plan_.config.minhash.num_perm
    if plan_.config.verify:
        # Unit by unit: only one unit's share of the documents' hashes is gathered at a time.
        rows = [
            signatures(*_unit_shingles(path, wanted), params.permutations())
            for path, _, wanted in _rows_by_unit(plan_, docs, "shingles")
        ]
        return np.concatenate(rows) if rows else np.zeros((0, num_perm), np.uint32)
    rows = [
        np.memmap(
            _checked_size(path, num_perm * 4 * count, f"{num_perm} x 4-byte values x {count} documents"),
            dtype="<u4",
            mode="r",
            shape=(count, num_perm),
        )[wanted]
        for path, count, wanted in _rows_by_unit(plan_, docs, "signatures")
    ]
    return np.concatenate(rows) if rows else np.zeros((0, num_perm), np.uint32)


def _rows_by_unit(plan_: DedupPlan, docs: np.ndarray, suffix: str):
    """(path of the unit's `suffix` work file, the unit's document count, the unit's rows among the sorted
    global `docs`) for each unit holding any of them, in order."""
    start = 0
    for unit, (source, file_index) in enumerate(plan_.units):
        count = source.file_rows[file_index]
        low, high = np.searchsorted(docs, [start, start + count])
        if high > low:
            yield plan_.work / "signatures" / f"{unit:05d}.{suffix}", count, docs[low:high] - start
        start += count


def exact_edges(exact: np.ndarray, null: np.ndarray, n_input: int) -> np.ndarray:
    """(k, 2) edges joining every document to the first one with the same normalised-text hash."""
    docs = np.flatnonzero(~null)
    # Documents grouped by their 128-bit hash, each group in document order. A stable sort on the first 64 bits
    # gives exactly that unless two different hashes share those bits (practically never, checked below); the
    # three-key lexsort it replaces took most of this function's time at a million documents.
    order = docs[np.argsort(exact[docs, 0], kind="stable")]
    ordered = exact[order]
    first_half_ties = ordered[1:, 0] == ordered[:-1, 0]
    if (ordered[1:, 1][first_half_ties] != ordered[:-1, 1][first_half_ties]).any():
        order = docs[np.lexsort((docs, exact[docs, 1], exact[docs, 0]))]
        ordered = exact[order]
    if len(order) < 2:
        return np.zeros((0, 2), np.int64)
    same = np.all(ordered[1:] == ordered[:-1], axis=1)
    head_position = np.maximum.accumulate(np.where(np.concatenate([[True], ~same]), np.arange(len(order)), 0))
    member = np.flatnonzero(np.concatenate([[False], same]))
    edges = np.stack([order[head_position[member]], order[member]], 1)
    # Reference documents among themselves are never removed: only edges touching the input matter.
    return edges[(edges < n_input).any(axis=1)]


def verify_pairs(
    plan_: DedupPlan, pairs: np.ndarray, report: Report, representative: np.ndarray | None = None
) -> tuple[np.ndarray, dict]:
    """Accepted candidate pairs as (k, 2) edges: settled by the signature estimate far from the threshold,
    by the exact Jaccard of the shingle sets in between (or by the estimate alone without verification).

    `representative` maps each document to the first of its exact-duplicate group (already joined by exact
    edges): exact duplicates have the same shingle set, so a pair is decided once per pair of groups, and pairs
    inside one group not at all; the components are the same.
    """
    params, candidates = plan_.config.minhash, len(pairs)
    report("verify", 0, total=candidates)
    if representative is not None and len(pairs):
        low = representative[(pairs >> np.uint64(32)).astype(np.int64)].astype(np.uint64)
        high = representative[(pairs & np.uint64(0xFFFFFFFF)).astype(np.int64)].astype(np.uint64)
        pairs = sorted_unique((np.minimum(low, high) << np.uint64(32)) | np.maximum(low, high))
        pairs = pairs[(pairs >> np.uint64(32)) != (pairs & np.uint64(0xFFFFFFFF))]
        report("verify", candidates - len(pairs))
    left = (pairs >> np.uint64(32)).astype(np.int64)
    right = (pairs & np.uint64(0xFFFFFFFF)).astype(np.int64)
    sigs, left_row, right_row = pair_signatures(plan_, left, right)
    estimate = estimate_jaccard(sigs, left_row, right_row)
    if not plan_.config.verify:
        accept = estimate >= params.threshold
        report("verify", len(pairs))
        return np.stack([left[accept], right[accept]], 1), {"candidate_pairs": candidates, "verified_pairs": 0}
    margin = settle_margin(params.threshold, params.num_perm)
    accept = estimate >= params.threshold + margin
    # The estimate compares 32-bit keys, which two different shingles share once in 2^32 pairs: rare, but one
    # such collision raises the Jaccard of sets of n shingles by up to 2 / (n - 1), which decides the verdict of
    # the shortest documents (two unrelated five-word titles would score 1.0). A pair is accepted unverified only
    # if its estimate clears the margin without that much.
    behind = keys_behind(sigs, params.permutations())
    keys = np.maximum(np.maximum(behind[left_row], behind[right_row]), 2)  # one key each: a rise of up to 2
    decisive_collision = estimate - 2 / (keys - 1) < params.threshold + margin
    grey = np.flatnonzero((estimate > params.threshold - margin) & (~accept | decisive_collision))
    report("verify", len(pairs) - len(grey))
    docs = sorted_unique(np.concatenate([left[grey], right[grey]]))
    values, bounds = shingle_sets_of(plan_, docs)
    similarity = jaccard_many(values, bounds, np.searchsorted(docs, left[grey]), np.searchsorted(docs, right[grey]))
    accept[grey] = similarity >= params.threshold
    report("verify", len(grey))
    return np.stack([left[accept], right[accept]], 1), {"candidate_pairs": candidates, "verified_pairs": len(grey)}


def shingle_sets_of(plan_: DedupPlan, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Shingle sets (values, bounds) of the given sorted global documents, in their order."""
    return sorted_sets(*kept_shingles(plan_, docs))


def kept_shingles(plan_: DedupPlan, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The shingle hashes (values, offsets) of the given sorted global documents, in their order, from the
    signatures stage's files (memory-mapped: only these are read)."""
    hashes, offsets = [], [np.zeros(1, np.int64)]
    for path, _, wanted in _rows_by_unit(plan_, docs, "shingles"):
        unit_hashes, unit_offsets = _unit_shingles(path, wanted)
        hashes.append(unit_hashes)
        offsets.append(unit_offsets[1:] + offsets[-1][-1])
    return np.concatenate(hashes) if hashes else np.zeros(0, np.uint64), np.concatenate(offsets)


def _unit_shingles(path: Path, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The shingle hashes (values, offsets) of one unit's `wanted` documents (its rows, sorted), from its work
    files (memory-mapped: only these are read)."""
    unit_offsets = read_work_file(path.with_suffix(".shingle_offsets.npy"), lambda p: np.load(p, mmap_mode="r"))
    unit_hashes = read_work_file(path, functools.partial(_mapped_hashes, count=int(unit_offsets[-1])))
    begin, counts = unit_offsets[wanted], unit_offsets[wanted + 1] - unit_offsets[wanted]
    index = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts - begin, counts)
    return np.asarray(unit_hashes[index]), np.concatenate([[0], np.cumsum(counts)])


def choose_kept(edges: np.ndarray, n_input: int, chars: np.ndarray | None, keep: str) -> np.ndarray:
    """(removed, kept) global index pairs, sorted by the removed document.

    One document survives per connected component: a reference document if the component has one (the
    first), else the first input document, or with keep='longest' the longest one (ties: the first).
    """
    if len(edges) == 0:
        return np.zeros((0, 2), np.int64)
    nodes, root = connected_components(edges[:, 0], edges[:, 1])
    is_input = nodes < n_input
    length_rank = np.where(is_input, -chars[nodes], 0) if keep == "longest" else np.zeros(len(nodes), np.int64)
    order = np.lexsort((nodes, length_rank, is_input, root))
    first = np.concatenate([[True], root[order][1:] != root[order][:-1]])
    keeper = nodes[order][np.maximum.accumulate(np.where(first, np.arange(len(order)), 0))]
    removed = ~first & is_input[order]
    pairs = np.stack([nodes[order][removed], keeper[removed]], 1)
    return pairs[np.argsort(pairs[:, 0], kind="stable")]


def removal_report(
    removed: np.ndarray, ids: pa.ChunkedArray, same_text: np.ndarray, similarity: np.ndarray
) -> pa.Table:
    """One row per removed document: its index and id, the kept id, a cluster number, the reason (`same_text`:
    an exact copy of the kept document, else a near duplicate) and the pair's `similarity` (1 for exact copies,
    else the MinHash estimate, 1 without MinHash).

    Clusters are numbered by their kept document's position, so the numbers depend on the data only.
    """
    doc, kept = removed[:, 0], removed[:, 1]
    _, cluster = sorted_unique(kept, return_inverse=True)
    doc, kept = from_numpy(doc.astype(np.int64)), from_numpy(kept.astype(np.int64))
    return pa.table(
        {
            "index": doc,
            "id": compute("take", ids, doc),
            "duplicate_of": compute("take", ids, kept),
            "cluster": from_numpy(cluster.astype(np.int64)),
            "reason": strings(np.where(same_text, "exact", "minhash").tolist()),
            "jaccard": from_numpy(similarity.astype(np.float32)),
        }
    )


# ---------------------------------------------------------------------------------------------------------------
# Stage 4: filter


def filter_unit(plan_: DedupPlan, unit: int, report: Report) -> dict:
    start = sum(plan_.source.file_rows[:unit])
    removed = to_numpy_filled(read_parquet(plan_.work / "components" / "removed.parquet", ["index"]).column(0))
    local = removed[(removed >= start) & (removed < start + plan_.source.file_rows[unit])] - start
    path = plan_.work / "filter" / f"{unit:05d}.parquet"
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    writer, offset, kept = None, 0, 0
    check_unchanged(plan_, plan_.source, unit)
    batches = plan_.decoded.pop(unit, None)
    if batches is None:
        # The signatures stage read and checked the text and ids of this file (check_unchanged: the same file).
        checked = [plan_.config.text_column] + ([plan_.id_column] if plan_.id_column else [])
        batches = plan_.source.iter_file_batches(unit, None, BATCH_ROWS, threads=False, validated=checked)
    with _removed_on_failure(tmp):
        for batch in batches:
            mask = np.ones(batch.num_rows, bool)
            mask[local[(local >= offset) & (local < offset + batch.num_rows)] - offset] = False
            offset += batch.num_rows
            if mask.any():
                # Dictionary encoding is only ever a wasted attempt on a column of documents.
                writer = writer or pq.ParquetWriter(
                    tmp,
                    batch.schema,
                    compression="zstd",
                    use_dictionary=[n for n in batch.schema.names if n != plan_.config.text_column],
                )
                writer.write_batch(compute("filter", batch, from_numpy(mask)))
                kept += int(mask.sum())
            report("filter", batch.num_rows)
        if writer is not None:
            writer.close()
            check_unchanged(plan_, plan_.source, unit)  # rewritten while it was read
    if writer is None:
        return {"kept": kept}
    os.replace(tmp, path)
    return {"kept": kept, "bytes": path.stat().st_size}


def check_unchanged(plan_: DedupPlan, source, file_index: int) -> None:
    """A shard must still be the file the run was planned on (path, size, modification time): rewritten, its rows
    would no longer be the documents the signatures and removals were computed from."""
    key = "input_files" if source is plan_.source else "reference_files"
    if file_identity([source.files[file_index]])[0] != plan_.area.fingerprint[key][file_index]:
        raise UserError(
            source.files[file_index],
            "changed while dedup was running (its size or modification time)",
            "let whatever writes the input finish, then re-run dedup with --overwrite",
        )


# ---------------------------------------------------------------------------------------------------------------
# Shared small helpers


def _write_table(path: Path, table: pa.Table) -> None:
    """Work files are uncompressed and plain: hashes neither compress nor repeat, so zstd and dictionary
    encoding would only burn CPU on them."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with _removed_on_failure(tmp), _refused_as_a_write(path):
        pq.write_table(table, tmp, compression="none", use_dictionary=False)
        os.replace(tmp, path)


def read_parquet(path: Path, columns: list[str] | None = None) -> pa.Table:
    """A whole parquet file, in this thread (pq.read_table goes through pyarrow.dataset, a slow import)."""
    return pq.ParquetFile(path).read(columns, use_threads=False)


def _band_rows(path: Path, wanted: range, bands: int, rows: int) -> np.ndarray:
    """Rows `wanted` of a shard's (bands, documents) keys: one read, as the file holds them band after band."""
    _checked_size(path, bands * rows * 8, f"{bands} bands x {rows} documents")
    keys = np.fromfile(path, dtype="<u8", count=rows * len(wanted), offset=wanted.start * rows * 8)
    return keys.reshape(len(wanted), rows)


def _checked_size(path: Path, size: int, layout: str) -> Path:
    if path.stat().st_size != size:
        raise UserError(
            path,
            f"holds {path.stat().st_size} bytes, not {layout}",
            "the work area was changed by hand; re-run with --overwrite",
        )
    return path


def _npy_header(dtype, length: int) -> bytes:
    """The .npy header np.save writes for a 1-D array of `length` values of `dtype` (native byte order)."""
    header = io.BytesIO()
    descr = np.lib.format.dtype_to_descr(np.dtype(dtype))
    np.lib.format.write_array_header_1_0(header, {"descr": descr, "fortran_order": False, "shape": (length,)})
    return header.getvalue()


def _atomic_save(path: Path, array: np.ndarray) -> None:
    """A 1-D array as the .npy file np.save writes, atomically (a refused write leaves no temporary copy)."""
    atomic_write_parts(path, [_npy_header(array.dtype, len(array)), np.ascontiguousarray(array)], durable=False)


@contextmanager
def _written_as_they_come(path: Path | None) -> Iterator[Callable[[np.ndarray], None]]:
    """A work file of uint64 values (raw, little-endian) written array by array as a unit makes them, and
    renamed into place once the unit is through; with no path, the arrays are dropped."""
    if path is None:
        yield lambda values: None
        return
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with _removed_on_failure(tmp):
        # Only the file's own calls count as refused writes: the caller's work between them reads its shard.
        with _refused_as_a_write(path):
            handle = open(tmp, "wb")  # noqa: SIM115 (closed below, where its last flush is guarded too)

        def write(values: np.ndarray) -> None:
            with _refused_as_a_write(path):
                handle.write(np.ascontiguousarray(values, "<u8"))

        try:
            yield write
        finally:
            with _refused_as_a_write(path):
                handle.close()
        with _refused_as_a_write(path):
            os.replace(tmp, path)


@contextmanager
def _refused_as_a_write(path: Path) -> Iterator[None]:
    """The file system's refusal (a full disk, a quota) as the WriteRefused atomic_write_parts raises: the
    finished units are kept for a resume."""
    try:
        yield
    except OSError as exc:
        raise write_refused(path, exc) from exc


def _mapped_hashes(path: Path, count: int) -> np.ndarray:
    """A raw file of `count` uint64 values (_written_as_they_come), memory-mapped."""
    if path.stat().st_size != 8 * count:
        raise ValueError(f"{path.stat().st_size} bytes, not {count} 8-byte values")
    return np.memmap(path, dtype="<u8", mode="r") if count else np.zeros(0, np.uint64)


@contextmanager
def _removed_on_failure(tmp: Path) -> Iterator[None]:
    """A work file's temporary copy goes if writing it fails: on a full disk it would hold on to the space the
    resumed run needs."""
    try:
        yield
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise

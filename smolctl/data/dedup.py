"""Exact and MinHash near-duplicate removal over dataset shards, as four restartable stages.

    smolctl dedup data/sample/web out/web --minhash

1. signatures  (one unit per input/reference shard): normalised-text hash, MinHash signature, band keys
2. buckets     (one unit per band): candidate pairs among documents sharing that band's key
3. components  (one unit): verify candidates (exact Jaccard in the grey zone), union-find with exact groups,
               one kept document per component
4. filter      (one unit per input shard): drop the removed rows; the task that completes the set assembles
               OUTPUT (kept documents + duplicates/ report + manifest) and commits it atomically

Intermediates live in OUTPUT/_work/<stage>/, each unit finished by an atomic `.done` marker, so any split of
units into Slurm array tasks (`--tasks N --task-id I`), a local process pool, or a re-run after a kill gives
the same bytes: documents are identified by their global position (input shards in order, then reference
shards), and every choice (kept document, cluster number, report order) is a function of that order only.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from smolctl.data import minhash
from smolctl.data.minhash import MinHashParams
from smolctl.errors import UserError
from smolctl.shards import (KIND_DOCUMENTS, MANIFEST_NAME, DatasetWriter, DocumentSource, OutputFolder,
                            atomic_write_json, check_output_path, open_documents, schema_to_dict)

STAGES = ("signatures", "buckets", "components", "filter")
KEEP_POLICIES = ("first", "longest")
WORK = "_work"
BATCH_ROWS = 4096
DUPLICATES_SCHEMA = pa.schema([("id", pa.string()), ("duplicate_of", pa.string()), ("cluster", pa.int64()),
                               ("reason", pa.string()), ("jaccard", pa.float32())])
# report(stage, advance, total=None): progress of a stage; a total is announced once it is known.
Report = Callable[..., None]
NO_BUCKET = np.uint64(0)


@dataclass(frozen=True)
class DedupConfig:
    """What to deduplicate and how; everything here is recorded in the work area and the output manifest."""

    input: str
    output: str
    exact: bool = True
    """Remove documents whose normalised text (NFKC, case-folded, whitespace collapsed) is identical."""
    minhash: MinHashParams | None = None
    """Near-duplicate removal parameters; None for exact dedup only."""
    verify: bool = True
    """Check candidate pairs by exact Jaccard of the shingle sets (estimate settles pairs far from the threshold)."""
    text_column: str = "text"
    id_column: str | None = None
    """Id column; None means 'id' when present, else ids are `shard:row`."""
    against: str | None = None
    """Reference dataset: remove INPUT documents that duplicate any of its documents; it is never changed."""
    keep: str = "first"
    """Which document of a cluster survives: the first in input order, or the longest (ties: first)."""
    overwrite: bool = False


@dataclass
class DedupResult:
    output: str
    stage: str
    finished: bool
    documents: int = 0
    null_text: int = 0
    exact_removed: int = 0
    near_removed: int = 0
    kept: int = 0
    clusters: int = 0
    candidate_pairs: int = 0
    verified_pairs: int = 0
    bytes: int = 0
    seconds: float = 0.0
    units_done: int = 0
    units_skipped: int = 0
    params: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------------
# The plan: validated inputs, units, work area


@dataclass
class Plan:
    config: DedupConfig
    source: DocumentSource
    reference: DocumentSource | None
    id_column: str | None
    work: Path

    @property
    def units(self) -> list[tuple[DocumentSource, int]]:
        """Signature units: every input shard, then every reference shard."""
        units = [(self.source, i) for i in range(len(self.source.files))]
        if self.reference is not None:
            units += [(self.reference, i) for i in range(len(self.reference.files))]
        return units

    def unit_count(self, stage: str) -> int:
        if stage == "signatures":
            return len(self.units)
        if stage == "buckets":
            return self.config.minhash.bands if self.config.minhash else 0
        return 1 if stage == "components" else len(self.source.files)

    def marker(self, stage: str, unit: int) -> Path:
        return self.work / stage / f"{unit:05d}.done"

    def done(self, stage: str) -> bool:
        return all(self.marker(stage, u).is_file() for u in range(self.unit_count(stage)))

    def fingerprint(self) -> dict:
        def files(src: DocumentSource | None) -> list:
            return [] if src is None else [[str(f.resolve()), f.stat().st_size, int(f.stat().st_mtime)] for f in src.files]

        return {"config": {k: v for k, v in asdict(self.config).items() if k not in ("overwrite", "output")},
                "input_files": files(self.source), "reference_files": files(self.reference)}


def plan(config: DedupConfig) -> Plan:
    """Check everything a run needs before any file is written; UserError on the first problem."""
    if not (config.exact or config.minhash):
        raise UserError("dedup", "both exact and MinHash dedup are off", "drop --no-exact or add --minhash")
    if config.keep not in KEEP_POLICIES:
        raise UserError("--keep", f"unknown policy {config.keep!r}", "use first or longest")
    source = open_documents(config.input)
    if source.num_rows == 0:
        raise UserError(config.input, "holds no documents", "pass a non-empty dataset")
    id_column = _resolve_ids(source, config)
    reference = None
    if config.against is not None:
        reference = open_documents(config.against)
        reference.require(text=[config.text_column])
        if Path(config.against).resolve() == Path(config.input).resolve():
            raise UserError("--against", "is the input itself", "pass a different reference dataset")
    output = Path(config.output)
    work = output / WORK
    only_work = output.is_dir() and {p.name for p in output.iterdir()} <= {WORK}
    if not only_work:
        check_output_path(output, config.overwrite)
    return Plan(config, source, reference, id_column, work)


def _resolve_ids(source: DocumentSource, config: DedupConfig) -> str | None:
    if config.id_column is not None:
        source.require(config.id_column, text=[config.text_column])
        return config.id_column
    source.require(text=[config.text_column])
    return "id" if "id" in source.columns else None


def check_work_area(plan_: Plan) -> None:
    """A work area left in OUTPUT must belong to a run with the same inputs and settings (or --overwrite)."""
    config_path = plan_.work / "config.json"
    if config_path.is_file() and json.loads(config_path.read_text()) != _fingerprint(plan_) and not plan_.config.overwrite:
        raise UserError(plan_.work, "holds an unfinished run with other inputs or settings",
                        "re-run with the original arguments, or pass --overwrite to start again")


def prepare_work_area(plan_: Plan) -> None:
    """Create OUTPUT/_work and record the run's fingerprint; an older run's area is cleared (--overwrite)."""
    config_path = plan_.work / "config.json"
    fingerprint = _fingerprint(plan_)
    if config_path.is_file():
        if json.loads(config_path.read_text()) == fingerprint:
            return
        shutil.rmtree(plan_.work)
    try:
        for stage in STAGES:
            (plan_.work / stage).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(plan_.config.output, f"cannot create the work area: {exc.strerror or exc}",
                        "check the path and its permissions") from exc
    atomic_write_json(config_path, fingerprint)


def _fingerprint(plan_: Plan) -> dict:
    return json.loads(json.dumps(plan_.fingerprint(), default=str))


def check_ready(plan_: Plan, stage: str) -> None:
    """A stage may start only when every unit of the stages before it has its marker."""
    for earlier in STAGES[:STAGES.index(stage)]:
        if not plan_.done(earlier):
            missing = sum(not plan_.marker(earlier, u).is_file() for u in range(plan_.unit_count(earlier)))
            raise UserError(f"--stage {stage}", f"the {earlier} stage has not finished ({missing} unit(s) missing under {plan_.work / earlier})",
                            f"run --stage {earlier} for every task first (or run without --stage)")


# ---------------------------------------------------------------------------------------------------------------
# Stage 1: signatures


def signature_unit(plan_: Plan, unit: int, report: Report) -> dict:
    source, file_index = plan_.units[unit]
    params = plan_.config.minhash
    id_column = plan_.id_column if source is plan_.source else ("id" if "id" in source.columns else None)
    columns = [plan_.config.text_column] + ([id_column] if id_column else [])
    shard_name = source.files[file_index].stem
    tables, band_keys, row = [], [], 0
    permutations = params.permutations() if params else None
    for batch in source.iter_file_batches(file_index, columns, BATCH_ROWS):
        texts = batch.column(plan_.config.text_column)
        python_texts = texts.to_pylist()
        normalized = [minhash.normalize(t) if t is not None else "" for t in python_texts]
        if id_column:
            ids = pc.cast(batch.column(id_column), pa.string())
        else:
            ids = pa.array([f"{shard_name}:{r}" for r in range(row, row + len(python_texts))], pa.string())
        columns_out = {"id": ids, "null": pc.is_null(texts), "chars": pc.fill_null(pc.utf8_length(texts), 0).cast(pa.int64()),
                       "bytes": pc.fill_null(pc.binary_length(texts), 0).cast(pa.int64())}
        tokens = minhash.tokenize(normalized)
        if plan_.config.exact:
            exact = minhash.exact_hashes(tokens)
            columns_out["exact_hi"], columns_out["exact_lo"] = exact[:, 0], exact[:, 1]
        if params:
            shingles, offsets = minhash.shingle_hashes(normalized, params.ngram, params.shingle, tokens)
            sigs = minhash.signatures(shingles, offsets, permutations)
            keys = minhash.band_keys(sigs, params.bands, params.rows)
            keys[np.diff(offsets) == 0] = NO_BUCKET  # documents without shingles (empty, null) match nothing
            band_keys.append(keys)
            columns_out["signature"] = pa.FixedSizeBinaryArray.from_buffers(
                pa.binary(sigs.shape[1] * 4), len(sigs), [None, pa.py_buffer(np.ascontiguousarray(sigs).tobytes())])
        tables.append(pa.table(columns_out))
        row += len(python_texts)
        report("signatures", len(python_texts))
    table = pa.concat_tables(tables)
    if params:
        # (bands, docs): each bucket task memory-maps its band's row instead of parsing a parquet column.
        _atomic_save(plan_.work / "signatures" / f"{unit:05d}.bands.npy",
                     np.ascontiguousarray(np.concatenate(band_keys).T) if band_keys else np.zeros((params.bands, 0), np.uint64))
    _write_table(plan_.work / "signatures" / f"{unit:05d}.parquet", table)
    return {"rows": table.num_rows}


# ---------------------------------------------------------------------------------------------------------------
# Stage 2: buckets


def bucket_unit(plan_: Plan, band: int, report: Report) -> dict:
    keys, docs, start = [], [], 0
    for unit in range(len(plan_.units)):
        band_keys = np.load(plan_.work / "signatures" / f"{unit:05d}.bands.npy", mmap_mode="r")[band]
        matchable = band_keys != NO_BUCKET
        keys.append(np.asarray(band_keys[matchable]))
        docs.append(np.arange(start, start + len(band_keys), dtype=np.int64)[matchable])
        start += len(band_keys)
    pairs = minhash.bucket_pairs(np.concatenate(keys), np.concatenate(docs))
    # Pairs inside the reference are never removed, so they need no verification.
    first_input_only = plan_.source.num_rows
    pairs = pairs[(pairs >> np.uint64(32)) < np.uint64(first_input_only)]
    _atomic_save(plan_.work / "buckets" / f"{band:05d}.npy", pairs)
    report("buckets", 1)
    return {"pairs": int(len(pairs))}


# ---------------------------------------------------------------------------------------------------------------
# Stage 3: components


def components_unit(plan_: Plan, unit: int, report: Report) -> dict:
    config, n_input = plan_.config, plan_.source.num_rows
    columns = ["id", "null", "chars"] + (["exact_hi", "exact_lo"] if config.exact else []) + (["signature"] if config.minhash else [])
    table = pa.concat_tables(pq.read_table(plan_.work / "signatures" / f"{u:05d}.parquet", columns=columns)
                             for u in range(len(plan_.units)))
    ids = table.column("id")
    _check_unique_ids(ids.slice(0, n_input), config.input, plan_.id_column)
    null = np.asarray(table.column("null"))
    edges = [np.zeros((0, 2), np.int64)]
    exact = np.stack([np.asarray(table.column("exact_hi")), np.asarray(table.column("exact_lo"))], 1) if config.exact else None
    if exact is not None:
        edges.append(exact_edges(exact, null, n_input))
    sigs, stats = None, {"candidate_pairs": 0, "verified_pairs": 0}
    if config.minhash:
        sigs = _signature_matrix(table.column("signature"), config.minhash.num_perm)
        pairs = np.unique(np.concatenate([np.load(plan_.work / "buckets" / f"{b:05d}.npy") for b in range(config.minhash.bands)]))
        accepted, stats = verify_pairs(plan_, pairs, sigs, report)
        edges.append(accepted)
    edges = np.concatenate(edges)
    removed = choose_kept(edges, n_input, np.asarray(table.column("chars")), config.keep)
    report_table = removal_report(removed, ids, exact, sigs)
    _write_table(plan_.work / "components" / "removed.parquet", report_table)
    reasons = report_table.column("reason").to_pylist()
    return {"documents": n_input, "null_text": int(null[:n_input].sum()), "exact_removed": reasons.count("exact"),
            "near_removed": reasons.count("minhash"), "clusters": len(set(report_table.column("cluster").to_pylist())),
            "bytes": _input_bytes(plan_), **stats}


def _input_bytes(plan_: Plan) -> int:
    return sum(int(pc.sum(pq.read_table(plan_.work / "signatures" / f"{u:05d}.parquet", columns=["bytes"]).column(0)).as_py() or 0)
               for u in range(len(plan_.source.files)))


def _check_unique_ids(ids: pa.ChunkedArray, where: str, id_column: str | None) -> None:
    if id_column is None:
        return
    nulls = ids.null_count
    if nulls:
        raise UserError(where, f"column '{id_column}' has {nulls} null id(s)", "give every document an id, or pass --id-column")
    counts = pc.value_counts(ids)
    repeated = pc.filter(counts, pc.greater(counts.field("counts"), 1))
    if len(repeated):
        first = repeated[0].as_py()
        raise UserError(where, f"column '{id_column}' holds {len(repeated)} repeated id(s), e.g. {first['values']!r} x{first['counts']}",
                        "make ids unique (or pass --id-column with a unique column)")


def _id_chunks(plan_: Plan, file_index: int) -> list[pa.Array]:
    return [pc.cast(batch.column(0), pa.string())
            for batch in plan_.source.iter_file_batches(file_index, [plan_.id_column], 65536)]


def _signature_matrix(column: pa.ChunkedArray, num_perm: int) -> np.ndarray:
    array = column.combine_chunks()
    width = num_perm * 4
    raw = np.frombuffer(array.buffers()[1], dtype=np.uint8)[array.offset * width:(array.offset + len(array)) * width]
    return raw.view(np.uint32).reshape(len(array), num_perm)


def exact_edges(exact: np.ndarray, null: np.ndarray, n_input: int) -> np.ndarray:
    """(k, 2) edges joining every document to the first one with the same normalised-text hash."""
    docs = np.flatnonzero(~null)
    order = docs[np.lexsort((docs, exact[docs, 1], exact[docs, 0]))]
    if len(order) < 2:
        return np.zeros((0, 2), np.int64)
    same = np.all(exact[order[1:]] == exact[order[:-1]], axis=1)
    head_position = np.maximum.accumulate(np.where(np.concatenate([[True], ~same]), np.arange(len(order)), 0))
    member = np.flatnonzero(np.concatenate([[False], same]))
    edges = np.stack([order[head_position[member]], order[member]], 1)
    # Reference documents among themselves are never removed: only edges touching the input matter.
    return edges[(edges < n_input).any(axis=1)]


def verify_pairs(plan_: Plan, pairs: np.ndarray, sigs: np.ndarray, report: Report) -> tuple[np.ndarray, dict]:
    """Accepted candidate pairs as (k, 2) edges: settled by the signature estimate far from the threshold,
    by the exact Jaccard of the shingle sets in between (or by the estimate alone without verification)."""
    params = plan_.config.minhash
    left = (pairs >> np.uint64(32)).astype(np.int64)
    right = (pairs & np.uint64(0xFFFFFFFF)).astype(np.int64)
    report("verify", 0, total=len(pairs))
    estimate = np.concatenate([minhash.estimate_jaccard(sigs[left[s:s + 65536]], sigs[right[s:s + 65536]])
                               for s in range(0, len(pairs), 65536)]) if len(pairs) else np.zeros(0)
    if not plan_.config.verify:
        accept = estimate >= params.threshold
        report("verify", len(pairs))
        return np.stack([left[accept], right[accept]], 1), {"candidate_pairs": len(pairs), "verified_pairs": 0}
    margin = minhash.settle_margin(params.threshold, params.num_perm)
    accept = estimate >= params.threshold + margin
    grey = np.flatnonzero((estimate > params.threshold - margin) & ~accept)
    report("verify", len(pairs) - len(grey))
    sets = shingle_sets_of(plan_, np.unique(np.concatenate([left[grey], right[grey]])))
    for k in grey:
        accept[k] = minhash.jaccard(sets[left[k]], sets[right[k]]) >= params.threshold
        report("verify", 1)
    return np.stack([left[accept], right[accept]], 1), {"candidate_pairs": len(pairs), "verified_pairs": len(grey)}


def shingle_sets_of(plan_: Plan, docs: np.ndarray) -> dict[int, np.ndarray]:
    """Shingle sets of the given global documents, re-read shard by shard (only the text column)."""
    params, sets, start = plan_.config.minhash, {}, 0
    for source, file_index in plan_.units:
        rows = source.file_rows[file_index]
        wanted = docs[(docs >= start) & (docs < start + rows)] - start
        offset = 0
        for batch in (source.iter_file_batches(file_index, [plan_.config.text_column], BATCH_ROWS) if len(wanted) else ()):
            local = wanted[(wanted >= offset) & (wanted < offset + batch.num_rows)]
            if len(local):
                texts = batch.column(0).take(pa.array(local - offset)).to_pylist()
                for row, shingles in zip(local, minhash.shingle_sets([minhash.normalize(t) for t in texts], params.ngram, params.shingle)):
                    sets[int(start + row)] = shingles
            offset += batch.num_rows
        start += rows
    return sets


def choose_kept(edges: np.ndarray, n_input: int, chars: np.ndarray, keep: str) -> np.ndarray:
    """(removed, kept) global index pairs, sorted by the removed document.

    One document survives per connected component: a reference document if the component has one (the
    first), else the first input document, or with keep='longest' the longest one (ties: the first).
    """
    if len(edges) == 0:
        return np.zeros((0, 2), np.int64)
    nodes, root = minhash.connected_components(edges[:, 0], edges[:, 1])
    is_input = nodes < n_input
    length_rank = np.where(is_input, -chars[nodes], 0) if keep == "longest" else np.zeros(len(nodes), np.int64)
    order = np.lexsort((nodes, length_rank, is_input, root))
    first = np.concatenate([[True], root[order][1:] != root[order][:-1]])
    keeper = nodes[order][np.maximum.accumulate(np.where(first, np.arange(len(order)), 0))]
    removed = ~first & is_input[order]
    pairs = np.stack([nodes[order][removed], keeper[removed]], 1)
    return pairs[np.argsort(pairs[:, 0], kind="stable")]


def removal_report(removed: np.ndarray, ids: pa.ChunkedArray, exact: np.ndarray | None, sigs: np.ndarray | None) -> pa.Table:
    """One row per removed document: its index and id, the kept id, a cluster number, the reason, the Jaccard.

    Clusters are numbered by their kept document's position, so the numbers depend on the data only.
    """
    doc, kept = removed[:, 0], removed[:, 1]
    _, cluster = np.unique(kept, return_inverse=True)
    same_text = np.all(exact[doc] == exact[kept], axis=1) if exact is not None else np.zeros(len(doc), bool)
    if sigs is not None:
        similarity = np.where(same_text, 1.0, minhash.estimate_jaccard(sigs[doc], sigs[kept]) if len(doc) else 0.0)
    else:
        similarity = np.ones(len(doc))
    return pa.table({"index": pa.array(doc, pa.int64()), "id": ids.take(pa.array(doc, pa.int64())),
                     "duplicate_of": ids.take(pa.array(kept, pa.int64())), "cluster": pa.array(cluster, pa.int64()),
                     "reason": pa.array(np.where(same_text, "exact", "minhash").tolist(), pa.string()),
                     "jaccard": pa.array(similarity, pa.float32())})


# ---------------------------------------------------------------------------------------------------------------
# Stage 4: filter, then assembly of OUTPUT


def filter_unit(plan_: Plan, unit: int, report: Report) -> dict:
    start = sum(plan_.source.file_rows[:unit])
    removed = np.asarray(pq.read_table(plan_.work / "components" / "removed.parquet", columns=["index"]).column(0))
    local = removed[(removed >= start) & (removed < start + plan_.source.file_rows[unit])] - start
    path = plan_.work / "filter" / f"{unit:05d}.parquet"
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    writer, offset, kept = None, 0, 0
    for batch in plan_.source.iter_file_batches(unit, None, BATCH_ROWS):
        mask = np.ones(batch.num_rows, bool)
        mask[local[(local >= offset) & (local < offset + batch.num_rows)] - offset] = False
        offset += batch.num_rows
        if mask.any():
            writer = writer or pq.ParquetWriter(tmp, batch.schema, compression="zstd")
            writer.write_batch(batch.filter(pa.array(mask)))
            kept += int(mask.sum())
        report("filter", batch.num_rows)
    if writer is not None:
        writer.close()
        os.replace(tmp, path)
    return {"kept": kept}


def assemble(plan_: Plan, stats: dict) -> dict:
    """Link the filtered shards into a staging folder, write duplicates/ and the manifest, swap into place."""
    config = plan_.config
    inputs = plan_.source.lineage() + (plan_.reference.lineage() if plan_.reference else [])
    with OutputFolder(config.output, kind=KIND_DOCUMENTS, overwrite=True, inputs=inputs) as folder:
        for unit in range(len(plan_.source.files)):
            piece = plan_.work / "filter" / f"{unit:05d}.parquet"
            if piece.is_file():
                name = f"part-{len(folder.shards):05d}.parquet"
                _link_or_copy(piece, folder.file(name))
                folder.add_shard(name, pq.read_metadata(folder.file(name)).num_rows)
        removed = pq.read_table(plan_.work / "components" / "removed.parquet").drop_columns(["index"])
        with OutputFolder(folder.file("duplicates"), kind=KIND_DOCUMENTS, inputs=[]) as report_folder:
            writer = DatasetWriter(report_folder, schema=DUPLICATES_SCHEMA)
            writer.write(removed.cast(DUPLICATES_SCHEMA))
            writer.close()
            report_folder.commit(schema=schema_to_dict(DUPLICATES_SCHEMA), stats={"removed": removed.num_rows})
        return folder.commit(schema=schema_to_dict(plan_.source.schema), stats=stats, dedup=_settings(plan_))


def _settings(plan_: Plan) -> dict:
    config = plan_.config
    return {"exact": config.exact, "minhash": asdict(config.minhash) if config.minhash else None, "verify": config.verify,
            "keep": config.keep, "text_column": config.text_column, "id_column": plan_.id_column or "shard:row",
            "against": str(Path(config.against).resolve()) if config.against else None}


def _link_or_copy(src: Path, dst: Path) -> None:
    """A hard link keeps the work area intact until the commit: a crash here loses nothing."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


# ---------------------------------------------------------------------------------------------------------------
# Running stages: in this process, in a local pool, or as one task of a Slurm array


UNIT_RUNNERS = {"signatures": signature_unit, "buckets": bucket_unit, "components": components_unit, "filter": filter_unit}


def run(config: DedupConfig, *, stage: str | None = None, tasks: int = 1, task_id: int = 0, workers: int = 1,
        report: Report = lambda stage, advance, total=None: None) -> DedupResult:
    """Run every stage (stage=None) or one stage's share for task `task_id` of `tasks`; skip finished units.

    The output is committed by whichever call completes the last filter unit; `finished` says if this one did.
    """
    started = time.perf_counter()
    if stage is not None and stage not in STAGES:
        raise UserError("--stage", f"unknown stage {stage!r}", f"use one of {', '.join(STAGES)}")
    if tasks < 1 or not 0 <= task_id < tasks:
        raise UserError("--task-id", f"{task_id} is out of range for --tasks {tasks}", f"use 0 to {max(tasks, 1) - 1} (e.g. $SLURM_ARRAY_TASK_ID with --array=0-{max(tasks, 1) - 1})")
    if stage == "components" and tasks != 1:
        raise UserError("--tasks", "the components stage is a single task", "run it with --tasks 1 --task-id 0")
    plan_ = plan(config)
    if stage is None:
        # Locally the ids are checked before anything is written; an array checks them in the components task.
        _check_unique_ids(pa.chunked_array([c for i in range(len(plan_.source.files)) for c in _id_chunks(plan_, i)], pa.string())
                          if plan_.id_column else None, config.input, plan_.id_column)
    check_work_area(plan_)
    stages = STAGES if stage is None else (stage,)
    if stage is not None:
        check_ready(plan_, stage)
    prepare_work_area(plan_)
    done = skipped = 0
    for name in stages:
        mine = [u for u in range(plan_.unit_count(name)) if u % tasks == task_id]
        todo = [u for u in mine if not plan_.marker(name, u).is_file()]
        report(name, 0, total=_stage_total(plan_, name, todo))
        skipped += len(mine) - len(todo)
        _run_units(plan_, name, todo, workers, report)
        done += len(todo)
    result = DedupResult(output=str(config.output), stage=stage or "all", finished=False, units_done=done,
                         units_skipped=skipped, params=_settings(plan_))
    if plan_.done("filter"):
        stats = _final_stats(plan_)
        manifest = _assemble_once(plan_, stats)
        result.finished = manifest is not None
        for key, value in stats.items():
            setattr(result, key, value)
    result.seconds = time.perf_counter() - started
    return result


def _stage_total(plan_: Plan, stage: str, units: list[int]) -> int:
    """Progress units: documents for the shard stages, bands for buckets, nothing for components (verify has its own)."""
    if stage == "signatures":
        return sum(source.file_rows[i] for source, i in (plan_.units[u] for u in units))
    if stage == "filter":
        return sum(plan_.source.file_rows[u] for u in units)
    return len(units) if stage == "buckets" else 0


def _final_stats(plan_: Plan) -> dict:
    components = json.loads(plan_.marker("components", 0).read_text())
    kept = sum(json.loads(plan_.marker("filter", u).read_text())["kept"] for u in range(plan_.unit_count("filter")))
    keys = ("documents", "null_text", "exact_removed", "near_removed", "clusters", "candidate_pairs", "verified_pairs", "bytes")
    stats = {k: components[k] for k in keys} | {"kept": kept}
    if stats["documents"] != kept + stats["exact_removed"] + stats["near_removed"]:
        raise RuntimeError(f"dedup accounting broken: {stats}")
    return stats


def _assemble_once(plan_: Plan, stats: dict) -> dict | None:
    """Commit OUTPUT unless another task holds the assembly lock; a lock left by a dead process is taken over."""
    lock = plan_.work / "assemble.lock"
    owner = {"host": socket.gethostname(), "pid": os.getpid()}
    try:
        handle = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        holder = json.loads(lock.read_text() or "{}")
        if holder.get("host") == owner["host"] and not _alive(holder.get("pid", -1)):
            lock.unlink(missing_ok=True)
            return _assemble_once(plan_, stats)
        return None
    with os.fdopen(handle, "w") as out:
        json.dump(owner, out)
    try:
        return assemble(plan_, stats)
    except BaseException:
        lock.unlink(missing_ok=True)
        raise


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid > 0


def _run_units(plan_: Plan, stage: str, units: list[int], workers: int, report: Report) -> None:
    if workers <= 1 or len(units) <= 1:
        for unit in units:
            mark_done(plan_, stage, unit, UNIT_RUNNERS[stage](plan_, unit, report))
        return
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    with ProcessPoolExecutor(min(workers, len(units)), mp_context=context, initializer=_init_worker, initargs=(queue,)) as pool:
        pending = {pool.submit(_unit_in_worker, plan_, stage, unit) for unit in units}
        while pending:
            finished, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            _drain(queue, report)
            for future in finished:
                error = future.result()
                if error is not None:
                    raise UserError(*error)
    _drain(queue, report)


_WORKER_QUEUE = None


def _init_worker(queue) -> None:
    global _WORKER_QUEUE
    _WORKER_QUEUE = queue


def _unit_in_worker(plan_: Plan, stage: str, unit: int) -> tuple | None:
    """Run one unit in a pool process; a UserError comes back as its parts (it does not pickle as raised)."""
    try:
        mark_done(plan_, stage, unit, UNIT_RUNNERS[stage](plan_, unit, _report_to_parent))
    except UserError as exc:
        return exc.where, exc.what, exc.fix
    return None


def _report_to_parent(stage: str, advance: int, total: int | None = None) -> None:
    _WORKER_QUEUE.put((stage, advance, total))


def _drain(queue, report: Report) -> None:
    import queue as queues

    while True:
        try:
            stage, advance, total = queue.get_nowait()
        except queues.Empty:
            return
        report(stage, advance, total=total)


# ---------------------------------------------------------------------------------------------------------------
# Shared small helpers


def _write_table(path: Path, table: pa.Table) -> None:
    """Work files are uncompressed: hashes do not compress, and zstd would only burn CPU on them."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp, compression="none")
    os.replace(tmp, path)


def _atomic_save(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.npy")
    np.save(tmp, array)
    os.replace(tmp, path)


def mark_done(plan_: Plan, stage: str, unit: int, stats: dict) -> None:
    atomic_write_json(plan_.marker(stage, unit), {**stats, "host": socket.gethostname(), "finished_at": time.time()})

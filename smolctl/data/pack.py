"""`smolctl pack`: tokenise documents with the fast (Rust) tokenizer and write packed rows with position ids.

    smolctl pack demo-out/mix/stage-1 demo-out/packed --tokenizer demo-out/tokenizer --seq-len 256

    smolctl pack mix/ packed/ --tokenizer tok/ --seq-len 4096 --tasks 64 --task-id $SLURM_ARRAY_TASK_ID

Three stages overlap: this thread reads batches of documents and hands them to the Rust batch encoder
(`smolctl.data.pack_tokens`: two calls in flight on the tokenizer's threads, or `--workers` processes), which
appends EOS to every document; a packing thread takes the token batches (a batch of long documents in the
pieces it was encoded in) in order, lays them into rows (`smolctl.data.pack_rows`) and writes them
(`smolctl.data.pack_sinks`) as safetensors shards with the packed-folder manifest that `pretrain` and `inspect`
read, or, with `--format datatrove`, as datatrove/nanotron `.ds` token files. A folder from `train-tokenizer`
is loaded from its tokenizer.json alone, so a pack never imports transformers or torch.

The unit of work is one input shard: it is packed on its own (no row holds documents of two shards, so no row
mixes two stages of a mix either) into OUTPUT/_work/<run>/pack/<unit>/ and marked done (smolctl/data/array_tasks.py).
A plain run packs every unit in order; `--tasks N --task-id I` packs units I, I+N, ... as one task of a Slurm
array. Whichever call finishes the last unit links the units' shards, in unit order, into OUTPUT with one
manifest, so the bytes are the same for any N and any order the tasks run in.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import asdict, dataclass
from pathlib import Path

from smolctl.data.array_tasks import (
    FINGERPRINT_KEY,
    START_AGAIN,
    AlreadyCommitted,
    WorkArea,
    check_task,
    file_identity,
    link_or_copy,
    task_units,
    unless_committed,
)
from smolctl.data.pack_config import PackConfig
from smolctl.data.pack_rows import PackStats, TokenBatch
from smolctl.data.pack_sinks import DatatroveSink, RowSink, manifest_fields, recorded_stats
from smolctl.data.pack_tokens import tokenised_pieces
from smolctl.data.tokenizer import RustTokenizer, document_end_id, load_rust_tokenizer
from smolctl.errors import UserError
from smolctl.shards import (
    KIND_PACKED,
    KIND_TOKENS,
    OutputFolder,
    lineage_ref,
    open_documents,
    read_manifest,
    sha256_file,
)

STAGE = "pack"
PACK_QUEUE_PIECES = 8
"""Token batches (or pieces of one) waiting for the packing thread: the tokenizer runs ahead while a buffer is
packed and written."""
__all__ = ["PackConfig", "PackJob", "PackResult", "pack", "prepare_pack"]


@dataclass
class PackResult:
    output: str
    seq_len: int
    strategy: str
    long_docs: str
    tokenizer: dict
    stats: PackStats
    seconds: float
    shards: int = 0
    format: str = "safetensors"
    tokens_per_second: float = 0.0
    """Tokens this call packed per second (one task's share when run as an array task)."""
    finished: bool = True
    """OUTPUT was committed by this call; `stats` then covers all of it, else only this task's units."""
    already_committed: bool = False
    """An array task of a run committed earlier: nothing was done."""
    units_done: int = 0
    units_skipped: int = 0

    def to_dict(self) -> dict:
        out = asdict(self) | {"stats": recorded_stats(self.format, self.stats)}
        if self.format == "datatrove":  # token files are not rows: no length, strategy or long-document rule
            for key in ("seq_len", "strategy", "long_docs"):
                del out[key]
        return out


# ---------------------------------------------------------------------------------------------------------------
# The command


def tokenizer_record(spec: str, tokenizer: RustTokenizer) -> dict:
    """How the packed manifest names its tokenizer (the convention `pretrain` and `inspect` read)."""
    local = Path(spec).exists()
    eos = document_end_id(spec, tokenizer)
    pad = int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else eos
    return {
        "path": str(Path(spec).resolve()) if local else spec,
        "name": Path(spec).resolve().name if local else spec,
        "fingerprint": tokenizer.fingerprint,
        # The ids the data can hold: a special token, or any entry of a vocabulary with gaps in its ids, may sit
        # above the count of its entries.
        "vocab_size": max(tokenizer.vocab_size, tokenizer.largest_id + 1, eos + 1, pad + 1),
        "eos_token_id": eos,
        "pad_token_id": pad,
    }


@dataclass
class PackJob:
    """A validated pack: the input, tokenizer and options were checked before any work (see `prepare_pack`)."""

    input_spec: str
    output: Path
    config: PackConfig
    source: object
    tokenizer: RustTokenizer
    record: dict
    inputs: list[dict]
    overwrite: bool
    area: WorkArea

    @property
    def total_documents(self) -> int:
        return self.source.num_rows

    @property
    def units(self) -> int:
        return len(self.source.files)

    def run(
        self, on_progress: Callable[[int, int], None] | None = None, *, tasks: int | None = None, task_id: int = 0
    ) -> PackResult:
        """Pack every unit, or task `task_id`'s share of `tasks` (an array task); skip finished units and commit
        OUTPUT when the last one is done. `on_progress(documents read, tokens packed)` follows every piece of a
        batch."""
        array_task = tasks is not None
        check_task(tasks, task_id)
        if array_task and self.area.committed():  # this very run, even with --overwrite (see dedup's run)
            return self._result(PackStats(), 0.0, already_committed=True)
        if not array_task:
            with self.area.alone():
                return self._run(on_progress, 1, 0, array_task)
        try:
            with unless_committed(self.area):
                return self._run(on_progress, tasks, task_id, array_task)
        except AlreadyCommitted:
            return self._result(PackStats(), 0.0, already_committed=True)

    def _run(self, on_progress, tasks: int, task_id: int, array_task: bool) -> PackResult:
        self.area.check(self.overwrite)
        mine = task_units(self.units, tasks, task_id)
        todo = self.area.pending(STAGE, mine)
        if todo or not array_task:  # a task with nothing left to do writes nothing
            self.area.prepare()
        try:
            return self._pack_and_commit(on_progress, mine, todo, array_task)
        except UserError as exc:
            if not array_task:
                self.area.clean_up_after(exc)
            raise

    def _pack_and_commit(self, on_progress, mine: list[int], todo: list[int], array_task: bool) -> PackResult:
        started = time.perf_counter()
        self._pack_units(todo, on_progress)
        seconds = time.perf_counter() - started
        packed = sum_stats(self.area.read_marker(STAGE, unit) for unit in todo)
        result = self._result(
            sum_stats(self.area.read_marker(STAGE, unit) for unit in mine),
            seconds,
            finished=False,
            units_done=len(todo),
            units_skipped=len(mine) - len(todo),
            tokens_per_second=packed.tokens / seconds if seconds else 0.0,
        )
        if self.area.stage_done(STAGE, self.units):
            manifest = self.area.commit_once(self._assemble, wait=array_task)
            if manifest is None and not array_task:
                raise self.area.busy_error()
            if manifest is not None:
                result.finished, result.shards = True, len(manifest["shards"])
                result.stats = PackStats(**{k: v for k, v in manifest["stats"].items() if k != "padding_fraction"})
        return result

    def _pack_units(self, units: list[int], on_progress) -> None:
        """Tokenise and pack the units in order, each into its own folder of the work area, then mark it done.

        Packing and writing run on their own thread, in batch order, so the tokenizer never waits for them."""
        config = self.config
        state: dict[str, UnitPacking] = {}
        failed = threading.Event()

        def add(unit: int, batch: TokenBatch, read: int, empty: int, batch_ends: bool) -> None:
            # Pieces queued behind a failed one are dropped: packing them would finish that unit without the
            # failed piece and mark it done, and a resumed array task would skip it.
            if failed.is_set():
                return
            try:
                current = state.get("unit")
                if current is None or current.unit != unit:
                    if current is not None:
                        current.finish()
                    current = state["unit"] = UnitPacking(self, unit)
                current.add(batch, empty, batch_ends)
                if on_progress:
                    on_progress(read, len(batch.ids))
            except BaseException:
                failed.set()
                raise

        pieces = tokenised_pieces(
            self.source, self.tokenizer, config.text_column, config.batch_documents, config.workers, units
        )
        with ThreadPoolExecutor(1, thread_name_prefix="pack") as packer, closing(pieces):
            waiting: deque = deque()
            try:
                for piece in pieces:
                    waiting.append(packer.submit(add, *piece))
                    while len(waiting) > PACK_QUEUE_PIECES or (waiting and waiting[0].done()):
                        waiting.popleft().result()  # raises what the packing thread raised
                while waiting:
                    waiting.popleft().result()
            except BaseException:
                packer.shutdown(wait=True, cancel_futures=True)  # the unit is no longer written to
                if "unit" in state:
                    state["unit"].abandon()
                raise
            finally:
                packer.shutdown(wait=True, cancel_futures=True)
        if "unit" in state:
            state["unit"].finish()
        for unit in units:  # input files without rows still finish their unit
            if not self.area.is_done(STAGE, unit):
                UnitPacking(self, unit).finish()

    def _assemble(self) -> dict:
        """Link every unit's shards, in unit order, into OUTPUT with one manifest; the accounting is the sum."""
        config = self.config
        stats = sum_stats(self.area.read_marker(STAGE, unit) for unit in range(self.units))
        if stats.documents == 0:
            raise UserError(
                self.input_spec,
                f"column '{config.text_column}' holds no non-empty documents ({stats.skipped_empty} empty)",
                "pass a dataset with text",
            )
        kind, suffix = (KIND_PACKED, ".safetensors") if config.format == "safetensors" else (KIND_TOKENS, ".ds")
        with OutputFolder(self.output, kind=kind, overwrite=True, inputs=self.inputs) as folder:
            for unit in range(self.units):
                unit_folder = self.area.stage_dir(STAGE) / f"{unit:05d}"
                unit_manifest = read_manifest(unit_folder)
                if unit_manifest is None:
                    raise UserError(unit_folder, "is missing from the work area", START_AGAIN)
                for shard in unit_manifest["shards"]:
                    name = f"part-{len(folder.shards):05d}{suffix}"
                    extra = {}
                    for key, new in (("index", f"{name}.index"), ("metadata", f"{name}.metadata")):
                        if key in shard:
                            link_or_copy(unit_folder / shard[key], folder.file(new))
                            # A .ds file is unreadable without its index: verify checks them too.
                            extra |= {key: new, f"{key}_sha256": sha256_file(folder.file(new))}
                    link_or_copy(unit_folder / shard["name"], folder.file(name), shard["bytes"])
                    folder.add_shard(name, shard["rows"], tokens=shard.get("tokens"), sha256=shard["sha256"], **extra)
            return folder.commit(
                stats=recorded_stats(config.format, stats),
                tokenizer=self.record,
                documents=stats.documents,
                skipped_empty=stats.skipped_empty,
                **manifest_fields(config, self.record, stats),
                **{FINGERPRINT_KEY: self.area.digest},
            )

    def _result(self, stats: PackStats, seconds: float, **fields) -> PackResult:
        config = self.config
        return PackResult(
            str(self.output),
            config.seq_len,
            config.strategy,
            config.long_docs,
            self.record,
            stats,
            seconds,
            format=config.format,
            **fields,
        )


class UnitPacking:
    """One unit (input file) being packed into OUTPUT/_work/<run>/pack/<unit>/, committed and marked when finished."""

    def __init__(self, job: PackJob, unit: int):
        self.job, self.unit, self.stats = job, unit, PackStats()
        kind, sink_type = (KIND_PACKED, RowSink) if job.config.format == "safetensors" else (KIND_TOKENS, DatatroveSink)
        self.folder = OutputFolder(
            job.area.stage_dir(STAGE) / f"{unit:05d}", kind=kind, overwrite=True, per_process=True
        )
        self.sink = sink_type(self.folder, job.config, job.record, self.stats, unit)

    def add(self, batch: TokenBatch, empty: int, batch_ends: bool) -> None:
        """Pack a batch of tokenised documents, or a piece of one (`batch_ends` on its last piece); each document
        ends in EOS, `empty` documents were dropped."""
        self.stats.skipped_empty += empty
        self.stats.documents += len(batch.lengths)
        self.sink.add(batch, batch_ends)

    def finish(self) -> None:
        try:
            self.sink.close()
            self.folder.commit(stats=asdict(self.stats))
        except BaseException:
            self.abandon()
            raise
        self.job.area.mark_done(STAGE, self.unit, asdict(self.stats))

    def abandon(self) -> None:
        """Remove this process's staging folder of the unit: a run that stopped mid-unit starts it again in its
        own (another process's id), so a kept one would only be left behind, a folder per failed run."""
        handle = getattr(self.sink, "handle", None)  # a token file open across batches (--format datatrove)
        if handle is not None:
            handle.close()  # first: NFS keeps a file removed while open as .nfsXXXX, and its folder with it
        self.folder.abort()


def sum_stats(markers) -> PackStats:
    total = PackStats()
    for marker in markers:
        for key in asdict(total):
            setattr(total, key, getattr(total, key) + marker[key])
    return total


def prepare_pack(
    input_spec: str, output: str | Path, *, tokenizer_spec: str, config: PackConfig, overwrite: bool = False
) -> PackJob:
    """Check everything a pack needs (options, input columns, tokenizer) before any work; the output folder is
    checked by `PackJob.run` (an array task may find it already committed by its own run)."""
    config.validate()
    config.rows_per_shard()
    source = open_documents(input_spec, columns=[config.text_column])
    source.check_output_spares(output)
    source.require(text=[config.text_column])
    tokenizer = load_rust_tokenizer(tokenizer_spec)
    record = tokenizer_record(tokenizer_spec, tokenizer)
    inputs = source.lineage() + ([lineage_ref(Path(tokenizer_spec))] if Path(tokenizer_spec).is_dir() else [])
    # --workers changes how fast, never what is written.
    settings = {k: v for k, v in asdict(config).items() if k != "workers"}
    # What the ids come out as: the rules, the ids written between documents (two folders of one tokenizer.json
    # can name another EOS, as Llama 3.1's base and Instruct do), and whether special-token text is split.
    written_with = {
        "rules": record["fingerprint"],
        "eos_token_id": record["eos_token_id"],
        "pad_token_id": record["pad_token_id"],
        "split_special_tokens": bool(tokenizer.backend.encode_special_tokens),
    }
    fingerprint = {"config": settings, "input_files": file_identity(source.files), "tokenizer": written_with}
    return PackJob(
        input_spec,
        Path(output),
        config,
        source,
        tokenizer,
        record,
        inputs,
        overwrite,
        WorkArea(Path(output), (STAGE,), fingerprint),
    )


def pack(
    input_spec: str,
    output: str | Path,
    *,
    tokenizer_spec: str,
    config: PackConfig,
    overwrite: bool = False,
    on_progress: Callable[[int, int], None] | None = None,
    tasks: int | None = None,
    task_id: int = 0,
) -> PackResult:
    """Tokenise and pack INPUT (any documents folder, parquet file or glob) into a packed folder at OUTPUT."""
    job = prepare_pack(input_spec, output, tokenizer_spec=tokenizer_spec, config=config, overwrite=overwrite)
    return job.run(on_progress, tasks=tasks, task_id=task_id)

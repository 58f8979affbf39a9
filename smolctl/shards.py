"""The file contract between stages, written once and used by every stage.

A *dataset folder* holds parquet shards `part-00000.parquet ...`; a *packed folder* holds safetensors shards;
a *model folder* is a Hugging Face model folder. Each carries a `manifest.json` that records what it holds
(shards with rows, tokens and sha256, the schema), the command and tool version that made it, and the manifests
of its inputs (the lineage), so the next stage can check what it is given.

Writes go to a hidden staging folder beside the output (`.NAME.partial`); each shard is written under a
temporary name and renamed, the manifest is written last, and only then does the staging folder replace the
output. A run interrupted at any moment leaves the earlier output (or none) and a stale staging folder that
the next run removes, never a folder that looks complete when it is not.
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob as globlib
import hashlib
import json
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from smolctl import __version__
from smolctl.errors import UserError, WriteRefused, committed, interrupts_deferred, writing_to

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1
KIND_DOCUMENTS = "documents"
KIND_PACKED = "packed"
KIND_TOKENS = "tokens"  # datatrove token files (pack --format datatrove)
KIND_MODEL = "model"
KIND_TOKENIZER = "tokenizer"
DEFAULT_SHARD_BYTES = 256 * 1024**2
PARQUET_MAGIC = b"PAR1"

# ---------------------------------------------------------------------------------------------------------------
# Small atomic primitives


def sha256_file(path: Path) -> str:
    # file_digest reads into one reused buffer: no fresh pages per block (a 4 MB read() each time cost a third more).
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def atomic_write_bytes(path: Path, data: bytes, durable: bool = True) -> None:
    """Write under a temporary name in the same folder, fsync, then rename: readers see all or nothing.
    durable=False skips the fsync, for files a crash only costs recomputing (work areas)."""
    atomic_write_parts(path, [data], durable)


def atomic_write_parts(path: Path, parts: Iterable, durable: bool = True) -> None:
    """atomic_write_bytes of the parts (bytes-like: bytes, C-contiguous numpy arrays) end to end, without
    joining them into one copy first."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            for part in parts:
                handle.write(part)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise write_refused(path, exc) from exc


def write_refused(path: Path, exc: OSError) -> WriteRefused:
    """The file system's refusal to write `path` (a full disk, a quota) as the error that keeps a run's finished
    units for a resume. Arrow's errors carry the errno under a longer message: the errno names it."""
    reason = os.strerror(exc.errno) if exc.errno else exc
    return WriteRefused(path, f"cannot write: {reason}", "check free space and permissions")


def remove_finished(path: Path) -> None:
    """Remove a folder that presents itself as finished (a manifest beside its files) so that no crash leaves it
    half removed under its name, a manifest beside missing files: it is renamed to a hidden name first, then
    deleted. What a crash left aside so before, in the same parent folder, goes too (only one process at a time
    removes from a run's folders: the run lock)."""
    for stale in path.parent.glob(".*.removing"):
        shutil.rmtree(stale, ignore_errors=True)
    aside = path.parent / f".{path.name}.removing"
    try:
        os.replace(path, aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def atomic_write_json(path: Path, payload: Any) -> None:
    atomic_write_bytes(path, (json.dumps(payload, indent=2, default=str) + "\n").encode())


def command_line() -> list[str]:
    return ["smolctl" if i == 0 else arg for i, arg in enumerate(sys.argv)]


# ---------------------------------------------------------------------------------------------------------------
# Manifests and lineage


def is_own_manifest(manifest: Any) -> bool:
    """Whether a folder's manifest.json is one smolctl wrote (every one holds smolctl_version, kind and
    format_version; `kind` alone is a common key of other tools' manifests)."""
    return isinstance(manifest, dict) and (
        "smolctl_version" in manifest or {"kind", "format_version"} <= manifest.keys()
    )


def read_manifest(folder: Path) -> dict | None:
    """The folder's manifest, or None when it has none or it is another tool's (`is_own_manifest`). A manifest
    that is not valid JSON, or one of smolctl's without its kind, is a user error."""
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(
            path,
            f"is not valid JSON ({exc})",
            "re-run the stage that wrote this folder (another tool's folder: pass its parquet files by a glob)",
        ) from exc
    if not is_own_manifest(manifest):
        return None  # another tool's manifest.json: the folder is read as a plain folder
    if "kind" not in manifest:
        raise UserError(path, "is not a smolctl manifest (no 'kind')", "re-run the stage that wrote this folder")
    return manifest


def named_manifest(folder: Path) -> tuple[dict | None, str | None]:
    """(manifest, why it is unreadable) of a folder named as an input without being read (a tokenizer, a model):
    its manifest.json may be another tool's or not JSON at all, which names it with no kind and stops nothing."""
    try:
        return read_manifest(folder), None
    except UserError as exc:
        return None, exc.what


def lineage_ref(folder: Path, manifest: dict | None = None) -> dict:
    """How an output names one of its inputs: absolute path, kind, and the sha256 of the input's manifest (read
    as `named_manifest` reads it, unless given)."""
    folder = Path(folder).resolve()
    manifest_path = folder / MANIFEST_NAME
    if manifest_path.is_file():
        kind = (manifest or named_manifest(folder)[0] or {}).get("kind")
        return {"path": str(folder), "kind": kind, "manifest_sha256": sha256_file(manifest_path)}
    return {"path": str(folder), "kind": None, "manifest_sha256": None}


def lineage_chain(folder: Path) -> list[dict]:
    """Walk the inputs back to the raw data: one entry per folder, depth first, each with its depth."""
    chain: list[dict] = []
    seen: set[str] = set()

    def visit(path: Path, depth: int, expected_sha: str | None) -> None:
        key = str(Path(path).resolve())
        unreadable = None
        if depth == 0:  # the folder asked about: its manifest must be readable
            manifest = read_manifest(path) if Path(path).is_dir() else None
        else:  # an input: the chain shows an unreadable manifest and goes on
            manifest, unreadable = named_manifest(path) if Path(path).is_dir() else (None, None)
        entry = {
            "depth": depth,
            "path": key,
            "kind": manifest.get("kind") if manifest else None,
            "command": " ".join(manifest.get("command", [])) if manifest else None,
            "rows": manifest.get("rows") if manifest else None,
            "tokens": manifest.get("tokens") if manifest else None,
            "status": "ok",
        }
        if unreadable:
            entry["status"] = f"its manifest.json {unreadable}"
        elif manifest is None:
            entry["status"] = "raw input (no manifest)" if Path(path).exists() else "missing"
        elif expected_sha and sha256_file(Path(path) / MANIFEST_NAME) != expected_sha:
            entry["status"] = "changed since it was used"
        chain.append(entry)
        if manifest is None or key in seen:
            return
        seen.add(key)
        for ref in manifest.get("inputs", []):
            visit(Path(ref["path"]), depth + 1, ref.get("manifest_sha256"))

    visit(Path(folder), 0, None)
    return chain


def schema_to_dict(schema: pa.Schema) -> dict[str, str]:
    return {name: str(schema.field(name).type) for name in schema.names}


# ---------------------------------------------------------------------------------------------------------------
# Output folders


class OutputFolder:
    """A stage's output folder, written in a staging folder and swapped into place on commit."""

    def __init__(
        self,
        path: str | Path,
        *,
        kind: str,
        overwrite: bool = False,
        inputs: Sequence[dict] = (),
        resumable: bool = False,
        per_process: bool = False,
    ):
        """resumable=True keeps an existing staging folder (a stage that resumes by shard decides what in it to
        reuse) and keeps it when the stage fails, for the next run to continue. per_process=True is for a unit of
        a work area that two copies of one array task may write at once (a requeued task whose first copy still
        runs): each stages in its own folder, and whichever is moved into place last stays (the same bytes)."""
        self.path = output_folder_path(path)
        self.kind = kind
        self.inputs = list(inputs)
        self.resumable = resumable
        self.shards: list[dict] = []
        check_output_path(self.path, overwrite)
        refuse_working_folder(self.path)  # put in place whole, by a rename over it
        refuse_output_over_inputs(self.path, [ref["path"] for ref in self.inputs if ref.get("path")])
        self.per_process = per_process
        own = f"-{os.getpid()}" if per_process else ""
        self.staging = self.path.parent / f".{self.path.name}.partial{own}"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.staging.exists() and not resumable:
                shutil.rmtree(self.staging)
            self.staging.mkdir(exist_ok=resumable)
        except OSError as exc:
            raise WriteRefused(
                self.path,
                f"cannot create the output folder: {exc.strerror or exc}",
                "check free space and the path's permissions",
            ) from exc

    def file(self, name: str) -> Path:
        """Where a file of this output is written before the commit."""
        return self.staging / name

    def add_shard(
        self, name: str, rows: int, tokens: int | None = None, sha256: str | None = None, **extra: Any
    ) -> dict:
        """Record a shard written into the staging folder; `sha256` when already known (a shard linked in from a
        work area, hashed when it was written)."""
        path = self.staging / name
        shard = {"name": name, "rows": int(rows), "bytes": path.stat().st_size, "sha256": sha256 or sha256_file(path)}
        if tokens is not None:
            shard["tokens"] = int(tokens)
        shard.update(extra)
        self.shards.append(shard)
        return shard

    def commit(self, *, schema: dict | None = None, stats: dict | None = None, **fields: Any) -> dict:
        """Write the manifest last, then swap the staging folder into place. Returns the manifest."""
        tokens = [s.get("tokens") for s in self.shards]
        manifest = {
            "format_version": FORMAT_VERSION,
            "kind": self.kind,
            "smolctl_version": __version__,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": command_line(),
            "inputs": self.inputs,
            "rows": sum(s["rows"] for s in self.shards),
            "tokens": sum(tokens) if tokens and all(t is not None for t in tokens) else None,
            "shards": self.shards,
            "schema": schema or {},
            "stats": stats or {},
            **fields,
        }
        # safetensors 0.8 writes through a temporary file made 0600 whatever the umask (safetensors#782): on a
        # cluster, other users could not read the packed data or models. Its files get the mode any other file has.
        mode = 0o666 & ~process_umask()
        for file in self.staging.rglob("*.safetensors"):
            os.chmod(file, mode)
        if self.kind in (KIND_MODEL, KIND_TOKENIZER) and "files" not in manifest:
            manifest["files"] = self._other_files()
        atomic_write_json(self.staging / MANIFEST_NAME, manifest)
        self._swap_into_place()
        return manifest

    def _other_files(self) -> list[dict]:
        """Every file but the shards and the manifest, hashed: a model's config.json and tokenizer files decide
        what its weights mean, and a tokenizer's config its special tokens and chat template, so `inspect
        --verify` checks them all."""
        shards = {shard["name"] for shard in self.shards} | {MANIFEST_NAME}
        files = sorted(p for p in self.staging.rglob("*") if p.is_file())
        return [
            {"name": name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}
            for path in files
            if (name := path.relative_to(self.staging).as_posix()) not in shards
        ]

    def _swap_into_place(self) -> None:
        if self.per_process:
            with interrupts_deferred():  # its moves in and out of place are never cut in half by Ctrl-C
                self._replace_copy()
            return
        old = self.path.parent / f".{self.path.name}.old"
        if old.exists():  # left by a run whose Ctrl-C came while it removed it
            shutil.rmtree(old)
        moved_aside = swapped = False
        try:
            # Ctrl-C waits for the two moves: cut between them, it left the earlier output aside as .NAME.old and
            # no OUTPUT. Not for the removals around them, which may take long (a large output replaced).
            with interrupts_deferred():
                if self.path.exists():
                    os.replace(self.path, old)
                    moved_aside = True
                os.replace(self.staging, self.path)
                swapped = True
                committed(self.path)
        except OSError as exc:
            # The output moved aside goes back (an array run's work area is in it); the new one is discarded.
            raise self._move_failed(
                exc,
                old if moved_aside else None,
                "output",
                "nothing was replaced; check the file system's space and permissions, then re-run",
            ) from exc
        finally:
            if swapped:  # also when a Ctrl-C held back during the moves arrives now
                shutil.rmtree(old, ignore_errors=True)

    def _replace_copy(self) -> None:
        """Move this process's staging folder into place over whatever another copy put there."""
        old = self.path.parent / f".{self.path.name}.old-{os.getpid()}"
        moved_aside = False
        try:
            os.replace(self.path, old)
            moved_aside = True
        except FileNotFoundError:
            pass  # none yet, or another copy is between its two moves
        try:
            os.replace(self.staging, self.path)
        except OSError as exc:
            shutil.rmtree(self.staging, ignore_errors=True)
            # Another copy's committed folder went in meanwhile: it holds the same bytes. Without one, the move
            # itself failed: the folder moved aside goes back (its copy may have marked the unit done), and this
            # copy must not mark it done with no folder.
            if not (self.path / "manifest.json").is_file():
                raise self._move_failed(
                    exc,
                    old if moved_aside else None,
                    "unit",
                    "check the file system's space and permissions, then re-run the task",
                ) from exc
        finally:
            if (self.path / "manifest.json").is_file():  # else the folder moved aside could not go back: keep it
                shutil.rmtree(old, ignore_errors=True)

    def _move_failed(self, exc: OSError, moved_aside: Path | None, what: str, fix: str) -> WriteRefused:
        """Put back the folder that was moved aside for the move that failed, and say so in one line."""
        if moved_aside is not None and not self.path.exists():
            with contextlib.suppress(OSError):
                os.replace(moved_aside, self.path)
        return WriteRefused(
            self.path,
            f"cannot move the finished {what} into place: {exc.strerror or exc}",
            fix,
        )

    def abort(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)

    def __enter__(self) -> OutputFolder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and not self.resumable:
            self.abort()


def process_umask() -> int:
    """The process's umask: read where Linux shows it, else set (to the strict 077, so a file another thread
    makes meanwhile is private, never open) and put back."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def output_folder_path(path: str | Path) -> Path:
    """Where an output folder (and a work area inside it) is made. Absolute: arrow reads a relative path whose
    first folder looks like a URI scheme (`run:1/...`) as a URI. A symlink's target (`out -> /scratch/...`, as on
    clusters): the output is made there, its staging folder beside the target (a rename cannot cross file
    systems), and the link stays; swapping or removing the link itself would leave a local folder in its place."""
    path = Path(path).absolute()
    return path.resolve() if path.is_symlink() else path


def check_output_path(path: Path, overwrite: bool) -> None:
    """Refuse to clobber: a non-empty output folder needs --overwrite; a file is never a folder."""
    path = Path(path)
    writing_to(path)
    if path.exists() and not path.is_dir():
        raise UserError(path, "exists and is a file, not a folder", "choose an output folder path")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise UserError(
            path, "already exists and is not empty", "pass --overwrite to replace it, or choose another folder"
        )
    parent = path.parent if not path.exists() else path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(parent, f"is a file, so {path} cannot be made under it", "choose an output folder path")
    if not os.access(parent, os.W_OK):
        raise UserError(parent, "is not writable", "choose an output folder you can write to")


def refuse_working_folder(path: Path) -> None:
    """For an output folder put in place whole (a staging folder renamed over it), or a run folder --overwrite
    deletes: the folder the shell is in, or one holding it, would be replaced under the user, who is left in a
    deleted folder. A run written into the folder it is started from is fine."""
    try:
        here = Path.cwd().resolve()
    except FileNotFoundError:  # already in a deleted folder: nothing of it to protect
        return
    out = Path(path).resolve()
    if out == here or out in here.parents:
        raise UserError(
            path,
            "is the folder you are in" if out == here else f"holds the folder you are in ({here})",
            "write to a new folder (e.g. ./out), or run from another folder",
        )


def refuse_output_over_inputs(output: Path, inputs: Sequence[str | Path], role: str = "the input") -> None:
    """Refuse an OUTPUT that is one of the inputs, holds one, or lies inside one: replacing it (--overwrite, or the
    commit's swap) would delete what the command reads, a model or run folder exported or merged into itself; and
    inside one it changes what the input holds (a plain parquet folder holding a smolctl folder is refused as input,
    a model or checkpoint folder fails its --verify)."""
    out = Path(output).resolve()
    for source in inputs:
        path = Path(source).resolve()
        if path == out or out in path.parents:
            what = f"is {role} itself" if path == out else f"holds {role} {source}"
            raise UserError(output, what, "write the output to another folder")
        if path in out.parents and path.is_dir():
            raise UserError(output, f"is inside {role} {source}", "write the output beside it, not inside it")


class DatasetWriter:
    """Parquet shards that roll at a size or row limit, each written under a temporary name and renamed."""

    def __init__(
        self,
        folder: OutputFolder,
        *,
        schema: pa.Schema | None = None,
        shard_bytes: int | None = DEFAULT_SHARD_BYTES,
        shard_rows: int | None = None,
        prefix: str = "part",
        compression: str = "zstd",
    ):
        self.folder = folder
        self.schema = schema
        self.shard_bytes = shard_bytes
        self.shard_rows = shard_rows
        self.prefix = prefix
        self.compression = compression
        self._writer: pq.ParquetWriter | None = None
        self._tmp: Path | None = None
        self._rows = 0
        self._bytes = 0

    def _open(self) -> None:
        name = f"{self.prefix}-{len(self.folder.shards):05d}.parquet"
        self._tmp = self.folder.file(f".{name}.tmp")
        try:
            self._writer = pq.ParquetWriter(self._tmp, self.schema, compression=self.compression)
        except OSError as exc:
            raise WriteRefused(
                self.folder.path, f"cannot write a shard: {exc}", "check free space and permissions"
            ) from exc
        self._rows = self._bytes = 0

    def write(self, batch: pa.RecordBatch | pa.Table) -> None:
        if batch.num_rows == 0:
            return
        if self.schema is None:
            self.schema = batch.schema
        elif batch.schema != self.schema:
            batch = (
                batch.cast(self.schema)
                if isinstance(batch, pa.Table)
                else pa.Table.from_batches([batch]).cast(self.schema)
            )
        table = batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])
        start = 0
        while start < table.num_rows:
            if self._writer is None:
                self._open()
            take = table.num_rows - start
            if self.shard_rows:
                take = min(take, self.shard_rows - self._rows)
            if self.shard_bytes:
                row_bytes = max(1, table.nbytes // max(1, table.num_rows))
                room = max(1, (self.shard_bytes - self._bytes) // row_bytes)
                take = min(take, room)
            piece = table.slice(start, take)
            self._write_piece(piece)
            start += take
            if (self.shard_rows and self._rows >= self.shard_rows) or (
                self.shard_bytes and self._bytes >= self.shard_bytes
            ):
                self._close_shard()

    def _write_piece(self, piece: pa.Table) -> None:
        try:
            self._writer.write_table(piece)
        except OSError as exc:
            raise WriteRefused(
                self.folder.path, f"cannot write a shard: {exc}", "check free space and permissions"
            ) from exc
        self._rows += piece.num_rows
        self._bytes += piece.nbytes

    def _close_shard(self) -> None:
        if self._writer is None:
            return
        try:
            self._writer.close()
        except OSError as exc:
            raise WriteRefused(
                self.folder.path, f"cannot write a shard: {exc}", "check free space and permissions"
            ) from exc
        final = self._tmp.with_name(self._tmp.name[1 : -len(".tmp")])
        os.replace(self._tmp, final)
        self.folder.add_shard(final.name, self._rows)
        self._writer = None

    def close(self) -> pa.Schema | None:
        """Finish the open shard. Returns the schema written (None when nothing was written)."""
        self._close_shard()
        return self.schema


def int32_safetensors_prefix(shapes: Mapping[str, Sequence[int]]) -> bytes:
    """The first bytes of a safetensors file of int32 tensors of these shapes: the header's length (u64,
    little-endian) and the header, compact JSON of each tensor's dtype, shape and data offsets in name order (the
    format orders tensors by dtype, then name), padded with spaces to 8 bytes."""
    entries, offset = {}, 0
    for name in sorted(shapes):
        size = 4 * math.prod(shapes[name])
        entries[name] = {"dtype": "I32", "shape": list(shapes[name]), "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header


def write_int32_safetensors(blocks: Mapping[str, Sequence[np.ndarray]], path: Path) -> str:
    """Write int32 tensors, each given as blocks of rows stacked in order, as one safetensors file, and return
    the file's sha256: the bytes `safetensors.numpy.save_file` writes for the stacked tensors.

    The blocks go to the file from where they lie. save_file would need each tensor joined into one array and
    then copied into bytes, two copies of a shard (256 MB by default) in fresh memory before the write. The
    digest is taken from the same memory on another thread (hashlib releases the GIL) while they are written."""
    shapes = {}
    for name, parts in blocks.items():
        if not parts or any(part.dtype != np.dtype("<i4") or part.shape[1:] != parts[0].shape[1:] for part in parts):
            raise ValueError(f"tensor {name!r}: blocks must be little-endian int32 arrays with the same row shape")
        shapes[name] = (sum(len(part) for part in parts), *parts[0].shape[1:])
    prefix = int32_safetensors_prefix(shapes)
    data = [np.ascontiguousarray(part).reshape(-1).view(np.uint8) for name in sorted(blocks) for part in blocks[name]]

    def digest() -> str:
        hasher = hashlib.sha256(prefix)
        for part in data:
            hasher.update(part)
        return hasher.hexdigest()

    from concurrent.futures import ThreadPoolExecutor  # here: the commands that write no packed shard skip it

    with ThreadPoolExecutor(1, thread_name_prefix="sha256") as helper:
        expected = helper.submit(digest)
        with open(path, "wb") as handle:
            handle.write(prefix)
            for part in data:
                handle.write(part)
        return expected.result()


class PackedWriter:
    """Safetensors shards of equal-length int32 rows (e.g. input_ids and position_ids, both [rows, seq_len])."""

    def __init__(self, folder: OutputFolder, *, rows_per_shard: int, prefix: str = "part"):
        self.folder = folder
        self.rows_per_shard = rows_per_shard
        self.prefix = prefix
        self._pending: list[tuple[dict[str, np.ndarray], np.ndarray]] = []  # (tensors, real tokens of each row)
        self._pending_rows = 0

    def write(self, tensors: dict[str, np.ndarray], row_tokens: np.ndarray) -> None:
        """Add rows; `row_tokens[i]` counts the real (non-padding) tokens of row i, for the manifest. The arrays are
        kept, not copied, until their shard is written: the caller must not change them."""
        if self._pending and tensors.keys() != self._pending[0][0].keys():
            raise ValueError(f"rows of {sorted(tensors)} after rows of {sorted(self._pending[0][0])}")
        self._pending.append((tensors, np.asarray(row_tokens, dtype=np.int64)))
        self._pending_rows += len(row_tokens)
        while self._pending_rows >= self.rows_per_shard:
            self._flush(self.rows_per_shard)

    def _flush(self, rows: int) -> None:
        # The shard is written from the pending blocks themselves; a block that straddles it is split by views.
        blocks: dict[str, list[np.ndarray]] = {name: [] for name in self._pending[0][0]}
        tokens, taken = 0, 0
        while taken < rows:
            tensors, row_tokens = self._pending[0]
            take = min(rows - taken, len(row_tokens))
            for name, array in tensors.items():
                blocks[name].append(array[:take])
            tokens += int(row_tokens[:take].sum())
            taken += take
            if take == len(row_tokens):
                self._pending.pop(0)
            else:
                self._pending[0] = ({name: array[take:] for name, array in tensors.items()}, row_tokens[take:])
        name = f"{self.prefix}-{len(self.folder.shards):05d}.safetensors"
        tmp = self.folder.file(f".{name}.tmp")
        try:
            sha256 = write_int32_safetensors(blocks, tmp)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise WriteRefused(
                self.folder.path, f"cannot write a shard: {exc}", "check free space and permissions"
            ) from exc
        os.replace(tmp, self.folder.file(name))
        self.folder.add_shard(name, rows, tokens=tokens, sha256=sha256)
        self._pending_rows -= rows

    def close(self) -> None:
        if self._pending_rows:
            self._flush(self._pending_rows)


# ---------------------------------------------------------------------------------------------------------------
# Readers


def parquet_files_under(root: Path) -> list[Path]:
    """Every parquet file under a folder, sorted: `.parquet` in any case (`PART-2.PARQUET`), through symlinked
    folders (each real folder once), skipping hidden and underscore entries (`.cache/`, `_temporary/`, Spark's
    `_SUCCESS`). A folder holding smolctl folders is refused: each is a dataset of its own, with its own
    datasets inside (dedup's duplicates/), which read as one would be neither."""
    found, seen = [], set()
    for folder, subfolders, names in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:  # a link back up the tree
            subfolders[:] = []
            continue
        seen.add(real)
        if MANIFEST_NAME in names and _is_dataset_folder(Path(folder)):
            _refuse_folder_of_datasets(root, Path(folder))
        subfolders[:] = [name for name in subfolders if not name.startswith((".", "_"))]
        shards = [
            Path(folder) / name
            for name in names
            if name.lower().endswith(".parquet") and not name.startswith((".", "_"))
        ]
        _refuse_broken_links(shards)
        found += [path for path in shards if path.is_file()]
    return sorted(found)


def _refuse_folder_of_datasets(root: Path, dataset: Path) -> None:
    """One line for a plain folder with a smolctl folder (`dataset`) inside, naming the ones next to it."""
    names = sorted(p.name for p in root.iterdir() if p.is_dir() and _is_dataset_folder(p))
    if dataset.parent != root:  # deeper down: named by its path, the folders on the way are not datasets
        names = [dataset.relative_to(root).as_posix()]
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    raise UserError(
        root,
        f"holds smolctl folders ({shown}), each a dataset of its own",
        f"pass one of them ({root / names[0]}), or combine them with smolctl mix",
    )


def _is_dataset_folder(folder: Path) -> bool:
    """Whether smolctl wrote this folder as a dataset (another tool's manifest.json, even broken, is not)."""
    try:
        manifest = read_manifest(folder)
    except UserError:
        return False
    return manifest is not None and manifest.get("kind") == KIND_DOCUMENTS


def _refuse_broken_links(paths: Iterable[Path]) -> None:
    """A UserError for the first shard that is a link to nothing: a file system not mounted (or a shard moved)
    would otherwise be a silently smaller input."""
    for path in paths:
        if path.is_symlink() and not path.exists():
            raise UserError(
                path,
                f"is a link to {os.readlink(path)}, which does not exist",
                "mount or restore what it points to, or remove the link",
            )


def _check_parquet_magic(path: Path) -> None:
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            head = handle.read(4)
            handle.seek(max(0, size - 4))
            tail = handle.read(4)
    except OSError as exc:
        raise UserError(path, f"cannot read: {exc.strerror or exc}", "check the path and its permissions") from exc
    if size < 12 or head != PARQUET_MAGIC or tail != PARQUET_MAGIC:
        what = "is empty" if size == 0 else "is not a parquet file (or is truncated)"
        if _is_json_lines(path.name):
            raise UserError(path, "is JSON lines, not parquet", _json_lines_fix(path))
        raise UserError(path, what, "pass parquet shards, e.g. a folder written by smolctl or datasets.to_parquet")


JSON_LINES_SUFFIXES = (".jsonl", ".json", ".ndjson")


def _is_json_lines(name: str) -> bool:
    """A JSON-lines file, compressed or not (`docs.jsonl.zst`, as many corpora ship)."""
    stem = name.lower()
    for compression in (".gz", ".zst", ".bz2", ".xz"):
        stem = stem.removesuffix(compression)
    return stem.endswith(JSON_LINES_SUFFIXES)


def _json_lines_fix(path: Path) -> str:
    pattern = f"{path}/*.json*" if path.is_dir() else str(path)
    return (
        'convert it to parquet first, e.g. python -c "import datasets; '
        f"datasets.load_dataset('json', data_files='{pattern}', split='train').to_parquet('docs.parquet')\""
    )


def resolve_parquet_files(spec: str | Path) -> tuple[list[Path], dict | None, Path | None]:
    """Files named by a dataset folder, a plain folder of parquet files, a single file or a glob.

    Returns (files, manifest or None, folder or None). The files are absolute: arrow reads a relative path
    whose first folder looks like a URI scheme (`run:1/docs.parquet`) as a URI.
    """
    files, manifest, folder = _parquet_files(spec)
    return [file.absolute() for file in files], manifest, folder


def _parquet_files(spec: str | Path) -> tuple[list[Path], dict | None, Path | None]:
    text = str(spec)
    if any(ch in text for ch in "*?[") and not Path(text).exists():
        matches = [Path(p) for p in globlib.glob(text, recursive=True)]
        _refuse_broken_links(matches)
        files = sorted(p for p in matches if p.is_file())
        if not files:
            raise UserError(
                text, "the pattern matches no files", "check the glob (quote it so the shell leaves it alone)"
            )
        return files, None, None
    path = Path(text)
    if not path.exists():
        raise UserError(path, "no such file or folder", "check the path")
    if path.is_file():
        return [path], None, None
    manifest = read_manifest(path)
    if manifest is not None:
        if manifest["kind"] != KIND_DOCUMENTS:
            raise UserError(
                path,
                f"is a {manifest['kind']} folder, not a dataset (documents) folder",
                "pass a folder of parquet documents"
                + ("; packed folders feed pretrain" if manifest["kind"] == KIND_PACKED else ""),
            )
        files = check_listed_shards(path, manifest)
        if not files:
            raise UserError(
                path, "holds no shards (its manifest lists none)", "re-run the stage with a non-empty input"
            )
        return files, manifest, path
    files = parquet_files_under(path)
    if not files:
        others = [p.name for p in path.iterdir() if not p.name.startswith(".")][:5]
        hint = f" (it holds {', '.join(others)})" if others else " (it is empty)"
        fix = "pass a folder of .parquet shards, a .parquet file or a glob"
        raise UserError(
            path,
            f"holds no parquet files{hint}",
            _json_lines_fix(path) if any(_is_json_lines(name) for name in others) else fix,
        )
    return files, None, path


def check_listed_shards(folder: Path, manifest: dict) -> list[Path]:
    """The manifest's shards, each present and of the recorded size: a cheap check that catches truncated or
    swapped shards before any work starts (`smolctl inspect --verify` re-hashes them in full)."""
    files = []
    for shard in manifest.get("shards", []):
        file = Path(folder) / shard["name"]
        if not file.is_file():
            raise UserError(file, "is listed in the manifest but missing", "re-run the stage that wrote this folder")
        size = file.stat().st_size
        if "bytes" in shard and size != shard["bytes"]:
            raise UserError(
                file,
                f"is {size} bytes but the manifest records {shard['bytes']} (changed or truncated)",
                "re-run the stage that wrote this folder; `smolctl inspect --verify` checks every shard",
            )
        files.append(file)
    return files


def readable_schema(schema: pa.Schema) -> pa.Schema:
    """The schema smolctl reads a parquet file as: string_view and binary_view (Polars writes them), at any depth
    of lists, structs and maps, become large_string and large_binary, the same values in the layout arrow's
    filter, take and string kernels accept."""
    return pa.schema([f.with_type(_without_views(f.type)) for f in schema], metadata=schema.metadata)


def _without_views(kind: pa.DataType) -> pa.DataType:
    if kind == pa.string_view():
        return pa.large_string()
    if kind == pa.binary_view():
        return pa.large_binary()
    if pa.types.is_list(kind) or pa.types.is_list_view(kind):
        return pa.list_(kind.value_field.with_type(_without_views(kind.value_type)))
    if pa.types.is_large_list(kind) or pa.types.is_large_list_view(kind):
        return pa.large_list(kind.value_field.with_type(_without_views(kind.value_type)))
    if pa.types.is_fixed_size_list(kind):
        return pa.list_(kind.value_field.with_type(_without_views(kind.value_type)), kind.list_size)
    if pa.types.is_map(kind):
        return pa.map_(
            kind.key_field.with_type(_without_views(kind.key_type)),
            kind.item_field.with_type(_without_views(kind.item_type)),
            kind.keys_sorted,
        )
    if pa.types.is_struct(kind):
        return pa.struct([kind.field(i).with_type(_without_views(kind.field(i).type)) for i in range(kind.num_fields)])
    if pa.types.is_dictionary(kind):
        return pa.dictionary(kind.index_type, _without_views(kind.value_type), kind.ordered)
    return kind


def widest_types(schemas: dict[str, pa.Schema]) -> dict[str, pa.DataType]:
    """The one type for each column whose values the sources hold in types that differ only in width, lossless
    either way: dictionary-encoded or not, string and large_string, binary and large_binary, integers of one
    signedness, and floats. Other differences (int and float, string and binary, ...) are left for the caller to
    refuse."""
    types: dict[str, set[pa.DataType]] = {}
    for schema in schemas.values():
        for column in schema:
            types.setdefault(column.name, set()).add(column.type)
    widest = {}
    for name, both in types.items():
        kinds = {t.value_type if pa.types.is_dictionary(t) else t for t in both} - {pa.null()}
        if len(both) == 1 or not kinds:
            continue  # one type already (a column dictionary-encoded in every source stays so)
        if len(kinds) == 1:
            widest[name] = kinds.pop()
        elif kinds <= {pa.string(), pa.large_string()}:
            widest[name] = pa.large_string()
        elif kinds <= {pa.binary(), pa.large_binary()}:
            widest[name] = pa.large_binary()
        elif (
            all(pa.types.is_signed_integer(k) for k in kinds)
            or all(pa.types.is_unsigned_integer(k) for k in kinds)
            or all(pa.types.is_floating(k) for k in kinds)
        ):
            widest[name] = max(kinds, key=lambda k: k.bit_width)
    return widest


def check_valid_values(data: pa.RecordBatch | pa.Table, path: Path, rows: int | np.ndarray) -> None:
    """Refuse values arrow reads from parquet but that break whatever reads them next: above all text that is not
    UTF-8, which a string column written by other tools can hold and which arrow reads as it is (a tokenizer,
    Python and every reader of an output decode it). `rows`: the file row of the data's first row, or of each row.
    One pass of arrow's full validation over the data; bisecting for the row only once it fails."""
    try:
        data.validate(full=True)
        return
    except pa.ArrowInvalid:
        pass
    for name, column in zip(data.schema.names, data.columns):
        values = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        try:
            values.validate(full=True)
        except pa.ArrowInvalid as exc:
            bad = _first_invalid_row(values)
            row = int(rows[bad]) if isinstance(rows, np.ndarray) else rows + bad
            if "utf8" in str(exc).lower().replace("-", ""):
                what, fix = (
                    "holds bytes that are not UTF-8 text",
                    "write the column as UTF-8 (decode with errors='replace')",
                )
            else:
                what, fix = f"holds a value arrow rejects ({str(exc).splitlines()[0]})", "re-create the file"
            raise UserError(path, f"row {row} (from 0): column '{name}' {what}", fix) from None


def _first_invalid_row(values: pa.Array) -> int:
    """The first row whose value fails full validation: the shortest failing prefix, by bisection."""
    valid, invalid = 0, len(values)  # the first `valid` rows pass; the first `invalid` rows fail
    while invalid - valid > 1:
        middle = (valid + invalid) // 2
        prefix = values.slice(0, middle)
        if pa.types.is_nested(values.type):  # a slice keeps all its children's values, which validate whole
            prefix = prefix.take(pa.array(np.arange(middle)))
        try:
            prefix.validate(full=True)
            valid = middle
        except pa.ArrowInvalid:
            invalid = middle
    return invalid - 1


def readable(data: pa.RecordBatch | pa.Table) -> pa.RecordBatch | pa.Table:
    """A batch or table read from parquet, in `readable_schema` (unchanged, not copied, when it has no views)."""
    schema = readable_schema(data.schema)
    return data if schema.equals(data.schema) else data.cast(schema)


@dataclass
class DocumentSource:
    """A streamable set of parquet files, schema-checked up front; nothing is read whole into memory."""

    spec: str
    files: list[Path]
    manifest: dict | None
    folder: Path | None
    schema: pa.Schema
    file_rows: list[int] = field(default_factory=list)
    file_labels: list[str] = field(default_factory=list)
    """How to name each file to a reader: its path under the files' common folder without `.parquet`, i.e. the
    stem of files side by side, and `en/000` apart from `fr/000` in a per-language layout."""
    file_bytes: list[int] = field(default_factory=list)
    """Each file's size uncompressed, as its footer records it (its row groups' total_byte_size): about what it
    takes decoded."""
    column_file_bytes: dict[str, list[int]] = field(default_factory=dict)
    """For each column named when the source was opened (open_documents' `sized_columns`), each file's bytes of it
    before compression, as its footer records them."""
    partitions: list[dict[str, str | None]] = field(default_factory=list)
    """Each file's Hive partition values (`lang=en/` → {"lang": "en"}), read as columns after the files' own (see
    `hive_partitions`); empty where the input is not partitioned."""

    @property
    def num_rows(self) -> int:
        return sum(self.file_rows)

    @property
    def columns(self) -> list[str]:
        return list(self.schema.names)

    def check_output_spares(self, output: str | Path, role: str = "the input", shards: Sequence[str] = ()) -> None:
        """Refuse an OUTPUT that is this input or holds any of its files: --overwrite (or a failed run's clean-up)
        would delete the data being read. Or one inside the input folder, or one holding any of `shards` (the
        parquet files the command writes, relative to OUTPUT) where the input's glob would find them: the next run
        would read it as input. `role` names this source in the message (the input, or the reference of
        --against)."""
        out = Path(output).resolve()
        if self.folder is not None and Path(self.folder).resolve() in out.parents:
            raise UserError(
                output,
                f"is inside {role} folder {self.folder}, whose files are all read: the next run would read it too",
                f"write the output beside {role} folder",
            )
        if self.folder is None and glob_base(self.spec) is not None and _glob_reaches(self.spec, out, shards):
            raise UserError(
                output,
                f"is where {role} pattern {self.spec} finds files: the next run would read the output too",
                "write the output where the pattern does not reach",
            )
        # A folder's files are under it (a symlinked one is not removed with OUTPUT): the folder alone is checked.
        refuse_output_over_inputs(output, [self.folder] if self.folder else self.files, role)

    def require(self, *columns: str, text: Sequence[str] = (), flags: Mapping[str, str] | None = None) -> None:
        """Every named column must exist; those in `text` must hold strings. A missing column's error names the
        flag that chose it (`flags`: column → flag; text columns default to --text-column) and the columns there are."""
        for name in (*columns, *text):
            if name not in self.schema.names:
                flag = (flags or {}).get(name) or ("--text-column" if name in text else None)
                where = f"pass one of them with {flag}" if flag else "pass one of them"
                raise UserError(
                    self.spec,
                    f"has no column '{name}' (columns: {', '.join(self.schema.names)})",
                    where if self.schema.names else "check the input",
                )
        for name in text:
            kind = self.schema.field(name).type
            if pa.types.is_dictionary(kind):  # pandas categoricals: strings stored once, read back decoded
                kind = kind.value_type
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):  # views were read as large_string
                # Named by kind for bytes: a binary_view column is read as large_binary, a name its writer never saw.
                held = "bytes" if pa.types.is_binary(kind) or pa.types.is_large_binary(kind) else kind
                raise UserError(self.spec, f"column '{name}' holds {held}, not text", "pass a column of strings")

    def lineage(self) -> list[dict]:
        if self.folder is not None:
            return [lineage_ref(self.folder, self.manifest)]
        return [{"path": str(Path(f).resolve()), "kind": None, "manifest_sha256": None} for f in self.files[:1000]]

    def iter_file_batches(
        self,
        index: int,
        columns: Sequence[str] | None = None,
        batch_size: int = 8192,
        threads: bool = True,
        validated: Sequence[str] = (),
    ) -> Iterator[pa.RecordBatch]:
        """Batches of one file; threads=False decodes in this thread only (for callers that run one process
        per core, where arrow's thread pool, sized to the whole machine, would only contend with them). Every
        batch is checked (`check_valid_values`) but for the `validated` columns, which the caller read and
        checked before from this same file.

        A file without rows gives one empty batch: callers that build a table per file still get its columns."""
        path = self.files[index]
        try:
            handle = pq.ParquetFile(path)
            # All columns in the source's order: a file may order them differently from the first.
            columns = list(columns) if columns is not None else list(self.schema.names)
            partitioned = [name for name in columns if name in self._partition_names()]
            in_file = [name for name in columns if name not in partitioned]
            # Read as the source's schema: a file holding views, or a narrower type than another shard, is cast
            # (decided once per file; most files are read as they are).
            wanted = pa.schema([self.schema.field(name) for name in in_file])
            written = handle.schema_arrow
            as_written = pa.schema([written.field(name) for name in in_file]).equals(wanted)
            if handle.metadata.num_rows == 0:
                yield pa.RecordBatch.from_pylist([], schema=pa.schema([self.schema.field(n) for n in columns]))
                return
            row = 0
            for batch in handle.iter_batches(batch_size=batch_size, columns=in_file, use_threads=threads):
                if batch.schema.names != in_file:
                    batch = batch.select(in_file)
                batch = batch if as_written else batch.cast(wanted)
                check_valid_values(batch.drop_columns(list(validated)) if validated else batch, path, row)
                row += batch.num_rows
                yield self.with_partitions(batch, index, columns) if partitioned else batch
        except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
            raise unreadable_parquet(path, exc) from exc

    def column_bytes(self, name: str) -> int:
        """The bytes of column `name` (one of the `sized_columns` the source was opened with) over all files before
        compression, as their footers record them: about the text a string column holds (plus four bytes of length
        per value), but a dictionary-encoded column's repeated values once; 0 for a partition column, which no file
        holds."""
        return sum(self.column_file_bytes[name])

    def iter_batches(self, columns: Sequence[str] | None = None, batch_size: int = 8192) -> Iterator[pa.RecordBatch]:
        for index in range(len(self.files)):
            yield from self.iter_file_batches(index, columns, batch_size)

    def _partition_names(self) -> list[str]:
        return list(self.partitions[0]) if self.partitions else []

    def with_partitions(self, data: pa.RecordBatch | pa.Table, index: int, columns: Sequence[str] | None = None):
        """`data` (read from file `index`) with its partition values as columns, in `columns`' order (default: the
        source's)."""
        columns = list(columns) if columns is not None else list(self.schema.names)
        values = self.partitions[index] if self.partitions else {}
        arrays = {
            name: pa.array([values[name]] * data.num_rows, pa.string()).cast(self.schema.field(name).type)
            if name in values
            else data.column(name)
            for name in columns
        }
        kind = pa.RecordBatch if isinstance(data, pa.RecordBatch) else pa.Table
        return kind.from_arrays(list(arrays.values()), schema=pa.schema([self.schema.field(n) for n in columns]))


def open_documents(
    spec: str | Path, columns: Sequence[str] | None = None, sized_columns: Sequence[str] = ()
) -> DocumentSource:
    """Open a dataset folder, a plain folder of parquet files, a single parquet file or a glob. `columns`: the
    only ones the command reads (pack and train-tokenizer read the text): where every file holds them, the files
    need to agree on those alone (pandas writes an integer column with a null in it as float64 in that shard
    only). `sized_columns`: the columns whose bytes the caller needs (`DocumentSource.column_bytes`), taken from
    the footers as they are read (each column of each row group costs a lookup: only these are summed)."""
    spec = home_expanded(spec)
    files, manifest, folder = resolve_parquet_files(spec)
    schemas: list[pa.Schema] = []
    rows: list[int] = []
    sizes: list[int] = []
    column_sizes: dict[str, list[int]] = {name: [] for name in sized_columns}
    for path in files:
        _check_parquet_magic(path)
        meta = read_footer(path)
        try:
            file_schema = pq.read_schema(path)
        except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
            raise unreadable_parquet(path, exc) from exc
        schemas.append(readable_schema(file_schema.remove_metadata()))
        rows.append(meta.num_rows)
        sizes.append(sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)))
        for name, size in footer_column_bytes(meta, sized_columns).items():
            column_sizes[name].append(size)
    root = Path(os.path.commonpath([file.parent for file in files]))
    labels = [str(file.relative_to(root).with_suffix("")) for file in files]
    if columns is not None and all(set(columns) <= set(schema.names) for schema in schemas):
        schemas = [pa.schema([schema.field(name) for name in columns]) for schema in schemas]
    schema = common_schema(files, schemas, root)
    base = folder if folder is not None else glob_base(str(spec))
    partitions = hive_partitions(files, base) if base is not None and manifest is None else []
    names = [name for name in (partitions[0] if partitions else {}) if name not in schema.names]
    partitions = [{name: values[name] for name in names} for values in partitions] if names else []
    kinds = [partition_type([values[name] for values in partitions]) for name in names]
    schema = pa.schema([*schema, *(pa.field(name, kind) for name, kind in zip(names, kinds))])
    return DocumentSource(str(spec), files, manifest, folder, schema, rows, labels, sizes, column_sizes, partitions)


def footer_column_bytes(meta: pq.FileMetaData, names: Sequence[str]) -> dict[str, int]:
    """A file's bytes before compression of each of the columns `names`, summed over its row groups (0 for one
    the file does not hold). A top-level column's path is its name, dots and all."""
    if not names:
        return {}
    index = {meta.schema.column(i).path: i for i in range(meta.num_columns)}
    groups = [meta.row_group(g) for g in range(meta.num_row_groups)]
    return {
        name: sum(group.column(index[name]).total_uncompressed_size for group in groups) if name in index else 0
        for name in names
    }


def unreadable_parquet(path: Path, exc: Exception) -> UserError:
    return UserError(
        path,
        f"cannot be read as parquet ({str(exc).splitlines()[0]})",
        "the file is corrupt or truncated; re-create it",
    )


def read_footer(path: Path) -> pq.FileMetaData:
    try:
        return pq.read_metadata(path)
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
        raise unreadable_parquet(path, exc) from exc


def home_expanded(spec: str | Path) -> str | Path:
    """A leading `~` or `~user` expanded as the shell would: a glob reaches smolctl whole only when quoted, and
    quoted, the shell leaves its `~` alone. A path that exists as written (a folder named `~`) is read as written."""
    text = str(spec)
    return os.path.expanduser(text) if text.startswith("~") and not Path(text).exists() else spec


def _glob_reaches(pattern: str, folder: Path, files: Sequence[str]) -> bool:
    """Whether `pattern` (as glob.glob(recursive=True) reads it) matches any of `files` (relative to the resolved
    `folder`). The pattern's leading folders are resolved too: through a link, it reads the same files."""
    parts = Path(pattern).parts
    fixed = next(i for i, part in enumerate(parts) if globlib.has_magic(part))
    wanted = Path(*parts[:fixed]).resolve().parts + parts[fixed:] if fixed else Path.cwd().parts + parts
    return any(_parts_match(wanted, (folder / file).parts) for file in files)


def _parts_match(pattern: Sequence[str], parts: Sequence[str]) -> bool:
    """Path parts against glob parts as glob.glob reads them: `**` is any number of folders, anything else one
    name (fnmatch); a wildcard never matches a name starting with a dot."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        visible = next((i for i, part in enumerate(parts) if part.startswith(".")), len(parts))
        return any(_parts_match(pattern[1:], parts[i:]) for i in range(visible + 1))
    if not parts or (parts[0].startswith(".") and not pattern[0].startswith(".")):
        return False
    return fnmatch.fnmatchcase(parts[0], pattern[0]) and _parts_match(pattern[1:], parts[1:])


def glob_base(pattern: str) -> Path | None:
    """The folder a glob's matches are under (its leading parts without wildcards), where partition folders
    start, as pyarrow's partition_base_dir; None for a path that is not a glob."""
    if not globlib.has_magic(pattern) or Path(pattern).exists():
        return None
    parts = Path(pattern).parts
    fixed = next(i for i, part in enumerate(parts) if globlib.has_magic(part))
    return Path(*parts[:fixed]) if fixed else Path(".")


HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"
"""The folder name Hive and Spark give a partition whose value is null."""


def _unescaped(text: str) -> str:
    """A partition folder's key or value as written: Hive and Spark escape `/`, `=`, `%` and the like as %XX."""
    if "%" not in text:
        return text
    from urllib.parse import unquote  # only here: a start-up cost every plain folder would pay

    return unquote(text)


def partition_type(values: list[str | None]) -> pa.DataType:
    """A partition column's type as pyarrow's Hive discovery infers it: int32 where every value is an integer
    that fits, else string (a wider integer stays text, as there)."""
    present = [value for value in values if value is not None]
    if not present or not all(re.fullmatch("-?[0-9]+", value) for value in present):
        return pa.string()
    return pa.int32() if all(-(2**31) <= int(value) < 2**31 for value in present) else pa.string()


def hive_partitions(files: list[Path], folder: Path) -> list[dict[str, str | None]]:
    """Each file's Hive partition values, from the `key=value` folders between `folder` and the file (as Spark,
    pyarrow and pandas write a partitioned dataset; values URL-decoded, as they are escaped there); [] when no
    file is under such a folder. Every file must be under the same keys in the same order."""
    folder, found = Path(folder).absolute(), []  # the files are absolute
    for file in files:
        between = file.relative_to(folder).parts[:-1] if file.is_relative_to(folder) else ()
        pairs = [part.split("=", 1) for part in between if part.find("=") > 0]
        found.append({_unescaped(key): None if value == HIVE_NULL else _unescaped(value) for key, value in pairs})
    if not any(found):
        return []
    first = next(values for values in found if values)
    for file, values in zip(files, found):
        if list(values) != list(first):
            raise UserError(
                folder,
                f"is partitioned by {', '.join(first) or 'nothing'} in one place and by "
                f"{', '.join(values) or 'nothing'} at {file.relative_to(folder)}",
                "pass one partitioned dataset (its files under the same key=value folders)",
            )
    return found


def common_schema(files: list[Path], schemas: list[pa.Schema], root: Path) -> pa.Schema:
    """The one schema a source's files are read in: the first file's columns in its order, each in the widest
    type any file holds it in where the types differ only in width (`widest_types`), nullable where any file's
    is. Files may order their columns differently (writers do); any other difference is refused, naming it."""
    widest = widest_types({str(path): schema for path, schema in zip(files, schemas)})
    first = schemas[0]
    # Named under the files' common folder (`root`): en/train-00000.parquet, not a name every language's split shares.
    first_name = str(files[0].relative_to(root))
    for path, schema in zip(files[1:], schemas[1:]):
        if schema.equals(first):
            continue
        extra = [n for n in schema.names if n not in first.names]
        missing = [n for n in first.names if n not in schema.names]
        retyped = [
            n
            for n in first.names
            if n in schema.names and widest.get(n, first.field(n).type) != widest.get(n, schema.field(n).type)
        ]
        if extra or missing or retyped or len(schema.names) != len(first.names):
            differences = [
                *([f"has {', '.join(extra)}, which {first_name} lacks"] if extra else []),
                *([f"lacks {', '.join(missing)}"] if missing else []),
                *(f"holds {n} as {schema.field(n).type} where {first_name} has {first.field(n).type}" for n in retyped),
            ] or ["repeats a column name"]
            raise UserError(
                path,
                f"has other columns than {first_name}: {'; '.join(differences)}",
                "make all shards share one schema",
            )
    nullable = {field.name for schema in schemas for field in schema if field.nullable}
    return pa.schema([f.with_type(widest.get(f.name, f.type)).with_nullable(f.name in nullable) for f in first])


@dataclass
class PackedSource:
    """A packed folder: safetensors shards of fixed-length rows, with the manifest that describes them."""

    folder: Path
    manifest: dict
    files: list[Path]

    @property
    def seq_len(self) -> int:
        return int(self.manifest["seq_len"])

    @property
    def num_rows(self) -> int:
        return int(self.manifest["rows"])

    @property
    def shard_rows(self) -> list[int]:
        return [int(s["rows"]) for s in self.manifest["shards"]]

    def load_shard(self, index: int) -> dict[str, np.ndarray]:
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        path = self.files[index]
        try:
            return load_file(str(path))
        except (SafetensorError, OSError, ValueError) as exc:
            raise UserError(
                path, f"cannot be read as safetensors ({exc})", "the shard is corrupt or truncated; re-run pack"
            ) from exc


def packed_shape_problems(folder: Path, manifest: dict) -> list[str]:
    """Shards whose tensors are not the manifest's [rows, seq_len] (read from their headers only): a hand-edited
    row count would have training read past a shard's end, or quietly other rows than it meant."""
    from safetensors import SafetensorError, safe_open

    problems = []
    for shard in manifest.get("shards", []):
        path = Path(folder) / shard["name"]
        if not path.is_file():
            continue  # reported as missing
        want = [int(shard["rows"]), int(manifest["seq_len"])]
        try:
            with safe_open(str(path), "numpy") as tensors:
                shapes = {name: tensors.get_slice(name).get_shape() for name in ("input_ids", "position_ids")}
        except (SafetensorError, OSError, KeyError) as exc:
            problems.append(f"{path}: cannot be read as packed rows ({str(exc).splitlines()[0]})")
            continue
        problems += [
            f"{path}: {name} is {shape}, the manifest says {want} (rows, seq_len)"
            for name, shape in shapes.items()
            if list(shape) != want
        ]
    return problems


def open_packed(spec: str | Path) -> PackedSource:
    path = Path(spec)
    if not path.exists():
        raise UserError(path, "no such folder", "check the path")
    if not path.is_dir():
        raise UserError(path, "is a file, not a packed folder", "pass the folder written by `smolctl pack`")
    manifest = read_manifest(path)
    if manifest is None:
        raise UserError(path, "has no manifest.json, so it is not a packed folder", "create it with `smolctl pack`")
    if manifest["kind"] == KIND_TOKENS:
        raise UserError(
            path,
            "holds datatrove token files (pack --format datatrove), for nanotron, not packed rows",
            "pack its documents again without --format datatrove",
        )
    if manifest["kind"] != KIND_PACKED:
        raise UserError(path, f"is a {manifest['kind']} folder, not a packed folder", "run `smolctl pack` on it first")
    files = check_listed_shards(path, manifest)
    problems = packed_shape_problems(path, manifest)
    if problems:
        where, what = problems[0].split(": ", 1)
        raise UserError(where, what, "the manifest and its shards disagree; re-run pack")
    return PackedSource(path, manifest, files)


# ---------------------------------------------------------------------------------------------------------------
# Verification


def verify_checksums(folder: Path, manifest: dict | None = None) -> list[str]:
    """Problems found comparing each shard with the manifest's size and sha256 (empty when all match)."""
    folder = Path(folder)
    manifest = manifest or read_manifest(folder)
    if manifest is None:
        raise UserError(
            folder, "has no manifest.json to verify against", "only folders written by smolctl can be verified"
        )
    problems = []
    for shard in manifest.get("shards", []):
        problems += _file_problems(folder / shard["name"], shard.get("bytes"), shard["sha256"])
        for companion in ("index", "metadata"):  # a token file's document ends and its tokenizer line
            if f"{companion}_sha256" in shard:
                problems += _file_problems(folder / shard[companion], None, shard[f"{companion}_sha256"])
    for listed in manifest.get("files", []):  # a model's other files, a checkpoint's (sha256 since they were recorded)
        problems += _file_problems(folder / listed["name"], listed["bytes"], listed.get("sha256"))
    problems += _unlisted_shards(folder, manifest)
    if manifest.get("kind") == KIND_PACKED and not problems:
        problems += packed_shape_problems(folder, manifest)
    return problems


def _file_problems(path: Path, size: int | None, sha256: str | None) -> list[str]:
    """The one problem of a listed file (missing, another size, another sha256), checked cheapest first."""
    if not path.is_file():
        return [f"{path}: missing"]
    if size is not None and path.stat().st_size != size:
        return [f"{path}: size {path.stat().st_size} != {size} in the manifest"]
    if sha256 is not None and sha256_file(path) != sha256:
        return [f"{path}: sha256 differs from the manifest"]
    return []


SHARD_SUFFIXES = {
    KIND_DOCUMENTS: ".parquet",
    KIND_PACKED: ".safetensors",
    KIND_TOKENS: ".ds",
    KIND_MODEL: ".safetensors",
}


def _unlisted_shards(folder: Path, manifest: dict) -> list[str]:
    """Files beside the shards that look like one but are not in the manifest: every reader goes by the manifest,
    so data copied into a finished folder is never read, and nothing else would say so."""
    suffix = SHARD_SUFFIXES.get(manifest.get("kind"))
    if suffix is None:
        return []
    listed = {shard["name"] for shard in manifest.get("shards", [])} | {f["name"] for f in manifest.get("files", [])}
    return [
        f"{path}: not listed in the manifest, so no reader reads it"
        for path in sorted(folder.iterdir())
        if path.name.lower().endswith(suffix)
        and not path.name.startswith(".")
        and path.name not in listed
        and path.is_file()
    ]

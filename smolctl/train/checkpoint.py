"""Checkpoints that resume at any world size, saved off the training loop's critical path.

    RUN/checkpoints/step-0000500/   .metadata, __R_0.distcp   torch.distributed.checkpoint (DCP): model and AdamW
                                                              state, one file per rank, whatever the layout
                                    train_state.json          step, tokens, data position, guards, parent
                                    rng-rank00000.pt          one per rank
                                    config.json, generation_config.json, tokenizer files (for `smolctl export`)
                                    manifest.json             kind "checkpoint", written last: the save finished;
                                                              every file's size and sha256
    RUN/final/                      a Hugging Face folder (kind "model"), gathered from memory at the end

    smolctl export RUN/checkpoints/step-0000500 OUT           the same Hugging Face folder for any checkpoint

One format for one process, DDP and FSDP2: state dicts go through `torch.distributed.checkpoint.state_dict`, so
DTensor shards are saved as such and DCP reshards them on load; the data order is a function of the step, so a
run saved on 2 processes continues on 1 or 4. An asynchronous save (`dcp.async_save`, at most one in flight) copies
the state into CPU buffers allocated once and reused by every later save (pinned on GPUs), on a background
thread, while the loop runs the next forward and backward; the loop waits for that copy only before its next
optimizer step (`wait_for_staging`), the first moment the state changes, as torchtitan does. Another thread then
writes the files. A save becomes a checkpoint — manifest written, staging folder renamed, visible to
`--resume auto` — only once every rank has finished writing, so a crash during a save leaves the previous
checkpoint as the newest.
"""

from __future__ import annotations

import json
import pickle
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from smolctl.data.tokenizer import load_tokenizer
from smolctl.errors import UserError
from smolctl.folder_lock import FolderBusy, holds_output
from smolctl.shards import (
    KIND_MODEL,
    MANIFEST_NAME,
    OutputFolder,
    atomic_write_json,
    lineage_ref,
    read_manifest,
    remove_finished,
    sha256_file,
)
from smolctl.train.distributed import Dist
from smolctl.train.run import EVENTS, FINAL, RUN_FILE, TRAINER_STATE, append_jsonl, holds_trainer_checkpoints

KIND_CHECKPOINT = "checkpoint"
TRAIN_STATE = "train_state.json"
DCP_METADATA = ".metadata"
MODEL_KEY, OPTIMIZER_KEY = "model", "optimizer"
EXPORT_SHARD_BYTES = 2 * 1024**3  # safetensors shards of an export: bounded memory, HF's sharded layout
WRITTEN_DIGESTS = "sha256.json"  # .__R_sha256.json: the digests of the files rank R wrote, until the commit

# One process is a layout DCP handles like any other; its "assuming a single process" warning says nothing new.
warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)", category=UserWarning)


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:07d}"


def checkpoint_step(path: Path) -> int:
    return int(Path(path).name.split("-")[1])


def _is_complete(folder: Path) -> bool:
    manifest = read_manifest(folder) if (folder / MANIFEST_NAME).is_file() else None
    if not manifest or manifest.get("kind") != KIND_CHECKPOINT:
        return False
    return _first_incomplete_file(folder, manifest) is None


def check_saved_bytes(path: Path, flag: str, dist: Dist | None = None) -> None:
    """Refuse (one line) a checkpoint whose files differ from the sha256 they were saved with, before anything
    reads them: a flipped block in a shard would otherwise load as wrong weights and train on. Under `dist`, every
    rank hashes its share of the files, so the checkpoint is read about once whatever the world size."""
    damaged = saved_bytes_problem(path, dist)
    if damaged is not None:
        raise UserError(flag, f"{path}: {damaged}", "use an earlier checkpoint of the run")


def saved_bytes_problem(path: Path, dist: Dist | None = None) -> str | None:
    """The first file of the checkpoint whose bytes differ from its saved sha256, as a phrase (the same on every
    rank under `dist`, each hashing its share of the files); None when all match."""
    listed = (read_manifest(path) or {}).get("files", [])
    rank, world = (dist.rank, dist.world_size) if dist else (0, 1)
    damaged = _first_damaged_file(path, listed[rank::world])
    return dist.first_problem(damaged) if dist is not None else damaged


def _first_damaged_file(folder: Path, listed: list[dict]) -> str | None:
    """The first of the `listed` files whose bytes differ from the sha256 it was saved with, as a phrase; None
    when all match (a checkpoint saved before the manifest held digests has none to compare)."""
    for entry in listed:
        if entry.get("sha256") is not None and sha256_file(folder / entry["name"]) != entry["sha256"]:
            return f"{entry['name']} differs from the sha256 it was saved with (a damaged copy or disk)"
    return None


def _first_incomplete_file(folder: Path, manifest: dict) -> str | None:
    """The first file the manifest lists that is missing or of another size, as a phrase; None when all are there."""
    for listed in manifest["files"]:
        path = folder / listed["name"]
        if not path.is_file():
            return f"{listed['name']} is missing"
        if path.stat().st_size != listed["bytes"]:
            return f"{listed['name']} is {path.stat().st_size} bytes, not the {listed['bytes']} it was saved with"
    return None


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoints whose save finished (manifest written, every listed file present at its size), oldest first.
    Saves in progress live in hidden `.step-N.partial` folders and are never listed."""
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.glob("step-*") if _is_complete(p)), key=checkpoint_step)


@contextmanager
def damaged_checkpoint(path: Path, flag: str = "--resume") -> Iterator[None]:
    """Reading a checkpoint whose files are present at their sizes but damaged (a flipped block, a truncated
    config, an unreadable shard) fails deep in torch.distributed.checkpoint or pickle: one line naming it instead.
    DCP catches whatever a rank's read raised, Ctrl-C and out-of-memory included, into one CheckpointException (a
    BaseException): the error inside decides. Ctrl-C stays Ctrl-C; anything but a damaged file (an OOM, the
    process group, a state that does not fit) surfaces as it is."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (CheckpointException, Exception) as exc:
        root = _root_error(exc)
        if isinstance(root, KeyboardInterrupt):
            raise KeyboardInterrupt from None
        if not _is_damage(root):
            raise
        lines = str(root).strip().splitlines()
        cause = f"{type(root).__name__}: {lines[-1][:200]}" if lines else type(root).__name__
        raise UserError(
            flag,
            f"{path} cannot be read: {cause}",
            "check its files (permissions, a damaged copy), or use an earlier checkpoint of the run",
        ) from exc


def _root_error(exc: BaseException) -> BaseException:
    """The innermost error: DCP wraps each rank's failure, (error, stack), in its CheckpointException."""
    failures = getattr(exc, "failures", None)
    if failures:
        first = next(iter(failures.values()))
        exc = first[0] if isinstance(first, tuple) else first
    while True:
        inner = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        if inner is None:
            return exc
        exc = inner


def _is_damage(error: BaseException) -> bool:
    """A file that cannot be read or decoded: pickle, JSON, the zip of a torch.save, or the file system."""
    if isinstance(error, (pickle.UnpicklingError, EOFError, OSError, json.JSONDecodeError, UnicodeDecodeError)):
        return True
    return isinstance(error, RuntimeError) and "PytorchStreamReader" in str(error)  # torch.load of a broken zip


def refuse_run_folder(folder: Path, flag: str, fix: str) -> None:
    """One line where a run folder is given in place of one of its checkpoints or its model; `fix` names what to
    pass, with {checkpoint} standing for the run's newest complete checkpoint."""
    if not (folder / RUN_FILE).is_file():
        return
    newest = complete_checkpoints(folder)
    unfinished = "" if (folder / FINAL / "config.json").is_file() else " without a final model yet"
    if unfinished and holds_trainer_checkpoints(folder):  # TRL's checkpoints: nothing export or --from takes
        raise UserError(
            flag,
            f"{folder} is a post-training run folder{unfinished}",
            "wait for it to finish, or continue it with --resume auto: RUN/final is the model to pass",
        )
    checkpoint = str(newest[-1]) if newest else "RUN/checkpoints/step-NNNNNNN (it has saved none yet)"
    raise UserError(flag, f"{folder} is a training run folder{unfinished}", fix.format(checkpoint=checkpoint))


def check_checkpoint(path: str | Path, flag: str) -> dict:
    """The manifest of a complete checkpoint, or one UserError naming `flag` (the option or argument given)."""
    folder = Path(path)
    if folder.is_file():
        raise UserError(flag, f"{folder} is a file, not a checkpoint folder", "pass RUN/checkpoints/step-NNNNNNN")
    if not folder.is_dir():
        raise UserError(flag, f"{folder}: no such checkpoint folder", "pass RUN/checkpoints/step-NNNNNNN")
    refuse_run_folder(folder, flag, "pass one of its checkpoints, e.g. {checkpoint}")
    manifest = read_manifest(folder)
    if manifest is None and (folder / TRAINER_STATE).is_file() and (folder / "config.json").is_file():
        raise UserError(
            flag,
            f"{folder} is a post-training checkpoint (TRL's), already a Hugging Face model folder",
            "pass it where a model is wanted as it is (--from, --model); it needs no export",
        )
    if manifest is None:
        raise UserError(
            flag,
            f"{folder} is not a complete checkpoint (no manifest.json: its save never finished)",
            "pass one of the run's RUN/checkpoints/step-NNNNNNN folders",
        )
    if manifest.get("kind") != KIND_CHECKPOINT:
        raise UserError(
            flag,
            f"{folder} is a {manifest.get('kind')} folder, not a training checkpoint",
            "pass one of the run's RUN/checkpoints/step-NNNNNNN folders",
        )
    incomplete = _first_incomplete_file(folder, manifest)
    if incomplete is not None:
        raise UserError(flag, f"{folder}: {incomplete}", "use an earlier checkpoint of the run")
    return manifest


# ---- what is saved: each part has state_dict / load_state_dict (DCP's Stateful protocol) -----------------------


class ModelState:
    """The model's parameters by fully qualified name (DDP's `module.` and compile's `_orig_mod.` removed);
    DTensors under FSDP2 / tensor parallel."""

    def __init__(self, model):
        self.model = model

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, state)


class OptimizerState:
    """AdamW moments keyed by parameter name, not position, so a different wrapping finds its own."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, state)


def rng_state() -> dict:
    import torch

    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class CheckpointManager:
    """Owns what is saved (model, optimizer, train state, RNG), when it becomes visible, and how (sync or async).

    Every rank calls `save`, `wait` and `load` at the same points of the loop; rank 0 alone commits."""

    def __init__(
        self,
        run_dir: Path,
        *,
        model,
        optimizer,
        dist: Dist,
        keep: int,
        async_save: bool,
        export_interval: int,
        write_model_files: Callable[[Path], None],
        inputs: Callable[[], list[dict]],
    ):
        self.run_dir, self.model, self.optimizer, self.dist = Path(run_dir), model, optimizer, dist
        self.keep, self.async_save, self.export_interval = keep, async_save, export_interval
        self.write_model_files, self.inputs = write_model_files, inputs
        # A background thread waits for the save in flight and commits it the moment it is written, so a crash
        # soon after still finds it; `_pending` is that thread's future.
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="smolctl-checkpoint")
        self._pending: Future | None = None
        self._staging: Future | None = None  # the copy of the save in flight into the stager's CPU buffers
        self._exporting: Future | None = None
        self._stager = None  # CPU buffers for async saves, allocated once and reused by every later save
        self.process_group = None
        if dist.active:
            import torch.distributed as torch_dist

            # DCP's background thread runs collectives; on their own gloo group they never interleave with the
            # training loop's (and async_save needs a CPU backend even when training uses NCCL).
            self.process_group = torch_dist.new_group(backend="gloo")

    def _state(self, optimizer: bool = True) -> dict:
        state = {MODEL_KEY: ModelState(self.model)}
        if optimizer:
            state[OPTIMIZER_KEY] = OptimizerState(self.model, self.optimizer)
        return state

    def save(self, step: int, *, train_state: dict, fields: dict, blocking: bool) -> float:
        """Start (or, with `blocking`, finish) the save of `step`; returns the seconds the loop was held."""
        import torch
        import torch.distributed.checkpoint as dcp

        started = time.perf_counter()
        self.wait(barrier=False)  # at most one save in flight
        path = checkpoint_path(self.run_dir, step)
        output = None
        if self.dist.is_main:
            output = OutputFolder(path, kind=KIND_CHECKPOINT, overwrite=True, inputs=self.inputs())
            atomic_write_json(output.file(TRAIN_STATE), train_state)
            self.write_model_files(output.staging)
        self.dist.barrier()  # the staging folder exists before any rank writes into it
        staging = path.parent / f".{path.name}.partial"
        torch.save(rng_state(), staging / f"rng-rank{self.dist.rank:05d}.pt")
        options = {
            "storage_writer": _digest_recording_writer(staging),
            "process_group": self.process_group,
            "no_dist": not self.dist.active,
        }
        fields = {"step": step, **fields}
        if blocking or not self.async_save:
            dcp.save(self._state(), **options)
            self._commit(output, fields)
            self.dist.barrier()
        else:
            if self._stager is None:
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                # Pinned host memory and a side stream make the device-to-host copy fast and off the compute stream
                # on GPUs; on CPU neither exists. The copy runs on the stager's thread (use_async_staging).
                on_gpu = torch.cuda.is_available()
                self._stager = DefaultStager(
                    StagingOptions(
                        use_pinned_memory=on_gpu,
                        use_shared_memory=False,
                        use_async_staging=True,
                        use_non_blocking_copy=on_gpu,
                    )
                )
            # Returns at once; the previous save has finished, so the buffers the copy reuses are free.
            response = dcp.async_save(self._state(), async_stager=self._stager, **options)
            self._staging = response.staging_completion
            self._pending = self._committer.submit(
                self._commit_when_written, response.upload_completion, output, fields
            )
        return time.perf_counter() - started

    def wait_for_staging(self) -> float:
        """Before anything changes the model or optimizer state (the optimizer step, a restore): wait until the
        save in flight has copied it; returns the seconds waited."""
        if self._staging is None:
            return 0.0
        started = time.perf_counter()
        staging, self._staging = self._staging, None
        staging.result()
        return time.perf_counter() - started

    def wait(self, *, barrier: bool = True) -> None:
        """Finish the save in flight (if any) and commit it; with `barrier`, every rank then sees it."""
        self.wait_for_staging()
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()  # re-raises a failed write (disk full, ...) instead of hiding it
        if barrier:
            self.dist.barrier()

    def _commit_when_written(self, written: Future, output: OutputFolder | None, fields: dict) -> None:
        written.result()
        self._commit(output, fields)

    def _commit(self, output: OutputFolder | None, fields: dict) -> None:
        """Rank 0 (the only one with an output): manifest, rename into place, prune, maybe export."""
        if output is None:
            return
        # Rank 0's save finishes after DCP's coordinator gathered every rank's write results: all shards are on disk,
        # and so is each rank's record of their digests. Rank 0 hashes only the small files (metadata, RNG, config).
        digests: dict[str, str] = {}
        for record in sorted(output.staging.glob(f".*{WRITTEN_DIGESTS}")):
            digests.update(json.loads(record.read_text()))
            record.unlink()
        files = [
            {"name": entry.name, "bytes": entry.stat().st_size, "sha256": digests.get(entry.name) or sha256_file(entry)}
            for entry in sorted(output.staging.iterdir())
            if entry.is_file()
        ]
        output.commit(files=files, **fields)
        append_jsonl(
            self.run_dir / EVENTS,
            {"event": "checkpoint", "step": fields["step"], "path": str(output.path), "time": time.time()},
        )
        self._finish_export()
        for old in complete_checkpoints(self.run_dir)[: -self.keep]:
            remove_finished(old)
        if self.export_interval and fields["step"] % self.export_interval == 0:
            export = ThreadPoolExecutor(max_workers=1, thread_name_prefix="smolctl-export")
            self._exporting = export.submit(
                export_checkpoint,
                output.path,
                self.run_dir / "exports" / output.path.name,
                overwrite=True,
                check_bytes=False,
            )
            export.shutdown(wait=False)

    def load(self, path: Path, *, optimizer: bool = True, flag: str = "--resume") -> dict:
        """Restore the model (and optimizer) in place from `path`, whatever world size saved it; this rank's RNG
        when the same rank saved one; returns the train state."""
        import torch
        import torch.distributed.checkpoint as dcp

        path = Path(path)
        with damaged_checkpoint(path, flag):
            dcp.load(
                self._state(optimizer),
                checkpoint_id=str(path),
                process_group=self.process_group,
                no_dist=not self.dist.active,
            )
            rng_file = path / f"rng-rank{self.dist.rank:05d}.pt"
            saved_world = len(list(path.glob("rng-rank*.pt")))
            if rng_file.is_file() and saved_world == self.dist.world_size:
                set_rng_state(torch.load(rng_file, weights_only=True))
            return json.loads((path / TRAIN_STATE).read_text())

    def discard_after(self, step: int) -> list[Path]:
        """Rank 0: delete the checkpoints newer than `step` (they may hold a bad incident's updates)."""
        doomed = [p for p in complete_checkpoints(self.run_dir) if checkpoint_step(p) > step]
        if self.dist.is_main:
            for path in doomed:
                remove_finished(path)
        self.dist.barrier()
        return doomed

    def _finish_export(self) -> None:
        """Wait for the export in flight (the checkpoint it reads must outlive it)."""
        if self._exporting is None:
            return
        try:
            self._exporting.result()
        except FolderBusy as busy:  # someone's own `smolctl export` into that folder: theirs stands, the run goes on
            append_jsonl(self.run_dir / EVENTS, {"event": "export_skipped", "reason": busy.line(), "time": time.time()})
        self._exporting = None

    def close(self) -> None:
        self.wait(barrier=False)
        self._finish_export()
        self._committer.shutdown()
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def _digest_recording_writer(staging: Path):
    """DCP's file writer, which also records the sha256 of the files this rank wrote (`.__R_sha256.json`), hashed
    while they are still in the page cache and, for an async save, on the thread that wrote them: rank 0 lists every
    shard's digest in the manifest without reading the other ranks' shards."""
    from torch.distributed.checkpoint import FileSystemWriter

    class DigestRecordingWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            written = super().write_data(plan, planner)
            names = sorted({result.storage_data.relative_path for result in written.wait()})
            atomic_write_json(
                staging / f".{plan.storage_data.prefix}{WRITTEN_DIGESTS}",
                {name: sha256_file(staging / name) for name in names},
            )
            return written

    return DigestRecordingWriter(str(staging))


def check_model_shapes(path: Path, model, flag: str = "--resume") -> None:
    """Refuse (one line) a checkpoint whose weights do not fit `model` (an unwrapped model), before DCP fails deep."""
    from torch.distributed.checkpoint import FileSystemReader

    with damaged_checkpoint(path, flag):
        metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    saved = {
        k[len(MODEL_KEY) + 1 :]: tuple(v.size)
        for k, v in metadata.items()
        if k.startswith(MODEL_KEY + ".") and hasattr(v, "size")
    }
    own = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    differ = sorted(name for name in own.keys() & saved.keys() if own[name] != saved[name])
    missing = sorted(own.keys() - saved.keys())
    if differ or missing:
        what = (
            f"{differ[0]} is {list(saved[differ[0]])} there but {list(own[differ[0]])} here"
            if differ
            else f"it has no {missing[0]}"
        )
        raise UserError(
            path, f"holds a different model ({what})", "make [model] match the recipe that wrote the checkpoint"
        )


# ---- Hugging Face folders from checkpoints ---------------------------------------------------------------------


@holds_output(lambda checkpoint, out, **kwargs: out)
def export_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    *,
    overwrite: bool = False,
    shard_bytes: int = EXPORT_SHARD_BYTES,
    flag: str = "CHECKPOINT",
    check_bytes: bool = True,
) -> dict:
    """A DCP checkpoint → a Hugging Face folder `from_pretrained` loads, streamed tensor group by tensor group
    (memory stays near `shard_bytes` whatever the model size), on CPU, with a manifest whose parent is the
    checkpoint. Returns the manifest. `check_bytes=False` skips re-hashing the files against their sha256, for
    the run's own export of the checkpoint it has just written and hashed."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemReader

    source = Path(checkpoint)
    manifest = check_checkpoint(source, flag)
    if check_bytes:
        check_saved_bytes(source, flag)
    with damaged_checkpoint(source, flag):
        tied = json.loads((source / "config.json").read_text()).get("tie_word_embeddings", False)
        metadata = FileSystemReader(str(source)).read_metadata().state_dict_metadata
    if (source / "tokenizer.json").is_file():  # copied as it is: damaged, it would make a folder that never loads
        try:
            load_tokenizer(source)
        except UserError as exc:
            raise UserError(
                flag,
                f"{source}'s tokenizer cannot be read: {exc.what}",
                "check its files (a damaged copy), or use an earlier checkpoint of the run",
            ) from None
    tensors = {
        key[len(MODEL_KEY) + 1 :]: meta
        for key, meta in metadata.items()
        if key.startswith(MODEL_KEY + ".") and hasattr(meta, "size")
    }
    if tied:
        tensors.pop("lm_head.weight", None)  # HF folders store a tied embedding once
    groups: list[list[str]] = [[]]
    group_bytes = 0
    for name, meta in tensors.items():
        size = meta.size.numel() * meta.properties.dtype.itemsize
        if groups[-1] and group_bytes + size > shard_bytes:
            groups.append([])
            group_bytes = 0
        groups[-1].append(name)
        group_bytes += size
    output = OutputFolder(out, kind=KIND_MODEL, overwrite=overwrite, inputs=[lineage_ref(source)])
    with output:
        for entry in source.iterdir():
            if (
                entry.is_file()
                and entry.name not in (MANIFEST_NAME, TRAIN_STATE, DCP_METADATA)
                and not entry.name.endswith(".distcp")
                and not entry.name.startswith("rng-rank")
            ):
                shutil.copy2(entry, output.file(entry.name))
        name_architecture(output.file("config.json"))  # checkpoints written before their config named it
        names = (
            ["model.safetensors"]
            if len(groups) == 1
            else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
        )
        weight_map = {}
        for name, group in zip(names, groups):
            part = {
                f"{MODEL_KEY}.{k}": torch.empty(tuple(tensors[k].size), dtype=tensors[k].properties.dtype)
                for k in group
            }
            with damaged_checkpoint(source, flag):
                dcp.load(part, checkpoint_id=str(source), no_dist=True)
            save_file({k: part[f"{MODEL_KEY}.{k}"] for k in group}, str(output.file(name)), metadata={"format": "pt"})
            del part
            weight_map.update({k: name for k in group})
            output.add_shard(name, rows=0)
        if len(names) > 1:
            total = sum(tensors[k].size.numel() * tensors[k].properties.dtype.itemsize for k in weight_map)
            atomic_write_json(
                output.file("model.safetensors.index.json"),
                {"metadata": {"total_size": total}, "weight_map": weight_map},
            )
        kept = {
            k: manifest[k]
            for k in ("stage", "step", "tokens_seen", "parameters", "tokenizer", "recipe", "identity", "stats")
            if k in manifest
        }
        return output.commit(parent=str(source.resolve()), **kept)


def name_architecture(config_file: Path) -> None:
    """Write the model's own class into config.json's `architectures`, which vLLM and the hub pick the
    implementation by: save_pretrained writes the class of the object it is called on, and FSDP2 renames a
    sharded model's class FSDP<Name> (a checkpoint's config, saved alone, names none at all)."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = json.loads(config_file.read_text())
    model_type = config.get("model_type")
    # transformers' lazy mapping has no working .get: it reads only what was loaded already
    config_class = CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None  # noqa: SIM401
    if config_class is None or config_class not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return  # a model transformers does not know: its config names what its own code wrote
    config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING[config_class].__name__]
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")  # as transformers writes it


def save_model_folder(
    path: Path, *, model, wrapped, tokenizer, dist: Dist, inputs: list[dict], parent: str | None, fields: dict
) -> Path:
    """RUN/final: the full weights gathered from memory (every rank takes part under FSDP) into a Hugging Face
    folder that rank 0 writes atomically."""
    from transformers.utils import logging as hf_logging

    from smolctl.train.distributed import full_state_dict

    hf_logging.disable_progress_bar()  # our own progress line is the only one on the console
    # Only sharded models need a gather; otherwise save_pretrained reads the model's own tensors (no copy).
    weights = full_state_dict(wrapped, dist) if dist.sharded else None
    if weights is not None and model.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # the gathered dict repeats the tied embedding; HF folders store it once
    if dist.is_main:
        output = OutputFolder(path, kind=KIND_MODEL, overwrite=True, inputs=inputs)
        model.save_pretrained(str(output.staging), state_dict=weights)
        name_architecture(output.staging / "config.json")
        tokenizer.save_pretrained(str(output.staging))
        for weights_file in sorted(output.staging.glob("*.safetensors")):
            output.add_shard(weights_file.name, rows=0)
        output.commit(parent=parent, **fields)
    dist.barrier()
    return path


def check_model_folder(path: str | Path, *, need_optimizer: bool = False) -> str:
    """A `--from` folder: a Hugging Face model folder ("model") or a complete training checkpoint ("checkpoint")."""
    folder = Path(path)
    if not folder.is_dir():
        raise UserError(
            "--from", f"{folder}: no such checkpoint folder", "pass RUN/final or RUN/checkpoints/step-NNNNNNN"
        )
    manifest = read_manifest(folder) or {}
    if manifest.get("kind") == KIND_CHECKPOINT:
        check_checkpoint(folder, "--from")
        return KIND_CHECKPOINT
    refuse_run_folder(folder, "--from", "pass its newest checkpoint, {checkpoint}")
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        raise UserError(
            "--from",
            f"{folder}: incomplete model folder (no config.json or *.safetensors)",
            "pass a finished checkpoint; a partial one (killed while saving) is not usable",
        )
    if manifest and manifest.get("kind") != KIND_MODEL:
        raise UserError("--from", f"{folder}: is a {manifest.get('kind')} folder, not a model", "pass a model folder")
    if need_optimizer:
        raise UserError(
            "--keep-optimizer",
            f"{folder} holds no optimizer state",
            "pass a RUN/checkpoints/step-NNNNNNN folder, or drop --keep-optimizer",
        )
    return KIND_MODEL


def packed_digest(path: str | Path) -> str:
    """What a packed folder holds, not where it is: its shards' checksums and rows, seq_len and tokenizer."""
    import hashlib

    from smolctl.shards import open_packed

    manifest = open_packed(path).manifest
    content = {
        "shards": [[s["sha256"], s["rows"]] for s in manifest["shards"]],
        "seq_len": manifest["seq_len"],
        "tokenizer": (manifest.get("tokenizer") or {}).get("fingerprint"),
    }
    return hashlib.sha256(json.dumps(content).encode()).hexdigest()[:16]


def run_identity(recipe, global_batch: int) -> dict:
    """What a resumed run must share with the run it continues: the model, the data by content (the same folder
    moved or named another way is the same data; another folder at the same path is not), and the numbers that
    fix the data order (seed, seq_len, and the rows of a step, `global_batch`, as the batch plan resolved them: a
    recipe that leaves the global batch to micro_batch × world size gets another one on another world size, and
    global_batch_tokens = global_batch × seq_len is the same batch). Its length, micro batch and schedule may
    change."""
    model = recipe.model.model_dump(exclude={"tokenizer"})  # the data's tokenizer fingerprint stands for it
    data = recipe.data
    stages = [
        {"start_step": s.start_step, "weights": s.weights, "folders": [packed_digest(p) for p in s.paths]}
        for s in data.stage_list()
    ]
    training = {"seed": recipe.training.seed, "seq_len": recipe.training.seq_len, "global_batch_rows": global_batch}
    return {
        "model": model,
        "data": {"stages": stages, "validation": packed_digest(data.validation) if data.validation else None},
        "training": training,
    }


def check_same_identity(saved: dict | None, current: dict, where: Path, recipe) -> None:
    """UserError naming the first recipe key whose value (or data content) differs from the saved run's."""
    if saved is None:
        raise UserError(where, "records no run identity (written by an older smolctl)", "start a new run folder")
    then, now = saved["training"].get("global_batch_rows"), current["training"].get("global_batch_rows")
    if then is not None and then != now:
        raise UserError(
            "training.global_batch",
            f"the run trained {then} rows a step and this launch would train {now} (micro_batch × data-parallel "
            "ranks, when global_batch is not set)",
            f"set training.global_batch = {then} to resume it here",
        )
    # The training keys both record: a run saved before the rows of a step were recorded compares the recipe's.
    keys = {"model": current["model"].keys() | saved["model"].keys()}
    keys["training"] = (current["training"].keys() & saved["training"].keys()) - {"global_batch_rows"}
    for section in ("model", "training"):
        for key in sorted(keys[section]):
            if saved[section].get(key) != current[section].get(key):
                raise UserError(
                    f"{section}.{key}",
                    f"differs from the run being resumed ({saved[section].get(key)!r} → {current[section].get(key)!r})",
                    "resume with the recipe the run started with, or start a new run",
                )
    stages_now, stages_then = current["data"]["stages"], saved["data"]["stages"]
    if [(s["start_step"], s["weights"], len(s["folders"])) for s in stages_now] != [
        (s["start_step"], s["weights"], len(s["folders"])) for s in stages_then
    ]:
        raise UserError(
            "data",
            "its stages or weights differ from the run being resumed",
            "resume with the recipe the run started with, or start a new run",
        )
    for stage, now, then in zip(recipe.data.stage_list(), stages_now, stages_then):
        for path, digest, before in zip(stage.paths, now["folders"], then["folders"]):
            if digest != before:
                raise UserError(
                    path,
                    "holds other data than the folder the run was trained on (shard checksums or tokenizer differ)",
                    "pass the packed folders the run started with, or start a new run",
                )
    if current["data"]["validation"] != saved["data"]["validation"]:
        raise UserError(
            "data.validation",
            "holds other data than the run's validation folder",
            "pass the validation folder the run started with",
        )

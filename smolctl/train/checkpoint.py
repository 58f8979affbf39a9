"""Checkpoints that Hugging Face loads as they are, and that resume a run bit for bit.

    RUN/checkpoints/step-0000500/   config.json, model.safetensors, tokenizer files, generation_config.json
                                    manifest.json (kind "model": lineage, parent, step, tokens)
                                    trainer_state.pt (step, tokens, data position, guards), optimizer.pt
                                    (or optimizer/ via torch.distributed.checkpoint when distributed),
                                    rng-rank00000.pt (one per rank)
    RUN/final/                      the finished model: the same HF folder and manifest, no trainer state

Each checkpoint is written into a hidden staging folder and renamed into place after its manifest, so a kill
at any moment leaves only complete checkpoints; `--resume auto` takes the newest one that has a manifest.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from smolctl.errors import UserError
from smolctl.shards import KIND_MODEL, MANIFEST_NAME, OutputFolder, read_manifest
from smolctl.train.distributed import Dist, full_state_dict

TRAINER_STATE = "trainer_state.pt"
OPTIMIZER_FILE = "optimizer.pt"
OPTIMIZER_DCP = "optimizer"


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:07d}"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoints with a manifest and trainer state, oldest first (staging folders are hidden and skipped)."""
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    found = [p for p in folder.glob("step-*") if (p / MANIFEST_NAME).is_file() and (p / TRAINER_STATE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def save_model_folder(path: Path, *, model, tokenizer, dist: Dist, inputs: list[dict], parent: str | None,
                      fields: dict, optimizer=None, wrapped=None, trainer_state: dict | None = None) -> Path:
    """Write an HF model folder (plus trainer state when `trainer_state` is given) atomically. Every rank calls
    this: under FSDP all ranks gather the weights and all write their optimizer shards."""
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress line is the only one on the console
    # Only FSDP needs a gather; otherwise save_pretrained reads the model's own tensors (no copy).
    weights = full_state_dict(wrapped, dist) if dist.sharded else None
    if weights is not None and model.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # the gathered dict repeats the tied embedding; HF folders store it once
    staging = path.parent / f".{path.name}.partial"
    output = None
    if dist.is_main:
        output = OutputFolder(path, kind=KIND_MODEL, overwrite=True, inputs=inputs)
        model.save_pretrained(str(output.staging), state_dict=weights)
        tokenizer.save_pretrained(str(output.staging))
    dist.barrier()
    if trainer_state is not None:
        if dist.active:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            dcp.save({"optimizer": get_optimizer_state_dict(wrapped, optimizer)}, checkpoint_id=str(staging / OPTIMIZER_DCP))
        else:
            torch.save(optimizer.state_dict(), staging / OPTIMIZER_FILE)
        torch.save(rng_state(), staging / f"rng-rank{dist.rank:05d}.pt")
        if dist.is_main:
            torch.save(trainer_state, staging / TRAINER_STATE)
    dist.barrier()
    if dist.is_main:
        for weights_file in sorted(output.staging.glob("*.safetensors")):
            output.add_shard(weights_file.name, rows=0)
        output.commit(parent=parent, **fields)
    dist.barrier()
    return path


def prune_checkpoints(run_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints; returns what was deleted."""
    doomed = complete_checkpoints(run_dir)[:-keep]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def load_trainer_state(path: Path, *, optimizer, wrapped, dist: Dist) -> dict:
    """Restore the optimizer and this rank's RNG state from a checkpoint; returns the loop's state dict."""
    import torch

    if optimizer is not None:
        if dist.active:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

            if not (path / OPTIMIZER_DCP).is_dir():
                raise UserError(path, "holds no distributed optimizer state (it was saved by a single process)",
                                "resume with the world size it was saved with")
            state = {"optimizer": get_optimizer_state_dict(wrapped, optimizer)}
            dcp.load(state, checkpoint_id=str(path / OPTIMIZER_DCP))
            set_optimizer_state_dict(wrapped, optimizer, state["optimizer"])
        else:
            if not (path / OPTIMIZER_FILE).is_file():
                raise UserError(path, "holds no single-process optimizer state (it was saved under torchrun)",
                                "resume with the world size it was saved with")
            optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, weights_only=True))
    rng_file = path / f"rng-rank{dist.rank:05d}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=True))
    return torch.load(path / TRAINER_STATE, weights_only=True)


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


def check_model_folder(path: str | Path, *, need_optimizer: bool = False) -> dict:
    """A `--from` folder must be a complete model folder written by smolctl (or a plain HF folder with weights)."""
    folder = Path(path)
    if not folder.is_dir():
        raise UserError("--from", f"{folder}: no such checkpoint folder", "pass RUN/final or RUN/checkpoints/step-NNNNNNN")
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        raise UserError("--from", f"{folder}: incomplete model folder (no config.json or *.safetensors)",
                        "pass a finished checkpoint; a partial one (killed while saving) is not usable")
    manifest = read_manifest(folder) or {}
    if manifest and manifest.get("kind") != KIND_MODEL:
        raise UserError("--from", f"{folder}: is a {manifest.get('kind')} folder, not a model", "pass a model folder")
    if need_optimizer and not (folder / OPTIMIZER_FILE).is_file() and not (folder / OPTIMIZER_DCP).is_dir():
        raise UserError("--keep-optimizer", f"{folder} holds no optimizer state",
                        "pass a RUN/checkpoints/step-NNNNNNN folder, or drop --keep-optimizer")
    return manifest

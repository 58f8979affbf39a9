"""`--dry-run`: the resolved recipe, the exact parameter count (model built on the meta device, nothing
allocated), the parallel layout and batch arithmetic, and memory / time from `smolctl estimate`'s model (the
same function on the same scenario, so the two commands agree), without touching any data.

    smolctl pretrain recipes/smollm3.toml --dry-run --world-size 384 --gpu h100
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from smolctl.data.tokenizer import load_tokenizer
from smolctl.errors import UserError
from smolctl.infra.estimate import compute, largest_micro_batch, load_model, memory, smallest_layouts
from smolctl.infra.memory import GPUS
from smolctl.infra.scenario import TrainingScenario, check_scenario, present_values, recipe_values, trainer_layout
from smolctl.results import Result
from smolctl.shards import KIND_PACKED, read_manifest
from smolctl.train.config import Layout, TrainRecipe, derive_batch, resolve_layout
from smolctl.train.model import build_config, build_model, count_parameters
from smolctl.train.parallel import tp_plan


def _data_status(path: str, seq_len: int) -> str:
    folder = Path(path)
    if not folder.is_dir():
        return "missing"
    manifest = read_manifest(folder)
    if manifest is None or manifest.get("kind") != KIND_PACKED:
        return "not a packed folder"
    if int(manifest.get("seq_len", -1)) != seq_len:
        return f"seq_len {manifest.get('seq_len')} ≠ {seq_len}"
    return f"ok ({manifest.get('tokens') or 0:,} tokens)"


def _vocab_size(recipe: TrainRecipe) -> int:
    if recipe.model.vocab_size:
        return recipe.model.vocab_size
    spec = recipe.model.tokenizer
    if spec is None:
        manifests = [read_manifest(Path(p)) for p in recipe.data.all_paths() if Path(p).is_dir()]
        spec = next((m["tokenizer"]["path"] for m in manifests if m and m.get("tokenizer")), None)
    if spec is None:
        raise UserError(
            "model.vocab_size",
            "is unknown: no model.tokenizer, vocab_size or readable packed folder",
            "set model.vocab_size (or model.tokenizer) for a dry run",
        )
    return len(load_tokenizer(spec))


def estimate_scenario(
    recipe: TrainRecipe, *, vocab: int, world_size: int, gpu: str, layout: Layout
) -> TrainingScenario:
    """The `smolctl estimate` scenario of this recipe on this layout: what `estimate RECIPE --gpus N` would size."""

    raw = present_values(recipe)
    raw["model"]["vocab_size"] = vocab
    values = recipe_values(raw, "recipe")
    values.update(gpus=world_size, gpu=gpu, source="recipe", **trainer_layout(layout.tp, layout.dp_shard))
    return check_scenario(TrainingScenario(**values))


def _runnable_layouts(recipe: TrainRecipe, scenario: TrainingScenario, shape, *, vocab: int, gpu: str) -> list[dict]:
    """estimate's layouts that fit (its smolctl framework: tp × FSDP2/HSDP data parallel), as recipe keys, each
    priced as the recipe with those keys would run (without FSDP the trainer runs amp, not bf16 weights): what
    the suggestion says is what applying it gives."""
    recompute = {"none": "none", "full": "full"}
    found: dict[tuple, dict] = {}
    for option in smallest_layouts(replace(scenario, framework="smolctl"), shape, top=20)["layouts"]:
        if option["pp"] == 1 and option["cp"] == 1 and option["recompute"] in recompute:
            keys = {
                "parallel.tp": option["tp"],
                "parallel.dp_shard": option["dp_shard"],
                "parallel.dp_replicate": option["dp_replicate"],
                "training.shard": option["zero"] == 3,
                "training.activation_checkpointing": recompute[option["recompute"]],
            }
            if tuple(keys.values()) in found:
                continue
            applied = recipe.model_copy(
                update={
                    "parallel": recipe.parallel.model_copy(
                        update={k.split(".")[1]: v for k, v in keys.items() if k.startswith("parallel.")}
                    ),
                    "training": recipe.training.model_copy(
                        update={k.split(".")[1]: v for k, v in keys.items() if k.startswith("training.")}
                    ),
                }
            )
            try:  # estimate replicates KV heads over a tp above their count; pretrain's tp must divide them
                layout = resolve_layout(applied, scenario.gpus)
            except UserError:
                continue
            sized = estimate_scenario(applied, vocab=vocab, world_size=scenario.gpus, gpu=gpu, layout=layout)
            held = memory(sized, shape)
            if held["fits"]:
                found[tuple(keys.values())] = {**keys, "total": held["total"]}
    return list(found.values())[:3]


@dataclass
class DryRun(Result):
    """What `pretrain --dry-run` found without training: the resolved recipe, the batch arithmetic, memory per GPU,
    the time estimate and each data folder's status; `would_fit` when the recipe does not fit."""

    recipe: dict
    parameters: int
    non_embedding_parameters: int
    vocab_size: int
    world_size: int
    layout: dict
    data_parallel: int
    micro_batch: int
    global_batch: int
    grad_accum: int
    tokens_per_step: int
    steps: int
    total_tokens: int
    flops_per_token: float
    total_flops: float
    memory: dict
    estimate: dict
    data: dict[str, str]
    would_fit: dict | None = None

    def to_dict(self) -> dict:
        return {key: value for key, value in asdict(self).items() if value is not None or key != "would_fit"}


def dry_run(recipe: TrainRecipe, *, world_size: int, gpu: str = "h100") -> DryRun:
    if gpu not in GPUS:
        raise UserError("--gpu", f"{gpu!r} is not known", f"known: {', '.join(GPUS)}")
    training = recipe.training
    layout = resolve_layout(recipe, world_size)
    plan = derive_batch(training, recipe.schedule, world_size, layout)
    vocab = _vocab_size(recipe)
    config = build_config(recipe.model, vocab_size=vocab, seq_len=training.seq_len, eos_id=None, pad_id=None)
    tp_plan(config, layout.tp)
    counts = count_parameters(build_model(config, device="meta", attention=training.attention))
    sizing = estimate_scenario(recipe, vocab=vocab, world_size=world_size, gpu=gpu, layout=layout)
    model_config, shape = load_model(sizing)
    held = memory(sizing, shape)
    timing = compute(sizing, model_config, shape)
    total_tokens = plan.steps * plan.tokens_per_step
    result = DryRun(
        recipe=json.loads(recipe.model_dump_json()),
        parameters=counts["total"],
        non_embedding_parameters=counts["non_embedding"],
        vocab_size=vocab,
        world_size=world_size,
        layout=asdict(layout),
        data_parallel=plan.data_parallel,
        micro_batch=plan.micro_batch,
        global_batch=plan.global_batch,
        grad_accum=plan.grad_accum,
        tokens_per_step=plan.tokens_per_step,
        steps=plan.steps,
        total_tokens=total_tokens,
        flops_per_token=timing["flops_per_token"],
        total_flops=timing["flops_per_token"] * total_tokens,
        memory=held,
        estimate={
            "gpu": gpu,
            "assumed_mfu": sizing.mfu,
            "gpu_hours": timing["gpu_hours"],
            "days": timing["time"]["days"],
        },
        data={
            path: _data_status(path, training.seq_len)
            for path in recipe.data.all_paths() + ([recipe.data.validation] if recipe.data.validation else [])
        },
    )
    if not held["fits"]:
        result.would_fit = {
            "largest_micro_batch": largest_micro_batch(sizing, shape),
            "layouts": _runnable_layouts(recipe, sizing, shape, vocab=vocab, gpu=gpu),
        }
    return result

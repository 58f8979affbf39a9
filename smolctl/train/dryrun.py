"""`--dry-run`: the resolved recipe, the exact parameter count (model built on the meta device, nothing
allocated), the batch arithmetic, and a memory / time estimate, without touching any data.

    smolctl pretrain recipes/smollm3.toml --dry-run --world-size 192
"""

from __future__ import annotations

import json
from pathlib import Path

from smolctl.errors import UserError
from smolctl.shards import KIND_PACKED, read_manifest
from smolctl.train.config import TrainRecipe, derive_batch

BYTES_PER_PARAM_TRAINING = 16  # fp32 weights 4 + fp32 gradients 4 + AdamW moments 8 (bf16 autocast keeps fp32 masters)
REFERENCE_GPU = ("H100", 989e12)  # dense bf16 peak used for the time estimate
ASSUMED_MFU = 0.40  # what a well-tuned dense 1-3B run reaches on H100s (SmolLM3 reports ~40%)


def _activation_bytes(config, seq_len: int, micro_batch: int, checkpointing: bool) -> float:
    """Per-device activation memory of one micro batch in bf16: Korthikanti et al. 2022 (eq. 2, no TP, flash/SDPA
    attention so the s² score term vanishes) ≈ 34·s·b·h per layer; with checkpointing only each layer's input
    (2·s·b·h) is kept. Plus the fp32 logits and their gradient (8·s·b·V)."""
    per_layer = (2 if checkpointing else 34) * seq_len * micro_batch * config.hidden_size
    return per_layer * config.num_hidden_layers + 8.0 * seq_len * micro_batch * config.vocab_size


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
    from smolctl.data.tokenizer import load_tokenizer

    spec = recipe.model.tokenizer
    if spec is None:
        manifests = [read_manifest(Path(p)) for p in recipe.data.all_paths() if Path(p).is_dir()]
        spec = next((m["tokenizer"]["path"] for m in manifests if m and m.get("tokenizer")), None)
    if spec is None:
        raise UserError("model.vocab_size", "is unknown: no model.tokenizer, vocab_size or readable packed folder",
                        "set model.vocab_size (or model.tokenizer) for a dry run")
    return len(load_tokenizer(spec))


def dry_run(recipe: TrainRecipe, *, world_size: int) -> dict:
    from smolctl.infra.flops import training_flops_per_token
    from smolctl.train.model import build_config, build_model, count_parameters

    training = recipe.training
    plan = derive_batch(training, recipe.schedule, world_size)
    vocab = _vocab_size(recipe)
    config = build_config(recipe.model, vocab_size=vocab, seq_len=training.seq_len, eos_id=None, pad_id=None)
    counts = count_parameters(build_model(config, device="meta", attention=training.attention))
    flops_per_token = training_flops_per_token(config, training.seq_len)
    total_tokens = plan.steps * plan.tokens_per_step
    states = BYTES_PER_PARAM_TRAINING * counts["total"] / (world_size if training.shard else 1)
    activations = _activation_bytes(config, training.seq_len, training.micro_batch, training.gradient_checkpointing)
    gpu, peak = REFERENCE_GPU
    gpu_hours = flops_per_token * total_tokens / (peak * ASSUMED_MFU) / 3600
    return {
        "recipe": json.loads(recipe.model_dump_json()),
        "parameters": counts["total"], "non_embedding_parameters": counts["non_embedding"], "vocab_size": vocab,
        "world_size": world_size, "micro_batch": plan.micro_batch, "global_batch": plan.global_batch,
        "grad_accum": plan.grad_accum, "tokens_per_step": plan.tokens_per_step, "steps": plan.steps,
        "total_tokens": total_tokens, "flops_per_token": flops_per_token, "total_flops": flops_per_token * total_tokens,
        "memory_per_device": {"weights_grads_optimizer": states, "activations": activations, "total": states + activations},
        "estimate": {"reference_gpu": gpu, "assumed_mfu": ASSUMED_MFU, "gpu_hours": gpu_hours,
                     "wall_hours_on_world": gpu_hours / world_size},
        "data": {path: _data_status(path, training.seq_len) for path in recipe.data.all_paths()
                 + ([recipe.data.validation] if recipe.data.validation else [])},
    }

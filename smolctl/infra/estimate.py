"""`smolctl estimate`: parameters, memory per GPU, compute, time and cost of a training run, from a recipe or
flags, without allocating the model (it is built on the meta device).

    smolctl estimate recipes/smollm3.toml --gpus 384 --tp 2 --tokens 11.2T --mfu 0.30
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, replace
from importlib import metadata
from itertools import product
from pathlib import Path
from types import SimpleNamespace

from smolctl import __version__

from smolctl.errors import UserError
from smolctl.shards import atomic_write_json
from smolctl.infra.flops import attention_flops_per_token, training_flops_per_token
from smolctl.infra.memory import (ALLOCATOR_HEADROOM, FP32_SPEED, GIB, GPUS, OPTIMIZER_BYTES, PRECISIONS,
                                  RUNTIME_RESERVED_GIB, activations, logits_grad_bytes, stage_params, state_bytes)
from smolctl.infra.model_shape import ModelShape, ParamCounts, config_from_dict, measure_shape, resolve_config
from smolctl.infra.plan import Plan, accumulation, check_model_layout, data_parallel

# Llama 3 (Meta, 2024): 419 unexpected interruptions in 54 days on 16,384 H100s.
FAILURES_PER_GPU_DAY = 419 / (54 * 16384)
RESTART_HOURS = 0.25
"""Time to notice a failure, reschedule and reload the last checkpoint."""


# What compute() reads from the transformers config; cached beside the measured shape.
CONFIG_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                 "num_hidden_layers", "vocab_size")


def _shape_cache_path(model: dict | str) -> Path | None:
    """Where the meta-device measurement of this exact model is kept. Importing torch and transformers' modeling
    code costs seconds on a login node, while the measurement itself takes milliseconds: a repeat estimate of the
    same model reads the cache instead. The key covers the model table (or preset / config.json content) and the
    transformers and smolctl versions."""
    from smolctl.infra.model_shape import PRESETS

    if isinstance(model, dict):
        described = json.dumps(model, sort_keys=True, default=str)
    elif model in PRESETS:
        described = json.dumps(PRESETS[model], sort_keys=True, default=str)
    else:
        path = Path(model) / "config.json" if Path(model).is_dir() else Path(model)
        if not path.is_file():
            return None
        described = path.read_text(errors="replace")
    key = hashlib.sha256(f"{described}|{metadata.version('transformers')}|{__version__}".encode()).hexdigest()[:24]
    root = Path(os.environ.get("SMOLCTL_CACHE") or Path.home() / ".cache" / "smolctl")
    return root / "model-shapes" / f"{key}.json"


def transformers_config(plan: Plan):
    """The model's transformers config (imports transformers; --validate builds a real model from it)."""
    if isinstance(plan.model, dict):
        return config_from_dict(plan.model, f"{plan.source}: [model]")
    return resolve_config(plan.model)


def load_model(plan: Plan):
    """(config fields, shape measured on the meta device), from the cache when this model was measured before."""
    cache = _shape_cache_path(plan.model)
    if cache is not None and cache.is_file():
        try:
            cached = json.loads(cache.read_text())
            shape = ModelShape(**{**cached["shape"], "params": ParamCounts(**cached["shape"]["params"])})
            return SimpleNamespace(**cached["config"]), shape
        except (ValueError, TypeError, KeyError):
            pass  # an unreadable or older cache entry is measured again
    config = transformers_config(plan)
    shape = measure_shape(config)
    fields = {name: getattr(config, name, None) for name in CONFIG_FIELDS}
    if cache is not None:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(cache, {"config": fields, "shape": shape.to_dict()})
        except (OSError, UserError):
            pass  # the cache is an optimisation; a read-only home only costs the next run its imports
    return SimpleNamespace(**fields), shape


def memory(plan: Plan, shape: ModelShape) -> dict:
    """Bytes per GPU on the most loaded pipeline stage, and whether they fit the GPU."""
    precision = PRECISIONS[plan.precision]
    _, accumulate = accumulation(plan)
    stage_layers = math.ceil(shape.layers / plan.pp)
    in_flight = min(plan.pp, accumulate)  # 1F1B: the first stage holds pp micro batches' activations
    act = activations(shape, micro_batch=plan.micro_batch, seq_len=plan.seq_len, precision=precision,
                      attention=plan.attention, recompute=plan.recompute, layers=stage_layers, tp=plan.tp, cp=plan.cp,
                      sequence_parallel=plan.sequence_parallel, loss_chunk_tokens=plan.loss_chunk_tokens)
    shard = data_parallel(plan) * plan.cp
    stages = []
    for name, params, last in zip(("first", "last"), stage_params(shape, plan.pp), (plan.pp == 1, True)):
        states = state_bytes(params, shape.params.per_layer, precision=precision, optimizer=plan.optimizer,
                             zero=plan.zero, shard=shard, tp=plan.tp)
        held = in_flight if name == "first" else 1
        saved = held * (act.inputs + stage_layers * act.per_layer + act.weight_copies)
        saved += max(act.head if last else 0.0, act.recompute)
        logits = logits_grad_bytes(shape, micro_batch=plan.micro_batch, seq_len=plan.seq_len, tp=plan.tp, cp=plan.cp,
                                   sequence_parallel=plan.sequence_parallel,
                                   loss_chunk_tokens=plan.loss_chunk_tokens) if last else 0.0
        allocated = states.total + saved + logits
        stages.append((allocated, name, states, saved, logits))
    allocated, stage, states, saved, logits = max(stages, key=lambda s: s[0])
    headroom = allocated * ALLOCATOR_HEADROOM
    total = allocated + headroom + RUNTIME_RESERVED_GIB * GIB
    capacity = GPUS[plan.gpu].memory_gib * GIB
    return {
        "gpu": plan.gpu, "capacity": capacity, "stage": stage if plan.pp > 1 else "all",
        **asdict(states), "activations": saved,
        "activations_detail": act.to_dict(stage_layers), "micro_batches_in_flight": in_flight,
        "logits_grad": logits, "allocated": allocated, "allocator_headroom": headroom,
        "runtime_reserved": RUNTIME_RESERVED_GIB * GIB, "total": total, "fits": total <= capacity,
        "free": capacity - total,
    }


def overhead(plan: Plan, checkpoint_bytes: float) -> dict:
    """The wall-clock factor on top of FLOPs ÷ (MFU × peak), and why."""
    write_seconds = checkpoint_bytes / (plan.checkpoint_gbps * 1e9)
    checkpoint = write_seconds / (plan.checkpoint_hours * 3600)
    failures_per_day = FAILURES_PER_GPU_DAY * plan.gpus
    failure = failures_per_day * (RESTART_HOURS + plan.checkpoint_hours / 2) / 24
    computed = 1 + checkpoint + failure
    why = (f"--mfu is the steady-state MFU the training monitor measures, so data loading, gradient sync and pipeline "
           f"bubbles are already in it; on top: blocking checkpoint writes {checkpoint:.2%} "
           f"({checkpoint_bytes / 1e9:.0f} GB every {plan.checkpoint_hours:g} h at {plan.checkpoint_gbps:g} GB/s) and "
           f"failure recovery {failure:.2%} ({failures_per_day:.2f} interruptions/day at Llama 3's "
           f"{FAILURES_PER_GPU_DAY:.1e} per GPU-day, each a {RESTART_HOURS * 60:.0f} min restart plus half a "
           f"checkpoint interval of lost work)")
    if plan.overhead is not None:
        why = f"--overhead {plan.overhead:g} given (computed: {computed:.3f} — {why})"
    return {"factor": plan.overhead if plan.overhead is not None else computed, "checkpoint_fraction": checkpoint,
            "failure_fraction": failure, "checkpoint_write_seconds": write_seconds, "why": why}


def _duration(seconds: float) -> dict:
    return {"seconds": seconds, "hours": seconds / 3600, "days": seconds / 86400}


def compute(plan: Plan, config, shape: ModelShape) -> dict:
    precision = PRECISIONS[plan.precision]
    batch_tokens, accumulate = accumulation(plan)
    tokens = plan.tokens or batch_tokens
    per_token = training_flops_per_token(config, plan.seq_len, shape.params.matmul)
    peak = GPUS[plan.gpu].bf16_tflops * 1e12 * (FP32_SPEED if plan.precision == "fp32" else 1.0)
    per_gpu = plan.mfu * peak / per_token
    seconds = tokens * per_token / (plan.gpus * plan.mfu * peak)
    full_state = shape.params.total * (precision.param_bytes + precision.master_bytes + OPTIMIZER_BYTES[plan.optimizer])
    extra = overhead(plan, full_state)
    wall = seconds * extra["factor"]
    result = {
        "flops_per_token": per_token, "six_n": 6.0 * shape.params.matmul,
        "attention_flops_per_token": attention_flops_per_token(config, plan.seq_len),
        "tokens": tokens, "total_flops": tokens * per_token, "peak_flops_per_gpu": peak,
        "global_batch_tokens": batch_tokens, "gradient_accumulation": accumulate,
        "steps": math.ceil(tokens / batch_tokens), "step_seconds": batch_tokens / (per_gpu * plan.gpus),
        "tokens_per_second_per_gpu": per_gpu, "tokens_per_second": per_gpu * plan.gpus,
        "compute_time": _duration(seconds), "overhead": extra, "time": _duration(wall),
        "gpu_hours": plan.gpus * wall / 3600,
        "cost": plan.gpus * wall / 3600 * plan.price_per_gpu_hour if plan.price_per_gpu_hour else None,
        "checkpoint": {"bytes": full_state, "model_bytes": shape.params.total * 2,
                       "write_seconds": extra["checkpoint_write_seconds"], "gbps": plan.checkpoint_gbps},
        "pipeline_bubble": (plan.pp - 1) / (accumulate + plan.pp - 1) if plan.pp > 1 else 0.0,
        "recompute_flops_per_token": 2.0 * shape.params.matmul if plan.recompute == "full" else 0.0,
    }
    if plan.target_days:
        gpus = tokens * per_token * extra["factor"] / (plan.target_days * 86400 * plan.mfu * peak)
        result["gpus_for_target"] = {"days": plan.target_days,
                                     "gpus": math.ceil(gpus / plan.model_parallel) * plan.model_parallel}
    return result


def _fits(plan: Plan, shape: ModelShape) -> dict | None:
    try:
        check_model_layout(plan, shape.heads, shape.kv_heads, shape.layers)
    except UserError:  # a layout the model cannot take is simply not a candidate
        return None
    result = memory(plan, shape)
    return result if result["fits"] else None


def largest_micro_batch(plan: Plan, shape: ModelShape, limit: int = 1024) -> int | None:
    """Memory grows with the micro batch, so the first one that does not fit ends the search."""
    best = None
    size = 1
    while size <= limit and _fits(replace(plan, micro_batch=size), shape):
        best, size = size, size + 1 if size < 8 else size * 2
    return best


_RECOMPUTE_COST = {"none": 0, "selective": 1, "full": 2}


def smallest_layouts(plan: Plan, shape: ModelShape, top: int = 5) -> list[dict]:
    """Layouts that fit at the plan's micro batch, fastest first: no recompute before selective before full
    (full recompute costs a third more FLOPs, more than intra-node TP costs), then the fewest model-parallel GPUs,
    then ZeRO 0–2 before 3 (ZeRO-1/2 move the same bytes as an all-reduce, ZeRO-3 half as much again), then TP
    before PP (bubbles) before CP, then the most free memory."""
    found = []
    for tp, pp, cp, zero, recompute in product((1, 2, 4, 8), (1, 2, 4, 8, 16), (1, 2, 4, 8), (0, 1, 2, 3),
                                               ("none", "selective", "full")):
        if plan.gpus % (tp * pp * cp) or plan.seq_len % cp or (recompute == "selective" and plan.attention != "eager"):
            continue
        candidate = replace(plan, tp=tp, pp=pp, cp=cp, zero=zero, recompute=recompute)
        result = _fits(candidate, shape)
        if result:
            found.append(((_RECOMPUTE_COST[recompute], tp * pp * cp, zero == 3, pp, cp, -result["free"]),
                          {"tp": tp, "pp": pp, "cp": cp, "dp": plan.gpus // (tp * pp * cp), "zero": zero,
                           "recompute": recompute, "total": result["total"], "free": result["free"]}))
    return [layout for _, layout in sorted(found, key=lambda item: item[0])[:top]]


def estimate(plan: Plan, *, find: bool = False) -> dict:
    config, shape = load_model(plan)
    check_model_layout(plan, shape.heads, shape.kv_heads, shape.layers)
    batch_tokens, accumulate = accumulation(plan)
    notes = list(plan.notes)
    if plan.global_batch_tokens and batch_tokens != plan.global_batch_tokens:
        notes.append(f"global batch rounded up from {plan.global_batch_tokens} to {batch_tokens} tokens (a whole "
                     f"number of micro batches on each of the {data_parallel(plan)} data-parallel ranks)")
    if not shape.llama_like:
        notes.append(f"{shape.model_type} is not a Llama-family layer: activations are approximated with the "
                     "Llama formula; run --validate to measure them")
    if plan.recompute == "selective" and plan.attention != "eager":
        notes.append("selective recompute = recompute the attention core, which flash/sdpa kernels already do: "
                     "same memory as none")
    if plan.recompute == "full":
        notes.append("full recompute runs each layer's forward twice (+2N FLOPs/token of hardware work); give the "
                     "MFU measured with it (MFU does not count recomputation)")
    held = memory(plan, shape)
    if not held["fits"]:
        notes.append(f"does not fit {plan.gpu}: --find lists the layouts that do (or try --recompute full, a larger "
                     "--tp, a smaller --micro-batch)")
    loss_bytes = held["activations_detail"]["head"] + held["logits_grad"]
    if loss_bytes > 0.15 * held["capacity"]:
        notes.append(f"the loss over {shape.vocab} vocabulary entries holds {loss_bytes / 2**30:.1f} GiB (fp32 "
                     "log-softmax and its gradients): a chunked/fused cross-entropy (e.g. Liger's) avoids most of it")
    result = {
        "source": plan.source,
        "model": {"name": plan.model if isinstance(plan.model, str) else plan.model.get("architecture", "?"),
                  **shape.to_dict()},
        "layout": {"gpus": plan.gpus, "gpu": plan.gpu, "tp": plan.tp, "pp": plan.pp, "cp": plan.cp,
                   "dp": data_parallel(plan), "zero": plan.zero, "recompute": plan.recompute,
                   "attention": plan.attention, "precision": plan.precision, "optimizer": plan.optimizer,
                   "seq_len": plan.seq_len, "micro_batch": plan.micro_batch, "gradient_accumulation": accumulate,
                   "global_batch_tokens": batch_tokens, "mfu": plan.mfu},
        "memory": held,
        "compute": compute(plan, config, shape),
        "notes": notes,
    }
    if find:
        result["find"] = {"largest_micro_batch": largest_micro_batch(plan, shape),
                          "layouts": smallest_layouts(plan, shape)}
    return result

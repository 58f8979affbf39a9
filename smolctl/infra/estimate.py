"""`smolctl estimate`: parameters, memory per GPU, compute, time and cost of a training run, from a recipe or
flags, without allocating the model (it is built on the meta device).

    smolctl estimate recipes/smollm3.toml --gpus 384 --tp 2 --tokens 11.2T --mfu 0.30
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, replace
from importlib import metadata
from itertools import product
from pathlib import Path
from types import SimpleNamespace

from smolctl import __version__
from smolctl.errors import UserError
from smolctl.infra.flops import attention_flops_per_token, training_flops_per_token
from smolctl.infra.inference import InferenceScenario, check_inference, inference
from smolctl.infra.memory import (
    ALLOCATOR_HEADROOM,
    GIB,
    GPUS,
    OPTIMIZER_BYTES,
    PRECISIONS,
    RUNTIME_RESERVED_GIB,
    TF32_SPEED,
    activations,
    logits_grad_bytes,
    stage_params,
    state_bytes,
)
from smolctl.infra.model_shape import PRESETS, ModelShape, ParamCounts, config_from_dict, measure_shape, resolve_config
from smolctl.infra.scenario import TrainingScenario, accumulation, check_model_layout, data_parallel
from smolctl.results import Result
from smolctl.user_cache import cache_path, read_entry, save_entry

# Llama 3 (Meta, 2024): 419 unexpected interruptions in 54 days on 16,384 H100s.
FAILURES_PER_GPU_DAY = 419 / (54 * 16384)
RESTART_HOURS = 0.25
"""Time to notice a failure, reschedule and reload the last checkpoint."""
GPUS_PER_NODE = 8
STAGING_GBPS = 10.0
"""GPU → host memory copy of each GPU's checkpoint shard before an async write (PCIe, pageable memory)."""


# What compute() reads from the transformers config; cached beside the measured shape.
CONFIG_FIELDS = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "num_hidden_layers",
    "vocab_size",
)


def _shape_cache_path(model: dict | str) -> Path | None:
    """Where the meta-device measurement of this exact model is kept. Importing torch and transformers' modeling
    code is nearly all of a first estimate's time (benchmarks/RESULTS.md, "estimate"): a repeat estimate of the
    same model reads the cache instead. The key covers the model table (or preset / config.json content) and the
    transformers and smolctl versions."""
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
    return cache_path("model-shapes", f"{key}.json")


def transformers_config(scenario: TrainingScenario):
    """The model's transformers config (imports transformers; --validate builds a real model from it)."""
    if isinstance(scenario.model, dict):
        return config_from_dict(scenario.model, f"{scenario.source}: [model]")
    return resolve_config(scenario.model)


def load_model(scenario: TrainingScenario):
    """(config fields, shape measured on the meta device), from the cache when this model was measured before."""
    cache = _shape_cache_path(scenario.model)
    entry = read_entry(cache)
    if entry is not None:
        try:
            cached = json.loads(entry)
            shape = ModelShape(**{**cached["shape"], "params": ParamCounts(**cached["shape"]["params"])})
            return SimpleNamespace(**cached["config"]), shape
        except (ValueError, TypeError, KeyError):
            pass  # an unreadable or older cache entry is measured again
    config = transformers_config(scenario)
    shape = measure_shape(config)
    fields = {name: getattr(config, name, None) for name in CONFIG_FIELDS}
    save_entry(cache, json.dumps({"config": fields, "shape": shape.to_dict()}, indent=2, default=str).encode())
    return SimpleNamespace(**fields), shape


def memory(scenario: TrainingScenario, shape: ModelShape) -> dict:
    """Bytes per GPU on the most loaded pipeline stage, and whether they fit the GPU."""
    precision = PRECISIONS[scenario.precision]
    _, accumulate = accumulation(scenario)
    stage_layers = math.ceil(shape.layers / scenario.pp)
    in_flight = min(scenario.pp, accumulate)  # 1F1B: the first stage holds pp micro batches' activations
    act = activations(
        shape,
        micro_batch=scenario.micro_batch,
        seq_len=scenario.seq_len,
        precision=precision,
        attention=scenario.attention,
        recompute=scenario.recompute,
        layers=stage_layers,
        tp=scenario.tp,
        cp=scenario.cp,
        sequence_parallel=scenario.sequence_parallel,
        loss_chunk_tokens=scenario.loss_chunk_tokens,
    )
    shard = (scenario.dp_shard or data_parallel(scenario)) * scenario.cp
    # ZeRO-3 / FSDP gathers one unit at a time: a decoder layer, or the embedding or LM head (their own units in
    # torchtitan's wrapping) when those are larger, as with a large vocabulary on a small model
    largest_unit = max(shape.params.per_layer, shape.params.embedding, shape.params.lm_head)
    kv_per_layer = 2 * shape.hidden * shape.kv_dim
    stages = []
    for name, params, last in zip(("first", "last"), stage_params(shape, scenario.pp), (scenario.pp == 1, True)):
        states = state_bytes(
            params,
            largest_unit,
            precision=precision,
            optimizer=scenario.optimizer,
            zero=scenario.zero,
            shard=shard,
            tp=scenario.tp,
            kv_params=kv_per_layer * stage_layers,
            kv_heads=shape.kv_heads,
        )
        held = in_flight if name == "first" else 1
        saved = held * (act.inputs + stage_layers * act.per_layer + act.weight_copies)
        saved += max(act.head if last else 0.0, act.recompute)
        logits = (
            logits_grad_bytes(
                shape,
                micro_batch=scenario.micro_batch,
                seq_len=scenario.seq_len,
                tp=scenario.tp,
                cp=scenario.cp,
                sequence_parallel=scenario.sequence_parallel,
                loss_chunk_tokens=scenario.loss_chunk_tokens,
            )
            if last
            else 0.0
        )
        allocated = states.total + saved + logits
        stages.append((allocated, name, states, saved, logits))
    allocated, stage, states, saved, logits = max(stages, key=lambda s: s[0])
    headroom = allocated * ALLOCATOR_HEADROOM
    total = allocated + headroom + RUNTIME_RESERVED_GIB * GIB
    capacity = GPUS[scenario.gpu].memory_gib * GIB
    return {
        "gpu": scenario.gpu,
        "capacity": capacity,
        "stage": stage if scenario.pp > 1 else "all",
        **asdict(states),
        "activations": saved,
        "activations_detail": act.to_dict(stage_layers),
        "micro_batches_in_flight": in_flight,
        "logits_grad": logits,
        "allocated": allocated,
        "allocator_headroom": headroom,
        "runtime_reserved": RUNTIME_RESERVED_GIB * GIB,
        "total": total,
        "fits": total <= capacity,
        "free": capacity - total,
    }


def peak_flops(scenario: TrainingScenario) -> float:
    gpu = GPUS[scenario.gpu]
    if scenario.precision != "fp32":
        return gpu.bf16_tflops * 1e12
    return gpu.bf16_tflops * 1e12 * TF32_SPEED if scenario.tf32 else gpu.fp32_tflops * 1e12


def overhead(scenario: TrainingScenario, checkpoint_bytes: float, staged_bytes_per_gpu: float) -> dict:
    """The wall-clock factor on top of FLOPs ÷ (MFU × peak), and why. A run of compute time C, checkpointing
    every τ seconds with δ seconds of training stopped each time, failing every M seconds (mean time between
    failures of the whole job) and losing R (restart) + τ/2 (work since the last checkpoint) + w (an async write
    in flight) per failure, takes W = C·(1 + δ/τ) + (W / M)·(R + τ/2 + w), so W / C = (1 + δ/τ) / (1 − (R + τ/2
    + w) / M). τ defaults to Young/Daly's optimum √(2·δ·M), no shorter than the write itself."""
    nodes = math.ceil(scenario.gpus / GPUS_PER_NODE)
    write = checkpoint_bytes / (scenario.checkpoint_gbps * 1e9 * nodes)
    stall = staged_bytes_per_gpu / (STAGING_GBPS * 1e9) if scenario.async_checkpoint else write
    in_flight = write if scenario.async_checkpoint else 0.0
    failures_per_day = FAILURES_PER_GPU_DAY * scenario.gpus
    mtbf = 86400 / failures_per_day
    interval = (
        scenario.checkpoint_hours * 3600 if scenario.checkpoint_hours else max(math.sqrt(2 * stall * mtbf), write)
    )
    lost = RESTART_HOURS * 3600 + interval / 2 + in_flight
    if lost >= mtbf:
        derived = "" if scenario.gpus_given else "not given, so one per data-parallel rank of the global batch: "
        raise UserError(
            "--gpus",
            f"{derived}{scenario.gpus} GPUs fail every {mtbf / 60:.0f} min on average, less than the "
            f"{lost / 60:.0f} min each failure costs (restart, lost work)",
            "give --gpus for the cluster you have"
            if derived
            else "checkpoint more often (--checkpoint-hours) or faster (--checkpoint-gbps), or use fewer GPUs",
        )
    checkpoint, failure = stall / interval, lost / mtbf
    computed = (1 + checkpoint) / (1 - failure)
    how = (
        f"async: {stall:.2g} s to stage {staged_bytes_per_gpu / 1e9:.2g} GB per GPU to host memory, then "
        f"{write:.0f} s to write"
        if scenario.async_checkpoint
        else f"blocking: {write:.0f} s to write"
    )
    rule = "given" if scenario.checkpoint_hours else "Young/Daly √(2·stall·MTBF)"
    why = (
        f"--mfu is the steady-state MFU the training monitor measures, so data loading, gradient sync and pipeline "
        f"bubbles are already in it; on top: checkpoints {checkpoint:.2%} ({checkpoint_bytes / 1e9:,.0f} GB every "
        f"{_minutes(interval)} ({rule}), {how} at {scenario.checkpoint_gbps:g} GB/s per node × {nodes} nodes) "
        f"and failure recovery {failure:.2%} ({failures_per_day:.2f} interruptions/day, one every "
        f"{mtbf / 3600:.1f} h at Llama 3's {FAILURES_PER_GPU_DAY:.1e} per GPU-day, each a "
        f"{RESTART_HOURS * 60:.0f} min restart plus {lost / 60 - RESTART_HOURS * 60:.1f} min of lost work): "
        f"{1 / computed:.1%} of the wall-clock time trains"
    )
    if scenario.overhead is not None:
        why = f"--overhead {scenario.overhead:g} given (computed: {computed:.3f} — {why})"
    factor = scenario.overhead if scenario.overhead is not None else computed
    return {
        "factor": factor,
        "effective_training_time": 1 / factor,
        "checkpoint_fraction": checkpoint,
        "failure_fraction": failure,
        "checkpoint_write_seconds": write,
        "checkpoint_stall_seconds": stall,
        "checkpoint_interval_seconds": interval,
        "mtbf_hours": mtbf / 3600,
        "why": why,
    }


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _duration(seconds: float) -> dict:
    return {"seconds": seconds, "hours": seconds / 3600, "days": seconds / 86400}


def compute(scenario: TrainingScenario, config, shape: ModelShape) -> dict:
    precision = PRECISIONS[scenario.precision]
    batch_tokens, accumulate = accumulation(scenario)
    tokens = scenario.tokens or batch_tokens
    per_token = training_flops_per_token(config, scenario.seq_len, shape.params.matmul)
    peak = peak_flops(scenario)
    per_gpu = scenario.mfu * peak / per_token
    seconds = tokens * per_token / (scenario.gpus * scenario.mfu * peak)
    full_state = shape.params.total * (
        precision.param_bytes + precision.master_bytes + OPTIMIZER_BYTES[scenario.optimizer]
    )
    # DCP writes each replicated tensor once and balances the writes over the ranks, so every GPU stages its share
    extra = overhead(scenario, full_state, full_state / scenario.gpus)
    wall = seconds * extra["factor"]
    result = {
        "flops_per_token": per_token,
        "six_n": 6.0 * shape.params.matmul,
        "attention_flops_per_token": attention_flops_per_token(config, scenario.seq_len),
        "tokens": tokens,
        "total_flops": tokens * per_token,
        "peak_flops_per_gpu": peak,
        "global_batch_tokens": batch_tokens,
        "gradient_accumulation": accumulate,
        "steps": math.ceil(tokens / batch_tokens),
        "step_seconds": batch_tokens / (per_gpu * scenario.gpus),
        "tokens_per_second_per_gpu": per_gpu,
        "tokens_per_second": per_gpu * scenario.gpus,
        "compute_time": _duration(seconds),
        "overhead": extra,
        "time": _duration(wall),
        "gpu_hours": scenario.gpus * wall / 3600,
        "cost": scenario.gpus * wall / 3600 * scenario.price_per_gpu_hour if scenario.price_per_gpu_hour else None,
        "checkpoint": {
            "bytes": full_state,
            "model_bytes": shape.params.total * 2,
            "write_seconds": extra["checkpoint_write_seconds"],
            "gbps_per_node": scenario.checkpoint_gbps,
            "stall_seconds": extra["checkpoint_stall_seconds"],
            "interval_seconds": extra["checkpoint_interval_seconds"],
            "async": scenario.async_checkpoint,
        },
        "pipeline_bubble": (scenario.pp - 1) / (accumulate + scenario.pp - 1) if scenario.pp > 1 else 0.0,
        "recompute_flops_per_token": 2.0 * shape.params.matmul if scenario.recompute == "full" else 0.0,
    }
    if scenario.target_days:
        gpus = tokens * per_token * extra["factor"] / (scenario.target_days * 86400 * scenario.mfu * peak)
        result["gpus_for_target"] = {
            "days": scenario.target_days,
            "gpus": math.ceil(gpus / scenario.model_parallel) * scenario.model_parallel,
        }
    return result


def _fits(scenario: TrainingScenario, shape: ModelShape) -> dict | None:
    try:
        check_model_layout(scenario, shape.heads, shape.kv_heads, shape.layers)
    except UserError:  # a layout the model cannot take is simply not a candidate
        return None
    result = memory(scenario, shape)
    return result if result["fits"] else None


def largest_micro_batch(scenario: TrainingScenario, shape: ModelShape, limit: int = 1024) -> int | None:
    """Memory grows with the micro batch, so the first one that does not fit ends the search."""
    best = None
    size = 1
    while size <= limit and _fits(replace(scenario, micro_batch=size), shape):
        best, size = size, size + 1 if size < 8 else size * 2
    return best


_RECOMPUTE_COST = {"none": 0, "selective": 1, "full": 2}


def _candidates(scenario: TrainingScenario):
    """Every layout --find considers. smolctl: what `smolctl pretrain` runs, tensor parallel × FSDP2 data parallel
    sharded over dp_shard ranks and replicated over the rest (HSDP; dp_shard 1 is plain DDP), no pipeline or
    context parallel. megatron: tp × pp × cp with ZeRO 0–3 over data parallel."""
    recomputes = ("none", "selective", "full") if scenario.attention == "eager" else ("none", "full")
    if scenario.framework == "smolctl":
        for tp, recompute in product((1, 2, 4, 8), recomputes):
            if scenario.gpus % tp:
                continue
            dp = scenario.gpus // tp
            for shard in sorted({d for d in (2**k for k in range(dp.bit_length())) if dp % d == 0} | {dp}):
                yield replace(
                    scenario,
                    tp=tp,
                    pp=1,
                    cp=1,
                    zero=3 if shard > 1 else 0,
                    dp_shard=shard if shard > 1 else None,
                    recompute=recompute,
                )
        return
    for tp, pp, cp, zero, recompute in product((1, 2, 4, 8), (1, 2, 4, 8, 16), (1, 2, 4, 8), (0, 1, 2, 3), recomputes):
        if not scenario.gpus % (tp * pp * cp) and not scenario.seq_len % cp:
            yield replace(scenario, tp=tp, pp=pp, cp=cp, zero=zero, dp_shard=None, recompute=recompute)


def smallest_layouts(scenario: TrainingScenario, shape: ModelShape, top: int = 5) -> dict:
    """Layouts that fit at the scenario's micro batch and global batch (held fixed: data parallel × micro batch must
    divide it, and a pipeline needs at least as many micro batches as stages), fastest first: no recompute before
    selective before full (full recompute costs a third more FLOPs, more than intra-node TP costs), then the fewest
    model-parallel GPUs, then weights gathered inside a node before across nodes (HSDP), then ZeRO 0–2 before 3
    (ZeRO-1/2 move the same bytes as an all-reduce, ZeRO-3 half as much again), then TP before PP (bubbles)
    before CP, then the most free memory."""
    batch_tokens = scenario.global_batch_tokens or accumulation(scenario)[0]  # the batch asked for, not a rounded one
    sequences = batch_tokens // scenario.seq_len
    found, skipped = [], {"batch": 0, "pipeline": 0}
    for candidate in _candidates(replace(scenario, global_batch_tokens=batch_tokens)):
        dp = data_parallel(candidate)
        if sequences % (dp * scenario.micro_batch):
            skipped["batch"] += 1
            continue
        accumulate = sequences // (dp * scenario.micro_batch)
        if accumulate < candidate.pp:
            skipped["pipeline"] += 1
            continue
        result = _fits(candidate, shape)
        if result:
            shard = candidate.dp_shard or dp
            across_nodes = candidate.zero == 3 and shard * candidate.model_parallel > GPUS_PER_NODE
            found.append(
                (
                    (
                        _RECOMPUTE_COST[candidate.recompute],
                        candidate.model_parallel,
                        across_nodes,
                        candidate.zero == 3,
                        candidate.pp,
                        candidate.cp,
                        -result["free"],
                    ),
                    {
                        "tp": candidate.tp,
                        "pp": candidate.pp,
                        "cp": candidate.cp,
                        "dp": dp,
                        "dp_shard": shard if candidate.zero == 3 else 1,
                        "dp_replicate": dp // shard if candidate.zero == 3 else dp,
                        "zero": candidate.zero,
                        "recompute": candidate.recompute,
                        "gradient_accumulation": accumulate,
                        "global_batch_tokens": batch_tokens,
                        "total": result["total"],
                        "free": result["free"],
                    },
                )
            )
    return {
        "framework": scenario.framework,
        "global_batch_tokens": batch_tokens,
        "skipped": skipped,
        "layouts": [layout for _, layout in sorted(found, key=lambda item: item[0])[:top]],
    }


def _headlines(scenario: TrainingScenario, held: dict, batch_tokens: int) -> list[dict]:
    """What the reader must not miss, above the tables: a run that does not fit, a global batch other than the
    one asked for, a time for one step when no token count was given."""
    lines = []
    if not held["fits"]:
        lines.append(
            {
                "level": "error",
                "text": f"does not fit {scenario.gpu}: {held['total'] / GIB:.1f} GiB per GPU of "
                f"{held['capacity'] / GIB:.1f} — --find lists the layouts that do (or try --recompute full, a "
                "larger --tp, a smaller --micro-batch)",
            }
        )
    if scenario.global_batch_tokens and batch_tokens != scenario.global_batch_tokens:
        wanted = scenario.global_batch_tokens // scenario.seq_len
        per_step = scenario.micro_batch * data_parallel(scenario)
        lines.append(
            {
                "level": "warning",
                "text": f"global batch changed from {scenario.global_batch_tokens:,} to "
                f"{batch_tokens:,} tokens: {data_parallel(scenario)} data-parallel ranks × micro batch "
                f"{scenario.micro_batch} = {per_step} sequences per pass do not divide the {wanted} asked for, so "
                f"the step rounds up to {batch_tokens // scenario.seq_len}; choose --gpus / --micro-batch so that "
                f"dp × micro batch divides {wanted} (or --find)",
            }
        )
    if scenario.tokens is None:
        lines.append(
            {
                "level": "warning",
                "text": f"no --tokens: the time and cost below are for ONE optimizer step "
                f"({batch_tokens:,} tokens); give the run's tokens, e.g. --tokens 1T",
            }
        )
    return lines


@dataclass
class Estimate(Result):
    """A training run sized: its model, layout, memory per GPU, compute and time, with what --find and --validate
    add when asked."""

    source: str | None
    model: dict
    headlines: list[dict]
    layout: dict
    memory: dict
    compute: dict
    notes: list[str]
    find: dict | None = None
    validate: dict | None = None

    def to_dict(self) -> dict:
        return {
            key: value for key, value in asdict(self).items() if value is not None or key not in ("find", "validate")
        }


@dataclass
class ServingEstimate(Result):
    """A model served on the scenario's GPU type: weights, KV cache, activations and decode speed (`--inference`)."""

    source: str | None
    model: dict
    inference: dict


def estimate(scenario: TrainingScenario, *, find: bool = False) -> Estimate:
    config, shape = load_model(scenario)
    check_model_layout(scenario, shape.heads, shape.kv_heads, shape.layers)
    batch_tokens, accumulate = accumulation(scenario)
    notes = list(scenario.notes)
    if not shape.llama_like:
        notes.append(
            f"{shape.model_type} is not a Llama-family layer: activations are approximated with the "
            "Llama formula; run --validate to measure them"
        )
    if scenario.recompute == "selective" and scenario.attention != "eager":
        notes.append(
            "selective recompute = recompute the attention core, which flash/sdpa kernels already do: "
            "same memory as none"
        )
    if scenario.recompute == "full":
        notes.append(
            "full recompute runs each layer's forward twice (+2N FLOPs/token of hardware work); give the "
            "MFU measured with it (MFU does not count recomputation)"
        )
    if scenario.tp > shape.kv_heads:
        notes.append(
            f"tp {scenario.tp} > {shape.kv_heads} KV heads: each KV head is replicated on "
            f"{scenario.tp // shape.kv_heads} ranks (its weights counted on each)"
        )
    if scenario.precision == "fp32":
        notes.append(
            "fp32 matmuls at the TF32 tensor-core rate (--tf32)"
            if scenario.tf32
            else f"fp32 matmuls at the plain fp32 rate ({GPUS[scenario.gpu].fp32_tflops:g} TFLOPS): PyTorch leaves "
            "TF32 off; with it on (torch.backends.cuda.matmul.allow_tf32) pass --tf32"
        )
    held = memory(scenario, shape)
    loss_bytes = held["activations_detail"]["head"] + held["logits_grad"]
    if loss_bytes > 0.15 * held["capacity"]:
        notes.append(
            f"the loss over {shape.vocab} vocabulary entries holds {loss_bytes / 2**30:.1f} GiB (fp32 "
            "log-softmax and its gradients): a chunked/fused cross-entropy (e.g. Liger's) avoids most of it"
        )
    result = Estimate(
        source=scenario.source,
        model={
            "name": scenario.model if isinstance(scenario.model, str) else scenario.model.get("architecture", "?"),
            **shape.to_dict(),
        },
        headlines=_headlines(scenario, held, batch_tokens),
        layout={
            "gpus": scenario.gpus,
            "gpu": scenario.gpu,
            "tp": scenario.tp,
            "pp": scenario.pp,
            "cp": scenario.cp,
            "dp": data_parallel(scenario),
            "dp_shard": scenario.dp_shard,
            "zero": scenario.zero,
            "recompute": scenario.recompute,
            "attention": scenario.attention,
            "precision": scenario.precision,
            "optimizer": scenario.optimizer,
            "seq_len": scenario.seq_len,
            "micro_batch": scenario.micro_batch,
            "gradient_accumulation": accumulate,
            "global_batch_tokens": batch_tokens,
            "mfu": scenario.mfu,
            "tf32": scenario.tf32,
        },
        memory=held,
        compute=compute(scenario, config, shape),
        notes=notes,
    )
    if find:
        result.find = {"largest_micro_batch": largest_micro_batch(scenario, shape), **smallest_layouts(scenario, shape)}
    return result


def estimate_inference(scenario: TrainingScenario, serving: InferenceScenario) -> ServingEstimate:
    """Weights, KV cache, activations and decode speed of serving the scenario's model on its GPU type (tp GPUs)."""
    _, shape = load_model(scenario)
    check_model_layout(replace(scenario, pp=1), shape.heads, shape.kv_heads, shape.layers)
    return ServingEstimate(
        source=scenario.source,
        model={
            "name": scenario.model if isinstance(scenario.model, str) else scenario.model.get("architecture", "?"),
            **shape.to_dict(),
        },
        inference=inference(shape, scenario.gpu, check_inference(serving), tp=scenario.tp),
    )

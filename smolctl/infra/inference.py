"""Inference memory and decode speed for `smolctl estimate --inference`: weights, the KV cache, the activations of
the prefill, what fits on the GPU, and the memory-bandwidth bound on decoding.

    smolctl estimate --model smollm3-3b --inference --context 8192 --batch 8 --compare-attention

Decoding one token reads every weight and the whole KV cache of the batch from GPU memory once, and does few
FLOPs per byte read, so memory bandwidth, not compute, bounds it: tokens/s ≤ batch × bandwidth / (weights + KV
cache). The KV cache is what grouped-query attention shrinks: 2 (K and V) × layers × KV heads × head dim × bytes
per token, where multi-head attention would have as many KV heads as query heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from smolctl.errors import UserError
from smolctl.infra.memory import GIB, GPUS, RUNTIME_RESERVED_GIB, tp_local_params
from smolctl.infra.model_shape import ModelShape

KV_DTYPES = {"bf16": 2, "fp16": 2, "fp8": 1}
WEIGHT_BYTES = 2  # bf16 weights, as released checkpoints are served
COMPUTE_BYTES = 2


@dataclass(frozen=True)
class InferenceScenario:
    context: int = 8192
    """Tokens per sequence held in the KV cache (prompt + generated)."""
    batch: int = 1
    """Sequences decoded together."""
    kv_dtype: str = "bf16"
    compare_attention: bool = False
    """Also size the same model with multi-head attention (as many KV heads as query heads)."""


def check_inference(scenario: InferenceScenario) -> InferenceScenario:
    if scenario.context < 1:
        raise UserError("--context", f"must be at least 1 token, got {scenario.context}", "e.g. --context 8192")
    if scenario.batch < 1:
        raise UserError("--batch", f"must be at least 1 sequence, got {scenario.batch}", "e.g. --batch 8")
    if scenario.kv_dtype not in KV_DTYPES:
        raise UserError("--kv-dtype", f"{scenario.kv_dtype!r} is not known", f"known: {', '.join(KV_DTYPES)}")
    return scenario


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str, tp: int = 1) -> float:
    """K and V of every layer for one token, on one GPU (tensor parallel splits the KV heads, down to one)."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * KV_DTYPES[kv_dtype] / min(tp, shape.kv_heads)


def prefill_bytes_per_token(shape: ModelShape, tp: int = 1) -> float:
    """Transient activations of a forward without autograd, per token of the prompt, at the widest point: the
    MLP's gate and up projections and their product (the largest layer tensors), the layer's input and output,
    and q, k, v (flash attention keeps no score matrix). Only the live layer's tensors exist at once."""
    return COMPUTE_BYTES * (3 * shape.ffn + 2 * shape.hidden + shape.q_dim + 2 * shape.kv_dim) / tp


def sizing(shape: ModelShape, gpu_name: str, scenario: InferenceScenario, tp: int = 1) -> dict:
    gpu = GPUS[gpu_name]
    capacity = gpu.memory_gib * GIB
    kv_params = shape.layers * 2 * shape.hidden * shape.kv_dim
    weights = tp_local_params(shape.params.total, kv_params, tp, shape.kv_heads) * WEIGHT_BYTES
    per_token = kv_bytes_per_token(shape, scenario.kv_dtype, tp)
    per_sequence = per_token * scenario.context
    kv_cache = per_sequence * scenario.batch
    # the prompt of every sequence in one forward, and the last position's fp32 logits (generation keeps only those)
    logits = scenario.batch * shape.vocab * 4 / tp
    prefill = prefill_bytes_per_token(shape, tp) * scenario.context * scenario.batch + logits
    reserved = RUNTIME_RESERVED_GIB * GIB
    total = weights + kv_cache + prefill + reserved
    spare = capacity - weights - reserved
    per_sequence_total = per_sequence + prefill_bytes_per_token(shape, tp) * scenario.context + shape.vocab * 4 / tp
    per_token_total = scenario.batch * (per_token + prefill_bytes_per_token(shape, tp))
    step_bytes = weights + kv_cache  # read once per decoded token
    bandwidth = gpu.memory_tbps * 1e12
    return {
        "kv_heads": shape.kv_heads,
        "params": shape.params.total,
        "weights": weights,
        "kv_per_token": per_token,
        "kv_per_sequence": per_sequence,
        "kv_cache": kv_cache,
        "activations": prefill,
        "runtime_reserved": reserved,
        "total": total,
        "capacity": capacity,
        "fits": total <= capacity,
        "free": capacity - total,
        "max_batch": max(0, math.floor(spare / per_sequence_total)) if spare > 0 else 0,
        "max_context": max(0, math.floor((spare - logits) / per_token_total)) if spare > logits else 0,
        "decode_tokens_per_second": scenario.batch * bandwidth / step_bytes,
        "decode_tokens_per_second_per_sequence": bandwidth / step_bytes,
        "memory_tbps": gpu.memory_tbps,
    }


def multi_head(shape: ModelShape) -> ModelShape:
    """The same model with multi-head attention: as many KV heads as query heads, and k/v projections to match."""
    extra = shape.layers * 2 * shape.hidden * (shape.q_dim - shape.kv_dim)
    params = replace(
        shape.params,
        total=shape.params.total + extra,
        non_embedding=shape.params.non_embedding + extra,
        per_layer=shape.params.per_layer + extra // shape.layers,
        matmul=shape.params.matmul + extra,
    )
    return replace(shape, kv_heads=shape.heads, params=params)


def inference(shape: ModelShape, gpu: str, scenario: InferenceScenario, tp: int = 1) -> dict:
    result = {
        "gpu": gpu,
        "tp": tp,
        "context": scenario.context,
        "batch": scenario.batch,
        "kv_dtype": scenario.kv_dtype,
        "model": sizing(shape, gpu, scenario, tp),
    }
    if scenario.compare_attention:
        result["multi_head"] = sizing(multi_head(shape), gpu, scenario, tp)
    return result

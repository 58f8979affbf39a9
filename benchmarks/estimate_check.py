"""How close `smolctl estimate` lands to measurement, next to the formulas users reach for today.

    .venv/bin/python benchmarks/estimate_check.py            # about a minute on 2 CPU cores

1. Parameters: meta-device count and closed form vs the published totals.
2. FLOPs per step: 6N + 12·L·h·seq vs FlopCounterMode on a real forward + backward; baseline 6N alone.
3. Activations: our per-tensor formula vs the peak of autograd's saved tensors, per recompute mode; baseline the
   Korthikanti et al. / EleutherAI Transformer Math formula s·b·h·(34 + 5·a·s/h) bytes per layer (GPT-style
   layer in fp16: 4h MLP, dropout masks), with full recompute 2·s·b·h per layer.
4. The published SmolLM3 run: 384 H100, 11.2T tokens, ~30% MFU, reported ~24 days; and its memory per GPU vs
   `accelerate estimate-memory`'s 16 bytes per parameter (weights, gradients, Adam; no activations).
5. On a CUDA machine: the per-GPU total vs torch.cuda.max_memory_allocated of a real training step.
6. Llama 3 405B on 16,384 H100s: effective training time (Meta: >90%) and GPU-hours (model card: 30.84M) under
   the overhead model, against the earlier one (one cluster-wide store, blocking hourly writes).
7. Inference: the KV cache of SmolLM3-3B against the closed form, and with multi-head attention beside it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from smolctl.infra.estimate import estimate
from smolctl.infra.flops import training_flops_per_token
from smolctl.infra.measure import measure_activations, measure_flops, scaled_down
from smolctl.infra.memory import GIB, PRECISIONS, activations
from smolctl.infra.model_shape import config_from_dict, measure_shape, resolve_config
from smolctl.infra.scenario import scenario_from_sources

console = Console(width=150)
PUBLISHED = {
    "smollm3-3b": 3.08e9,
    "smollm2-135m": 135e6,
    "smollm2-360m": 362e6,
    "smollm2-1.7b": 1.71e9,
    "llama3-8b": 8.03e9,
    "qwen3-0.6b": 0.6e9,
}


def small(model_type: str, **extra):
    base = dict(
        model_type=model_type,
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=1000,
    )
    return config_from_dict({**base, **extra}, "benchmark")


CONFIGS = {
    "smollm3 (scaled)": lambda: scaled_down(resolve_config("smollm3-3b")),
    "llama3 (scaled)": lambda: scaled_down(resolve_config("llama3-8b")),
    "qwen3 (scaled)": lambda: scaled_down(resolve_config("qwen3-0.6b")),
    "qwen2 bias": lambda: small("qwen2"),
    "mistral MHA": lambda: small("mistral", num_key_value_heads=6, intermediate_size=320),
}


def show(title: str, columns: list[str], rows: list[list]) -> None:
    out = Table(title=title, title_justify="left")
    for i, name in enumerate(columns):
        out.add_column(name, justify="left" if i == 0 else "right")
    for row in rows:
        out.add_row(*map(str, row))
    console.print(out)


def parameters() -> None:
    rows = []
    for name, published in PUBLISHED.items():
        params = measure_shape(resolve_config(name)).params
        rows.append(
            [
                name,
                f"{params.total:,}",
                f"{params.closed_form:,}",
                params.total - params.closed_form,
                f"{published:.3g}",
                f"{params.total / published:.3f}",
            ]
        )
    show("1. parameters", ["model", "meta device", "closed form", "difference", "published", "meta/published"], rows)


def flops() -> None:
    rows = []
    for name, make in CONFIGS.items():
        config = make()
        matmul = measure_shape(config).params.matmul
        for seq_len in (64, 256):
            measured = measure_flops(config, micro_batch=2, seq_len=seq_len)
            ours = training_flops_per_token(config, seq_len, matmul) * 2 * seq_len
            six_n = 6 * matmul * 2 * seq_len
            rows.append([name, seq_len, f"{measured:.4e}", f"{ours / measured:.4f}", f"{six_n / measured:.4f}"])
    show(
        "2. FLOPs per forward+backward vs FlopCounterMode",
        ["config", "seq", "measured", "ours/measured", "6N/measured"],
        rows,
    )


def korthikanti(shape, micro_batch: int, seq_len: int, recompute: str, attention: str) -> float:
    tokens = micro_batch * seq_len
    if recompute == "full":
        per_layer = 2 * tokens * shape.hidden
    else:
        scores = 0 if recompute == "selective" or attention != "eager" else 5 * shape.heads * seq_len / shape.hidden
        per_layer = tokens * shape.hidden * (34 + scores)
    return shape.layers * per_layer


def activation_rows() -> None:
    rows = []
    for name, make in CONFIGS.items():
        config = make()
        shape = measure_shape(config)
        for precision, attention, recompute in [
            ("bf16", "sdpa", "none"),
            ("bf16", "eager", "none"),
            ("bf16", "eager", "selective"),
            ("bf16", "sdpa", "full"),
            ("amp", "sdpa", "none"),
            ("amp", "eager", "selective"),
            ("fp32", "eager", "full"),
        ]:
            row = [name, precision, attention, recompute]
            for micro_batch, seq_len in ((2, 128), (4, 384)):
                measured = measure_activations(
                    config,
                    micro_batch=micro_batch,
                    seq_len=seq_len,
                    precision=precision,
                    attention=attention,
                    recompute=recompute,
                )
                ours = activations(
                    shape,
                    micro_batch=micro_batch,
                    seq_len=seq_len,
                    precision=PRECISIONS[precision],
                    attention=attention,
                    recompute=recompute,
                ).peak(shape.layers)
                base = korthikanti(shape, micro_batch, seq_len, recompute, attention)
                row += [f"{measured / 1024**2:.2f}", f"{ours / measured:.3f}", f"{base / measured:.3f}"]
            rows.append(row)
    show(
        "3. activation peak (saved tensors) vs measured, micro batch 2 × 128 | 4 × 384",
        [
            "config",
            "precision",
            "attention",
            "recompute",
            "MiB",
            "ours/meas.",
            "Korthikanti/meas.",
            "MiB",
            "ours/meas.",
            "Korthikanti/meas.",
        ],
        rows,
    )


def smollm3_run() -> None:
    scenario = scenario_from_sources(
        recipe="recipes/smollm3.toml",
        flags={"gpus": 384, "gpu": "h100", "tp": 2, "zero": 1, "tokens": "11.2T", "mfu": 0.30},
    )
    started = time.perf_counter()
    result = estimate(scenario)
    seconds = time.perf_counter() - started
    compute, memory = result.compute, result.memory
    accelerate_style = 16 * result.model["params"]["total"]
    show(
        "4. SmolLM3: 384 H100, tp 2, ZeRO-1, micro batch 3 × 4096, 11.2T tokens, MFU 30%",
        ["", "value"],
        [
            ["FLOPs/token (6N + attention)", f"{compute['flops_per_token']:.4e}"],
            ["compute days at 30% MFU", f"{compute['compute_time']['days']:.2f}"],
            ["overhead factor", f"{compute['overhead']['factor']:.4f}"],
            ["estimated days", f"{compute['time']['days']:.2f}"],
            ["reported days", "~24"],
            ["estimate / reported", f"{compute['time']['days'] / 24:.3f}"],
            [
                "6N·D only days (playbook rule of thumb)",
                f"{6 * result.model['params']['total'] * compute['tokens'] / (384 * 0.3 * 989.4e12) / 86400:.2f}",
            ],
            [
                "memory per GPU (ours, fits 80 GB)",
                f"{memory['total'] / GIB:.1f} GiB ({'fits' if memory['fits'] else 'no'})",
            ],
            ["  of which activations", f"{memory['activations'] / GIB:.1f} GiB"],
            [
                "accelerate estimate-memory training (16 B/param, whole model, no activations)",
                f"{accelerate_style / GIB:.1f} GiB",
            ],
            ["estimate() wall time (model already imported)", f"{seconds:.2f} s"],
        ],
    )


def gpu_peak() -> None:
    """Weights + gradients + AdamW states + activations + the loss's transient vs torch.cuda.max_memory_allocated
    over a second training step, for real (not scaled-down) small models."""
    import torch

    from smolctl.infra.measure import measure_gpu_peak
    from smolctl.infra.memory import logits_grad_bytes, state_bytes

    if not torch.cuda.is_available():
        console.print("5. GPU peak memory: skipped (no CUDA device here)")
        return
    rows = []
    for name, micro_batch, seq_len, recompute in [
        ("smollm2-135m", 4, 2048, "none"),
        ("smollm2-135m", 4, 2048, "full"),
        ("smollm2-360m", 2, 4096, "none"),
        ("qwen3-0.6b", 2, 2048, "full"),
    ]:
        config = resolve_config(name)
        shape = measure_shape(config)
        measured = measure_gpu_peak(
            config, micro_batch=micro_batch, seq_len=seq_len, precision="amp", attention="sdpa", recompute=recompute
        )
        states = state_bytes(
            shape.params.total,
            shape.params.per_layer,
            precision=PRECISIONS["amp"],
            optimizer="adamw",
            zero=0,
            shard=1,
            tp=1,
        )
        act = activations(
            shape,
            micro_batch=micro_batch,
            seq_len=seq_len,
            precision=PRECISIONS["amp"],
            attention="sdpa",
            recompute=recompute,
        ).peak(shape.layers)
        ours = states.total + act + logits_grad_bytes(shape, micro_batch=micro_batch, seq_len=seq_len, tp=1, cp=1)
        rows.append(
            [
                name,
                f"{micro_batch} × {seq_len}",
                recompute,
                f"{measured['max_memory_allocated'] / GIB:.2f}",
                f"{ours / GIB:.2f}",
                f"{ours / measured['max_memory_allocated']:.3f}",
            ]
        )
    show(
        f"5. GPU peak allocated, amp + AdamW, second step ({measured['device']})",
        ["model", "batch", "recompute", "measured GiB", "ours GiB", "ours/measured"],
        rows,
    )


LLAMA3_405B = {
    "model": "llama3-405b",
    "gpus": 16384,
    "tp": 8,
    "pp": 16,
    "zero": 1,
    "seq_len": 8192,
    "recompute": "full",
    "global_batch_tokens": 16 * 2**20,
    "tokens": "15.6T",
    "mfu": 0.38,
}


def llama3_405b() -> None:
    rows = []
    for name, extra in [
        ("async, per node 1 GB/s, Young/Daly (defaults)", {}),
        ("sync writes, per node 1 GB/s, Young/Daly", {"async_checkpoint": False}),
        ("async, hourly", {"checkpoint_hours": 1.0}),
        (
            "earlier model: 5 GB/s for the cluster, blocking, hourly",
            {"checkpoint_gbps": 5 / 2048, "checkpoint_hours": 1.0, "async_checkpoint": False},
        ),
    ]:
        compute = estimate(scenario_from_sources(flags={**LLAMA3_405B, **extra})).compute
        over = compute["overhead"]
        rows.append(
            [
                name,
                f"{over['checkpoint_interval_seconds']:.0f} s",
                f"{over['checkpoint_fraction']:.2%}",
                f"{over['failure_fraction']:.2%}",
                f"{over['effective_training_time']:.1%}",
                f"{compute['time']['days']:.1f}",
                f"{compute['gpu_hours'] / 1e6:.2f}M",
                f"{compute['gpu_hours'] / 30.84e6:.3f}",
            ]
        )
    show(
        "6. Llama 3 405B, 16,384 H100, tp 8 pp 16, 15.6T tokens at 38% MFU (Meta: >90% effective, 30.84M GPU-hours)",
        ["checkpointing", "interval", "checkpoint", "failures", "effective", "days", "GPU-hours", "/ published"],
        rows,
    )


def inference_kv() -> None:
    from smolctl.infra.estimate import estimate_inference
    from smolctl.infra.inference import InferenceScenario

    rows = []
    for context in (4096, 8192, 65536):
        served = estimate_inference(
            scenario_from_sources(flags={"model": "smollm3-3b"}),
            InferenceScenario(context=context, compare_attention=True),
        ).inference
        formula = 2 * 36 * 4 * 128 * context * 2
        gqa, mha = served["model"], served["multi_head"]
        rows.append(
            [
                context,
                f"{gqa['kv_per_sequence'] / 2**20:.0f}",
                f"{gqa['kv_per_sequence'] / formula:.4f}",
                f"{mha['kv_per_sequence'] / 2**20:.0f}",
                gqa["max_batch"],
                mha["max_batch"],
                f"{gqa['decode_tokens_per_second']:.0f}",
                f"{mha['decode_tokens_per_second']:.0f}",
            ]
        )
    show(
        "7. SmolLM3-3B inference on one H100, bf16 KV cache, batch 1: GQA (4 KV heads) vs multi-head (16)",
        [
            "context",
            "KV MiB/seq",
            "/ formula",
            "MHA KV MiB/seq",
            "max batch",
            "MHA max batch",
            "decode tok/s",
            "MHA decode tok/s",
        ],
        rows,
    )


if __name__ == "__main__":
    parameters()
    flops()
    activation_rows()
    smollm3_run()
    gpu_peak()
    llama3_405b()
    inference_kv()

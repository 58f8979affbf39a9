"""`smolctl estimate`: parameters, memory per GPU, FLOPs, time and cost of a training run, or serving memory
(--inference), before any GPU is rented."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from smolctl.cli.app import app
from smolctl.cli.options import JsonOpt, SetOpt
from smolctl.console import (
    emit_json,
    escape,
    human_bytes,
    human_count,
    human_duration,
    key_values,
    show,
    stderr_console,
    styled,
    table,
)
from smolctl.errors import CheckFailed, UserError
from smolctl.units import COUNT_HELP

if TYPE_CHECKING:  # the estimate module loads on first use, not with `smolctl --help`
    from smolctl.infra.estimate import Estimate, ServingEstimate


@app.command(
    "estimate",
    epilog="""[bold]Examples[/]

  smolctl estimate recipes/smollm3.toml --gpus 384 --tp 2 --tokens 11.2T     the published SmolLM3 run

  smolctl estimate --model smollm3-3b --seq-len 4096 --micro-batch 3 --gpus 384 --gpu h100 --tp 2 --zero 1
  --tokens 11.2T --mfu 0.30 --price-per-gpu-hour 2.5

  smolctl estimate --model llama3-8b --gpus 64 --gpu a100-80 --tokens 1T --find     what fits: layouts, micro batch

  smolctl estimate --model llama3-405b --gpus 16384 --tp 8 --pp 16 --zero 1 --seq-len 8192 --recompute full
  --global-batch-tokens 16777216 --tokens 15.6T --mfu 0.38          Llama 3 405B: ~33M GPU-hours (Meta: 30.84M)

  smolctl estimate --model smollm3-3b --inference --context 8192 --batch 8 --compare-attention     serving memory

  smolctl estimate recipes/smollm3-tiny.toml --validate
  --set model.vocab_size=8192                   estimate vs measured (the vocabulary: once packed, the data's)

  smolctl estimate path/to/model-folder --tokens 1T --target-days 14 --json     any HF config
""",
)
def estimate_command(
    ctx: typer.Context,
    recipe: str | None = typer.Argument(None, help="A pretrain recipe (.toml), or a model as --model takes it."),
    model: str | None = typer.Option(
        None, "--model", help="Preset (smollm3-3b, llama3-8b, ...) or a config.json / model folder."
    ),
    overrides: SetOpt = None,
    seq_len: int | None = typer.Option(
        None, "--seq-len", help="Tokens per sequence (default: the recipe's, else 4096)."
    ),
    micro_batch: int | None = typer.Option(
        None, "--micro-batch", help="Sequences per GPU per forward (default: the recipe's, else 1)."
    ),
    global_batch_tokens: str | None = typer.Option(
        None, "--global-batch-tokens", help=f"Tokens per optimizer step, e.g. 2359296 or 2.36M ({COUNT_HELP})."
    ),
    tokens: str | None = typer.Option(None, "--tokens", help=f"Training tokens: 11.2T, 100G, 5e9 ({COUNT_HELP})."),
    gpus: int | None = typer.Option(
        None, "--gpus", help="GPUs in the run (default: global batch ÷ micro batch × tp·pp·cp)."
    ),
    gpu: str | None = typer.Option(
        None, "--gpu", help="h100 (default), h200, a100-80, a100-40, l40s, b200, mi300x, ..."
    ),
    tp: int | None = typer.Option(None, "--tp", help="Tensor parallel size (with sequence parallelism)."),
    pp: int | None = typer.Option(None, "--pp", help="Pipeline stages (1F1B schedule)."),
    cp: int | None = typer.Option(None, "--cp", help="Context parallel size (splits the sequence)."),
    zero: int | None = typer.Option(None, "--zero", help="ZeRO stage 0-3 over data parallel (recipe shard=true: 3)."),
    dp_shard: int | None = typer.Option(
        None,
        "--dp-shard",
        help="With --zero 3: shard over this many data-parallel ranks, replicate over the rest (HSDP).",
    ),
    recompute: str | None = typer.Option(None, "--recompute", help="none | selective | full activation recomputation."),
    attention: str | None = typer.Option(None, "--attention", help="flash | sdpa | eager."),
    precision: str | None = typer.Option(
        None, "--precision", help="bf16 (bf16 weights + fp32 master) | amp (fp32 weights, bf16 autocast) | fp32."
    ),
    optimizer: str | None = typer.Option(None, "--optimizer", help="adamw | adamw8bit | sgd."),
    mfu: float | None = typer.Option(None, "--mfu", help="Achieved model FLOPs utilisation (default 0.30)."),
    price: float | None = typer.Option(None, "--price-per-gpu-hour", help="Cost of one GPU-hour, for the total."),
    target_days: float | None = typer.Option(
        None, "--target-days", help="Also report the GPUs needed to finish in this many days."
    ),
    tf32: bool | None = typer.Option(
        None, "--tf32", help="fp32 matmuls run as TF32 on tensor cores (off in PyTorch unless enabled)."
    ),
    checkpoint_gbps: float | None = typer.Option(
        None, "--checkpoint-gbps", help="Checkpoint write bandwidth per node, GB/s (default 1)."
    ),
    checkpoint_hours: float | None = typer.Option(
        None, "--checkpoint-hours", help="Hours between checkpoints (default: Young/Daly's optimum)."
    ),
    sync_checkpoint: bool = typer.Option(
        False,
        "--sync-checkpoint",
        help="Training waits for each checkpoint write (default: async, waits only for the copy to host memory).",
    ),
    overhead: float | None = typer.Option(
        None, "--overhead", help="Use this wall-clock overhead factor instead of the computed one."
    ),
    find: bool = typer.Option(False, "--find", help="Also search the layouts and the largest micro batch that fit."),
    framework: str | None = typer.Option(
        None,
        "--framework",
        help="What --find proposes: smolctl (tp × FSDP2/HSDP, the trainer's layouts; default) or megatron (tp, pp, cp, ZeRO).",
    ),
    require_fit: bool = typer.Option(False, "--require-fit", help="Exit 1 when the run does not fit the GPU."),
    inference_mode: bool = typer.Option(
        False, "--inference", help="Size serving instead: weights, KV cache, activations, decode tokens/s."
    ),
    context: int = typer.Option(8192, "--context", help="--inference: tokens per sequence in the KV cache."),
    batch: int = typer.Option(1, "--batch", help="--inference: sequences decoded together."),
    kv_dtype: str = typer.Option("bf16", "--kv-dtype", help="--inference: bf16 or fp8 KV cache."),
    compare_attention: bool = typer.Option(
        False, "--compare-attention", help="--inference: the same model with multi-head attention beside it."
    ),
    validate: bool = typer.Option(
        False, "--validate", help="Run a (scaled-down) copy here and print estimate vs measured."
    ),
    json_out: JsonOpt = False,
) -> None:
    """Parameters, memory per GPU, FLOPs, time and cost of a training run; --find what fits; --validate against
    a measured forward + backward."""
    from smolctl.infra.estimate import (
        InferenceScenario,
        estimate,
        estimate_inference,
        transformers_config,
    )
    from smolctl.infra.scenario import recipe_or_model, scenario_from_sources

    serving = {
        "context": "--context",
        "batch": "--batch",
        "kv_dtype": "--kv-dtype",
        "compare_attention": "--compare-attention",
    }
    given = [flag for name, flag in serving.items() if ctx.get_parameter_source(name).name == "COMMANDLINE"]
    if given and not inference_mode:  # a training estimate reads none of them: silently ignored otherwise
        raise UserError(
            given[0], "sizes serving, which only --inference estimates", f"add --inference, or drop {given[0]}"
        )
    if recipe is not None:
        recipe, model = recipe_or_model(recipe, model)
    flags = {
        "model": model,
        "seq_len": seq_len,
        "micro_batch": micro_batch,
        "global_batch_tokens": global_batch_tokens,
        "tokens": tokens,
        "gpus": gpus,
        "gpu": gpu,
        "tp": tp,
        "pp": pp,
        "cp": cp,
        "zero": zero,
        "dp_shard": dp_shard,
        "recompute": recompute,
        "attention": attention,
        "precision": precision,
        "optimizer": optimizer,
        "mfu": mfu,
        "price_per_gpu_hour": price,
        "target_days": target_days,
        "checkpoint_gbps": checkpoint_gbps,
        "checkpoint_hours": checkpoint_hours,
        "overhead": overhead,
        "tf32": tf32,
        "framework": framework,
        "async_checkpoint": False if sync_checkpoint else None,
    }
    scenario = scenario_from_sources(recipe=recipe, overrides=overrides, flags=flags)
    if inference_mode:
        served = estimate_inference(scenario, InferenceScenario(context, batch, kv_dtype.lower(), compare_attention))
        emit_json(served.to_dict()) if json_out else _render_inference(served)
        if require_fit and not served.inference["model"]["fits"]:
            raise CheckFailed(
                f"estimate: {served.model['name']} does not fit {scenario.gpu} for inference at "
                f"batch {batch} × {context} tokens"
            )
        return
    result = estimate(scenario, find=find)
    if validate:
        from smolctl.infra.measure import validate as run_validation

        with stderr_console().status("validating: forward + backward on this machine", spinner="dots"):
            result.validate = run_validation(scenario, transformers_config(scenario))
    if json_out:
        emit_json(result.to_dict())
    else:
        _render_estimate(result)
    if require_fit and not result.memory["fits"]:
        raise CheckFailed(f"estimate: does not fit {scenario.gpu} ({result.memory['total'] / 2**30:.1f} GiB per GPU)")


def _render_headlines(r: Estimate) -> None:
    for line in r.headlines:
        # not "error:": that prefix means a refused command (exit 2) everywhere else, and an estimate that does
        # not fit is still an answer (exit 0, or 1 with --require-fit)
        label = "[bold red]✗[/]" if line["level"] == "error" else "[bold yellow]warning:[/]"
        show(styled(f"{label} {escape(line['text'])}"), soft_wrap=True)


def _render_estimate(r: Estimate) -> None:
    m, lay, mem, comp = r.model, r.layout, r.memory, r.compute
    act = mem["activations_detail"]
    p = m["params"]
    show(
        key_values(
            f"model: {m['name']} ({m['model_type']})",
            [
                (
                    "parameters",
                    f"{human_count(p['total'])} ({p['total']:,}; closed form "
                    f"{'n/a' if p['closed_form'] is None else format(p['closed_form'], ',')})",
                ),
                (
                    "embedding / LM head",
                    f"{human_count(p['embedding'])} / {'tied' if m['tied'] else human_count(p['lm_head'])}",
                ),
                ("non-embedding / per layer", f"{human_count(p['non_embedding'])} / {human_count(p['per_layer'])}"),
                (
                    "shape",
                    f"{m['layers']} layers, hidden {m['hidden']}, FFN {m['ffn']}, {m['heads']} heads "
                    f"({m['kv_heads']} KV) × {m['head_dim']}, vocab {m['vocab']}",
                ),
            ],
        )
    )
    _render_headlines(r)
    show(
        key_values(
            "layout",
            [
                (
                    "GPUs",
                    f"{lay['gpus']} × {lay['gpu']} = tp {lay['tp']} × pp {lay['pp']} × cp {lay['cp']} × dp {lay['dp']}"
                    + (
                        f" (FSDP2 shard {lay['dp_shard']} × replicate {lay['dp'] // lay['dp_shard']})"
                        if lay["dp_shard"]
                        else ""
                    ),
                ),
                (
                    "batch",
                    f"micro {lay['micro_batch']} × {lay['seq_len']} tokens, accumulation {lay['gradient_accumulation']}, "
                    f"global {human_count(lay['global_batch_tokens'])} tokens/step",
                ),
                (
                    "training",
                    f"{lay['precision']}, {lay['optimizer']}, ZeRO-{lay['zero']}, recompute {lay['recompute']}, "
                    f"{lay['attention']} attention",
                ),
            ],
        )
    )
    rows = [
        (name, human_bytes(mem[key]), f"{mem[key] / mem['capacity']:.1%}")
        for name, key in [
            ("weights", "weights"),
            ("gradients", "grads"),
            ("fp32 master weights", "master"),
            ("optimizer states", "optimizer"),
            ("ZeRO-3 gather buffers", "gather"),
            (f"activations: {human_bytes(act['per_layer'])}/layer, head {human_bytes(act['head'])}", "activations"),
            ("logits gradient (transient)", "logits_grad"),
            ("allocator headroom", "allocator_headroom"),
            ("CUDA context + NCCL", "runtime_reserved"),
        ]
        if mem[key]
    ]
    verdict = "[green]fits[/]" if mem["fits"] else "[red]does not fit[/]"
    rows.append(
        (
            styled(f"total — {verdict} {escape(mem['gpu'])}"),
            human_bytes(mem["total"]),
            f"{mem['total'] / mem['capacity']:.1%}",
        )
    )
    stage = "" if mem["stage"] == "all" else f", {mem['stage']} pipeline stage"
    show(table(f"memory per GPU ({human_bytes(mem['capacity'])}{stage})", ["", "bytes", "of GPU"], rows))
    _render_compute(comp, lay["mfu"])
    for note in [comp["overhead"]["why"], *r.notes]:
        show(styled(f"[dim]note:[/] {escape(note)}"), soft_wrap=False)
    if r.find is not None:
        _render_find(r.find, lay)
    if r.validate is not None:
        _render_validation(r.validate)


def _render_compute(comp: dict, mfu: float) -> None:

    t = comp["time"]
    facts = [
        (
            "FLOPs per token",
            f"{comp['flops_per_token']:.3e} = 6N {comp['six_n']:.3e} + attention "
            f"{comp['attention_flops_per_token']:.3e}",
        ),
        ("tokens / total FLOPs", f"{human_count(comp['tokens'])} / {comp['total_flops']:.3e}"),
        (
            "throughput",
            f"{comp['tokens_per_second_per_gpu']:,.0f} tokens/s/GPU at MFU {mfu:.0%}; "
            f"{comp['step_seconds']:.2f} s/step, {comp['steps']:,} steps",
        ),
        ("compute time", human_duration(comp["compute_time"]["seconds"])),
        (
            "overhead",
            f"× {comp['overhead']['factor']:.3f} ({comp['overhead']['effective_training_time']:.1%} of "
            "the wall-clock time trains)",
        ),
        ("time", f"{human_duration(t['seconds'])} = {t['hours']:,.1f} h = {t['days']:.2f} days"),
        ("GPU-hours", f"{comp['gpu_hours']:,.0f}" + (f"  cost {comp['cost']:,.0f}" if comp["cost"] else "")),
        (
            "checkpoint",
            f"{human_bytes(comp['checkpoint']['bytes'])} (model only "
            f"{human_bytes(comp['checkpoint']['model_bytes'])}) every "
            f"{human_duration(comp['checkpoint']['interval_seconds'])}: "
            + (f"{comp['checkpoint']['stall_seconds']:.2g} s stall, then " if comp["checkpoint"]["async"] else "")
            + f"{comp['checkpoint']['write_seconds']:.1f} s to write at "
            f"{comp['checkpoint']['gbps_per_node']:g} GB/s per node",
        ),
    ]
    if comp.get("gpus_for_target"):
        target = comp["gpus_for_target"]
        facts.append((f"GPUs for {target['days']:g} days", f"{target['gpus']}"))
    if comp["pipeline_bubble"]:
        facts.append(("pipeline bubble", f"{comp['pipeline_bubble']:.1%} of each step (inside the MFU)"))
    show(key_values("compute and time", facts))


def _render_find(found: dict, lay: dict) -> None:

    show(styled(f"largest micro batch that fits this layout: [bold]{found['largest_micro_batch'] or 'none'}[/]"))
    if found["framework"] == "smolctl":
        columns = ["tp", "dp shard (FSDP2)", "dp replicate", "recompute", "accumulation", "total", "free"]
        rows = [
            (
                x["tp"],
                x["dp_shard"],
                x["dp_replicate"],
                x["recompute"],
                x["gradient_accumulation"],
                human_bytes(x["total"]),
                human_bytes(x["free"]),
            )
            for x in found["layouts"]
        ]
    else:
        columns = ["tp", "pp", "cp", "dp", "zero", "recompute", "accumulation", "total", "free"]
        rows = [
            (
                x["tp"],
                x["pp"],
                x["cp"],
                x["dp"],
                x["zero"],
                x["recompute"],
                x["gradient_accumulation"],
                human_bytes(x["total"]),
                human_bytes(x["free"]),
            )
            for x in found["layouts"]
        ]
    show(
        table(
            f"{found['framework']} layouts that fit {lay['gpus']} × {lay['gpu']} at micro batch "
            f"{lay['micro_batch']} and global batch {found['global_batch_tokens']:,} tokens, fastest first",
            columns,
            rows or [("none fit",) + ("",) * (len(columns) - 1)],
        )
    )
    skipped = found["skipped"]
    show(
        styled(
            f"[dim]left out: {skipped['batch']} layout(s) whose data parallel × micro batch does not divide "
            f"the global batch, {skipped['pipeline']} pipeline(s) with fewer micro batches than stages[/]"
        ),
        soft_wrap=True,
    )


def _render_inference(r: ServingEstimate) -> None:

    inf = r.inference
    sides = [("this model", inf["model"])] + (
        [("multi-head attention", inf["multi_head"])] if "multi_head" in inf else []
    )
    rows = [
        ("KV heads", *(str(x["kv_heads"]) for _, x in sides)),
        ("weights (bf16)", *(human_bytes(x["weights"]) for _, x in sides)),
        (f"KV cache per token ({inf['kv_dtype']})", *(human_bytes(x["kv_per_token"]) for _, x in sides)),
        (f"KV cache per sequence ({inf['context']:,} tokens)", *(human_bytes(x["kv_per_sequence"]) for _, x in sides)),
        (f"KV cache for the batch ({inf['batch']})", *(human_bytes(x["kv_cache"]) for _, x in sides)),
        ("prefill activations", *(human_bytes(x["activations"]) for _, x in sides)),
        ("CUDA context + workspaces", *(human_bytes(x["runtime_reserved"]) for _, x in sides)),
        (
            "total",
            *(
                styled(f"{human_bytes(x['total'])} — " + ("[green]fits[/]" if x["fits"] else "[red]does not fit[/]"))
                for _, x in sides
            ),
        ),
        (f"largest batch at {inf['context']:,} tokens", *(str(x["max_batch"]) for _, x in sides)),
        (f"longest context at batch {inf['batch']}", *(f"{x['max_context']:,}" for _, x in sides)),
        (
            f"decode bound ({inf['model']['memory_tbps']:g} TB/s)",
            *(
                f"{x['decode_tokens_per_second']:,.0f} tokens/s ({x['decode_tokens_per_second_per_sequence']:,.0f} per "
                "sequence)"
                for _, x in sides
            ),
        ),
    ]
    gpus = f"{inf['tp']} × {inf['gpu']}" if inf["tp"] > 1 else inf["gpu"]
    show(table(f"inference: {r.model['name']} on {gpus} (per GPU)", ["", *(name for name, _ in sides)], rows))
    show(
        styled(
            "[dim]note: decoding reads every weight and the batch's KV cache once per token, so memory "
            "bandwidth bounds tokens/s; real servers reach 60–80% of it[/]"
        ),
        soft_wrap=True,
    )


def _render_validation(v: dict) -> None:

    def fmt(row: dict, value: float) -> str:
        return {"bytes": human_bytes, "count": "{:,}".format}.get(row["unit"], "{:.4e}".format)(value)

    show(
        table(
            f"validate on {v['device']}: {v['ran']}, micro batch {v['micro_batch']} × {v['seq_len']}",
            ["", "estimate", "measured", "estimate/measured"],
            [
                (
                    row["what"],
                    fmt(row, row["estimate"]),
                    fmt(row, row["measured"]),
                    f"{row['estimate'] / row['measured']:.3f}",
                )
                for row in v["rows"]
            ],
        )
    )

"""`smolctl estimate`: exact parameter counts, FLOPs against FlopCounterMode, activation bytes against autograd's
saved-tensor hooks (every recompute mode), memory arithmetic, the published SmolLM3 run, and bad input."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from smolctl.cli import main
from smolctl.infra.estimate import (
    FAILURES_PER_GPU_DAY,
    estimate,
    estimate_inference,
    largest_micro_batch,
    load_model,
    memory,
    smallest_layouts,
    transformers_config,
)
from smolctl.infra.flops import matmul_params, training_flops_per_token
from smolctl.infra.inference import InferenceScenario
from smolctl.infra.measure import build_model, measure_activations, measure_flops, scaled_down, validate
from smolctl.infra.memory import GIB, GPUS, PRECISIONS, activations, state_bytes
from smolctl.infra.model_shape import config_from_dict, measure_shape, resolve_config
from smolctl.infra.scenario import scenario_from_sources

REPO = Path(__file__).resolve().parent.parent


def small(model_type: str, **extra):
    base = dict(
        model_type=model_type,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=500,
    )
    return config_from_dict({**base, **extra}, "test")


# Several architectures and the switches that change their parameter count or saved tensors.
CONFIGS = {
    "smollm3": lambda: scaled_down(resolve_config("smollm3-3b")),  # NoPE layer, tied, GQA 4:1
    "llama-bias-untied": lambda: small("llama", attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
    "qwen2": lambda: small("qwen2", num_key_value_heads=4),  # q/k/v biases, no GQA
    "qwen3": lambda: scaled_down(resolve_config("qwen3-0.6b")),  # q/k norms, head_dim ≠ hidden/heads
    "mistral": lambda: small("mistral", num_hidden_layers=3, hidden_size=96, num_attention_heads=6),
}


def test_smollm3_parameter_count_is_exact_on_the_meta_device():
    params = measure_shape(resolve_config("smollm3-3b")).params
    assert params.total == params.closed_form == 3_075_098_624
    assert params.embedding == 128256 * 2048 and params.lm_head == 0
    assert params.non_embedding == params.total - params.embedding
    assert params.total == params.embedding + 36 * params.per_layer + 2048  # + the final norm


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parameter_counts_match_an_allocated_model(name):
    config = CONFIGS[name]()
    params = measure_shape(config).params
    allocated = build_model(config, precision="fp32", attention="sdpa", recompute="none")
    assert params.total == params.closed_form == sum(p.numel() for p in allocated.parameters())


def test_flops_of_a_non_llama_model_come_from_its_own_matmuls(tmp_path):
    config = resolve_config(str(_gpt2_folder(tmp_path)))
    model = build_model(config, precision="fp32", attention="eager", recompute="none")
    measured = measure_flops(config, micro_batch=2, seq_len=32)
    assert training_flops_per_token(config, 32, matmul_params(model)) * 64 == pytest.approx(measured, rel=0.03)
    assert measure_shape(config).params.total == sum(p.numel() for p in model.parameters())


def _gpt2_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "gpt2-mini"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 300, "n_positions": 64}
        )
    )
    return folder


@pytest.mark.parametrize(
    "name,seq_len", [("smollm3", 64), ("smollm3", 160), ("llama-bias-untied", 96), ("qwen3", 64), ("mistral", 128)]
)
def test_flops_per_token_within_3_percent_of_flop_counter(name, seq_len):
    config = CONFIGS[name]()
    measured = measure_flops(config, micro_batch=1, seq_len=seq_len)
    exact = training_flops_per_token(config, seq_len, measure_shape(config).params.matmul) * seq_len
    closed = training_flops_per_token(config, seq_len) * seq_len  # what the training monitor uses
    assert abs(exact / measured - 1) < 0.03 and abs(closed / measured - 1) < 0.03


# (config, precision, attention, recompute): each recompute mode on several configs and precisions. "selective"
# checkpoints the eager attention core; with flash/sdpa it is "none" (the kernels already recompute it).
ACTIVATION_CASES = [
    ("smollm3", "bf16", "sdpa", "none"),
    ("smollm3", "bf16", "eager", "selective"),
    ("smollm3", "amp", "sdpa", "full"),
    ("llama-bias-untied", "amp", "eager", "none"),
    ("llama-bias-untied", "fp32", "eager", "selective"),
    ("llama-bias-untied", "bf16", "eager", "full"),
    ("qwen3", "fp32", "sdpa", "none"),
    ("qwen3", "amp", "eager", "selective"),
    ("qwen3", "bf16", "sdpa", "full"),
    ("qwen2", "amp", "sdpa", "full"),
]
# Longer sequences, where recomputing the eager core during backward outgrows the loss's tensors at the end of
# forward and sets the peak.
LONG_CASES = [
    ("smollm3", "bf16", "eager", "selective"),
    ("mistral", "amp", "eager", "selective"),
    ("llama-bias-untied", "fp32", "eager", "full"),
]


@pytest.mark.parametrize(
    "name,precision,attention,recompute,micro_batch,seq_len",
    [(*case, 2, 48) for case in ACTIVATION_CASES] + [(*case, 4, 384) for case in LONG_CASES],
)
def test_activation_bytes_within_10_percent_of_saved_tensors(
    name, precision, attention, recompute, micro_batch, seq_len
):
    config = CONFIGS[name]()
    shape = measure_shape(config)
    measured = measure_activations(
        config, micro_batch=micro_batch, seq_len=seq_len, precision=precision, attention=attention, recompute=recompute
    )
    estimated = activations(
        shape,
        micro_batch=micro_batch,
        seq_len=seq_len,
        precision=PRECISIONS[precision],
        attention=attention,
        recompute=recompute,
    ).peak(shape.layers)
    assert abs(estimated / measured - 1) < 0.10, (estimated, measured)


def test_recompute_modes_order_memory_as_they_should():
    shape = measure_shape(CONFIGS["smollm3"]())
    peaks = {
        mode: activations(
            shape, micro_batch=4, seq_len=256, precision=PRECISIONS["bf16"], attention="eager", recompute=mode
        ).peak(shape.layers)
        for mode in ("none", "selective", "full")
    }
    assert peaks["none"] > peaks["selective"] > peaks["full"]


def test_zero_stages_shard_what_they_should():
    kwargs = dict(precision=PRECISIONS["bf16"], optimizer="adamw", shard=8, tp=1)
    z0, z1, z2, z3 = (state_bytes(1e9, 1e7, zero=z, **kwargs) for z in range(4))
    assert (z0.weights, z0.grads, z0.master, z0.optimizer) == (2e9, 2e9, 4e9, 8e9)  # 16 bytes per parameter
    assert (z1.weights, z1.grads, z1.master, z1.optimizer) == (2e9, 2e9, 0.5e9, 1e9)
    assert z2.grads == 0.25e9 and z2.weights == 2e9
    assert z3.weights == 0.25e9 and z3.gather > 0
    tp2 = state_bytes(1e9, 1e7, zero=0, **{**kwargs, "tp": 2})
    assert tp2.total == pytest.approx(z0.total / 2)
    eight_bit = state_bytes(1e9, 1e7, zero=0, **{**kwargs, "optimizer": "adamw8bit"})
    assert eight_bit.optimizer == pytest.approx(2e9, rel=0.01)


def test_tensor_and_context_parallel_split_what_they_should():
    shape = measure_shape(resolve_config("smollm3-3b"))
    common = dict(micro_batch=2, seq_len=4096, precision=PRECISIONS["bf16"], attention="flash", recompute="none")
    base, tp2, cp2 = (activations(shape, **common, tp=tp, cp=cp) for tp, cp in ((1, 1), (2, 1), (1, 2)))
    for split in (tp2, cp2):  # sequence parallelism / context parallelism: every per-token tensor halves
        assert split.per_layer == pytest.approx(base.per_layer / 2) and split.head == pytest.approx(base.head / 2)
    full = activations(shape, **{**common, "recompute": "full"})
    assert full.per_layer == pytest.approx(2 * 2 * 4096 * 2048)  # bf16 layer input per token
    assert full.recompute == pytest.approx(base.per_layer)


def test_smollm3_published_run_lands_near_24_days():
    scenario = scenario_from_sources(
        recipe=str(REPO / "recipes/smollm3.toml"),
        flags={"gpus": 384, "gpu": "h100", "tp": 2, "tokens": "11.2T", "mfu": 0.30},
    )
    result = estimate(scenario)
    days = result.compute["time"]["days"]
    assert abs(days / 24 - 1) < 0.10
    assert result.compute["six_n"] * 11.2e12 == pytest.approx(6 * 3.075e9 * 11.2e12, rel=0.01)
    assert result.layout["gradient_accumulation"] == 1 and result.layout["dp"] == 192
    assert result.memory["fits"] and result.memory["stage"] == "all"


def test_pipeline_stages_hold_the_embedding_first_and_the_head_last():
    scenario = scenario_from_sources(
        flags={
            "model": "llama3-8b",
            "gpus": 8,
            "pp": 4,
            "micro_batch": 1,
            "global_batch_tokens": 16 * 2048,
            "seq_len": 2048,
        }
    )
    _, shape = load_model(scenario)
    one_stage = memory(scenario_from_sources(flags={"model": "llama3-8b", "gpus": 8, "seq_len": 2048}), shape)
    result = memory(scenario, shape)
    assert result["stage"] in ("first", "last")
    assert result["weights"] < one_stage["weights"] / 3
    assert result["micro_batches_in_flight"] == 4


def test_find_returns_the_largest_micro_batch_and_layouts_that_fit():
    scenario = scenario_from_sources(
        flags={
            "model": "smollm3-3b",
            "gpus": 16,
            "gpu": "a100-40",
            "seq_len": 4096,
            "zero": 1,
            "recompute": "full",
            "precision": "bf16",
        }
    )
    _, shape = load_model(scenario)
    from dataclasses import replace

    best = largest_micro_batch(scenario, shape)
    assert best is not None
    assert memory(replace(scenario, micro_batch=best), shape)["fits"]
    assert not memory(replace(scenario, micro_batch=best + 1 if best < 8 else best * 2), shape)["fits"]
    found = smallest_layouts(scenario, shape)
    layouts = found["layouts"]
    assert found["framework"] == "smolctl" and layouts
    for x in layouts:  # what `smolctl pretrain` runs: tp × FSDP2 shard × replicate, no pipeline or context parallel
        assert (x["pp"], x["cp"]) == (1, 1) and x["tp"] * x["dp_shard"] * x["dp_replicate"] == 16
        assert x["zero"] == (3 if x["dp_shard"] > 1 else 0) and x["total"] <= 39.4 * GIB


def test_find_holds_the_global_batch_and_fills_every_pipeline():
    # 8 sequences per step on 16 GPUs: dp 16 (× micro batch 1) cannot hold it, and dp 8 with 2 stages would run
    # one micro batch through a 2-stage pipeline
    scenario = scenario_from_sources(
        flags={
            "model": "smollm3-3b",
            "gpus": 16,
            "gpu": "a100-40",
            "seq_len": 4096,
            "global_batch_tokens": 8 * 4096,
            "framework": "megatron",
        }
    )
    _, shape = load_model(scenario)
    found = smallest_layouts(scenario, shape, top=1000)
    assert found["skipped"]["batch"] > 0 and found["skipped"]["pipeline"] > 0 and found["layouts"]
    for x in found["layouts"]:
        assert 8 % x["dp"] == 0 and x["gradient_accumulation"] == 8 // x["dp"] >= x["pp"]
        assert x["global_batch_tokens"] == 8 * 4096
    assert any(x["pp"] > 1 for x in found["layouts"])


def test_kv_weights_are_replicated_when_tp_exceeds_the_kv_heads():
    shape = load_model(scenario_from_sources(flags={"model": "smollm3-3b", "gpus": 8}))[1]  # 4 KV heads
    kv = shape.layers * 2 * shape.hidden * shape.kv_dim
    weights = {
        tp: memory(scenario_from_sources(flags={"model": "smollm3-3b", "gpus": 8, "tp": tp}), shape)["weights"]
        for tp in (4, 8)
    }
    assert weights[4] == pytest.approx(shape.params.total / 4 * 2)
    assert weights[8] == pytest.approx(((shape.params.total - kv) / 8 + kv / 4) * 2)  # one whole KV head per rank


def test_fp32_runs_at_the_plain_fp32_rate_unless_tf32_is_on():
    flags = {"model": "smollm2-135m", "gpus": 8, "precision": "fp32", "tokens": "1G"}
    plain, tf32 = (estimate(scenario_from_sources(flags={**flags, "tf32": on})).compute for on in (False, True))
    assert plain["peak_flops_per_gpu"] == GPUS["h100"].fp32_tflops * 1e12
    assert tf32["peak_flops_per_gpu"] == GPUS["h100"].bf16_tflops * 1e12 / 2
    assert plain["compute_time"]["seconds"] / tf32["compute_time"]["seconds"] == pytest.approx(989.4 / 2 / 66.9)


def test_hsdp_shards_the_states_over_dp_shard_ranks_only():
    flags = {"model": "smollm3-3b", "gpus": 64, "zero": 3}
    shape = load_model(scenario_from_sources(flags=flags))[1]
    fsdp, hsdp = (memory(scenario_from_sources(flags={**flags, "dp_shard": shard}), shape) for shard in (None, 8))
    assert hsdp["optimizer"] == pytest.approx(fsdp["optimizer"] * 8) and hsdp["weights"] == pytest.approx(
        fsdp["weights"] * 8
    )
    assert hsdp["gather"] == fsdp["gather"]


def test_zero3_gathers_the_largest_unit_even_when_it_is_the_embedding():
    scenario = scenario_from_sources(flags={"model": "smollm2-135m", "gpus": 8, "zero": 3})
    shape = load_model(scenario)[1]
    assert shape.params.embedding > 5 * shape.params.per_layer  # 49k × 576 against one 3.5M-parameter layer
    assert memory(scenario, shape)["gather"] == pytest.approx(shape.params.embedding * (2 * 2 + 2))


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


def test_llama3_405b_reproduces_its_published_goodput_and_gpu_hours():
    # Meta's model card: 30.84M H100 GPU-hours; the Llama 3 paper: >90% effective training time on 16,384 H100s
    # at 38% MFU, 419 unexpected interruptions in 54 days
    result = estimate(scenario_from_sources(flags=LLAMA3_405B))
    compute = result.compute
    assert abs(compute["gpu_hours"] / 30.84e6 - 1) < 0.15, compute["gpu_hours"]
    assert compute["overhead"]["effective_training_time"] > 0.90
    assert compute["overhead"]["mtbf_hours"] == pytest.approx(24 / (FAILURES_PER_GPU_DAY * 16384))
    # the old model (one 5 GB/s store for the whole cluster, every write blocking, hourly) loses a quarter
    blocking = estimate(
        scenario_from_sources(
            flags={**LLAMA3_405B, "checkpoint_gbps": 5 / 2048, "checkpoint_hours": 1.0, "async_checkpoint": False}
        )
    ).compute["overhead"]
    assert blocking["effective_training_time"] < 0.75


def test_the_checkpoint_interval_follows_young_daly_unless_given():
    base = {"model": "smollm3-3b", "gpus": 384, "tokens": "1T"}
    fast = estimate(scenario_from_sources(flags=base)).compute["overhead"]
    stall, mtbf = fast["checkpoint_stall_seconds"], fast["mtbf_hours"] * 3600
    assert fast["checkpoint_interval_seconds"] == pytest.approx(
        max((2 * stall * mtbf) ** 0.5, fast["checkpoint_write_seconds"])
    )
    hourly = estimate(scenario_from_sources(flags={**base, "checkpoint_hours": 1.0})).compute["overhead"]
    assert hourly["checkpoint_interval_seconds"] == 3600 and hourly["factor"] > fast["factor"]
    blocking = estimate(scenario_from_sources(flags={**base, "async_checkpoint": False})).compute["overhead"]
    assert blocking["checkpoint_stall_seconds"] == blocking["checkpoint_write_seconds"] > stall
    twice = estimate(scenario_from_sources(flags={**base, "gpus": 768})).compute["overhead"]
    assert twice["checkpoint_write_seconds"] == pytest.approx(fast["checkpoint_write_seconds"] / 2)  # per node


def test_inference_kv_cache_of_smollm3_at_8k():
    scenario = scenario_from_sources(flags={"model": "smollm3-3b"})
    result = estimate_inference(scenario, InferenceScenario(context=8192, batch=4, compare_attention=True)).inference
    gqa, mha = result["model"], result["multi_head"]
    formula = 2 * 36 * 4 * 128 * 8192 * 2  # K and V × layers × KV heads × head dim × context × bf16
    assert abs(gqa["kv_per_sequence"] / formula - 1) < 0.01 and gqa["kv_cache"] == 4 * gqa["kv_per_sequence"]
    assert mha["kv_heads"] == 16 and mha["kv_per_sequence"] == pytest.approx(4 * gqa["kv_per_sequence"])
    assert mha["weights"] > gqa["weights"] and mha["max_batch"] < gqa["max_batch"]
    assert gqa["decode_tokens_per_second"] == pytest.approx(4 * 3.35e12 / (gqa["weights"] + gqa["kv_cache"]))
    fp8 = estimate_inference(scenario, InferenceScenario(context=8192, kv_dtype="fp8")).inference["model"]
    assert fp8["kv_per_sequence"] == pytest.approx(formula / 2)
    assert gqa["fits"] and gqa["total"] == pytest.approx(
        gqa["weights"] + gqa["kv_cache"] + gqa["activations"] + gqa["runtime_reserved"]
    )


def test_validate_on_the_tiny_recipe_agrees_with_measurement(tmp_path):
    packed = tmp_path / "packed"
    packed.mkdir()
    (packed / "manifest.json").write_text(json.dumps({"kind": "packed", "tokenizer": {"vocab_size": 1024}}))
    recipe = tmp_path / "tiny.toml"
    recipe.write_text((REPO / "recipes/smollm3-tiny.toml").read_text().replace('"demo-out/packed"', f'"{packed}"'))
    scenario = scenario_from_sources(
        recipe=str(recipe), overrides=["training.micro_batch=2", "training.global_batch=4"]
    )
    assert scenario.model["vocab_size"] == 1024 and scenario.precision == "amp" and scenario.gpus == 2
    report = validate(scenario, transformers_config(scenario))
    assert len(report["rows"]) >= 6
    for row in report["rows"]:
        assert abs(row["estimate"] / row["measured"] - 1) < 0.10, row


def run_cli(capsys, *args) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def test_cli_json_for_a_preset(capsys):
    code, out, _ = run_cli(
        capsys,
        "estimate",
        "--model",
        "smollm3-3b",
        "--gpus",
        "8",
        "--tokens",
        "100G",
        "--price-per-gpu-hour",
        "2.5",
        "--target-days",
        "7",
        "--json",
    )
    result = json.loads(out)
    assert code == 0 and result["model"]["params"]["total"] == 3_075_098_624
    compute = result["compute"]
    assert compute["cost"] == pytest.approx(compute["gpu_hours"] * 2.5)
    assert compute["time"]["hours"] == pytest.approx(compute["time"]["seconds"] / 3600)
    assert compute["gpus_for_target"]["gpus"] >= math.ceil(compute["time"]["days"] / 7 * 8 * 0.9)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "gpt-9"], "known models: smollm3-3b"),
        (["--model", "smollm3-3b", "--gpu", "v100"], "known: h100"),
        (["--model", "smollm3-3b", "--gpus", "6", "--tp", "4"], "cannot hold tp 4"),
        (["--model", "smollm3-3b", "--gpus", "6", "--tp", "3"], "does not divide the 16 attention heads"),
        (["--model", "smollm3-3b", "--tokens", "many"], "cannot read 'many' as an amount"),
        (["--model", "smollm3-3b", "--recompute", "some"], "known: none, selective, full"),
        (["--model", "smollm3-3b", "--checkpoint-gbps", "0"], "--checkpoint-gbps: must be positive"),
        (["--model", "smollm3-3b", "--pp", "40"], "40 pipeline stages for 36 layers"),
        (["--model", "smollm3-3b", "--framework", "deepspeed"], "known: smolctl, megatron"),
        (["--model", "smollm3-3b", "--gpus", "16", "--dp-shard", "8"], "--dp-shard: 8 shards weights"),
        (["--model", "smollm3-3b", "--gpus", "16", "--zero", "3", "--dp-shard", "3"], "3 does not divide the 16"),
        (["--model", "smollm3-3b", "--inference", "--kv-dtype", "int4"], "--kv-dtype: 'int4' is not known"),
        (["--model", "smollm3-3b", "--inference", "--context", "0"], "--context: must be at least 1"),
        (["--model", "smollm3-3b", "--tp", "0"], "--tp: must be at least 1, got 0 — use 1 or more"),
        (
            ["--model", "smollm3-3b", "--gpus", "8", "--global-batch-tokens", "5000"],
            "use a multiple of 4096, e.g. 8192",
        ),
        (
            [str(REPO / "recipes/smollm3.toml"), "--seq-len", "1"],
            "--gpus: not given, so one per data-parallel rank of the global batch: 1572864 GPUs",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, args, message):
    code, _, err = run_cli(capsys, "estimate", *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "override,message",
    [
        ("training.seqlen=8192", "training.seqlen: unknown key — did you mean 'seq_len'?"),
        ('training.activation_checkpointing="ful"', "did you mean 'full'?"),
        ('parallel.tp="2"', "parallel.tp: expected int, got '2'"),
        ("training.micro_batch=2.5", "training.micro_batch: expected int, got 2.5"),
        ("parallel.dp_replicate=5", "parallel.dp_replicate: 5 does not divide the 192 ranks"),
    ],
)
def test_a_recipe_is_checked_as_pretrain_checks_it(capsys, override, message):
    """estimate read the recipe's TOML as it was: a typo was ignored (and the estimate was of another run), a
    wrong type crashed it."""
    code, _, err = run_cli(capsys, "estimate", str(REPO / "recipes/smollm3.toml"), "--gpus", "384", "--set", override)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("dp_shard", [1, 8])
def test_a_recipes_parallel_mesh_is_sized_as_the_pretrain_dry_run_sizes_it(capsys, dp_shard):
    """estimate ignored [parallel] dp_shard: FSDP2 over all 192 data-parallel ranks, whatever the recipe said, so
    dp_shard 1 (TP with replicas, nothing sharded) came out 24 GiB too low."""
    recipe, mesh = str(REPO / "recipes/smollm3.toml"), f"parallel.dp_shard={dp_shard}"
    code, out, err = run_cli(capsys, "estimate", recipe, "--gpus", "384", "--set", mesh, "--json")
    assert code == 0, err
    estimated = json.loads(out)["memory"]["total"]
    code, out, err = run_cli(capsys, "pretrain", recipe, "--dry-run", "--world-size", "384", "--set", mesh, "--json")
    assert code == 0, err
    assert estimated == pytest.approx(json.loads(out)["memory"]["total"], rel=1e-9)
    flat = json.loads(run_cli(capsys, "estimate", recipe, "--gpus", "384", "--json")[1])["memory"]["total"]
    assert (estimated > flat + 2 * GIB) if dp_shard == 1 else (estimated > flat)


def test_recipe_without_vocabulary_says_how_to_give_it(capsys, tmp_path):
    recipe = tmp_path / "tiny.toml"
    shutil.copy(REPO / "recipes/smollm3-tiny.toml", recipe)
    text = recipe.read_text().replace('"demo-out/packed"', f'"{tmp_path / "missing"}"')
    recipe.write_text(text)
    code, _, err = run_cli(capsys, "estimate", str(recipe))
    assert code == 2 and "--set model.vocab_size=N" in err


def test_repeat_estimates_read_the_measured_shape_from_the_cache(tmp_path, monkeypatch):
    import json

    from conftest import run_cli

    cache = tmp_path / "cache"
    env = {"SMOLCTL_CACHE": str(cache)}
    first = run_cli("estimate", "--model", "smollm2-135m", "--json", env=env)
    assert first.returncode == 0, first.stderr
    entries = list((cache / "model-shapes").glob("*.json"))
    assert len(entries) == 1
    second = run_cli("estimate", "--model", "smollm2-135m", "--json", env=env)
    assert json.loads(second.stdout) == json.loads(first.stdout)
    entries[0].write_text("{not json")
    third = run_cli("estimate", "--model", "smollm2-135m", "--json", env=env)
    assert json.loads(third.stdout) == json.loads(first.stdout)
    assert (
        json.loads(entries[0].read_text())["shape"]["params"]["total"]
        == json.loads(first.stdout)["model"]["params"]["total"]
    )


def test_estimate_says_what_it_prices_and_whether_it_fits(capsys):
    code, out, err = run_cli(capsys, "estimate", "--model", "llama3-8b", "--gpus", "8")
    text = " ".join((out + err).split())
    assert code == 0 and "no --tokens: the time and cost below are for ONE optimizer step" in text
    assert (
        "✗ does not fit h100" in text
        and "error:" not in text
        and text.index("does not fit h100") < text.index("layout")
    )
    code, out, err = run_cli(
        capsys, "estimate", "--model", "llama3-8b", "--gpus", "8", "--tokens", "1T", "--require-fit"
    )
    assert code == 1 and "failed: estimate: does not fit h100" in " ".join(err.split())
    assert "ONE optimizer step" not in out + err
    code, _, _ = run_cli(
        capsys, "estimate", "--model", "smollm2-135m", "--gpus", "8", "--tokens", "1T", "--require-fit"
    )
    assert code == 0


def test_estimate_says_when_it_changes_the_global_batch(capsys):
    code, out, err = run_cli(
        capsys,
        "estimate",
        "--model",
        "smollm3-3b",
        "--gpus",
        "384",
        "--micro-batch",
        "3",
        "--global-batch-tokens",
        "2359296",
        "--tokens",
        "1T",
    )
    text = " ".join((out + err).split())
    assert code == 0 and "global batch changed from 2,359,296 to 4,718,592 tokens" in text
    assert "do not divide the 576 asked for" in text


def test_cli_inference_json(capsys):
    code, out, _ = run_cli(
        capsys,
        "estimate",
        "--model",
        "smollm3-3b",
        "--inference",
        "--context",
        "8192",
        "--batch",
        "2",
        "--compare-attention",
        "--json",
    )
    result = json.loads(out)["inference"]
    assert code == 0 and result["batch"] == 2 and result["multi_head"]["kv_heads"] == 16
    code, _, err = run_cli(
        capsys,
        "estimate",
        "--model",
        "smollm3-3b",
        "--inference",
        "--gpu",
        "l4",
        "--context",
        "131072",
        "--batch",
        "64",
        "--require-fit",
    )
    assert code == 1 and "does not fit l4 for inference" in err


@pytest.mark.parametrize("flag", ["--pp", "--cp"])
def test_a_recipe_sized_with_pipeline_or_context_parallel_keeps_that_layout(capsys, flag):
    """pretrain's mesh is tp × data parallel: laid over a --pp/--cp layout it failed on a --dp-shard not given."""
    recipe = str(REPO / "recipes/smollm3.toml")
    code, out, err = run_cli(capsys, "estimate", recipe, "--gpus", "384", flag, "2", "--json")
    assert code == 0, err
    layout = json.loads(out)["layout"]
    assert layout[flag[2:]] == 2 and layout["tp"] * layout["pp"] * layout["cp"] * layout["dp"] == 384

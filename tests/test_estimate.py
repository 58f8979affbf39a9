"""`smolctl estimate`: exact parameter counts, FLOPs against FlopCounterMode, activation bytes against autograd's
saved-tensor hooks (every recompute mode), memory arithmetic, the published SmolLM3 run, and bad input."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from smolctl.cli import main
from smolctl.errors import UserError
from smolctl.infra.estimate import estimate, largest_micro_batch, load_model, memory, smallest_layouts, transformers_config
from smolctl.infra.flops import matmul_params, training_flops_per_token
from smolctl.infra.measure import build_model, measure_activations, measure_flops, scaled_down, validate
from smolctl.infra.memory import GIB, PRECISIONS, activations, state_bytes
from smolctl.infra.model_shape import config_from_dict, measure_shape, resolve_config
from smolctl.infra.plan import parse_count, plan_from_sources

REPO = Path(__file__).resolve().parent.parent


def small(model_type: str, **extra):
    base = dict(model_type=model_type, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=500)
    return config_from_dict({**base, **extra}, "test")


# Several architectures and the switches that change their parameter count or saved tensors.
CONFIGS = {
    "smollm3": lambda: scaled_down(resolve_config("smollm3-3b")),   # NoPE layer, tied, GQA 4:1
    "llama-bias-untied": lambda: small("llama", attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
    "qwen2": lambda: small("qwen2", num_key_value_heads=4),           # q/k/v biases, no GQA
    "qwen3": lambda: scaled_down(resolve_config("qwen3-0.6b")),       # q/k norms, head_dim ≠ hidden/heads
    "mistral": lambda: small("mistral", num_hidden_layers=3, hidden_size=96, num_attention_heads=6),
}


def test_token_counts_parse_with_suffixes_and_reject_junk():
    assert parse_count("11.2T", "--tokens") == 11_200_000_000_000
    assert parse_count("100B", "--tokens") == 100_000_000_000
    assert parse_count("5e9", "--tokens") == 5_000_000_000
    assert parse_count("2_359_296", "--tokens") == 2_359_296
    assert parse_count("350m", "--tokens") == 350_000_000
    for bad in ("lots", "1.2X", "-5", "0", "T"):
        with pytest.raises(UserError):
            parse_count(bad, "--tokens")


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
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
                                                    "vocab_size": 300, "n_positions": 64}))
    return folder


@pytest.mark.parametrize("name,seq_len", [("smollm3", 64), ("smollm3", 160), ("llama-bias-untied", 96),
                                          ("qwen3", 64), ("mistral", 128)])
def test_flops_per_token_within_3_percent_of_flop_counter(name, seq_len):
    config = CONFIGS[name]()
    measured = measure_flops(config, micro_batch=1, seq_len=seq_len)
    exact = training_flops_per_token(config, seq_len, measure_shape(config).params.matmul) * seq_len
    closed = training_flops_per_token(config, seq_len) * seq_len  # what the training monitor uses
    assert abs(exact / measured - 1) < 0.03 and abs(closed / measured - 1) < 0.03


# (config, precision, attention, recompute): each recompute mode on several configs and precisions. "selective"
# checkpoints the eager attention core; with flash/sdpa it is "none" (the kernels already recompute it).
ACTIVATION_CASES = [
    ("smollm3", "bf16", "sdpa", "none"), ("smollm3", "bf16", "eager", "selective"), ("smollm3", "amp", "sdpa", "full"),
    ("llama-bias-untied", "amp", "eager", "none"), ("llama-bias-untied", "fp32", "eager", "selective"),
    ("llama-bias-untied", "bf16", "eager", "full"), ("qwen3", "fp32", "sdpa", "none"),
    ("qwen3", "amp", "eager", "selective"), ("qwen3", "bf16", "sdpa", "full"), ("qwen2", "amp", "sdpa", "full"),
]
# Longer sequences, where recomputing the eager core during backward outgrows the loss's tensors at the end of
# forward and sets the peak.
LONG_CASES = [("smollm3", "bf16", "eager", "selective"), ("mistral", "amp", "eager", "selective"),
              ("llama-bias-untied", "fp32", "eager", "full")]


@pytest.mark.parametrize("name,precision,attention,recompute,micro_batch,seq_len",
                         [(*case, 2, 48) for case in ACTIVATION_CASES] + [(*case, 4, 384) for case in LONG_CASES])
def test_activation_bytes_within_10_percent_of_saved_tensors(name, precision, attention, recompute, micro_batch,
                                                              seq_len):
    config = CONFIGS[name]()
    shape = measure_shape(config)
    measured = measure_activations(config, micro_batch=micro_batch, seq_len=seq_len, precision=precision,
                                   attention=attention, recompute=recompute)
    estimated = activations(shape, micro_batch=micro_batch, seq_len=seq_len, precision=PRECISIONS[precision],
                            attention=attention, recompute=recompute).peak(shape.layers)
    assert abs(estimated / measured - 1) < 0.10, (estimated, measured)


def test_recompute_modes_order_memory_as_they_should():
    shape = measure_shape(CONFIGS["smollm3"]())
    peaks = {mode: activations(shape, micro_batch=4, seq_len=256, precision=PRECISIONS["bf16"], attention="eager",
                               recompute=mode).peak(shape.layers) for mode in ("none", "selective", "full")}
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
    plan = plan_from_sources(recipe=str(REPO / "recipes/smollm3.toml"),
                             flags={"gpus": 384, "gpu": "h100", "tp": 2, "tokens": "11.2T", "mfu": 0.30})
    result = estimate(plan)
    days = result["compute"]["time"]["days"]
    assert abs(days / 24 - 1) < 0.10
    assert result["compute"]["six_n"] * 11.2e12 == pytest.approx(6 * 3.075e9 * 11.2e12, rel=0.01)
    assert result["layout"]["gradient_accumulation"] == 1 and result["layout"]["dp"] == 192
    assert result["memory"]["fits"] and result["memory"]["stage"] == "all"


def test_pipeline_stages_hold_the_embedding_first_and_the_head_last():
    plan = plan_from_sources(flags={"model": "llama3-8b", "gpus": 8, "pp": 4, "micro_batch": 1,
                                    "global_batch_tokens": 16 * 2048, "seq_len": 2048})
    config, shape = load_model(plan)
    one_stage = memory(plan_from_sources(flags={"model": "llama3-8b", "gpus": 8, "seq_len": 2048}), shape)
    result = memory(plan, shape)
    assert result["stage"] in ("first", "last")
    assert result["weights"] < one_stage["weights"] / 3
    assert result["micro_batches_in_flight"] == 4


def test_find_returns_the_largest_micro_batch_and_layouts_that_fit():
    plan = plan_from_sources(flags={"model": "smollm3-3b", "gpus": 16, "gpu": "a100-40", "seq_len": 4096, "zero": 1, "recompute": "full",
                                    "precision": "bf16"})
    config, shape = load_model(plan)
    from dataclasses import replace

    best = largest_micro_batch(plan, shape)
    assert best is not None
    assert memory(replace(plan, micro_batch=best), shape)["fits"]
    assert not memory(replace(plan, micro_batch=best + 1 if best < 8 else best * 2), shape)["fits"]
    layouts = smallest_layouts(plan, shape)
    assert layouts and all(x["tp"] * x["pp"] * x["cp"] * x["dp"] == 16 for x in layouts)
    assert all(x["total"] <= 39.4 * GIB for x in layouts)


def test_validate_on_the_tiny_recipe_agrees_with_measurement(tmp_path):
    packed = tmp_path / "packed"
    packed.mkdir()
    (packed / "manifest.json").write_text(json.dumps({"kind": "packed", "tokenizer": {"vocab_size": 1024}}))
    recipe = tmp_path / "tiny.toml"
    recipe.write_text((REPO / "recipes/smollm3-tiny.toml").read_text().replace('"demo-out/packed"', f'"{packed}"'))
    plan = plan_from_sources(recipe=str(recipe), overrides=["training.micro_batch=2", "training.global_batch=4"])
    assert plan.model["vocab_size"] == 1024 and plan.precision == "amp" and plan.gpus == 2
    report = validate(plan, transformers_config(plan))
    assert len(report["rows"]) >= 6
    for row in report["rows"]:
        assert abs(row["estimate"] / row["measured"] - 1) < 0.10, row


def run_cli(capsys, *args) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def test_cli_json_for_a_preset(capsys):
    code, out, _ = run_cli(capsys, "estimate", "--model", "smollm3-3b", "--gpus", "8",
                           "--tokens", "100B", "--price-per-gpu-hour", "2.5", "--target-days", "7", "--json")
    result = json.loads(out)
    assert code == 0 and result["model"]["params"]["total"] == 3_075_098_624
    compute = result["compute"]
    assert compute["cost"] == pytest.approx(compute["gpu_hours"] * 2.5)
    assert compute["time"]["hours"] == pytest.approx(compute["time"]["seconds"] / 3600)
    assert compute["gpus_for_target"]["gpus"] >= math.ceil(compute["time"]["days"] / 7 * 8 * 0.9)


@pytest.mark.parametrize("args,message", [
    (["--model", "gpt-9"], "known models: smollm3-3b"),
    (["--model", "smollm3-3b", "--gpu", "v100"], "known: h100"),
    (["--model", "smollm3-3b", "--gpus", "6", "--tp", "4"], "cannot hold tp 4"),
    (["--model", "smollm3-3b", "--gpus", "6", "--tp", "3"], "does not divide the 16 attention heads"),
    (["--model", "smollm3-3b", "--tokens", "many"], "is not a count"),
    (["--model", "smollm3-3b", "--recompute", "some"], "known: none, selective, full"),
    (["--model", "smollm3-3b", "--checkpoint-gbps", "0"], "--checkpoint-gbps: must be positive"),
    (["--model", "smollm3-3b", "--pp", "40"], "40 pipeline stages for 36 layers"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, message):
    code, _, err = run_cli(capsys, "estimate", *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


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
    assert json.loads(entries[0].read_text())["shape"]["params"]["total"] == json.loads(first.stdout)["model"]["params"]["total"]

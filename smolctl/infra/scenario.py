"""The run `smolctl estimate` sizes: model, batch, precision, parallel layout and cluster, read from a pretrain
recipe and/or flags (flags win), checked before anything is computed.

    scenario = scenario_from_sources(recipe="recipes/smollm3.toml", flags={"gpus": 384, "tp": 2, "tokens": "11.2T"})
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from smolctl.errors import UserError
from smolctl.infra.memory import ATTENTIONS, GPUS, OPTIMIZER_BYTES, PRECISIONS, RECOMPUTES
from smolctl.recipe import load_toml
from smolctl.units import parse_count


@dataclass(frozen=True, kw_only=True)
class TrainingScenario:
    model: dict[str, Any] | str
    """A recipe [model] table, or a preset name / config.json path."""
    seq_len: int = 4096
    micro_batch: int = 1
    """Sequences per forward/backward on one GPU."""
    global_batch_tokens: int | None = None
    """Tokens per optimizer step over all GPUs; default: one micro batch per data-parallel rank."""
    tokens: int | None = None
    """Training tokens; default: one step of the global batch."""
    gpus: int | None = None
    """Default: enough data-parallel ranks to run the global batch without gradient accumulation."""
    gpu: str = "h100"
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: int = 0
    recompute: str = "none"
    attention: str = "flash"
    precision: str = "bf16"
    optimizer: str = "adamw"
    mfu: float = 0.30
    """Achieved model FLOPs utilisation (steady state, as the training monitor reports it)."""
    tf32: bool = False
    """fp32 matmuls on tensor cores (TF32); off by default in PyTorch, so fp32 runs at the plain fp32 rate."""
    price_per_gpu_hour: float | None = None
    target_days: float | None = None
    checkpoint_gbps: float = 1.0
    """Checkpoint write bandwidth per node, GB/s (Llama 3's storage: 2 TB/s sustained over 2,048 nodes)."""
    checkpoint_hours: float | None = None
    """Hours between checkpoints; default: Young/Daly's optimum for the cluster's failure rate."""
    async_checkpoint: bool = True
    """Training waits only for the copy to host memory; the write to storage runs behind it (DCP async_save)."""
    overhead: float | None = None
    """Replace the computed overhead factor (checkpoint writes + failure recovery) by this one."""
    framework: str = "smolctl"
    """What --find may propose: smolctl (tp × FSDP2/HSDP data parallel, as `smolctl pretrain` runs) or megatron
    (tp, pp, cp, ZeRO 0–3)."""
    dp_shard: int | None = None
    """FSDP2/HSDP: data-parallel ranks one replica is sharded over (default: all of them, when zero = 3)."""
    sequence_parallel: bool = True
    """False for smolctl's trainer: its TP splits attention and MLP only; norms and the LM head stay whole."""
    loss_chunk_tokens: int | None = None
    """smolctl's trainer: the LM head + cross-entropy run over chunks of this many tokens (None: full logits)."""
    source: str = "flags"
    gpus_given: bool = True
    """False where --gpus was derived from the global batch (an error about the GPU count then says so)."""
    notes: tuple[str, ...] = field(default=())

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp


# Recipe [training] keys → scenario fields; values translated where the recipe speaks the trainer's language.
_RECIPE_PRECISION = {"auto": "amp", "bf16": "amp", "fp32": "fp32"}
FRAMEWORKS = ("smolctl", "megatron")
_RECIPE_ATTENTION = {"sdpa": "sdpa", "eager": "eager", "flash_attention_2": "flash", "flex_attention": "flash"}


def _vocab_from_tokenizer(folder: Path) -> int | None:
    """Vocabulary of a local tokenizer folder, read from tokenizer.json without loading the tokenizer."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    ids = list(data.get("model", {}).get("vocab", {}).values()) + [t["id"] for t in data.get("added_tokens", [])]
    return max(ids) + 1 if ids else None


def _vocab_from_data(recipe: dict) -> int | None:
    data = recipe.get("data", {})
    paths = list(data.get("paths") or []) + [p for stage in data.get("stages") or [] for p in stage.get("paths", [])]
    for path in paths:
        manifest = Path(path) / "manifest.json"
        if manifest.is_file():
            vocab = json.loads(manifest.read_text()).get("tokenizer", {}).get("vocab_size")
            if vocab:
                return int(vocab)
    return None


def recipe_values(recipe: dict, path: str) -> dict[str, Any]:
    model = dict(recipe.get("model") or {})
    if not model:
        raise UserError(path, "has no [model] table", "pass a pretrain recipe (recipes/smollm3.toml) or use --model")
    if "vocab_size" not in model:
        tokenizer = model.get("tokenizer")
        vocab = (_vocab_from_tokenizer(Path(tokenizer)) if tokenizer else None) or _vocab_from_data(recipe)
        if vocab is None:
            raise UserError(
                f"{path}: model.vocab_size",
                "is not set and no local tokenizer or packed data says it",
                "add --set model.vocab_size=N (or run `smolctl pack` first)",
            )
        model["vocab_size"] = vocab
    training = recipe.get("training") or {}
    values: dict[str, Any] = {"model": model}
    for key in ("seq_len", "micro_batch"):
        if key in training:
            values[key] = training[key]
    if "global_batch_tokens" in training:
        values["global_batch_tokens"] = training["global_batch_tokens"]
    elif "global_batch" in training and "seq_len" in training:
        values["global_batch_tokens"] = training["global_batch"] * training["seq_len"]
    if "tokens" in training:
        values["tokens"] = training["tokens"]
    elif "steps" in training and "global_batch_tokens" in values:
        values["tokens"] = training["steps"] * values["global_batch_tokens"]
    # Absent keys mean the pretrain schema's defaults: precision "auto" (amp on GPU), attention "sdpa".
    values["precision"] = _RECIPE_PRECISION.get(training.get("precision", "auto"), "amp")
    values["attention"] = _RECIPE_ATTENTION.get(training.get("attention", "sdpa"), "sdpa")
    if training.get("shard") and "zero" not in training:
        values["zero"] = 3
    values.update(_trainer_values(recipe.get("parallel") or {}, training))  # what smolctl pretrain runs
    return values


# smolctl pretrain's activation_checkpointing → the memory model's recompute modes.
_RECIPE_RECOMPUTE = {"none": "none", "selective": "ops", "full": "full"}


def _trainer_values(parallel: dict, training: dict) -> dict[str, Any]:
    """What smolctl's own trainer runs, read from a pretrain recipe: TP from [parallel] (FSDP2 whenever TP or
    sharding is on), its checkpointing modes, the chunked loss, TP without sequence parallelism."""
    values: dict[str, Any] = {"sequence_parallel": False, "loss_chunk_tokens": training.get("loss_chunk_tokens", 4096)}
    if "tp" in parallel:
        values["tp"] = parallel["tp"]
    if training.get("shard") or parallel.get("tp", 1) > 1 or parallel.get("dp_shard", 1) > 1:
        values["zero"] = 3
        if training.get("precision", "auto") != "fp32":
            values["precision"] = "bf16"  # FSDP2's policy: bf16 weights in compute, fp32 shards and reductions
    if "activation_checkpointing" in training:
        values["recompute"] = _RECIPE_RECOMPUTE.get(training["activation_checkpointing"], "none")
    return values


def recipe_or_model(subject: str, model: str | None = None) -> tuple[str | None, str | None]:
    """What estimate's positional SUBJECT is, as (recipe, model): a file holding TOML is a recipe; a preset name, a
    config.json or a model folder is a model. Decided by what the path holds, not by its name."""
    if model is not None:
        raise UserError(
            "estimate", f"got both {subject!r} and --model {model}", "pass one (flags override the recipe's values)"
        )
    path = Path(subject)
    if path.is_dir() or (path.is_file() and path.suffix == ".json"):
        return None, subject
    if path.is_file():
        load_toml(path)  # a TOML recipe, or one line saying why it is not
        return subject, None
    if "/" in subject or path.suffix:
        raise UserError(subject, "no such file or folder", "pass a recipe (.toml), a config.json or a model folder")
    return None, subject  # a preset name: resolve_config names the known ones when it is not one


def present_values(recipe) -> dict:
    """A validated recipe as the tables recipe_values reads: the keys that have a value."""
    return {
        section: {k: v for k, v in table.items() if v is not None} if isinstance(table, dict) else table
        for section, table in json.loads(recipe.model_dump_json()).items()
    }


def trainer_layout(tp: int, dp_shard: int) -> dict[str, Any]:
    """The scenario fields of a smolctl pretrain mesh: FSDP2 over dp_shard ranks, or, with dp_shard 1, replicas
    only (DDP, or TP without FSDP), nothing sharded over the data-parallel ranks."""
    return {"tp": tp, "zero": 0, "dp_shard": None} if dp_shard == 1 else {"tp": tp, "zero": 3, "dp_shard": dp_shard}


def scenario_from_sources(
    *, recipe: str | None = None, overrides: list[str] | None = None, flags: dict[str, Any] | None = None
) -> TrainingScenario:
    """Recipe values first, then every flag that was given (None means not given). A recipe is checked as
    `smolctl pretrain` checks it (a typo or a wrong type is refused, not ignored), and its [parallel] mesh is
    laid over the GPUs as pretrain lays it, unless --tp, --pp, --cp, --dp-shard or --zero say otherwise."""
    from smolctl.train.config import load_command_recipe, split_world

    values: dict[str, Any] = {}
    checked = None
    if recipe is not None:
        checked = load_command_recipe("pretrain", recipe, overrides or [])
        values = recipe_values(present_values(checked), recipe)
        values["source"] = recipe
    elif overrides:
        raise UserError("--set", "overrides a recipe", "pass RECIPE.toml, or use the flags directly")
    for key, value in (flags or {}).items():
        if value is not None:
            values[key] = value
    if "model" not in values:
        raise UserError("estimate", "no model given", "pass RECIPE.toml or --model smollm3-3b|PATH-TO-CONFIG")
    for key in ("tokens", "global_batch_tokens"):
        if key in values:
            values[key] = parse_count(values[key], f"--{key.replace('_', '-')}")
    known = {f.name for f in fields(TrainingScenario)}
    scenario = check_scenario(TrainingScenario(**{k: v for k, v in values.items() if k in known}))
    # pretrain's mesh is tp × data parallel: a layout of flags (pipeline or context parallel among them) is sized as given
    if checked is None or any((flags or {}).get(k) is not None for k in ("tp", "pp", "cp", "dp_shard", "zero")):
        return scenario
    layout = split_world(scenario.gpus, checked.parallel, checked.training.shard)
    return check_scenario(replace(scenario, **trainer_layout(layout.tp, layout.dp_shard)))


def _choice(value: str, known, flag: str) -> None:
    if value not in known:
        raise UserError(flag, f"{value!r} is not known", f"known: {', '.join(known)}")


def check_scenario(scenario: TrainingScenario) -> TrainingScenario:
    """Reject impossible scenarios with the flag to change; fill in the derived defaults."""
    scenario = replace(scenario, gpu=scenario.gpu.lower())  # H100 is h100
    _choice(scenario.gpu, GPUS, "--gpu")
    _choice(scenario.precision, PRECISIONS, "--precision")
    _choice(scenario.optimizer, OPTIMIZER_BYTES, "--optimizer")
    _choice(scenario.recompute, RECOMPUTES, "--recompute")
    _choice(scenario.attention, ATTENTIONS, "--attention")
    _choice(scenario.framework, FRAMEWORKS, "--framework")
    for name in ("seq_len", "micro_batch", "tp", "pp", "cp"):
        if getattr(scenario, name) < 1:
            raise UserError(
                f"--{name.replace('_', '-')}", f"must be at least 1, got {getattr(scenario, name)}", "use 1 or more"
            )
    if scenario.zero not in (0, 1, 2, 3):
        raise UserError(
            "--zero", f"must be 0, 1, 2 or 3, got {scenario.zero}", "use 0 (DDP), 1, 2, or 3 (FSDP: shards everything)"
        )
    if not 0 < scenario.mfu <= 1:
        raise UserError("--mfu", f"must be in (0, 1], got {scenario.mfu}", "typical: 0.3–0.5 on H100 for dense models")
    for name in ("checkpoint_gbps", "checkpoint_hours", "target_days", "overhead", "price_per_gpu_hour"):
        value = getattr(scenario, name)
        if value is not None and not value > 0:
            raise UserError(f"--{name.replace('_', '-')}", f"must be positive, got {value}")
    if scenario.overhead is not None and scenario.overhead < 1:
        raise UserError(
            "--overhead",
            f"is a factor on the compute time, at least 1, got {scenario.overhead}",
            "e.g. --overhead 1.2 for 20% on top",
        )
    if scenario.seq_len % scenario.cp:
        raise UserError(
            "--cp",
            f"{scenario.cp} does not divide --seq-len {scenario.seq_len}",
            "use a divisor of the sequence length",
        )
    if scenario.global_batch_tokens is not None and scenario.global_batch_tokens % scenario.seq_len:
        whole = -(-scenario.global_batch_tokens // scenario.seq_len) * scenario.seq_len
        raise UserError(
            "--global-batch-tokens",
            f"{scenario.global_batch_tokens} is not a whole number of {scenario.seq_len}-token sequences",
            f"use a multiple of {scenario.seq_len}, e.g. {whole}",
        )
    gpus = scenario.gpus
    if gpus is None:
        sequences = (scenario.global_batch_tokens or scenario.seq_len * scenario.micro_batch) // scenario.seq_len
        data_parallel = sequences // scenario.micro_batch if sequences % scenario.micro_batch == 0 else 1
        gpus = data_parallel * scenario.model_parallel
        scenario = replace(
            scenario,
            gpus_given=False,
            notes=scenario.notes
            + (
                f"--gpus not given: {gpus} (global batch ÷ micro batch = "
                f"{data_parallel} data-parallel ranks × tp·pp·cp)",
            ),
        )
    if gpus < 1 or gpus % scenario.model_parallel:
        raise UserError(
            "--gpus",
            f"{gpus} GPUs cannot hold tp {scenario.tp} × pp {scenario.pp} × cp {scenario.cp} = "
            f"{scenario.model_parallel} (the layout must multiply to --gpus with a whole data-parallel size)",
            f"use a multiple of {scenario.model_parallel} GPUs",
        )
    if scenario.dp_shard is not None and scenario.zero != 3:
        raise UserError(
            "--dp-shard",
            f"{scenario.dp_shard} shards weights, gradients and optimizer states (FSDP2, "
            f"ZeRO-3), not ZeRO-{scenario.zero}",
            "add --zero 3",
        )
    if scenario.dp_shard is not None and (
        scenario.dp_shard < 1 or (gpus // scenario.model_parallel) % scenario.dp_shard
    ):
        raise UserError(
            "--dp-shard",
            f"{scenario.dp_shard} does not divide the {gpus // scenario.model_parallel} data-parallel ranks",
            "use a divisor of the data-parallel size",
        )
    return replace(scenario, gpus=gpus)


def check_model_layout(scenario: TrainingScenario, heads: int, kv_heads: int, layers: int) -> None:
    """Layout checks that need the model: TP splits heads, PP splits layers."""
    if heads % scenario.tp:
        raise UserError(
            "--tp", f"{scenario.tp} does not divide the {heads} attention heads", f"use a divisor of {heads}"
        )
    if kv_heads % scenario.tp and scenario.tp % kv_heads:
        raise UserError(
            "--tp",
            f"{scenario.tp} neither divides nor is a multiple of the {kv_heads} key/value heads",
            f"use a divisor of {kv_heads}",
        )
    if scenario.pp > layers:
        raise UserError("--pp", f"{scenario.pp} pipeline stages for {layers} layers", f"use at most {layers}")


def data_parallel(scenario: TrainingScenario) -> int:
    return scenario.gpus // scenario.model_parallel


def accumulation(scenario: TrainingScenario) -> tuple[int, int]:
    """(global batch tokens, gradient accumulation steps). The global batch is rounded up to a whole number of
    micro batches on every data-parallel rank."""
    per_step = scenario.micro_batch * data_parallel(scenario) * scenario.seq_len
    wanted = scenario.global_batch_tokens or per_step
    steps = max(1, math.ceil(wanted / per_step))
    return steps * per_step, steps

"""What a model is, for sizing: a transformers config from a preset, a config.json or a recipe's [model] table,
and its exact parameter counts from a copy built on the meta device (no memory allocated).

    config = resolve_config("smollm3-3b")
    shape = measure_shape(config)        # shape.params.total == 3_075_098_624
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from smolctl.errors import UserError
from smolctl.infra.flops import head_dim, kv_heads, matmul_params

# Published configs (the models' config.json on the Hub), so `--model NAME` works without network access.
PRESETS: dict[str, dict[str, Any]] = {
    "smollm3-3b": dict(
        model_type="smollm3",
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=128256,
        tie_word_embeddings=True,
        no_rope_layer_interval=4,
        rope_theta=5_000_000.0,
    ),
    "smollm2-135m": dict(
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
        rope_theta=100_000.0,
    ),
    "smollm2-360m": dict(
        model_type="llama",
        hidden_size=960,
        intermediate_size=2560,
        num_hidden_layers=32,
        num_attention_heads=15,
        num_key_value_heads=5,
        vocab_size=49152,
        tie_word_embeddings=True,
        rope_theta=100_000.0,
    ),
    "smollm2-1.7b": dict(
        model_type="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=49152,
        tie_word_embeddings=True,
        rope_theta=130_000.0,
    ),
    "llama3-8b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_theta=500_000.0,
    ),
    "llama3-405b": dict(
        model_type="llama",
        hidden_size=16384,
        intermediate_size=53248,
        num_hidden_layers=126,
        num_attention_heads=128,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_theta=500_000.0,
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
    ),
}

# Architectures whose decoder layer is the Llama one (pre-norm RMSNorm, q/k/v/o, gated MLP of three matrices):
# the closed-form parameter count and the activation formula are exact for them (checked by the tests).
LLAMA_FAMILY = {"llama", "mistral", "qwen2", "qwen3", "smollm3"}


@dataclass(frozen=True)
class ParamCounts:
    total: int
    """Unique parameters (a tied LM head counted once)."""
    embedding: int
    lm_head: int
    """0 when tied to the embedding."""
    non_embedding: int
    per_layer: int
    matmul: int
    """Weights used in matmuls (all Linear/Conv1D weights, the LM head included even when tied): the N of 6·N."""
    closed_form: int | None
    """The Llama-family formula, for checking (None for other architectures)."""


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qk_norm: bool
    """Per-head RMSNorm on queries and keys (Qwen3): saves extra activations."""
    rope_layers: int
    """Layers with rotary embeddings (SmolLM3 leaves every 4th out): RoPE's output dtype differs under autocast."""
    llama_like: bool
    """The activation formula is exact only for Llama-family layers; otherwise it is an approximation."""
    params: ParamCounts

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def to_dict(self) -> dict:
        return asdict(self)


def _model_kwargs(raw: dict[str, Any], where: str) -> tuple[str, dict[str, Any]]:
    kwargs = dict(raw)
    model_type = kwargs.pop("model_type", None) or kwargs.pop("architecture", None)
    if not model_type:
        raise UserError(
            where,
            "does not say which architecture it is",
            "add model_type (config.json) or architecture (recipe [model]), e.g. 'smollm3' or 'llama'",
        )
    kwargs.update(kwargs.pop("config", None) or {})
    theta = kwargs.pop("rope_theta", None)
    if theta is not None and "rope_parameters" not in kwargs:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": float(theta)}
    # Special token ids do not change the size of anything, and a preset's ids may lie outside a shrunk vocabulary.
    for key in ("tokenizer", "architectures", "transformers_version", "torch_dtype", "dtype", "initializer_range"):
        kwargs.pop(key, None)
    kwargs.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    kwargs["use_cache"] = False
    return model_type, kwargs


def config_from_dict(raw: dict[str, Any], where: str):
    """A transformers config from a config.json dict, a preset or a recipe [model] table."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type, kwargs = _model_kwargs(raw, where)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(
            where,
            f"{model_type!r} is not a causal-LM architecture transformers knows",
            "use e.g. smollm3, llama, qwen3 or mistral",
        )
    if "vocab_size" not in kwargs:
        raise UserError(where, "has no vocab_size", "set it, e.g. --set model.vocab_size=49152")
    try:
        return AutoConfig.for_model(model_type, **kwargs)
    except (TypeError, ValueError) as exc:
        raise UserError(where, f"is not a valid {model_type} config: {exc}", "check the keys") from exc


def resolve_config(spec: str):
    """`spec` is a preset name, a config.json file, or a folder holding one."""
    if spec in PRESETS:
        return config_from_dict(PRESETS[spec], spec)
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UserError(
            "--model",
            f"{spec!r} is neither a known model nor a config.json / model folder",
            f"known models: {', '.join(PRESETS)}",
        )
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(path, f"is not a JSON config: {exc}", "pass a model's config.json") from exc
    return config_from_dict(raw, str(path))


def closed_form_params(config) -> int | None:
    """Llama-family parameter count from the config alone (norms, biases and Qwen3's q/k norms included)."""
    model_type = config.model_type
    if model_type not in LLAMA_FAMILY:
        return None
    hidden, dim = config.hidden_size, head_dim(config)
    q_dim, kv_dim = config.num_attention_heads * dim, kv_heads(config) * dim
    qkv_bias = model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
    o_bias = bool(getattr(config, "attention_bias", False)) and model_type != "qwen2"
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    attention = 2 * hidden * q_dim + 2 * hidden * kv_dim + qkv_bias * (q_dim + 2 * kv_dim) + o_bias * hidden
    mlp = 3 * hidden * config.intermediate_size + mlp_bias * (2 * config.intermediate_size + hidden)
    norms = 2 * hidden + (2 * dim if model_type == "qwen3" else 0)
    embedding = config.vocab_size * hidden
    head = 0 if config.tie_word_embeddings else embedding
    return config.num_hidden_layers * (attention + mlp + norms) + hidden + embedding + head


def _layer_list(model, layers: int):
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == layers:
            return module
    raise UserError(type(model).__name__, "has no list of decoder layers", "use a decoder-only causal LM")


def build_meta_model(config):
    """The model on the meta device: every parameter has a shape and no storage, so even a 70B model is free."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def count_params(model, config) -> ParamCounts:
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    lm_head = 0 if head is None or head.weight is embedding else head.weight.numel()
    layer = _layer_list(model, config.num_hidden_layers)[0]
    return ParamCounts(
        total=total,
        embedding=embedding.numel(),
        lm_head=lm_head,
        non_embedding=total - embedding.numel() - lm_head,
        per_layer=sum(p.numel() for p in layer.parameters()),
        matmul=matmul_params(model),
        closed_form=closed_form_params(config),
    )


def shape_of(model, config) -> ModelShape:
    layer = _layer_list(model, config.num_hidden_layers)[0]
    names = {name.rsplit(".", 1)[-1] for name, _ in layer.named_modules()}
    return ModelShape(
        model_type=config.model_type,
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        heads=config.num_attention_heads,
        kv_heads=kv_heads(config),
        head_dim=head_dim(config),
        ffn=getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
        vocab=config.vocab_size,
        tied=bool(config.tie_word_embeddings),
        qk_norm="q_norm" in names,
        rope_layers=sum(getattr(config, "no_rope_layers", None) or [1] * config.num_hidden_layers),
        llama_like=config.model_type in LLAMA_FAMILY,
        params=count_params(model, config),
    )


def measure_shape(config) -> ModelShape:
    """Build `config` on the meta device and read its exact shape and parameter counts."""
    return shape_of(build_meta_model(config), config)

"""Build any transformers causal LM from the recipe's [model] table, and the AdamW parameter groups for it.

config = build_config(recipe.model, vocab_size=49152, seq_len=4096, eos_id=0, pad_id=1)
model = build_model(config, device="meta")   # no memory allocated: for --dry-run on a laptop
"""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

from smolctl.errors import UserError
from smolctl.train.config import ModelSection, OptimizerSection

# Keys smolctl sets itself; giving them in [model.config] would silently fight the recipe.
_MANAGED_KEYS = {
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rope_parameters",
    "rope_theta",
    "tie_word_embeddings",
    "max_position_embeddings",
    "use_cache",
    "eos_token_id",
    "pad_token_id",
    "bos_token_id",
}


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def build_config(section: ModelSection, *, vocab_size: int, seq_len: int, eos_id: int | None, pad_id: int | None):
    """A transformers config for `section`, sized for `vocab_size` tokens and sequences of `seq_len`."""
    from transformers import AutoConfig

    known = causal_lm_types()
    if section.architecture not in known:
        close = difflib.get_close_matches(section.architecture, known, n=1)
        raise UserError(
            "model.architecture",
            f"{section.architecture!r} is not a causal-LM model_type transformers knows",
            f"did you mean {close[0]!r}?" if close else "use e.g. 'smollm3', 'llama' or 'qwen3'",
        )
    clashing = sorted(_MANAGED_KEYS & set(section.config))
    if clashing:
        raise UserError(
            "model.config",
            f"sets {', '.join(clashing)}, which smolctl derives from the recipe",
            "use the [model] keys (rope_theta, vocab_size, ...) or training.seq_len instead",
        )
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=section.hidden_size,
        intermediate_size=section.intermediate_size,
        num_hidden_layers=section.num_hidden_layers,
        num_attention_heads=section.num_attention_heads,
        num_key_value_heads=section.num_key_value_heads or section.num_attention_heads,
        rope_parameters={"rope_type": "default", "rope_theta": float(section.rope_theta)},
        tie_word_embeddings=section.tie_word_embeddings,
        max_position_embeddings=seq_len,
        initializer_range=section.initializer_range,
        rms_norm_eps=section.rms_norm_eps,
        use_cache=False,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        **section.config,
    )
    if section.architecture == "smollm3":
        kwargs["no_rope_layer_interval"] = section.no_rope_layer_interval
    try:
        return AutoConfig.for_model(section.architecture, **kwargs)
    except (TypeError, ValueError) as exc:
        raise UserError(
            "model",
            f"transformers rejects this {section.architecture} config: {str(exc).splitlines()[0]}",
            "check the [model] keys against the architecture's config class",
        ) from exc


def check_attention(attention: str, device: str) -> None:
    """flash_attention_2 needs a CUDA GPU and the flash-attn package; say so before the model is built."""
    if attention == "flash_attention_2" and (
        not device.startswith("cuda") or importlib.util.find_spec("flash_attn") is None
    ):
        raise UserError(
            "training.attention",
            "flash_attention_2 needs a CUDA GPU and the flash-attn package",
            'use attention = "sdpa" (it masks packed documents too), or install flash-attn on the GPU machine',
        )


def build_model(config, *, device: str = "cpu", attention: str = "sdpa", seed: int | None = None):
    """The model with fresh weights (seeded, so every rank and every rerun starts identical). On the meta device
    only shapes exist, which is how --dry-run sizes a 3B model without allocating it."""
    import torch
    from transformers import AutoModelForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=torch.float32)
    return model


def count_parameters(model) -> dict[str, int]:
    """Unique parameters (tied embeddings counted once) and those outside the embedding table."""
    seen: dict[int, int] = {}
    embedding = model.get_input_embeddings().weight
    for param in model.parameters():
        seen[id(param)] = param.numel()
    total = sum(seen.values())
    return {"total": total, "non_embedding": total - embedding.numel()}


def parameter_groups(model, optimizer: OptimizerSection) -> list[dict]:
    """Weight decay on matrices only: embeddings, norms and biases keep their scale (as in GPT-3 / nanotron)."""
    embedding_ids = {id(model.get_input_embeddings().weight)}
    decay, no_decay = [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or id(param) in embedding_ids else decay).append(param)
    return [{"params": decay, "weight_decay": optimizer.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def read_weights(folder: Path, model) -> dict:
    """A model folder's safetensors weights, checked against `model`'s parameter names and shapes."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise UserError(folder, "holds no *.safetensors weights", "pass a model folder written by pretrain/midtrain")
    state: dict = {}
    for file in files:
        state.update(load_file(str(file)))
    own = {name: tuple(param.shape) for name, param in model.state_dict().items()}
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = sorted(set(own) - set(state) - tied)
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise UserError(
            folder, f"weights do not fit the recipe's model ({what})", "make [model] match the checkpoint's config.json"
        )
    for name, tensor in state.items():
        if own[name] != tuple(tensor.shape):
            raise UserError(
                folder,
                f"{name} has shape {tuple(tensor.shape)} but the recipe's model needs {own[name]}",
                "make the [model] table match the checkpoint's config.json",
            )
    return state

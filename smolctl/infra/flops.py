"""FLOPs arithmetic shared by `smolctl estimate` and the training monitor's MFU, so both always agree.

    training_flops_per_token(config, seq_len=4096)          # SmolLM3-3B: ≈ 2.21e10

The accounting is the one `torch.utils.flop_counter.FlopCounterMode` applies to a real forward + backward (and
the one nanotron and the PaLM appendix use for MFU): every matmul counts 2·m·n·k, three times over a training
step (forward, gradient w.r.t. the input, gradient w.r.t. the weight); norms, activations, softmax and the loss
are not counted; causal attention is counted as full attention (no halving for the mask).
"""

from __future__ import annotations

# Forward (1) + backward (2: input gradient and weight gradient) = 3 matmuls of 2 FLOPs per multiply-add.
MATMUL_FLOPS_PER_PARAM = 6


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def matmul_params(model) -> int:
    """Weights that take part in a matmul, counted on a built model (any architecture; the meta device is
    enough): every Linear, and transformers' Conv1D (GPT-2's transposed Linear). A tied LM head counts: it is a
    matmul even though its weight is the embedding's."""
    import torch

    return sum(
        module.weight.numel()
        for module in model.modules()
        if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"
    )


def matmul_params_closed_form(config) -> int:
    """Weights that take part in a matmul for a Llama-style decoder (q/k/v/o projections, a gated MLP of three
    matrices, the LM head), biases and norms excluded. The input embedding is a lookup, not a matmul; the LM head
    is a matmul even when it shares its weight with the embedding."""
    hidden = config.hidden_size
    q_dim = config.num_attention_heads * head_dim(config)
    kv_dim = kv_heads(config) * head_dim(config)
    attention = 2 * hidden * q_dim + 2 * hidden * kv_dim
    mlp = 3 * hidden * (getattr(config, "intermediate_size", None) or 4 * hidden)
    return config.num_hidden_layers * (attention + mlp) + hidden * config.vocab_size


def attention_flops_per_token(config, seq_len: int) -> float:
    """QKᵀ and scores·V: 2 matmuls × 2 FLOPs × seq × head_dim per head, forward + backward (×3) = 12·L·h·seq with
    h = heads × head_dim (query heads: GQA shares keys/values but every query head does its own products)."""
    return 12.0 * config.num_hidden_layers * config.num_attention_heads * head_dim(config) * seq_len


def training_flops_per_token(config, seq_len: int, matmul_params: int | None = None) -> float:
    """Forward + backward FLOPs per trained token: 6·N_matmul + 12·L·h·seq.

    `matmul_params` is the exact count when the caller has the model (`matmul_params(model)`, right for every
    architecture); without it the Llama-family closed form is used."""
    if matmul_params is None:
        matmul_params = matmul_params_closed_form(config)
    return MATMUL_FLOPS_PER_PARAM * float(matmul_params) + attention_flops_per_token(config, seq_len)

"""FLOPs arithmetic shared by `smolctl estimate` and the training monitor's MFU, so both always agree."""

from __future__ import annotations


def training_flops_per_token(config, seq_len: int) -> float:
    """Forward + backward FLOPs per trained token: 6·N (N = parameters that take part in matmuls, the LM head
    included and the input embedding lookup excluded) plus the attention score/value term 12·L·h·seq
    (h = heads × head_dim), as in the Chinchilla / PaLM appendix accounting."""
    hidden = config.hidden_size
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    ffn = config.intermediate_size
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    mlp = 3 * hidden * ffn
    matmul_params = layers * (attention + mlp) + hidden * config.vocab_size
    return 6.0 * matmul_params + 12.0 * layers * heads * head_dim * seq_len

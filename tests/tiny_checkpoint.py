"""A tiny SmolLM3 checkpoint for the post-training tests: an HF model folder + tokenizer + kind "model" manifest,
as `smolctl pretrain` writes it (weights random: the tests need a model, not a good one)."""

from __future__ import annotations

from pathlib import Path


def make_tiny_checkpoint(tokenizer_dir: Path, output: Path, seed: int = 0, **config) -> Path:
    """seed: the random weights; config: SmolLM3Config keys that differ from the tiny defaults."""
    import torch
    from transformers import AutoModelForCausalLM, SmolLM3Config

    from smolctl.data.tokenizer import load_tokenizer
    from smolctl.shards import KIND_MODEL, OutputFolder, lineage_ref

    torch.manual_seed(seed)
    tokenizer = load_tokenizer(tokenizer_dir)
    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    model = AutoModelForCausalLM.from_config(SmolLM3Config(**{**settings, **config}))
    with OutputFolder(output, kind=KIND_MODEL, inputs=[lineage_ref(tokenizer_dir)]) as folder:
        model.save_pretrained(str(folder.staging))
        tokenizer.save_pretrained(str(folder.staging))
        folder.commit(parent=None)
    return output

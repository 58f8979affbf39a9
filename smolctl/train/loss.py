"""The LM head and cross-entropy without the full logits: tokens go through in chunks, each chunk's logits live
only while its loss (forward) or its gradient (backward) is computed.

    loss_sum = linear_cross_entropy(hidden, lm_head.weight, labels, chunk_tokens=4096)   # hidden: (N, h)

The plain path, `cross_entropy(hidden @ W.T)`, keeps `[tokens, vocab]` fp32 logits and their log-softmax for
backward: 4 GiB per 4096 tokens at SmolLM3's 128k vocabulary. Here backward keeps only the hidden states, the
weight and the labels, and recomputes each chunk's logits: one extra LM-head matmul, ~3% of a 3B model's
training FLOPs (but ~15% of a toy CPU model's, whose LM head is a large share of its compute). A micro batch
that fits in one chunk takes the plain path: the loss is the last op of forward and the first of backward, so
keeping one chunk's logits costs the same peak as recomputing them. On a GPU with Liger installed its fused
Triton kernel replaces both.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from smolctl.train.loader import IGNORE_INDEX


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum over tokens of cross_entropy(hidden @ weight.T, labels); backward recomputes logits chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens: int):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            logits = (hidden[start : start + chunk_tokens] @ weight.T).float()  # (chunk, V)
            total += F.cross_entropy(
                logits, labels[start : start + chunk_tokens], ignore_index=IGNORE_INDEX, reduction="sum"
            )
        ctx.save_for_backward(hidden, weight, labels)
        ctx.chunk_tokens = chunk_tokens
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, labels = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            chunk, target = hidden[rows], labels[rows]
            # d loss / d logits = softmax - one_hot(label), zero for ignored tokens
            grad_logits = torch.softmax((chunk @ weight.T).float(), dim=-1)  # (chunk, V)
            kept = (target != IGNORE_INDEX).nonzero().squeeze(1)
            grad_logits[kept, target[kept]] -= 1.0
            grad_logits[target == IGNORE_INDEX] = 0.0
            grad_logits *= grad_total
            grad_hidden[rows] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            grad_weight += grad_logits.T @ chunk.float()
        return grad_hidden, grad_weight.to(weight.dtype), None, None


@functools.cache
def _liger_loss():
    """Liger's fused linear cross-entropy (Triton, CUDA only) when the package is installed, else None."""
    if importlib.util.find_spec("liger_kernel") is None:
        return None
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")


def linear_cross_entropy(hidden, weight, labels, *, chunk_tokens: int):
    """Summed token cross-entropy of `hidden` (N, h) through the LM head `weight` (V, h) against `labels` (N,),
    IGNORE_INDEX skipped. Under autocast the matmuls run in the autocast dtype, as the plain LM head would."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    if device == "cuda":
        liger = _liger_loss()
        if liger is not None:
            return liger(weight, hidden, labels).float()
    with torch.autocast(device, enabled=False):
        if hidden.shape[0] <= chunk_tokens:
            return F.cross_entropy((hidden @ weight.T).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
        return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, chunk_tokens)


class CausalLMLoss(torch.nn.Module):
    """A causal LM whose forward returns the summed token loss (never the logits): the module FSDP shards as its
    root, so one forward gathers embeddings, final norm and a tied LM head together.

    Under flash_attention_2 a micro batch of B rows is run as one row of B·T tokens: FA2's variable-length path
    finds document boundaries from the position ids (0 at each start) only in a batch of one row."""

    def __init__(self, lm, *, chunk_tokens: int, flatten_rows: bool = False):
        super().__init__()
        self.lm, self.chunk_tokens, self.flatten_rows = lm, chunk_tokens, flatten_rows

    def forward(self, input_ids, position_ids, labels):
        if self.flatten_rows and input_ids.shape[0] > 1:
            input_ids, position_ids, labels = flatten_micro_batch(input_ids, position_ids, labels)
        hidden = self.lm.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        weight = self.lm.get_output_embeddings().weight
        return linear_cross_entropy(hidden.flatten(0, 1), weight, labels.flatten(), chunk_tokens=self.chunk_tokens)


def flatten_micro_batch(input_ids, position_ids, labels):
    """(B, T) → (1, B·T). Every packed row starts a document at position 0 (`check_rows_start_documents`), so
    the boundaries FA2 finds in the flattened position ids are exactly the documents."""
    return input_ids.reshape(1, -1), position_ids.reshape(1, -1), labels.reshape(1, -1)

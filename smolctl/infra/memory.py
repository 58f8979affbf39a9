"""Memory arithmetic for one GPU: parameter states under ZeRO / TP / PP, and the activations autograd keeps.

The activation formula counts, tensor by tensor, what autograd saves for backward in a transformers Llama-family
decoder layer (read from the saved-tensor hooks and checked against them by `tests/test_estimate.py`), per token:

    RMSNorm          4h (fp32 copy of the input) + 4 (rsqrt) + p·h (normalised) + a·h (output, the next matmul's
                     input; under autocast one cast per consuming matmul)
    attention, sdpa / flash kernels
                     a·(2·q + 2·kv) (q, k, v, output; GQA keys/values not repeated) + 4·heads (log-sum-exp)
    attention, eager a·4·q (q, repeated k and v, output) + (4 + a)·heads·seq (fp32 softmax and its cast, none
                     in fp32)
    Qwen3 q/k norms  4·(q + kv) + 4·(heads + kv_heads) + a·(q + kv)
    gated MLP        4·a·ffn (gate, SiLU(gate), up, their product)
    LM head + loss   RMSNorm + 4·vocab (fp32 log-softmax) + 8 (int64 labels);  embedding: 8 (int64 ids)

with p the parameter dtype's bytes (bf16: 2; fp32 and amp: 4) and a the compute dtype's (bf16 and amp: 2; fp32:
4). Recompute modes: "selective" recomputes the attention core (Korthikanti et al. 2022, the Ultra-Scale
Playbook) — flash/sdpa kernels already do, so there it equals "none"; "full" keeps only each layer's input and
recomputes one layer at a time during backward; "ops" is smolctl pretrain's selective checkpointing (torchtitan's
op-level policy): each layer keeps its input and every matmul and attention output, and recomputes the norms,
activations and element-wise work.

smolctl's trainer (`pretrain --dry-run` and `estimate` on a pretrain recipe) differs from the textbook layout in
two ways, each a keyword below: its TP has no sequence parallelism (norms, residual stream, embeddings and LM head
stay whole on every TP rank: `sequence_parallel=False`), and its loss runs the LM head over token chunks,
recomputed in backward (`loss_chunk_tokens`), so neither the full logits nor their log-softmax are ever held.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from smolctl.infra.model_shape import ModelShape

GIB = 1024**3


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float
    """What `torch.cuda.mem_get_info` reports as total (a little under the marketing number)."""
    bf16_tflops: float
    """Dense bf16 tensor-core peak (no sparsity)."""
    fp32_tflops: float
    """Plain fp32 (CUDA cores, no TF32): what fp32 matmuls get unless TF32 is switched on."""
    memory_tbps: float
    """Memory bandwidth, TB/s: the bound on decoding, which reads every weight and the KV cache per token."""


# Datasheet numbers (dense, SXM unless named).
GPUS: dict[str, Gpu] = {
    g.name: g
    for g in [
        Gpu("h100", 79.1, 989.4, 66.9, 3.35),
        Gpu("h100-pcie", 79.1, 756.0, 51.2, 2.0),
        Gpu("h200", 139.8, 989.4, 66.9, 4.8),
        Gpu("gh200", 94.5, 989.4, 66.9, 4.0),
        Gpu("b200", 178.4, 2250.0, 80.0, 8.0),
        Gpu("a100-80", 79.2, 312.0, 19.5, 2.04),
        Gpu("a100-40", 39.4, 312.0, 19.5, 1.56),
        Gpu("l40s", 44.4, 362.1, 91.6, 0.86),
        Gpu("l4", 22.0, 121.0, 30.3, 0.3),
        Gpu("a10g", 22.0, 70.0, 31.2, 0.6),
        Gpu("rtx4090", 23.6, 165.2, 82.6, 1.01),
        Gpu("mi300x", 191.5, 1307.4, 163.4, 5.3),
    ]
}

# fp32 matmuls with TF32 switched on (torch.backends.cuda.matmul.allow_tf32) run on tensor cores at half the bf16
# rate (A100, H100, B200); PyTorch leaves it off by default, so plain fp32 runs at the GPU's fp32_tflops.
TF32_SPEED = 0.5
# The caching allocator's fragmentation: reserved memory runs 5–15% above allocated in long training runs.
ALLOCATOR_HEADROOM = 0.10
# CUDA context, cuBLAS/NCCL workspaces: outside max_memory_allocated but not usable by tensors.
RUNTIME_RESERVED_GIB = 1.5


@dataclass(frozen=True)
class Precision:
    name: str
    param_bytes: int
    grad_bytes: int
    master_bytes: int
    """fp32 copy of the weights kept by the optimizer when the model's weights are bf16."""
    compute_bytes: int
    autocast: bool
    """Autocast keeps a bf16 copy of every weight from forward to backward (saved by the matmuls)."""


PRECISIONS = {
    "bf16": Precision("bf16", 2, 2, 4, 2, False),  # bf16 weights, fp32 master weights (Megatron, nanotron)
    "amp": Precision("amp", 4, 4, 0, 2, True),  # fp32 weights under torch.autocast(bf16) (recipe precision auto)
    "fp32": Precision("fp32", 4, 4, 0, 4, False),
}
# Optimizer state bytes per parameter: AdamW two fp32 moments; bitsandbytes 8-bit Adam one byte per moment plus
# an fp32 absmax per 2048-value block; SGD one fp32 momentum buffer.
OPTIMIZER_BYTES = {"adamw": 8.0, "adamw8bit": 2.0 + 2 * 4 / 2048, "sgd": 4.0}
ATTENTIONS = ("sdpa", "flash", "eager")
RECOMPUTES = ("none", "selective", "full", "ops")


def _norm(width: int, precision: Precision, consumers: int) -> float:
    """RMSNorm's saved bytes per token; under autocast each consuming matmul saves its own bf16 cast of the
    output (q, k and v: 3; gate and up: 2), otherwise they share one."""
    p, a = precision.param_bytes, precision.compute_bytes
    return 4 * width + 4 + p * width + a * width * (consumers if precision.autocast else 1)


def _eager_core(shape: ModelShape, seq_len: int, a: int) -> float:
    """q, repeated k and v, the output; the fp32 softmax and its cast to the compute dtype (none in fp32)."""
    return 4 * a * shape.q_dim + (4 + (a if a < 4 else 0)) * shape.heads * seq_len


def layer_bytes_per_token(shape: ModelShape, seq_len: int, precision: Precision, attention: str) -> float:
    """Bytes autograd saves per token for one decoder layer with nothing recomputed."""
    a = precision.compute_bytes
    q, kv = shape.q_dim, shape.kv_dim
    if attention == "eager":
        core = _eager_core(shape, seq_len, a)
    else:
        core = a * (2 * q + 2 * kv) + 4 * shape.heads
    qk_norm = 4 * (q + kv) + 4 * (shape.heads + shape.kv_heads) + a * (q + kv) if shape.qk_norm else 0
    return _norm(shape.hidden, precision, 3) + _norm(shape.hidden, precision, 2) + core + qk_norm + 4 * a * shape.ffn


def _selective_core_bytes(shape: ModelShape, precision: Precision) -> float:
    """Eager attention with its core checkpointed: q and k (after RoPE they take the dtype of the fp32 cos/sin
    under autocast), v, and the output projection's input."""
    p, a = precision.param_bytes, precision.compute_bytes
    rope = shape.rope_layers / shape.layers
    return (rope * p + (1 - rope) * a) * (shape.q_dim + shape.kv_dim) + a * shape.kv_dim + a * shape.q_dim


def _eager_recompute(shape: ModelShape, seq_len: int, precision: Precision) -> float:
    """What recomputing a checkpointed eager core saves again during backward: the fp32 softmax and its cast,
    keys and values repeated for GQA, and under autocast the bf16 casts of q and k (RoPE left them fp32). The
    un-repeated k and v and a bf16 q are the checkpoint's own inputs, already counted."""
    a = precision.compute_bytes
    grouped = shape.heads != shape.kv_heads
    scores = (4 + (a if a < 4 else 0)) * shape.heads * seq_len
    repeated = (1 + (0 if precision.autocast else 1)) * a * shape.q_dim if grouped else 0
    casts = 2 * a * shape.q_dim if precision.autocast else 0
    return scores + repeated + casts


def _ops_layer_bytes(shape: ModelShape, precision: Precision, tp: int, sequence_parallel: bool) -> float:
    """Per token, what the op-level selective policy keeps of one layer: its input (the residual stream, in the
    parameter dtype), the q/k/v, attention (with its fp32 log-sum-exp) and gate/up outputs (split by TP), and the
    o/down outputs (whole on every TP rank unless sequence-parallel)."""
    p, a = precision.param_bytes, precision.compute_bytes
    q, kv = shape.q_dim, shape.kv_dim
    split = a * (q + 2 * kv) + a * q + 4 * shape.heads + 2 * a * shape.ffn
    whole = p * shape.hidden + 2 * a * shape.hidden
    return split / tp + whole / (tp if sequence_parallel else 1)


def _replicated_norm_bytes(shape: ModelShape, precision: Precision) -> float:
    """The two RMSNorms of a layer: without sequence parallelism every TP rank holds them whole."""
    return _norm(shape.hidden, precision, 3) + _norm(shape.hidden, precision, 2)


def _layer_matmul_params(shape: ModelShape) -> int:
    return 2 * shape.hidden * (shape.q_dim + shape.kv_dim) + 3 * shape.hidden * shape.ffn


@dataclass(frozen=True)
class Activations:
    """Saved-for-backward bytes of one micro batch on one GPU (a whole pipeline stage's layers)."""

    per_layer: float
    """Held by each layer from its forward to its backward."""
    recompute: float
    """Re-materialised for one layer at a time during backward (full: the whole layer; selective: the core)."""
    head: float
    """Final norm, fp32 log-softmax of the logits and labels (last pipeline stage)."""
    inputs: float
    """Token ids saved by the embedding (first stage) and RoPE cos/sin shared by all layers."""
    weight_copies: float
    """amp only: bf16 copies of the weights saved by the matmuls."""

    def peak(self, layers: int) -> float:
        """Live saved bytes at their peak: all layers resident plus the larger of the head (end of forward) and a
        recomputed layer (during backward, once the head's tensors are freed)."""
        return self.inputs + layers * self.per_layer + self.weight_copies + max(self.head, self.recompute)

    def to_dict(self, layers: int) -> dict:
        return {
            "per_layer": self.per_layer,
            "recompute": self.recompute,
            "head": self.head,
            "inputs": self.inputs,
            "weight_copies": self.weight_copies,
            "peak": self.peak(layers),
        }


def activations(
    shape: ModelShape,
    *,
    micro_batch: int,
    seq_len: int,
    precision: Precision,
    attention: str,
    recompute: str,
    layers: int | None = None,
    tp: int = 1,
    cp: int = 1,
    sequence_parallel: bool = True,
    loss_chunk_tokens: int | None = None,
) -> Activations:
    """Activation bytes per GPU for one micro batch. TP with sequence parallelism (Megatron-SP, torchtitan) divides
    every per-token term by TP; without it the norms and the LM head stay whole. CP gives each GPU seq/cp tokens
    (attention still spans the whole seq). `loss_chunk_tokens`: the head keeps only the hidden states."""
    layers = shape.layers if layers is None else layers
    tokens = micro_batch * seq_len / cp
    p, a = precision.param_bytes, precision.compute_bytes
    full_layer = layer_bytes_per_token(shape, seq_len, precision, attention) * tokens / tp
    if not sequence_parallel and tp > 1:
        full_layer += _replicated_norm_bytes(shape, precision) * tokens * (1 - 1 / tp)
    copies = _layer_matmul_params(shape) * a / tp if precision.autocast else 0.0
    if recompute == "full":
        # The layer input is kept; an fp32 input is also what the first norm saves, so the recompute shares it.
        shared_input = 4 * shape.hidden * tokens / tp if p == 4 else 0.0
        per_layer, transient, held_copies = p * shape.hidden * tokens / tp, full_layer + copies - shared_input, 0.0
    elif recompute == "selective" and attention == "eager":
        eager_core = _eager_core(shape, seq_len, a)
        core_saved = _selective_core_bytes(shape, precision)
        per_layer = full_layer - (eager_core - core_saved) * tokens / tp
        # The core of the last layer is recomputed once backward has freed what that layer saved after it (the
        # output projection's input, the second norm, the MLP), so only the excess over those adds to the peak.
        after_core = a * shape.q_dim + _norm(shape.hidden, precision, 2) + 4 * a * shape.ffn
        transient = max(0.0, _eager_recompute(shape, seq_len, precision) - after_core) * tokens / tp
        held_copies = copies * layers
    elif recompute == "ops":
        per_layer = min(full_layer, _ops_layer_bytes(shape, precision, tp, sequence_parallel) * tokens)
        transient, held_copies = full_layer - per_layer, copies * layers
    else:
        per_layer, transient, held_copies = full_layer, 0.0, copies * layers
    head_tp = tp if sequence_parallel else 1
    if loss_chunk_tokens:
        # the final norm, its output cast to the compute dtype (all the chunked loss keeps) and the labels
        head = (_norm(shape.hidden, precision, 1) + a * shape.hidden + 8) * tokens / head_tp
    else:
        head = (_norm(shape.hidden, precision, 1) + 4 * shape.vocab + 8) * tokens / head_tp
    if precision.autocast:
        head += shape.vocab * shape.hidden * a / head_tp
    rope = 2 * seq_len * shape.head_dim * p
    return Activations(
        per_layer=per_layer, recompute=transient, head=head, inputs=8 * tokens + rope, weight_copies=held_copies
    )


@dataclass(frozen=True)
class StateBytes:
    weights: float
    grads: float
    master: float
    optimizer: float
    gather: float
    """ZeRO-3: unsharded weights of the layer in use and the prefetched one, and one layer's full gradient."""

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.master + self.optimizer + self.gather


def stage_params(shape: ModelShape, pp: int) -> tuple[int, int]:
    """Parameters of the first and of the last pipeline stage (the most loaded ones): the embedding sits on the
    first, final norm and LM head on the last (a tied head is a second copy of the embedding when pp > 1)."""
    counts = shape.params
    if pp == 1:
        return counts.total, counts.total
    stage_layers = math.ceil(shape.layers / pp) * counts.per_layer
    head = counts.lm_head or counts.embedding
    return stage_layers + counts.embedding, stage_layers + shape.hidden + head


def tp_local_params(params: float, kv_params: float, tp: int, kv_heads: int) -> float:
    """Parameters on one tensor-parallel rank: everything splits by tp except the key/value projections when tp
    exceeds the KV heads (GQA): a head cannot be split, so each rank holds one whole KV head, replicated across
    tp / kv_heads ranks."""
    return (params - kv_params) / tp + kv_params / min(tp, kv_heads)


def state_bytes(
    params: float,
    per_layer: float,
    *,
    precision: Precision,
    optimizer: str,
    zero: int,
    shard: int,
    tp: int,
    kv_params: float = 0.0,
    kv_heads: int = 1,
) -> StateBytes:
    """Weights, gradients, fp32 master weights and optimizer states of `params` parameters on one GPU. TP shards
    everything by tp (KV projections: see tp_local_params); ZeRO stage 1/2/3 shards optimizer states (+ master),
    then gradients, then weights over the `shard` ranks that hold replicas (data parallel × context parallel).
    `per_layer` is the largest unit ZeRO-3 gathers at once (a decoder layer, or the embedding when larger)."""
    local = tp_local_params(params, kv_params, tp, kv_heads) if kv_params else params / tp
    gather = 0.0
    if zero >= 3:
        gather = per_layer / tp * (2 * precision.param_bytes + precision.grad_bytes)
    return StateBytes(
        weights=local * precision.param_bytes / (shard if zero >= 3 else 1),
        grads=local * precision.grad_bytes / (shard if zero >= 2 else 1),
        master=local * precision.master_bytes / (shard if zero >= 1 else 1),
        optimizer=local * OPTIMIZER_BYTES[optimizer] / (shard if zero >= 1 else 1),
        gather=gather,
    )


def logits_grad_bytes(
    shape: ModelShape,
    *,
    micro_batch: int,
    seq_len: int,
    tp: int,
    cp: int,
    sequence_parallel: bool = True,
    loss_chunk_tokens: int | None = None,
) -> float:
    """The loss backward briefly holds two fp32 vocab-sized gradients (log-softmax's input and output); a chunked
    loss holds them for one chunk of tokens at a time."""
    tokens = micro_batch * seq_len / cp
    if loss_chunk_tokens:
        tokens = min(tokens, loss_chunk_tokens)
    return 8 * shape.vocab * tokens / (tp if sequence_parallel else 1)

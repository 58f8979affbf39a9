"""Parallelise a transformers causal LM the torchtitan way, in a fixed order: tensor parallel on each decoder
layer, activation checkpointing, torch.compile per layer, then FSDP2 per layer and at the root.

    mesh = build_mesh(Layout(dp_replicate=1, dp_shard=192, tp=2), "cuda")
    wrapped = parallelize(CausalLMLoss(model, chunk_tokens=4096), mesh, layout, ...)

The mesh has dims (dp_replicate, dp_shard, tp), tp innermost so a TP group sits on one node's NVLink. Tensor
parallel follows the model's own `base_model_tp_plan` (column-wise q/k/v/gate/up, row-wise o/down): the
column-wise outputs stay local shards, so each rank runs heads/tp attention heads and ffn/tp of the MLP, and the
row-wise matmuls all-reduce back to the full hidden state. FSDP2 then shards every parameter over the
data-parallel ranks (2-D DTensors: Shard over dp, and over tp where TP split them).
"""

from __future__ import annotations

from functools import partial

from smolctl.errors import UserError
from smolctl.train.config import Layout

# The plan styles transformers uses that map onto torch's DTensor parallel styles.
_STYLES = ("colwise", "rowwise")


def tp_plan(config, tp: int) -> dict[str, str]:
    """The decoder-layer TP plan ({"self_attn.q_proj": "colwise", ...}); UserError when tp > 1 and the
    architecture has none this trainer can apply."""
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if tp == 1:
        return {}
    if not plan:
        raise UserError(
            "parallel.tp",
            f"{config.model_type} has no tensor-parallel plan in transformers",
            "set parallel.tp = 1 (FSDP2 alone), or pick an architecture with one (smollm3, llama, qwen2, mistral)",
        )
    layer_plan = {}
    for path, style in plan.items():
        if not path.startswith("layers.*.") or style not in _STYLES:
            raise UserError(
                "parallel.tp",
                f"{config.model_type}'s TP plan shards {path} as {style!r}, which this trainer "
                f"does not apply (only {' / '.join(_STYLES)} decoder-layer linears)",
                "set parallel.tp = 1",
            )
        layer_plan[path.removeprefix("layers.*.")] = style
    return layer_plan


def build_mesh(layout: Layout, device_type: str):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(
        device_type,
        (layout.dp_replicate, layout.dp_shard, layout.tp),
        mesh_dim_names=("dp_replicate", "dp_shard", "tp"),
    )


def apply_tp(layers, tp_mesh, plan: dict[str, str]) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for layer in layers:
        parallelize_module(layer, tp_mesh, {path: styles[style]() for path, style in plan.items()})


# Selective checkpointing (torchtitan's op-level policy): keep what is expensive to recompute (matmul and attention
# outputs), recompute the cheap element-wise work (norms, activations, RoPE, residual adds).
def _saved_ops() -> set:
    import torch

    aten = torch.ops.aten
    names = (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    return {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        *(getattr(aten, n).default for n in names if hasattr(aten, n)),
    }


def _selective_policy(saved, ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model, mode: str) -> None:
    """Checkpoint every decoder layer (transformers' own per-layer hook), fully or with the selective policy."""
    if mode == "none":
        return
    kwargs: dict = {"use_reentrant": False}
    if mode == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, partial(_selective_policy, _saved_ops()))
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)


def apply_compile(layers) -> None:
    """Compile each decoder layer in place (parameter names unchanged); the layers share one compiled graph, and
    FSDP's collectives stay outside it."""
    for layer in layers:
        layer.compile()


def apply_fsdp(wrapped, layers, dp_mesh, *, bf16: bool) -> None:
    """fully_shard each layer, then the root (embeddings, final norm, LM head: tied weights must share a unit).
    Under bf16, parameters are gathered and used in bf16 and gradients reduced in fp32."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
    for index, layer in enumerate(layers):
        # the last layer's parameters are needed again at once by backward: keep them gathered
        fully_shard(layer, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=index < len(layers) - 1)
    fully_shard(wrapped, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=False)


def parallelize(
    wrapped, *, mesh, layout: Layout, activation_checkpointing: str, compile: bool, bf16: bool, fsdp: bool = True
):
    """Apply TP, AC, compile and FSDP2 (when `fsdp` and more than one data-parallel rank) to `wrapped` (a
    CausalLMLoss) in torchtitan's order; `mesh` is None for one process. Returns `wrapped`."""
    model = wrapped.lm
    layers = model.base_model.layers
    if layout.tp > 1:
        apply_tp(layers, mesh["tp"], tp_plan(model.config, layout.tp))
    apply_ac(model, activation_checkpointing)
    if compile:
        apply_compile(layers)
    if fsdp and layout.data_parallel > 1:
        dims = ("dp_replicate", "dp_shard") if layout.dp_replicate > 1 else ("dp_shard",)
        apply_fsdp(wrapped, layers, mesh[dims], bf16=bf16)
    return wrapped


def clip_grad_norm_(parameters, max_norm: float):
    """The global gradient norm, clipped to `max_norm`, over plain and DTensor gradients on different meshes
    (TP layers on (dp, tp), the rest on dp): norms are taken per (mesh, placement) group, each reduced once.
    Returns the norm as a device tensor (no host sync)."""
    import torch
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for param in parameters:
        if param.grad is not None:
            grad = param.grad
            key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
            groups.setdefault(key, []).append(grad)
    norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros(())
    total = torch.linalg.vector_norm(torch.stack(norms))
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for grads in groups.values():
        torch._foreach_mul_(grads, coef)
    return total

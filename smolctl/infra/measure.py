"""Measure what `estimate` predicts, on a real forward + backward of a (scaled-down) model on this machine.

    measure_activations(config, micro_batch=2, seq_len=128, precision="bf16", attention="sdpa", recompute="full")

- FLOPs: `torch.utils.flop_counter.FlopCounterMode` around forward + backward. On CPU the attention runs eager
  (PyTorch's CPU flash kernel has no FLOP formula, its matmuls would go uncounted); on a GPU as configured.
- Activations: the peak of live saved-for-backward bytes, from autograd's saved-tensor hooks over forward AND
  backward. A tensor is counted once per storage (views share it) from the first save to the moment autograd
  frees its last saved reference; parameters are not activations and are skipped. Recompute modes run as
  training would: "full" checkpoints every decoder layer (transformers' activation checkpointing, reentrant, so
  the layer inputs it keeps and the tensors it re-saves while recomputing during backward pass through the
  hooks); "selective" checkpoints the eager attention core (scores, softmax, probabilities·V).
- GPU memory: `torch.cuda.max_memory_allocated` over a second AdamW step (the first one creates the states) of
  two accumulated micro batches, so gradients are held while activations peak, as in training.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from smolctl.infra.flops import head_dim as head_dim_of
from smolctl.infra.flops import kv_heads as kv_heads_of
from smolctl.infra.flops import matmul_params_closed_form, training_flops_per_token
from smolctl.infra.memory import PRECISIONS, activations, logits_grad_bytes, state_bytes
from smolctl.infra.model_shape import config_from_dict, measure_shape

_RECOMPUTED_EAGER = "smolctl_recomputed_eager"


class _Saved:
    """What autograd keeps instead of the tensor: its finaliser tells the meter when autograd lets go."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor):
        self.tensor = tensor


class SavedTensorMeter:
    """Live and peak bytes of tensors autograd saves for backward (parameters excluded, one count per storage)."""

    def __init__(self, model):
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._refs: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def _release(self, key: int, nbytes: int) -> None:
        self._refs[key] -= 1
        if not self._refs[key]:
            del self._refs[key]
            self.live -= nbytes

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if key in self._params:
            return tensor
        if key not in self._refs:
            self._refs[key] = 0
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self._refs[key] += 1
        saved = _Saved(tensor)
        weakref.finalize(saved, self._release, key, nbytes)
        return saved

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    @contextmanager
    def recording(self) -> Iterator[SavedTensorMeter]:
        import torch

        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self


def scaled_down(config, *, layers: int = 4, head_dim: int = 16, max_kv_heads: int = 2, vocab: int = 2048):
    """A small copy of `config` with the same architecture, GQA ratio, FFN/hidden ratio and flags (NoPE, q/k
    norms, biases, tying), so the formulas are checked on the same kinds of tensors, in seconds on a CPU."""
    raw = config.to_dict()
    group = config.num_attention_heads // kv_heads_of(config)
    kv = min(kv_heads_of(config), max_kv_heads)
    heads = kv * group
    hidden_per_head = config.hidden_size / (config.num_attention_heads * head_dim_of(config))
    hidden = max(16, round(heads * head_dim * hidden_per_head / 8) * 8)
    for derived in ("no_rope_layers", "layer_types", "max_window_layers", "head_dim"):
        raw.pop(derived, None)
    raw.update(
        num_hidden_layers=min(config.num_hidden_layers, layers),
        num_attention_heads=heads,
        num_key_value_heads=kv,
        hidden_size=hidden,
        vocab_size=min(config.vocab_size, vocab),
        intermediate_size=max(8, round(hidden * config.intermediate_size / config.hidden_size)),
    )
    if getattr(config, "head_dim", None) and hidden_per_head != 1:
        raw["head_dim"] = head_dim
    return config_from_dict(raw, "scaled-down copy")


def _register_recomputed_eager(model) -> None:
    """An attention implementation that checkpoints the model's own eager attention core."""
    from torch.utils.checkpoint import checkpoint
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    eager = sys.modules[type(model).__module__].eager_attention_forward

    def recomputed(module, query, key, value, attention_mask, **kwargs):
        def core(q, k, v):
            return eager(module, q, k, v, attention_mask, **kwargs)[0]

        return checkpoint(core, query, key, value, use_reentrant=True), None

    AttentionInterface.register(_RECOMPUTED_EAGER, recomputed)
    ALL_MASK_ATTENTION_FUNCTIONS.register(_RECOMPUTED_EAGER, eager_mask)


def _implementation(attention: str) -> str:
    """ "flash" runs as sdpa: PyTorch dispatches it to a flash kernel (on CPU too), which saves the same tensors
    (q, k, v, output, log-sum-exp) as the flash-attn package, without needing that package."""
    return "sdpa" if attention == "flash" else attention


def build_model(config, *, precision: str, attention: str, recompute: str, device: str = "cpu", seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    implementation = _implementation(attention)
    if recompute == "selective" and attention == "eager":
        with torch.device("meta"):
            probe = AutoModelForCausalLM.from_config(config)
        _register_recomputed_eager(probe)
        implementation = _RECOMPUTED_EAGER
    model = AutoModelForCausalLM.from_config(config, attn_implementation=implementation)
    dtype = torch.bfloat16 if PRECISIONS[precision].param_bytes == 2 else torch.float32
    model = model.to(device=device, dtype=dtype).train()
    if recompute == "full":
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    return model


@contextmanager
def _autocast(precision: str, device: str) -> Iterator[None]:
    import torch

    with torch.autocast(device, dtype=torch.bfloat16, enabled=PRECISIONS[precision].autocast):
        yield


def _batch(config, micro_batch: int, seq_len: int, device: str):
    import torch

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (micro_batch, seq_len), generator=generator)
    return ids.to(device)


def measure_activations(
    config, *, micro_batch: int, seq_len: int, precision: str, attention: str, recompute: str
) -> int:
    """Peak live saved-tensor bytes over one forward + backward on CPU."""
    model = build_model(config, precision=precision, attention=attention, recompute=recompute)
    ids = _batch(config, micro_batch, seq_len, "cpu")
    meter = SavedTensorMeter(model)
    with meter.recording():
        with _autocast(precision, "cpu"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return meter.peak


def measure_flops(config, *, micro_batch: int, seq_len: int, device: str = "cpu", attention: str = "sdpa") -> int:
    """FLOPs of one forward + backward as FlopCounterMode counts them."""
    from torch.utils.flop_counter import FlopCounterMode

    attention = "eager" if device == "cpu" else attention
    model = build_model(config, precision="fp32", attention=attention, recompute="none", device=device)
    ids = _batch(config, micro_batch, seq_len, device)
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    return counter.get_total_flops()


def measure_gpu_peak(
    config, *, micro_batch: int, seq_len: int, precision: str, attention: str, recompute: str, optimizer: str = "adamw"
) -> dict[str, Any]:
    """max_memory_allocated over the second training step (states exist from the first)."""
    import torch

    model = build_model(config, precision=precision, attention=attention, recompute=recompute, device="cuda")
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = _batch(config, micro_batch, seq_len, "cuda")
    for step in range(2):
        if step == 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        # Two accumulated micro batches, as in training: the second runs with the first one's gradients held.
        for _ in range(2):
            with _autocast(precision, "cuda"):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return {"max_memory_allocated": torch.cuda.max_memory_allocated(), "device": torch.cuda.get_device_name()}


def _run_size(scenario, config) -> tuple[Any, int, int, str]:
    """The config, micro batch and sequence length to run: as given when that is small, else a scaled-down copy
    (the formulas are per-token and per-layer, so a small copy of the same architecture checks them)."""
    seq_len = min(scenario.seq_len, 256)
    micro_batch = max(1, min(scenario.micro_batch, 1024 // seq_len))
    if matmul_params_closed_form(config) <= 20_000_000 and seq_len == scenario.seq_len:
        return config, micro_batch, seq_len, "the model as given"
    small = scaled_down(config)
    what = (
        f"scaled-down copy: {small.num_hidden_layers} layers, hidden {small.hidden_size}, "
        f"{small.num_attention_heads}/{small.num_key_value_heads} heads, vocab {small.vocab_size}"
    )
    return small, micro_batch, seq_len, what


def validate(scenario, config) -> dict[str, Any]:
    """Estimate vs measurement, side by side, for FLOPs, parameters and activations of every recompute mode; on
    a GPU also the peak allocated memory of a training step."""
    import torch

    small, micro_batch, seq_len, what = _run_size(scenario, config)
    shape = measure_shape(small)
    tokens = micro_batch * seq_len
    real = build_model(small, precision="fp32", attention="sdpa", recompute="none")
    rows = [
        {
            "what": "parameters (meta-device count vs allocated model)",
            "estimate": shape.params.total,
            "measured": sum(p.numel() for p in real.parameters()),
            "unit": "count",
        }
    ]
    if shape.params.closed_form is not None:
        rows.append(
            {
                "what": "parameters (closed form vs allocated model)",
                "estimate": shape.params.closed_form,
                "measured": rows[0]["measured"],
                "unit": "count",
            }
        )
    del real
    rows.append(
        {
            "what": "FLOPs forward+backward (FlopCounterMode)",
            "unit": "flops",
            "estimate": training_flops_per_token(small, seq_len, shape.params.matmul) * tokens,
            "measured": measure_flops(small, micro_batch=micro_batch, seq_len=seq_len),
        }
    )
    modes = [(scenario.attention, "none"), ("eager", "none"), ("eager", "selective"), (scenario.attention, "full")]
    if (scenario.attention, scenario.recompute) not in modes:
        modes.append((scenario.attention, scenario.recompute))
    precision = PRECISIONS[scenario.precision]
    for attention, recompute in modes:
        estimated = activations(
            shape,
            micro_batch=micro_batch,
            seq_len=seq_len,
            precision=precision,
            attention=attention,
            recompute=recompute,
        ).peak(shape.layers)
        measured = measure_activations(
            small,
            micro_batch=micro_batch,
            seq_len=seq_len,
            precision=scenario.precision,
            attention=attention,
            recompute=recompute,
        )
        rows.append(
            {
                "what": f"activations {scenario.precision} {attention} recompute={recompute} (saved tensors)",
                "estimate": estimated,
                "measured": measured,
                "unit": "bytes",
            }
        )
    result = {"ran": what, "micro_batch": micro_batch, "seq_len": seq_len, "rows": rows, "device": "cpu"}
    if torch.cuda.is_available():
        # Plain torch AdamW keeps no fp32 master copy of bf16 weights, so the GPU step runs amp (fp32 weights).
        gpu_precision = "amp" if scenario.precision == "bf16" else scenario.precision
        optimizer = "sgd" if scenario.optimizer == "sgd" else "adamw"
        measured = measure_gpu_peak(
            small,
            micro_batch=micro_batch,
            seq_len=seq_len,
            precision=gpu_precision,
            attention=scenario.attention,
            recompute=scenario.recompute,
            optimizer=optimizer,
        )
        states = state_bytes(
            shape.params.total,
            shape.params.per_layer,
            precision=PRECISIONS[gpu_precision],
            optimizer=optimizer,
            zero=0,
            shard=1,
            tp=1,
        )
        act = activations(
            shape,
            micro_batch=micro_batch,
            seq_len=seq_len,
            precision=PRECISIONS[gpu_precision],
            attention=scenario.attention,
            recompute=scenario.recompute,
        )
        estimated = (
            states.total
            + act.peak(shape.layers)
            + logits_grad_bytes(shape, micro_batch=micro_batch, seq_len=seq_len, tp=1, cp=1)
        )
        rows.append(
            {
                "what": f"GPU peak allocated {gpu_precision} (torch.cuda.max_memory_allocated)",
                "estimate": estimated,
                "measured": measured["max_memory_allocated"],
                "unit": "bytes",
            }
        )
        result["device"] = measured["device"]
    return result

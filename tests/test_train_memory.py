"""What the trainer keeps in memory: the chunked LM-head loss (same loss and gradients as the plain one, a
fraction of its saved bytes), the three activation-checkpointing modes, and FA2's flattened micro batch (the
same loss as per-row attention with packed documents). Models are tiny (hidden 64, 2 layers) and run on CPU."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from smolctl.errors import UserError
from smolctl.infra.measure import SavedTensorMeter
from smolctl.train.loader import IGNORE_INDEX, check_rows_start_documents, make_labels
from smolctl.train.loss import CausalLMLoss, linear_cross_entropy
from smolctl.train.parallel import apply_ac


def _tiny_model(vocab: int = 512, attention: str = "sdpa"):
    from transformers import AutoConfig

    from smolctl.train.model import build_model

    config = AutoConfig.for_model(
        "smollm3",
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    return build_model(config, attention=attention, seed=0)


def _packed_batch(rows: int = 2, seq: int = 64, vocab: int = 512, seed: int = 0):
    """Rows of several documents each (positions restart at 0 at every document), as `smolctl pack` writes them."""
    rng = np.random.default_rng(seed)
    positions = np.empty((rows, seq), dtype=np.int64)
    for row in range(rows):
        cuts = np.sort(rng.choice(np.arange(1, seq), size=3, replace=False))
        starts = np.zeros(seq, dtype=bool)
        starts[[0, *cuts]] = True
        index = np.arange(seq)
        positions[row] = index - np.maximum.accumulate(np.where(starts, index, 0))
    ids = rng.integers(0, vocab, size=(rows, seq))
    return torch.from_numpy(ids), torch.from_numpy(positions), torch.from_numpy(make_labels(ids, positions))


def test_chunked_loss_equals_the_plain_loss_and_its_gradients():
    torch.manual_seed(0)
    hidden = torch.randn(200, 64, dtype=torch.float32, requires_grad=True)
    weight = torch.randn(1000, 64, dtype=torch.float32, requires_grad=True)
    labels = torch.randint(0, 1000, (200,))
    labels[::7] = IGNORE_INDEX
    count = int((labels != IGNORE_INDEX).sum())
    plain = F.cross_entropy(hidden @ weight.T, labels, ignore_index=IGNORE_INDEX, reduction="sum") / count
    plain.backward()
    expected = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    chunked = linear_cross_entropy(hidden, weight, labels, chunk_tokens=48) / count  # 48 does not divide 200
    chunked.backward()
    assert chunked.item() == pytest.approx(plain.item(), abs=1e-6)
    assert torch.allclose(hidden.grad, expected[0], atol=1e-6) and torch.allclose(weight.grad, expected[1], atol=1e-6)


def test_chunked_loss_saves_at_least_chunks_times_fewer_bytes_at_vocab_32k():
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 32_000, bias=False)
    hidden = torch.randn(512, 64, requires_grad=True)
    labels = torch.randint(0, 32_000, (512,))
    chunk = 64

    def saved(loss_fn) -> int:
        meter = SavedTensorMeter(head)
        with meter.recording():
            loss = loss_fn()
        loss.backward()
        return meter.peak

    plain = saved(lambda: F.cross_entropy((hidden @ head.weight.T).float(), labels, reduction="sum"))
    chunked = saved(lambda: linear_cross_entropy(hidden, head.weight, labels, chunk_tokens=chunk))
    assert chunked > 0 and plain / chunked >= 512 // chunk


class _LiveTensors(TorchDispatchMode):
    """Bytes of the tensors created during forward that are still alive after it: what the model keeps for
    backward, however it keeps them (autograd's saved tensors, checkpoint inputs, selective-checkpoint caches)."""

    def __init__(self):
        super().__init__()
        self.refs: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.refs += [weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out

    def bytes(self) -> int:
        gc.collect()
        storages = {}
        for ref in self.refs:
            tensor = ref()
            if tensor is not None:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())


def test_selective_checkpointing_keeps_less_than_none_and_more_than_full():
    ids, positions, labels = _packed_batch()
    kept, losses = {}, {}
    for mode in ("none", "selective", "full"):
        model = _tiny_model()
        apply_ac(model, mode)
        model.train()
        with _LiveTensors() as live:
            loss = CausalLMLoss(model, chunk_tokens=64)(ids, positions, labels)
        kept[mode] = live.bytes()
        loss.backward()
        losses[mode] = (loss.item(), model.model.layers[0].mlp.down_proj.weight.grad.clone())
    assert kept["none"] > kept["selective"] > kept["full"]
    for mode in ("selective", "full"):  # recomputing changes nothing but memory
        assert losses[mode][0] == pytest.approx(losses["none"][0], rel=1e-6)
        assert torch.allclose(losses[mode][1], losses["none"][1], atol=1e-6)


def test_flattened_micro_batch_gives_the_per_row_loss_under_packed_documents():
    """FA2 runs a micro batch as one row of B·T tokens; under sdpa the same flattening (with position ids
    restarting per document) must give the loss of the per-row form, and both must mask documents: the same rows
    read as one document each give another loss."""
    model = _tiny_model()
    ids, positions, labels = _packed_batch(rows=3)
    with torch.no_grad():
        per_row = CausalLMLoss(model, chunk_tokens=64)(ids, positions, labels)
        flat = CausalLMLoss(model, chunk_tokens=64, flatten_rows=True)(ids, positions, labels)
        unmasked = CausalLMLoss(model, chunk_tokens=64)(ids, torch.arange(64).repeat(3, 1), labels)
    assert flat.item() == pytest.approx(per_row.item(), rel=1e-5)
    assert abs(unmasked.item() - per_row.item()) > 1e-3


def test_flattening_refuses_rows_that_continue_a_document():
    _, positions, _ = _packed_batch()
    check_rows_start_documents(positions.numpy())
    shifted = positions.numpy().copy()
    shifted[1, :5] = np.arange(7, 12)  # row 1 continues a document from row 0
    with pytest.raises(UserError) as error:
        check_rows_start_documents(shifted)
    assert error.value.line().startswith("training.attention: ")

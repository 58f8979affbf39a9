"""One process, torchrun, or accelerate launch: the same environment variables, the same code path.

`Dist` is a null object when there is one process, so the loop never asks `if distributed:`.
Backends: NCCL on GPUs, gloo on CPU (tests run two CPU processes with torchrun).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

from smolctl.launcher import check_rendezvous_env, local_rank_from_env, rank_from_env, world_size_from_env
from smolctl.train.parallel import build_mesh, parallelize


@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: str = "cpu"
    sharded: bool = False
    """Parameters are DTensors (TP and/or FSDP): saving gathers them, loading scatters into them."""
    fsdp: bool = False
    """FSDP2 manages gradient reduction (set_requires_gradient_sync); otherwise DDP or a single process."""
    host_group: object = None
    """A gloo group of its own for flags agreed on the host (`any`): never the training loop's group (NCCL on
    GPUs), nor the one DCP's background save thread runs collectives on, since two threads' collectives on one
    group can pair up in a different order on each rank and deadlock."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.active:
            import torch.distributed as dist

            dist.barrier()

    def sum(self, value):
        """All-reduce a tensor by sum (in place) and return it; identity with one process."""
        if self.active:
            import torch.distributed as dist

            dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on at least one (e.g. a signal that reached only some ranks).
        Agreed on the host group: no device sync."""
        if not self.active:
            return flag
        import torch
        import torch.distributed as dist

        value = torch.tensor([int(flag)])
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.host_group)
        return bool(value.item())

    def first_problem(self, problem: str | None) -> str | None:
        """The problem of the lowest rank that found one, on every rank (None when none did): each rank checks a
        share of something and all of them stop with the same line. Agreed on the host group."""
        if not self.active:
            return problem
        import torch.distributed as dist

        found: list[str | None] = [None] * self.world_size
        dist.all_gather_object(found, problem, group=self.host_group)
        return next((p for p in found if p is not None), None)

    def close(self) -> None:
        if self.active:
            import torch.distributed as dist

            dist.destroy_process_group()


def init_distributed() -> Dist:
    """Read RANK / WORLD_SIZE / LOCAL_RANK (set by torchrun and accelerate launch) and join the process group."""
    import torch

    world = world_size_from_env()
    rank = rank_from_env()
    local_rank = local_rank_from_env()
    device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
    host_group = None
    if world > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            check_rendezvous_env()
            dist.init_process_group(
                "nccl" if device.startswith("cuda") else "gloo",
                device_id=torch.device(device) if device.startswith("cuda") else None,
            )
        host_group = dist.new_group(backend="gloo")
    return Dist(rank, local_rank, world, device, host_group=host_group)


def wrap_model(wrapped, dist: Dist, layout, *, activation_checkpointing: str, compile: bool, bf16: bool):
    """Parallelise `wrapped` (a CausalLMLoss) over `layout`: TP + FSDP2 through smolctl.train.parallel, or DDP when
    the layout only replicates (tp 1, dp_shard 1) — one all-reduce of gradients, no parameter gathers."""
    replicate_only = layout.tp == 1 and layout.dp_shard == 1
    mesh = build_mesh(layout, dist.device.split(":")[0]) if dist.active and not replicate_only else None
    parallelize(
        wrapped,
        mesh=mesh,
        layout=layout,
        activation_checkpointing=activation_checkpointing,
        compile=compile,
        bf16=bf16,
        fsdp=not replicate_only,
    )
    dist.sharded = mesh is not None
    dist.fsdp = mesh is not None and layout.data_parallel > 1
    if not dist.active or not replicate_only:
        return wrapped
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [dist.local_rank] if dist.device.startswith("cuda") else None
    return DistributedDataParallel(wrapped, device_ids=device_ids)


def gradient_sync(wrapped, dist: Dist, last_micro_batch: bool):
    """Skip the gradient reduction on all but the last micro batch of a step (gradient accumulation)."""
    if dist.fsdp:
        wrapped.set_requires_gradient_sync(last_micro_batch)
        return nullcontext()
    if not dist.active or last_micro_batch or dist.sharded:
        return nullcontext()
    return wrapped.no_sync()


def full_state_dict(model, dist: Dist) -> dict:
    """Unsharded CPU weights for the Hugging Face folder (every rank must call it under FSDP; rank 0 uses it)."""
    if dist.sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def load_full_state_dict(model, state: dict, dist: Dist) -> None:
    if dist.sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
        return
    model.load_state_dict(state, strict=False)
    if model.config.tie_word_embeddings:
        model.tie_weights()

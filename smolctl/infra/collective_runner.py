"""The collective side of benchmark-nccl: joining the process group, buffers, calls, timing and verification on one
rank, and the multi-node probes. Every Runner method is collective: all ranks call it in the same order.
collectives.py holds what needs no process group (config, sizes, patterns, the report)."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict

from smolctl.errors import UserError
from smolctl.infra.collectives import (
    DTYPES,
    BenchConfig,
    BenchReport,
    OpResult,
    PatternTiles,
    SizeResult,
    bandwidths,
    expected_segments,
    input_segments,
    launch_environment,
    message_sizes,
    pattern_tables,
)
from smolctl.infra.multinode import Link, link_schedule, ring_shifts, summarize
from smolctl.launcher import check_rendezvous_env


def node_key() -> str:
    """Ranks on one machine share a node key. torchrun's GROUP_RANK is the node's index in the job, which also
    tells apart agents started on one host (a two-'node' run on a laptop)."""
    return f"{socket.gethostname()}/{os.environ.get('GROUP_RANK', '0')}"


class Runner:
    """Buffers, calls and timing for one rank; every method is collective (all ranks call it in the same order)."""

    def __init__(self, rank: int, world: int, device, dtype_name: str, iters: int, warmup: int):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.rank, self.world, self.device = rank, world, device
        self.dtype_name, self.iters, self.warmup = dtype_name, iters, warmup
        attr, self.type_name, exact_limit = DTYPES[dtype_name]
        self.dtype = getattr(torch, attr)
        self.elem_size = torch.empty((), dtype=self.dtype).element_size()
        self.tiles = PatternTiles(pattern_tables(world, exact_limit, rank), self.dtype, device)
        self.cuda = device.type == "cuda"

    def check_same_options(self, options: dict) -> None:
        """Every rank must run the same ops over the same sizes: ranks launched by hand (or by a script that
        differs per node) with other options would enter different collectives, which fails on one rank with a
        transport error and passes on another. Every rank raises the same error; rank 0 says it."""
        everyone: list = [None] * self.world
        self.dist.all_gather_object(everyone, options)
        differing = [key for key in options if any(other[key] != options[key] for other in everyone)]
        if differing:
            raise UserError(
                "benchmark-nccl",
                f"the {self.world} ranks were started with different {', '.join(differing)}",
                "launch every rank with the same command line",
            )

    def topology(self, backend: str, max_bytes: int) -> dict:
        torch, dist = self.torch, self.dist
        mine = {
            "node": node_key(),
            "host": socket.gethostname(),
            "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_NCCL_"))},
        }
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, mine)
        node_names = list(dict.fromkeys(info["node"] for info in everyone))
        node_of_rank = [node_names.index(info["node"]) for info in everyone]
        per_node = sorted({node_of_rank.count(k) for k in range(len(node_names))})
        env_keys = sorted({key for info in everyone for key in info["env"]})
        return {
            "world_size": self.world,
            "nodes": len(node_names),
            "ranks_per_node": per_node[0] if len(per_node) == 1 else per_node,
            "hosts": list(dict.fromkeys(info["host"] for info in everyone)),
            "node_of_rank": node_of_rank,
            "rank_hosts": [info["host"] for info in everyone],
            "backend": backend,
            "device": torch.cuda.get_device_name(self.device) if self.cuda else "cpu",
            "dtype": self.type_name,
            "max_bytes": max_bytes,
            "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if self.cuda else None,
            "nccl_env": everyone[0]["env"],
            # a variable set differently on some ranks is a classic cause of one slow or hanging node
            "env_mismatch": [k for k in env_keys if len({info["env"].get(k) for info in everyone}) > 1],
        }

    def _buffers(self, op: str, count: int):
        chunk = count // self.world
        inp = self.torch.zeros(chunk if op == "all_gather" else count, dtype=self.dtype, device=self.device)
        if op in ("all_reduce", "broadcast"):  # in-place ops, as torch.distributed offers them
            return inp, inp
        out = self.torch.zeros(chunk if op == "reduce_scatter" else count, dtype=self.dtype, device=self.device)
        return inp, out

    def _call(self, op: str, inp, out, group=None):
        dist = self.dist
        if op == "all_reduce":
            return lambda: dist.all_reduce(out, group=group)
        if op == "all_gather":
            return lambda: dist.all_gather_single(out, inp, group=group)
        if op == "reduce_scatter":
            return lambda: dist.reduce_scatter_single(out, inp, group=group)
        if op == "all_to_all":
            return lambda: dist.all_to_all_single(out, inp, group=group)
        if op == "broadcast":
            return lambda: dist.broadcast(out, src=0, group=group)
        send_to, recv_from = (self.rank + 1) % self.world, (self.rank - 1) % self.world  # a ring

        def exchange() -> None:
            for work in dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, inp, send_to), dist.P2POp(dist.irecv, out, recv_from)]
            ):
                work.wait()

        return exchange

    def _seconds(self, call: Callable[[], object], group=None) -> float:
        """This rank's seconds per call: CUDA events around the timed calls on GPU, wall clock on CPU; both start
        right after a barrier so that every rank begins together."""
        torch, dist = self.torch, self.dist
        for _ in range(self.warmup):
            call()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)
            dist.barrier(group=group)
            start.record()
            for _ in range(self.iters):
                call()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / self.iters
        dist.barrier(group=group)
        began = time.perf_counter()
        for _ in range(self.iters):
            call()
        return (time.perf_counter() - began) / self.iters

    def _sum(self, values: list[float], group=None) -> list[float]:
        tensor = self.torch.tensor(values, dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(tensor, group=group)
        return tensor.tolist()

    def measure(self, op: str, size: int, count: int) -> SizeResult:
        inp, out = self._buffers(op, count)
        call = self._call(op, inp, out)
        seconds = self._seconds(call)
        self.tiles.fill(inp, input_segments(op, self.rank, self.world, count))
        call()
        wrong = self.tiles.count_wrong(out, expected_segments(op, self.rank, self.world, count))
        total_seconds, total_wrong = self._sum([seconds, float(wrong)])
        mean = total_seconds / self.world  # nccl-tests' default: the time averaged over ranks
        algbw, busbw = bandwidths(op, size, mean, self.world)
        return SizeResult(
            size,
            count,
            self.type_name,
            "sum" if op in ("all_reduce", "reduce_scatter") else "none",
            0 if op == "broadcast" else -1,
            mean * 1e6,
            algbw,
            busbw,
            int(total_wrong),
        )

    def _gather(self, value: float) -> list[float]:
        values = self.torch.zeros(self.world, dtype=self.torch.float64, device=self.device)
        values[self.rank] = value
        self.dist.all_reduce(values)
        return values.tolist()

    def _one_way(self, tensor, peer: int, send: bool) -> Callable[[], None]:
        dist = self.dist

        def transfer() -> None:
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend if send else dist.irecv, tensor, peer)]):
                work.wait()

        return transfer

    def multinode(self, topology: dict, max_bytes: int) -> dict:
        """All_reduce inside each node and across nodes (one rank per node and local index, as rail-optimised
        fabrics pair them), then one-way transfers from every rank to the same local rank `shift` nodes on, for
        several shifts, each timed at both ends (infra/multinode.py plans them and writes the report)."""
        node_of_rank = topology["node_of_rank"]
        by_node = [[r for r, k in enumerate(node_of_rank) if k == node] for node in range(topology["nodes"])]
        widest = max(len(ranks) for ranks in by_node)
        rails = [[ranks[j] for ranks in by_node if j < len(ranks)] for j in range(widest)]
        count = max_bytes // self.elem_size
        size = count * self.elem_size
        seconds_of = {}
        for name, groups in (("intra", by_node), ("inter", rails)):
            group, _ = self.dist.new_subgroups_by_enumeration(groups)
            members = next(g for g in groups if self.rank in g)
            seconds = float("nan")
            if len(members) > 1:
                inp, out = self._buffers("all_reduce", count)
                mine = self._seconds(self._call("all_reduce", inp, out, group=group), group=group)
                seconds = self._sum([mine], group=group)[0] / len(members)
            per_rank = self._gather(seconds)
            seconds_of[name] = (groups, [per_rank[g[0]] for g in groups])
        buffer = self.torch.zeros(count, dtype=self.dtype, device=self.device)
        links = []
        for shift in ring_shifts(len(by_node)):
            for phase in link_schedule(len(by_node), shift):
                pairs = [
                    (by_node[a][j], by_node[b][j])
                    for a, b in phase
                    for j in range(min(len(by_node[a]), len(by_node[b])))
                ]
                role = next(((peer, True) for sender, peer in pairs if sender == self.rank), None) or next(
                    ((peer, False) for peer, receiver in pairs if receiver == self.rank), None
                )
                seconds = float("nan")
                if role is None:  # not in this phase: still meet the others at the barrier inside _seconds
                    self.dist.barrier()
                else:
                    seconds = self._seconds(self._one_way(buffer, *role))
                per_rank = self._gather(seconds)
                links += [
                    Link(shift, sender, receiver, per_rank[sender], per_rank[receiver]) for sender, receiver in pairs
                ]
        return summarize(topology["rank_hosts"], seconds_of["intra"], seconds_of["inter"], links, size)


def run_benchmark(
    config: BenchConfig, on_size: Callable[[str, int], None] | None = None, on_plan: Callable[[int], None] | None = None
) -> BenchReport:
    """Join the process group torchrun set up, run every op over every size, and return the same report on every
    rank. `on_plan(total sizes)` and `on_size(op, bytes)` drive a progress bar."""
    import torch
    import torch.distributed as dist

    rank, world, local_rank = launch_environment()
    backend = config.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise UserError("--backend", "nccl needs CUDA GPUs and none is visible", "use --backend gloo on CPU")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
    if backend == "nccl" and local_world > torch.cuda.device_count():
        raise UserError(
            "--nproc_per_node",
            f"{local_world} processes on this node but {torch.cuda.device_count()} "
            "GPU(s) visible; NCCL puts one rank on each GPU",
            "start one process per GPU",
        )
    dtype_name = config.dtype or ("bf16" if backend == "nccl" else "fp32")
    max_bytes = config.max_bytes or (8 * 2**30 if backend == "nccl" else 64 * 2**20)
    if config.min_bytes > max_bytes:
        raise UserError(
            "--min-bytes",
            f"{config.min_bytes} B is above the default --max-bytes {max_bytes} B",
            "give --max-bytes too",
        )
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    check_rendezvous_env()
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    try:
        runner = Runner(rank, world, device, dtype_name, config.iters, config.warmup)
        runner.check_same_options({**asdict(config), "max_bytes": max_bytes, "backend": backend, "dtype": dtype_name})
        topology = runner.topology(backend, max_bytes)
        sizes_by_op = [
            (op, message_sizes(op, config.min_bytes, max_bytes, config.factor, runner.elem_size, world))
            for op in config.ops
        ]
        if on_plan:
            on_plan(sum(len(sizes) for _, sizes in sizes_by_op))
        results = []
        for op, sizes in sizes_by_op:
            result = OpResult(op)
            for size, count in sizes:
                result.rows.append(runner.measure(op, size, count))
                if on_size:
                    on_size(op, size)
            results.append(result)
        multinode = runner.multinode(topology, max_bytes) if topology["nodes"] > 1 else None
        return BenchReport(topology, results, config.expect_busbw, multinode)
    finally:
        dist.destroy_process_group()

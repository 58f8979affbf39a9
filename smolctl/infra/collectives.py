"""benchmark-nccl: collective bandwidth the way nccl-tests measures it, with nothing to compile.

    torchrun --nproc_per_node 8 -m smolctl benchmark-nccl --max-bytes 8G --expect-busbw all_reduce=350,all_to_all=40

For every op and message size: warm-up, `iters` timed calls (CUDA events on GPU, wall clock after a barrier on
CPU), the per-rank time averaged over ranks (nccl-tests' default), algbw = size / time and busbw = algbw × the
nccl-tests bus factor, then one verification call on a known pattern whose wrong elements are counted over all
ranks (#wrong). Multi-node runs add an intra- vs inter-node all_reduce split and rail-aligned one-way transfers
between nodes over several ring shifts (infra/multinode.py names the slowest host and link). Every rank computes
the same report; only rank 0 shows it. This module holds the arithmetic, the sizes, the verification patterns and
the report, and imports no torch; collective_runner.py joins the process group and does the collective calls.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from smolctl.errors import UserError
from smolctl.launcher import local_rank_from_env, rank_from_env, world_size_from_env
from smolctl.units import parse_nccl_bytes

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
LAUNCH_HINT = (
    "launch one process per GPU with torchrun: `torchrun --nproc_per_node 8 -m smolctl benchmark-nccl "
    "...` (across nodes: recipes/slurm/benchmark-nccl.sbatch)"
)

# name → (torch dtype attribute, the nccl-tests type name, largest integer the type holds exactly)
DTYPES = {
    "bf16": ("bfloat16", "bfloat16", 2**8),
    "fp16": ("float16", "half", 2**11),
    "fp32": ("float32", "float", 2**24),
    "fp64": ("float64", "double", 2**53),
    "int32": ("int32", "int32", 2**31 - 1),
}
DTYPE_ALIASES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float": "fp32",
    "float32": "fp32",
    "double": "fp64",
    "float64": "fp64",
    "int": "int32",
}
CHUNKED_OPS = ("all_gather", "reduce_scatter", "all_to_all")  # the buffer splits into one chunk per rank
PERIOD = 31  # data-moving ops carry 0..30 (and the patterns repeat every 31 elements at small world sizes)
RANK_STRIDE = 7  # rank r's pattern is shifted by 7·r, so data from the wrong rank shows up as wrong
SUM_VARIETY = 16  # at least this many distinct sums along a reduced buffer, so a misplaced chunk shows up
VERIFY_CHUNK = 2**22  # elements filled/compared per kernel, which bounds the pattern tile's memory


def bus_factor(op: str, world: int) -> float:
    """nccl-tests' busbw factor (doc/PERFORMANCE.md): the fraction of the data each rank's link must carry, so
    that busbw is comparable across ops and world sizes with the hardware's bandwidth."""
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op in CHUNKED_OPS:
        return (world - 1) / world
    return 1.0  # broadcast, send_recv


def bandwidths(op: str, size_bytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes/s, as nccl-tests prints them)."""
    algbw = size_bytes / seconds / 1e9
    return algbw, algbw * bus_factor(op, world)


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark-nccl run, validated before any process group exists (every rank raises the same error)."""

    ops: tuple[str, ...]
    min_bytes: int
    max_bytes: int | None
    """None: 8 GiB with NCCL, 64 MiB with gloo (CPU memory and time)."""
    factor: float
    dtype: str | None
    """None: bf16 with NCCL (what training reduces), fp32 with gloo."""
    iters: int = 20
    warmup: int = 5
    backend: str = "auto"
    expect_busbw: dict[str, float] = field(default_factory=dict)
    """op → GB/s that its busbw at the largest size must reach."""


def parse_thresholds(text: str | None, ops: list[str]) -> dict[str, float]:
    """'300' (every op), 'all_reduce=350,all_to_all=40' (those ops) → {op: GB/s}."""
    if text is None:
        return {}
    fix = "give GB/s, e.g. 300 (every op) or all_reduce=350,all_to_all=40"
    thresholds = {}
    for part in (p.strip() for p in str(text).split(",") if p.strip()):
        name, _, value = part.rpartition("=")
        name = name.strip().lower().replace("-", "_")
        try:
            number = float(value)
        except ValueError:
            raise UserError("--expect-busbw", f"cannot read {part!r} as a bandwidth", fix) from None
        if not number > 0:
            raise UserError("--expect-busbw", f"{number:g} is not a bandwidth", fix)
        if not name:
            thresholds.update({op: number for op in ops})
        elif name not in ops:
            raise UserError(
                "--expect-busbw", f"{name!r} is not among the ops run ({', '.join(ops)})", "name an op given to --ops"
            )
        else:
            thresholds[name] = number
    if not thresholds:
        raise UserError("--expect-busbw", "no threshold given", fix)
    return thresholds


def build_config(
    *,
    ops: str,
    min_bytes: str,
    max_bytes: str | None,
    factor: float,
    dtype: str | None,
    iters: int,
    warmup: int,
    backend: str,
    expect_busbw: str | float | None,
) -> BenchConfig:
    names = [op.strip().lower().replace("-", "_") for op in ops.split(",") if op.strip()]
    if names == ["all"]:
        names = list(OPS)
    for name in names:
        if name not in OPS:
            raise UserError("--ops", f"unknown op {name!r}", f"choose from {', '.join(OPS)} (comma-separated)")
    if not names:
        raise UserError("--ops", "no op given", f"choose from {', '.join(OPS)}")
    dtype_name = None if dtype is None else DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    if dtype_name is not None and dtype_name not in DTYPES:
        raise UserError("--dtype", f"unknown dtype {dtype!r}", f"choose from {', '.join(DTYPES)}")
    low = parse_nccl_bytes(min_bytes, "--min-bytes")
    high = None if max_bytes is None else parse_nccl_bytes(max_bytes, "--max-bytes")
    if high is not None and low > high:
        raise UserError(
            "--min-bytes",
            f"{min_bytes} is larger than --max-bytes {max_bytes}",
            "give a --min-bytes no larger than --max-bytes",
        )
    if factor <= 1:
        raise UserError("--factor", f"{factor} does not grow the size", "use a factor above 1, e.g. 2")
    if backend not in ("auto", "nccl", "gloo"):
        raise UserError("--backend", f"unknown backend {backend!r}", "choose auto, nccl or gloo")
    thresholds = parse_thresholds(None if expect_busbw is None else str(expect_busbw), list(dict.fromkeys(names)))
    if iters < 1:
        raise UserError("--iters", f"{iters} timed calls measure nothing", "use 1 or more, e.g. --iters 20")
    if warmup < 0:
        raise UserError("--warmup", f"{warmup} is negative", "use 0 or more, e.g. --warmup 5")
    return BenchConfig(tuple(dict.fromkeys(names)), low, high, factor, dtype_name, iters, warmup, backend, thresholds)


def launch_environment() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment, or a UserError saying how to launch."""
    missing = [name for name in ("RANK", "WORLD_SIZE") if name not in os.environ]
    if missing:
        unset = f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set"
        raise UserError("benchmark-nccl", f"not started by torchrun ({unset})", LAUNCH_HINT)
    rank, world = rank_from_env(), world_size_from_env()
    if world < 2:
        raise UserError(
            "benchmark-nccl",
            "only 1 rank: bus bandwidth needs at least 2 ranks to move data between",
            "start 2 or more, e.g. `torchrun --nproc_per_node 2 -m smolctl benchmark-nccl` (one per GPU)",
        )
    return rank, world, local_rank_from_env()


def message_sizes(
    op: str, min_bytes: int, max_bytes: int, factor: float, elem_size: int, world: int
) -> list[tuple[int, int]]:
    """(bytes, elements) from min to max by `factor`; chunked ops round down to a whole element per rank, like
    nccl-tests; sizes that round to nothing (or repeat) are skipped."""
    sizes, seen, size = [], set(), float(min_bytes)
    while size <= max_bytes * (1 + 1e-9):
        count = int(size) // elem_size
        if op in CHUNKED_OPS:
            count -= count % world
        if count > 0 and count not in seen:
            seen.add(count)
            sizes.append((count * elem_size, count))
        size *= factor
    return sizes


# --- verification patterns: every buffer is a periodic table of values, described as segments ---------------


@dataclass(frozen=True)
class Segment:
    """Elements [start, start+length) of a buffer hold table[(phase + k) % period] for k = 0..length-1."""

    start: int
    length: int
    table: str  # "moved" | "summand" (this rank's) | "sum" | "fill" (the constant `phase`)
    phase: int


@dataclass(frozen=True)
class Patterns:
    """One rank's verification tables, all `period` long."""

    period: int
    tables: dict[str, Sequence[float]]


def reduction_layout(world: int, exact_limit: int) -> tuple[int, int]:
    """(groups, variety) for the reduction patterns: rank r contributes to element k only when r ≡ k (mod
    groups), so at most ⌈world / groups⌉ ranks add to any element; every contributor adds 1 except the first
    (rank k mod groups), which adds 1 + a value below `variety`. The largest sum, ⌈world / groups⌉ + variety − 1,
    stays within the integers the dtype holds exactly (bf16: 256), so any summation order gives the exact
    result and #wrong needs no tolerance, at any world size."""
    variety = min(PERIOD, exact_limit - world + 1)
    if variety >= SUM_VARIETY:
        return 1, variety
    return math.ceil(world / (exact_limit - SUM_VARIETY + 1)), SUM_VARIETY


@functools.lru_cache(maxsize=4)
def _shared_tables(
    world: int, exact_limit: int
) -> tuple[int, int, tuple[int, ...], tuple[float, ...], tuple[float, ...]]:
    """(period, groups, what each element's first contributor adds, the moved values, the expected sums): the
    same on every rank."""
    groups, variety = reduction_layout(world, exact_limit)
    period = groups * variety if groups > 1 else PERIOD
    first_adds = tuple(1 + (k // groups) % variety for k in range(period))
    # element k's contributors are ranks k mod groups, + groups, + 2·groups, ... below world
    total = tuple(float(len(range(k % groups, world, groups)) - 1 + first_adds[k]) for k in range(period))
    return period, groups, first_adds, tuple(float(k % PERIOD) for k in range(period)), total


def pattern_tables(world: int, exact_limit: int, rank: int = 0) -> Patterns:
    """Data-moving ops carry 0..30; reductions carry this rank's summands and check their exact sum."""
    period, groups, first_adds, moved, total = _shared_tables(world, exact_limit)
    summand = [0.0] * period
    for k in range(rank % groups, period, groups):
        summand[k] = float(first_adds[k]) if rank == k % groups else 1.0
    return Patterns(period, {"moved": moved, "summand": summand, "sum": total})


def input_segments(op: str, rank: int, world: int, count: int) -> list[Segment]:
    """What rank `rank` puts in its input buffer before the verification call (`count` = total elements)."""
    chunk = count // world
    if op in ("all_reduce", "reduce_scatter"):  # the summand table is this rank's own
        return [Segment(0, count, "summand", 0)]
    if op == "all_gather":
        return [Segment(0, chunk, "moved", RANK_STRIDE * rank)]
    if op == "broadcast":  # the root's data; the others start from a value no pattern holds
        return [Segment(0, count, "moved", 0)] if rank == 0 else [Segment(0, count, "fill", PERIOD)]
    return [Segment(0, count, "moved", RANK_STRIDE * rank)]  # all_to_all, send_recv


def expected_segments(op: str, rank: int, world: int, count: int) -> list[Segment]:
    """What rank `rank`'s output buffer must hold after one call on the inputs of `input_segments`."""
    chunk = count // world
    if op == "all_reduce":
        return [Segment(0, count, "sum", 0)]
    if op == "reduce_scatter":
        return [Segment(0, chunk, "sum", rank * chunk)]
    if op == "all_gather":
        return [Segment(j * chunk, chunk, "moved", RANK_STRIDE * j) for j in range(world)]
    if op == "all_to_all":  # chunk j comes from rank j's input, at this rank's offset
        return [Segment(j * chunk, chunk, "moved", rank * chunk + RANK_STRIDE * j) for j in range(world)]
    if op == "broadcast":
        return [Segment(0, count, "moved", 0)]
    return [Segment(0, count, "moved", RANK_STRIDE * ((rank - 1) % world))]  # send_recv: from the previous rank


class PatternTiles:
    """The tables laid out once on the device, a period longer than a chunk, so any segment's slice at any
    phase is a view: filling is one copy and checking one compare per chunk, with no index tensors."""

    def __init__(self, patterns: Patterns, dtype, device, chunk: int = VERIFY_CHUNK):
        import torch

        self.chunk, self.period = chunk, patterns.period
        index = torch.arange(chunk + self.period, device=device) % self.period
        self.tiles = {
            name: torch.tensor(values, dtype=torch.float64, device=device)[index].to(dtype)
            for name, values in patterns.tables.items()
        }

    def _pieces(self, segment: Segment):
        for offset in range(0, segment.length, self.chunk):
            length = min(self.chunk, segment.length - offset)
            phase = (segment.phase + offset) % self.period
            yield segment.start + offset, length, phase

    def fill(self, buffer, segments: list[Segment]) -> None:
        for segment in segments:
            if segment.table == "fill":
                buffer[segment.start : segment.start + segment.length].fill_(segment.phase)
                continue
            tile = self.tiles[segment.table]
            for start, length, phase in self._pieces(segment):
                buffer[start : start + length].copy_(tile[phase : phase + length])

    def count_wrong(self, buffer, segments: list[Segment]):
        """Elements of `buffer` that differ from the segments' pattern, as a device int64 scalar (no sync)."""
        import torch

        wrong = torch.zeros((), dtype=torch.int64, device=buffer.device)
        covered = 0
        for segment in segments:
            tile = self.tiles[segment.table]
            covered += segment.length
            for start, length, phase in self._pieces(segment):
                wrong += torch.ne(buffer[start : start + length], tile[phase : phase + length]).sum()
        return wrong + (buffer.numel() - covered)  # a buffer of the wrong size is wrong everywhere else


# --- running the benchmark -------------------------------------------------------------------------------------


@dataclass
class SizeResult:
    size: int
    count: int
    type: str
    redop: str
    root: int
    time_us: float
    algbw: float
    busbw: float
    wrong: int


@dataclass
class OpResult:
    op: str
    rows: list[SizeResult] = field(default_factory=list)

    @property
    def avg_busbw(self) -> float:
        return statistics.fmean(row.busbw for row in self.rows) if self.rows else 0.0

    @property
    def peak(self) -> SizeResult | None:
        return self.rows[-1] if self.rows else None


@dataclass
class BenchReport:
    topology: dict
    results: list[OpResult]
    expect_busbw: dict[str, float]
    multinode: dict | None = None

    @property
    def wrong(self) -> int:
        return sum(row.wrong for result in self.results for row in result.rows)

    @property
    def avg_busbw(self) -> float:
        rows = [row.busbw for result in self.results for row in result.rows]
        return statistics.fmean(rows) if rows else 0.0

    def below_expectation(self) -> list[OpResult]:
        """Ops whose busbw at the largest size misses their --expect-busbw. The largest size, not the average:
        small sizes are latency-bound, and the plateau is the number a cluster is specified by."""
        return [
            r
            for r in self.results
            if r.op in self.expect_busbw and (r.peak is None or r.peak.busbw < self.expect_busbw[r.op])
        ]

    @property
    def passed(self) -> bool:
        return self.wrong == 0 and not self.below_expectation()

    def to_dict(self) -> dict:
        return {
            "topology": self.topology,
            "expect_busbw": self.expect_busbw,
            "passed": self.passed,
            "wrong": self.wrong,
            "avg_busbw": self.avg_busbw,
            "multinode": self.multinode,
            "results": [
                {"op": r.op, "avg_busbw": r.avg_busbw, "rows": [asdict(row) for row in r.rows]} for r in self.results
            ],
        }

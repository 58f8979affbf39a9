"""stress-gpu: sustained matmuls on every device with every result checked, like gpu-burn and gpu-fryer.

    smolctl stress-gpu --duration 5m

Every GPU runs in its own process: an n×n matmul repeated for the whole duration (TFLOPS sampled per window,
timed around the matmuls only), every result compared bit for bit with the device's first one (itself checked in
float64 by Freivalds' method), and a pattern test that writes and reads back a buffer filling the rest of the
chosen memory fraction; NVML telemetry (infra/telemetry.py) is sampled alongside. Every device multiplies the same
matrices from the same seed with the same kernel, so the SHA-256 of each device's product must agree across the
node. `judge` then marks each device OK or FAULTY. `--devices cpu` runs the same code on the CPU in float32 with
small matrices (a check of the tool, not of the CPU).

Why processes: a Python thread per GPU shares one GIL for all kernel launches, so eight GPUs launching short
matmuls and checks contend for it, and a CUDA error (an Xid, an illegal address) poisons the whole process's
CUDA context, so one bad GPU would fail all the others. A process per GPU costs a few seconds of start-up.
Threads remain for the CPU (one device; tests inject faults by patching the worker in-process).
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import queue
import re
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields

from smolctl.child_processes import exit_with_parent
from smolctl.errors import CheckFailed, UserError
from smolctl.infra.telemetry import health_findings, nvidia_smi_gpus, open_telemetry, why_no_gpu
from smolctl.results import Result

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11, "fp32": 2.0**-24}
CPU_PATTERN_BYTES = 16 * 2**20  # CPU mode exercises the code path; it is not a RAM test (memtester is)
PATTERN_CHUNK = 2**24  # int32 words written/checked per kernel: bounds the scratch buffer to 64 MiB
PATTERN_SEEDS = (0x55555555, -0x55555556, 0, -1)  # 0x5555…, 0xAAAA…, all zeros, all ones: every bit both ways
HEADROOM_BYTES = 512 * 2**20  # left free for cuBLAS workspaces and the check's temporaries
LAUNCHES = ("auto", "process", "thread")


def parse_duration(text: str) -> float:
    """'60' (seconds), '30s', '5m', '1h', '1.5m' → seconds."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|sec|m|min|h)?\s*", str(text), flags=re.IGNORECASE)
    if not match or float(match.group(1)) <= 0:
        raise UserError("--duration", f"cannot read {text!r} as a duration", "use seconds (60) or 30s, 5m, 1h")
    scale = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}[(match.group(2) or "").lower()]
    return float(match.group(1)) * scale


@dataclass(frozen=True)
class StressConfig:
    duration_s: float
    devices: tuple[str, ...]
    """torch device strings, e.g. ('cuda:0', 'cuda:1') or ('cpu',)."""
    dtype: str = "bf16"
    size: int = 8192
    """n of the n×n matmuls (gpu-fryer's 8192 keeps tensor cores saturated)."""
    memory_fraction: float = 0.9
    """Of each device's total memory, for the matmul buffers plus the pattern-test buffer."""
    tolerance: float = 0.10
    """A device whose median TFLOPS is more than this fraction below the best device's fails."""
    sample_s: float = 1.0
    """Seconds of matmuls per TFLOPS sample."""
    expect_tflops: float | None = None
    """An absolute floor on each device's median TFLOPS (a node whose GPUs are all equally slow fails too)."""
    launch: str = "auto"
    """process (one per device), thread, or auto: processes for GPUs, a thread for the CPU."""


def build_config(
    *,
    duration: str,
    dtype: str | None,
    size: int | None,
    memory_fraction: float,
    tolerance: float,
    devices: str,
    expect_tflops: float | None = None,
    expect_gpus: int | None = None,
    launch: str = "auto",
) -> StressConfig:
    """Validate the flags; defaults follow the hardware: bf16 and 8192 on GPUs, fp32 and 512 on the CPU."""
    import torch

    seconds = parse_duration(duration)
    if not 0 < memory_fraction < 1:
        raise UserError("--memory-fraction", f"{memory_fraction} is outside (0, 1)", "use e.g. 0.9 for 90%")
    if not 0 <= tolerance < 1:
        raise UserError("--tolerance", f"{tolerance} is outside [0, 1)", "use e.g. 0.10 for 10% slower than the best")
    if expect_tflops is not None and not expect_tflops > 0:
        raise UserError("--expect-tflops", f"{expect_tflops} is not a rate", "give TFLOPS above 0, e.g. 600")
    if expect_gpus is not None and expect_gpus < 1:
        raise UserError("--expect-gpus", f"{expect_gpus} GPUs checks nothing", "give 1 or more, e.g. 8")
    if launch not in LAUNCHES:
        raise UserError("--launch", f"unknown launch {launch!r}", f"choose from {', '.join(LAUNCHES)}")
    if dtype is not None and DTYPE_ALIASES.get(dtype.lower(), dtype.lower()) not in DTYPES:
        raise UserError("--dtype", f"unknown dtype {dtype!r}", f"choose from {', '.join(DTYPES)}")
    if size is not None and not 16 <= size <= 65536:
        raise UserError("--size", f"{size} is not a sensible matrix size", "use 16..65536, e.g. 8192 on GPUs")
    if expect_gpus is not None and devices.strip().lower() == "cpu":
        raise UserError("--expect-gpus", "counts GPUs, and --devices cpu runs on none", "drop one of the two")
    # the flags are sound; now whether the node is (a GPU that torch cannot see fails it, exit 1)
    resolved = resolve_devices(devices, torch.cuda.device_count())
    on_gpu = resolved[0] != "cpu"
    if on_gpu:
        check_gpu_count(torch.cuda.device_count(), expect_gpus, everything=devices.strip().lower() == "all")
    name = DTYPE_ALIASES.get(dtype.lower(), dtype.lower()) if dtype else ("bf16" if on_gpu else "fp32")
    n = size or (8192 if on_gpu else 512)
    return StressConfig(
        seconds,
        resolved,
        name,
        n,
        memory_fraction,
        tolerance,
        sample_s=min(2.0, max(0.25, seconds / 30)),
        expect_tflops=expect_tflops,
        launch=launch,
    )


def resolve_devices(spec: str, gpu_count: int) -> tuple[str, ...]:
    """'all' → every visible GPU (a failed check when torch sees none); '0,3' → those GPUs; 'cpu' → the CPU."""
    spec = spec.strip().lower()
    if spec == "cpu":
        return ("cpu",)
    if spec == "all" and gpu_count == 0:
        raise CheckFailed(
            f"stress-gpu --devices all: torch sees no GPU ({why_no_gpu()}); a node whose GPUs "
            "torch cannot use fails — for a CPU-only check of the tool pass --devices cpu"
        )
    if spec == "all":
        return tuple(f"cuda:{i}" for i in range(gpu_count))
    indices = []
    for part in spec.split(","):
        part = part.strip().removeprefix("cuda:")
        if part in ("cpu", "all"):
            raise UserError(
                "--devices", f"{part} stands alone, not in a list ({spec})", f"pass --devices {part}, or GPU indices"
            )
        if not part.isdigit() or int(part) >= gpu_count:
            raise UserError(
                "--devices",
                f"no GPU {part!r} ({gpu_count} visible)",
                "use all, cpu, or GPU indices like 0,1 (CUDA_VISIBLE_DEVICES numbering)",
            )
        indices.append(int(part))
    return tuple(f"cuda:{i}" for i in dict.fromkeys(indices))


def check_gpu_count(visible: int, expected: int | None, *, everything: bool) -> None:
    """Fail a node where torch sees fewer GPUs than --expect-gpus, or (with --devices all and no --expect-gpus)
    than nvidia-smi lists: a GPU that CUDA cannot initialise is otherwise simply left out of 'all'."""
    source = "--expect-gpus"
    if expected is None and everything:
        expected, source = nvidia_smi_gpus(), "nvidia-smi / CUDA_VISIBLE_DEVICES"
    if expected is not None and visible < expected:
        raise CheckFailed(
            f"stress-gpu: torch sees {visible} GPU(s), {expected} expected ({source}); a missing "
            "GPU is a failed node (check `nvidia-smi`, the kernel log for Xid / 'fallen off the bus')"
        )


@dataclass
class DeviceReport:
    device: str
    name: str = ""
    tflops: list[float] = field(default_factory=list)
    matmuls: int = 0
    mismatches: int = 0
    """Result elements not bit-identical to the device's first result (plus its rows failing the float64 check)."""
    result_hash: str | None = None
    """SHA-256 of the device's first product: every device multiplies the same inputs, so these must agree."""
    memory_errors: int = 0
    """int32 words the pattern test read back wrong."""
    memory_tested_bytes: int = 0
    pattern_passes: int = 0
    telemetry: dict = field(default_factory=dict)
    error: str | None = None
    verdict: str = "OK"
    reasons: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def tflops_min(self) -> float | None:
        return min(self.tflops) if self.tflops else None

    @property
    def tflops_median(self) -> float | None:
        return statistics.median(self.tflops) if self.tflops else None

    def to_dict(self) -> dict:
        return {**asdict(self), "tflops_min": self.tflops_min, "tflops_median": self.tflops_median}


@dataclass
class StressRun(Result):
    """What `smolctl stress-gpu` found: the settings it ran with and one report per device."""

    config: StressConfig
    devices: list[DeviceReport]

    def to_dict(self) -> dict:
        verdict = "OK" if all(device.verdict == "OK" for device in self.devices) else "FAULTY"
        return {"verdict": verdict, "config": asdict(self.config), "devices": [d.to_dict() for d in self.devices]}


def node_failure(error: CheckFailed) -> dict:
    """The --json of a node failed before any device ran (torch sees no GPU, or fewer than expected): the same
    top-level verdict a device failure gives, so a collector reads every node's line the same way."""
    return {"verdict": "FAULTY", "reasons": [str(error)], "config": None, "devices": []}


def _hash_outliers(reports: list[DeviceReport]) -> dict[str, str]:
    """device → why its product is suspect: devices of one model whose hash is not the majority's (all of them
    when no hash has a majority)."""
    outliers = {}
    for name in dict.fromkeys(r.name for r in reports):
        members = [r for r in reports if r.name == name and r.result_hash]
        votes = Counter(r.result_hash for r in members)
        if len(votes) < 2:
            continue
        (majority, count), *rest = votes.most_common()
        tied = rest[0][1] == count
        for r in members:
            if tied:
                outliers[r.device] = (
                    f"products differ bit-wise across the {len(members)} {name} devices with no "
                    f"majority ({len(votes)} different results from the same inputs)"
                )
            elif r.result_hash != majority:
                outliers[r.device] = (
                    f"product differs bit-wise from {count} of the {len(members)} {name} devices "
                    "(same inputs, same kernel)"
                )
    return outliers


def judge(reports: list[DeviceReport], tolerance: float, expect_tflops: float | None = None) -> list[DeviceReport]:
    """Mark each device OK or FAULTY (in place, and return the list): a crash, any mismatch, a product that
    differs from the other devices', a memory error, what NVML reports (hardware throttling, row remapping, new
    uncorrectable ECC errors, Xid errors, a PCIe link below its maximum), a median TFLOPS below --expect-tflops,
    or more than `tolerance` below the best device's (gpu-fryer's rule)."""
    timed = [r for r in reports if r.tflops_median]
    healthy = [r for r in timed if not (r.error or r.mismatches or r.memory_errors)]
    fastest = max(healthy or timed, key=lambda r: r.tflops_median, default=None)  # a broken device sets no bar
    best, best_device = (fastest.tflops_median, fastest.device) if fastest else (None, None)
    outliers = _hash_outliers(reports)
    for report in reports:
        reasons = []
        if report.error:
            reasons.append(f"error: {report.error}")
        if report.mismatches:
            reasons.append(f"{report.mismatches} mismatching result element(s)")
        if report.device in outliers:
            reasons.append(outliers[report.device])
        if report.memory_errors:
            reasons.append(f"{report.memory_errors} memory error(s)")
        faults, report.warnings = health_findings(report.telemetry)
        reasons += faults
        if report.tflops_median is None:
            reasons.append("no matmul finished")
        else:
            if expect_tflops and report.tflops_median < expect_tflops:
                reasons.append(f"median {report.tflops_median:.4g} TFLOPS < --expect-tflops {expect_tflops:g}")
            if best and report.tflops_median < (1 - tolerance) * best:
                reasons.append(f"{1 - report.tflops_median / best:.0%} slower than the best device ({best_device})")
        report.reasons, report.verdict = reasons, "FAULTY" if reasons else "OK"
    return reports


def _device_main(index: int, config: StressConfig, updates, stop, parent: int) -> None:
    """One device's worker, in a thread or a spawned process: runs the burn and posts its report after every
    window, the last time with done=True."""
    if os.getpid() != parent:  # a process: it must not go on burning a GPU after the command is killed
        exit_with_parent(parent)
    report = DeviceReport(config.devices[index])
    try:
        DeviceStress(index, config, report, stop, publish=lambda: updates.put((index, asdict(report), False))).run()
    except KeyboardInterrupt:  # Ctrl-C reaches every process of the group; the parent reports it once
        return
    updates.put((index, asdict(report), True))


def run_stress(
    config: StressConfig, on_tick: Callable[[float, list[DeviceReport]], None] | None = None, stop=None
) -> list[DeviceReport]:
    """Stress every device concurrently (so they heat up together, as in a real run) and judge them."""
    in_processes = config.launch == "process" or (config.launch == "auto" and config.devices[0] != "cpu")
    context = multiprocessing.get_context("spawn")
    updates = context.Queue() if in_processes else queue.Queue()
    stop = stop or (context.Event() if in_processes else threading.Event())
    make = context.Process if in_processes else threading.Thread
    workers = [
        make(target=_device_main, args=(i, config, updates, stop, os.getpid()), name=f"stress-{device}", daemon=True)
        for i, device in enumerate(config.devices)
    ]
    reports = [DeviceReport(device) for device in config.devices]
    done: set[int] = set()
    began = time.monotonic()
    for worker in workers:
        worker.start()
    try:
        while len(done) < len(workers):
            try:
                index, state, final = updates.get(timeout=0.2)
                reports[index] = DeviceReport(**{f.name: state[f.name] for f in fields(DeviceReport)})
                if final:
                    done.add(index)
            except queue.Empty:  # nothing new: a worker that died without its last report crashed
                for index, worker in enumerate(workers):
                    if index not in done and not worker.is_alive():
                        code = getattr(worker, "exitcode", None)
                        reports[index].error = f"worker exited with code {code} without a report"
                        done.add(index)
            if on_tick:
                on_tick(time.monotonic() - began, reports)
    except KeyboardInterrupt:
        stop.set()
        raise
    finally:
        for worker in workers:
            worker.join(timeout=10)
            if in_processes and worker.is_alive():
                worker.terminate()
    return judge(reports, config.tolerance, config.expect_tflops)


class DeviceStress:
    """One device's burn: setup, then windows of checked matmuls and periodic pattern passes until the deadline."""

    def __init__(self, index: int, config: StressConfig, report: DeviceReport, stop, publish=lambda: None):
        self.index, self.config, self.report, self.stop, self.publish = index, config, report, stop, publish

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # a crashed device (CUDA error, Xid, OOM) is a finding, not a smolctl bug
            self.report.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]

    def _run(self) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(self.config.devices[self.index])
        self.dtype = getattr(torch, DTYPES[self.config.dtype])
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            torch.cuda.set_device(self.device)
        self.report.name = torch.cuda.get_device_name(self.device) if on_gpu else "cpu"
        self.telemetry = open_telemetry(self.device)
        self._setup_matmul()
        self.pattern = PatternTest(torch, self.device, self._pattern_bytes())
        self._pattern_pass()
        self._burn()
        self._pattern_pass()
        self.report.telemetry = self.telemetry.close()

    def _setup_matmul(self) -> None:
        torch, n = self.torch, self.config.size
        generator = torch.Generator(self.device).manual_seed(20250101)
        self.a = torch.randn(n, n, generator=generator, device=self.device).to(self.dtype)
        self.b = torch.randn(n, n, generator=generator, device=self.device).to(self.dtype)
        self.out = torch.empty(n, n, dtype=self.dtype, device=self.device)
        self.multiply()
        self.reference = self.out.clone()
        # the bytes, whatever the dtype: the same on every device of one model, or one of them computes wrong
        self.report.result_hash = hashlib.sha256(
            self.reference.contiguous().view(torch.uint8).cpu().numpy().tobytes()
        ).hexdigest()
        self.reference_rows_wrong = self._reference_rows_wrong(generator)
        self.report.mismatches = self.reference_rows_wrong
        self.wrong = torch.zeros((), dtype=torch.int64, device=self.device)

    def _reference_rows_wrong(self, generator) -> int:
        """Freivalds' check in float64: reference·x against a·(b·x) for a random ±1 vector, a cheap witness that
        the reference itself is right (O(n²), independent of the matmul kernels). The bound allows the dtype's
        rounding of each element (u) and float32 accumulation (√n·2⁻²⁴), 8 standard deviations out."""
        torch, n = self.torch, self.config.size
        x = torch.randint(0, 2, (n,), generator=generator, device=self.device).double() * 2 - 1
        want = self.a.double() @ (self.b.double() @ x)
        got = self.reference.double() @ x
        u = UNIT_ROUNDOFF[self.config.dtype] + n**0.5 * 2.0**-24
        bound = 8 * u * self.reference.double().pow(2).sum(dim=1).sqrt() + 1e-9
        return int(((got - want).abs() <= bound).logical_not_().sum())

    def multiply(self) -> None:
        self.torch.matmul(self.a, self.b, out=self.out)

    def _check(self) -> None:
        # the same kernel on the same inputs gives the same bits: any difference (a NaN included) is corruption
        self.wrong += self.torch.ne(self.out, self.reference).sum()

    def _pattern_bytes(self) -> int:
        if self.device.type != "cuda":
            return int(CPU_PATTERN_BYTES * self.config.memory_fraction)
        self.torch.cuda.empty_cache()  # setup's float64 temporaries sit in the allocator's cache, not in use
        free, total = self.torch.cuda.mem_get_info(self.device)
        spare = free - (1 - self.config.memory_fraction) * total - HEADROOM_BYTES - self.config.size**2
        return max(0, int(spare))

    def _pattern_pass(self) -> None:
        errors = self.pattern.run(PATTERN_SEEDS[self.report.pattern_passes % len(PATTERN_SEEDS)])
        self.report.memory_errors += errors
        self.report.memory_tested_bytes += self.pattern.nbytes
        self.report.pattern_passes += 1

    def _burn(self) -> None:
        clock = CudaClock(self.torch, self.device) if self.device.type == "cuda" else WallClock()
        flops = 2.0 * self.config.size**3
        deadline = time.monotonic() + self.config.duration_s
        pattern_every = max(self.config.sample_s, self.config.duration_s / 8)
        next_pattern = time.monotonic() + pattern_every
        iters = 1
        while not self.stop.is_set():
            window_began = time.monotonic()
            for _ in range(iters):
                clock.start()
                self.multiply()
                clock.stop()
                self._check()
            self.report.tflops.append(iters * flops / clock.seconds() / 1e12)
            self.report.matmuls += iters
            self.report.mismatches = self.reference_rows_wrong + int(self.wrong)
            self.telemetry.sample()
            self.publish()
            now = time.monotonic()
            if now >= deadline:
                return
            if now >= next_pattern and deadline - now > pattern_every / 2:
                self._pattern_pass()
                next_pattern = time.monotonic() + pattern_every
            # aim the next window at sample_s of wall time and not past the deadline; grow at most 4× a window,
            # so that one fast early measurement cannot commit the device to a long overrun
            per_iter = (now - window_began) / iters
            iters = max(1, min(4 * iters, int(min(self.config.sample_s, deadline - now) / per_iter)))


class WallClock:
    """Seconds spent between start() and stop() calls, for synchronous (CPU) work."""

    def __init__(self) -> None:
        self.total, self.began = 0.0, 0.0

    def start(self) -> None:
        self.began = time.perf_counter()

    def stop(self) -> None:
        self.total += time.perf_counter() - self.began

    def seconds(self) -> float:
        total, self.total = self.total, 0.0
        return total


class CudaClock:
    """The same, with CUDA events around the matmuls only, so the checks between them cost no TFLOPS."""

    def __init__(self, torch, device) -> None:
        self.torch, self.device, self.pairs = torch, device, []

    def start(self) -> None:
        self.pairs.append((self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)))
        self.pairs[-1][0].record()

    def stop(self) -> None:
        self.pairs[-1][1].record()

    def seconds(self) -> float:
        self.pairs[-1][1].synchronize()
        total = sum(begin.elapsed_time(end) for begin, end in self.pairs) / 1e3
        self.pairs = []
        return total


class PatternTest:
    """Write an address-dependent pattern over a large int32 buffer, then read it all back: stuck bits show up
    against the alternating seeds, addressing faults against the per-chunk offsets."""

    def __init__(self, torch, device, nbytes: int):
        self.torch = torch
        words = nbytes // 4
        self.buffer = torch.empty(words, dtype=torch.int32, device=device)
        self.scratch = torch.empty(min(PATTERN_CHUNK, max(words, 1)), dtype=torch.int32, device=device)
        self.nbytes = words * 4

    def _expected(self, k: int, out, seed: int):
        start = k * 7919  # < 2³¹ for any buffer below ~2.7 TB
        self.torch.arange(start, start + out.numel(), dtype=self.torch.int32, out=out)
        return out.bitwise_xor_(seed)

    def run(self, seed: int) -> int:
        """One pass: write the whole buffer first (so the reads come from DRAM, not a cache), then verify it."""
        self.write(seed)
        return self.verify(seed)

    def write(self, seed: int) -> None:
        for k, chunk in enumerate(self.buffer.split(PATTERN_CHUNK)):
            self._expected(k, chunk, seed)

    def verify(self, seed: int) -> int:
        """How many int32 words differ from what write(seed) put there."""
        errors = self.torch.zeros((), dtype=self.torch.int64, device=self.buffer.device)
        for k, chunk in enumerate(self.buffer.split(PATTERN_CHUNK)):
            errors += self.torch.ne(chunk, self._expected(k, self.scratch[: chunk.numel()], seed)).sum()
        return int(errors)

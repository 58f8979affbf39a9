"""stress-gpu: sustained matmuls on every device with every result checked, like gpu-burn and gpu-fryer.

    smolctl stress-gpu --duration 5m

Each device runs in its own thread: an n×n matmul repeated for the whole duration (TFLOPS sampled per window,
timed around the matmuls only), every result compared with a reference computed once and sanity-checked in
float64 (silent data corruption shows up as mismatching elements), and a pattern test that writes and reads back
a buffer filling the rest of the chosen memory fraction. With nvidia-ml-py installed, temperature, power, SM
clock, throttle reasons and ECC / row-remapping counters are sampled too. A device is FAULTY on any mismatch or
memory error, or when its median TFLOPS is more than `tolerance` below the best device's. On a machine without
GPUs the same code runs on the CPU in float32 with small matrices.
"""

from __future__ import annotations

import re
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from smolctl.errors import UserError

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11, "fp32": 2.0**-24}
CPU_PATTERN_BYTES = 16 * 2**20  # CPU mode exercises the code path; it is not a RAM test (memtester is)
PATTERN_CHUNK = 2**24  # int32 words written/checked per kernel: bounds the scratch buffer to 64 MiB
PATTERN_SEEDS = (0x55555555, -0x55555556, 0, -1)  # 0x5555…, 0xAAAA…, all zeros, all ones: every bit both ways
HEADROOM_BYTES = 512 * 2**20  # left free for cuBLAS workspaces and the check's temporaries
THROTTLE_REASONS = {0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal",
                    0x80: "hw_power_brake"}


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


def build_config(*, duration: str, dtype: str | None, size: int | None, memory_fraction: float, tolerance: float,
                 devices: str) -> StressConfig:
    """Validate the flags; defaults follow the hardware: bf16 and 8192 on GPUs, fp32 and 512 on the CPU."""
    import torch

    seconds = parse_duration(duration)
    if not 0 < memory_fraction < 1:
        raise UserError("--memory-fraction", f"{memory_fraction} is outside (0, 1)", "use e.g. 0.9 for 90%")
    if not 0 <= tolerance < 1:
        raise UserError("--tolerance", f"{tolerance} is outside [0, 1)", "use e.g. 0.10 for 10% slower than the best")
    resolved = resolve_devices(devices, torch.cuda.device_count())
    on_gpu = resolved[0] != "cpu"
    name = dtype.lower() if dtype else ("bf16" if on_gpu else "fp32")
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise UserError("--dtype", f"unknown dtype {dtype!r}", f"choose from {', '.join(DTYPES)}")
    n = size or (8192 if on_gpu else 512)
    if not 16 <= n <= 65536:
        raise UserError("--size", f"{n} is not a sensible matrix size", "use 16..65536, e.g. 8192 on GPUs")
    return StressConfig(seconds, resolved, name, n, memory_fraction, tolerance,
                        sample_s=min(2.0, max(0.25, seconds / 30)))


def resolve_devices(spec: str, gpu_count: int) -> tuple[str, ...]:
    """'all' → every visible GPU (or the CPU when there is none); '0,3' → those GPUs; 'cpu' → the CPU."""
    spec = spec.strip().lower()
    if spec == "cpu" or (spec == "all" and gpu_count == 0):
        return ("cpu",)
    if spec == "all":
        return tuple(f"cuda:{i}" for i in range(gpu_count))
    indices = []
    for part in spec.split(","):
        part = part.strip().removeprefix("cuda:")
        if not part.isdigit() or int(part) >= gpu_count:
            raise UserError("--devices", f"no GPU {part!r} ({gpu_count} visible)",
                            "use all, cpu, or GPU indices like 0,1 (CUDA_VISIBLE_DEVICES numbering)")
        indices.append(int(part))
    return tuple(f"cuda:{i}" for i in dict.fromkeys(indices))


@dataclass
class DeviceReport:
    device: str
    name: str = ""
    tflops: list[float] = field(default_factory=list)
    matmuls: int = 0
    mismatches: int = 0
    """Result elements that differ from the reference (plus reference rows failing the float64 check)."""
    memory_errors: int = 0
    """int32 words the pattern test read back wrong, plus new uncorrectable ECC errors."""
    memory_tested_bytes: int = 0
    pattern_passes: int = 0
    telemetry: dict = field(default_factory=dict)
    error: str | None = None
    verdict: str = "OK"
    reasons: list[str] = field(default_factory=list)

    @property
    def tflops_min(self) -> float | None:
        return min(self.tflops) if self.tflops else None

    @property
    def tflops_median(self) -> float | None:
        return statistics.median(self.tflops) if self.tflops else None

    def to_dict(self) -> dict:
        return {**asdict(self), "tflops_min": self.tflops_min, "tflops_median": self.tflops_median}


def judge(reports: list[DeviceReport], tolerance: float) -> list[DeviceReport]:
    """Mark each device OK or FAULTY (in place, and return the list): any mismatch, memory or ECC error, a crash,
    or a median TFLOPS more than `tolerance` below the best device's (gpu-fryer's rule)."""
    timed = [r for r in reports if r.tflops_median]
    healthy = [r for r in timed if not (r.error or r.mismatches or r.memory_errors)]
    fastest = max(healthy or timed, key=lambda r: r.tflops_median, default=None)  # a broken device sets no bar
    best, best_device = (fastest.tflops_median, fastest.device) if fastest else (None, None)
    for report in reports:
        reasons = []
        if report.error:
            reasons.append(f"error: {report.error}")
        if report.mismatches:
            reasons.append(f"{report.mismatches} mismatching result element(s)")
        if report.memory_errors:
            reasons.append(f"{report.memory_errors} memory error(s)")
        if report.telemetry.get("remap_failure"):
            reasons.append("row remapping failed")
        if report.tflops_median is None:
            reasons.append("no matmul finished")
        elif best and report.tflops_median < (1 - tolerance) * best:
            reasons.append(f"{1 - report.tflops_median / best:.0%} slower than the best device ({best_device})")
        report.reasons, report.verdict = reasons, "FAULTY" if reasons else "OK"
    return reports


def run_stress(config: StressConfig, on_tick: Callable[[float, list[DeviceReport]], None] | None = None,
               stop: threading.Event | None = None) -> list[DeviceReport]:
    """Stress every device concurrently (so they heat up together, as in a real run) and judge them."""
    stop = stop or threading.Event()
    reports = [DeviceReport(device) for device in config.devices]
    workers = [DeviceStress(i, config, report, stop) for i, report in enumerate(reports)]
    threads = [threading.Thread(target=worker.run, name=f"stress-{worker.report.device}", daemon=True)
               for worker in workers]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    try:
        while any(thread.is_alive() for thread in threads):
            for thread in threads:
                thread.join(timeout=0.2)
            if on_tick:
                on_tick(time.monotonic() - began, reports)
    except KeyboardInterrupt:
        stop.set()
        raise
    return judge(reports, config.tolerance)


class DeviceStress:
    """One device's burn: setup, then windows of checked matmuls and periodic pattern passes until the deadline."""

    def __init__(self, index: int, config: StressConfig, report: DeviceReport, stop: threading.Event):
        self.index, self.config, self.report, self.stop = index, config, report, stop

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
        self.report.memory_errors += self.report.telemetry.get("ecc_uncorrected_new") or 0

    def _setup_matmul(self) -> None:
        torch, n = self.torch, self.config.size
        generator = torch.Generator(self.device).manual_seed(20250101)
        self.a = torch.randn(n, n, generator=generator, device=self.device).to(self.dtype)
        self.b = torch.randn(n, n, generator=generator, device=self.device).to(self.dtype)
        self.out = torch.empty(n, n, dtype=self.dtype, device=self.device)
        self.multiply()
        self.reference = self.out.clone()
        self.reference_rows_wrong = self._reference_rows_wrong(generator)
        self.report.mismatches = self.reference_rows_wrong
        # |result - reference| may reach one unit in the last place and no more (a floor keeps near-zero
        # elements from demanding exactness); deterministic kernels give bit-identical results anyway
        u = UNIT_ROUNDOFF[self.config.dtype]
        rms = self.reference.float().pow(2).mean().sqrt()
        self.bound = (self.reference.float().abs() * (2 * u) + 2 * u * rms).to(self.dtype)
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
        diff = self.out.sub_(self.reference).abs_()  # out is scratch: the next multiply overwrites it
        # counting the elements within bound (rather than those beyond) makes a NaN count as wrong
        self.wrong += self.out.numel() - self.torch.le(diff, self.bound).sum()

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
            errors += self.torch.ne(chunk, self._expected(k, self.scratch[:chunk.numel()], seed)).sum()
        return int(errors)


class NoTelemetry:
    """Stand-in when nvidia-ml-py is missing or the device is the CPU."""

    def sample(self) -> None:
        pass

    def close(self) -> dict:
        return {}


def open_telemetry(device) -> NoTelemetry:
    if device.type != "cuda":
        return NoTelemetry()
    try:
        import pynvml  # nvidia-ml-py, optional
        pynvml.nvmlInit()
    except Exception:
        return NoTelemetry()
    return NvmlTelemetry(pynvml, device)


class NvmlTelemetry(NoTelemetry):
    """Temperature, power, SM clock and throttle reasons per sample; ECC and row remapping before and after."""

    def __init__(self, nvml, device) -> None:
        import torch

        self.nvml = nvml
        try:
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            self.handle = nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        except Exception:  # older drivers / MIG: fall back to the index, right unless CUDA_VISIBLE_DEVICES reorders
            self.handle = nvml.nvmlDeviceGetHandleByIndex(device.index)
        self.temps, self.powers, self.clocks, self.reasons = [], [], [], 0
        self.ecc_before = self._read(nvml.nvmlDeviceGetTotalEccErrors, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                     nvml.NVML_VOLATILE_ECC)

    def _read(self, getter, *args):
        try:
            return getter(self.handle, *args)
        except Exception:  # a counter this GPU or driver does not have
            return None

    def sample(self) -> None:
        nvml = self.nvml
        for values, value in ((self.temps, self._read(nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU)),
                              (self.powers, self._read(nvml.nvmlDeviceGetPowerUsage)),
                              (self.clocks, self._read(nvml.nvmlDeviceGetClockInfo, nvml.NVML_CLOCK_SM))):
            if value is not None:
                values.append(value)
        reasons_getter = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        self.reasons |= self._read(reasons_getter) or 0

    def close(self) -> dict:
        ecc_after = self._read(self.nvml.nvmlDeviceGetTotalEccErrors, self.nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                               self.nvml.NVML_VOLATILE_ECC)
        remap = self._read(self.nvml.nvmlDeviceGetRemappedRows)  # (corrected, uncorrected, pending, failure)
        return {
            "max_temp_c": max(self.temps, default=None), "max_power_w": max(self.powers, default=0) / 1e3 or None,
            "min_sm_clock_mhz": min(self.clocks, default=None),
            "throttle": [name for bit, name in THROTTLE_REASONS.items() if self.reasons & bit],
            "ecc_uncorrected_new": None if ecc_after is None or self.ecc_before is None
            else ecc_after - self.ecc_before,
            "remap_pending": bool(remap[2]) if remap else None, "remap_failure": bool(remap[3]) if remap else None,
        }

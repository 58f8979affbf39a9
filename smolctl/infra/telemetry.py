"""GPU health for stress-gpu, read from NVML (nvidia-ml-py), and what the node says about its GPUs.

    telemetry = open_telemetry(torch.device("cuda:0"))
    ... telemetry.sample() once per window ...
    faults, warnings = health_findings(telemetry.close())

Per sample: temperature, power, SM clock, clock-event (throttle) reasons, the PCIe link's generation and width,
and Xid events (an NVML event set registered before the burn, so only errors of this run count). Before and after
the run: uncorrectable ECC errors and the row remapper's pending / failed flags.
"""

from __future__ import annotations

import os
import shutil
import subprocess

# Clock-event reason bits (nvml.h nvmlClocksEventReason*). Hardware slowdown, hardware thermal slowdown and the
# power brake mean the board or its cooling is failing; software thermal slowdown means the GPU ran hotter than
# its operating limit under load (cooling again). The software power cap is the driver holding the configured
# power limit, which a full-load matmul may legitimately reach: a warning only.
THROTTLE_FAULTS = {0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake"}
THROTTLE_WARNINGS = {0x4: "sw_power_cap"}
XID_EVENT = 0x8  # nvmlEventTypeXidCriticalError


class NoTelemetry:
    """The CPU: nothing to read."""

    def sample(self) -> None:
        pass

    def close(self) -> dict:
        return {}


class MissingTelemetry(NoTelemetry):
    """A GPU whose NVML could not be opened: the verdict must say what went unchecked."""

    def __init__(self, why: str) -> None:
        self.why = why

    def close(self) -> dict:
        return {"missing": self.why}


def open_telemetry(device, nvml=None) -> NoTelemetry:
    """NVML telemetry for a torch CUDA device (matched by UUID, so CUDA_VISIBLE_DEVICES reordering is harmless)."""
    if device.type != "cuda":
        return NoTelemetry()
    try:
        if nvml is None:
            import pynvml as nvml  # nvidia-ml-py
        nvml.nvmlInit()
    except Exception as exc:  # the package, libnvidia-ml.so or the driver behind it
        return MissingTelemetry(f"NVML unavailable ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
    import torch

    try:
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:  # older drivers / MIG: the index, right unless CUDA_VISIBLE_DEVICES reorders
        handle = nvml.nvmlDeviceGetHandleByIndex(device.index)
    return NvmlTelemetry(nvml, handle)


class NvmlTelemetry(NoTelemetry):
    def __init__(self, nvml, handle) -> None:
        self.nvml, self.handle = nvml, handle
        self.temps: list[int] = []
        self.powers: list[int] = []
        self.clocks: list[int] = []
        self.link: tuple[int, int] | None = None  # the best (generation, width) seen while under load
        self.reasons = 0
        self.xids: list[int] = []
        self.ecc_before = self._ecc()
        self.events = self._register_xid_events()

    def _read(self, name: str, *args):
        getter = getattr(self.nvml, name, None)
        if getter is None:
            return None
        try:
            return getter(self.handle, *args)
        except Exception:  # a counter this GPU or driver does not have
            return None

    def _ecc(self):
        return self._read("nvmlDeviceGetTotalEccErrors", 1, 0)  # uncorrected, volatile (since the driver loaded)

    def _register_xid_events(self):
        try:
            events = self.nvml.nvmlEventSetCreate()
            self.nvml.nvmlDeviceRegisterEvents(self.handle, XID_EVENT, events)
            return events
        except Exception:  # not supported on this GPU / in this container: Xid goes unchecked, and says so
            return None

    def _drain_xid_events(self) -> None:
        while self.events is not None:
            try:
                event = self.nvml.nvmlEventSetWait(self.events, 0)
            except Exception:  # NVMLError_Timeout: nothing pending
                return
            if event.eventType & XID_EVENT:
                self.xids.append(int(event.eventData))

    def sample(self) -> None:
        for values, value in (
            (self.temps, self._read("nvmlDeviceGetTemperature", 0)),  # NVML_TEMPERATURE_GPU
            (self.powers, self._read("nvmlDeviceGetPowerUsage")),
            (self.clocks, self._read("nvmlDeviceGetClockInfo", 1)),
        ):  # NVML_CLOCK_SM
            if value is not None:
                values.append(value)
        reasons = self._read("nvmlDeviceGetCurrentClocksEventReasons")
        if reasons is None:
            reasons = self._read("nvmlDeviceGetCurrentClocksThrottleReasons")
        self.reasons |= reasons or 0
        # PCIe links drop to a lower generation when idle; under load the link runs at its best, so keep the best
        generation, width = (
            self._read("nvmlDeviceGetCurrPcieLinkGeneration"),
            self._read("nvmlDeviceGetCurrPcieLinkWidth"),
        )
        if generation is not None and width is not None:
            self.link = max(self.link or (0, 0), (generation, width))
        self._drain_xid_events()

    def close(self) -> dict:
        self._drain_xid_events()
        ecc_after = self._ecc()
        remap = self._read("nvmlDeviceGetRemappedRows")  # (corrected, uncorrected, pending, failure)
        most = (self._read("nvmlDeviceGetMaxPcieLinkGeneration"), self._read("nvmlDeviceGetMaxPcieLinkWidth"))
        if self.events is not None:
            try:
                self.nvml.nvmlEventSetFree(self.events)
            except Exception:
                pass
        return {
            "max_temp_c": max(self.temps, default=None),
            "max_power_w": max(self.powers, default=0) / 1e3 or None,
            "min_sm_clock_mhz": min(self.clocks, default=None),
            "throttle": [name for bit, name in {**THROTTLE_FAULTS, **THROTTLE_WARNINGS}.items() if self.reasons & bit],
            "ecc_uncorrected_new": None
            if ecc_after is None or self.ecc_before is None
            else ecc_after - self.ecc_before,
            "remap_pending": bool(remap[2]) if remap else None,
            "remap_failure": bool(remap[3]) if remap else None,
            "xid": sorted(set(self.xids)) if self.events is not None else None,
            "pcie": None
            if self.link is None or None in most
            else {"generation": self.link[0], "width": self.link[1], "max_generation": most[0], "max_width": most[1]},
        }


def health_findings(telemetry: dict) -> tuple[list[str], list[str]]:
    """(faults, warnings) in what one device's telemetry says; an empty dict (the CPU) says nothing."""
    faults, warnings = [], []
    if "missing" in telemetry:
        return [], [
            f"telemetry missing: {telemetry['missing']}; throttling, ECC, row remapping, Xid and PCIe were not checked"
        ]
    throttled = set(telemetry.get("throttle") or [])
    if hard := [name for name in THROTTLE_FAULTS.values() if name in throttled]:
        faults.append(f"throttled by {', '.join(hard)}")
    if soft := [name for name in THROTTLE_WARNINGS.values() if name in throttled]:
        warnings.append(f"held at its power limit ({', '.join(soft)})")
    if telemetry.get("remap_pending"):
        faults.append("row remapping pending (reset the GPU to apply it before using the node)")
    if telemetry.get("remap_failure"):
        faults.append("row remapping failed")
    if telemetry.get("ecc_uncorrected_new"):
        faults.append(f"{telemetry['ecc_uncorrected_new']} new uncorrectable ECC error(s)")
    if telemetry.get("xid"):
        faults.append(f"Xid error(s) during the run: {', '.join(map(str, telemetry['xid']))}")
    elif telemetry and telemetry.get("xid") is None:
        warnings.append("Xid events not available from NVML here")
    pcie = telemetry.get("pcie")
    if pcie and (pcie["generation"] < pcie["max_generation"] or pcie["width"] < pcie["max_width"]):
        faults.append(
            f"PCIe link gen{pcie['generation']} x{pcie['width']}, below its maximum "
            f"gen{pcie['max_generation']} x{pcie['max_width']}"
        )
    return faults, warnings


def nvidia_smi_gpus() -> int | None:
    """GPUs the driver lists (`nvidia-smi -L`), or None without nvidia-smi or when it fails. Under
    CUDA_VISIBLE_DEVICES (Slurm's GPU binding) the job owns only those, so their count is what to expect."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() and not visible.strip().startswith("-"):
        return len([part for part in visible.split(",") if part.strip()])
    listing = _nvidia_smi_listing()
    return None if listing is None or listing[0] else sum(line.startswith("GPU ") for line in listing[1].splitlines())


def _nvidia_smi_listing() -> tuple[int, str] | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 1, str(exc)
    return done.returncode, (done.stdout + done.stderr).strip()


def why_no_gpu() -> str:
    """Why torch sees no GPU, as far as torch, the environment and the driver (nvidia-smi) say."""
    import torch

    reasons = []
    if torch.version.cuda is None:
        reasons.append(f"this torch is a CPU-only build ({torch.__version__})")
    else:
        try:
            torch.cuda.init()
        except Exception as exc:
            reasons.append(f"CUDA failed to initialise: {str(exc).splitlines()[0][:160]}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        reasons.append(f"CUDA_VISIBLE_DEVICES={visible!r}")
    listing = _nvidia_smi_listing()
    if listing is None:
        reasons.append("nvidia-smi is not on PATH (no NVIDIA driver installed?)")
    elif listing[0]:
        reasons.append(f"nvidia-smi fails: {listing[1].splitlines()[0][:160] if listing[1] else 'no output'}")
    else:
        count = sum(line.startswith("GPU ") for line in listing[1].splitlines())
        reasons.append(f"nvidia-smi lists {count} GPU(s)")
    return "; ".join(reasons)

"""What a run shows and records: a live line (step, loss, lr, grad norm, tokens/s, data-wait share, MFU or
FLOP/s, ETA), RUN/metrics.jsonl every `logging.interval` steps, RUN/events.jsonl for every guard event, and the
trackers of `logging.report_to` (smolctl/train/trackers.py). Only rank 0 monitors; the other ranks get a silent
one (a null object). `smolctl report RUN` reads what is written here.

Each metrics line holds the playbook's numbers: loss, lr, grad_norm, tokens_per_s, MFU (GPU) or FLOP/s (CPU),
data_wait (share of step time spent waiting for the batch), memory (peak reserved over device total on GPU, peak
RSS on CPU), comm_share (time collectives were in flight over the step's time, measured on one step under
torch.profiler every `logging.profile_interval` steps when there is more than one process), checkpoint_s
(seconds the loop was blocked saving since the last line), and the running counts of skipped updates, spikes and
rollbacks.

MFU uses the FLOPs-per-token formula of `smolctl estimate` (smolctl/infra/flops.py) against the dense bf16 peak
of the GPU model; on CPU there is no meaningful peak, so the achieved FLOP/s is shown instead.
"""

from __future__ import annotations

import json
import math
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from smolctl.console import escape, human_count, human_duration, progress
from smolctl.train.run import drop_lines_after
from smolctl.train.trackers import NoTracker, Tracker

# Dense bf16 tensor-core peak per device (vendor datasheets, no sparsity), matched against the device name.
PEAK_BF16_FLOPS = [
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H200", 989e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("GH200", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
]


def peak_flops(device: str, precision: str) -> float | None:
    """Per-device peak for MFU, or None (CPU, fp32, or an unknown GPU: then only FLOP/s is reported)."""
    if not device.startswith("cuda") or precision != "bf16":
        return None
    import torch

    name = torch.cuda.get_device_name(torch.device(device))
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name), None)


def flops_text(flops_per_s: float) -> str:
    return f"{flops_per_s / 1e12:.1f} TFLOP/s" if flops_per_s >= 1e12 else f"{flops_per_s / 1e9:.1f} GFLOP/s"


# Profiler events that are collectives: NCCL kernels on the GPU, gloo work on CPU threads, the c10d ops around them.
_COLLECTIVE_MARKERS = ("nccl", "gloo:", "c10d::")


def collective_seconds(events, on_gpu: bool) -> float:
    """Seconds during which at least one collective was in flight (overlapping and nested events counted once).
    On GPU only the NCCL kernels count: the CPU-side c10d events there are launches, not transfers."""
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if any(m in e.name.lower() for m in (("nccl",) if on_gpu else _COLLECTIVE_MARKERS))
        and (not on_gpu or e.device_type.name == "CUDA")
    )
    covered, reach = 0.0, -math.inf
    for start, end in spans:  # union of intervals, microseconds
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered / 1e6


def memory_use(device: str) -> dict:
    """GPU: peak reserved bytes and their share of the device; CPU: the process's peak resident set size."""
    import torch

    if device.startswith("cuda"):
        index = torch.device(device)
        peak = torch.cuda.max_memory_reserved(index)
        return {"memory_peak_bytes": peak, "memory_share": peak / torch.cuda.get_device_properties(index).total_memory}
    return {"memory_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux reports KiB


class Monitor:
    def __init__(
        self,
        run_dir: Path,
        *,
        title: str,
        enabled: bool,
        total_steps: int,
        start_step: int,
        flops_per_token: float,
        peak: float | None,
        world_size: int,
        interval: int,
        show: bool,
        device: str = "cpu",
        profile_interval: int = 0,
        tracker: Tracker | None = None,
    ):
        self.enabled, self.title, self.device = enabled, title, device
        self.total_steps, self.start_step = total_steps, start_step
        self.flops_per_token, self.peak, self.world_size = flops_per_token, peak, world_size
        self.interval = interval
        # Collectives exist only with more than one process; every rank profiles the same steps (they wait on each
        # other).
        self.profile_interval = profile_interval if world_size > 1 else 0
        self.tracker = tracker if tracker is not None else NoTracker()
        self.show = show and enabled
        self.metrics_path = Path(run_dir) / "metrics.jsonl"
        self.events_path = Path(run_dir) / "events.jsonl"
        self.events: list[dict] = []
        self.history: list[dict] = []
        self._window = _empty_window()
        self._totals = _empty_window()
        self._comm_share: float | None = None  # the latest profiled step's, reported once on the next line
        self._started = time.perf_counter()
        if enabled:
            drop_lines_after(self.metrics_path, start_step)
            drop_lines_after(self.events_path, start_step)
            self.events_path.touch()  # present even when no guard fired: "no events" is a result too

    def __enter__(self) -> Monitor:
        self._progress_cm = progress(self.show)
        self._bar = self._progress_cm.__enter__()
        self._task = self._bar.add_task(self.title, total=self.total_steps, completed=self.start_step, rate="")
        return self

    def __exit__(self, *exc) -> None:
        self._progress_cm.__exit__(*exc)
        self.tracker.close()

    @contextmanager
    def profiled(self, step: int) -> Iterator[None]:
        """Around one training step: every `profile_interval` steps it runs under torch.profiler, and the share of
        its time spent in collectives goes on the next metrics line."""
        if not self.profile_interval or step % self.profile_interval:
            yield
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        on_gpu = self.device.startswith("cuda")
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])) as prof:
            started = time.perf_counter()
            yield
            if on_gpu:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - started
        self._comm_share = min(1.0, collective_seconds(prof.events(), on_gpu) / max(seconds, 1e-9))

    def checkpoint_held(self, seconds: float) -> None:
        """Seconds an asynchronous save held the loop after `checkpointing()` returned (its copy of the state
        finishing before the next optimizer step): checkpoint time, not another checkpoint."""
        for bucket in (self._window, self._totals):
            bucket["checkpoint"] += seconds

    @contextmanager
    def checkpointing(self) -> Iterator[None]:
        """Around a blocking checkpoint save: its seconds go on the next metrics line (the playbook's budget is
        under 5 minutes per 1,000 steps)."""
        started = time.perf_counter()
        yield
        for bucket in (self._window, self._totals):
            bucket["checkpoint"] += time.perf_counter() - started
            bucket["checkpoints"] += 1

    def step(
        self,
        step: int,
        *,
        loss: float,
        lr: float,
        grad_norm: float,
        tokens: int,
        data_s: float,
        compute_s: float,
        guards: dict | None = None,
    ) -> None:
        """`guards`: the running counts of skipped updates, spikes and rollbacks, written with each line."""
        for bucket in (self._window, self._totals):
            bucket["tokens"] += tokens
            bucket["data"] += data_s
            bucket["compute"] += compute_s
            bucket["steps"] += 1
        if not self.enabled:
            return
        self._bar.update(self._task, completed=step)
        if step % self.interval and step != self.total_steps:
            return
        seconds = max(1e-9, self._window["data"] + self._window["compute"])
        tokens_per_s = self._window["tokens"] / seconds
        record = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s,
            "data_wait": self._window["data"] / seconds,
            "step_s": seconds / self._window["steps"],
            "flops_per_s": tokens_per_s * self.flops_per_token,
            "mfu": self._mfu(tokens_per_s),
            **memory_use(self.device),
            "checkpoint_s": self._window["checkpoint"],
            "checkpoint_share": self._totals["checkpoint"] / max(1e-9, time.perf_counter() - self._started),
            **(guards or {}),
            "time": time.time(),
        }
        if self._comm_share is not None:
            record["comm_share"], self._comm_share = self._comm_share, None
        self.history.append(record)
        _append_jsonl(self.metrics_path, record)
        self.tracker.log(
            {f"train/{k}": v for k, v in record.items() if k not in ("step", "time") and v is not None}, step
        )
        self._bar.update(self._task, rate=f"loss {loss:.4f}")
        self._bar.console.print(self._line(record))
        self._window = _empty_window()

    def _mfu(self, tokens_per_s: float) -> float | None:
        return tokens_per_s * self.flops_per_token / (self.peak * self.world_size) if self.peak else None

    def _line(self, r: dict) -> str:
        speed = f"MFU {r['mfu']:.1%}" if r["mfu"] is not None else flops_text(r["flops_per_s"])
        remaining = (self.total_steps - r["step"]) * self._seconds_per_step()
        return (
            f"step {r['step']:>{len(str(self.total_steps))}}/{self.total_steps} │ loss {r['loss']:.4f} │ "
            f"lr {r['lr']:.2e} │ gnorm {r['grad_norm']:.2f} │ {human_count(r['tokens_per_s'])} tok/s │ "
            f"data {r['data_wait']:.1%} │ {speed} │ eta {human_duration(remaining)}"
        )

    def _seconds_per_step(self) -> float:
        return (self._totals["data"] + self._totals["compute"]) / max(1, self._totals["steps"])

    def validation(self, step: int, loss: float) -> None:
        if self.enabled:
            record = {"step": step, "val_loss": loss, "time": time.time()}
            self.history.append(record)
            _append_jsonl(self.metrics_path, record)
            self._bar.console.print(f"step {step}: validation loss {loss:.4f}")
            self.tracker.log({"val/loss": loss}, step)

    def rewind(self, step: int) -> None:
        """After a rollback the steps past `step` run again: their metrics lines go (events stay: they are the
        record)."""
        if self.enabled:
            drop_lines_after(self.metrics_path, step)
            self._bar.update(self._task, completed=step)

    def event(self, record: dict) -> None:
        self.events.append(record)
        if self.enabled:
            _append_jsonl(self.events_path, {**record, "time": time.time()})
            self._bar.console.print(
                f"[yellow]{escape(str(record['event']))}[/] at step {record.get('step')}: "
                + escape(", ".join(f"{k}={v}" for k, v in record.items() if k not in ("event", "step")))
            )

    def note(self, message: str) -> None:
        if self.enabled:
            self._bar.console.print(message, markup=False)

    def totals(self) -> dict:
        seconds = max(1e-9, self._totals["data"] + self._totals["compute"])
        tokens_per_s = self._totals["tokens"] / seconds
        wall = time.perf_counter() - self._started
        held, saves, steps = self._totals["checkpoint"], self._totals["checkpoints"], self._totals["steps"]
        return {
            "steps_run": steps,
            "tokens_run": self._totals["tokens"],
            "train_seconds": seconds,
            "wall_seconds": wall,
            "tokens_per_s": tokens_per_s,
            "flops_per_s": tokens_per_s * self.flops_per_token,
            "mfu": self._mfu(tokens_per_s),
            "data_wait": self._totals["data"] / seconds,
            **checkpoint_cost(held, saves, steps, wall),
        }


CHECKPOINT_BUDGET_S_PER_1000_STEPS = 300.0  # the seed's yardstick: under 5 minutes of checkpointing per 1,000 steps


def checkpoint_cost(held_s: float, saves: int, steps: int, wall_s: float) -> dict:
    """Seconds the loop was held by checkpoints: in all, per save, per 1,000 steps and as a share of wall time."""
    return {
        "checkpoints_saved": saves,
        "checkpoint_seconds": held_s,
        "checkpoint_s_each": held_s / saves if saves else 0.0,
        "checkpoint_s_per_1000_steps": 1000 * held_s / steps if steps else 0.0,
        "checkpoint_share": held_s / wall_s if wall_s > 0 else 0.0,
    }


def idle_totals() -> dict:
    """The totals of a command that ran no step (a finished run resumed)."""
    return {
        "steps_run": 0,
        "tokens_run": 0,
        "train_seconds": 0.0,
        "wall_seconds": 0.0,
        "tokens_per_s": 0.0,
        "flops_per_s": 0.0,
        "mfu": None,
        "data_wait": 0.0,
        **checkpoint_cost(0.0, 0, 0, 0.0),
    }


def _empty_window() -> dict:
    return {"tokens": 0, "data": 0.0, "compute": 0.0, "checkpoint": 0.0, "checkpoints": 0, "steps": 0}


def _append_jsonl(path: Path, record: dict) -> None:
    # NaN / inf are not JSON (jq and most readers reject them): written as strings
    clean = {k: str(v) if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    with open(path, "a") as handle:
        handle.write(json.dumps(clean) + "\n")

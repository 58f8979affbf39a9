"""What a run shows and records: a live line (step, loss, lr, grad norm, tokens/s, data-wait share, MFU or
FLOP/s, ETA), RUN/metrics.jsonl every `logging.interval` steps, RUN/events.jsonl for every guard event, and
TensorBoard scalars when asked. Only rank 0 monitors; the other ranks get a silent one (a null object).

MFU uses the FLOPs-per-token formula of `smolctl estimate` (smolctl/infra/flops.py) against the dense bf16 peak
of the GPU model; on CPU there is no meaningful peak, so the achieved FLOP/s is shown instead.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from smolctl.console import human_count, human_duration, progress
from smolctl.errors import UserError

# Dense bf16 tensor-core peak per device (vendor datasheets, no sparsity), matched against the device name.
PEAK_BF16_FLOPS = [
    ("GB200", 2.5e15), ("B200", 2.25e15), ("H200", 989e12), ("H100", 989e12), ("H800", 989e12), ("GH200", 989e12),
    ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12), ("L40", 181e12), ("L4", 121e12), ("A10G", 70e12),
    ("A10", 125e12), ("RTX 4090", 165e12), ("RTX 3090", 71e12), ("MI300X", 1307e12), ("MI250X", 383e12),
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


def check_tensorboard() -> None:
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError as exc:
        raise UserError("logging.tensorboard", "is true but the tensorboard package is not installed",
                        "pip install tensorboard, or set logging.tensorboard = false (metrics.jsonl is always written)") from exc


class Monitor:
    def __init__(self, run_dir: Path, *, title: str, enabled: bool, total_steps: int, start_step: int, flops_per_token: float,
                 peak: float | None, world_size: int, interval: int, tensorboard: bool, show: bool):
        self.enabled, self.title = enabled, title
        self.total_steps, self.start_step = total_steps, start_step
        self.flops_per_token, self.peak, self.world_size = flops_per_token, peak, world_size
        self.interval = interval
        self.show = show and enabled
        self.metrics_path = Path(run_dir) / "metrics.jsonl"
        self.events_path = Path(run_dir) / "events.jsonl"
        self.events: list[dict] = []
        self.history: list[dict] = []
        self._window = _empty_bucket()
        self._totals = _empty_bucket()
        self._started = time.perf_counter()
        self._tensorboard = None
        if enabled:
            _drop_lines_after(self.metrics_path, start_step)
            _drop_lines_after(self.events_path, start_step)
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._tensorboard = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def __enter__(self) -> "Monitor":
        self._progress_cm = progress(self.show)
        self._bar = self._progress_cm.__enter__()
        self._task = self._bar.add_task(self.title, total=self.total_steps, completed=self.start_step, rate="")
        return self

    def __exit__(self, *exc) -> None:
        self._progress_cm.__exit__(*exc)
        if self._tensorboard is not None:
            self._tensorboard.close()

    def step(self, step: int, *, loss: float, lr: float, grad_norm: float, tokens: int, data_s: float, compute_s: float,
             checkpoint_s: float | None = None) -> None:
        """`checkpoint_s`: the seconds this step's checkpoint held the loop (None: no checkpoint at this step)."""
        for bucket in (self._window, self._totals):
            bucket["tokens"] += tokens
            bucket["data"] += data_s
            bucket["compute"] += compute_s
            bucket["steps"] += 1
            if checkpoint_s is not None:
                bucket["checkpoint"] += checkpoint_s
                bucket["checkpoints"] += 1
        if not self.enabled:
            return
        self._bar.update(self._task, completed=step)
        if step % self.interval and step != self.total_steps:
            return
        seconds = max(1e-9, self._window["data"] + self._window["compute"])
        tokens_per_s = self._window["tokens"] / seconds
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
                  "data_wait": self._window["data"] / seconds, "step_s": seconds / self._window["steps"], "flops_per_s": tokens_per_s * self.flops_per_token,
                  "mfu": self._mfu(tokens_per_s), "checkpoint_s": self._window["checkpoint"],
                  "checkpoint_share": self._totals["checkpoint"] / max(1e-9, time.perf_counter() - self._started), "time": time.time()}
        self.history.append(record)
        _append_jsonl(self.metrics_path, record)
        if self._tensorboard is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu"):
                if record[key] is not None:
                    self._tensorboard.add_scalar(f"train/{key}", record[key], step)
        self._bar.update(self._task, rate=f"loss {loss:.4f}")
        self._bar.console.print(self._line(record))
        self._window = _empty_bucket()

    def _mfu(self, tokens_per_s: float) -> float | None:
        return tokens_per_s * self.flops_per_token / (self.peak * self.world_size) if self.peak else None

    def _line(self, r: dict) -> str:
        speed = f"MFU {r['mfu']:.1%}" if r["mfu"] is not None else flops_text(r["flops_per_s"])
        remaining = (self.total_steps - r["step"]) * self._seconds_per_step()
        return (f"step {r['step']:>{len(str(self.total_steps))}}/{self.total_steps} │ loss {r['loss']:.4f} │ lr {r['lr']:.2e} │ "
                f"gnorm {r['grad_norm']:.2f} │ {human_count(r['tokens_per_s'])} tok/s │ data {r['data_wait']:.1%} │ {speed} │ "
                f"eta {human_duration(remaining)}")

    def _seconds_per_step(self) -> float:
        return (self._totals["data"] + self._totals["compute"]) / max(1, self._totals["steps"])

    def validation(self, step: int, loss: float) -> None:
        if self.enabled:
            record = {"step": step, "val_loss": loss, "time": time.time()}
            self.history.append(record)
            _append_jsonl(self.metrics_path, record)
            self._bar.console.print(f"step {step}: validation loss {loss:.4f}")
            if self._tensorboard is not None:
                self._tensorboard.add_scalar("val/loss", loss, step)

    def rewind(self, step: int) -> None:
        """After a rollback the steps past `step` run again: their metrics lines go (events stay: they are the record)."""
        if self.enabled:
            _drop_lines_after(self.metrics_path, step)
            self._bar.update(self._task, completed=step)

    def event(self, record: dict) -> None:
        self.events.append(record)
        if self.enabled:
            _append_jsonl(self.events_path, {**record, "time": time.time()})
            self._bar.console.print(f"[yellow]{record['event']}[/] at step {record.get('step')}: "
                                    + ", ".join(f"{k}={v}" for k, v in record.items() if k not in ("event", "step")))

    def note(self, message: str) -> None:
        if self.enabled:
            self._bar.console.print(message)

    def totals(self) -> dict:
        seconds = max(1e-9, self._totals["data"] + self._totals["compute"])
        tokens_per_s = self._totals["tokens"] / seconds
        wall = time.perf_counter() - self._started
        held, saves, steps = self._totals["checkpoint"], self._totals["checkpoints"], self._totals["steps"]
        return {"steps_run": steps, "tokens_run": self._totals["tokens"],
                "train_seconds": seconds, "wall_seconds": wall,
                "tokens_per_s": tokens_per_s, "flops_per_s": tokens_per_s * self.flops_per_token,
                "mfu": self._mfu(tokens_per_s), "data_wait": self._totals["data"] / seconds,
                **checkpoint_cost(held, saves, steps, wall)}


def _empty_bucket() -> dict:
    return {"tokens": 0, "data": 0.0, "compute": 0.0, "steps": 0, "checkpoint": 0.0, "checkpoints": 0}


CHECKPOINT_BUDGET_S_PER_1000_STEPS = 300.0  # the seed's yardstick: under 5 minutes of checkpointing per 1,000 steps


def checkpoint_cost(held_s: float, saves: int, steps: int, wall_s: float) -> dict:
    """Seconds the loop was held by checkpoints: in all, per save, per 1,000 steps and as a share of wall time."""
    return {"checkpoints_saved": saves, "checkpoint_seconds": held_s, "checkpoint_s_each": held_s / saves if saves else 0.0,
            "checkpoint_s_per_1000_steps": 1000 * held_s / steps if steps else 0.0,
            "checkpoint_share": held_s / wall_s if wall_s > 0 else 0.0}


def idle_totals() -> dict:
    """The totals of a command that ran no step (a finished run resumed)."""
    return {"steps_run": 0, "tokens_run": 0, "train_seconds": 0.0, "wall_seconds": 0.0, "tokens_per_s": 0.0,
            "flops_per_s": 0.0, "mfu": None, "data_wait": 0.0, **checkpoint_cost(0.0, 0, 0, 0.0)}


def _append_jsonl(path: Path, record: dict) -> None:
    # NaN / inf are not JSON (jq and most readers reject them): written as strings
    clean = {k: str(v) if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    with open(path, "a") as handle:
        handle.write(json.dumps(clean) + "\n")


def _drop_lines_after(path: Path, step: int) -> None:
    """On resume, forget what was logged after the checkpoint: those steps are about to be run again (a fresh
    start is step 0, so a run killed before its first checkpoint leaves nothing behind)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in kept))

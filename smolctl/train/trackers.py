"""Experiment trackers beside RUN/metrics.jsonl (which is always written): TensorBoard, Weights & Biases and
Trackio, chosen by `logging.report_to` and offline by default, so a run on a cluster without network still records.

    smolctl pretrain recipes/smollm3-tiny.toml runs/tiny --set 'logging.report_to=["tensorboard", "trackio"]'
    tensorboard --logdir runs/tiny/tensorboard
    trackio show --project smolctl
    wandb sync runs/tiny/wandb/offline-run-*

Where each one writes: TensorBoard event files in RUN/tensorboard; wandb an offline run in RUN/wandb (WANDB_MODE
defaults to offline; set WANDB_MODE=online to stream); Trackio its local store (TRACKIO_DIR, by default
~/.cache/huggingface/trackio), project "smolctl", one run per run folder, named after it.

Two entry points, so every training command reports the same way: `open_tracker` for smolctl's own loops
(pretrain, midtrain, ppo) and `trainer_reporting` for the TRL-based stages, which take the same list through the
Trainer's `report_to`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from contextlib import redirect_stdout
from pathlib import Path
from typing import Protocol

from smolctl.errors import UserError

TRACKERS = ("tensorboard", "wandb", "trackio")
PROJECT = "smolctl"
TENSORBOARD_DIR = "tensorboard"


class Tracker(Protocol):
    def log(self, metrics: dict, step: int) -> None: ...
    def close(self) -> None: ...


class NoTracker:
    """The tracker of a run that asked for none, and of every rank but 0: calls cost nothing."""

    def log(self, metrics: dict, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def require_trackers(report_to: Sequence[str]) -> None:
    """Every asked-for tracker must be installed: checked before any compute, one line naming the extra."""
    for name in report_to:
        if importlib.util.find_spec(name) is None:
            raise UserError(
                "logging.report_to",
                f"asks for {name} but the {name} package is not installed",
                f"pip install 'smolctl[{name}]', or drop it from logging.report_to (metrics.jsonl is always written)",
            )


def offline_environment(run_dir: Path) -> None:
    """Where the trackers write and that they stay offline; a value the user already set wins."""
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_DIR", str(run_dir))
    os.environ.setdefault("WANDB_PROJECT", PROJECT)
    os.environ.setdefault("TENSORBOARD_LOGGING_DIR", str(run_dir / TENSORBOARD_DIR))
    # trackio syncs to a Space only when one is named; nothing here names one.


def open_tracker(
    run_dir: Path, report_to: Sequence[str], *, enabled: bool = True, resuming: bool = False, config: dict | None = None
) -> Tracker:
    """One tracker fanning out to each of `report_to` (rank 0 only: pass enabled=False elsewhere). A resumed run
    continues its tracker run; a fresh start (or --overwrite) opens a new one."""
    if not enabled or not report_to:
        return NoTracker()
    require_trackers(report_to)
    offline_environment(run_dir)
    opened = {"tensorboard": _TensorBoard, "wandb": _Wandb, "trackio": _Trackio}
    return _Fanout([opened[name](run_dir, config or {}, resuming) for name in report_to])


def trainer_reporting(run_dir: Path, report_to: Sequence[str]) -> dict:
    """TrainingArguments for the TRL stages: the same trackers, the same places, offline."""
    if not report_to:
        return {"report_to": "none"}
    require_trackers(report_to)
    offline_environment(run_dir)
    # trackio_static_space_id=False: never create a Space after training (transformers would try on the Hub).
    return {
        "report_to": list(report_to),
        "run_name": run_dir.name,
        "project": PROJECT,
        "trackio_static_space_id": False,
    }


class _Fanout:
    def __init__(self, trackers: list):
        self.trackers = trackers

    def log(self, metrics: dict, step: int) -> None:
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for tracker in self.trackers:
            tracker.log(scalars, step)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


class _TensorBoard:
    def __init__(self, run_dir: Path, config: dict, resuming: bool):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / TENSORBOARD_DIR))

    def log(self, metrics: dict, step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a crashed or killed run keeps what it logged

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, run_dir: Path, config: dict, resuming: bool):
        import wandb

        # An id derived from the folder: a resumed run continues the same wandb run.
        self.run = wandb.init(
            project=os.environ["WANDB_PROJECT"],
            name=run_dir.name,
            dir=os.environ["WANDB_DIR"],
            id=_run_id(run_dir) if resuming else None,
            resume="allow" if resuming else None,
            config=config,
        )

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class _Trackio:
    def __init__(self, run_dir: Path, config: dict, resuming: bool):
        import trackio

        with redirect_stdout(sys.stderr):  # trackio prints its banner; stdout belongs to --json
            self.run = trackio.init(
                project=PROJECT,
                name=run_dir.name,
                config=config,
                embed=False,
                resume="allow" if resuming else "never",
                auto_log_gpu=False,
                auto_log_cpu=False,
            )
        self.finish = trackio.finish

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        with redirect_stdout(sys.stderr):
            self.finish()


def _run_id(run_dir: Path) -> str:
    """A stable id per run folder (wandb ids allow letters, digits, - and _)."""
    return f"{run_dir.name[:40]}-{hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:8]}".replace("/", "-")

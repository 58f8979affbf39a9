"""Guards against the failures that ruin long runs: non-finite losses or gradients, and loss spikes.

A non-finite loss or gradient norm skips the update. A loss far above the recent median (robust z-score over a
window, so one earlier spike does not hide the next) is a spike: the update is kept and the event logged. After
`max_bad_steps` consecutive bad steps one of two things happens:
  - the bad losses are finite and agree with each other (their spread is within the window's own noise): the loss
    has moved to a new level (a data stage switch, say). The window re-baselines to it; nothing is rolled back.
  - otherwise it is an incident: the loop rolls back to the last checkpoint saved before the incident's first bad
    step (later ones may hold its updates) and skips the offending batches. `max_rollbacks` counts incidents.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from smolctl.train.config import GuardsSection

_MAD_TO_SIGMA = 1.4826  # MAD × this estimates the standard deviation of normally distributed values
_MIN_HISTORY = 8  # losses needed before a z-score means anything


@dataclass
class Verdict:
    apply_update: bool
    event: dict | None = None
    rollback: bool = False
    bad_batches: list[int] = field(default_factory=list)
    first_bad_step: int | None = None
    """The incident's first bad step: a rollback goes to a checkpoint saved before it."""
    level_shift: dict | None = None
    """Set when this step completed a sustained shift and the window re-baselined (an event to log)."""


class Guards:
    def __init__(self, config: GuardsSection):
        self.config = config
        self.recent: deque[float] = deque(maxlen=config.spike_window)
        self.bad_run: list[
            tuple[int, int, float]
        ] = []  # (step, batch, loss) of the current run of consecutive bad steps
        self.skipped = 0
        self.spikes = 0
        self.rollbacks = 0

    def _median_and_scale(self) -> tuple[float, float]:
        ordered = sorted(self.recent)
        median = ordered[len(ordered) // 2]
        mad = sorted(abs(x - median) for x in ordered)[len(ordered) // 2]
        return median, max(_MAD_TO_SIGMA * mad, 1e-3 * abs(median), 1e-8)

    def zscore(self, loss: float) -> float:
        if len(self.recent) < _MIN_HISTORY:
            return 0.0
        median, scale = self._median_and_scale()
        return (loss - median) / scale

    def _level_shift(self) -> float | None:
        """The new level when the bad run is a sustained shift (all finite, spread within the window's noise)."""
        losses = [loss for _, _, loss in self.bad_run]
        if not all(math.isfinite(x) for x in losses) or len(self.recent) < _MIN_HISTORY:
            return None
        level = sorted(losses)[len(losses) // 2]
        _, scale = self._median_and_scale()
        return level if all(abs(x - level) / scale <= self.config.spike_zscore for x in losses) else None

    def _rebaseline(self, level: float) -> dict:
        """Move the window to the new level, keeping its noise, so later losses are judged against it."""
        old, _ = self._median_and_scale()
        shifted = [x + level - old for x in self.recent]
        self.recent.clear()
        self.recent.extend(shifted)
        self.recent.extend(loss for _, _, loss in self.bad_run)
        return {
            "event": "level_shift",
            "step": self.bad_run[-1][0],
            "from": old,
            "to": level,
            "action": "spike window re-baselined",
        }

    def observe(self, step: int, batch: int, loss: float, grad_norm: float) -> Verdict:
        """Judge one step from its (globally reduced) loss and gradient norm; every rank reaches the same verdict."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.skipped += 1
            verdict = Verdict(
                False,
                {
                    "event": "nonfinite",
                    "step": step,
                    "batch": batch,
                    "loss": _jsonable(loss),
                    "grad_norm": _jsonable(grad_norm),
                    "action": "update skipped",
                },
            )
        else:
            z = self.zscore(loss)
            if z > self.config.spike_zscore:
                self.spikes += 1
                verdict = Verdict(
                    True,
                    {
                        "event": "spike",
                        "step": step,
                        "batch": batch,
                        "loss": loss,
                        "zscore": round(z, 2),
                        "grad_norm": grad_norm,
                    },
                )
            else:
                self.recent.append(loss)
                self.bad_run.clear()
                return Verdict(True)
        self.bad_run.append((step, batch, loss))
        if len(self.bad_run) >= self.config.max_bad_steps:
            level = self._level_shift()
            if level is not None:
                verdict.level_shift = self._rebaseline(level)
            else:
                verdict.rollback = True
                verdict.bad_batches = [b for _, b, _ in self.bad_run]
                verdict.first_bad_step = self.bad_run[0][0]
            self.bad_run.clear()
        return verdict

    def counts(self) -> dict:
        """Running totals for the metrics lines: updates skipped, spikes seen, rollbacks done."""
        return {"skipped": self.skipped, "spikes": self.spikes, "rollbacks": self.rollbacks}

    def state_dict(self) -> dict:
        return {
            "recent": list(self.recent),
            "skipped": self.skipped,
            "spikes": self.spikes,
            "rollbacks": self.rollbacks,
        }

    def load_state_dict(self, state: dict) -> None:
        self.recent.clear()
        self.recent.extend(float(x) for x in state["recent"])
        self.skipped, self.spikes, self.rollbacks = int(state["skipped"]), int(state["spikes"]), int(state["rollbacks"])
        self.bad_run.clear()


def _jsonable(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)

"""Learning-rate schedules as a pure function of the step: nothing to save, so resume is exact by construction.

    learning_rate(step, peak=2e-4, schedule=ScheduleSection(kind="wsd", warmup_steps=2000, decay_steps=522_000),
                  total_steps=4_720_000)

The one schedule of every training command: pretrain sets each step's lr from `learning_rate`, the TRL trainers
(sft, dpo, grpo) and the PPO loop get `lambda_scheduler`, a LambdaLR over the same function.
"""

from __future__ import annotations

import math
from functools import partial

from smolctl.train.config import ScheduleSection


def decay_length(schedule: ScheduleSection, total_steps: int) -> int:
    """wsd: steps of the final decay (the rest after warmup is the stable phase)."""
    if schedule.decay_steps is not None:
        return schedule.decay_steps
    if schedule.decay_fraction is not None:
        return min(total_steps - schedule.warmup_steps, round(schedule.decay_fraction * total_steps))
    return round(0.1 * total_steps)  # the WSD paper's default: decay over the last 10%


def _shape(kind: str, progress: float) -> float:
    """Multiplier going from 1 (progress 0) to 0 (progress 1)."""
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if kind == "1-sqrt":  # Hägele et al. 2024: matches cosine with a short cooldown
        return 1.0 - math.sqrt(progress)
    return 1.0 - progress


def learning_rate(step: int, *, peak: float, schedule: ScheduleSection, total_steps: int) -> float:
    """The lr of optimizer step `step` (0-based): 1) warmup, 2) constant / stable, 3) decay to min_lr_ratio·peak."""
    floor = schedule.min_lr_ratio * peak
    warmup = schedule.warmup_steps
    if step < warmup:
        return peak * (step + 1) / warmup
    if schedule.kind == "constant":
        return peak
    if schedule.kind == "exponential":
        return max(floor, peak * schedule.decay_rate ** (step - warmup))
    if schedule.kind == "cosine":
        progress = min(1.0, (step - warmup + 1) / max(1, total_steps - warmup))
        return floor + (peak - floor) * _shape("cosine", progress)
    decay = decay_length(schedule, total_steps)
    decay_start = total_steps - decay
    if step < decay_start or decay == 0:
        return peak
    progress = min(1.0, (step - decay_start + 1) / decay)
    return floor + (peak - floor) * _shape(schedule.decay_shape, progress)


def lambda_scheduler(optimizer, schedule: ScheduleSection, total_steps: int):
    """A LambdaLR that gives the optimizer's param groups `learning_rate` of the step (their lr is the peak);
    the TRL trainers and the PPO loop step it once per optimizer step, as pretrain's loop counts steps."""
    from torch.optim.lr_scheduler import LambdaLR

    return LambdaLR(optimizer, partial(learning_rate, peak=1.0, schedule=schedule, total_steps=total_steps))

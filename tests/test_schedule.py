"""Learning-rate schedules: warmup, the WSD plateau and its decay shapes, cosine with a floor."""

from __future__ import annotations

import pytest

from smolctl.train.config import ScheduleSection
from smolctl.train.schedule import learning_rate


def lrs(total: int, **kwargs) -> list[float]:
    schedule = ScheduleSection(**kwargs)
    return [learning_rate(step, peak=1.0, schedule=schedule, total_steps=total) for step in range(total)]


def test_wsd_warms_up_holds_then_decays_linearly_to_the_floor():
    values = lrs(20, kind="wsd", warmup_steps=4, decay_steps=5, min_lr_ratio=0.1)
    assert values[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert values[4:15] == [1.0] * 11
    assert values[15:] == pytest.approx([0.82, 0.64, 0.46, 0.28, 0.1])


def test_wsd_decay_shapes_end_at_the_floor_and_differ_on_the_way():
    linear, one_minus_sqrt, cosine = (
        lrs(10, kind="wsd", decay_fraction=1.0, decay_shape=shape) for shape in ("linear", "1-sqrt", "cosine")
    )
    assert linear[-1] == one_minus_sqrt[-1] == pytest.approx(0.0, abs=1e-12) and cosine[-1] == pytest.approx(
        0.0, abs=1e-12
    )
    assert one_minus_sqrt[2] < linear[2] < cosine[2]  # 1-sqrt drops fastest at first, cosine slowest


def test_smollm3_schedule_points():
    schedule = ScheduleSection(kind="wsd", warmup_steps=2000, decay_steps=522_000)
    at = lambda step: learning_rate(step, peak=2e-4, schedule=schedule, total_steps=4_720_000)  # noqa: E731
    assert at(999) == pytest.approx(1e-4) and at(2_000) == at(4_197_999) == 2e-4
    assert at(4_198_000 + 261_000 - 1) == pytest.approx(1e-4) and at(4_719_999) == pytest.approx(0.0)


def test_cosine_reaches_min_lr_and_constant_stays():
    values = lrs(11, kind="cosine", warmup_steps=1, min_lr_ratio=0.1)
    assert values[0] == 1.0 and values[-1] == pytest.approx(0.1) and values == sorted(values, reverse=True)
    assert lrs(5, kind="constant", warmup_steps=2) == [0.5, 1.0, 1.0, 1.0, 1.0]


def test_exponential_decays_by_its_rate_after_warmup_down_to_the_floor():
    assert lrs(5, kind="exponential", decay_rate=0.5) == [1.0, 0.5, 0.25, 0.125, 0.0625]
    assert lrs(5, kind="exponential", warmup_steps=2, decay_rate=0.5, min_lr_ratio=0.3) == [0.5, 1.0, 1.0, 0.5, 0.3]


def test_the_trainers_lambda_scheduler_is_the_same_function():
    import torch

    from smolctl.train.schedule import lambda_scheduler

    schedule = ScheduleSection(kind="wsd", warmup_steps=2, decay_fraction=0.5, min_lr_ratio=0.1)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=3e-4)
    scheduler = lambda_scheduler(optimizer, schedule, 8)
    seen = []
    for _ in range(8):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([learning_rate(s, peak=3e-4, schedule=schedule, total_steps=8) for s in range(8)])

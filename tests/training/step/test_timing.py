"""StepTimer charges wall-clock time to the phase that ran it."""

from __future__ import annotations

import time

import pytest

from maxent_grpo.training.step.trajectory import StepTimer


class FakeClock:
    """A clock that moves only when told to: the test needs no sleeps and no fast machine."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_phases_accumulate_and_step_covers_them():
    clock = FakeClock()
    timer = StepTimer("cpu", clock=clock)  # the step begins at 100.0
    clock.now += 1.0  # before start(): charged to the step only
    timer.start()
    clock.now += 0.02
    timer.stop("forward")
    clock.now += 0.01
    timer.stop("backward")
    clock.now += 0.5  # between phases: charged to no phase
    timer.start()
    clock.now += 0.02
    timer.stop("forward")  # a second micro-batch adds to the same phase
    clock.now += 0.25
    out = timer.summary(completion_tokens=100)
    assert out["score_s"] == pytest.approx(0.04)
    assert out["backward_s"] == pytest.approx(0.01)
    assert out["reward_s"] == 0.0
    assert out["step_s"] == pytest.approx(1.8)
    assert out["tokens_per_s"] == pytest.approx(100 / 1.8)


def test_the_real_clock_is_monotonic_and_charged():
    timer = StepTimer("cpu")
    timer.start()
    time.sleep(0.001)
    timer.stop("forward")
    out = timer.summary(completion_tokens=1)
    assert 0 < out["score_s"] <= out["step_s"]

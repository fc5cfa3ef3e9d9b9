"""StepTimer charges wall-clock time to the phase that ran it."""

from __future__ import annotations

import time

import pytest

from maxent_grpo.training.step.timing import StepTimer


def test_phases_accumulate_and_step_covers_them():
    timer = StepTimer("cpu")
    timer.start()
    time.sleep(0.02)
    timer.stop("forward")
    time.sleep(0.01)
    timer.stop("backward")
    timer.start()
    time.sleep(0.02)
    timer.stop("forward")  # a second micro-batch adds to the same phase
    out = timer.summary(generate_seconds=0.5, completion_tokens=100)
    assert out["score_s"] == pytest.approx(0.04, abs=0.015)
    assert out["backward_s"] == pytest.approx(0.01, abs=0.01)
    assert out["reward_s"] == 0.0
    assert out["generate_s"] == 0.5
    assert out["step_s"] >= out["score_s"] + out["backward_s"]
    assert out["tokens_per_s"] == pytest.approx(100 / out["step_s"])

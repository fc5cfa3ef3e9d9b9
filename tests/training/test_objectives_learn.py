"""Every objective learns, end to end through the LightningModule, in seconds: the digit
task of ``tests/objective_learning.py`` (random-init model, reward = share of digits)."""

from __future__ import annotations

import pytest

from tests.objective_learning import OBJECTIVES, first_and_last, learning_curve


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_every_objective_learns_the_digit_task(cache_dir, name):
    curve = learning_curve(name, seed=0, cache_dir=cache_dir)
    first, last = first_and_last(curve)
    # Bounds from the recorded runs (benchmarks/results/objective_learning.json, made with
    # benchmarks/objective_learning.py: 4 objectives x seeds 0-4): every run started at
    # 0.137-0.192 (chance is about 0.1 per character) and ended at 0.832-0.970. A policy
    # that does not move stays near its start, and one pushed the wrong way falls to 0.
    assert first <= 0.30, f"{name}: the first steps already scored {first:.3f}"
    assert last >= 0.60 and last >= 3 * first, (
        f"{name} did not learn the digit task: first 10 steps {first:.3f}, last 10 {last:.3f}")

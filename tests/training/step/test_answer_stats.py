"""``train/answer_entropy`` and ``train/distinct_correct``: the spread of a step's answers."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from maxent_grpo.rewards.answers import answer_key
from maxent_grpo.rollout import PromptCompletionBatch
from maxent_grpo.training.step.step_log import StepMetrics


def test_answers_are_compared_as_coverage_reads_them():
    assert answer_key("4 + 5") == answer_key("5 + 4")
    assert answer_key(" 8 ") == answer_key("8") == "8"
    assert answer_key("   ") is None


def test_answer_entropy_and_distinct_correct_per_group():
    completions = ["8", "8", "7", "  ", "4 + 5", "5 + 4", "3 + 6", "x y"]
    correct = [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    trajectory = SimpleNamespace(
        rewards=torch.zeros(2, 4),
        pairs=PromptCompletionBatch(prompts=["p"] * 8, completions=completions),
        samples=SimpleNamespace(components={"r": torch.tensor(correct).view(2, 4)}),
        answer_keys=[answer_key(c) for c in completions],
    )
    metrics = StepMetrics(["r"], SimpleNamespace(reward_index=0, correct_threshold=1.0))
    metrics.observe_answers(trajectory)
    # both groups: one answer twice, two once -> H = -(0.5 ln 0.5 + 2 * 0.25 ln 0.25)
    h = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    assert float(metrics.mean("answer_entropy").compute()) == pytest.approx(h, rel=1e-12)
    # one distinct right answer in the first group, two in the second ("4 + 5" = "5 + 4")
    assert float(metrics.mean("distinct_correct").compute()) == pytest.approx(1.5)

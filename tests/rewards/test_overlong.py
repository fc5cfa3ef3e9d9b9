"""DAPO's soft overlong punishment as the ``overlong`` reward (docs/ALGORITHM.md §4.5)."""

from __future__ import annotations

import pytest
import torch

from maxent_grpo.rewards import WeightedRewards, get_reward
from maxent_grpo.rewards.combine import RewardFunctionError
from maxent_grpo.rollout import PromptCompletionBatch
from maxent_grpo.training.module import MaxEntGRPOModule


@pytest.mark.parametrize("length, expected", [
    (1, 0.0), (6, 0.0), (7, -0.25), (9, -0.75), (10, -1.0), (11, -1.0),
])
def test_the_penalty_is_zero_then_linear_over_the_buffer(length, expected):
    """L_max 10, L_cache 4: 0 up to 6 tokens, ((10 - 4) - L) / 4 up to 10, -1 beyond."""
    got = get_reward("overlong")(["q"], ["c"], completion_ids=[[5] * length],
                                 max_completion_length=10, overlong_buffer=4)
    assert got == [pytest.approx(expected, abs=1e-12)]


def test_the_trainer_passes_its_length_and_the_entrys_buffer():
    module = MaxEntGRPOModule(rewards={"first_number": 1.0, "overlong": {"buffer": 2}},
                              max_completion_length=4)
    pairs = PromptCompletionBatch(prompts=["3 + 4 ="] * 4, completions=["7", "7", "8", "7"])
    ids = torch.tensor([[9, 0, 0, 0], [9, 9, 9, 0], [9, 9, 9, 9], [9, 9, 9, 9]])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]]).bool()
    total, components = module.rewards(pairs, {"answer": ["7"]}, 4, ids, mask)
    overlong = [0.0, -0.5, -1.0, -1.0]  # lengths 1, 3, 4, 4 with L_max 4, L_cache 2
    assert components[1].tolist() == overlong
    assert total.tolist() == [c + o for c, o in zip([1.0, 1.0, 0.0, 1.0], overlong,
                                                      strict=True)]


def test_the_default_buffer_is_a_quarter_of_the_length():
    got = get_reward("overlong")(["q"] * 2, ["a", "b"], completion_ids=[[1] * 6, [1] * 7],
                                 max_completion_length=8)
    assert got == [0.0, -0.5]


@pytest.mark.parametrize("rewards, match", [
    ({"overlong": {"buffer": 0}}, r"model.rewards.overlong.buffer must be"),
    ({"accuracy": {"buffer": 2}}, r"model.rewards.accuracy has no option 'buffer'"),
])
def test_bad_buffers_name_the_option(rewards, match):
    with pytest.raises(ValueError, match=match):
        WeightedRewards(rewards)


def test_outside_the_trainer_the_length_is_asked_for():
    rewards = WeightedRewards({"overlong": 1.0})
    pairs = PromptCompletionBatch(prompts=["q"], completions=["a"])
    with pytest.raises(RewardFunctionError, match="needs the trainer.s max_completion_length"):
        rewards(pairs, {}, 1, torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2).bool())


def test_a_buffer_longer_than_the_budget_stops_the_build():
    with pytest.raises(ValueError, match=r"model.rewards.overlong.buffer \(9\) must be at most "
                                         r"model.max_completion_length \(4\)"):
        MaxEntGRPOModule(rewards={"overlong": {"buffer": 9}}, max_completion_length=4)

"""How reward functions are called (TRL's convention) and ``model.rewards`` per-reward options:
weights or mappings, checked when built; time limits with an error or a fallback."""

from __future__ import annotations

import importlib
import logging
import math
import sys
import threading
import time

import pytest
import torch

import maxent_grpo.cli.parser as cli_module
from maxent_grpo.rewards import (
    RewardFunctionError,
    TrainerState,
    WeightedRewards,
    format_reward,
    score_completions,
)
from maxent_grpo.rollout import PromptCompletionBatch

HERE = "tests.rewards.test_reward_calls"
# the trainer imports "HERE:function", pytest this file under its own name: both copies
# share the state of the module the trainer imports
_SHARED = importlib.import_module(HERE).__dict__
SEEN: list[dict] = _SHARED.setdefault("SEEN", [])
RELEASE: threading.Event = _SHARED.setdefault("RELEASE", threading.Event())
CHAT = [{"role": "user", "content": "2+2?"}]


def spy(prompts, completions, **kwargs):
    SEEN.append({"prompts": prompts, "completions": completions, **kwargs})
    return [1.0] * len(completions)


def test_every_function_gets_the_trl_arguments():
    SEEN.clear()
    state = TrainerState(global_step=3, max_steps=10)
    score_completions([("spy", spy, 1.0)], [CHAT, "2+2="], ["4", "5"], {"answer": ["4", "4"]},
                      completion_ids=[[7, 2], [8]], trainer_state=state)
    (call,) = SEEN
    assert call["prompts"] == [CHAT, "2+2="]  # as given
    assert call["completions"] == [[{"role": "assistant", "content": "4"}], "5"]
    assert call["completion_ids"] == [[7, 2], [8]] and call["trainer_state"] is state
    assert call["answer"] == ["4", "4"]
    # without ids or a state the arguments are still there (None), as TRL always passes them
    SEEN.clear()
    score_completions([("spy", spy, 1.0)], ["p"], ["c"], {})
    assert SEEN[0]["completion_ids"] is None and SEEN[0]["trainer_state"] is None


@pytest.mark.parametrize("k, idle, max_epochs, expected", [
    (1, 0, -1, (8, 2)), (2, 0, -1, (8, 1)),
    (1, 1, -1, (8, 3)),  # 8 steps over 9 batches: a third epoch (said 2)
    (2, 1, -1, (8, 2)),  # 4 rollouts and 1 idle batch: 5 batches
    (1, 1, 2, (7, 2))])  # 2 epochs of 4 batches, one idle: 7 steps
def test_the_trainer_state_counts_an_asynchronous_runs_idle_batches(k, idle, max_epochs,
                                                                     expected):
    """``num_train_epochs``: the epochs a run goes through, where an asynchronous run's first
    ``max_staleness`` batches only start rollouts (4 batches an epoch, max_steps 8)."""
    from types import SimpleNamespace as NS

    trainer = NS(fit_loop=NS(epoch_loop=NS(batch_progress=NS(current=NS(processed=0)))),
                 num_training_batches=4, current_epoch=0, max_steps=8, max_epochs=max_epochs,
                 global_step=0, is_global_zero=True, local_rank=0)
    state = TrainerState.from_trainer(trainer, k, idle)
    assert (state.max_steps, state.num_train_epochs) == expected


def test_weighted_rewards_unpad_the_rollout_ids_and_give_a_state():
    SEEN.clear()
    rewards = WeightedRewards({f"{HERE}:spy": 1.0})
    pairs = PromptCompletionBatch(prompts=["a", "a", "b", "b"], completions=["w", "x", "y", "z"])
    ids = torch.tensor([[5, 2, 0], [6, 0, 0], [7, 8, 9], [4, 2, 0]])
    mask = ids != 0
    rewards(pairs, {"task": ["t1", "t2"]}, 2, ids, mask)
    call = SEEN[-1]
    assert call["completion_ids"] == [[5, 2], [6], [7, 8, 9], [4, 2]]
    assert call["task"] == ["t1", "t1", "t2", "t2"]
    assert call["trainer_state"] == TrainerState()  # none given: step 0, unknown length
    with pytest.raises(ValueError, match="completion_ids and completion_mask must be"):
        rewards(pairs, {}, 2, ids, mask[:, :2])
    with pytest.raises(ValueError, match="column 'trainer_state' clashes"):
        rewards(pairs, {"trainer_state": [1, 2]}, 2)


def test_builtin_rewards_read_conversational_completions():
    assert format_reward([CHAT], [[{"role": "assistant", "content":
                                    "<think>x</think><answer>4</answer>"}]]) == [1.0]
    total, _ = score_completions([("format", format_reward, 1.0)], [CHAT, CHAT],
                                 ["<think>x</think><answer>4</answer>", "4"], {})
    assert total.tolist() == [1.0, 0.0]


# ------------------------------------------------------------------ options


def test_weights_and_option_mappings_mix():
    rewards = WeightedRewards({
        "format": 0.5,
        "tag_count": {"weight": 2, "timeout": 3.0, "fallback": None},
        "answer_format": {"timeout": 1},
    })
    assert rewards.names == ["format", "tag_count", "answer_format"]
    assert rewards.weights == [0.5, 2.0, 1.0]  # weight defaults to 1
    tag, answer = rewards.options[1], rewards.options[2]
    assert (tag.timeout, tag.fallback, tag.has_fallback) == (3.0, None, True)
    assert (answer.timeout, answer.has_fallback) == (1.0, False)
    assert rewards.funcs[0] is format_reward  # no timeout: called directly


@pytest.mark.parametrize(("rewards", "match"), [
    ({}, "model.rewards must name at least one"),
    ({"format": math.nan}, r"model\.rewards\.format must be a finite number"),
    ({"format": "1"}, r"model\.rewards\.format must be a finite number"),
    ({"format": {"weight": math.inf}}, r"model\.rewards\.format\.weight must be a finite"),
    ({"format": {"timeout": -1}}, r"model\.rewards\.format\.timeout must be a finite number in "
                                  r"\(0, "),
    # longer than Python's waits take (it failed in the wait, blaming the reward function)
    ({"format": {"timeout": 1e12}}, r"format\.timeout must be a finite number in \(0, 10000000\]"),
    ({"format": {"fallback": 0.0}}, r"model\.rewards\.format\.fallback .* needs model\.rewards"
                                    r"\.format\.timeout"),
    ({"format": {"timeout": 1, "fallback": "zero"}}, r"format\.fallback must be a finite number"),
    ({"format": {"wieght": 1}}, r"model\.rewards\.format has no option 'wieght'; options: "),
    # --model.rewards.mypkg.rewards:fmt 1.0, as the parser nests it (a hunt: no way out said)
    ({"mypkg": {"rewards:fmt": 1.0}}, r"cannot be a dotted option: give --model\.rewards "
                                      r"'\{\"mypkg\.rewards:fmt\": \.\.\.\}'"),
    ({"nope": 1.0}, r"model\.rewards: .*'nope'"),
    # trained without a word, every reward 0 and every loss 0
    ({"format": 0.0, "accuracy": {"weight": 0}}, r"model\.rewards: every weight is 0"),
    # TRL's list of reward functions, and a function object as a key (a hunt: the first
    # raised "dictionary update sequence element #0 has length 6; 2 is required")
    (["format"], r"must map reward names to weights .* \(e\.g\. \{'format': 1\.0\}\)"),
    ({len: 1.0}, r"a function is named by its import path.*'__main__:len'"),
])
def test_bad_options_name_the_option(rewards, match):
    with pytest.raises(ValueError, match=match):
        WeightedRewards(rewards)


def test_the_cli_accepts_option_mappings(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["maxent_grpo"])
    cli = cli_module.main(
        ["--model.rewards", "{format: 1.0, tag_count: {weight: 2.0, timeout: 5, fallback: null}}"],
        run=False)
    rewards = cli.model.rewards
    assert rewards.weights == [1.0, 2.0] and rewards.options[1].has_fallback
    with pytest.raises(ValueError, match=r"model\.rewards\.format\.timeout"):
        cli_module.main(["--model.rewards", "{format: {timeout: 0}}"], run=False)


# ------------------------------------------------------------------ time limits

def hangs(prompts, completions, **kwargs):
    RELEASE.wait(10)
    return [1.0] * len(completions)


def fails_fast(prompts, completions, **kwargs):
    raise KeyError("no such key")


HANGS = f"{HERE}:hangs"
PAIRS = PromptCompletionBatch(prompts=["p", "p"], completions=["a", "b"])


def test_a_hanging_reward_stops_the_step_naming_reward_and_timeout():
    """It said the function "raised RewardTimeout", and the command line added "(at
    maxent_grpo/rewards/timeout.py:108)", the package's own file (a hunt)."""
    from maxent_grpo.cli.errors import message_of

    RELEASE.clear()
    rewards = WeightedRewards({"format": 1.0, HANGS: {"timeout": 0.2}})
    start = time.perf_counter()
    with pytest.raises(RewardFunctionError, match=(
        rf"'{HANGS}' \(#1\) gave no result within "
        rf"model\.rewards\.{HANGS}\.timeout = 0\.2 s")) as stopped:
        rewards(PAIRS, {}, 2)
    assert time.perf_counter() - start < 5
    assert "timeout.py" not in message_of(stopped.value)
    RELEASE.set()


def test_a_fallback_scores_a_timed_out_call(caplog):
    RELEASE.clear()
    rewards = WeightedRewards({"format": 1.0, HANGS: {"weight": 2.0, "timeout": 0.2,
                                                      "fallback": -1.0}})
    with caplog.at_level(logging.WARNING, logger="maxent_grpo.rewards.timeout"):
        total, components = rewards(PAIRS, {}, 2)
    assert components[1].tolist() == [-1.0, -1.0] and total.tolist() == [-2.0, -2.0]
    assert rewards.funcs[1].timeouts == 1 and "gave no result within 0.2 s" in caplog.text
    none = WeightedRewards({"format": 1.0, HANGS: {"timeout": 0.2, "fallback": None}})
    _, components = none(PAIRS, {}, 2)
    assert torch.isnan(components[1]).all()  # not applicable
    RELEASE.set()
    # a call that returns in time gives its values; its errors are the function's
    _, components = none(PAIRS, {}, 2)
    assert components[1].tolist() == [1.0, 1.0]
    failing = WeightedRewards({f"{HERE}:fails_fast": {"timeout": 5}})
    with pytest.raises(RewardFunctionError, match="raised KeyError") as info:
        failing(PAIRS, {}, 2)
    assert isinstance(info.value.__cause__, KeyError)

"""Reward functions and their registry.

Every reward follows the TRL convention ``fn(prompts, completions, **columns) ->
list[float | None]``: ``completions`` are strings or TRL conversational message lists (the
last message's ``"content"`` is read), ``columns`` are the dataset's other columns repeated
per completion, and ``None`` marks a row the reward does not apply to.

Registered names: ``accuracy`` (math-verify equivalence with the ``answer`` column),
``countdown`` (valid expression for ``numbers``/``target``), ``first_number`` (the first
integer equals ``answer``), ``digit_pair`` (``a + b`` equals ``target``), ``format`` (exact
``<think>…</think><answer>…</answer>`` layout), ``tag_count`` (0.25 per tag used once) and
``answer_format`` (an ``<answer>`` block exists). :func:`score_completions` combines
weighted rewards into one reward per completion.
"""

from __future__ import annotations

from maxent_grpo.rewards.correctness import (
    accuracy_reward,
    countdown_reward,
    digit_pair_reward,
    first_number_reward,
)
from maxent_grpo.rewards.parsing import completion_text, extract_answer, last_boxed
from maxent_grpo.rewards.registry import REWARDS, get_reward, list_rewards, register_reward
from maxent_grpo.rewards.scoring import RewardFunctionError, WeightedRewards, score_completions
from maxent_grpo.rewards.shaping import answer_format_reward, format_reward, tag_count_reward

__all__ = [
    "REWARDS",
    "RewardFunctionError",
    "WeightedRewards",
    "accuracy_reward",
    "answer_format_reward",
    "completion_text",
    "countdown_reward",
    "digit_pair_reward",
    "extract_answer",
    "first_number_reward",
    "format_reward",
    "get_reward",
    "last_boxed",
    "list_rewards",
    "register_reward",
    "score_completions",
    "tag_count_reward",
]

"""Reward functions, reward models and their registry.

Every reward follows TRL's ``GRPOTrainer`` convention (:mod:`maxent_grpo.rewards.combine`),
``fn(prompts, completions, completion_ids, trainer_state, **columns) -> list[float | None]``,
where ``None`` marks a row the reward does not apply to.

The registered rewards (:func:`list_rewards`) are described in docs/REWARDS.md, "Rewards".
``model:<name_or_path>`` names a sequence-classification reward model (:class:`RewardModel`);
per-reward options are in :mod:`maxent_grpo.rewards.options`. :class:`WeightedRewards`
combines weighted rewards.
"""

from __future__ import annotations

from maxent_grpo.rewards.answers import (
    accuracy_reward,
    completion_text,
    extract_answer,
    first_number_reward,
    last_boxed,
)
from maxent_grpo.rewards.combine import (
    RewardFunctionError,
    TrainerState,
    WeightedRewards,
    score_completions,
    trl_completions,
)
from maxent_grpo.rewards.options import RewardOptions, parse_reward_options
from maxent_grpo.rewards.registry import REWARDS, get_reward, list_rewards, register_reward
from maxent_grpo.rewards.reward_model import RewardModel
from maxent_grpo.rewards.shaping import answer_format_reward, format_reward, tag_count_reward
from maxent_grpo.rewards.task_rewards import countdown_reward, digit_pair_reward, in_set_reward
from maxent_grpo.rewards.timeout import RewardTimeout, TimedReward

__all__ = [
    "REWARDS", "RewardFunctionError", "RewardModel", "RewardOptions", "RewardTimeout",
    "TimedReward", "TrainerState", "WeightedRewards", "accuracy_reward", "answer_format_reward",
    "completion_text", "countdown_reward", "digit_pair_reward", "extract_answer",
    "first_number_reward", "format_reward", "in_set_reward", "get_reward", "last_boxed",
    "list_rewards", "parse_reward_options", "register_reward", "score_completions",
    "tag_count_reward", "trl_completions",
]

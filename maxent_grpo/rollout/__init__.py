"""Rollout engines: sample G completions per prompt from the current policy.

:class:`RolloutEngine` is the interface, :class:`RolloutOutput` its result, and
:class:`HFGenerateEngine` the engine built on ``transformers``' ``generate``.
"""

from __future__ import annotations

from maxent_grpo.rollout.hf import HFGenerateEngine, completion_mask_from_ids
from maxent_grpo.rollout.protocol import RolloutEngine, RolloutOutput

__all__ = ["HFGenerateEngine", "RolloutEngine", "RolloutOutput", "completion_mask_from_ids"]

"""Rollout engines: sample G completions per prompt from the current policy.

:class:`RolloutEngine` is the interface, :class:`RolloutOutput` its result (its texts a
:class:`GenerationBatch`), :class:`SamplingSettings` the distribution it samples, and
:class:`HFGenerateEngine` the default engine, built on ``transformers``' ``generate``.

``HFGenerateEngine`` is imported on first use (PEP 562), so that the data types here load
without transformers.
"""

from __future__ import annotations

from typing import Any

from maxent_grpo.rollout.batch import GenerationBatch, PromptCompletionBatch
from maxent_grpo.rollout.protocol import (
    EngineFactory,
    RolloutEngine,
    RolloutOutput,
    SamplingSettings,
)

__all__ = [
    "EngineFactory",
    "GenerationBatch",
    "HFGenerateEngine",
    "PromptCompletionBatch",
    "RolloutEngine",
    "RolloutOutput",
    "SamplingSettings",
    "completion_mask_from_ids",
]


def __getattr__(name: str) -> Any:
    if name in ("HFGenerateEngine", "completion_mask_from_ids"):
        from maxent_grpo.rollout import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'maxent_grpo.rollout' has no attribute {name!r}")

"""Rollout engines: sample G completions per prompt from the current policy.

:class:`RolloutEngine` is the interface, :class:`RolloutOutput` its result (its texts a
:class:`GenerationBatch`), :class:`SamplingSettings` the distribution it samples, and
a :class:`HFGenerateEngine` the default engine, built on ``transformers``' ``generate``, and
:class:`VLLMEngine` the engine on a colocated ``vllm.LLM`` (vLLM installed separately), and
:class:`VLLMServerEngine` the engine on ``vllm serve`` processes.

``HFGenerateEngine`` is imported on first use (PEP 562), so that the data types here load
without transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

from maxent_grpo.rollout.batch import GenerationBatch, PromptCompletionBatch, checked_rollout
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
    "VLLMEngine",
    "VLLMServerEngine",
    "checked_rollout",
    "completion_mask_from_ids",
]


#: the names imported on first use -> their module (``vllm_engine`` imports vLLM only when
#: an engine is built)
_LAZY = {"HFGenerateEngine": "hf", "completion_mask_from_ids": "hf", "VLLMEngine": "vllm_engine",
         "VLLMServerEngine": "vllm_server"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"maxent_grpo.rollout.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'maxent_grpo.rollout' has no attribute {name!r}")

"""The documented dataclasses of a training step: the data contract between components
(:mod:`.rewards`: rollout, reward, target and scoring data; :mod:`.logging`: scalar bundles
and the ``MetricWriter`` protocol; :mod:`.runtime`: job-long handles and loop settings).
Importing this package loads torch but neither Lightning nor transformers.
"""

from __future__ import annotations

from maxent_grpo.training.types.logging import (
    LoggingConfigView,
    LogStepArtifacts,
    LossScalarBundle,
    MetricWriter,
    TokenUsageStats,
    TrainingScalarStats,
)
from maxent_grpo.training.types.rewards import (
    AdvantageStats,
    BatchingSettings,
    GenerationBatch,
    PromptCompletionBatch,
    QDistribution,
    RewardComponentStats,
    RewardMoments,
    SequenceScores,
)
from maxent_grpo.training.types.runtime import (
    ControllerPaths,
    LoopSettings,
    OptimizationSettings,
    RuntimeHandles,
)

__all__ = [
    "AdvantageStats",
    "BatchingSettings",
    "ControllerPaths",
    "GenerationBatch",
    "LogStepArtifacts",
    "LoggingConfigView",
    "LoopSettings",
    "LossScalarBundle",
    "MetricWriter",
    "OptimizationSettings",
    "PromptCompletionBatch",
    "QDistribution",
    "RewardComponentStats",
    "RewardMoments",
    "RuntimeHandles",
    "SequenceScores",
    "TokenUsageStats",
    "TrainingScalarStats",
]

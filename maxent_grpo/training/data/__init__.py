"""The prompt data: :class:`PromptDataModule` (``data:`` in YAML) and its parts: ``sources``
(tasks, local ``files``, hub), ``prompts`` (checks, rendering), ``sampler`` (order, collate).
"""

from maxent_grpo.training.data.datamodule import (
    EpochShuffleSampler,
    PromptDataModule,
    PromptDataset,
    PromptLoader,
    collate_prompts,
)
from maxent_grpo.training.data.sampler import PromptExample

__all__ = ["EpochShuffleSampler", "PromptDataModule", "PromptDataset", "PromptExample",
           "PromptLoader", "collate_prompts"]

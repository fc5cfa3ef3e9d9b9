"""The prompt data: :class:`PromptDataModule` and its parts.

- :mod:`~maxent_grpo.training.data.datamodule`: the ``LightningDataModule`` (``data:`` in
  YAML, ``maxent_grpo.training.data.PromptDataModule``), its dataset and loader;
- :mod:`~maxent_grpo.training.data.sources`: where rows come from (tasks, local files, hub);
- :mod:`~maxent_grpo.training.data.files`: local files through ``datasets.load_dataset``;
- :mod:`~maxent_grpo.training.data.prompts`: row checks and chat rendering;
- :mod:`~maxent_grpo.training.data.sampler`: the seeded, resumable order and the collate.
"""

from maxent_grpo.training.data.datamodule import (
    EpochShuffleSampler,
    PromptDataModule,
    PromptDataset,
    PromptExample,
    PromptLoader,
    collate_prompts,
)

__all__ = ["EpochShuffleSampler", "PromptDataModule", "PromptDataset", "PromptExample",
           "PromptLoader", "collate_prompts"]

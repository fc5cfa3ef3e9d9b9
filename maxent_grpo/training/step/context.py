"""What one training step uses, handed to its two halves as one typed object.

``collect`` and ``optimizer_step`` never see the LightningModule and *return* what they
produce, so both run without a ``Trainer`` (a Lightning ``Strategy`` such as
``SingleDeviceStrategy`` stands in for the ranks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy

    from maxent_grpo.objectives import Objective
    from maxent_grpo.rewards import WeightedRewards
    from maxent_grpo.rollout import RolloutEngine
    from maxent_grpo.training.settings import GenerationSettings, ScheduleSettings
    from maxent_grpo.training.step.token_logps import Scorer


@dataclass
class StepContext:
    """The parts of one training step.

    Attributes:
        engine: the run-long rollout engine, already in step with ``policy``'s weights.
        rewards: the weighted reward functions (``model.rewards``).
        scorer: teacher-forced log-probs and micro-batch plans.
        objective: the training objective (``prepare`` / ``loss``).
        policy: the model being trained.
        reference: the frozen reference when the step needs it, else None.
        generation: ``G``, the sampling settings, the row filters.
        schedule: iterations per rollout, clipping, the non-finite limit.
        strategy: Lightning's strategy: the ranks and their collectives (``all_gather``,
            ``reduce_boolean_decision``; :mod:`~maxent_grpo.training.step.strategy`).
        backward: ``loss -> None``, the strategy's backward (``manual_backward``).
        optimizer: the optimizer (Lightning's ``LightningOptimizer``, whose
            ``toggle_model(sync_grad=...)`` defers DDP's all-reduce to the last micro-batch).
        scheduler: the learning-rate scheduler, stepped once per optimizer step.
        step: the global step (the optimizer steps taken so far).
        refill: ``n -> batch``, the next ``n`` prompts of the DataModule's refill stream
            (:meth:`~maxent_grpo.training.data.datamodule.PromptDataModule.refill_batch`),
            when ``generation.refill_rounds > 0``; else None.
    """

    engine: RolloutEngine
    rewards: WeightedRewards
    scorer: Scorer
    objective: Objective
    policy: torch.nn.Module
    reference: torch.nn.Module | None
    generation: GenerationSettings
    schedule: ScheduleSettings
    strategy: Strategy
    backward: Callable[[Tensor], None]
    optimizer: Any
    scheduler: Any
    step: int
    refill: Callable[[int], dict[str, Any]] | None = None

    @property
    def world_size(self) -> int:
        """``W``, the data-parallel ranks."""
        return self.strategy.world_size

    @property
    def rank(self) -> int:
        """This rank's index in ``[0, W)``."""
        return self.strategy.global_rank

    @property
    def device(self) -> torch.device:
        """The device this rank computes on."""
        return self.strategy.root_device

    def gather(self, data: Tensor | dict[str, Tensor]) -> Any:
        """Every rank's ``data`` stacked along a new first dim ``(W, ...)`` (a tensor or
        each tensor of a dict); ``data`` itself when there is one rank."""
        if self.world_size == 1:
            return data
        if isinstance(data, dict):
            return {k: self.strategy.all_gather(v) for k, v in data.items()}
        return self.strategy.all_gather(data)

    def all_ranks(self, flag: bool) -> bool:
        """True when ``flag`` is True on every rank."""
        return bool(self.strategy.reduce_boolean_decision(flag, all=True))

    def any_rank(self, flag: bool) -> bool:
        """True when ``flag`` is True on some rank."""
        return bool(self.strategy.reduce_boolean_decision(flag, all=False))

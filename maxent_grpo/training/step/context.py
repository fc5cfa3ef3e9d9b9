"""What one training step uses, handed to its two halves as one typed object, and the
step's clock (:class:`StepTimer`).

``collect`` and ``optimizer_step`` never see the LightningModule and *return* what they
produce, so both run without a ``Trainer`` (a Lightning ``Strategy`` such as
``SingleDeviceStrategy`` stands in for the ranks).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from maxent_grpo.rewards.combine import TrainerState

if TYPE_CHECKING:
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.strategies import Strategy
    from torch.optim.lr_scheduler import LRScheduler

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
        trainer_state: the training progress the reward functions are given
            (:func:`trainer_state`).
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
    optimizer: LightningOptimizer
    scheduler: LRScheduler | None
    step: int
    refill: Callable[[int], dict[str, Any]] | None = None
    trainer_state: TrainerState = TrainerState()

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


def trainer_state(trainer: Any, num_iterations: int = 1) -> TrainerState:
    """The progress of a Lightning ``trainer`` as the reward functions get it
    (:class:`~maxent_grpo.rewards.combine.TrainerState`); ``TrainerState()`` (step 0, unknown
    length) without one. ``num_iterations`` optimizer steps are taken per batch."""
    if trainer is None:
        return TrainerState()
    batches = trainer.num_training_batches  # per epoch, this rank; inf before fit
    batches = batches if isinstance(batches, int) and batches > 0 else None
    done = trainer.fit_loop.epoch_loop.batch_progress.current.completed
    epoch = trainer.current_epoch + (min(done, batches) / batches if batches else 0.0)
    caps = [trainer.max_steps] if trainer.max_steps > 0 else []
    max_epochs = trainer.max_epochs if trainer.max_epochs is not None else -1
    if batches and max_epochs > 0:
        caps.append(batches * max_epochs * num_iterations)
    max_steps = min(caps) if caps else -1
    epochs = -1
    if batches and max_steps > 0:
        epochs = math.ceil(max_steps / (batches * num_iterations))
    return TrainerState(
        global_step=int(trainer.global_step), max_steps=int(max_steps), epoch=float(epoch),
        num_train_epochs=int(epochs), is_world_process_zero=bool(trainer.is_global_zero),
        is_local_process_zero=trainer.local_rank == 0,
    )


# ---------------------------------------------------------------- the step's clock
# Per-step wall-clock timings (``perf/...`` metrics).
#
# A :class:`StepTimer` splits one training step into phases and reports seconds per phase
# (the rollout's own time, measured by the engine, is logged as ``perf/generate_s`` through
# :attr:`~maxent_grpo.training.types.TrainingScalarStats.vllm_latency_ms`):
#
# - ``reward_s``: the reward functions,
# - ``score_s``: forward passes that produce log-probs (reference, behaviour and policy),
# - ``backward_s``: backward passes plus gradient clipping and the optimizer step,
# - ``step_s``: the whole step, and ``tokens_per_s``: completion tokens of this rank divided
#   by ``step_s``.
#
# On CUDA each boundary synchronises the device so that asynchronous kernels are charged to
# the phase that launched them; on the CPU the clock is read directly.


class StepTimer:
    """Seconds per named phase: ``stop(name)`` charges the time since the last ``start()``
    or ``stop()`` to ``name`` (consecutive phases: one ``start``, several ``stop`` calls)."""

    def __init__(self, device: torch.device | str | None = None, clock=time.perf_counter) -> None:
        self._cuda = torch.device(device or "cpu").type == "cuda"
        self._clock = clock  # seconds; injectable so that tests need no real sleeps
        self._begin = self._now()
        self._last = self._begin
        self.seconds: dict[str, float] = defaultdict(float)

    def _now(self) -> float:
        if self._cuda:
            torch.cuda.synchronize()
        return self._clock()

    def start(self) -> None:
        self._last = self._now()

    def stop(self, phase: str) -> None:
        now = self._now()
        self.seconds[phase] += now - self._last
        self._last = now

    def summary(self, completion_tokens: int) -> dict[str, float]:
        """The ``perf/...`` values of the step (keys without the prefix)."""
        step = self._now() - self._begin
        s = self.seconds
        return {
            "reward_s": s["reward"],
            "score_s": s["frozen"] + s["forward"],
            "backward_s": s["backward"] + s["optimizer"],
            "step_s": step,
            "tokens_per_s": completion_tokens / step if step > 0 else float("nan"),
        }

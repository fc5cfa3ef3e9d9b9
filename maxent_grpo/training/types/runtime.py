"""Runtime handles and grouped loop settings: what lives for the whole training job, as
typed views of what Lightning owns. Importing this module loads neither Lightning nor
transformers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from maxent_grpo.training.types.rewards import BatchingSettings

if TYPE_CHECKING:
    import torch
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.strategies import Strategy
    from torch.optim.lr_scheduler import LRScheduler
    from torch.utils.data import DataLoader, Sampler
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from maxent_grpo.objectives import Objective
    from maxent_grpo.training.settings import (
        EvaluationSettings,
        GenerationSettings,
        ScheduleSettings,
    )

__all__ = ["ControllerPaths", "LoopSettings", "OptimizationSettings", "RuntimeHandles"]


@dataclass(frozen=True)
class ControllerPaths:
    """Where the tau/beta/meta controllers write and read ``controller_state.json`` (a side
    file to the state in the Lightning checkpoint); paths are None or non-empty strings.

    Attributes:
        state_path: file the state is written to, or ``None`` for no side file.
        resume_from: file the state is loaded from at start, or ``None``.
        overwrite_existing: allow replacing an existing ``state_path`` at the start of a
            fresh run (otherwise the callback refuses, to protect an earlier run's state).
    """

    state_path: str | None
    resume_from: str | None
    overwrite_existing: bool = False

    def __post_init__(self) -> None:
        for name in ("state_path", "resume_from"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be None or a non-empty string; got {value!r}")


@dataclass(frozen=True)
class OptimizationSettings:
    """The optimisation schedule plus the optimizer/scheduler handles it drives.

    Attributes:
        schedule: the schedule settings (iterations per rollout, clipping, warm-up, ...).
        handles: ``(optimizer, lr_scheduler)``, Lightning's wrappers of them from
            ``LightningModule.optimizers()`` / ``lr_schedulers()``; None until training
            starts, when the module builds these settings again with them (never set in
            place), and again after it.
    """

    schedule: ScheduleSettings
    handles: tuple[LightningOptimizer, LRScheduler | None] | None


@dataclass(frozen=True)
class LoopSettings:
    """The training loop's configuration, grouped by concern
    (:func:`~maxent_grpo.training.option_groups.build_loop_settings`). The three controller fields
    describe the tau / beta controllers (Lightning callbacks): built without any, and
    rebuilt (:meth:`with_controller`, never mutated) as each controller attaches to the
    module at ``setup``.

    Attributes:
        generation: rollout settings (G, max completion length, temperature, …).
        evaluation: evaluation settings (k for pass@k, number of samples, …).
        optimization: the :class:`OptimizationSettings`.
        scoring: how scoring is chunked (:class:`BatchingSettings`).
        controller: where the controllers' state file is written and read (the first
            path any of them names; both None without one). A checkpoint records it, so
            a resume without the controllers that wrote it is warned about.
        controller_objective: the objective the controllers move (the module's), read by
            each controller at every step; None without a controller.
        controller_meta_manager: the :class:`~maxent_grpo.training.callbacks.MetaController`
            when one runs, else None (recorded in the checkpoint like ``controller``).
    """

    generation: GenerationSettings
    evaluation: EvaluationSettings
    optimization: OptimizationSettings
    scoring: BatchingSettings
    controller: ControllerPaths
    controller_objective: Objective | None = None
    controller_meta_manager: Any = None  # a training.callbacks.MetaController (above types/)

    def with_controller(self, paths: ControllerPaths, objective: Objective,
                        meta_manager: Any = None) -> LoopSettings:
        """These settings with one more controller attached: its ``paths`` fill the ones
        not yet named, ``objective`` is the one it moves, ``meta_manager`` the
        MetaController (None keeps the current one)."""
        mine = self.controller
        return dataclasses.replace(
            self,
            controller=ControllerPaths(mine.state_path or paths.state_path,
                                       mine.resume_from or paths.resume_from,
                                       mine.overwrite_existing or paths.overwrite_existing),
            controller_objective=objective,
            controller_meta_manager=meta_manager or self.controller_meta_manager)

    def with_handles(self, optimizer: LightningOptimizer | None,
                     scheduler: LRScheduler | None) -> LoopSettings:
        """These settings with the optimizer and scheduler Lightning built for training
        (:attr:`OptimizationSettings.handles`; none for ``optimizer`` None: a fit's end), as
        new settings."""
        return dataclasses.replace(self, optimization=OptimizationSettings(
            self.optimization.schedule, None if optimizer is None else (optimizer, scheduler)))


def detached_controllers(loop: LoopSettings) -> LoopSettings:
    """``loop`` without controllers (what a fit starts from: each attaches at ``setup``)."""
    return dataclasses.replace(loop, controller=ControllerPaths(None, None),
                               controller_objective=None, controller_meta_manager=None)


@dataclass(frozen=True)
class RuntimeHandles:
    """The objects of the whole job, as Lightning holds them. ``get_ref_model`` loads the
    frozen reference lazily, so a run that never needs it (beta = 0 and no controller can
    raise beta) never loads it. Built when the module loads its models, and built again
    (never changed in place) with the reference once loaded and with the trainer's loader
    and sampler when training starts.

    Attributes:
        accelerator: Lightning's ``Strategy`` (``trainer.strategy``: devices, collectives,
            gradient clipping; what an HF Accelerate ``Accelerator`` does elsewhere), or
            None outside a trainer.
        model: the policy being trained.
        tokenizer: the policy's tokenizer.
        train_loader: the trainer's training ``DataLoader`` (the PromptDataModule's), or
            None before training starts.
        train_sampler: that loader's sampler (the PromptDataModule's
            :class:`~maxent_grpo.training.data.EpochShuffleSampler`, whose order an exact
            resume continues), or None before training starts.
        device: the device this process computes on (the module's device when the models
            load, then, when training starts, the one Lightning moved it to).
        get_ref_model: zero-argument callable returning the reference model.
        reference_model: the reference model once loaded, else ``None``.
        prompt_cache_get: a prompt-tokenization lookup; always None here (no prompt cache:
            the engines tokenize each rollout's prompts).
    """

    accelerator: Strategy | None
    model: PreTrainedModel | torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    train_loader: DataLoader | None
    train_sampler: Sampler | None
    device: torch.device
    get_ref_model: Callable[[], PreTrainedModel]
    reference_model: PreTrainedModel | None = None
    prompt_cache_get: Callable[[str], Any] | None = None

    def __post_init__(self) -> None:
        if not callable(self.get_ref_model):
            raise TypeError("get_ref_model must be a zero-argument callable")

    def with_reference(self) -> RuntimeHandles:
        """These handles with the reference model loaded (``get_ref_model`` runs only when it
        is not loaded yet), as new handles."""
        if self.reference_model is not None:
            return self
        return dataclasses.replace(self, reference_model=self.get_ref_model())

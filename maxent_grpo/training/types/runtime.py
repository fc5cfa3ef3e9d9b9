"""Runtime handles and grouped loop settings: what lives for the whole training job, as
typed views of what Lightning owns. Importing this module loads neither Lightning nor
transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from maxent_grpo.training.types.rewards import BatchingSettings

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["ControllerPaths", "LoopSettings", "OptimizationSettings", "RuntimeHandles"]


@dataclass
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


@dataclass
class OptimizationSettings:
    """The optimisation schedule plus the optimizer/scheduler handles it drives.

    Attributes:
        schedule: the schedule settings object.
        handles: the optimizer and lr-scheduler objects (or Lightning's wrappers of them),
            from ``LightningModule.optimizers()`` / ``lr_schedulers()``.
    """

    schedule: Any
    handles: Any


@dataclass
class LoopSettings:
    """The training loop's configuration, grouped by concern
    (:func:`~maxent_grpo.training.settings.build_loop_settings`).

    Attributes:
        generation: rollout settings (G, max completion length, temperature, …).
        evaluation: evaluation settings (k for pass@k, number of samples, …).
        optimization: the :class:`OptimizationSettings`.
        scoring: how scoring is chunked (:class:`BatchingSettings`).
    """

    generation: Any
    evaluation: Any
    optimization: OptimizationSettings
    scoring: BatchingSettings


@dataclass
class RuntimeHandles:
    """The models of the whole job. ``get_ref_model`` loads the frozen reference lazily, so
    a run that never needs it (beta = 0 and no controller can raise beta) never loads it.

    Attributes:
        model: the policy being trained.
        tokenizer: the policy's tokenizer.
        get_ref_model: zero-argument callable returning the reference model.
        reference_model: the reference model once loaded, else ``None``.
    """

    model: PreTrainedModel | torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    get_ref_model: Callable[[], PreTrainedModel]
    reference_model: PreTrainedModel | None = None

    def __post_init__(self) -> None:
        if not callable(self.get_ref_model):
            raise TypeError("get_ref_model must be a zero-argument callable")

    def reference(self) -> PreTrainedModel:
        """The reference model, loading it with ``get_ref_model`` on first use."""
        if self.reference_model is None:
            self.reference_model = self.get_ref_model()
        return self.reference_model

"""Runtime handles and grouped loop settings: what lives for the whole training job.

Lightning owns the accelerator, the loop and the optimizer; the types here are typed views
built from those Lightning objects so that the training code can name what it uses.
Lightning and transformers types are imported for type checking only: importing this
module loads neither library.
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
    """Where the tau/beta/meta controllers write and read ``controller_state.json``.

    Consumed by the controller callbacks. The controllers' state also travels in the
    Lightning checkpoint (callback ``state_dict``); these paths add a side file that is
    written atomically after each update and read on resume.

    Attributes:
        state_path: file the state is written to, or ``None`` for no side file.
        resume_from: file the state is loaded from at start, or ``None``.
        overwrite_existing: allow replacing an existing ``state_path`` at the start of a
            fresh run (otherwise the callback refuses, to protect an earlier run's state).

    Paths must be ``None`` or non-empty strings.
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

    A typed view built from Lightning: ``schedule`` comes from the module's constructor
    arguments (lr, warm-up, total steps, gradient accumulation, clipping norm) and
    ``handles`` from ``LightningModule.optimizers()`` / ``lr_schedulers()``; Lightning
    still owns stepping them. Consumed by logging (current lr) and the controllers.

    Attributes:
        schedule: the schedule settings object.
        handles: the optimizer and lr-scheduler objects (or Lightning's wrappers of them).
    """

    schedule: Any
    handles: Any


@dataclass
class LoopSettings:
    """The training loop's configuration, grouped by concern.

    Built once by the LightningModule from its constructor arguments
    (:func:`~maxent_grpo.training.settings.build_loop_settings`); read by ``training_step``
    (generation, optimization, scoring) and the evaluator (evaluation). Lightning's
    ``Trainer`` owns the loop itself; this is the view of its settings. The controllers'
    paths (:class:`ControllerPaths`) are their own (``Controller.paths``).

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
    """The models of the whole job: a typed view of what the module loaded.

    Built by the LightningModule in ``configure_model``; read by the step (policy,
    reference), the export callback (model, tokenizer). ``get_ref_model`` loads the frozen
    reference lazily, so a run that never needs it (beta = 0 and no controller can raise
    beta) never loads it.

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

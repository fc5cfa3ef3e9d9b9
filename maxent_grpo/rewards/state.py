"""``trainer_state``: the training progress every reward function is given.

As TRL's ``transformers.TrainerState`` (mostly read for schedules,
``global_step / max_steps``): the fields such functions read, under TRL's names and
meanings, frozen and built from the Lightning trainer at each call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["TrainerState"]


@dataclass(frozen=True)
class TrainerState:
    """Read-only training progress.

    Attributes:
        global_step: optimizer steps taken so far (``trainer.global_step``; 0 at the first
            rollout).
        max_steps: the optimizer steps the run will take (``trainer.max_steps``, or the
            epochs' batches times ``num_iterations``, whichever is smaller); -1 when unknown
            (no trainer, an endless loader).
        epoch: epochs done, with the fraction of the current one (``2.25`` = a quarter into
            the third epoch), as TRL's ``state.epoch``.
        num_train_epochs: epochs the run goes through (-1 when unknown).
        is_world_process_zero: this process is global rank 0.
        is_local_process_zero: this process is rank 0 of its node.

    >>> state = TrainerState(global_step=30, max_steps=100)
    >>> state.global_step / state.max_steps
    0.3
    """

    global_step: int = 0
    max_steps: int = -1
    epoch: float = 0.0
    num_train_epochs: int = -1
    is_world_process_zero: bool = True
    is_local_process_zero: bool = True

    @classmethod
    def of(cls, module: Any) -> TrainerState:
        """The state of the Lightning trainer that ``module`` (a ``LightningModule``) is
        attached to; ``TrainerState()`` (step 0, unknown length) without one."""
        try:
            trainer = module.trainer
        except (AttributeError, RuntimeError):  # None, or a module not attached to a trainer
            return cls()
        if trainer is None:
            return cls()
        hparams = getattr(module, "hparams", None) or {}
        iterations = int(hparams.get("num_iterations", 1))
        batches = trainer.num_training_batches  # per epoch, this rank; inf before fit
        batches = batches if isinstance(batches, int) and batches > 0 else None
        done = trainer.fit_loop.epoch_loop.batch_progress.current.completed
        epoch = trainer.current_epoch + (min(done, batches) / batches if batches else 0.0)
        caps = [trainer.max_steps] if trainer.max_steps > 0 else []
        max_epochs = trainer.max_epochs if trainer.max_epochs is not None else -1
        if batches and max_epochs > 0:
            caps.append(batches * max_epochs * iterations)
        max_steps = min(caps) if caps else -1
        epochs = -1
        if batches and max_steps > 0:
            epochs = math.ceil(max_steps / (batches * iterations))
        return cls(
            global_step=int(trainer.global_step), max_steps=int(max_steps), epoch=float(epoch),
            num_train_epochs=int(epochs), is_world_process_zero=bool(trainer.is_global_zero),
            is_local_process_zero=trainer.local_rank == 0,
        )

"""``trainer_state``: the training progress every reward function is given.

As TRL's ``transformers.TrainerState`` (mostly read for schedules,
``global_step / max_steps``): the fields such functions read, under TRL's names and
meanings, frozen; the trainer builds one per step
(:func:`maxent_grpo.training.step.context.trainer_state`) and hands it to the rewards.
"""

from __future__ import annotations

from dataclasses import dataclass

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

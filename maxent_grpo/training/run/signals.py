"""SIGTERM (a job scheduler's stop, ``kill``) with several processes.

Lightning's handler broadcasts a tensor from inside the signal handler, whenever the signal
comes: the other ranks are then in one of the step's own collectives (an ``all_gather`` of
the rollout), the two do not match and the run hangs until the process group's time-out.
A signal to one rank only (its own ``kill``) stopped that rank alone, the others waiting.

Here the handler only notes the signal (and, as Lightning's does, passes it on to the
processes Lightning launched). At the end of every training, validation, test and predict
batch (the same batch on every rank) :func:`share_sigterm` asks every rank whether one was
signalled; if so each sets Lightning's ``received_sigterm`` there and Lightning stops them
all after that batch (a ``ModelCheckpoint(save_on_exception=True)`` saves that step). With
one process the handler sets ``received_sigterm`` itself, as Lightning's does.
"""

from __future__ import annotations

import logging
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["share_sigterm", "take_sigterm"]

log = logging.getLogger(__name__)


def take_sigterm(trainer: Any) -> None:
    """Give the trainer the handler above; before Lightning registers it (a callback's
    ``setup`` runs first)."""
    connector = trainer._signal_connector
    connector.sigterm_pending = False

    def notify(signum: int, _: FrameType | None) -> None:
        log.info("[rank %d] SIGTERM: the run stops after this batch", trainer.global_rank)
        if not connector.sigterm_pending and trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(signum)  # the processes Lightning started
        connector.sigterm_pending = True
        if trainer.world_size == 1:
            connector.received_sigterm = True

    connector._sigterm_notifier_fn = notify


def share_sigterm(trainer: Any) -> bool:
    """Whether any rank was signalled (one small ``all_reduce`` with several processes);
    sets ``received_sigterm`` on every rank if so. Called at the same batch on every rank."""
    connector = trainer._signal_connector
    pending = bool(getattr(connector, "sigterm_pending", False))
    if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
        flag = torch.tensor([int(pending)], device=trainer.strategy.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        pending = bool(flag.item())
    if pending:
        connector.received_sigterm = True
    return pending

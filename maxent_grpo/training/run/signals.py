"""SIGTERM (a job scheduler's stop, ``kill``) with several processes.

Lightning's handler broadcasts a tensor from inside the signal handler, whenever the signal
comes: the other ranks are then in one of the step's own collectives (an ``all_gather`` of
the rollout), the two do not match and the run hangs until the process group's time-out.
A signal to one rank only (its own ``kill``) stopped that rank alone, the others waiting.

Here the handler only notes the signal (and, as Lightning's does, passes it on to the
processes Lightning launched). At the end of every training batch, and of every
validation, test and predict batch when every rank has as many of them
(:func:`same_batches`: Lightning's predict sampler, a user's loader or an iterable
dataset can give ranks different counts), :func:`share_sigterm` asks every rank whether
one was signalled; if so each sets Lightning's ``received_sigterm`` there and Lightning
stops them all after that batch (a ``ModelCheckpoint(save_on_exception=True)`` saves that
step). With one process the handler sets ``received_sigterm`` itself, as Lightning's does.
Lightning installs the handler once the model is built and a checkpoint restored, and
removes it when the loop ends: a signal before (while a large model loads) or after (an
export at the fit's end) ends the process it reaches at once, as by default.
"""

from __future__ import annotations

import logging
import math
from types import FrameType
from typing import Any

import torch

__all__ = ["give_back_sigterm", "same_batches", "share_sigterm", "take_sigterm"]

log = logging.getLogger(__name__)


def take_sigterm(trainer: Any) -> None:
    """Give the trainer the handler above; before Lightning registers it (a callback's
    ``setup`` runs first)."""
    connector = trainer._signal_connector
    connector.sigterm_pending, connector.sigterm_per_batch = False, True

    def notify(signum: int, _: FrameType | None) -> None:
        log.info("[rank %d] SIGTERM: the run stops after this batch", trainer.global_rank)
        if not connector.sigterm_pending and trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(signum)  # the processes Lightning started
        connector.sigterm_pending = True
        if trainer.world_size == 1:
            connector.received_sigterm = True

    connector._sigterm_notifier_fn = notify


def give_back_sigterm(trainer: Any) -> None:
    """Lightning's handler again, for a later run on the Trainer of another module."""
    if (connector := getattr(trainer, "_signal_connector", None)) is not None:
        vars(connector).pop("_sigterm_notifier_fn", None)


def same_batches(trainer: Any, counts: list[int | float]) -> None:
    """At a validation, test or predict loop's start (every rank there): whether every rank
    has ``counts`` batches (the loop's per-loader counts), so that :func:`share_sigterm` may
    run after each; one ``all_gather``."""
    total = sum(counts) if all(math.isfinite(n) for n in counts) else -1
    same = True
    if trainer.world_size > 1:
        strategy = trainer.strategy
        totals = strategy.all_gather(torch.tensor(total, device=strategy.root_device))
        same = total >= 0 and bool((totals == total).all())
    trainer._signal_connector.sigterm_per_batch = same


def share_sigterm(trainer: Any, training: bool = True) -> bool:
    """Whether any rank was signalled (one ``reduce_boolean_decision``); sets
    ``received_sigterm`` on every rank if so. Called after the same batch on every rank:
    each training batch, an evaluation batch only where :func:`same_batches` allows it."""
    connector = trainer._signal_connector
    if not (training or getattr(connector, "sigterm_per_batch", True)):
        return False
    pending = bool(getattr(connector, "sigterm_pending", False))
    pending = trainer.strategy.reduce_boolean_decision(pending, all=False)
    if pending:
        connector.received_sigterm = True
    return pending

"""SIGTERM (a job scheduler's stop, ``kill``) and Ctrl-C with several processes.

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

Ctrl-C (SIGINT) with several processes is taken the same way, once: a terminal's reaches
every process, each raised ``KeyboardInterrupt`` wherever it was (one in a collective, one
not: the checkpoint's save mismatched them), and a SIGINT sent to one process alone (``kill
-INT`` of the launching one, ``timeout -s INT``) stopped that one in mid-step, the others
failing in their collective, with no checkpoint. The handler notes it as a SIGTERM; every
rank stops after the same batch and the command exits 130 on every one. A second Ctrl-C
to a process, :data:`SAME_CTRL_C_S` after the first or later (sooner, it is the first passed
on by a launcher), stops it at once, unsaved (``KeyboardInterrupt``, as by default). A
process started with Ctrl-C ignored (``cmd &`` in a script) keeps ignoring it. With one
process Ctrl-C is Lightning's ``KeyboardInterrupt``: ``save_on_exception`` saves the step it
cut, which a resume runs again.

SLURM's requeue signal (``SIGUSR1`` with ``#SBATCH --signal=USR1@600``), where Lightning's
``SLURMEnvironment`` auto-requeues, is taken the same way: Lightning's handler finalised
the loggers and saved inside the signal handler, which deadlocked on a lock the interrupted
logging held (the job hung until its time limit, not requeued, its ``hpc_ckpt`` unsaved),
and saved in mid-step. Here the handler notes it; at the end of the training batch every
rank saves ``hpc_ckpt_N.ckpt`` into ``trainer.default_root_dir`` together, after the
user's callbacks' end of that batch (Lightning runs the ``ModelCheckpoint`` savers after
it: a file a saver writes at that step is not in the hpc checkpoint's record of it), and
rank 0 runs ``scontrol requeue`` (:func:`requeue`), the loggers flushed first.
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from maxent_grpo.training.run.checkpoint_io import ResolvedCheckpoint, is_local
from maxent_grpo.validation import require

__all__ = ["answer_requeue", "give_back_sigterm", "INTERRUPTED", "hpc_checkpoints", "requeue",
           "resolve_with_requeue", "same_batches", "share_sigterm", "slurm_requeue_checkpoint",
           "slurm_resume", "take_sigterm"]

log = logging.getLogger(__name__)

# Ctrl-C during a run on several processes: "once" (this process's: every process stops
# after the batch, the command exits 130), "shared" (another process's, agreed on at the end
# of a batch), "again" (this process's second: it stops at once, unsaved)
INTERRUPTED: list[str] = []
#: a SIGINT this soon (s) after the first is that Ctrl-C passed on: a launcher or
#: ``maxent_grpo.serve`` forwards the terminal's, which reached this process too
SAME_CTRL_C_S = 2.0


def take_sigterm(trainer: Any) -> None:
    """Give the trainer the handler above; before Lightning registers it (a callback's
    ``setup`` runs first)."""
    connector = trainer._signal_connector
    connector.sigterm_pending, connector.sigterm_per_batch = False, True

    termed: list[float] = []  # when this process's first SIGTERM came

    def notify(signum: int, _: FrameType | None) -> None:
        again = bool(termed) and time.monotonic() - termed[0] >= SAME_CTRL_C_S  # not passed on
        termed.append(time.monotonic())
        log.info("[rank %d] SIGTERM: the run stops after this batch%s", trainer.global_rank,
                 " (still running: a batch that never ends, a reward without a timeout that "
                 "hangs, blocks it; SIGKILL ends the process, unsaved)" if again else "")
        if not connector.sigterm_pending and trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(signum)  # the processes Lightning started
        connector.sigterm_pending = True
        if trainer.world_size == 1:
            connector.received_sigterm = True

    connector._sigterm_notifier_fn = notify
    INTERRUPTED.clear()

    first: list[float] = []  # when this process's first Ctrl-C came

    def note_interrupt(signum: int, frame: FrameType | None) -> None:
        if first and time.monotonic() - first[0] < SAME_CTRL_C_S:
            return  # the same Ctrl-C, passed on
        if first:
            log.info("[rank %d] Ctrl-C again: this process stops now, unsaved",
                     trainer.global_rank)
            INTERRUPTED.append("again")
            raise KeyboardInterrupt
        first.append(time.monotonic())
        INTERRUPTED.append("once")
        log.info("[rank %d] Ctrl-C: the run stops after this batch on every process (Ctrl-C "
                 "again stops this process now, without a checkpoint)", trainer.global_rank)
        connector.sigterm_pending = True

    register = connector.register_signal_handlers

    def register_with_interrupt() -> None:
        register()  # Lightning's: the handlers it found are put back at its teardown
        ignored = connector._original_handlers.get(signal.SIGINT) == signal.SIG_IGN  # `cmd &`
        if trainer.world_size > 1 and not ignored and (
                threading.current_thread() is threading.main_thread()):
            signal.signal(signal.SIGINT, note_interrupt)

    connector.register_signal_handlers = register_with_interrupt

    def note_requeue(signum: int, _: FrameType | None) -> None:
        log.info("[rank %d] SLURM's requeue signal %d: the checkpoint is saved after this "
                 "batch", trainer.global_rank, signum)
        connector.requeue_pending = True

    connector.requeue_pending = False
    connector._slurm_sigusr_handler_fn = note_requeue


def give_back_sigterm(trainer: Any) -> None:
    """Lightning's handler again, for a later run on the Trainer of another module."""
    if (connector := getattr(trainer, "_signal_connector", None)) is not None:
        vars(connector).pop("_sigterm_notifier_fn", None)
        vars(connector).pop("_slurm_sigusr_handler_fn", None)
        vars(connector).pop("register_signal_handlers", None)


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
    """Whether any rank was signalled (one all-reduce); sets ``received_sigterm`` on every
    rank if so. Called after the same batch on every rank: each training batch, an
    evaluation batch only where :func:`same_batches` allows it. After a training batch, a
    requeue signal that reached any rank is agreed on, for :func:`answer_requeue`."""
    connector = trainer._signal_connector
    if not (training or getattr(connector, "sigterm_per_batch", True)):
        return False
    flags = [bool(getattr(connector, "sigterm_pending", False)),
             training and bool(getattr(connector, "requeue_pending", False)),
             "once" in INTERRUPTED]
    if trainer.world_size > 1:
        strategy = trainer.strategy
        shared = torch.tensor(flags, dtype=torch.int32, device=strategy.root_device)
        flags = [f > 0 for f in strategy.reduce(shared, reduce_op="sum").tolist()]
    pending, requeued, interrupted = flags
    if interrupted and not INTERRUPTED:
        INTERRUPTED.append("shared")  # its exit too: 130
    if requeued:
        connector.requeue_pending, connector.requeue_agreed = False, True
    if pending:
        connector.received_sigterm = True
    return pending


def answer_requeue(trainer: Any) -> None:
    """After the user's callbacks' end of the training batch (the controllers' updates
    saved too), every rank: :func:`requeue` where :func:`share_sigterm` agreed on one."""
    connector = trainer._signal_connector
    if getattr(connector, "requeue_agreed", False):
        connector.requeue_agreed = False
        requeue(trainer)


def requeue(trainer: Any) -> None:
    """What Lightning's requeue handler does, at the end of a training batch (every rank):
    the loggers flushed, ``hpc_ckpt_N.ckpt`` saved into ``trainer.default_root_dir``, where
    a fit started again under SLURM resumes from it, and on global rank 0 ``scontrol
    requeue`` of the job (``SLURM_ARRAY_JOB_ID_SLURM_ARRAY_TASK_ID`` for an array's task);
    a requeue that fails is warned of and the run goes on."""
    if trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
        log.info("SLURM's requeue signal after the run's last step: nothing to requeue")
        return
    for logger in trainer.loggers if trainer.is_global_zero else ():
        logger.save()
        if callable(flush := getattr(getattr(logger, "experiment", None), "flush", None)):
            flush()
    folder = str(trainer.default_root_dir)
    found = trainer.strategy.broadcast(hpc_checkpoints(folder))  # rank 0's folder, its N
    path = os.path.join(folder, f"hpc_ckpt_{(found[-1][0] if found else 0) + 1}.ckpt")
    trainer.save_checkpoint(path)
    if not trainer.is_global_zero:
        return
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{os.environ.get('SLURM_ARRAY_TASK_ID')}" if array else os.environ.get(
        "SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_]+", job):
        log.warning("SLURM's requeue signal, but no SLURM job id (%r): not requeued", job)
        return
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True,
                              timeout=60)
        code, said = done.returncode, (done.stderr or done.stdout).strip()
    except (OSError, subprocess.TimeoutExpired) as err:
        code, said = -1, str(err)
    if code == 0:
        log.info("saved %s and requeued SLURM job %s", path, job)
    else:
        log.warning("scontrol requeue %s failed (%s): the job is not requeued; it goes on "
                    "until it ends or is stopped (a new job resumes it with --ckpt_path %s)",
                    job, said or f"exit code {code}", path)


def hpc_checkpoints(folder: str) -> list[tuple[int, str]]:
    """``(N, path)`` of each ``hpc_ckpt_N.ckpt`` in ``folder`` (none where it is no local
    folder), by ``N``: SLURM's requeue checkpoints (:func:`requeue`)."""
    folder = os.path.expanduser(folder)
    if not (is_local(folder) and os.path.isdir(folder)):
        return []
    return sorted((int(m[1]), os.path.join(folder, name)) for name in os.listdir(folder)
                  if (m := re.fullmatch(r"hpc_ckpt_(\d+)\.ckpt", name)))


def slurm_requeue_checkpoint(default_root_dir: str | None) -> str | None:
    """Under SLURM, the ``hpc_ckpt_N.ckpt`` with the highest ``N`` in ``default_root_dir``
    (the working folder when None): the checkpoint Lightning resumes a fit from when no
    ``--ckpt_path`` is given; else None."""
    found = hpc_checkpoints(str(default_root_dir or os.getcwd()))
    return found[-1][1] if found and SLURMEnvironment.detect() else None


def slurm_resume(stage: str, ckpt_path: str | None, default_root_dir: str | None
                 ) -> tuple[str | None, tuple[str, ...], str | None]:
    """SLURM's requeue checkpoint (:func:`slurm_requeue_checkpoint`) in a command's choice
    of checkpoint, which Lightning takes by itself where no ``--ckpt_path`` is given:
    ``(ckpt_path, extra candidates of "last", the refusal where nothing else resolves)``. A
    requeued job's ``fit`` (``SLURM_RESTART_COUNT`` >= 1) resolves ``last`` with it; a new
    job's, or another command's, is refused without ``--ckpt_path`` (it is an earlier
    job's, or would stand in for the configured model), and is a candidate of an explicit
    ``last`` (taken when it is the newest of the run: ``last`` passed over it)."""
    hpc = slurm_requeue_checkpoint(default_root_dir) if ckpt_path in (None, "last") else None
    if hpc is None:
        return ckpt_path, (), None
    if stage == "fit" and os.environ.get("SLURM_RESTART_COUNT", "0") not in ("", "0"):
        if ckpt_path is None:
            rank_zero_info(f"SLURM: a requeued job: the fit resumes from {hpc} or later")
        return "last", (hpc,), None
    refusal = (f"{hpc}, an earlier SLURM job's requeue checkpoint, would resume this new job "
               "(Lightning's rule)" if stage == "fit" else f"{hpc}, a SLURM requeue "
               f"checkpoint, would be loaded by {stage} in place of the configured model "
               "(Lightning's rule)") + (f": delete or move it, or name it on purpose with "
                                        f"--ckpt_path {hpc}")
    require(ckpt_path == "last", refusal)
    return ckpt_path, (hpc,), refusal


def resolve_with_requeue(resolve: Callable[..., ResolvedCheckpoint | None],
                         extra: tuple[str, ...], refusal: str | None
                         ) -> ResolvedCheckpoint | None:
    """``resolve(extra=...)`` with :func:`slurm_resume`'s answer: the requeue file is left
    out (with a warning) where it is another run's; a new job (``refusal`` set) takes it
    only where the savers' newest checkpoint is recorded as of the same run (else it may be
    an earlier job's of another run, a sweep's: the savers' is taken, or with none the job
    is refused)."""
    try:
        found = resolve(extra=extra)
    except ValueError as err:
        if not extra:
            raise
        rank_zero_warn(f"{extra[0]} is left out of --ckpt_path last: {err}")  # another run's
        found = resolve()
    if refusal is not None and found is not None and found.path in map(os.path.abspath, extra):
        alone = resolve()
        if alone is None or found.run is None or alone.run != found.run:
            if alone is not None:
                rank_zero_warn(f"{found.path} is left out of --ckpt_path last: this new job "
                               f"cannot tell it is of the run of {alone.path}")
            found = alone
    require(found is not None or refusal is None, str(refusal))  # Lightning's pick
    return found


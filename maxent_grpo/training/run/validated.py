"""A validation that a stop cut short runs when the fit resumes.

``ModelCheckpoint`` saves at a training batch's end, before that step's validation, and
Lightning resumes such a checkpoint after that validation. A run stopped while it validated
(Ctrl-C, SIGTERM, a kill: validation is long, so it is often where a stop lands) lost that
step's validation values, and a ``val/`` monitored saver that candidate, without a word.

The checkpoint cannot know whether the validation after it ended, so the validation's end
records it: :func:`note_validated` writes ``validated.json`` into each saver's folder (its
checkpoints' names, sizes and modification times). A checkpoint written
before a validation ended says so (:func:`saved_before_validation`); when a fit resumes from
one that file does not name, :func:`validate_first` runs that validation before the next
batch. A checkpoint moved without that file (``cp`` without ``-p``) has its validation run
again: a second point at the same step; a remote one (``s3://``) has no such file, and its
validation is not run again. A fit with no step left (its ``max_steps`` reached at that
checkpoint) runs none: a warning names ``validate``, whose end records the checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

from lightning.pytorch.utilities import rank_zero_info

from maxent_grpo.training.run.checkpoint import restore_rng_state
from maxent_grpo.training.run.checkpoint_io import atomic_write, is_local

MARKER = "validated.json"
#: the checkpoint's entry: True where it was written before a validation due at its step
VALIDATION_DUE = "maxent_grpo_validation_due"


def identity(path: str) -> list[int] | None:
    try:
        info = os.stat(path)  # a save_last link: its file's
    except OSError:
        return None
    return [info.st_size, info.st_mtime_ns]


def _read(path: str) -> dict[str, list[int]]:
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def _record(folder: str, paths: set[str]) -> None:
    """``paths`` (those that exist) recorded in ``folder``'s ``validated.json``, with the
    entries of files since replaced or deleted dropped."""
    marker = os.path.join(folder, MARKER)
    entries = {name: kept for name, kept in _read(marker).items()
               if identity(os.path.join(folder, name)) == kept}
    for path in filter(None, paths):
        if identity(path) is not None:
            entries[os.path.relpath(path, folder)] = identity(path)
    text = json.dumps(entries, indent=1).encode()
    atomic_write(marker, lambda f, text=text: f.write(text))


def note_validated(trainer: Any, loaded: list[int] | None = None) -> None:
    """At the end of a fit's validation (global rank 0): every checkpoint of this run's
    savers is recorded as validated in its folder's ``validated.json`` (those of earlier
    steps too: the run went on past them, so their validation ended; the entries of files
    since replaced or deleted are dropped). At the end of ``validate --ckpt_path``: that
    checkpoint, in its folder's, where its validation was due (``loaded``: its identity
    when it was loaded, which it must still have: not a ``last.ckpt`` a fit replaced
    since) and that folder can be written (what the warning of a resume with no step left
    asks for; a later resume does not run it again). Not for ``fast_dev_run``'s one
    batch."""
    if not trainer.is_global_zero or trainer.sanity_checking or trainer.fast_dev_run:
        return
    if trainer.state.fn == "validate":
        path = str(trainer.ckpt_path or "")
        if loaded is not None and is_local(path) and identity(path) == loaded:
            with contextlib.suppress(OSError):  # a read-only folder: it runs again, no more
                _record(os.path.dirname(os.path.abspath(path)), {path})
        return
    for saver in trainer.checkpoint_callbacks:
        folder = getattr(saver, "dirpath", None)
        if folder and is_local(folder):
            _record(folder, {*getattr(saver, "best_k_models", {}), *(getattr(
                saver, name, "") for name in ("best_model_path", "last_model_path",
                                              "_last_checkpoint_saved"))})


def saved_before_validation(trainer: Any, validation_ended: bool) -> bool:
    """Whether a checkpoint saved now comes before the end of a validation the fit runs at
    this step: saved during one (an error or a stop, ``save_on_exception``; not a saver's
    at its end, ``validation_ended``), or at a training batch's end (its step done, its
    validation not begun) with a validation due (Lightning's own test; not for
    ``val_check_interval`` as a time)."""
    if trainer.state.fn != "fit" or trainer.sanity_checking:
        return False
    if trainer.validating:
        return not validation_ended
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    progress = getattr(getattr(loop, "batch_progress", None), "current", None)
    return bool(
        progress is not None
        and progress.ready == progress.started == progress.processed == progress.completed + 1
        and getattr(trainer, "_val_check_time_interval", None) is None
        and loop._should_check_val_fx(trainer.fit_loop._data_fetcher))


def unvalidated(trainer: Any) -> bool:
    """On global rank 0: ``trainer.ckpt_path`` is named in no ``validated.json`` (its own
    folder's, or a saver's: a checkpoint in a metric's subfolder); False for a remote one,
    which has no such file (its validation is not run again on every resume)."""
    path = str(trainer.ckpt_path)
    if not is_local(path) or identity(path) is None:
        return False
    folders = {os.path.dirname(os.path.abspath(path)), *(
        os.path.abspath(saver.dirpath) for saver in trainer.checkpoint_callbacks
        if getattr(saver, "dirpath", None) and is_local(saver.dirpath))}
    return not any(identity(path) in _read(os.path.join(folder, MARKER)).values()
                   for folder in folders)


def validate_first(trainer: Any, due: bool, rng: dict[str, Any] | None = None) -> bool:
    """At the start of a fit resumed from ``trainer.ckpt_path`` (every rank): when that
    checkpoint came before the end of a validation (``due``: :func:`saved_before_validation`
    when it was saved) that no ``validated.json`` records (:func:`unvalidated`), run that
    validation now, logged at its step, in place of Lightning's resume (which skipped it, or
    ran the rest of one stopped midway), from the checkpoint's random state ``rng`` (that
    of the validation's start: it samples in a fork of it), so with the values it would
    have had; returns whether it ran."""
    due = due and trainer.enable_validation and trainer.is_global_zero and unvalidated(trainer)
    if not trainer.strategy.broadcast(due, src=0):
        return False
    rank_zero_info(f"the validation of step {trainer.global_step} did not end before the run "
                   "stopped: it runs first")
    loop = trainer.fit_loop.epoch_loop  # as Lightning runs one after a batch
    first = trainer._logger_connector._first_loop_iter
    trainer.validating = True
    loop.val_loop.batch_progress.current.reset()  # none of its batches counts
    if rng is not None:  # the first batch restores it again, as it would have been
        restore_rng_state(rng)
    loop.val_loop.run()
    loop.val_loop.reset_restart_stage()  # done: not to be finished by Lightning's resume
    trainer.training = True
    trainer._logger_connector._first_loop_iter = first
    return True

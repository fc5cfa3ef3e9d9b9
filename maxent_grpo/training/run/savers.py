"""A run's ``ModelCheckpoint`` savers across a resume: ``last.ckpt`` written over, not beside.

Lightning restores a saver's state (its ``last_model_path``, its best checkpoints) only into
a saver with the same ``state_key`` (its monitor, mode and intervals) and the same
``dirpath``; any other saver starts afresh, finds ``last.ckpt`` there and writes
``last-v1.ckpt`` beside it, leaving ``last.ckpt``, which ``validate``, ``predict`` and
``export`` are shown, at the old step. :func:`follow_savers` gives a saver its earlier state
where the checkpoint was written by the same run in the same folder: one whose folder moved
or was copied whole, and one whose options changed (another ``every_n_train_steps``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any

import lightning as L

from maxent_grpo.training.run import checkpoint_io as ckpt_io
from maxent_grpo.validation import temporary_name

__all__ = ["follow_savers", "whole_sharded_saves"]

#: the name a sharded checkpoint's earlier folder has while its new one takes its place
REPLACED = ".replaced"


def whole_sharded_saves(strategy: Any) -> None:
    """Sharded checkpoints (FSDP2's folders, ``ModelParallelStrategy``) written whole or not
    at all. Lightning writes the shards and then ``meta.pt`` into the folder in place: a run
    killed in a save left ``last.ckpt`` with the new shards beside the old ``meta.pt`` (its
    step, counters and random state), which a resume took without a word, training a step
    twice. Each save is written to ``.<name>.<host>-<pid>.tmp`` beside it (a killed one's is
    swept as the files' temporaries are), then takes the name; the earlier folder, moved to
    ``<name>.replaced`` for that instant, is removed."""
    if not getattr(strategy, "_save_distributed_checkpoint", False) or getattr(
            strategy, "whole_saves", False):
        return
    save = strategy.save_checkpoint

    def whole(checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if not ckpt_io.is_local(str(filepath)):
            return save(checkpoint, filepath, storage_options)
        path = Path(strategy.broadcast(str(filepath)))
        held = os.listdir(path) if path.is_dir() and not path.is_symlink() else ()
        if held and not {"meta.pt", ".metadata"} & set(held):
            raise IsADirectoryError(f"cannot save a checkpoint as {str(path)!r}: a folder that "
                                    "is not a checkpoint (it would be replaced)")
        partial = Path(strategy.broadcast(str(path.with_name(  # rank 0's name, on every rank
            temporary_name(path.name, ckpt_io.TMP_SUFFIX)))))
        try:
            save(checkpoint, partial, storage_options)
        except BaseException:  # a full disk: no checkpoint-sized folder left behind
            if strategy.is_global_zero:
                shutil.rmtree(partial, ignore_errors=True)
            raise
        _sync(partial)  # on disk before it takes the name (a node losing power, not a kill)
        strategy.barrier("whole_sharded_saves")  # every rank's shards are written
        aside = path.with_name(path.name + REPLACED)
        if strategy.is_global_zero:
            _remove(aside)
            moved = path.exists() or path.is_symlink()
            if moved:
                os.rename(path, aside)
            try:
                os.rename(partial, path)
            except BaseException:
                if moved:  # the earlier checkpoint back where it was
                    os.rename(aside, path)
                raise
            _sync(path.parent, files=False)  # the new name, on disk
        strategy.barrier("whole_sharded_saves")
        if strategy.is_global_zero:  # the others need not wait for it
            _remove(aside)

    strategy.save_checkpoint, strategy.whole_saves = whole, True


def _sync(folder: Path, files: bool = True) -> None:
    """fsync ``folder``'s files (``files``; each rank: those it wrote are among them) and the
    folder's own entries, where the system allows."""
    held: list[Path] = []
    with contextlib.suppress(OSError):  # (a folder gone: nothing to hold)
        held = [p for p in folder.iterdir() if p.is_file()] if files else []
    for path in [*held, folder]:
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def follow_savers(trainer: L.Trainer, checkpoint: dict[str, Any]) -> None:
    """Before Lightning restores the callbacks of ``checkpoint`` (a fit's resume):

    - a saver whose folder was moved or copied since (its state names another ``dirpath``)
      takes that state re-rooted in its folder, when every checkpoint it names is there
      (the folder moved whole) and the last one is of this run;
    - a saver with ``save_last`` and without a state in the checkpoint (its options
      changed), the only such one in its folder, takes the ``last_model_path`` of the one
      earlier saver of that folder no saver now has (its best checkpoints were chosen under
      other options: not taken), when that file is of this run.
    """
    states = checkpoint.get("callbacks") or {}
    keys = {getattr(saver, "state_key", None) for saver in trainer.checkpoint_callbacks}
    orphans = [state for key, state in states.items()
               if str(key).startswith("ModelCheckpoint") and key not in keys]
    fresh = [_folder(getattr(saver, "dirpath", None)) for saver in trainer.checkpoint_callbacks
             if getattr(saver, "state_key", None) not in states]  # the savers with no state
    for saver in trainer.checkpoint_callbacks:
        state = states.get(getattr(saver, "state_key", None))
        if state is None:
            here = _folder(getattr(saver, "dirpath", None))
            if getattr(saver, "save_last", False) and fresh.count(here) == 1:
                _adopt(saver, orphans, checkpoint, states)
            continue
        old, new = state.get("dirpath"), getattr(saver, "dirpath", None)
        if not (isinstance(old, str) and isinstance(new, str) and old != new):
            continue

        def moved(path: Any, old: str = old, new: str = new) -> Any:
            inside = isinstance(path, str) and path.startswith(old + os.sep)
            return os.path.join(new, os.path.relpath(path, old)) if inside else path

        last = moved(state.get("last_model_path"))
        named = [state.get(k) for k in ("best_model_path", "kth_best_model_path")]
        named = [last, *(p for p in named if p), *(state.get("best_k_models") or {})]
        if last == state.get("last_model_path") or not all(  # the whole folder is there
                os.path.exists(moved(p)) for p in named):
            continue
        if _of_this_run(last, checkpoint):
            state.update(dirpath=new, last_model_path=last,
                         best_model_path=moved(state.get("best_model_path")),
                         kth_best_model_path=moved(state.get("kth_best_model_path")),
                         best_k_models={moved(k): v for k, v in
                                        (state.get("best_k_models") or {}).items()})


def _adopt(saver: Any, orphans: list[dict[str, Any]], checkpoint: dict[str, Any],
           states: dict[str, Any]) -> None:
    """The state ``saver`` restores when its options changed: the one earlier saver's
    ``last_model_path`` in the same folder (nothing when none or several)."""
    here = getattr(saver, "dirpath", None)
    same = [s for s in orphans if isinstance(here, str) and isinstance(s.get("dirpath"), str)
            and _folder(s["dirpath"]) == _folder(here)]
    last = same[0].get("last_model_path") if len(same) == 1 else None
    if isinstance(last, str) and last and _of_this_run(last, checkpoint):
        states[saver.state_key] = {"dirpath": here, "last_model_path": last,
                                   "best_model_score": None, "best_model_path": ""}


def _folder(path: Any) -> Any:
    return os.path.realpath(path) if isinstance(path, str) else path


def _of_this_run(path: str, checkpoint: dict[str, Any]) -> bool:
    """``path`` is a checkpoint of fit written by the run ``checkpoint`` is of."""
    problem, index = ckpt_io._usable(path, False, False)
    return problem is None and (index or {}).get(ckpt_io.RUN_KEY) == checkpoint.get(
        ckpt_io.RUN_KEY)

"""Hugging Face export of the trained policy, as a Lightning callback.

Added under ``trainer.callbacks`` in YAML::

    - class_path: maxent_grpo.training.callbacks.HFExport
      init_args: {every_n_train_steps: 100}

:func:`export_policy` writes the folders; ``python -m maxent_grpo.cli.export`` uses it to export
a checkpoint without a fit.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from maxent_grpo.adapters import check_lora_bias, has_adapters, merged_copy, name_base
from maxent_grpo.builtin.catalog import is_builtin
from maxent_grpo.models import load_policy, model_chain
from maxent_grpo.rollout.weights import sharded_state_dict
from maxent_grpo.training.callbacks.run_report import why_no_training
from maxent_grpo.training.run.folders import run_dir
from maxent_grpo.validation import check_bool, check_int, no_room, require, unwritable

__all__ = ["EXPORT_COMMAND", "HFExport", "export_policy"]

log = logging.getLogger(__name__)

#: the command that exports a checkpoint without a fit (:mod:`maxent_grpo.cli.export`)
EXPORT_COMMAND = "python -m maxent_grpo.cli.export <checkpoint.ckpt> --output <folder>"


def save_tokenizer(tokenizer: Any, folder: Path) -> None:
    """``tokenizer.save_pretrained(folder)`` with the padding side and pad token its own
    files gave it (the trainer pads on the left for generation, which an export wrote into
    the files of a tokenizer that padded on the right, and pads with eos where a tokenizer
    has no pad token, which an export wrote as its pad: a collator masking pad labels then
    masks every eos, and a model tuned from the export never learns to stop)."""
    trained, pad = getattr(tokenizer, "padding_side", None), getattr(tokenizer, "pad_token", None)
    files = getattr(tokenizer, "init_kwargs", None) or {}
    own = files.get("padding_side") or trained
    try:
        if own is not None:
            tokenizer.padding_side = own
        if pad is not None and files.get("pad_token") is None:
            tokenizer.pad_token = None
        tokenizer.save_pretrained(folder)
    finally:
        if trained is not None:
            tokenizer.padding_side = trained
        if pad is not None:
            tokenizer.pad_token = pad


def export_policy(model: Any, tokenizer: Any, out: str | os.PathLike[str], source: Any = None,
                  merged: bool = False, state_dict: dict[str, Any] | None = None) -> list[Path]:
    """``save_pretrained`` of ``model`` and ``tokenizer`` into ``out``; returns the folders
    written.

    For a ``peft`` model the folder holds the adapter, whose ``adapter_config.json`` names
    its base ``source.name_or_path`` when that is a ``builtin:`` name (else what peft
    records: the hub id or the folder's absolute path); it loads with
    :func:`~maxent_grpo.models.load_policy` or as ``model.model_name_or_path`` (adapter
    merged into the base). With ``merged`` a second folder ``<out>-merged`` holds the plain
    model with the adapters folded in (:func:`~maxent_grpo.adapters.merged_copy`, from a
    fresh copy of the base that ``source`` names: ``name_or_path``, ``dtype``,
    ``cache_dir``); ``merged`` is ignored without adapters. ``state_dict``: the model's whole
    one when its own tensors are FSDP2 shards (:func:`~maxent_grpo.rollout.weights.
    sharded_state_dict`, gathered by every rank).
    """
    out = Path(os.path.realpath(os.path.expanduser(out)))  # a link's folder is replaced
    adapters = has_adapters(model)
    name = getattr(source, "name_or_path", None)
    merged_out = out.with_name(f"{out.name}-merged") if merged and adapters else None
    clash = replaced_model(source, [out] if merged_out is None else [out, merged_out])
    require(clash is None, f"exporting into {str(out)!r} would replace the folder the model "
                           f"loads from ({clash}): export into another folder")
    if merged_out is not None:  # before anything is written
        check_lora_bias(model, "the merged model", "export the adapter alone (not merged)")

    def write(folder: Path) -> None:
        with _without_bars():  # its "Writing model shards" line broke the fit's progress bar
            model.save_pretrained(folder, state_dict=state_dict)
        if adapters and name and is_builtin(name):
            name_base(folder, name)
        save_tokenizer(tokenizer, folder)

    _replace(out, write)
    log.info("exported the policy%s and tokenizer to %s", "'s adapter" if adapters else "", out)
    if merged_out is None:
        return [out]
    require(source is not None, "export_policy(merged=True) needs the model's source")
    base = load_policy(source.name_or_path, dtype=source.dtype, cache_dir=source.cache_dir)
    whole = merged_copy(model, base, state_dict)
    with _without_bars():
        _replace(merged_out, lambda folder: (whole.save_pretrained(folder),
                                             save_tokenizer(tokenizer, folder)))
    log.info("exported the merged model to %s", merged_out)
    return [out, merged_out]


@contextlib.contextmanager
def _without_bars() -> Iterator[None]:
    """transformers' progress bars off for the call (as they were after it)."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def replaced_model(source: Any, targets: list[Path]) -> str | None:
    """A folder the model of ``source`` loads from (its own, or an adapter's base) that
    writing the folders ``targets`` would replace (a run exporting over the model it
    trains from lost it, and a resumed run took its KL to the trained policy); None."""
    name = getattr(source, "name_or_path", None)
    for folder in [] if name is None else model_chain(name, getattr(source, "cache_dir", None)):
        real = Path(os.path.realpath(folder))
        if any(real == t or t in real.parents for t in map(Path, targets)):
            return folder
    return None


def _owner() -> str:
    """The writer named in an export's temporary folders: ``.<name>.partial-<host>-<pid>``
    beside the export, ``.partial-<host>-<pid>`` inside it (``old`` for the earlier one)."""
    return f"{socket.gethostname()}-{os.getpid()}"


#: the file an export holds locked in its temporary folder while it writes there: a
#: temporary folder whose file no process holds was left by a writer that was killed
WRITING = ".maxent-grpo-writing"
_TEMPORARY = {False: re.compile(r"\..+\.partial-(?P<host>.+)-\d+"),
              True: re.compile(r"\.partial-(?P<host>.+)-\d+")}
#: another host's temporary folder is removed only once untouched this long (seconds): a
#: shared file system may not show one host's locks to another (NFS ``nolock``, FUSE)
OTHER_HOSTS_AFTER = 24 * 3600.0


@contextlib.contextmanager
def _writing(folder: Path) -> Iterator[None]:
    """``folder`` (new) marked as an export's temporary folder for the call: its
    :data:`WRITING` file, locked (``flock``; the lock goes with the process, however it
    ends; a file system without locks: no mark, so nothing takes it for a killed one's).
    The file stays until the files are in place (:func:`_written`)."""
    fd = os.open(folder / f"{WRITING}.new", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            os.unlink(folder / f"{WRITING}.new")
        else:
            os.replace(folder / f"{WRITING}.new", folder / WRITING)  # found only once locked
        yield
    finally:
        os.close(fd)


def _written(folder: Path) -> None:
    with contextlib.suppress(OSError):  # a hidden empty file left behind at worst
        os.unlink(folder / WRITING)


def _abandoned(folder: Path) -> bool:
    """Whether ``folder`` is an export's temporary folder whose writer is gone."""
    try:
        fd = os.open(folder / WRITING, os.O_RDWR)
    except OSError:
        return False  # no mark: not an export's (or being moved into place)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # its writer is at it (or the file system has no locks)
    finally:
        os.close(fd)
    return True


def _idle_seconds(folder: Path) -> float:
    """How long nothing in ``folder`` has changed (0 when that cannot be read)."""
    try:
        return time.time() - max(p.stat().st_mtime for p in [folder, *folder.rglob("*")])
    except OSError:
        return 0.0


def clear_leftovers(folder: Path, inside: bool = False) -> None:
    """Remove the temporary folders that exports into ``folder``'s folders (``inside``:
    into ``folder`` itself) left when they were killed (``kill -9``, out of memory), each
    the size of a model: those whose :data:`WRITING` file no process holds locked (another
    host's: also untouched for :data:`OTHER_HOSTS_AFTER`)."""
    if not folder.is_dir():
        return
    here = socket.gethostname()
    for path in folder.iterdir():
        found = _TEMPORARY[inside].fullmatch(path.name)
        if found is None or not path.is_dir() or not _abandoned(path):
            continue
        if found["host"] != here and _idle_seconds(path) < OTHER_HOSTS_AFTER:
            continue
        shutil.rmtree(path, ignore_errors=True)
        log.info("removed %s, left by an export that was killed", path)


def _replace(out: Path, write: Any) -> None:
    """:func:`_write_export`, a write that finds no room named with the folder (safetensors
    called it "a bug")."""
    earlier = out.is_dir() and any(p.name != "lost+found" for p in out.iterdir())
    try:
        _write_export(out, lambda folder: (write(folder), _umask_modes(folder)), earlier)
    except Exception as err:
        keep = ("the export there before is kept" if earlier else "nothing was left") + (
            f"; a checkpoint exports again with {EXPORT_COMMAND}")
        if (full := no_room(err, f"the export {out}", keep)) is not None:
            raise full from err
        raise


def _umask_modes(folder: Path) -> None:
    """The files of ``folder`` given the mode the umask gives a new file: safetensors writes
    the weights owner-only, so another user (a vLLM server's account) could read an export's
    config but not its weights."""
    probe = folder / ".mode-probe"
    probe.touch()
    mode = probe.stat().st_mode & 0o777
    probe.unlink()
    for path in folder.rglob("*"):
        with contextlib.suppress(OSError):
            if path.is_file() and path.stat().st_mode & 0o777 != mode:
                path.chmod(mode)


def _write_export(out: Path, write: Any, earlier: bool) -> None:
    """``write(folder)`` the export into ``out``, beside it first, then swapped in: a failed
    or interrupted write (Ctrl-C) leaves no partial folder that loads as a broken model,
    and an earlier export in ``out`` (``earlier``: a run before this one into it) is
    replaced whole (written over, its files that this export lacks, an adapter beside a full
    model, would have made the folder load as the earlier model) or, if the write fails,
    kept. A folder that cannot be renamed (a mount point, a bind mount) or written beside (a
    parent folder that is not writable) is written inside instead (:func:`_swap_inside`)."""
    tmp, old = (out.with_name(f".{out.name}.{kind}-{_owner()}") for kind in ("partial", "old"))
    clear_leftovers(out.parent)
    for leftover in (tmp, old):  # this process's, from an export it gave up
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        if os.path.ismount(out):
            raise OSError("a mount point")
        tmp.mkdir(parents=True)
    except OSError:
        out.mkdir(parents=True, exist_ok=True)
        clear_leftovers(out, inside=True)
        staging = out / f".partial-{_owner()}"
        staging.mkdir()
        try:
            with _writing(staging):  # marked until its files are in place
                write(staging)
                _swap_inside(out, staging)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    else:
        with _writing(tmp):  # marked until its files are in place
            _swap_beside(out, tmp, old, write)
    if earlier:
        log.info("replaced the earlier export in %s", out)


def _swap_beside(out: Path, tmp: Path, old: Path, write: Any) -> None:
    """:func:`_replace`'s export written into ``tmp`` beside ``out``, then renamed onto it
    (``out`` moved to ``old`` first when it holds anything); a folder that cannot be
    renamed (a bind mount: EBUSY) gets the files moved in (:func:`_swap_inside`)."""
    held = out.is_dir() and any(out.iterdir())
    try:
        write(tmp)
        try:
            if held:
                os.replace(out, old)
                try:
                    os.replace(tmp, out)
                except BaseException:
                    os.replace(old, out)  # the earlier export back where it was
                    raise
            else:
                os.replace(tmp, out)  # a new folder, or onto an empty one
            _written(out)
        except OSError as err:  # a bind mount (EBUSY): the files are moved in instead
            if err.errno not in (errno.EBUSY, errno.EXDEV, errno.EPERM):
                raise
            _swap_inside(out, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)


def _swap_inside(out: Path, new: Path) -> None:
    """Replace what ``out`` holds (but ``lost+found`` and ``new``) with ``new``'s files: the
    earlier ones are moved aside inside ``out`` first, and back if the move in fails."""
    aside = out / f".old-{_owner()}"
    shutil.rmtree(aside, ignore_errors=True)
    aside.mkdir()
    skip = {aside.name, new.name, "lost+found"}
    earlier = [p for p in out.iterdir() if p.name not in skip]
    for item in earlier:
        os.replace(item, aside / item.name)
    moved: list[Path] = []
    try:
        for item in [p for p in new.iterdir() if p.name != WRITING]:  # marked till the end
            shutil.move(str(item), str(out / item.name))  # a copy across file systems
            moved.append(out / item.name)
    except BaseException:
        for path in moved:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        for item in aside.iterdir():
            os.replace(item, out / item.name)
        raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)


class HFExport(Callback):
    """Save ``pl_module.runtime``'s model and tokenizer with ``save_pretrained`` (rank 0;
    :func:`export_policy`).

    At the end of training into ``<dirpath>/final`` and, with ``every_n_train_steps``, each
    time the global step passes a multiple of it into ``<dirpath>/step-<global_step>``.

    A fit that runs no training step (``fit --ckpt_path`` of a run that already reached
    ``trainer.max_steps``, ``max_epochs`` or ``max_time``, or no training batches) never
    reaches the end of training in Lightning: then, at the end of the fit, the weights a
    checkpoint loaded are exported to ``final`` anyway, and a warning says that nothing
    trained and why (without a checkpoint nothing is exported, and the warning says so).

    With ``model.peft`` the folder holds the adapter, and with ``merged`` a second folder
    ``<name>-merged`` the plain model with the adapters folded in (:func:`export_policy`);
    a hub base's adapter also loads with ``peft.AutoPeftModelForCausalLM.from_pretrained``.

    Args:
        dirpath: output folder (``~`` expanded); None means ``<run folder>/hf`` (the
            logger's version folder). Refused when an export would replace the folder the
            model loads from (a run continuing from ``<dirpath>/final``).
        every_n_train_steps: also export every this many optimizer steps; None: only at the end.
        merged: with ``peft`` adapters, also write the merged model to ``<name>-merged``
            (ignored without adapters: ``<name>`` is the whole model then).
    """

    def __init__(self, dirpath: str | None = None, every_n_train_steps: int | None = None,
                 merged: bool = False) -> None:
        require(dirpath is None or bool(str(dirpath).strip()),
                f"HFExport.dirpath must be None or a non-empty path; got {dirpath!r}")
        check_int("HFExport.every_n_train_steps", every_n_train_steps, minimum=1, allow_none=True)
        check_bool("HFExport.merged", merged)
        self.dirpath = None if dirpath is None else os.path.expanduser(dirpath)
        self.every_n_train_steps = every_n_train_steps
        self.merged = merged
        self._last_step = 0
        self._training_ended = False  # on_train_end ran in this fit

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Pick ``dirpath`` and make sure it can be written before anything trains (it was
        found out at the end of training, which then lost the last checkpoint too)."""
        if self.dirpath is None:
            self.dirpath = os.path.join(run_dir(trainer), "hf")
        self._training_ended = False
        if stage != "fit":
            return
        problem = unwritable(self.dirpath, folder=True) if trainer.is_global_zero else None
        if problem is None and trainer.is_global_zero:  # the folders an export replaces
            out = Path(os.path.realpath(self.dirpath))
            clash = replaced_model(getattr(pl_module, "source", None), [
                out / "final", out / "final-merged", *out.glob("step-*")])
            problem = clash and f"it holds the folder the model loads from ({clash})"
        require(trainer.strategy.reduce_boolean_decision(problem is None, all=True),
                f"HFExport.dirpath {str(self.dirpath)!r} cannot be a folder to export into: "
                f"{problem or 'see global rank 0'}")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step  # a resumed run does not re-export at once
        policy = getattr(pl_module, "policy", None)
        if self.merged and has_adapters(policy):  # it failed at the end, after training
            check_lora_bias(policy, "HFExport(merged=true)", "set merged: false (the adapter "
                            "folder is kept), or model.peft's lora_bias: false")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:
        n = self.every_n_train_steps
        step = trainer.global_step
        if n is not None and step // n > self._last_step // n:
            self.export(trainer, pl_module, f"step-{step}")
        self._last_step = step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._training_ended = True
        self.export(trainer, pl_module, "final")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After a fit whose training loop Lightning skipped (see the class docstring)."""
        if self._training_ended:
            return
        loaded = trainer.ckpt_path
        out = self.export(trainer, pl_module, "final") if loaded is not None else None
        if not trainer.is_global_zero:
            return
        done = (f"exported the weights loaded from {loaded} to {out}" if out is not None
                else "nothing was exported (no checkpoint was loaded)")
        log.warning("HFExport: this fit ran no training step (%s): %s. To export a "
                    "checkpoint without a fit: %s",
                    why_no_training(trainer), done, EXPORT_COMMAND)

    def export(self, trainer: pl.Trainer, pl_module: pl.LightningModule, name: str) -> Path | None:
        """:func:`export_policy` of ``pl_module.runtime``'s model and tokenizer into
        ``<dirpath>/<name>`` (with ``merged`` also ``<name>-merged``); returns that path
        (None on other ranks; on every rank under ``fast_dev_run``, which exports nothing, as
        it saves no checkpoint). Every rank calls it: an FSDP2-sharded model is gathered
        first."""
        if getattr(trainer, "fast_dev_run", False):
            return None
        runtime = pl_module.runtime
        whole = sharded_state_dict(runtime.model, keep=trainer.is_global_zero)  # a collective
        if not trainer.is_global_zero:
            return None
        assert self.dirpath is not None, "HFExport.setup() sets dirpath"
        out = Path(self.dirpath) / name
        export_policy(runtime.model, runtime.tokenizer, out,
                      source=getattr(pl_module, "source", None), merged=self.merged,
                      state_dict=whole)
        return out

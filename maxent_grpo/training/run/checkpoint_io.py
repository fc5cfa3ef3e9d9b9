"""Runs that stay whole (docs/CHECKPOINTS.md, "Runs that stay whole"): atomic checkpoint
writes (:class:`AtomicCheckpointIO`), ``--ckpt_path`` resolved to the usable checkpoint of
one run (:func:`resolve_checkpoint`), and resumed logs (:class:`LoggerVersions`;
a CSVLogger's rows: :func:`~maxent_grpo.training.run.folders.continue_csv_log`).

"Usable" is checked without loading the tensors: a complete zip archive (``torch.save``'s
format, whose central directory is written last) whose members lie inside the file, with a
loadable pickled index (memory-mapped); the one taken is also read whole against its
checksums (:func:`checkpoint_problem`'s ``full``).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import shutil
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_warn

from maxent_grpo.training.run.checkpoint import CHECKPOINT_KEY, fit_batches
from maxent_grpo.training.run.folders import absolute_folder
from maxent_grpo.validation import HOST as _HOST
from maxent_grpo.validation import no_room, temporary_name

log = logging.getLogger(__name__)

#: Top-level checkpoint entries written by :class:`LoggerVersions`.
LOGGERS_KEY = "maxent_grpo_loggers"
RUN_KEY = "maxent_grpo_run"
#: ``--ckpt_path`` values that Lightning resolves itself (not file names)
LIGHTNING_NAMES = ("best", "hpc", "registry")
#: The temporary files of :class:`AtomicCheckpointIO`: ``.<name>.<host>-<pid>.tmp``.
TMP_SUFFIX = ".tmp"


def is_local(path: str | os.PathLike) -> bool:
    """Whether ``path`` is on this machine's file system (no URL scheme but ``file://``)."""
    return "://" not in str(path) or str(path).startswith("file://")


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local writes are atomic (:func:`atomic_write`); remote
    paths (``s3://`` ...) use Lightning's own write."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        # a remote path, or storage_options, which Lightning's write refuses (TypeError)
        if storage_options is not None or not is_local(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        atomic_write(str(path).removeprefix("file://"), lambda f: self.write(checkpoint, f))

    def write(self, checkpoint: dict[str, Any], f: IO[bytes]) -> None:
        """Serialise ``checkpoint`` into the open temporary file (tests override this)."""
        torch.save(checkpoint, f)


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> None:
    """Write a file whole or not at all: ``write(f)`` fills ``.<name>.<host>-<pid>.tmp`` in the
    target folder, which is fsync-ed and renamed over ``path`` (``os.replace``), then the
    folder is fsync-ed where possible. On an error the temporary file is removed."""
    path = os.path.abspath(path)
    folder, name = os.path.split(path)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, temporary_name(name, TMP_SUFFIX))
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(err, Exception) and (
                full := no_room(err, path, "the files written before are kept")):
            raise full from err  # torch's zip writer said "unexpected pos ...": "a bug"
        raise
    with contextlib.suppress(OSError):  # the folder's entry, where the system allows
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


#: what a sharded checkpoint's folder holds: torch's distributed checkpoint (FSDP2) writes
#: ``.metadata`` and Lightning ``meta.pt`` beside it; DeepSpeed ``latest`` and ``checkpoint/``
SHARDED_MARKS = frozenset({".metadata", "meta.pt", "latest", "checkpoint"})


def checkpoint_problem(path: str | os.PathLike, full: bool = True, trusted: bool = False
                       ) -> str | None:
    """Why ``path`` cannot be resumed from, or ``None`` when it looks complete (a sharded
    checkpoint's folder is accepted as is, FSDP2's with its ``meta.pt``; DeepSpeed's).
    ``full``: every entry is also read against its checksum (the whole file: damaged tensor
    bytes leave the index intact). A file is loaded only as ``torch.load(weights_only=True)``
    does, never running code it holds, unless ``trusted`` (``--weights_only false``)."""
    path = str(path)
    if os.path.islink(path) and not os.path.exists(path):
        return f"a symlink to a missing file ({os.readlink(path)})"
    if os.path.isdir(path):
        names = set(os.listdir(path))
        if names & SHARDED_MARKS:  # FSDP2's shards without meta.pt: cut short (older saves)
            cut = ".metadata" in names and "meta.pt" not in names
            return "FSDP2 shards without Lightning's meta.pt (a save cut short)" if cut else None
        inside = sorted(n for n in names if n.endswith(".ckpt"))[:5]
        return "a folder, not a checkpoint" + (
            f" (it holds {', '.join(inside)}: give one of them)" if inside else
            " (a Hugging Face model folder goes to --model.model_name_or_path)"
            if "config.json" in names else " (give a .ckpt file written by a fit)")
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as file:  # safetensors: 8 bytes of header length, then JSON
            head = file.read(9)
    except OSError as err:
        return f"cannot be read ({err})"
    if size == 0:
        return "empty (0 bytes)"
    if head[8:] == b"{":
        return ("a safetensors weights file, not a checkpoint written by fit (a Hugging Face "
                "model's folder goes to --model.model_name_or_path)")
    if not zipfile.is_zipfile(path):
        # torch.save's legacy (non-zip) format, or a truncated zip without its directory
        try:
            saved = torch.load(path, map_location="cpu", weights_only=not trusted)
        except Exception as err:  # noqa: BLE001 -- any failure means "not usable"
            return f"truncated, corrupt or unsafe ({size} bytes; {_load_error(err, trusted)})"
        return _not_fit(saved)
    try:
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
            if not any(i.filename.endswith("data.pkl") for i in infos):
                return f"not a torch checkpoint ({size} bytes, no data.pkl)"
            end = max(i.header_offset + len(i.FileHeader()) + i.compress_size for i in infos)
            if end > size:
                return f"truncated ({size} bytes, its index needs {end})"
            # (one written without checksums, as torch can: nothing to compare)
            for info in (i for i in infos if full and i.CRC != 0):
                try:
                    with archive.open(info) as entry:
                        while entry.read(1 << 24):
                            pass
                except zipfile.BadZipFile:
                    return f"corrupt ({size} bytes; {info.filename} does not match its checksum)"
    except (zipfile.BadZipFile, OSError, ValueError) as err:
        return f"truncated or corrupt ({size} bytes; {err})"
    return None


@dataclass
class ResolvedCheckpoint:
    """The checkpoint a run resumes from and what was skipped to find it."""

    path: str
    global_step: int | None = None
    loggers: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, problem)
    run: str | None = None  # LoggerVersions' run identity; None before it was recorded
    #: the training batches it had run: the logging step the resumed fit writes first (the
    #: optimizer steps with num_iterations k > 1 are k times as many); None: not recorded
    log_step: int | None = None
    trusted: bool = False  # loaded with weights_only=False (--weights_only false)
    seed: int | bool | None = None  # the run's seed_everything (False: unseeded); None: not
    # recorded (an older checkpoint, or one without an index to read)
    #: each ModelCheckpoint's dirpath then and the checkpoints it named (a run folder moved)
    saved_in: tuple[tuple[str, tuple[str, ...]], ...] = ()


def checkpoint_files(folder: str, below: bool = True) -> list[str]:
    """The ``*.ckpt`` files in ``folder`` and (``below``) its subfolders: a file name holding
    a metric's name (``{val/pass@1}``) puts the file in one (``step=2-val/pass@1=0.125.ckpt``)."""
    pattern = os.path.join(glob.escape(folder), "**" if below else "", "*.ckpt")
    return glob.glob(pattern, recursive=below)


def _candidates(dirpaths: list[str], extra: tuple[str, ...] = (), below: bool = True
                ) -> list[str]:
    """Every ``*.ckpt`` of ``dirpaths`` (and their subfolders: ``below``) and the files
    ``extra``, newest first (a ``last*`` name wins a tie)."""
    found: dict[str, tuple[float, bool]] = {}
    folders = [str(f).removeprefix("file://") for f in dirpaths]
    listed = [checkpoint_files(f, below) for f in folders if is_local(f) and os.path.isdir(f)]
    for paths in (*listed, extra):
        for path in paths:
            try:
                mtime = os.stat(path).st_mtime  # a symlink's target's time
            except OSError:
                mtime = os.lstat(path).st_mtime  # dangling: still listed, then skipped
            found[os.path.abspath(path)] = (mtime, os.path.basename(path).startswith("last"))
    return sorted(found, key=found.get, reverse=True)


def _load_error(err: Exception, trusted: bool) -> str:
    text = str(err).strip()
    found = re.search(r"Unsupported global: GLOBAL (\S+)", text)  # what a safe load refuses
    what = f"it holds {found[1]}" if found else f"{type(err).__name__}: {text[:300]}"
    return what if trusted else (f"torch.load(weights_only=True), as a checkpoint written by "
                                 f"fit loads: {what}; a file you trust: --weights_only false")


def _not_fit(saved: Any) -> str | None:
    """Why what a file holds is no checkpoint of a fit, or None."""
    return None if isinstance(saved, dict) and "state_dict" in saved else (
        "not a checkpoint written by fit (no state_dict; a Hugging Face model's folder goes to "
        "--model.model_name_or_path)")


def _usable(path: str, need_training_state: bool, full: bool = True, trusted: bool = False,
            ) -> tuple[str | None, dict[str, Any] | None]:
    if (problem := checkpoint_problem(path, full, trusted)) is not None:
        return problem, None
    folder = os.path.isdir(path)  # sharded (FSDP2): Lightning's meta.pt holds the index
    source = os.path.join(path, "meta.pt") if folder else path
    if not (os.path.isfile(source) and zipfile.is_zipfile(source)):
        return None, None  # a legacy file, another folder: no index to read without loading
    try:  # the checkpoint's entries with the tensors memory-mapped (not read)
        index = torch.load(source, map_location="cpu", mmap=True, weights_only=not trusted)
    except Exception as err:  # noqa: BLE001
        return f"its index cannot be loaded ({_load_error(err, trusted)})", None
    if not folder and (problem := _not_fit(index)) is not None:
        return problem, None
    if need_training_state and not folder and "optimizer_states" not in index:
        return "weights only (no optimizer or loop state to resume)", None
    return None, index


def _resolved(path: str, index: dict | None, skipped, trusted: bool = False) -> ResolvedCheckpoint:
    index = index or {}
    step, batches = index.get("global_step"), fit_batches(index)
    return ResolvedCheckpoint(
        path=path, global_step=int(step) if step is not None else None,
        loggers=list(index.get(LOGGERS_KEY) or []), skipped=skipped, run=index.get(RUN_KEY),
        log_step=batches, trusted=trusted,
        seed=(index.get(CHECKPOINT_KEY) or {}).get("seed"), saved_in=tuple((s["dirpath"], tuple(
            p for p in (s.get("last_model_path"), s.get("best_model_path"), *(s.get(
                "best_k_models") or {})) if isinstance(p, str) and p)) for s in (index.get(
                    "callbacks") or {}).values() if isinstance(s, dict) and isinstance(
                        s.get("dirpath"), str)))


def _describe(found: ResolvedCheckpoint) -> str:
    import datetime

    when = datetime.datetime.fromtimestamp(os.stat(found.path).st_mtime)
    return (f"{found.path} (run {found.run or 'unrecorded'}, step {found.global_step}, "
            f"written {when:%Y-%m-%d %H:%M:%S})")


def _latest_of_one_run(usable: list[ResolvedCheckpoint], dirpaths: list[str]) -> ResolvedCheckpoint:
    """The checkpoint of the highest step among ``usable`` (newest first), which must all
    belong to one run; ValueError naming them all otherwise."""
    runs = {found.run for found in usable if found.run is not None}  # unrecorded: any run
    if len(runs) > 1:
        listing = "; ".join(_describe(found) for found in usable)
        raise ValueError(
            f"--ckpt_path last: {dirpaths} hold the checkpoints of {len(runs)} different runs, "
            f"so which one to continue is ambiguous: {listing}. Pass the file to resume "
            "(--ckpt_path <file>), or move the other runs' checkpoints away")
    steps = [-1 if found.global_step is None else found.global_step for found in usable]
    return usable[steps.index(max(steps))]  # the newest of the highest step


def resolve_checkpoint(
    ckpt_path: str, dirpaths: list[str], need_training_state: bool = True,
    trusted: bool = False, extra: tuple[str, ...] = (),
) -> ResolvedCheckpoint | None:
    """The checkpoint ``ckpt_path`` stands for, checked.

    ``"last"``: the usable ``*.ckpt`` of ``dirpaths`` (and the files ``extra``: SLURM's
    requeue checkpoint) with the highest global step (the newest among equals), when they
    all belong to one run (:class:`LoggerVersions`' record);
    ValueError naming every candidate when they belong to several (a smoke test or a second
    run into the same folder: which one to continue is the user's choice). Unusable files
    are skipped with a warning; ``None`` when there is none (a fit starts afresh; for an
    evaluation, ValueError); ValueError when none is usable. A local file: itself when
    usable, else ValueError naming the newest usable one in its folder; a missing local
    file: ValueError. ``"best"`` for an evaluation: the best checkpoint the newest one
    recorded. Anything else (a fit's ``"best"``, a URL): ``None``, left to Lightning.
    """
    if is_local(ckpt_path) and ckpt_path.startswith("~"):  # not expanded by a shell
        ckpt_path = os.path.expanduser(ckpt_path)  # (--ckpt_path=~/x, or quoted)
    if ckpt_path == "best" and not need_training_state and all(map(is_local, dirpaths)):
        ckpt_path = _best(dirpaths, trusted, extra)
    if ckpt_path == "last":
        skipped: list[tuple[str, str]] = []
        usable: list[ResolvedCheckpoint] = []
        for path in _candidates(dirpaths, extra):
            problem, index = _usable(path, need_training_state, False, trusted)
            if problem is None:
                usable.append(_resolved(path, index, skipped, trusted))
            else:
                skipped.append((path, problem))
        while usable:  # the one taken is read whole, the others only by their index
            found = _latest_of_one_run(usable, dirpaths)
            if (problem := checkpoint_problem(found.path, trusted=trusted)) is None:
                break
            skipped.append((found.path, problem))
            usable.remove(found)
        names = "; ".join(f"{p}: {why}" for p, why in skipped)
        if usable:
            if skipped:
                rank_zero_warn(f"--ckpt_path last: skipped unusable checkpoint(s) ({names}); "
                               f"resuming from the latest usable one, {found.path}")
            return found
        if skipped:
            raise ValueError(f"--ckpt_path last: no usable checkpoint in {dirpaths} ({names}); "
                             "delete or move them to start afresh")
        if not need_training_state and all(map(is_local, dirpaths)):  # else Lightning's
            where = dirpaths or "no folder (no ModelCheckpoint has a dirpath)"
            raise ValueError(f"--ckpt_path last: no checkpoint in {where}; pass a .ckpt file, "
                             "or leave --ckpt_path out to evaluate the configured model")
        return None
    if not is_local(ckpt_path) or ckpt_path in LIGHTNING_NAMES or ckpt_path.startswith(
            "registry:"):
        return None
    if not os.path.lexists(ckpt_path):
        near = _candidates([os.path.dirname(os.path.abspath(ckpt_path))], below=False)[:3]
        hint = f" (checkpoints in that folder: {', '.join(near)})" if near else ""
        raise ValueError(
            f"--ckpt_path {ckpt_path}: no such file, from the folder {os.getcwd()}{hint}; pass "
            "a .ckpt file written by fit (the shipped configs write lightning_logs/<name>/"
            "checkpoints/last.ckpt), or 'last' to take the newest run of the configured "
            "ModelCheckpoint folder")
    problem, index = _usable(ckpt_path, need_training_state, trusted=trusted)
    if problem is None:
        return _resolved(ckpt_path, index, [], trusted)
    here = os.path.abspath(ckpt_path)  # _candidates' paths are absolute too
    others = (path for path in _candidates([os.path.dirname(here)], below=False)
              if path != here and _usable(path, need_training_state, False, trusted)[0] is None)
    other = next(others, None)
    hint = f"; the newest usable checkpoint next to it is {other}" if other else ""
    raise ValueError(f"--ckpt_path {ckpt_path} is not usable: {problem}{hint}")


def _best(dirpaths: list[str], trusted: bool, extra: tuple[str, ...]) -> str:
    """The ``best_model_path`` that a ModelCheckpoint with a ``monitor`` and one of
    ``dirpaths`` recorded in the newest checkpoint there (its own files, saved after each
    validation, hold its latest record): Lightning knows the best only in the process that
    ran the fit (an evaluation's ``best`` said the callback was "not configured"). A monitor
    without a ``dirpath`` saves into the logger's version folder, where the newest file of
    ``dirpaths`` holds a record one validation old: refused, as is a best no longer there."""
    try:
        newest = resolve_checkpoint("last", dirpaths, False, trusted, extra)
    except ValueError as err:  # nothing, or nothing usable, in those folders
        raise ValueError(str(err).replace("--ckpt_path last", "--ckpt_path best", 1)) from None
    assert newest is not None  # an evaluation's local folders: None raised above
    states = (_usable(newest.path, False, False, trusted)[1] or {}).get("callbacks") or {}
    folders = {os.path.abspath(path) for path in dirpaths}
    best = sorted({str(state["best_model_path"]) for name, state in states.items()
                   if name.startswith("ModelCheckpoint") and isinstance(state, dict)
                   and state.get("monitor") and state.get("best_model_path")
                   and os.path.abspath(str(state.get("dirpath"))) in folders})
    if len(best) != 1 or not os.path.exists(best[0]):
        raise ValueError(
            f"--ckpt_path best: {newest.path} records "
            + (f"several best checkpoints ({', '.join(best)})" if best[1:] else
               f"a best checkpoint that is gone ({best[0]})" if best else "no best checkpoint")
            + " of a ModelCheckpoint with a monitor and a dirpath (the one that keeps it in "
            "its own files); pass the checkpoint's file, or last")
    return best[0]


def later_steps_of_run(dirpaths: list[str], resumed: ResolvedCheckpoint) -> list[str]:
    """The usable checkpoints of ``dirpaths`` from ``resumed``'s run at a higher step: a fit
    resumed from ``resumed`` then forks that run (:class:`LoggerVersions` gives it an id of
    its own), so that ``--ckpt_path last`` does not later take the abandoned branch."""
    if resumed.run is None or resumed.global_step is None:
        return []
    later = []
    for path in _candidates(dirpaths):
        problem, index = _usable(path, False, False, resumed.trusted)
        found = None if problem is not None else _resolved(path, index, [], resumed.trusted)
        if found is not None and found.run == resumed.run and (
                found.global_step or 0) > resumed.global_step:
            later.append(path)
    return later


def remove_stale_temporaries(dirpaths: list[str], resuming: bool = True,
                             names: str = ".*.ckpt.*") -> list[str]:
    """Delete the ``.<name>.<host>-<pid>.tmp`` a killed write of the files ``names`` (a glob)
    left in ``dirpaths``: a resume's all but those whose writer runs here; otherwise this
    machine's whose writer is gone (another node's, an older version's, may be a live save)."""
    removed = []
    for folder in dirpaths:
        if not is_local(folder):
            continue
        pattern = os.path.join(glob.escape(folder), "**", f"{names}{TMP_SUFFIX}")
        for path in glob.glob(pattern, recursive=True):  # subfolders: checkpoint_files
            host, _, pid = path.removesuffix(TMP_SUFFIX).rpartition(".")[2].rpartition("-")
            with contextlib.suppress(OSError):
                mine = host in (_HOST, "") and pid.isdigit()  # "": an older version's name
                if (mine or resuming) and not (mine and int(pid) != os.getpid() and _alive(pid)):
                    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)  # FSDP2's
                    removed.append(path)
    return removed


def _alive(pid: str) -> bool:  # a process here (another user's: PermissionError, alive)
    with contextlib.suppress(ProcessLookupError):
        return os.kill(int(pid), 0) is None
    return False


class LoggerVersions(pl.Callback):
    """Record the run's identity (``checkpoint["maxent_grpo_run"]``: a random id drawn when
    a fit starts afresh, kept when it resumes) and every logger's class, ``save_dir`` (a
    local one made absolute: a resume from another folder must not take over that folder's
    own ``lightning_logs``), ``name`` and ``version`` (``checkpoint["maxent_grpo_loggers"]``)
    in each checkpoint."""

    def __init__(self) -> None:
        import uuid

        self.run = uuid.uuid4().hex[:12]
        self.fork = False  # set when the resumed run has later checkpoints (a rollback)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn != "fit":
            return
        self.fork = bool(trainer.strategy.broadcast(self.fork))  # rank 0's finding, everywhere
        if run := checkpoint.get(RUN_KEY):  # the same run; from before its last step: a branch
            self.run = f"{run}@{checkpoint.get('global_step')}" if self.fork else str(run)
        if self.fork:  # the branch's savers start afresh: the run's later files stay its own
            for key, state in (checkpoint.get("callbacks") or {}).items():
                if key.startswith("ModelCheckpoint") and isinstance(state, dict):
                    state.update(best_model_score=None, best_model_path="", best_k_models={},
                                 kth_best_model_path="", last_model_path="")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        checkpoint[RUN_KEY] = self.run
        records = []
        for logger in trainer.loggers:
            record = {"class": f"{type(logger).__module__}.{type(logger).__qualname__}"}
            with contextlib.suppress(Exception):  # a logger without these: nothing to continue
                record.update(save_dir=absolute_folder(logger.save_dir), name=logger.name,
                              version=logger.version)
            records.append(record)
        checkpoint[LOGGERS_KEY] = records

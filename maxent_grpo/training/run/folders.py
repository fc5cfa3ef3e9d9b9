"""The run's own folder, where ``config.yaml``, ``{log_dir}`` files and exports go.

Lightning's ``trainer.log_dir`` is the version folder of a TensorBoardLogger or CSVLogger
(``lightning_logs/version_3``), but only the ``save_dir`` of any other logger: every W&B or
MLflow run saved there shared it, so one run's ``config.yaml`` replaced another's and
their ``{log_dir}`` files mixed. :func:`run_dir` gives those loggers the folder their
checkpoints already use, ``<save_dir>/<name>/<version>`` (W&B: ``<project>/<run id>``,
MLflow: ``<experiment id>/<run id>``). A resumed CSVLogger keeps its earlier rows
(:func:`continue_csv_log`).
"""

from __future__ import annotations

import contextlib
import csv
import enum
import itertools
import logging
import os
import posixpath
import re
import socket
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml
from jsonargparse import set_dumper
from lightning.fabric.utilities.logger import _convert_params, _flatten_dict
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.utilities import rank_zero_warn


def logger_folder(logger: Any, default_root_dir: str) -> str:
    """The folder of one logger's run: its ``log_dir`` where it has one (TensorBoard, CSV),
    else ``<save_dir>/<name>/<version>`` as ModelCheckpoint names it (``save_dir`` unset:
    ``default_root_dir``). Read it on rank 0, where the logger's run exists."""
    if getattr(logger, "log_dir", None):
        return str(logger.log_dir)
    version = logger.version
    version = version if isinstance(version, str) else f"version_{version}"
    return os.path.join(str(logger.save_dir or default_root_dir), str(logger.name), version)


def run_dir(trainer: Any) -> str:
    """The run's folder: Lightning's ``trainer.log_dir`` with no logger (a ``fast_dev_run``'s
    DummyLogger is none) or a TensorBoard or CSV one first, else the first logger's
    :func:`logger_folder`, rank 0's (broadcast). Every rank must call it."""
    loggers = getattr(trainer, "loggers", None) or []
    if not loggers or isinstance(loggers[0], (TensorBoardLogger, CSVLogger, DummyLogger)):
        return str(trainer.log_dir or trainer.default_root_dir)  # broadcast by Lightning
    return str(trainer.strategy.broadcast(logger_folder(loggers[0], trainer.default_root_dir)))


def warn_unreachable_trackers(loggers: list[Any]) -> None:
    """Say at once when an MLflow logger's tracking server refuses a connection: mlflow
    retries for minutes, silently, before the run stops (the wait stays: a restarting
    server may come back)."""
    for logger in loggers:
        uri = str(getattr(logger, "_tracking_uri", "")) if isinstance(
            logger, MLFlowLogger) else ""
        address = urlparse(uri)
        if address.scheme not in ("http", "https") or not address.hostname:
            continue
        try:
            port = address.port or (443 if address.scheme == "https" else 80)
            socket.create_connection((address.hostname, port), timeout=5).close()
        except (OSError, ValueError) as err:
            logging.getLogger(__name__).warning(
                "MLFlowLogger: the tracking server %s does not answer (%s); mlflow retries "
                "for minutes before the run stops: start the server or fix tracking_uri",
                uri, err)


def _param_name(key: str) -> str:
    """A flattened key as MLflow takes it as a parameter name: characters it refuses as
    ``_`` and the path normalised (a reward ``model:/models/rm/`` ended in ``/``)."""
    name = posixpath.normpath(re.sub(r"[^\w\-. /:]", "_", key)).lstrip("/")
    return "_" if name in ("", ".") else name


def keep_first_values(logger: Any) -> None:
    """An MLflow logger's parameters: names MLflow takes (:func:`_param_name`), and on a run
    that already holds some of them with other values (a continued ``run_id``) those values
    kept, the new names logged and the changed ones named in a warning; MLflow refuses to
    change a logged parameter, which stopped the run (a resume with another
    ``--model.temperature``), from a file store as from a tracking server."""
    log = logger.log_hyperparams

    def log_hyperparams(params: Any) -> None:
        flat = {_param_name(k): v for k, v in _flatten_dict(_convert_params(params)).items()}
        try:
            log(flat)
        except Exception as err:  # noqa: BLE001 - mlflow's own types, imported lazily
            mlflow_error = any(c.__name__ == "MlflowException" for c in type(err).__mro__)
            if not mlflow_error or "Changing param" not in str(err):
                raise
            logged = logger.experiment.get_run(logger.run_id).data.params
            log({k: v for k, v in flat.items() if k not in logged})
            changed = sorted(k for k, v in flat.items() if logged.get(k, str(v)[:250])
                             != str(v)[:250])
            rank_zero_warn(
                f"MLFlowLogger: run {logger.run_id} keeps the values it logged first for "
                f"{len(changed)} parameter(s) that this run sets otherwise (MLflow does not "
                f"change a logged parameter; config.yaml has this run's): "
                + ", ".join(changed[:8]) + (", ..." if len(changed) > 8 else ""))

    logger.log_hyperparams = log_hyperparams


#: what names a run (or draws its seed afresh) rather than trains it: not compared
RUN_NAMING = ("ckpt_path", "weights_only", "seed_everything")


def keep_earlier(path: str, earlier: bytes | None,
                 fresh: bool = False) -> list[tuple[Path, Path | None]]:
    """A fit that continues a version under changed options (aside from :data:`RUN_NAMING`
    and ``trainer.logger``, which a resume may name anew: the checkpoint restores the
    random state), or a ``fresh`` fit (no checkpoint: an explicit logger ``version`` of an
    earlier run, or no logger; warned of), keeps that version's earlier ``config.yaml`` as
    ``config-1.yaml`` (``-2``, ... the first free name): the file holds this fit's options.
    So is the loggers' ``hparams.yaml`` beside it (TensorBoard writes one only where none
    is: it kept the first fit's values). Returns what it did: ``(file written, None)`` and ``(file
    moved to, from)``."""
    def options(text: bytes) -> Any:
        config = yaml.safe_load(text) or {}
        if not isinstance(config, dict):
            return config
        trainer = {k: v for k, v in (config.get("trainer") or {}).items() if k != "logger"}
        return {**{k: v for k, v in config.items() if k not in RUN_NAMING}, "trainer": trainer}

    with open(path, "rb") as file:
        if earlier is None or not fresh and options(earlier) == options(file.read()):
            return []
    keep = unused_path(Path(path))
    keep.write_bytes(earlier)
    done: list[tuple[Path, Path | None]] = [(keep, None)]
    hparams = Path(path).with_name("hparams.yaml")
    if hparams.is_file():
        done.append((unused_path(hparams), hparams))
        os.replace(hparams, done[-1][0])
    if fresh:
        logging.getLogger(__name__).warning(
            "%s holds an earlier run's config.yaml (a logger version given, or no logger: "
            "one folder for every run): this fit, which resumes no checkpoint, writes its own "
            "there and keeps that one as %s", os.path.dirname(path), keep.name)
    else:
        logging.getLogger(__name__).info(
            "%s: this fit's options differ from the earlier fit's, kept as %s", path, keep.name)
    return done


def unused_path(path: Path) -> Path:
    """``path``, or when it exists (an earlier predict's file, an earlier fit's config) the
    first free ``<stem>-<n><suffix>`` beside it."""
    stem, n = path.stem, 0
    while path.exists():
        n += 1
        path = path.with_name(f"{stem}-{n}{path.suffix}")
    return path


OBJECTIVE_KEY = "maxent_grpo_objective"  #: a checkpoint's record of the CLI's model.objective


class ConfigDumper(yaml.SafeDumper):
    """jsonargparse's YAML dump of a config (the run's ``config.yaml``, the model's
    hyper-parameters, ``--print_config``), with an enum that is a ``str`` written as its value:
    an option typed ``str`` whose default is one (``Timer``'s ``interval``) stopped every fit
    there with "cannot represent an object"."""


ConfigDumper.add_multi_representer(enum.Enum, lambda dumper, value: dumper.represent_str(
    str(value.value)) if isinstance(value, str) else dumper.represent_undefined(value))
set_dumper("yaml", lambda data: yaml.dump(data, Dumper=ConfigDumper, default_flow_style=False,
                                          allow_unicode=True, sort_keys=False))


class SaveRunConfig(SaveConfigCallback):
    """The CLI's ``config.yaml``, written on rank 0 into the folder of every logger's run
    (:func:`run_dir` first; no logger: ``default_root_dir``), and the whole config, nested
    under ``config``, as the hyper-parameters of every logger but TensorBoard and CSV (W&B,
    MLflow, ...: their runs showed only the module's plain options, not the objective,
    optimizer, scheduler, adapters, data or trainer). A fit replaces the file of the
    version it continues (one under changed options, or a ``fresh`` fit's, keeps the earlier
    as ``config-1.yaml``: :func:`keep_earlier`); ``validate``, ``test`` or ``predict`` in a
    run folder that holds one (a W&B ``id``, an MLflow ``run_id``) writes
    ``<stage>_config.yaml`` beside it and
    leaves the logger's hyper-parameters as the fit logged them. A fit that fails before it
    trains (a resume its checkpoint's checks refuse) puts the files it replaced back (it
    left the version's ``config.yaml`` holding the options that were refused)."""

    _put_back: list[tuple[str, bytes, list[tuple[Path, Path | None]]]] = []
    fresh = False  # a fit that resumes no checkpoint (the command line sets it)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._put_back = []
        if self.already_saved:
            return
        folder = run_dir(trainer)
        if trainer.is_global_zero:
            self._save(trainer, folder, stage)
            self.already_saved = True
        self.already_saved = trainer.strategy.broadcast(self.already_saved)

    def _save(self, trainer: Any, folder: str, stage: str) -> None:
        loggers = [lg for lg in trainer.loggers if not isinstance(lg, DummyLogger)]
        for logger in loggers:
            if isinstance(logger, MLFlowLogger):
                keep_first_values(logger)
        folders = [folder, *(logger_folder(lg, trainer.default_root_dir) for lg in loggers[1:])]
        stage = str(getattr(stage, "value", stage))  # Lightning passes a TrainerFn
        written: set[str] = set()
        config = None
        for n, where in enumerate(folders):
            path = os.path.join(where, self.config_filename)
            kept = stage != "fit" and os.path.isfile(path)  # a fit's: evaluating leaves it
            if kept:
                path = os.path.join(where, f"{stage}_{self.config_filename}")
            if os.path.abspath(path) not in written:
                written.add(os.path.abspath(path))
                os.makedirs(where, exist_ok=True)
                earlier = None if kept or not os.path.isfile(path) else Path(path).read_bytes()
                self.parser.save(self.config, path, skip_unset=False, overwrite=True,
                                 multifile=self.multifile)
                moved = keep_earlier(path, earlier, stage == "fit" and self.fresh)
                if stage == "fit" and earlier is not None:  # a version this fit continues
                    self._put_back.append((path, earlier, moved))
            logger = loggers[n] if n < len(loggers) else None
            if logger is None or kept or isinstance(logger, (TensorBoardLogger, CSVLogger)):
                continue
            if config is None:  # less what names the run rather than trains it
                config = {k: v for k, v in self._plain().items() if k != "ckpt_path"}
                config["trainer"] = {k: v for k, v in (config.get("trainer") or {}).items()
                                     if k != "logger"}
            logger.log_hyperparams({"config": config})

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._put_back = []  # the fit trains under its options: its config stays

    def _plain(self) -> dict[str, Any]:
        """The whole config as plain data, dumped once (it does not change during the run)."""
        if getattr(self, "_plain_config", None) is None:
            self._plain_config = yaml.safe_load(
                self.parser.dump(self.config, skip_unset=False)) or {}
        return self._plain_config

    def _objective(self) -> dict[str, Any] | None:
        """The config's ``model.objective`` (``class_path`` and every ``init_args``)."""
        objective = (self._plain().get("model") or {}).get("objective")
        return objective if isinstance(objective, dict) else None

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
        """The run's objective options, which the module's saved hyper-parameters leave out
        (the objective is an object), for a resume to compare with its own."""
        checkpoint[OBJECTIVE_KEY] = self._objective()

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
        """A fit resumed with other objective options (``epsilon``, ``loss_type``, ...) goes
        on with this run's, warned of as the other changed options are (``beta`` and
        ``tau``: :func:`~maxent_grpo.training.run.checkpoint.load_state`)."""
        saved, now = checkpoint.get(OBJECTIVE_KEY), self._objective()
        name = [str(c.get("class_path", "")).rpartition(".")[2] for c in (saved or {}, now or {})]
        if getattr(trainer.state, "fn", None) != "fit" or not (saved and now) or (
                name[0] != name[1]):  # another class: refused by load_state (by its name)
            return
        tunable = set(getattr(getattr(pl_module, "objective", None), "tunable", ()))
        old, new = saved.get("init_args") or {}, now.get("init_args") or {}
        changed = [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in sorted({*old, *new})
                   if k not in tunable and old.get(k) != new.get(k)]
        if changed:
            rank_zero_warn(f"model.objective's options differ from the checkpoint's "
                           f"({', '.join(changed)}): it goes on with this run's")

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        for path, earlier, moved in self._put_back:
            for new, old in reversed(moved):  # config-1.yaml written, hparams.yaml moved
                if old is None:
                    new.unlink(missing_ok=True)
                elif new.exists():  # over one the logger wrote for this fit since
                    os.replace(new, old)
            Path(path).write_bytes(earlier)
        self._put_back = []


def remove_empty_name_folders(dirpath: Any, filename: Any, named: bool = True) -> None:
    """The empty folders under a checkpoint saver's local ``dirpath`` that its file names
    made: a metric with a ``/`` in ``ModelCheckpoint.filename`` (``{step}-{val/pass@1}``)
    puts each file in a folder of its own (``step=4-val/pass@1=0.5.ckpt``), which Lightning
    leaves behind when it drops the file (top-k). Only empty folders are removed, in those
    whose names the ``filename``'s part before its ``/`` makes (others are the user's;
    ``named``: the saver's ``auto_insert_metric_name``, which writes ``step=``)."""
    if dirpath is None or "://" in str(dirpath) or not os.path.isdir(dirpath) or (
            "/" not in str(filename or "")):
        return
    parts = re.split(r"(\{[^}]*\})", str(filename).split("/")[0])  # "{step}-{val": "step=*-val"
    if not named and "{" in parts[-1]:  # the "/" inside a metric's name: not written
        return
    made = re.compile("".join(
        (re.escape(x[1:-1].split(":")[0]) + "=" if named else "") + ".*" if x.endswith("}")
        else re.escape(x.replace("{", "")) for x in parts))
    for top in os.scandir(dirpath):
        if made.fullmatch(top.name) and top.is_dir(follow_symlinks=False):
            for folder, _, _ in os.walk(top.path, topdown=False):
                with contextlib.suppress(OSError):  # not empty
                    os.rmdir(folder)


def absolute_folder(folder: Any) -> Any:
    """A local folder as an absolute path (``~`` and ``$VAR`` expanded, as Lightning does);
    None or a URL (``s3://...``) as it is."""
    if folder is None or "://" in str(folder):
        return folder
    return os.path.abspath(os.path.expanduser(os.path.expandvars(str(folder))))


def logger_places(folder: Any, path: str, saved_in: tuple[tuple[str, tuple[str, ...]], ...],
                  now: list[str]) -> list[Any]:
    """Where ``folder``, recorded when checkpoint ``path`` was saved, may be now: as recorded,
    and, when nothing is there any more, where the run folder was moved whole: a saver's
    folder then (``saved_in``: its dirpath, the checkpoints it named, ``path`` among them,
    or the file a ``save_last`` link names) is a configured one now (``now``), at another
    place that holds every one of them; the parts the two folders' paths do not end alike
    in are the old and the new root. (A copy, the old place still there, is a run of its
    own: another project's folder must never be taken, and purged, for this run's.)"""
    places = [folder]
    if not isinstance(folder, str) or any("://" in str(f) for f in (folder, path, *now)) or (
            os.path.exists(absolute_folder(folder))):
        return places
    recorded = Path(absolute_folder(folder))
    for (then, named), new in itertools.product(saved_in, map(Path, map(absolute_folder, now))):
        old = Path(absolute_folder(then))
        if old == new or not any(  # the checkpoint, or the file a link names (paths resolved)
                here.is_relative_to(base) and str(old / here.relative_to(base)) in named
                for here, base in ((Path(absolute_folder(path)), new), (
                    Path(os.path.realpath(path)), Path(os.path.realpath(new))))) or not all(
                    Path(p).is_relative_to(old) and (new / Path(p).relative_to(old)).exists()
                    for p in named):
            continue
        n = 0  # the common end: <old root>/<x>, <new root>/<x>
        while n < min(len(old.parts), len(new.parts)) - 1 and old.parts[-1 - n] == new.parts[
                -1 - n]:
            n += 1
        if n and recorded.is_relative_to(old.parents[n - 1]):
            places.append(str(new.parents[n - 1] / recorded.relative_to(old.parents[n - 1])))
    return places


def continues_logger(record: dict[str, Any], cls: str, args: Any, path: str,
                     saved_in: tuple[tuple[str, tuple[str, ...]], ...], now: list[str]) -> bool:
    """Whether a logger a checkpoint (``path``) recorded (``record``) is the one of class
    ``cls`` with options ``args`` that goes on in its version: the class, the name, the
    version's folder (``args.version`` None: any; ``0`` and ``version_0`` alike) and the
    ``save_dir``, as recorded or where the run folder moved (:func:`logger_places`)."""
    def folder(version: Any) -> Any:
        return version if version is None or isinstance(version, str) else f"version_{version}"

    return (record.get("class") == cls and record.get("version") is not None
            and folder(args.get("version")) in (None, folder(record["version"]))
            and record.get("name") == args.get("name") and any(
                None not in (place, args.get("save_dir")) and os.path.realpath(absolute_folder(
                    place)) == os.path.realpath(absolute_folder(args.get("save_dir")))
                for place in logger_places(record.get("save_dir"), path, saved_in, now)))


def continue_csv_log(logger: Any, resume_step: int | None) -> int:
    """Keep the ``metrics.csv`` of a CSVLogger that continues a version folder (Lightning's
    writer deletes it): rows with ``step < resume_step`` are written back and the writer
    takes their columns. Returns the rows kept. Call on global rank zero, before logging.
    """
    metrics = os.path.join(logger.log_dir, "metrics.csv")
    if not os.path.isfile(metrics):
        return 0
    with open(metrics, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        header = list(reader.fieldnames or [])
        rows = list(reader)
    if resume_step is not None:
        def keep(row: dict[str, str]) -> bool:
            try:
                return float(row.get("step") or 0) < resume_step
            except ValueError:
                return True
        rows = [r for r in rows if keep(r)]
    with warnings.catch_warnings():  # its "Previous log files ... will be deleted": kept
        warnings.filterwarnings("ignore", "Experiment logs directory .* is not empty")
        writer = logger.experiment  # the CSV writer; removes metrics.csv
    columns = sorted(set(writer.metrics_keys) | set(header))  # the writer's (sorted) order
    with open(metrics, "w", newline="", encoding="utf-8") as f:
        out = csv.DictWriter(f, fieldnames=columns)
        out.writeheader()
        out.writerows(rows)
    writer.metrics_keys = columns
    return len(rows)

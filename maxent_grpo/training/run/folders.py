"""The run's own folder, where ``config.yaml``, ``{log_dir}`` files and exports go.

Lightning's ``trainer.log_dir`` is the version folder of a TensorBoardLogger or CSVLogger
(``lightning_logs/version_3``), but only the ``save_dir`` of any other logger: every W&B or
MLflow run saved there shared it, so one run's ``config.yaml`` replaced another's and
their ``{log_dir}`` files mixed. :func:`run_dir` gives those loggers the folder their
checkpoints already use, ``<save_dir>/<name>/<version>`` (W&B: ``<project>/<run id>``,
MLflow: ``<experiment id>/<run id>``).
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any
from urllib.parse import urlparse

import yaml
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
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
    """The run's folder: Lightning's ``trainer.log_dir`` with no logger or a TensorBoard or
    CSV one first, else the first logger's :func:`logger_folder`, rank 0's (broadcast).
    Every rank must call it."""
    loggers = getattr(trainer, "loggers", None) or []
    if not loggers or isinstance(loggers[0], (TensorBoardLogger, CSVLogger)):
        return str(trainer.log_dir or trainer.default_root_dir)  # broadcast by Lightning
    return str(trainer.strategy.broadcast(logger_folder(loggers[0], trainer.default_root_dir)))


def warn_unreachable_trackers(loggers: list[Any]) -> None:
    """Say at once when an MLflow logger's tracking server refuses a connection: mlflow
    retries for minutes, silently, before the run stops (the wait stays: a restarting
    server may come back)."""
    for logger in loggers:
        uri = str(getattr(logger, "_tracking_uri", "")) if type(logger).__name__ == \
            "MLFlowLogger" else ""
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


class SaveRunConfig(SaveConfigCallback):
    """The CLI's ``config.yaml``, written on rank 0 into :func:`run_dir` (replacing the
    file of a resumed version), and the whole config, nested under ``config``, as the
    hyper-parameters of every logger that keeps no folder of its own beside it (W&B,
    MLflow, others; not TensorBoard or CSV, whose version folder holds the file): their
    runs showed only the module's plain options, not the objective, optimizer, scheduler,
    adapters, data or trainer."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.already_saved:
            return
        folder = run_dir(trainer)
        if trainer.is_global_zero:
            os.makedirs(folder, exist_ok=True)
            self.parser.save(self.config, os.path.join(folder, self.config_filename),
                             skip_unset=False, overwrite=True, multifile=self.multifile)
            self.save_config(trainer, pl_module, stage)
            self.already_saved = True
        self.already_saved = trainer.strategy.broadcast(self.already_saved)

    def save_config(self, trainer: Any, pl_module: Any, stage: str) -> None:
        loggers = [logger for logger in trainer.loggers
                   if not isinstance(logger, (TensorBoardLogger, CSVLogger))]
        if not loggers:
            return
        config = yaml.safe_load(self.parser.dump(self.config, skip_unset=False))
        for logger in loggers:
            try:
                logger.log_hyperparams({"config": config})
            except Exception as err:  # noqa: BLE001 - mlflow's own type, imported lazily
                if type(err).__name__ != "MlflowException":
                    raise
                rank_zero_warn(f"{type(logger).__name__}: the continued run keeps the config "
                               f"values it logged first (MLflow does not change one): {err}")

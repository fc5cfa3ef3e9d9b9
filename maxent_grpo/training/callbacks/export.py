"""Hugging Face export of the trained policy, as a Lightning callback.

Added under ``trainer.callbacks`` in YAML::

    - class_path: maxent_grpo.training.callbacks.HFExport
      init_args: {every_n_train_steps: 100}
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from maxent_grpo.adapters import has_adapters, merged_copy
from maxent_grpo.models import load_policy
from maxent_grpo.validation import check_bool, check_int, require

__all__ = ["HFExport"]

log = logging.getLogger(__name__)


class HFExport(Callback):
    """Save ``pl_module.runtime``'s model and tokenizer with ``save_pretrained`` (rank 0).

    At the end of training into ``<dirpath>/final`` and, with ``every_n_train_steps``, each
    time the global step passes a multiple of it into ``<dirpath>/step-<global_step>``.

    With ``model.peft`` the folder holds the adapter (loaded by
    ``peft.AutoPeftModelForCausalLM.from_pretrained``); with ``merged`` a second folder
    ``<name>-merged`` holds the plain model with the adapters folded in
    (:func:`~maxent_grpo.adapters.merged_copy`, from a fresh copy of the base).

    Args:
        dirpath: output folder; None means ``<trainer.log_dir>/hf`` (the logger's version folder).
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
        self.dirpath = dirpath
        self.every_n_train_steps = every_n_train_steps
        self.merged = merged
        self._last_step = 0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = os.path.join(trainer.log_dir or trainer.default_root_dir, "hf")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step  # a resumed run does not re-export at once

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
        self.export(trainer, pl_module, "final")

    def export(self, trainer: pl.Trainer, pl_module: pl.LightningModule, name: str) -> Path | None:
        """``save_pretrained`` of the model (or adapter) and tokenizer into ``<dirpath>/<name>``
        (with ``merged`` also ``<name>-merged``); returns that path (None on other ranks)."""
        if not trainer.is_global_zero:
            return None
        assert self.dirpath is not None, "HFExport.setup() sets dirpath"
        out = Path(self.dirpath) / name
        model, tokenizer = pl_module.runtime.model, pl_module.runtime.tokenizer
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        adapters = has_adapters(model)
        log.info("exported the policy%s and tokenizer to %s", "'s adapter" if adapters else "",
                 out)
        if self.merged and adapters:
            src = pl_module.source
            base = load_policy(src.name_or_path, dtype=src.dtype, cache_dir=src.cache_dir)
            merged = merged_copy(model, base)
            merged.save_pretrained(out.with_name(f"{name}-merged"))
            tokenizer.save_pretrained(out.with_name(f"{name}-merged"))
            log.info("exported the merged model to %s-merged", out)
        return out

"""What the adaptive tau / beta controllers (docs/ALGORITHM.md §5) share, as Lightning callbacks.

Added under ``trainer.callbacks`` in YAML::

    - class_path: maxent_grpo.training.callbacks.TauController
      init_args: {target_entropy: 1.2, lr: 0.2}

Once per training step (one rollout, also with ``num_iterations > 1``), in
``on_train_batch_end``, a controller reads ``pl_module.step_metrics_dict`` (the step's logged
dict, ``train/...`` names, reduced over micro-batches and ranks, so every rank computes the
same update) and writes the new
``pl_module.objective.tau`` / ``.beta`` (kept nowhere else), used from the next rollout on.
They log ``train/delta_tau``, ``train/delta_beta``, their targets and ``train/meta/...``.

Checks at ``setup`` (ValueError naming the callback and the objective or the file): every
moved attribute is in ``objective.tunable``, no two controllers move the same one, and the
start values suit the rule. One that can raise beta calls ``pl_module.require_reference()``.

State: ``state_dict`` holds only the controller's own state (tau and beta are in the
module's checkpoint entry). ``setup`` reads ``resume_from`` (a ``controller_state.json``,
:mod:`~maxent_grpo.training.callbacks.state_file`); a ``--ckpt_path`` checkpoint then
overrides both. ``state_path`` (``{log_dir}``: the logger's version folder) is written at
every checkpoint save and at the end of training.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from maxent_grpo.objectives import Objective
from maxent_grpo.training.callbacks.state_file import (
    apply_snapshot,
    build_snapshot,
    read_controller_state,
    write_controller_state,
)
from maxent_grpo.training.run.folders import run_dir
from maxent_grpo.training.types import ControllerPaths, LoopSettings
from maxent_grpo.validation import check_bool, require, unwritable

__all__ = ["Controller"]

log = logging.getLogger(__name__)


class Controller(Callback):
    """Shared machinery: checks at ``setup``, the update hook, state and the side file.

    Subclasses set :attr:`moves` and :attr:`file_fields` (``steps`` first, then their own
    state, restored through ``setattr``) and implement ``_check_start`` (refuse start
    values) and ``_update`` (one step: update the objective, return the logs).
    """

    #: objective attributes this controller moves (each must be in ``objective.tunable``)
    moves: tuple[str, ...] = ()
    #: its ``state_dict`` key (attributes of the same name) -> where the value lives in
    #: ``controller_state.json``
    file_fields: dict[str, str] = {}  # noqa: RUF012 (set once per subclass, never mutated)
    #: whether it can raise beta (then the reference is loaded from the start)
    can_raise_beta: bool = False
    #: whether it is the meta-controller (``LoopSettings.controller_meta_manager``)
    is_meta: bool = False

    def __init__(
        self, state_path: str | None, resume_from: str | None, overwrite_existing: bool
    ) -> None:
        check_bool(f"{self.name}.overwrite_existing", overwrite_existing)
        self.paths = ControllerPaths(state_path, resume_from, overwrite_existing)
        self.steps = 0  # training steps (rollouts) observed
        self._state_file: Path | None = None

    @property
    def name(self) -> str:
        return type(self).__name__

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Check the objective and the other controllers; read ``resume_from``. Each fit
        from its start (not one continued on the same Trainer) starts from the controller's
        first state (a list of controllers given to a second fit skipped the warm-up and kept
        the EMA); a resume's is restored after this."""
        if stage != "fit":
            return
        if not getattr(trainer, "global_step", 0):  # not a fit going on on its Trainer
            self.load_state_dict(self.__dict__.setdefault("_first_state", self.state_dict()))
        objective = getattr(pl_module, "objective", None)
        require(
            isinstance(objective, Objective),
            f"{self.name} needs a MaxEntGRPOModule with an objective; got "
            f"{type(pl_module).__name__}",
        )
        missing = [name for name in self.moves if name not in objective.tunable]
        require(
            not missing,
            f"{self.name} moves {' and '.join(f'objective.{n}' for n in self.moves)}, but "
            f"model.objective is {type(objective).__name__}, whose tunable attributes "
            f"{list(objective.tunable)} lack {missing}",
        )
        for other in trainer.callbacks:
            if other is self or not isinstance(other, Controller):
                continue
            require(type(other) is not type(self),
                    f"trainer.callbacks holds two {self.name}s; keep one")
            shared = sorted(set(self.moves) & set(other.moves))
            require(
                not shared,
                f"{self.name} and {other.name} both move objective.{shared[0] if shared else ''}"
                "; use MetaController alone, or TauController and/or BetaController",
            )
        if self.paths.state_path is not None:
            self._state_file = Path(self.paths.state_path.replace("{log_dir}", run_dir(trainer)))
        origin = "model.objective"
        if self.paths.resume_from is not None:
            path = self.paths.resume_from
            apply_snapshot(read_controller_state(path), path, objective, [self])
            origin = f"controller state file {path!r}"
            log.info("%s resumed from %s: %s", self.name, path, self.state_dict())
        self._check_start(objective, origin, pl_module)
        if self.can_raise_beta:
            pl_module.require_reference()
        loop = getattr(pl_module, "loop", None)
        if isinstance(loop, LoopSettings):  # the module's loop settings name its controllers
            pl_module.loop = loop.with_controller(self.paths, objective,
                                                  self if self.is_meta else None)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Refuse a state file that cannot be written (found out at the first checkpoint
        save, which it broke)."""
        path = self._state_file
        if path is not None:
            problem = unwritable(path) if trainer.is_global_zero else None  # the writer
            require(trainer.strategy.reduce_boolean_decision(problem is None, all=True),
                    f"{self.name}.state_path {str(path)!r} cannot be written: "
                    f"{problem or 'see global rank 0'}")

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule
                              ) -> None:
        """The state file's check before the sanity check's validation spends its time."""
        self.on_train_start(trainer, pl_module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Refuse to overwrite another run's state file (``overwrite_existing=False``; seen
        by any rank: a folder of its own machine's); a run resuming a checkpoint or from its
        ``state_path`` continues it. Checked here and at the sanity check's start, after the
        checkpoint's restore: FSDP2 and DeepSpeed restore after ``on_fit_start``, where
        ``trainer.ckpt_path`` is not yet known (their resumes were refused). A resume's start
        values, the checkpoint's when controllers moved them, are checked as the config's
        were (a beta of 0 that BetaController can never raise went on without a word)."""
        loop = getattr(pl_module, "loop", None)
        if trainer.ckpt_path is not None and isinstance(loop, LoopSettings) and (
                loop.controller_objective is not None):
            self._check_start(loop.controller_objective, f"the checkpoint {trainer.ckpt_path}, "
                              "whose values a resume with controllers continues,", pl_module)
        path = self._state_file
        if path is None or self.paths.overwrite_existing or not (
                trainer.strategy.reduce_boolean_decision(path.exists(), all=False)):
            return
        resume = self.paths.resume_from
        require(trainer.ckpt_path is not None or (resume is not None and Path(resume) == path),
                f"{self.name}: the controller state file {str(path)!r} already exists (from an "
                "earlier run?); set overwrite_existing: true to replace it, resume_from to "
                "continue from it, or another state_path")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:
        """One update of the objective from the step's reduced statistics (none on a step
        that trained nothing: the first ``model.max_staleness`` steps only start rollouts, and
        a step whose every group ``model.drop_constant_groups`` dropped measures nothing)."""
        empty = getattr(getattr(pl_module, "trajectory", None), "kept_groups", 1) == 0
        if getattr(pl_module, "step_log", True) is None or empty:
            return
        loop = getattr(pl_module, "loop", None)
        attached = isinstance(loop, LoopSettings) and loop.controller_objective is not None
        objective = loop.controller_objective if attached else pl_module.objective
        logs = self._update(objective, pl_module.step_metrics_dict)
        self.steps += 1
        if logs:
            pl_module.log_dict(logs, on_step=True, on_epoch=False, batch_size=1)

    def state_dict(self) -> dict[str, Any]:
        """``steps`` and the controller's own state; never tau / beta (the objective's)."""
        return {"steps": self.steps, **{key: getattr(self, key) for key in self.file_fields
                                         if key != "steps"}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (unknown or missing keys raise ValueError)."""
        expected = list(self.state_dict())
        missing = [k for k in expected if k not in state_dict]
        require(
            not missing,
            f"{self.name} state in the checkpoint is missing keys {missing}; expected {expected}",
        )
        unknown = sorted(set(state_dict) - set(expected))
        require(not unknown, f"{self.name} state in the checkpoint has unknown keys {unknown}")
        self.steps = int(state_dict["steps"])
        for key in expected[1:]:
            value = state_dict[key]
            setattr(self, key, None if value is None else float(value))

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._write_file(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write_file(trainer, pl_module)

    def _write_file(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Write the snapshot of the objective and every controller (global rank 0; once per
        file, by the first controller naming it)."""
        if self._state_file is None or not trainer.is_global_zero:
            return
        controllers = [cb for cb in trainer.callbacks if isinstance(cb, Controller)]
        writer = next(cb for cb in controllers if cb._state_file == self._state_file)
        if writer is self:
            write_controller_state(self._state_file, build_snapshot(pl_module.objective,
                                                                    controllers))

    def _check_start(self, objective: Objective, origin: str,
                     pl_module: pl.LightningModule) -> None:
        """Refuse start values (from ``origin``) the rule cannot work from."""
        raise NotImplementedError

    def _update(self, objective: Objective, stats: dict[str, float]) -> dict[str, float]:
        raise NotImplementedError

"""Lightning callbacks: the adaptive tau / beta controllers (ALGORITHM §5) and HF export.

Controllers, added under ``trainer.callbacks`` in YAML::

    trainer:
      callbacks:
        - class_path: maxent_grpo.training.callbacks.TauController
          init_args: {target_entropy: 1.2, lr: 0.2}
        - class_path: maxent_grpo.training.callbacks.BetaController
          init_args: {kl_target: 0.02}

When they act: once per training step (one rollout), in ``on_train_batch_end``, after the
step's optimizer step(s), on ``pl_module.step_log`` -- the step's logged ``train/...``
scalars, already reduced over micro-batches and ranks, so every rank computes the same
update. With ``model.num_iterations = 1`` that is once per optimizer step, as in §5; with
``num_iterations > 1`` a rollout feeds several optimizer steps and the controllers act once
per rollout, on the statistics reduced over all of its optimizer steps (the weight entropy
is a property of the rollout anyway). The new value is used from the next rollout on.

What they move: ``pl_module.objective.tau`` / ``.beta``, with the pure rules of
:mod:`maxent_grpo.core.control`. The module logs ``train/tau``, ``train/beta`` (the values
the step used) and ``train/weight_entropy`` (with ``_min`` / ``_max`` over groups) every
step; the controllers add ``train/delta_tau``, ``train/delta_beta`` (new - old), their
targets and ``train/meta/tau_grad``, ``train/meta/beta_grad``.

=================  ======================================  =============================
controller         objectives                              reads
=================  ======================================  =============================
TauController      ListwiseMaxEnt, GroupMaxEnt (tau > 0)   ``train/weight_entropy``
BetaController     GRPO, EntropyMaxEnt, ListwiseMaxEnt     ``train/kl`` (loads the ref.)
MetaController     ListwiseMaxEnt                          both
=================  ======================================  =============================

Anything else fails at ``setup`` with a ValueError naming the callback and the objective;
so do two controllers that move the same attribute. A controller that can raise beta
(Beta, Meta) calls ``pl_module.require_reference()`` at ``setup``, so the reference model
is loaded from the start and ``train/kl`` is measured every step.

State: each controller has ``state_dict`` / ``load_state_dict``, so Lightning's checkpoint
carries it; on ``fit --ckpt_path`` Lightning calls ``load_state_dict`` after ``setup``, and
the restored values are pushed into the objective at once. Optionally, with a state path
(the documented :class:`~maxent_grpo.training.types.ControllerPaths`), the controllers'
state is also written to ``controller_state.json`` (schema
``{"beta", "tau", "tau_log", "tau_entropy_ema", "meta": {...}}``) atomically at every
checkpoint save and at the end of training, and read from ``resume_from`` at ``setup``
(with ``fit --ckpt_path`` as well, the checkpoint's state, restored after ``setup``, wins).
``state_path`` may contain ``{log_dir}``, the logger's version folder, so every run gets
its own file. A truncated or corrupt file, or one without a needed key, raises ValueError
naming the file and the key: a run never silently restarts from the config's values.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from maxent_grpo.core.control import beta_update, entropy_target_at, meta_update, tau_update
from maxent_grpo.objectives import GRPO, GroupMaxEnt, ListwiseMaxEnt, Objective
from maxent_grpo.training.types import ControllerPaths

__all__ = [
    "STATE_FILENAME",
    "BetaController",
    "HFExport",
    "MetaController",
    "TauController",
    "read_controller_state",
    "write_controller_state",
]

log = logging.getLogger(__name__)

STATE_FILENAME = "controller_state.json"
STATE_KEYS = ("beta", "tau", "tau_log", "tau_entropy_ema", "meta")


# ---------------------------------------------------------------------- the state file


def write_controller_state(path: str | Path, state: dict[str, Any]) -> None:
    """Write ``state`` as JSON to ``path`` atomically: a temporary file in the same folder,
    flushed to disk, then ``os.replace`` -- a reader sees the old file or the new one,
    never half of one. Non-finite numbers are refused (``allow_nan=False``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(state, f, indent=2, sort_keys=True, allow_nan=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_controller_state(path: str | Path) -> dict[str, Any]:
    """Read ``controller_state.json`` and check its schema.

    Returns ``{"beta", "tau", "tau_log", "tau_entropy_ema", "meta": {...}}`` where the four
    scalars are finite numbers or ``null``. Raises FileNotFoundError for a missing file and
    ValueError naming the file (and the key) for invalid JSON (a truncated or corrupt
    file), a missing key or a value of the wrong type.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"controller state file not found: {str(path)!r}")
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(
            f"controller state file {str(path)!r} is not valid JSON (truncated or corrupt?): "
            f"{err}"
        ) from err
    if not isinstance(state, dict):
        raise ValueError(f"controller state file {str(path)!r} must hold a JSON object")
    for key in STATE_KEYS:
        if key not in state:
            raise ValueError(
                f"controller state file {str(path)!r} has no key {key!r}; expected keys "
                f"{list(STATE_KEYS)}"
            )
    for key in STATE_KEYS[:-1]:
        if state[key] is not None and not _is_number(state[key]):
            raise ValueError(
                f"controller state file {str(path)!r}: {key!r} must be a finite number or "
                f"null; got {state[key]!r}"
            )
    if not isinstance(state["meta"], dict):
        raise ValueError(f"controller state file {str(path)!r}: 'meta' must be an object")
    return state


def _need(state: dict[str, Any], key: str, path: str, meta: bool = False) -> float:
    """``state[key]`` (or ``state["meta"][key]``) as a finite number, else ValueError."""
    where = state["meta"] if meta else state
    name = f"meta.{key}" if meta else key
    if key not in where:
        raise ValueError(f"controller state file {path!r} has no key {name!r}")
    if not _is_number(where[key]):
        raise ValueError(
            f"controller state file {path!r}: {name!r} must be a finite number; "
            f"got {where[key]!r}"
        )
    return float(where[key])


def _optional(state: dict[str, Any], key: str, path: str) -> float | None:
    """``state["meta"][key]``: a finite number or null; the key itself is required."""
    if key not in state["meta"]:
        raise ValueError(f"controller state file {path!r} has no key 'meta.{key}'")
    value = state["meta"][key]
    if value is not None and not _is_number(value):
        raise ValueError(
            f"controller state file {path!r}: 'meta.{key}' must be a finite number or null; "
            f"got {value!r}"
        )
    return None if value is None else float(value)


# ---------------------------------------------------------------------- controllers


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


class _Controller(Callback):
    """Shared machinery: validation at ``setup``, the update hook, state and the JSON file.

    Subclasses set :attr:`moves` and implement ``_check_objective``, ``_start``, ``_update``,
    ``_push``, ``_fields``, ``_restore`` and ``_fill`` / ``_read``.
    """

    #: objective attributes this controller moves
    moves: tuple[str, ...] = ()
    #: whether it can raise beta (then the reference is loaded from the start)
    can_raise_beta: bool = False

    def __init__(
        self, state_path: str | None, resume_from: str | None, overwrite_existing: bool
    ) -> None:
        self.paths = ControllerPaths(state_path, resume_from, overwrite_existing)
        self.steps = 0  # training steps (rollouts) observed
        self._module: pl.LightningModule | None = None
        self._state_file: Path | None = None

    @property
    def name(self) -> str:
        return type(self).__name__

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Validate against the objective and the other controllers; read ``resume_from``."""
        if stage != "fit":
            return
        objective = getattr(pl_module, "objective", None)
        _check(
            isinstance(objective, Objective),
            f"{self.name} needs a MaxEntGRPOModule with an objective; got "
            f"{type(pl_module).__name__}",
        )
        self._check_objective(objective, pl_module)
        for other in trainer.callbacks:
            if other is self or not isinstance(other, _Controller):
                continue
            _check(
                type(other) is not type(self),
                f"trainer.callbacks holds two {self.name}s; keep one",
            )
            shared = sorted(set(self.moves) & set(other.moves))
            _check(
                not shared,
                f"{self.name} and {other.name} both move objective.{shared[0] if shared else ''}"
                "; use MetaController alone, or TauController and/or BetaController",
            )
        if self.can_raise_beta:
            pl_module.require_reference()
        self._module = pl_module
        self._start(objective)
        if self.paths.state_path is not None:
            log_dir = trainer.log_dir or trainer.default_root_dir
            self._state_file = Path(self.paths.state_path.replace("{log_dir}", log_dir))
        if self.paths.resume_from is not None:
            path = self.paths.resume_from
            self._read(read_controller_state(path), path)
            self._push(objective)
            log.info("%s resumed from %s: %s", self.name, path, self._fields())

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Refuse to overwrite another run's state file (``overwrite_existing=False``).

        Checked here, not in ``setup``, because only now is it known whether the run
        resumes from a checkpoint (``trainer.ckpt_path``): a resumed run continues its own
        file, and so does a run whose ``resume_from`` is its ``state_path``.
        """
        path = self._state_file
        if path is None or self.paths.overwrite_existing or not path.exists():
            return
        resume = self.paths.resume_from
        if trainer.ckpt_path is not None or (resume is not None and Path(resume) == path):
            return
        raise ValueError(
            f"{self.name}: the controller state file {str(path)!r} already exists (from an "
            "earlier run?); set overwrite_existing: true to replace it, resume_from to "
            "continue from it, or another state_path"
        )

    # ------------------------------------------------------------------ the update
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:
        """One update from the step's reduced statistics, pushed into the objective."""
        logs = self._update(pl_module.step_log.as_dict())
        self.steps += 1
        self._push(pl_module.objective)
        if logs:
            pl_module.log_dict(logs, on_step=True, on_epoch=False, batch_size=1)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, **self._fields()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` and push the values into the objective (Lightning
        calls this after ``setup``, so the objective is known by then)."""
        expected = ["steps", *self._fields()]
        missing = [k for k in expected if k not in state_dict]
        _check(
            not missing,
            f"{self.name} state in the checkpoint is missing keys {missing}; expected {expected}",
        )
        self.steps = int(state_dict["steps"])
        self._restore(state_dict)
        if self._module is not None:
            self._push(self._module.objective)

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._write_file(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write_file(trainer, pl_module)

    def _write_file(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Write the joint snapshot of every controller (global rank 0; once per file)."""
        if self._state_file is None or not trainer.is_global_zero:
            return
        controllers = [cb for cb in trainer.callbacks if isinstance(cb, _Controller)]
        writer = next(cb for cb in controllers if cb._state_file == self._state_file)
        if writer is not self:
            return
        objective = pl_module.objective
        tau = getattr(objective, "tau", None)
        snapshot: dict[str, Any] = {
            "beta": getattr(objective, "beta", None),
            "tau": tau,
            "tau_log": math.log(tau) if tau else None,
            "tau_entropy_ema": None,
            "meta": {},
        }
        for cb in controllers:
            cb._fill(snapshot)
        write_controller_state(self._state_file, snapshot)

    # ------------------------------------------------------------------ for subclasses
    def _check_objective(self, objective: Objective, pl_module: pl.LightningModule) -> None:
        raise NotImplementedError

    def _start(self, objective: Objective) -> None:
        raise NotImplementedError

    def _update(self, stats: dict[str, float]) -> dict[str, float]:
        raise NotImplementedError

    def _push(self, objective: Objective) -> None:
        raise NotImplementedError

    def _fields(self) -> dict[str, Any]:
        raise NotImplementedError

    def _restore(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def _fill(self, snapshot: dict[str, Any]) -> None:
        raise NotImplementedError

    def _read(self, state: dict[str, Any], path: str) -> None:
        raise NotImplementedError


def _check_target_entropy(owner: str, value: float | None, pl_module: pl.LightningModule) -> None:
    """A weight entropy over G candidates lies in [0, log G]."""
    G = getattr(getattr(pl_module, "hparams", None), "num_generations", None)
    if value is None or G is None:
        return
    _check(
        value <= math.log(G),
        f"{owner} must be in [0, log G] = [0, {math.log(G):.4f}] for "
        f"model.num_generations={G}; got {value}",
    )


def _check_tau_bounds(owner: str, tau_min: float, tau_max: float) -> None:
    _check(_is_number(tau_min) and tau_min > 0, f"{owner}.tau_min must be > 0; got {tau_min}")
    _check(
        _is_number(tau_max) and tau_max >= tau_min,
        f"{owner}.tau_max must be finite and >= tau_min ({tau_min}); got {tau_max}",
    )


def _check_tau_start(owner: str, objective: Objective, tau_min: float, tau_max: float) -> None:
    tau = objective.tau
    _check(
        tau_min <= tau <= tau_max,
        f"{owner}: model.objective.tau = {tau} lies outside [tau_min, tau_max] = "
        f"[{tau_min}, {tau_max}]; change one of them",
    )


class TauController(_Controller):
    """Steer the weight entropy ``H_w`` (mean over groups of ``H(w)``) to a target ``H*``.

    Per training step (:func:`maxent_grpo.core.control.tau_update`)::

        EMA   <- ema_decay * EMA + (1 - ema_decay) * H_w     (the first H_w initialises it)
        log t <- log t + lr * (H*(step) - EMA)                (not during warmup_steps)
        tau    = clip(exp(log t), tau_min, tau_max)

    Too little weight entropy raises tau (flatter weights). ``H*`` is ``target_entropy``,
    or anneals linearly to ``target_entropy_final`` over ``target_entropy_horizon`` steps
    (:func:`~maxent_grpo.core.control.entropy_target_at`). It must lie in ``[0, log G]``.
    A step without a finite ``train/weight_entropy`` leaves tau unchanged (with a warning).

    Works with ListwiseMaxEnt and GroupMaxEnt, starting from ``model.objective.tau`` (> 0,
    inside ``[tau_min, tau_max]``).

    Args:
        target_entropy: ``H*`` in nats (``log G`` is uniform weights), at step 0.
        lr: ``eta_tau``, step size on ``log tau`` per nat of error.
        tau_min: lower bound of tau (> 0).
        tau_max: upper bound of tau.
        ema_decay: decay of the entropy EMA, in [0, 1).
        warmup_steps: training steps during which only the EMA moves.
        target_entropy_final: ``H*`` at the end of the anneal, or None (constant target).
        target_entropy_horizon: steps of the linear anneal (0 = constant target).
        state_path: where to write ``controller_state.json`` (may contain ``{log_dir}``,
            the logger's version folder), or None.
        resume_from: a ``controller_state.json`` to start from, or None.
        overwrite_existing: allow a fresh run to replace an existing ``state_path``.
    """

    moves = ("tau",)

    def __init__(
        self,
        target_entropy: float,
        lr: float = 0.1,
        tau_min: float = 0.01,
        tau_max: float = 10.0,
        ema_decay: float = 0.9,
        warmup_steps: int = 0,
        target_entropy_final: float | None = None,
        target_entropy_horizon: int = 0,
        state_path: str | None = None,
        resume_from: str | None = None,
        overwrite_existing: bool = False,
    ) -> None:
        super().__init__(state_path, resume_from, overwrite_existing)
        for name, value in (("target_entropy", target_entropy),
                            ("target_entropy_final", target_entropy_final)):
            _check(value is None or (_is_number(value) and value >= 0),
                   f"TauController.{name} must be a finite number >= 0; got {value}")
        _check(_is_number(lr) and lr >= 0, f"TauController.lr must be >= 0; got {lr}")
        _check_tau_bounds("TauController", tau_min, tau_max)
        _check(_is_number(ema_decay) and 0 <= ema_decay < 1,
               f"TauController.ema_decay must be in [0, 1); got {ema_decay}")
        _check(warmup_steps >= 0, f"TauController.warmup_steps must be >= 0; got {warmup_steps}")
        _check(target_entropy_horizon >= 0,
               f"TauController.target_entropy_horizon must be >= 0; got {target_entropy_horizon}")
        self.target_entropy = float(target_entropy)
        self.lr = float(lr)
        self.tau_min, self.tau_max = float(tau_min), float(tau_max)
        self.ema_decay = float(ema_decay)
        self.warmup_steps = int(warmup_steps)
        self.target_entropy_final = target_entropy_final
        self.target_entropy_horizon = int(target_entropy_horizon)
        self.tau = math.nan
        self.tau_log = math.nan
        self.entropy_ema: float | None = None

    def _check_objective(self, objective: Objective, pl_module: pl.LightningModule) -> None:
        _check(
            isinstance(objective, (ListwiseMaxEnt, GroupMaxEnt)),
            "TauController moves objective.tau and steers the weight entropy, which only "
            "ListwiseMaxEnt and GroupMaxEnt have; model.objective is "
            f"{type(objective).__name__}",
        )
        _check(
            objective.tau > 0,
            "TauController moves log tau, so it needs model.objective.tau > 0; got "
            f"{objective.tau}",
        )
        _check_tau_start("TauController", objective, self.tau_min, self.tau_max)
        _check_target_entropy("TauController.target_entropy", self.target_entropy, pl_module)
        _check_target_entropy(
            "TauController.target_entropy_final", self.target_entropy_final, pl_module
        )

    def _start(self, objective: Objective) -> None:
        self.tau = float(objective.tau)
        self.tau_log = math.log(self.tau)
        self.entropy_ema = None

    def target_at(self, step: int) -> float:
        """``H*`` at controller step ``step``."""
        return entropy_target_at(
            step, start=self.target_entropy, final=self.target_entropy_final,
            horizon=self.target_entropy_horizon,
        )

    def _update(self, stats: dict[str, float]) -> dict[str, float]:
        h = stats.get("weight_entropy", math.nan)
        if not _is_number(h):
            rank_zero_warn(f"TauController: no finite train/weight_entropy ({h}); tau unchanged")
            return {}
        target = self.target_at(self.steps)
        old = self.tau
        new = tau_update(
            tau_log=self.tau_log, entropy_ema=self.entropy_ema, weight_entropy=h,
            target_entropy=target, lr=self.lr, tau_min=self.tau_min, tau_max=self.tau_max,
            ema_decay=self.ema_decay, in_warmup=self.steps < self.warmup_steps,
        )
        self.tau, self.tau_log, self.entropy_ema = new.tau, new.tau_log, new.entropy_ema
        return {
            "train/delta_tau": self.tau - old,
            "train/tau_entropy_ema": new.entropy_ema,
            "train/tau_target_entropy": target,
        }

    def _push(self, objective: Objective) -> None:
        objective.tau = self.tau

    def _fields(self) -> dict[str, Any]:
        return {"tau": self.tau, "tau_log": self.tau_log, "tau_entropy_ema": self.entropy_ema}

    def _restore(self, state: dict[str, Any]) -> None:
        self.tau, self.tau_log = float(state["tau"]), float(state["tau_log"])
        ema = state["tau_entropy_ema"]
        self.entropy_ema = None if ema is None else float(ema)

    def _fill(self, snapshot: dict[str, Any]) -> None:
        snapshot["tau_log"] = self.tau_log
        snapshot["tau_entropy_ema"] = self.entropy_ema
        snapshot["meta"]["tau_steps"] = self.steps

    def _read(self, state: dict[str, Any], path: str) -> None:
        self.tau = _need(state, "tau", path)
        self.tau_log = _need(state, "tau_log", path)
        ema = state["tau_entropy_ema"]
        self.entropy_ema = None if ema is None else float(ema)
        self.steps = int(_need(state, "tau_steps", path, meta=True))


class BetaController(_Controller):
    """Steer the measured KL to the reference towards ``kl_target`` (ALGORITHM §5).

    Per training step (:func:`maxent_grpo.core.control.beta_update`)::

        e    = clip(KL / kl_target - 1, -step_bound, step_bound)
        beta <- max(0, beta * (1 + e / horizon))

    ``KL`` is ``train/kl``, the token-mean KL of the step. A step whose KL is missing or
    non-finite counts as above the target (``e = +step_bound``), as in the core rule.

    The rule is multiplicative: ``beta = 0`` can never rise. So ``model.objective.beta``
    must start > 0 (use :class:`MetaController`, whose beta step is additive, to start from
    0), and ``step_bound < horizon`` keeps every factor ``1 + e/H`` positive, so beta never
    reaches 0 either. Works with GRPO, EntropyMaxEnt and ListwiseMaxEnt; loads the
    reference model from the start.

    Args:
        kl_target: ``KL*`` (> 0), in nats per token.
        horizon: ``H`` (> 0): steps over which beta moves by about ``e``; larger is slower.
        step_bound: ``s`` (> 0, < horizon): bound of the relative KL error per step.
        state_path: where to write ``controller_state.json`` (may contain ``{log_dir}``),
            or None.
        resume_from: a ``controller_state.json`` to start from, or None.
        overwrite_existing: allow a fresh run to replace an existing ``state_path``.
    """

    moves = ("beta",)
    can_raise_beta = True

    def __init__(
        self,
        kl_target: float,
        horizon: float = 10.0,
        step_bound: float = 0.2,
        state_path: str | None = None,
        resume_from: str | None = None,
        overwrite_existing: bool = False,
    ) -> None:
        super().__init__(state_path, resume_from, overwrite_existing)
        _check(_is_number(kl_target) and kl_target > 0,
               f"BetaController.kl_target must be a finite number > 0; got {kl_target}")
        _check(_is_number(horizon) and horizon > 0,
               f"BetaController.horizon must be a finite number > 0; got {horizon}")
        _check(_is_number(step_bound) and 0 < step_bound < horizon,
               f"BetaController.step_bound must be > 0 and < horizon ({horizon}), or beta "
               f"could fall to 0, where the multiplicative rule keeps it; got {step_bound}")
        self.kl_target = float(kl_target)
        self.horizon = float(horizon)
        self.step_bound = float(step_bound)
        self.beta = math.nan
        self.error: float | None = None

    def _check_objective(self, objective: Objective, pl_module: pl.LightningModule) -> None:
        _check(
            isinstance(objective, (GRPO, ListwiseMaxEnt))
            and not isinstance(objective, GroupMaxEnt),
            "BetaController moves objective.beta, which GRPO, EntropyMaxEnt and ListwiseMaxEnt "
            "have (GroupMaxEnt weighs the reference with lam instead); model.objective is "
            f"{type(objective).__name__}",
        )
        _check(
            objective.beta > 0,
            "BetaController: model.objective.beta is 0, and its multiplicative rule "
            "beta <- beta * (1 + e / horizon) can never raise beta from 0; set "
            "model.objective.beta > 0 (e.g. 0.01), or use MetaController (additive)",
        )

    def _start(self, objective: Objective) -> None:
        self.beta = float(objective.beta)
        self.error = None

    def _update(self, stats: dict[str, float]) -> dict[str, float]:
        kl = stats.get("kl", math.nan)
        old = self.beta
        new = beta_update(
            beta=self.beta, kl=kl, kl_target=self.kl_target, horizon=self.horizon,
            step_bound=self.step_bound,
        )
        self.beta, self.error = new.beta, new.error
        return {"train/delta_beta": self.beta - old, "train/beta_kl_error": new.error}

    def _push(self, objective: Objective) -> None:
        objective.beta = self.beta

    def _fields(self) -> dict[str, Any]:
        return {"beta": self.beta, "kl_error": self.error}

    def _restore(self, state: dict[str, Any]) -> None:
        self.beta = float(state["beta"])
        self.error = None if state["kl_error"] is None else float(state["kl_error"])

    def _fill(self, snapshot: dict[str, Any]) -> None:
        snapshot["meta"]["beta_steps"] = self.steps
        snapshot["meta"]["kl_error"] = self.error

    def _read(self, state: dict[str, Any], path: str) -> None:
        self.beta = _need(state, "beta", path)
        _check(
            self.beta > 0,
            f"controller state file {path!r}: 'beta' is 0, which BetaController can never "
            "raise; use MetaController or start a fresh run",
        )
        self.steps = int(_need(state, "beta_steps", path, meta=True))
        self.error = _optional(state, "kl_error", path)


class MetaController(_Controller):
    """Move tau and beta together along the gradient of ``½(H_w - H*)² + ½(KL - KL*)²``.

    Every ``every_n_steps`` training steps (:func:`maxent_grpo.core.control.meta_update`)::

        tau_grad  = H_w - H*                      beta_grad = clip(KL - KL*, -c, c)
        tau  <- clip(tau - lr_tau * tau_grad, tau_min, tau_max)
        beta <- max(0, beta + lr_beta * beta_grad)

    on the latest step's ``train/weight_entropy`` and ``train/kl`` (a missing or
    non-finite KL counts as above the target, ``beta_grad = +c``; a step without a finite
    weight entropy is skipped with a warning). The beta step is additive, so beta may
    start at 0 and rise; the reference model is loaded from the start. ListwiseMaxEnt only
    (it has both tau and beta); use it instead of, not with, Tau/BetaController.

    Args:
        target_entropy: ``H*`` in nats, in [0, log G].
        kl_target: ``KL*`` in nats per token.
        lr_tau: step size of tau per nat of entropy error.
        lr_beta: step size of beta per nat of KL error.
        tau_min: lower bound of tau (> 0, keeps ``tau + beta > 0``).
        tau_max: upper bound of tau.
        kl_clip: ``c`` (> 0), bound of the KL error.
        every_n_steps: act on every n-th training step.
        state_path: where to write ``controller_state.json`` (may contain ``{log_dir}``),
            or None.
        resume_from: a ``controller_state.json`` to start from, or None.
        overwrite_existing: allow a fresh run to replace an existing ``state_path``.
    """

    moves = ("tau", "beta")
    can_raise_beta = True

    def __init__(
        self,
        target_entropy: float,
        kl_target: float,
        lr_tau: float = 0.05,
        lr_beta: float = 0.05,
        tau_min: float = 0.01,
        tau_max: float = 10.0,
        kl_clip: float = 1.0,
        every_n_steps: int = 1,
        state_path: str | None = None,
        resume_from: str | None = None,
        overwrite_existing: bool = False,
    ) -> None:
        super().__init__(state_path, resume_from, overwrite_existing)
        _check(_is_number(target_entropy) and target_entropy >= 0,
               f"MetaController.target_entropy must be a finite number >= 0; got {target_entropy}")
        _check(_is_number(kl_target) and kl_target >= 0,
               f"MetaController.kl_target must be a finite number >= 0; got {kl_target}")
        for name, value in (("lr_tau", lr_tau), ("lr_beta", lr_beta)):
            _check(_is_number(value) and value >= 0,
                   f"MetaController.{name} must be >= 0; got {value}")
        _check_tau_bounds("MetaController", tau_min, tau_max)
        _check(_is_number(kl_clip) and kl_clip > 0,
               f"MetaController.kl_clip must be > 0; got {kl_clip}")
        _check(every_n_steps >= 1,
               f"MetaController.every_n_steps must be >= 1; got {every_n_steps}")
        self.target_entropy = float(target_entropy)
        self.kl_target = float(kl_target)
        self.lr_tau, self.lr_beta = float(lr_tau), float(lr_beta)
        self.tau_min, self.tau_max = float(tau_min), float(tau_max)
        self.kl_clip = float(kl_clip)
        self.every_n_steps = int(every_n_steps)
        self.tau = self.beta = math.nan
        self.tau_grad: float | None = None
        self.beta_grad: float | None = None

    def _check_objective(self, objective: Objective, pl_module: pl.LightningModule) -> None:
        _check(
            isinstance(objective, ListwiseMaxEnt),
            "MetaController moves objective.tau and objective.beta and steers the weight "
            "entropy: only ListwiseMaxEnt has all three; model.objective is "
            f"{type(objective).__name__}",
        )
        _check_tau_start("MetaController", objective, self.tau_min, self.tau_max)
        _check_target_entropy("MetaController.target_entropy", self.target_entropy, pl_module)

    def _start(self, objective: Objective) -> None:
        self.tau, self.beta = float(objective.tau), float(objective.beta)
        self.tau_grad = self.beta_grad = None

    def _update(self, stats: dict[str, float]) -> dict[str, float]:
        if (self.steps + 1) % self.every_n_steps:
            return {}
        h = stats.get("weight_entropy", math.nan)
        if not _is_number(h):
            rank_zero_warn(f"MetaController: no finite train/weight_entropy ({h}); step skipped")
            return {}
        old_tau, old_beta = self.tau, self.beta
        new = meta_update(
            tau=self.tau, beta=self.beta, weight_entropy=h,
            kl=stats.get("kl", math.nan), target_entropy=self.target_entropy,
            kl_target=self.kl_target, lr_tau=self.lr_tau, lr_beta=self.lr_beta,
            tau_min=self.tau_min, tau_max=self.tau_max, kl_clip=self.kl_clip,
        )
        self.tau, self.beta = new.tau, new.beta
        self.tau_grad, self.beta_grad = new.tau_grad, new.beta_grad
        return {
            "train/delta_tau": self.tau - old_tau,
            "train/delta_beta": self.beta - old_beta,
            "train/meta/tau_grad": new.tau_grad,
            "train/meta/beta_grad": new.beta_grad,
        }

    def _push(self, objective: Objective) -> None:
        objective.tau, objective.beta = self.tau, self.beta

    def _fields(self) -> dict[str, Any]:
        return {"tau": self.tau, "beta": self.beta, "tau_grad": self.tau_grad,
                "beta_grad": self.beta_grad}

    def _restore(self, state: dict[str, Any]) -> None:
        self.tau, self.beta = float(state["tau"]), float(state["beta"])
        self.tau_grad = None if state["tau_grad"] is None else float(state["tau_grad"])
        self.beta_grad = None if state["beta_grad"] is None else float(state["beta_grad"])

    def _fill(self, snapshot: dict[str, Any]) -> None:
        snapshot["meta"].update(
            meta_steps=self.steps, tau_grad=self.tau_grad, beta_grad=self.beta_grad
        )

    def _read(self, state: dict[str, Any], path: str) -> None:
        self.tau = _need(state, "tau", path)
        self.beta = _need(state, "beta", path)
        self.steps = int(_need(state, "meta_steps", path, meta=True))
        self.tau_grad = _optional(state, "tau_grad", path)
        self.beta_grad = _optional(state, "beta_grad", path)


# ---------------------------------------------------------------------- export


class HFExport(Callback):
    """Save the policy and its tokenizer with ``save_pretrained`` (global rank 0).

    At the end of training into ``<dirpath>/final``, and, with ``every_n_train_steps``,
    each time the global step passes a multiple of it into ``<dirpath>/step-<global_step>``.
    The folders load with ``AutoModelForCausalLM.from_pretrained`` /
    ``AutoTokenizer.from_pretrained`` (or ``model.model_name_or_path``).

    Args:
        dirpath: output folder; None means ``<trainer.log_dir>/hf`` (the logger's version
            folder, e.g. ``lightning_logs/tiny/version_0/hf``).
        every_n_train_steps: also export every this many optimizer steps; None = only at
            the end.
    """

    def __init__(self, dirpath: str | None = None, every_n_train_steps: int | None = None) -> None:
        _check(dirpath is None or bool(str(dirpath).strip()),
               f"HFExport.dirpath must be None or a non-empty path; got {dirpath!r}")
        _check(every_n_train_steps is None or every_n_train_steps >= 1,
               f"HFExport.every_n_train_steps must be >= 1 or None; got {every_n_train_steps}")
        self.dirpath = dirpath
        self.every_n_train_steps = every_n_train_steps
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
        """``save_pretrained`` of ``pl_module.policy`` and ``.tokenizer`` into
        ``<dirpath>/<name>``; returns the folder (None on other ranks)."""
        if not trainer.is_global_zero:
            return None
        assert self.dirpath is not None, "HFExport.setup() sets dirpath"
        out = Path(self.dirpath) / name
        pl_module.policy.save_pretrained(out)
        pl_module.tokenizer.save_pretrained(out)
        log.info("exported the policy and tokenizer to %s", out)
        return out

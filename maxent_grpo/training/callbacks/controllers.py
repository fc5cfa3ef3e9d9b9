"""The tau / beta / meta controllers of docs/ALGORITHM.md §5: their checks and update rules.

Each is a :class:`~maxent_grpo.training.callbacks.controller_base.Controller` (timing,
state, restore order); the rules are :mod:`maxent_grpo.core.control`'s. Which objectives:
by :attr:`~maxent_grpo.objectives.Objective.tunable`:

=================  ======================  =====================================
controller         needs in ``tunable``    reads
=================  ======================  =====================================
TauController      ``tau`` (tau > 0)       ``train/weight_entropy``
BetaController     ``beta`` (beta > 0)     ``train/kl`` (loads the reference)
MetaController     ``tau`` and ``beta``    both
=================  ======================  =====================================

Anything else fails at ``setup`` with a ValueError naming the callback and the objective.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn

from maxent_grpo.core.control import beta_update, entropy_target_at, meta_update, tau_update
from maxent_grpo.objectives import Objective
from maxent_grpo.training.callbacks.controller_base import Controller
from maxent_grpo.validation import check_int, check_number, is_number, require

__all__ = ["BetaController", "MetaController", "TauController"]


def _check_target_entropy(owner: str, value: float | None, pl_module: pl.LightningModule) -> None:
    """A weight entropy over G candidates lies in [0, log G]."""
    if value is None:
        return
    G = pl_module.loop.generation.num_generations
    require(
        value <= math.log(G),
        f"{owner} must be in [0, log G] = [0, {math.log(G):.4f}] for "
        f"model.num_generations={G}; got {value}",
    )


def _check_tau_bounds(owner: str, tau_min: float, tau_max: float) -> None:
    check_number(f"{owner}.tau_min", tau_min, minimum=0, strict=True)
    require(
        is_number(tau_max) and tau_max >= tau_min,
        f"{owner}.tau_max must be a finite number >= tau_min ({tau_min}); got {tau_max}",
    )


def _check_tau_start(owner: str, tau: float, origin: str, tau_min: float, tau_max: float) -> None:
    require(  # within rounding: a warm-up's exp(log tau) may move tau by an ulp past a bound
        tau_min * (1 - 1e-12) <= tau <= tau_max * (1 + 1e-12),
        f"{owner}: tau = {tau} in {origin} lies outside [tau_min, tau_max] = "
        f"[{tau_min}, {tau_max}]; change one of them",
    )


class TauController(Controller):
    """Steer the weight entropy ``H_w`` (mean over groups of ``H(w)``) to a target ``H*``.

    Per training step (:func:`maxent_grpo.core.control.tau_update`)::

        EMA   <- ema_decay * EMA + (1 - ema_decay) * H_w     (the first H_w initialises it)
        log t <- log t + lr * (H*(step) - EMA)                (not during warmup_steps)
        tau    = clip(exp(log t), tau_min, tau_max)

    with ``log t = log(objective.tau)`` (> 0, in ``[tau_min, tau_max]``) and ``H*`` in
    ``[0, log G]``. A non-finite ``train/weight_entropy`` leaves tau unchanged (a warning).

    Args:
        target_entropy: ``H*`` in nats (``log G`` is uniform weights), at step 0.
        lr: ``eta_tau``, step size on ``log tau`` per nat of error.
        tau_min: lower bound of tau (> 0).
        tau_max: upper bound of tau.
        ema_decay: decay of the entropy EMA, in [0, 1).
        warmup_steps: training steps during which only the EMA moves.
        target_entropy_final: ``H*`` at the end of a linear anneal, or None (constant).
        target_entropy_horizon: steps of the linear anneal (0 = constant target).
        state_path: where to write ``controller_state.json`` (may hold ``{log_dir}``), or None.
        resume_from: a ``controller_state.json`` to start from, or None.
        overwrite_existing: allow a fresh run to replace an existing ``state_path``.
    """

    moves = ("tau",)
    file_fields = {"steps": "meta.tau_steps", "tau_entropy_ema": "tau_entropy_ema"}

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
        check_number("TauController.target_entropy", target_entropy, minimum=0)
        check_number("TauController.target_entropy_final", target_entropy_final, minimum=0,
                     allow_none=True)
        check_number("TauController.lr", lr, minimum=0)
        _check_tau_bounds("TauController", tau_min, tau_max)
        require(is_number(ema_decay) and 0 <= ema_decay < 1,
                f"TauController.ema_decay must be in [0, 1); got {ema_decay}")
        check_int("TauController.warmup_steps", warmup_steps, minimum=0)
        check_int("TauController.target_entropy_horizon", target_entropy_horizon, minimum=0)
        require((target_entropy_final is None) == (target_entropy_horizon == 0),
                "TauController: an anneal of the target entropy needs both "
                "target_entropy_final and target_entropy_horizon (> 0); got "
                f"target_entropy_final={target_entropy_final}, "
                f"target_entropy_horizon={target_entropy_horizon}")
        self.target_entropy = float(target_entropy)
        self.lr = float(lr)
        self.tau_min, self.tau_max = float(tau_min), float(tau_max)
        self.ema_decay = float(ema_decay)
        self.warmup_steps = warmup_steps
        self.target_entropy_final = target_entropy_final
        self.target_entropy_horizon = target_entropy_horizon
        self.tau_entropy_ema: float | None = None

    def _check_start(self, objective: Objective, origin: str,
                     pl_module: pl.LightningModule) -> None:
        require(
            objective.tau > 0,
            f"TauController moves log tau, so it needs tau > 0; {origin} has tau = "
            f"{objective.tau}",
        )
        _check_tau_start("TauController", objective.tau, origin, self.tau_min, self.tau_max)
        _check_target_entropy("TauController.target_entropy", self.target_entropy, pl_module)
        _check_target_entropy(
            "TauController.target_entropy_final", self.target_entropy_final, pl_module
        )

    def target_at(self, step: int) -> float:
        """``H*`` at controller step ``step``."""
        return entropy_target_at(
            step, start=self.target_entropy, final=self.target_entropy_final,
            horizon=self.target_entropy_horizon,
        )

    def _update(self, objective: Objective, stats: dict[str, float]) -> dict[str, float]:
        h = stats.get("train/weight_entropy", math.nan)
        if not is_number(h):
            rank_zero_warn(f"TauController: no finite train/weight_entropy ({h}); tau unchanged")
            return {}
        target = self.target_at(self.steps)
        old = objective.tau
        new = tau_update(
            tau_log=math.log(old), entropy_ema=self.tau_entropy_ema, weight_entropy=h,
            target_entropy=target, lr=self.lr, tau_min=self.tau_min, tau_max=self.tau_max,
            ema_decay=self.ema_decay, in_warmup=self.steps < self.warmup_steps,
        )
        objective.tau, self.tau_entropy_ema = new.tau, new.entropy_ema
        return {
            "train/delta_tau": new.tau - old,
            "train/tau_entropy_ema": new.entropy_ema,
            "train/tau_target_entropy": target,
        }


class BetaController(Controller):
    """Steer the measured KL to the reference towards ``kl_target`` (docs/ALGORITHM.md §5).

    Per training step (:func:`maxent_grpo.core.control.beta_update`)::

        e    = clip(KL / kl_target - 1, -step_bound, step_bound)
        beta <- max(0, beta * (1 + e / horizon))

    ``KL`` is ``train/kl`` (token mean; missing or non-finite: ``e = +step_bound``, once the
    run has measured one: before, beta stays, with a warning). The rule is multiplicative:
    beta must start > 0 (:class:`MetaController` can start from 0).

    Args:
        kl_target: ``KL*`` (> 0), in nats per token.
        horizon: ``H`` (> 0): steps over which beta moves by about ``e``; larger is slower.
        step_bound: ``s`` (> 0, < horizon): bound of the relative KL error per step.
        state_path: where to write ``controller_state.json`` (may hold ``{log_dir}``), or None.
        resume_from: a ``controller_state.json`` to start from, or None.
        overwrite_existing: allow a fresh run to replace an existing ``state_path``.
    """

    moves = ("beta",)
    file_fields = {"steps": "meta.beta_steps", "kl_error": "meta.kl_error"}
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
        check_number("BetaController.kl_target", kl_target, minimum=0, strict=True)
        check_number("BetaController.horizon", horizon, minimum=0, strict=True)
        require(is_number(step_bound) and 0 < step_bound < horizon,
                f"BetaController.step_bound must be > 0 and < horizon ({horizon}), or beta "
                f"could fall to 0, where the multiplicative rule keeps it; got {step_bound}")
        self.kl_target = float(kl_target)
        self.horizon = float(horizon)
        self.step_bound = float(step_bound)
        self.kl_error: float | None = None

    def _check_start(self, objective: Objective, origin: str,
                     pl_module: pl.LightningModule) -> None:
        require(
            objective.beta > 0,
            f"BetaController: beta is 0 in {origin} and its multiplicative rule "
            "beta <- beta * (1 + e / horizon) can never raise beta from 0; " + (
                "set model.objective.beta > 0 (e.g. 0.01)" if origin == "model.objective" else
                "write a beta > 0 into it" if origin.startswith("controller state file") else
                "start afresh from its weights (maxent-grpo export)") + (
                ", or use MetaController (additive)" if "tau" in objective.tunable else ""),
        )

    def _update(self, objective: Objective, stats: dict[str, float]) -> dict[str, float]:
        # kl_error: set by each update (and resumed): a KL was measured once this run
        if self.kl_error is None and "train/kl" not in stats:  # an objective that logs none
            rank_zero_warn(f"BetaController: no train/kl yet ({type(objective).__name__}'s "
                           "loss's sums hold no 'kl'?); beta unchanged")
            return {}
        old = objective.beta
        new = beta_update(
            beta=old, kl=stats.get("train/kl", math.nan), kl_target=self.kl_target,
            horizon=self.horizon, step_bound=self.step_bound,
        )
        objective.beta, self.kl_error = new.beta, new.error
        return {"train/delta_beta": new.beta - old, "train/beta_kl_error": new.error}


class MetaController(Controller):
    """Move tau and beta together along the gradient of ``½(H_w - H*)² + ½(KL - KL*)²``.

    Every ``every_n_steps`` training steps (:func:`maxent_grpo.core.control.meta_update`)::

        tau_grad  = H_w - H*                      beta_grad = clip(KL - KL*, -c, c)
        tau  <- clip(tau - lr_tau * tau_grad, tau_min, tau_max)
        beta <- max(0, beta + lr_beta * beta_grad)

    on ``train/weight_entropy`` and ``train/kl`` (a missing or non-finite KL gives
    ``beta_grad = +c`` once the run has measured one: before, beta stays, with a warning; a
    non-finite entropy skips the step, warning). Use it instead of Tau/BetaController.

    Args:
        target_entropy: ``H*`` in nats, in [0, log G].
        kl_target: ``KL*`` in nats per token.
        lr_tau: step size of tau per nat of entropy error.
        lr_beta: step size of beta per nat of KL error.
        tau_min: lower bound of tau (> 0, keeps ``tau + beta > 0``).
        tau_max: upper bound of tau.
        kl_clip: ``c`` (> 0), bound of the KL error.
        every_n_steps: act on every n-th training step.
        state_path: where to write ``controller_state.json`` (may hold ``{log_dir}``), or None.
        resume_from: a ``controller_state.json`` to start from, or None.
        overwrite_existing: allow a fresh run to replace an existing ``state_path``.
    """

    moves = ("tau", "beta")
    file_fields = {"steps": "meta.meta_steps", "tau_grad": "meta.tau_grad",
                   "beta_grad": "meta.beta_grad"}
    can_raise_beta = True
    is_meta = True

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
        check_number("MetaController.target_entropy", target_entropy, minimum=0)
        check_number("MetaController.kl_target", kl_target, minimum=0)
        check_number("MetaController.lr_tau", lr_tau, minimum=0)
        check_number("MetaController.lr_beta", lr_beta, minimum=0)
        _check_tau_bounds("MetaController", tau_min, tau_max)
        check_number("MetaController.kl_clip", kl_clip, minimum=0, strict=True)
        check_int("MetaController.every_n_steps", every_n_steps, minimum=1)
        self.target_entropy = float(target_entropy)
        self.kl_target = float(kl_target)
        self.lr_tau, self.lr_beta = float(lr_tau), float(lr_beta)
        self.tau_min, self.tau_max = float(tau_min), float(tau_max)
        self.kl_clip = float(kl_clip)
        self.every_n_steps = every_n_steps
        self.tau_grad: float | None = None
        self.beta_grad: float | None = None

    def _check_start(self, objective: Objective, origin: str,
                     pl_module: pl.LightningModule) -> None:
        _check_tau_start("MetaController", objective.tau, origin, self.tau_min, self.tau_max)
        _check_target_entropy("MetaController.target_entropy", self.target_entropy, pl_module)

    def _update(self, objective: Objective, stats: dict[str, float]) -> dict[str, float]:
        if (self.steps + 1) % self.every_n_steps:
            return {}
        h = stats.get("train/weight_entropy", math.nan)
        if not is_number(h):
            rank_zero_warn(f"MetaController: no finite train/weight_entropy ({h}); step skipped")
            return {}
        old_tau, old_beta = objective.tau, objective.beta
        # beta_grad: set by each update that moved beta (and resumed): a KL was measured
        unmeasured = self.beta_grad is None and "train/kl" not in stats
        if unmeasured:  # an objective that logs none: not read as a KL above the target
            rank_zero_warn(f"MetaController: no train/kl yet ({type(objective).__name__}'s "
                           "loss's sums hold no 'kl'?); tau moves, beta unchanged")
        new = meta_update(
            tau=old_tau, beta=old_beta, weight_entropy=h,
            kl=self.kl_target if unmeasured else stats.get("train/kl", math.nan),
            target_entropy=self.target_entropy, kl_target=self.kl_target, lr_tau=self.lr_tau,
            lr_beta=self.lr_beta, tau_min=self.tau_min, tau_max=self.tau_max,
            kl_clip=self.kl_clip,
        )
        objective.tau, objective.beta = new.tau, new.beta
        self.tau_grad = new.tau_grad
        logs = {"train/delta_tau": new.tau - old_tau, "train/meta/tau_grad": new.tau_grad}
        if unmeasured:
            return logs
        self.beta_grad = new.beta_grad
        return {**logs, "train/delta_beta": new.beta - old_beta,
                "train/meta/beta_grad": new.beta_grad}

"""Pure update rules of the adaptive controllers (docs/ALGORITHM.md §4.2 and §5).

Every function takes and returns plain python floats. The Lightning callbacks read tau and
beta from the objective (their one owner), keep their own state (the entropy EMA, ...) and
call these rules once per training step on statistics reduced over micro-batches and ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TauUpdate:
    """Result of :func:`tau_update`: new ``tau``, its log and the entropy EMA."""

    tau: float
    tau_log: float
    entropy_ema: float


@dataclass(frozen=True)
class BetaUpdate:
    """Result of :func:`beta_update`: new ``beta`` and the clipped relative KL error ``e``."""

    beta: float
    error: float


@dataclass(frozen=True)
class MetaUpdate:
    """Result of :func:`meta_update`: new ``tau``, ``beta`` and the two gradients used."""

    tau: float
    beta: float
    tau_grad: float
    beta_grad: float


def _finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a finite number; got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite; got {value!r}")
    return float(value)


def _at_least(name: str, value: float, bound: float, *, strict: bool = False) -> float:
    value = _finite(name, value)
    if value < bound or (strict and value == bound):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {bound:g}; got {value!r}")
    return value


def _tau_bounds(tau_min: float, tau_max: float) -> tuple[float, float]:
    tau_min = _at_least("tau_min", tau_min, 0.0, strict=True)
    tau_max = _finite("tau_max", tau_max)
    if tau_max < tau_min:
        raise ValueError(f"tau_max must be >= tau_min ({tau_min!r}); got {tau_max!r}")
    return tau_min, tau_max


def tau_update(
    *, tau_log: float, entropy_ema: float | None, weight_entropy: float, target_entropy: float,
    lr: float, tau_min: float, tau_max: float, ema_decay: float = 0.9, in_warmup: bool = False,
) -> TauUpdate:
    """One step of the tau controller, which steers the weight entropy ``H_w`` to ``H*``.

    1. ``EMA <- ema_decay * EMA + (1 - ema_decay) * H_w``; when ``entropy_ema`` is None (first
       observation) ``EMA <- H_w``.
    2. Unless ``in_warmup``: ``log tau <- log tau + lr * (H* - EMA)`` with the new EMA, then
       ``tau = exp(log tau)`` clipped to ``[tau_min, tau_max]``. Too little entropy raises tau.

    When the clip binds, ``tau_log`` is reset to the bound's log (no wind-up). During warmup
    the EMA still tracks ``H_w`` but tau does not move: ``tau = exp(tau_log)``, unclipped.

    Raises ``ValueError`` for non-finite inputs (``weight_entropy`` included), ``lr < 0``,
    unless ``0 < tau_min <= tau_max`` and ``0 <= ema_decay < 1``.
    """
    tau_log = _finite("tau_log", tau_log)
    weight_entropy = _finite("weight_entropy", weight_entropy)
    target_entropy = _finite("target_entropy", target_entropy)
    lr = _at_least("lr", lr, 0.0)
    tau_min, tau_max = _tau_bounds(tau_min, tau_max)
    ema_decay = _at_least("ema_decay", ema_decay, 0.0)
    if ema_decay >= 1:
        raise ValueError(f"ema_decay must be in [0, 1); got {ema_decay!r}")

    if entropy_ema is None:
        ema = weight_entropy
    else:
        ema = _finite("entropy_ema", entropy_ema)
        ema = ema_decay * ema + (1.0 - ema_decay) * weight_entropy
    if in_warmup:
        return TauUpdate(tau=math.exp(tau_log), tau_log=tau_log, entropy_ema=ema)

    new_log = tau_log + lr * (target_entropy - ema)
    if new_log <= math.log(tau_min):
        tau = tau_min
        new_log = math.log(tau_min)
    elif new_log >= math.log(tau_max):
        tau = tau_max
        new_log = math.log(tau_max)
    else:
        tau = math.exp(new_log)
    return TauUpdate(tau=tau, tau_log=new_log, entropy_ema=ema)


def entropy_target_at(
    step: int, *, start: float, final: float | None = None, horizon: int = 0
) -> float:
    """Target weight entropy ``H*`` at optimizer step ``step``.

    Linear anneal ``H*(step) = start + (final - start) * min(step / horizon, 1)``: ``start``
    at step 0, ``final`` from step ``horizon`` on. Constant ``start`` when ``final`` is None
    or ``horizon == 0``. Raises ``ValueError`` for ``step < 0``, ``horizon < 0`` or non-finite
    ``start`` / ``final``.
    """
    for name, value in (("step", step), ("horizon", horizon)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0; got {value!r}")
    start = _finite("start", start)
    if final is None or horizon == 0:
        return start
    final = _finite("final", final)
    return start + (final - start) * min(step / horizon, 1.0)


def beta_update(
    *, beta: float, kl: float, kl_target: float, horizon: float, step_bound: float
) -> BetaUpdate:
    """One step of the beta (KL) controller, which steers the measured KL to ``KL*``.

    ``e = clip(KL / KL* - 1, -s, s)``, ``beta <- max(0, beta * (1 + e / H))`` with horizon
    ``H`` and step bound ``s``. A non-finite ``kl`` counts as above the target: ``e = +s``.
    ``beta = 0`` stays 0.

    Raises ``ValueError`` unless ``beta >= 0`` and ``kl_target``, ``horizon`` and
    ``step_bound`` are ``> 0`` (all finite).
    """
    beta = _at_least("beta", beta, 0.0)
    kl_target = _at_least("kl_target", kl_target, 0.0, strict=True)
    horizon = _at_least("horizon", horizon, 0.0, strict=True)
    step_bound = _at_least("step_bound", step_bound, 0.0, strict=True)
    if isinstance(kl, bool) or not isinstance(kl, (int, float)):
        raise ValueError(f"kl must be a number; got {kl!r}")
    if math.isfinite(kl):
        error = min(max(kl / kl_target - 1.0, -step_bound), step_bound)
    else:
        error = step_bound
    return BetaUpdate(beta=max(0.0, beta * (1.0 + error / horizon)), error=error)


def meta_update(
    *, tau: float, beta: float, weight_entropy: float, kl: float, target_entropy: float,
    kl_target: float, lr_tau: float, lr_beta: float, tau_min: float, tau_max: float, kl_clip: float,
) -> MetaUpdate:
    """One step of the meta controller (gradient of ``½(H_w - H*)² + ½(KL - KL*)²``).

    ``tau_grad = H_w - H*``, ``beta_grad = clip(KL - KL*, -c, c)``;
    ``tau <- clip(tau - lr_tau * tau_grad, tau_min, tau_max)`` (too little entropy raises tau),
    ``beta <- max(0, beta + lr_beta * beta_grad)``. A non-finite ``kl`` counts as above the
    target: ``beta_grad = +c``.

    Raises ``ValueError`` for non-finite ``tau``, ``weight_entropy``, ``target_entropy`` or
    ``kl_target``, unless ``beta >= 0``, ``lr_tau >= 0``, ``lr_beta >= 0``, ``kl_clip > 0`` and
    ``0 < tau_min <= tau_max`` (``tau_min > 0`` keeps ``tau + beta > 0`` for the listwise
    weights even when beta reaches 0).
    """
    tau = _finite("tau", tau)
    beta = _at_least("beta", beta, 0.0)
    weight_entropy = _finite("weight_entropy", weight_entropy)
    target_entropy = _finite("target_entropy", target_entropy)
    kl_target = _finite("kl_target", kl_target)
    lr_tau = _at_least("lr_tau", lr_tau, 0.0)
    lr_beta = _at_least("lr_beta", lr_beta, 0.0)
    tau_min, tau_max = _tau_bounds(tau_min, tau_max)
    kl_clip = _at_least("kl_clip", kl_clip, 0.0, strict=True)
    if isinstance(kl, bool) or not isinstance(kl, (int, float)):
        raise ValueError(f"kl must be a number; got {kl!r}")

    tau_grad = weight_entropy - target_entropy
    beta_grad = min(max(kl - kl_target, -kl_clip), kl_clip) if math.isfinite(kl) else kl_clip
    new_tau = min(max(tau - lr_tau * tau_grad, tau_min), tau_max)
    new_beta = max(0.0, beta + lr_beta * beta_grad)
    return MetaUpdate(tau=new_tau, beta=new_beta, tau_grad=tau_grad, beta_grad=beta_grad)


def entropy_gate_multiplier(
    kl: float, *, kappa: float, gain: float, m_lo: float, m_hi: float,
    disable_outside_trust_zone: bool = False,
) -> float:
    """KL gate on the entropy coefficient: ``alpha_eff = alpha * multiplier`` (section 4.2).

    With threshold ``kappa`` and gain ``g``:

    - ``KL <= kappa`` (inside the trust zone): ``1 + g * (kappa - KL) / kappa``;
    - ``KL > kappa``: ``1 / (1 + g * (KL - kappa) / kappa)``, or exactly ``0.0`` when
      ``disable_outside_trust_zone``;

    then clipped to ``[m_lo, m_hi]``, except the disabled ``0.0``, returned as is. A
    non-finite KL counts as above: the ``KL -> inf`` limit, 0 when ``g > 0`` and 1 when
    ``g = 0``, before the clip.

    Raises ``ValueError`` unless ``kappa > 0``, ``gain >= 0`` and ``0 <= m_lo <= m_hi``
    (all finite).
    """
    kappa = _at_least("kappa", kappa, 0.0, strict=True)
    gain = _at_least("gain", gain, 0.0)
    m_lo = _at_least("m_lo", m_lo, 0.0)
    m_hi = _finite("m_hi", m_hi)
    if m_hi < m_lo:
        raise ValueError(f"m_hi must be >= m_lo ({m_lo!r}); got {m_hi!r}")
    if isinstance(kl, bool) or not isinstance(kl, (int, float)):
        raise ValueError(f"kl must be a number; got {kl!r}")

    if math.isfinite(kl) and kl <= kappa:
        multiplier = 1.0 + gain * (kappa - kl) / kappa
    elif disable_outside_trust_zone:
        return 0.0
    elif math.isfinite(kl):
        multiplier = 1.0 / (1.0 + gain * (kl - kappa) / kappa)
    else:
        multiplier = 0.0 if gain > 0 else 1.0
    return min(max(multiplier, m_lo), m_hi)

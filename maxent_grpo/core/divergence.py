"""Per-token KL estimators, importance ratios and clip statistics (docs/ALGORITHM.md §2).

Per-token tensors are ``(N, T)`` (``N = B*G`` prompt-major rows): ``logps`` the current
policy's log-probabilities of the sampled tokens, ``old_logps`` the behaviour policy's,
``ref_logps`` the frozen reference's.
"""

from __future__ import annotations

import math

import torch

__all__ = ["CORRECTIONS", "RATIO_LEVELS", "clip_fractions", "importance_ratio",
           "importance_ratio_at", "kl_penalty", "sampler_correction_weights"]

KL_ESTIMATORS = ("k1", "k2", "k3")


def _check_tensor(value: object, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor; got {type(value).__name__}")
    if not value.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor; got dtype {value.dtype}")
    return value


def _check_same_shape(a: torch.Tensor, a_name: str, b: torch.Tensor, b_name: str) -> None:
    if a.shape != b.shape:
        raise ValueError(
            f"{b_name} must have the same shape as {a_name} {tuple(a.shape)}; got {tuple(b.shape)}"
        )


def _check_clip_range(eps_low: float, eps_high: float | None) -> float:
    """The effective ``eps_high``, after checking ``0 <= eps_low < 1`` and ``eps_high >= 0``."""
    if isinstance(eps_low, bool) or not isinstance(eps_low, (int, float)):
        raise ValueError(f"eps_low must be a number in [0, 1); got {eps_low!r}")
    if not 0.0 <= eps_low < 1.0:
        raise ValueError(f"eps_low must be in [0, 1); got {eps_low!r}")
    if eps_high is None:
        return float(eps_low)
    if isinstance(eps_high, bool) or not isinstance(eps_high, (int, float)):
        raise ValueError(f"eps_high must be a finite number >= 0 or None; got {eps_high!r}")
    if not (math.isfinite(eps_high) and eps_high >= 0.0):
        raise ValueError(f"eps_high must be a finite number >= 0 or None; got {eps_high!r}")
    return float(eps_high)


def _broadcast_advantages(advantages: object, like: torch.Tensor) -> torch.Tensor:
    """Advantages ``(N,)`` (one per row) or ``(N, T)`` (per token) as an ``(N, T)`` view."""
    advantages = _check_tensor(advantages, "advantages")
    if like.dim() != 2:
        raise ValueError(
            f"ratio must have shape (N, T) (2 dimensions); got shape {tuple(like.shape)}"
        )
    if advantages.shape == like.shape[:1]:
        return advantages.unsqueeze(-1).expand_as(like)
    if advantages.shape == like.shape:
        return advantages
    raise ValueError(
        f"advantages must have shape (N,) = {tuple(like.shape[:1])} or (N, T) = "
        f"{tuple(like.shape)}; got {tuple(advantages.shape)}"
    )


def kl_penalty(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of ``KL(pi_theta || pi_ref)`` from sampled-token log-probabilities.

    With ``d = ref_logps - logps`` (tokens sampled from ``pi_theta``):

    - ``k1 = -d``                 (unbiased, can be negative),
    - ``k2 = d**2 / 2``           (>= 0, biased),
    - ``k3 = exp(d) - d - 1``     (>= 0, unbiased; the default).

    ``k3`` is computed as ``expm1(d) - d``. Nothing is clamped: ``d`` above ~88 overflows
    float32 to ``inf``, a real divergence. ``logps`` and ``ref_logps`` are floating tensors
    of one shape (any); the result has that shape and is differentiable in both.
    """
    logps = _check_tensor(logps, "logps")
    ref_logps = _check_tensor(ref_logps, "ref_logps")
    _check_same_shape(logps, "logps", ref_logps, "ref_logps")
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of 'k1', 'k2', 'k3'; got {estimator!r}")
    d = ref_logps - logps
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    return torch.expm1(d) - d


def importance_ratio(
    logps: torch.Tensor, old_logps: torch.Tensor, max_log_ratio: float = 20.0
) -> torch.Tensor:
    """Importance ratio ``c = exp(clamp(logps - old_logps, -max_log_ratio, max_log_ratio))``.

    The bound (finite, ``> 0``) only guards ``exp`` against overflow; where it is active the
    gradient is zero. ``old_logps`` (same shape as ``logps``, any) is detached: with
    ``old_logps = logps.detach()`` the ratio is exactly 1 and its gradient that of ``logps``.
    """
    logps = _check_tensor(logps, "logps")
    old_logps = _check_tensor(old_logps, "old_logps")
    _check_same_shape(logps, "logps", old_logps, "old_logps")
    if (
        isinstance(max_log_ratio, bool)
        or not isinstance(max_log_ratio, (int, float))
        or not math.isfinite(max_log_ratio)
        or max_log_ratio <= 0
    ):
        raise ValueError(f"max_log_ratio must be a finite number > 0; got {max_log_ratio!r}")
    log_ratio = (logps - old_logps.detach()).clamp(-max_log_ratio, max_log_ratio)
    return torch.exp(log_ratio)


#: the levels of :func:`importance_ratio_at`
RATIO_LEVELS = ("token", "sequence", "sequence_token")


def importance_ratio_at(
    logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor, level: str = "token",
    max_log_ratio: float = 20.0,
) -> torch.Tensor:
    """The importance ratio ``(N, T)`` at one of :data:`RATIO_LEVELS` (docs/ALGORITHM.md §2).

    With ``d[i,t] = logps - old_logps`` (old detached), ``T_i = sum_t m[i,t]`` and
    ``s_i = exp(sum_t m d / max(T_i, 1))``, the length-normalised sequence ratio of GSPO:

    - ``token``: ``c[i,t] = exp(d[i,t])`` (PPO, GRPO; :func:`importance_ratio`);
    - ``sequence``: ``c[i,t] = s_i`` for every token (GSPO; TRL's
      ``importance_sampling_level="sequence"``), gradient ``s_i / T_i * sum_t m grad l``;
    - ``sequence_token``: ``c[i,t] = sg(s_i) * exp(l[i,t] - sg(l[i,t]))``: the value of
      ``s_i``, the gradient of one token, ``s_i * grad l[i,t]`` (GSPO-token).

    Every exponent is clamped to ``[-max_log_ratio, max_log_ratio]`` as in
    :func:`importance_ratio`. ``mask`` ``(N, T)`` bool; values outside it are not used.
    """
    if level not in RATIO_LEVELS:
        raise ValueError(f"level must be one of {RATIO_LEVELS}; got {level!r}")
    if level == "token":
        return importance_ratio(logps, old_logps, max_log_ratio)
    logps = _check_tensor(logps, "logps")
    old_logps = _check_tensor(old_logps, "old_logps")
    _check_same_shape(logps, "logps", old_logps, "old_logps")
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise ValueError("mask must be a bool tensor")
    _check_same_shape(logps, "logps", mask, "mask")
    m = mask.to(logps.dtype)
    d = torch.where(mask, logps - old_logps.detach(), torch.zeros((), dtype=logps.dtype))
    seq = (d.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)).clamp(
        -max_log_ratio, max_log_ratio)  # (N, 1)
    if level == "sequence":
        return torch.exp(seq).expand_as(logps)
    return torch.exp(seq.detach() + logps - logps.detach())


@torch.no_grad()
def clip_fractions(
    ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, eps_low: float = 0.2,
    eps_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fractions of completion tokens whose clipped surrogate is active (for logging).

    Over the tokens with ``mask`` true:

    - low:  ``ratio < 1 - eps_low``  and ``A < 0``;
    - high: ``ratio > 1 + eps_high`` and ``A > 0``;
    - total: low + high (the two sets are disjoint).

    Each is ``count / max(mask.sum(), 1)``. ``ratio`` and the bool ``mask`` are ``(N, T)``,
    ``advantages`` ``(N,)`` or ``(N, T)``, the clip widths as in
    :func:`~maxent_grpo.core.losses.clipped_surrogate`. Returns ``(low, high, total)``,
    detached 0-d float32 tensors on ``ratio``'s device.
    """
    ratio = _check_tensor(ratio, "ratio")
    adv = _broadcast_advantages(advantages, ratio)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"mask must be a bool tensor; got {got}")
    _check_same_shape(ratio, "ratio", mask, "mask")
    high_eps = _check_clip_range(eps_low, eps_high)
    low = (ratio < 1.0 - eps_low) & (adv < 0) & mask
    high = (ratio > 1.0 + high_eps) & (adv > 0) & mask
    denom = mask.sum().clamp(min=1).to(torch.float32)
    low_frac = low.sum().to(torch.float32) / denom
    high_frac = high.sum().to(torch.float32) / denom
    return low_frac, high_frac, low_frac + high_frac


#: the sampler-correction modes of :func:`sampler_correction_weights`
CORRECTIONS = ("token_tis", "token_mis", "sequence_tis", "sequence_mis")


def sampler_correction_weights(
    logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor, mode: str,
    cap: float,
) -> torch.Tensor:
    """Detached importance weights ``w`` ``(N, T)`` that correct for sampling from an engine
    whose distribution ``pi_s`` differs from the trainer's ``pi`` (docs/ALGORITHM.md §2).

    With ``d[i,t] = logps - sampler_logps`` (both ``(N, T)``, the trainer's behaviour
    log-probs and the sampler's own) and the ratio ``rho = exp(d)``:

    - ``token_tis``: ``w = min(rho, cap)`` per token (truncated IS);
    - ``token_mis``: ``w = rho`` where ``rho <= cap``, else 0 (masked IS);
    - ``sequence_tis``: ``w_i = min(exp(sum_t m d), cap)`` for every token of row ``i``;
    - ``sequence_mis``: ``w_i = exp(sum_t m d)`` where that is ``<= cap``, else 0.

    ``mask`` ``(N, T)`` bool; weights outside it are 0. ``cap > 0``. The exponent is clamped
    to ``[-20, 20]`` against overflow, as in :func:`importance_ratio`.
    """
    logps, sampler_logps = _check_tensor(logps, "logps"), _check_tensor(sampler_logps,
                                                                         "sampler_logps")
    _check_same_shape(logps, "logps", sampler_logps, "sampler_logps")
    if mode not in CORRECTIONS:
        raise ValueError(f"mode must be one of {CORRECTIONS}; got {mode!r}")
    if not cap > 0:
        raise ValueError(f"cap must be > 0; got {cap!r}")
    m = mask.to(logps.dtype)
    d = (logps.detach() - sampler_logps.detach()) * m
    if mode.startswith("sequence"):
        d = d.sum(-1, keepdim=True).expand_as(m)
    rho = torch.exp(d.clamp(-20.0, 20.0))
    w = rho.clamp(max=cap) if mode.endswith("tis") else torch.where(rho <= cap, rho, 0.0)
    return w * m

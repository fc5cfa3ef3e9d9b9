"""Per-token policy losses and their parts (docs/ALGORITHM.md §2-3): KL estimators,
importance ratios, clip statistics, sampler corrections, the clipped surrogate and its
peers' variants, and the token-loss reductions. The listwise losses are in
:mod:`maxent_grpo.core.listwise`.

Per-token tensors are ``(N, T)`` (``N = B*G`` prompt-major rows): ``logps`` the current
policy's log-probabilities of the sampled tokens, ``old_logps`` the behaviour policy's,
``ref_logps`` the frozen reference's; masks are bool.
"""

from __future__ import annotations

import math

import torch

__all__ = ["CORRECTIONS", "RATIO_LEVELS", "cispo_surrogate", "clip_cov_surrogate",
           "clip_fractions", "clipped_surrogate", "importance_ratio", "importance_ratio_at",
           "kl_cov_surrogate", "kl_penalty", "reduce_token_loss", "sampler_correction_weights",
           "token_covariance", "top_entropy_mask"]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
KL_ESTIMATORS = ("k1", "k2", "k3")


def _check_tensor(value: object, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor; got {type(value).__name__}")
    if not value.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor; got dtype {value.dtype}")
    return value


def _check_same_shape(a: torch.Tensor, a_name: str, b: torch.Tensor, b_name: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{b_name} must have the same shape as {a_name} {tuple(a.shape)}; got "
                         f"{tuple(b.shape)}")


def _check_pair(a: object, a_name: str, b: object, b_name: str
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two floating tensors of one shape."""
    a, b = _check_tensor(a, a_name), _check_tensor(b, b_name)
    _check_same_shape(a, a_name, b, b_name)
    return a, b


def _check_positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int; got {value!r}")
    return value


def _check_mask(mask: object, like: torch.Tensor, like_name: str) -> None:
    """A bool tensor of ``like``'s shape."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"mask must be a bool tensor; got {got}")
    _check_same_shape(like, like_name, mask, "mask")


def _check_clip_range(eps_low: float, eps_high: float | None) -> float:
    """The effective ``eps_high``, after checking ``0 <= eps_low < 1`` and ``eps_high >= 0``."""
    if isinstance(eps_low, bool) or not isinstance(eps_low, (int, float)):
        raise ValueError(f"eps_low must be a number in [0, 1); got {eps_low!r}")
    if not 0.0 <= eps_low < 1.0:
        raise ValueError(f"eps_low must be in [0, 1); got {eps_low!r}")
    if eps_high is None:
        return float(eps_low)
    if (isinstance(eps_high, bool) or not isinstance(eps_high, (int, float))
            or not (math.isfinite(eps_high) and eps_high >= 0.0)):
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


def kl_penalty(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: str = "k3",
               mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token estimate of ``KL(pi_theta || pi_ref)`` from sampled-token log-probabilities.

    With ``d = ref_logps - logps`` (tokens sampled from ``pi_theta``):

    - ``k1 = -d``                 (unbiased, can be negative),
    - ``k2 = d**2 / 2``           (>= 0, biased),
    - ``k3 = exp(d) - d - 1``     (>= 0, unbiased; the default).

    ``k3`` is computed as ``expm1(d) - d``. Nothing is clamped: ``d`` above ~88 overflows
    float32 to ``inf``, a real divergence. ``logps`` and ``ref_logps`` are floating tensors
    of one shape (any); the result has that shape and is differentiable in both. ``d`` is 0
    outside a bool ``mask``: an overflow in padding made the gradient NaN when masked after.
    """
    logps, ref_logps = _check_pair(logps, "logps", ref_logps, "ref_logps")
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of 'k1', 'k2', 'k3'; got {estimator!r}")
    d = ref_logps - logps
    if mask is not None:
        d = torch.where(mask, d, 0.0)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    return torch.expm1(d) - d


def importance_ratio(logps: torch.Tensor, old_logps: torch.Tensor,
                     max_log_ratio: float = 20.0) -> torch.Tensor:
    """Importance ratio ``c = exp(clamp(logps - old_logps, -max_log_ratio, max_log_ratio))``.

    The bound (finite, ``> 0``; in float16 at most about 10.1) only guards ``exp`` against
    overflow; where it is active the gradient is zero. ``old_logps`` (same shape as
    ``logps``, any) is detached: with ``old_logps = logps.detach()`` the ratio is exactly 1
    and its gradient that of ``logps``.
    """
    logps, old_logps = _check_pair(logps, "logps", old_logps, "old_logps")
    bound = _exp_bound(max_log_ratio, logps.dtype)
    return torch.exp((logps - old_logps.detach()).clamp(-bound, bound))


def _exp_bound(max_log_ratio: float, dtype: torch.dtype) -> float:
    """``max_log_ratio`` (checked), lowered where ``exp`` of it would overflow ``dtype``
    (float16: ``log(65504) - 1``, about 10.1; float32 and bfloat16 reach past 88)."""
    if isinstance(max_log_ratio, bool) or not isinstance(max_log_ratio, (int, float)) or not (
            math.isfinite(max_log_ratio) and max_log_ratio > 0):
        raise ValueError(f"max_log_ratio must be a finite number > 0; got {max_log_ratio!r}")
    return min(float(max_log_ratio), math.log(torch.finfo(dtype).max) - 1.0)


#: the levels of :func:`importance_ratio_at`
RATIO_LEVELS = ("token", "sequence", "sequence_token")


def importance_ratio_at(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor,
                        level: str = "token", max_log_ratio: float = 20.0) -> torch.Tensor:
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
    logps, old_logps = _check_pair(logps, "logps", old_logps, "old_logps")
    _check_mask(mask, logps, "logps")
    m = mask.to(logps.dtype)
    d = torch.where(mask, logps - old_logps.detach(), torch.zeros((), dtype=logps.dtype))
    bound = _exp_bound(max_log_ratio, logps.dtype)
    seq = (d.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)).clamp(
        -bound, bound)  # (N, 1)
    if level == "sequence":
        return torch.exp(seq).expand_as(logps)
    return torch.exp(seq.detach() + logps - logps.detach())


@torch.no_grad()
def clip_fractions(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                   eps_low: float = 0.2, eps_high: float | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fractions of completion tokens whose clipped surrogate is active (for logging).

    Over the tokens with ``mask`` true:

    - low:  ``ratio < 1 - eps_low``  and ``A < 0``;
    - high: ``ratio > 1 + eps_high`` and ``A > 0``;
    - total: low + high (the two sets are disjoint).

    Each is ``count / max(mask.sum(), 1)``. ``ratio`` and the bool ``mask`` are ``(N, T)``,
    ``advantages`` ``(N,)`` or ``(N, T)``, the clip widths as in :func:`clipped_surrogate`.
    Returns ``(low, high, total)``, detached 0-d float32 tensors on ``ratio``'s device.
    """
    ratio = _check_tensor(ratio, "ratio")
    adv = _broadcast_advantages(advantages, ratio)
    _check_mask(mask, ratio, "ratio")
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
    logps, sampler_logps = _check_pair(logps, "logps", sampler_logps, "sampler_logps")
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


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float = 0.2,
    eps_high: float | None = None,
) -> torch.Tensor:
    """PPO clipped surrogate per token, ``(N, T)``, differentiable in ``ratio`` (to be
    maximised; the loss is its negative).

    ``surr = min(c * A, clip(c, 1 - eps_low, 1 + eps_high) * A)``.

    Args:
        ratio: ``(N, T)`` importance ratios ``c``.
        advantages: ``(N,)`` one per row (broadcast over tokens) or ``(N, T)``; used as given
            (pass detached values).
        eps_low: lower clip width, ``0 <= eps_low < 1``.
        eps_high: upper clip width ``>= 0``; ``None`` means ``eps_low``.
    """
    ratio = _check_tensor(ratio, "ratio")
    adv = _broadcast_advantages(advantages, ratio)
    high = _check_clip_range(eps_low, eps_high)
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + high)
    return torch.minimum(ratio * adv, clipped * adv)


def cispo_surrogate(
    ratio: torch.Tensor, logps: torch.Tensor, advantages: torch.Tensor, eps_high: float,
) -> torch.Tensor:
    """CISPO's surrogate per token, ``(N, T)``, to be maximised (MiniMax-M1, 2025).

    ``surr = sg(min(c, 1 + eps_high)) * A * l``: the importance weight is clipped and its
    gradient stopped, so every token keeps the REINFORCE gradient ``w * A * grad l`` (the
    PPO clip zeroes the gradient of a clipped token instead). As in the paper's runs there
    is no lower bound on the weight. TRL's ``loss_type="cispo"`` is this with its
    ``epsilon_high`` equal to ``1 + eps_high``.

    Args:
        ratio: ``(N, T)`` importance ratios ``c`` (any level; used detached).
        logps: ``(N, T)`` the policy's token log-probs ``l``, with gradient.
        advantages: ``(N,)`` or ``(N, T)``, used as given.
        eps_high: the weight's cap is ``1 + eps_high``, ``eps_high >= 0``.
    """
    ratio, logps = _check_pair(ratio, "ratio", logps, "logps")
    adv = _broadcast_advantages(advantages, ratio)
    high = _check_clip_range(0.0, eps_high)
    return ratio.detach().clamp(max=1.0 + high) * adv * logps


def token_covariance(logps: torch.Tensor, advantages: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    """``cov[i,t] = (A - mean_m A) * (l - mean_m l)`` ``(N, T)``, detached, the means over the
    masked tokens of this tensor (Cui et al. 2025: the tokens whose log-prob moves with the
    advantage drive the entropy down). ``-inf`` outside the mask."""
    adv = _broadcast_advantages(advantages, logps).detach()
    lp = logps.detach()
    count = mask.sum().to(lp.dtype).clamp(min=1.0)  # selected: a -inf in padding stays out
    cov = ((adv - torch.where(mask, adv, 0.0).sum() / count)
           * (lp - torch.where(mask, lp, 0.0).sum() / count))
    return torch.where(mask, cov, torch.full_like(cov, -math.inf))


def top_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, rho: float) -> torch.Tensor:
    """``(N, T)`` bool: the masked tokens whose entropy is ``>=`` the ``1 - rho`` quantile
    (``torch.quantile``, linear interpolation) of the masked tokens' entropies, as TRL's
    ``top_entropy_quantile``; no token when the mask is empty. ``entropy`` is used detached."""
    values = entropy.detach()[mask].float()
    if values.numel() == 0:
        return torch.zeros_like(mask)
    threshold = torch.quantile(values, 1.0 - rho).to(entropy.dtype)
    return (entropy.detach() >= threshold) & mask


def _how_many(fraction: float, mask: torch.Tensor) -> int:
    return max(int(fraction * int(mask.sum())), 1)


def clip_cov_surrogate(
    ratio: torch.Tensor, logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    eps_low: float, eps_high: float, fraction: float, bounds: tuple[float, float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip-Cov (Cui et al. 2025, verl's ``clip_cov``): PPO's clipped surrogate with a few
    high-covariance tokens taken out of the gradient. Returns ``(surr, chosen)``, both
    ``(N, T)``.

    Among the masked tokens that PPO's clip does not already hold and whose
    :func:`token_covariance` lies strictly between ``bounds = (lo, hi)``,
    ``max(1, int(fraction * tokens))`` are drawn uniformly at random (the global generator)
    and their surrogate is multiplied by 0; they stay in every token count.
    """
    surr = clipped_surrogate(ratio, advantages, eps_low, eps_high)
    adv = _broadcast_advantages(advantages, ratio)
    unclipped = ratio * adv
    held = (surr.detach() < unclipped.detach()) & mask  # PPO's clip is active
    cov = token_covariance(logps, advantages, mask)
    eligible = (cov > bounds[0]) & (cov < bounds[1]) & mask & ~held
    where = eligible.nonzero()
    chosen = torch.zeros_like(mask)
    if len(where):
        pick = where[torch.randperm(len(where))[: _how_many(fraction, mask)]]
        chosen[pick[:, 0], pick[:, 1]] = True
    return torch.where(chosen, torch.zeros_like(surr), surr), chosen


def kl_cov_surrogate(
    ratio: torch.Tensor, logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
    mask: torch.Tensor, fraction: float, coef: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL-Cov (Cui et al. 2025, verl's ``kl_cov``): the unclipped surrogate ``c * A``, with
    ``coef * |l - l_old|`` subtracted on the ``max(1, int(fraction * tokens))`` masked tokens
    of largest :func:`token_covariance`. Returns ``(surr, chosen)``, both ``(N, T)``."""
    adv = _broadcast_advantages(advantages, ratio)
    surr = ratio * adv
    cov = token_covariance(logps, advantages, mask).reshape(-1)
    top = torch.topk(cov, min(_how_many(fraction, mask), int(mask.sum()) or 1)).indices
    chosen = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
    chosen[top] = True
    chosen = chosen.view_as(mask) & mask
    penalty = coef * (logps - old_logps.detach()).abs()
    return torch.where(chosen, surr - penalty, surr), chosen


def reduce_token_loss(
    per_token_loss: torch.Tensor, mask: torch.Tensor, loss_type: str, *,
    max_completion_length: int | None = None, num_global_tokens: int | torch.Tensor | None = None,
    num_rows: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``L`` of one micro-batch to a scalar (docs/ALGORITHM.md §3).

    With ``m`` the mask, ``T_i = sum_t m[i, t]`` and ``N = num_rows``:

    - ``"grpo"``:    ``(1/N) sum_i (sum_t m L) / max(T_i, 1)``  (mean of per-row token means);
    - ``"bnpo"``:    ``sum m L / max(sum m, 1)`` over this tensor (token mean per micro-batch);
    - ``"dr_grpo"``: ``sum m L / (N * max_completion_length)``;
    - ``"dapo"``:    ``sum m L / num_global_tokens``.

    With ``N`` the rows of the whole optimizer-step batch on this rank, ``grpo``, ``dr_grpo``
    and ``dapo`` are additive over micro-batches (``bnpo``, a mean of micro-batch means,
    ignores ``num_rows``). DDP averages gradients over ranks, so for the global token mean
    the caller multiplies the ``dapo`` loss by the world size. Masked-out positions are
    selected away (``where``), so a non-finite value there cannot make the sum NaN. Unused
    keyword arguments are still validated.

    Args:
        per_token_loss: ``(N_mb, T)`` floating.
        mask: ``(N_mb, T)`` bool completion mask (0/1 numbers are rejected, not converted).
        loss_type: one of ``"grpo"``, ``"bnpo"``, ``"dr_grpo"``, ``"dapo"``.
        max_completion_length: ``T_max >= T``; required for ``"dr_grpo"``.
        num_global_tokens: completion tokens of the optimizer-step batch over all ranks, a
            positive int or 0-d tensor (checked: one device sync); required for ``"dapo"``.
        num_rows: rows ``N >= N_mb`` in the optimizer-step batch (default: ``N_mb``).

    Returns a 0-d tensor of ``per_token_loss``'s dtype.
    """
    loss = _check_tensor(per_token_loss, "per_token_loss")
    if loss.dim() != 2:
        raise ValueError(
            f"per_token_loss must have shape (N, T) (2 dimensions); got shape {tuple(loss.shape)}"
        )
    _check_mask(mask, loss, "per_token_loss")
    if loss_type not in LOSS_TYPES:
        raise ValueError(
            f"loss_type must be one of 'grpo', 'bnpo', 'dr_grpo', 'dapo'; got {loss_type!r}"
        )
    n_mb, n_tok = loss.shape
    if num_rows is None:
        n_rows = max(n_mb, 1)
    else:
        n_rows = _check_positive_int(num_rows, "num_rows")
        if n_rows < n_mb:
            raise ValueError(
                f"num_rows must be >= the {n_mb} rows of per_token_loss; got {num_rows}"
            )
    if max_completion_length is not None:
        _check_positive_int(max_completion_length, "max_completion_length")
        if max_completion_length < n_tok:
            raise ValueError(
                f"max_completion_length must be >= the {n_tok} tokens of per_token_loss; "
                f"got {max_completion_length}"
            )
    if num_global_tokens is not None:
        if isinstance(num_global_tokens, torch.Tensor):
            if num_global_tokens.dim() != 0 or num_global_tokens.dtype == torch.bool:
                raise ValueError(
                    "num_global_tokens must be a positive int or a 0-d numeric tensor; got a "
                    f"tensor of shape {tuple(num_global_tokens.shape)}, "
                    f"dtype {num_global_tokens.dtype}"
                )
            if not float(num_global_tokens) > 0:
                raise ValueError(f"num_global_tokens must be > 0; got {float(num_global_tokens)}")
        else:
            _check_positive_int(num_global_tokens, "num_global_tokens")

    masked = torch.where(mask, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))
    if loss_type == "grpo":
        row_tokens = mask.sum(dim=-1).clamp(min=1).to(loss.dtype)
        return (masked.sum(dim=-1) / row_tokens).sum() / n_rows
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1).to(loss.dtype)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("max_completion_length is required for loss_type 'dr_grpo'")
        return masked.sum() / (n_rows * max_completion_length)
    # dapo
    if num_global_tokens is None:
        raise ValueError("num_global_tokens is required for loss_type 'dapo'")
    if isinstance(num_global_tokens, torch.Tensor):
        return masked.sum() / num_global_tokens.to(device=loss.device, dtype=loss.dtype)
    return masked.sum() / num_global_tokens

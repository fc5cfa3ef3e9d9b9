"""The surrogate shared by GRPO, EntropyMaxEnt and GroupMaxEnt (docs/ALGORITHM.md §2-3, §4.5).

A component, not a base class: an objective that optimises the surrogate keeps its clip
ranges (``epsilon`` / ``epsilon_high``, checked by :func:`clip_range`) and two parts,
checked by :func:`surrogate_parts`: the ratio's level (``ratio_level``: token, GSPO's
sequence, GSPO-token) and the clipping rule (``clip_rule``: PPO's clip or CISPO's clipped,
stop-gradient weight). It takes the per-token loss from :func:`clipped_token_loss` and
reduces it with :func:`reduce_tokens` (``dr_grpo`` for GroupMaxEnt), so it inherits no
option it does not use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from maxent_grpo.core import (
    cispo_surrogate,
    clip_cov_surrogate,
    clip_fractions,
    clipped_surrogate,
    importance_ratio_at,
    kl_cov_surrogate,
    reduce_token_loss,
)
from maxent_grpo.objectives.base import MicroBatch
from maxent_grpo.validation import check_choice, check_number, is_number, require

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
RatioLevel = Literal["token", "sequence", "sequence_token"]
ClipRule = Literal["ppo", "cispo", "clip_cov", "kl_cov"]


@dataclass(frozen=True)
class CovSettings:
    """The options of the ``clip_cov`` and ``kl_cov`` rules (Cui et al. 2025): the fraction
    of a micro-batch's tokens chosen and Clip-Cov's covariance bounds (verl's defaults),
    KL-Cov's coefficient (the paper's recipes' 1; verl's config has 0.1)."""

    fraction: float = 2e-4
    bounds: tuple[float, float] = (1.0, 5.0)
    coef: float = 1.0

    @classmethod
    def checked(cls, fraction: float, bounds: tuple[float, float] | list[float],
                coef: float) -> CovSettings:
        check_number("objective.cov_fraction", fraction, minimum=0, maximum=1, strict=True)
        require(len(bounds) == 2 and all(is_number(b) for b in bounds) and bounds[0] < bounds[1],
                f"objective.clip_cov_bounds must be [low, high] with low < high; got {bounds!r}")
        check_number("objective.kl_cov_coef", coef, minimum=0)
        return cls(float(fraction), (float(bounds[0]), float(bounds[1])), float(coef))


def clip_range(epsilon: float, epsilon_high: float | None) -> tuple[float, float]:
    """Check ``objective.epsilon`` in [0, 1) and ``objective.epsilon_high`` >= 0 (or null);
    return ``(eps_low, eps_high)`` with ``None`` meaning ``epsilon``."""
    require(is_number(epsilon) and 0 <= epsilon < 1,
            f"objective.epsilon must be in [0, 1); got {epsilon!r}")
    check_number("objective.epsilon_high", epsilon_high, minimum=0, allow_none=True)
    return float(epsilon), float(epsilon if epsilon_high is None else epsilon_high)


def surrogate_parts(ratio_level: str, clip_rule: str) -> tuple[str, str]:
    """Check ``objective.ratio_level`` and ``objective.clip_rule``; return them."""
    check_choice("objective.ratio_level", ratio_level, get_args(RatioLevel))
    check_choice("objective.clip_rule", clip_rule, get_args(ClipRule))
    return ratio_level, clip_rule


def clipped_token_loss(
    mb: MicroBatch, advantages: Tensor, epsilon: float, epsilon_high: float,
    ratio_level: str = "token", clip_rule: str = "ppo", cov: CovSettings | None = None,
) -> tuple[Tensor, dict[str, tuple[Tensor, Tensor]]]:
    """Per-token loss ``(n, T)`` of one micro-batch, and the clip fractions ``clip/low``,
    ``clip/high``, ``clip/total`` as token-weighted ``(sum, count)`` pairs.

    ``c`` is the ratio to the behaviour policy at ``ratio_level``
    (:func:`~maxent_grpo.core.importance_ratio_at`; 1 when ``mb.old_token_logps`` is None).
    ``clip_rule="ppo"``: ``-min(c*A, clip(c, 1-eps_low, 1+eps_high)*A)``;
    ``"cispo"``: ``-sg(min(c, 1+eps_high)) * A * l`` (:func:`~maxent_grpo.core.cispo_surrogate`;
    ``clip/high`` counts the capped tokens); ``"clip_cov"`` / ``"kl_cov"``: Clip-Cov and
    KL-Cov with ``cov`` (:func:`~maxent_grpo.core.clip_cov_surrogate`,
    :func:`~maxent_grpo.core.kl_cov_surrogate`; ``clip/cov`` counts the chosen tokens; the
    statistics are over the micro-batch, as in verl). With ``mb.correction`` each token's
    loss is multiplied by its importance weight ``w``."""
    old = mb.old_token_logps if mb.old_token_logps is not None else mb.token_logps.detach()
    ratio = importance_ratio_at(mb.token_logps, old, mb.mask, ratio_level)  # (n, T)
    n_tok = mb.mask.sum().float()
    chosen = None
    if clip_rule == "cispo":
        surr = cispo_surrogate(ratio, mb.token_logps, advantages, epsilon_high)
        capped = (ratio.detach() > 1.0 + epsilon_high) & mb.mask
        high = capped.sum().float() / n_tok.clamp(min=1)
        low, total = torch.zeros_like(high), high
    elif clip_rule == "kl_cov":
        cov = cov or CovSettings()
        surr, chosen = kl_cov_surrogate(ratio, mb.token_logps, old, advantages, mb.mask,
                                        cov.fraction, cov.coef)
        low = high = total = torch.zeros((), device=n_tok.device)
    else:
        if clip_rule == "clip_cov":
            cov = cov or CovSettings()
            surr, chosen = clip_cov_surrogate(ratio, mb.token_logps, advantages, mb.mask,
                                              epsilon, epsilon_high, cov.fraction, cov.bounds)
        else:
            surr = clipped_surrogate(ratio, advantages, epsilon, epsilon_high)
        low, high, total = clip_fractions(ratio.detach(), advantages, mb.mask, epsilon,
                                          epsilon_high)
    sums = {
        "clip/low": (low * n_tok, n_tok),
        "clip/high": (high * n_tok, n_tok),
        "clip/total": (total * n_tok, n_tok),
    }
    if chosen is not None:
        sums["clip/cov"] = (chosen.sum().float(), n_tok)
    if mb.correction is not None:  # the sampler correction (docs/ALGORITHM.md §2)
        return -surr * mb.correction, sums
    return -surr, sums


def reduce_tokens(per_token: Tensor, mb: MicroBatch, loss_type: LossType) -> Tensor:
    """:func:`maxent_grpo.core.reduce_token_loss` of one micro-batch with the step's
    normalisers, so that the micro-batches of a step sum to the batch's value (``bnpo``,
    a token mean per micro-batch, is divided by their number: a mean of their means)."""
    loss = reduce_token_loss(
        per_token,
        mb.mask,
        loss_type,
        max_completion_length=mb.max_completion_length,
        num_global_tokens=mb.num_global_tokens if loss_type == "dapo" else None,
        num_rows=mb.num_rows,
    )
    if loss_type == "bnpo":
        loss = loss / mb.num_micro_batches
    return loss

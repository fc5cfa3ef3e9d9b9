"""Policy losses: clipped surrogate, token-loss reductions, listwise losses (ALGORITHM.md §2-4).

Per-token tensors are ``(N, T)`` (``N = B*G`` prompt-major rows), masks bool; sequence-level
tensors ``(B, G)``, one row per prompt group.
"""

from __future__ import annotations

import math

import torch

from maxent_grpo.core.divergence import (
    _broadcast_advantages,
    _check_clip_range,
    _check_same_shape,
    _check_tensor,
    importance_ratio,
)

__all__ = ["cispo_surrogate", "clip_cov_surrogate", "clipped_surrogate", "kl_cov_surrogate",
           "listwise_loss", "reduce_token_loss", "sequence_clip_loss", "token_covariance",
           "top_entropy_mask"]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
WEIGHT_SUM_TOL = 1e-4


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
    ratio = _check_tensor(ratio, "ratio")
    _check_same_shape(ratio, "ratio", _check_tensor(logps, "logps"), "logps")
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
    m = mask.to(lp.dtype)
    count = m.sum().clamp(min=1.0)
    cov = (adv - (adv * m).sum() / count) * (lp - (lp * m).sum() / count)
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


def _check_positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int; got {value!r}")
    return value


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
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"mask must be a bool tensor; got {got}")
    _check_same_shape(loss, "per_token_loss", mask, "mask")
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


def _check_group_weights(
    seq_logps: object, weights: object, seq_name: str = "seq_logps"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``(B, G)`` scores and weights on the simplex; return them (weights detached)."""
    scores = _check_tensor(seq_logps, seq_name)
    if scores.dim() != 2 or scores.shape[0] == 0 or scores.shape[1] == 0:
        raise ValueError(
            f"{seq_name} must have shape (B, G) with B, G >= 1; got shape {tuple(scores.shape)}"
        )
    w = _check_tensor(weights, "weights")
    _check_same_shape(scores, seq_name, w, "weights")
    w = w.detach()
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError("weights must be finite and non-negative")
    row_sums = w.sum(dim=-1)
    worst = float((row_sums - 1.0).abs().max())
    if worst > WEIGHT_SUM_TOL:
        raise ValueError(
            f"weights must sum to 1 over each group (within {WEIGHT_SUM_TOL}); "
            f"largest deviation {worst:.3g}"
        )
    return scores, w.to(scores.dtype)


def listwise_loss(
    seq_logps: torch.Tensor, weights: torch.Tensor, candidates: torch.Tensor | None = None
) -> torch.Tensor:
    """Listwise cross-entropy between target weights and the policy over each group's candidates.

    ``loss = mean_b ( -sum_i w[b, i] * log_softmax_G(s)[b, i] )``, ``s = seq_logps``, a 0-d
    tensor with gradient ``(p - w) / B`` on ``s``, ``p = softmax_G(s)``. For the
    length-normalised variant pass ``s_i / T_i``.

    Args:
        seq_logps: ``(B, G)`` sequence log-probabilities ``s_i = sum_t m l``.
        weights: ``(B, G)`` target weights, non-negative, each row summing to 1 (within 1e-4);
            treated as constants (detached).
        candidates: ``(B, G)`` bool or None: the softmax runs over each group's candidates
            only (e.g. its distinct completions, :func:`~maxent_grpo.core.distinct_candidates`);
            weights outside them must be 0.
    """
    scores, w = _check_group_weights(seq_logps, weights)
    if candidates is None:
        return -(w * torch.log_softmax(scores, dim=-1)).sum(dim=-1).mean()
    _check_same_shape(scores, "seq_logps", candidates, "candidates")
    logp = torch.log_softmax(scores.masked_fill(~candidates, float("-inf")), dim=-1)
    return -torch.where(candidates, w * logp, torch.zeros_like(logp)).sum(dim=-1).mean()


def answer_listwise_loss(
    seq_logps: torch.Tensor, weights: torch.Tensor, answers: torch.Tensor,
    candidates: torch.Tensor | None = None,
) -> torch.Tensor:
    """Listwise cross-entropy over each group's distinct *answers* (docs/ALGORITHM.md §4.3,
    answer level): ``loss = mean_b ( -sum_C w_C * log P(C) )`` with
    ``P(C) = sum_{i in C} e^{s_i} / sum_j e^{s_j}`` over the candidate rows, the policy
    restricted to the sampled completions and summed over the completions of one answer.

    ``weights`` ``(B, G)`` holds ``w_C`` on the first row of each class (0 elsewhere,
    :func:`~maxent_grpo.core.answer_maxent_weights`); ``answers`` the classes
    (:func:`~maxent_grpo.core.answer_classes`). The gradient on ``s_i`` of row ``i`` in
    class ``C`` is ``p_i (1 - w_C / P(C)) / B``: the class's mass moves towards ``w_C`` and
    is shared among its completions in proportion to the policy. With one candidate row
    per class it is :func:`listwise_loss` over the candidates.
    """
    from maxent_grpo.core.advantages import check_answer_classes
    from maxent_grpo.core.listwise import class_logsumexp

    scores, w = _check_group_weights(seq_logps, weights)
    check_answer_classes(answers, candidates)
    _check_same_shape(scores, "seq_logps", answers, "answers")
    first = answers == torch.arange(answers.shape[1], device=answers.device)
    if bool((w[~first] != 0).any()):
        raise ValueError("answer-level weights must be 0 outside the first row of each class")
    masked = scores if candidates is None else scores.masked_fill(~candidates, float("-inf"))
    log_class = class_logsumexp(scores, answers, candidates) - torch.logsumexp(
        masked, dim=-1, keepdim=True)  # (B, G): log P(class of row i)
    return -torch.where(first, w * log_class, torch.zeros_like(log_class)).sum(dim=-1).mean()


def sequence_clip_loss(
    seq_logps: torch.Tensor, old_seq_logps: torch.Tensor, weights: torch.Tensor,
    eps_low: float = 0.2, eps_high: float | None = None, max_log_ratio: float = 20.0,
) -> torch.Tensor:
    """Optional sequence-level clipped term of listwise MaxEnt-GRPO (docs/ALGORITHM.md §4.3 step 4).

    ``a_hat = w - 1/G``, ``ratio = exp(clamp(s - s_old, -max_log_ratio, max_log_ratio))``,
    ``term = -mean_b sum_i min(ratio * a_hat, clip(ratio, 1 - eps_low, 1 + eps_high) * a_hat)``,
    a 0-d tensor. At ``s_old = s`` the value is 0 and the gradient on ``s`` is ``-a_hat / B``.

    Args:
        seq_logps: ``(B, G)`` current sequence log-probabilities.
        old_seq_logps: ``(B, G)`` behaviour-policy sequence log-probabilities (detached).
        weights: ``(B, G)`` target weights on the simplex (detached).
        eps_low, eps_high: clip widths as in :func:`clipped_surrogate`.
        max_log_ratio: overflow bound as in :func:`~maxent_grpo.core.divergence.importance_ratio`.
    """
    scores, w = _check_group_weights(seq_logps, weights)
    old = _check_tensor(old_seq_logps, "old_seq_logps")
    _check_same_shape(scores, "seq_logps", old, "old_seq_logps")
    a_hat = w - 1.0 / scores.shape[1]
    ratio = importance_ratio(scores, old, max_log_ratio)
    return -clipped_surrogate(ratio, a_hat, eps_low, eps_high).sum(dim=-1).mean()

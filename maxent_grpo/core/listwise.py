"""Listwise MaxEnt over a prompt group (docs/ALGORITHM.md §4.3 and §4.4): the target
weights and the listwise losses that move the policy towards them.

All tensors are ``(B, G)``: ``B`` prompts, ``G`` candidates per prompt; every softmax runs
over ``G``. The weights are targets, computed without autograd and detached.

``ref_seq_logps`` is ``rho_i = sum_t m * logp_ref / max(T_i, 1)``, the length-normalised
reference log-likelihood of each candidate; the caller computes it.
"""

from __future__ import annotations

import torch

from maxent_grpo.core.advantages import check_answer_classes, check_rewards, group_advantages
from maxent_grpo.core.logprobs import _check_scalar
from maxent_grpo.core.losses import (
    _check_pair,
    _check_same_shape,
    clipped_surrogate,
    importance_ratio,
)

WEIGHT_SUM_TOL = 1e-4


def _check_ref(
    ref_seq_logps: torch.Tensor | None, like: torch.Tensor, *, coef_name: str, coef: float
) -> None:
    """Check ``ref_seq_logps``: required when ``coef > 0``; if given, finite and like-shaped."""
    if ref_seq_logps is None:
        if coef > 0:
            raise ValueError(
                f"ref_seq_logps is required when {coef_name} > 0 (got {coef_name}={coef!r}); "
                "pass the length-normalised reference log-likelihoods, shape (B, G)"
            )
        return
    check_rewards(ref_seq_logps, name="ref_seq_logps")
    if ref_seq_logps.shape != like.shape:
        raise ValueError(
            f"ref_seq_logps must have the same shape as the scores {tuple(like.shape)}; "
            f"got {tuple(ref_seq_logps.shape)}"
        )


def _masked_softmax(
    logits: torch.Tensor, candidates: torch.Tensor | None, temperature: float = 1.0
) -> torch.Tensor:
    """``softmax_G(logits / temperature)`` over each row's candidates (0 elsewhere); all
    rows when None. A temperature so small that the division overflows, or is 0 in the
    logits' dtype (below float32's 1.4e-45), gives the limit (each row's largest entries
    share the mass), not NaN."""
    if candidates is not None:
        if candidates.shape != logits.shape or not bool(candidates.any(dim=1).all()):
            raise ValueError(
                f"candidates must be a bool tensor of shape {tuple(logits.shape)} with at "
                "least one True per row"
            )
        logits = logits.masked_fill(~candidates, float("-inf"))
    w = torch.softmax(logits / temperature, dim=1)
    if temperature < 1.0 and not bool(torch.isfinite(w).all()):
        shifted = logits - logits.amax(dim=1, keepdim=True)  # the largest: 0, not 0 / 0
        w = torch.softmax(torch.where(shifted == 0, 0.0, shifted / temperature), dim=1)
    return w


def q_distribution(
    rewards: torch.Tensor, temperature: float = 1.0, epsilon: float = 1e-6,
    candidates: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reward target over the candidates: ``(B, G) -> (B, G)``, rows summing to 1.

    ``q = softmax_G(r / temperature)``, then the floor ``q <- q * (1 - G*eps') + eps'`` with
    ``eps' = min(epsilon, 1/G - 1e-8)``, so every ``q >= eps' > 0`` and ``log q`` is finite.
    Example: ``r = [[1000, 0, 0, 0]]``, ``epsilon = 1e-6`` gives
    ``q = [1 - 3e-6, 1e-6, 1e-6, 1e-6]``.

    With ``candidates`` (``(B, G)`` bool, see :func:`distinct_candidates`) the softmax and
    the floor run over each row's ``k`` candidates only (``G`` replaced by ``k``) and the
    other entries are 0.

    Raises ``ValueError`` unless ``rewards`` is a finite floating ``(B, G)`` tensor and
    ``temperature`` and ``epsilon`` are finite and ``> 0``.
    """
    check_rewards(rewards)
    _check_scalar("temperature", temperature, positive=True)
    _check_scalar("epsilon", epsilon, positive=True)
    q = _masked_softmax(rewards, candidates, temperature)
    if candidates is None:
        group = rewards.shape[1]
        floor = min(epsilon, 1.0 / group - 1e-8)
        return q * (1.0 - group * floor) + floor
    k = candidates.sum(dim=1, keepdim=True).to(q.dtype)  # (B, 1)
    floor = torch.clamp(1.0 / k - 1e-8, max=epsilon)
    return torch.where(candidates, q * (1.0 - k * floor) + floor, torch.zeros_like(q))


def maxent_weights(
    log_q: torch.Tensor, tau: float, beta: float = 0.0, ref_seq_logps: torch.Tensor | None = None,
    candidates: torch.Tensor | None = None,
) -> torch.Tensor:
    """Closed-form listwise MaxEnt weights: ``(B, G) -> (B, G)``, detached, rows sum to 1.

    ``w = softmax_G((log_q + beta * rho) / (tau + beta))``, i.e.
    ``w ∝ q^(1/(tau+beta)) * pi_ref^(beta/(tau+beta))`` with ``pi_ref = softmax_G(rho)``.
    This is the unique maximiser over the simplex of
    ``<w, log q> + tau * H(w) - beta * KL(w || pi_ref)`` (strictly concave when
    ``tau + beta > 0``).

    Raises ``ValueError`` unless ``log_q`` is a finite floating ``(B, G)`` tensor,
    ``tau >= 0``, ``beta >= 0``, ``tau + beta > 0``, and ``ref_seq_logps`` (``rho``) is given,
    finite and shaped like ``log_q`` when ``beta > 0``. If given with ``beta = 0`` it is
    validated but has no effect. With ``candidates`` the softmax runs over each row's
    candidates only (``log_q`` may then be ``-inf`` elsewhere) and the other weights are 0.
    """
    if candidates is not None:  # entries outside the candidates are never read
        log_q = log_q.masked_fill(~candidates, 0.0)
    check_rewards(log_q, name="log_q")
    _check_scalar("tau", tau)
    _check_scalar("beta", beta)
    if tau + beta <= 0:
        raise ValueError(
            f"tau + beta must be > 0 for the MaxEnt weights; got tau={tau!r}, beta={beta!r}"
        )
    _check_ref(ref_seq_logps, log_q, coef_name="beta", coef=beta)
    with torch.no_grad():
        logits = log_q.detach()
        if beta > 0:
            logits = logits + beta * ref_seq_logps.detach().to(log_q.dtype)
            if not bool(torch.isfinite(logits).all()):
                raise ValueError(
                    f"beta={beta!r} is too large: beta * ref_seq_logps overflows {log_q.dtype}")
        return _masked_softmax(logits, candidates, tau + beta)


def group_utility(
    rewards: torch.Tensor, lengths: torch.Tensor, max_completion_length: int
) -> torch.Tensor:
    """Length-weighted group utility for group MaxEnt: ``(B, G) -> (B, G)``.

    ``U_i = A_i * T_i / T_max`` with ``A_i = r_i - mean_group(r)`` (no std scaling; a group of
    equal rewards gives exactly 0), ``T_i = lengths`` (completion tokens) and
    ``T_max = max_completion_length``. Computed in the rewards' dtype.

    Raises ``ValueError`` unless ``rewards`` is a finite floating ``(B, G)`` tensor with
    ``G >= 2``, ``lengths`` has the same shape with finite values in
    ``[0, max_completion_length]``, and ``max_completion_length`` is an integer ``>= 1``.
    """
    if (
        not isinstance(max_completion_length, int)
        or isinstance(max_completion_length, bool)
        or max_completion_length < 1
    ):
        raise ValueError(
            f"max_completion_length must be an integer >= 1; got {max_completion_length!r}"
        )
    advantages = group_advantages(rewards, scale="none")
    if not isinstance(lengths, torch.Tensor) or lengths.shape != rewards.shape:
        shape = tuple(lengths.shape) if isinstance(lengths, torch.Tensor) else type(lengths)
        raise ValueError(
            f"lengths must be a tensor with the shape of rewards {tuple(rewards.shape)}; "
            f"got {shape}"
        )
    lengths = lengths.to(rewards.dtype)
    if not bool(((lengths >= 0) & (lengths <= max_completion_length)).all()):
        raise ValueError(f"lengths must lie in [0, max_completion_length={max_completion_length}]")
    return advantages * lengths / max_completion_length


def group_weights(
    utility: torch.Tensor, tau: float, lam: float = 0.0, ref_seq_logps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Group MaxEnt weights: ``(B, G) -> (B, G)``, detached, rows sum to 1.

    ``kappa = tau + lam``; ``w = softmax_G((U + lam * rho) / kappa)``. When
    ``tau = lam = 0`` the limit is taken exactly: ``w`` is uniform over the argmax set
    ``{i : U_i == max_j U_j}`` of each row (exact float equality decides ties). The loss
    scales row ``i`` by ``G * w_i``; as ``tau -> inf`` this tends to 1 (Dr.GRPO).

    Raises ``ValueError`` unless ``utility`` is a finite floating ``(B, G)`` tensor,
    ``tau >= 0``, ``lam >= 0``, and ``ref_seq_logps`` (``rho``) is given, finite and shaped like
    ``utility`` when ``lam > 0``.
    """
    check_rewards(utility, name="utility")
    _check_scalar("tau", tau)
    _check_scalar("lam", lam)
    _check_ref(ref_seq_logps, utility, coef_name="lam", coef=lam)
    with torch.no_grad():
        utility = utility.detach()
        kappa = tau + lam
        if kappa == 0:
            top = utility == utility.amax(dim=1, keepdim=True)
            return top.to(utility.dtype) / top.sum(dim=1, keepdim=True).to(utility.dtype)
        logits = utility
        if lam > 0:
            logits = logits + lam * ref_seq_logps.detach().to(utility.dtype)
        return _masked_softmax(logits, None, kappa)


def weight_entropy(weights: torch.Tensor) -> torch.Tensor:
    """Entropy of each group's weights: ``(B, G) -> (B,)``, ``H = -sum_i w_i log w_i``.

    Uses ``0 * log 0 = 0``. Raises ``ValueError`` unless ``weights`` is a finite,
    non-negative floating ``(B, G)`` tensor.
    """
    check_rewards(weights, name="weights")
    if bool((weights < 0).any()):
        raise ValueError("weights must be non-negative")
    return -torch.special.xlogy(weights, weights).sum(dim=1)


def class_logsumexp(
    values: torch.Tensor, answers: torch.Tensor, candidates: torch.Tensor | None = None
) -> torch.Tensor:
    """``(B, G) -> (B, G)``: for every row, ``logsumexp`` of ``values`` over the candidate
    rows of its answer class (differentiable). With ``values = s`` this is the log of the
    policy mass of the row's answer among the sampled completions (up to the group's
    normaliser); with ``values = rho``, the reference's."""
    same = answers[:, :, None] == answers[:, None, :]  # (B, G, G)
    if candidates is not None:
        same = same & candidates[:, None, :]
    spread = values[:, None, :].expand(-1, values.shape[1], -1)
    return torch.logsumexp(spread.masked_fill(~same, float("-inf")), dim=-1)


def answer_maxent_weights(
    rewards: torch.Tensor, answers: torch.Tensor, tau: float, beta: float = 0.0,
    ref_seq_logps: torch.Tensor | None = None, candidates: torch.Tensor | None = None,
    q_temperature: float = 1.0, q_epsilon: float = 1e-6, right_reward: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Listwise MaxEnt weights over a group's distinct *answers* (docs/ALGORITHM.md §4.3,
    answer level): ``(q, w)``, both ``(B, G)``, non-zero only on the first row of each
    answer class (:func:`answer_classes`), rows summing to 1.

    With ``K`` classes per group: the class reward ``r_C`` is the mean reward of its rows,
    ``q = softmax_K(r_C / q_temperature)`` floored by ``q_epsilon`` over the ``K`` classes
    (:func:`q_distribution`), the class reference ``rho_C = logsumexp`` of ``rho`` over the
    class's candidate rows (:func:`class_logsumexp`), and
    ``w_C = softmax_K((log q_C + beta * rho_C) / (tau + beta))`` (:func:`maxent_weights`
    over the classes). When every class is one candidate row this is the listwise target
    over distinct candidates exactly.

    With ``right_reward`` the weights live on the group's *right* answers only (``r_C >=
    right_reward``): the maximiser of the same objective with the reference restricted to
    them, ``w_C ∝ q_C^(1/(tau+beta)) * pi_ref(C | right)^(beta/(tau+beta))`` on the right
    classes and 0 on the others, so the reference's mass on wrong answers is not held up.
    A group with no right answer keeps the target over all its answers. ``q`` is unchanged.
    """
    check_rewards(rewards)
    check_answer_classes(answers, candidates)
    if rewards.shape != answers.shape:
        raise ValueError(f"answers must have the shape of rewards {tuple(rewards.shape)}; "
                         f"got {tuple(answers.shape)}")
    first = answers == torch.arange(answers.shape[1], device=answers.device)  # (B, G)
    with torch.no_grad():
        same = (answers[:, :, None] == answers[:, None, :]).to(rewards.dtype)  # (B, G, G)
        class_reward = (same * rewards[:, None, :]).sum(-1) / same.sum(-1)  # (B, G)
        q = q_distribution(class_reward, q_temperature, q_epsilon, first)
        ref = None
        if beta > 0:
            _check_ref(ref_seq_logps, rewards, coef_name="beta", coef=beta)
            ref = class_logsumexp(ref_seq_logps.detach().to(rewards.dtype), answers, candidates)
        support = first
        if right_reward is not None:
            right = first & (class_reward >= right_reward)
            support = torch.where(right.any(-1, keepdim=True), right, first)
        w = maxent_weights(q.log(), tau, beta, ref, support)
    return q, w


def _check_group_weights(
    seq_logps: object, weights: object, seq_name: str = "seq_logps"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``(B, G)`` scores and weights on the simplex; return them (weights detached)."""
    scores, w = _check_pair(seq_logps, seq_name, weights, "weights")
    if scores.dim() != 2 or scores.shape[0] == 0 or scores.shape[1] == 0:
        raise ValueError(
            f"{seq_name} must have shape (B, G) with B, G >= 1; got shape {tuple(scores.shape)}"
        )
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
        eps_low, eps_high: clip widths as in :func:`~maxent_grpo.core.losses.clipped_surrogate`.
        max_log_ratio: overflow bound as in :func:`~maxent_grpo.core.losses.importance_ratio`.
    """
    scores, w = _check_group_weights(seq_logps, weights)
    old = _check_pair(scores, "seq_logps", old_seq_logps, "old_seq_logps")[1]
    a_hat = w - 1.0 / scores.shape[1]
    ratio = importance_ratio(scores, old, max_log_ratio)
    return -clipped_surrogate(ratio, a_hat, eps_low, eps_high).sum(dim=-1).mean()

"""Group-relative advantages (docs/ALGORITHM.md §1), and the structure of a group that
objectives read besides its rewards: its constant groups, its distinct completions and
its answer classes.

Rewards are ``(B, G)``: row ``b`` holds the ``G`` completions' rewards of prompt ``b``.
Everything is computed in the input's floating dtype, on the input's device.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Literal

import torch

Scale = Literal["group", "batch", "none"]
_SCALES = ("group", "batch", "none")


def check_rewards(rewards: torch.Tensor, *, name: str = "rewards", min_group: int = 1) -> None:
    """Raise ``ValueError`` unless ``rewards`` is a finite floating ``(B, G)`` tensor (B >= 1).

    ``min_group`` is the smallest allowed ``G``; ``name`` names the argument in messages.
    """
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape (B, G); got {type(rewards)!r}")
    if not rewards.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor; got dtype {rewards.dtype}")
    if rewards.dim() != 2 or rewards.shape[0] < 1 or rewards.shape[1] < min_group:
        raise ValueError(f"{name} must have shape (B, G) with B >= 1 and G >= {min_group}; "
                         f"got shape {tuple(rewards.shape)}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError(f"{name} must be finite (no NaN or inf)")


def constant_groups(rewards: torch.Tensor) -> torch.Tensor:
    """``(B, G) -> (B,)`` bool: True where every reward in the group is exactly equal."""
    return (rewards == rewards[:, :1]).all(dim=1)


def droppable_groups(rewards: torch.Tensor, solved_reward: float | None = None) -> torch.Tensor:
    """``(B, G) -> (B,)`` bool: the groups ``drop_constant_groups`` leaves out: constant
    groups (:func:`constant_groups`), less the *solved* ones, whose common reward is at
    least ``solved_reward`` (``None``: every constant group is dropped).

    >>> r = torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 1.0]])
    >>> droppable_groups(r).tolist(), droppable_groups(r, 1.0).tolist()
    ([True, True, False], [False, True, False])
    """
    constant = constant_groups(rewards)
    if solved_reward is None:
        return constant
    return constant & (rewards[:, 0] < solved_reward)


def group_advantages(
    rewards: torch.Tensor, scale: Scale = "group", eps: float = 1e-4
) -> torch.Tensor:
    """Group-relative advantages ``(B, G) -> (B, G)``.

    ``A[b, i] = r[b, i] - mean_i r[b, :]``, then by ``scale``:

    - ``"group"``: ``A / (std_i r[b, :] + eps)`` with the unbiased std (ddof = 1) of the group;
    - ``"batch"``: ``A / (std r + eps)`` with the unbiased std over all ``B*G`` rewards;
    - ``"none"``: no division (Dr.GRPO).

    A group whose rewards are all exactly equal gets ``A = 0`` exactly (no rounding residue,
    no 0/0 with ``eps = 0``).

    Raises ``ValueError`` unless ``rewards`` is a finite floating ``(B, G)`` tensor with
    ``G >= 2`` (the unbiased std needs two samples), ``scale`` is one of the three literals and
    ``eps`` is finite and ``>= 0``.
    """
    check_rewards(rewards, min_group=2)
    if scale not in _SCALES:
        raise ValueError(f"scale must be one of 'group', 'batch', 'none'; got {scale!r}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be finite and >= 0; got {eps!r}")

    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if scale == "group":
        centered = centered / (rewards.std(dim=1, keepdim=True, correction=1) + eps)
    elif scale == "batch":
        centered = centered / (rewards.std(correction=1) + eps)
    return _zero_constant(rewards, centered)


def zero_std_fraction(rewards: torch.Tensor) -> torch.Tensor:
    """Fraction of groups whose rewards are all equal: ``(B, G) -> ()`` in the input dtype.

    Such groups carry no learning signal (logged as ``zero_std_frac``); ``G = 1`` counts as
    constant.
    """
    check_rewards(rewards, min_group=1)
    return constant_groups(rewards).to(rewards.dtype).mean()


def leave_one_out_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO advantages ``(B, G) -> (B, G)`` (Ahmadian et al. 2024; TRL's ``RLOOTrainer``).

    ``A[b, i] = r[b, i] - (sum_j r[b, j] - r[b, i]) / (G - 1)``: each sample's baseline is
    the mean of the *other* samples of its group, so it does not depend on the sample.
    It equals ``G / (G - 1)`` times the centred reward ``r - mean(r)``; a group's
    advantages sum to 0, and a constant group gets exactly 0. ``G >= 2``.
    """
    check_rewards(rewards, min_group=2)
    G = rewards.shape[1]
    baseline = (rewards.sum(dim=1, keepdim=True) - rewards) / (G - 1)
    return _zero_constant(rewards, rewards - baseline)


def batch_normalised(advantages: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """``(A - mean(A)) / (std(A) + eps)`` over every entry of ``advantages`` (unbiased std):
    REINFORCE++'s global-batch normalisation, and TRL's ``RLOOTrainer``
    ``normalize_advantages``. Entries that are all exactly equal (one entry included) give
    exactly 0: the rounding left in ``A - mean(A)`` would be divided by ``eps`` alone.

    >>> batch_normalised(torch.full((2, 4), 0.1)).abs().max().item()
    0.0
    """
    check_rewards(advantages, name="advantages")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be finite and >= 0; got {eps!r}")
    if bool((advantages == advantages.reshape(-1)[0]).all()):
        return torch.zeros_like(advantages)
    centred = advantages - advantages.mean()
    return centred / (advantages.std(correction=1) + eps)


def passk_advantages(rewards: torch.Tensor, k: int, eps: float = 1e-6) -> torch.Tensor:
    """Pass@k Training's closed-form group advantages (Chen et al. 2025), ``(B, G) -> (B, G)``.

    For binary rewards, a group of ``n = G`` samples with ``c`` correct has the mean pass@k
    over its size-``k`` subsets ``R = 1 - C(n - c, k) / C(n, k)`` and their std
    ``s = sqrt(R (1 - R))``. A correct sample gets ``(1 - R) / (s + eps)``, a wrong one
    ``(1 - R - C(n - c - 1, k - 1) / C(n - 1, k - 1)) / (s + eps)``: the mean over the subsets
    that hold the sample of ``(max(subset) - R) / s``. A group all right or all wrong gets 0.
    ``1 <= k <= G``; with ``k = 1`` this is GRPO's advantage with the population std.
    """
    check_rewards(rewards, min_group=2)
    G = rewards.shape[1]
    _check_k(k, G)
    if not bool(((rewards == 0) | (rewards == 1)).all()):
        raise ValueError("pass@k advantages need rewards that are exactly 0 or 1 (a right "
                         "answer or not); for other rewards use objective.advantage: pkpo")
    out = torch.zeros_like(rewards)
    for b, c in enumerate(rewards.sum(dim=1).round().long().tolist()):
        R = 1.0 - math.comb(G - c, k) / math.comb(G, k)
        s = math.sqrt(R * (1.0 - R))
        if s == 0.0:
            continue
        right = (1.0 - R) / (s + eps)
        wrong = (1.0 - R - math.comb(G - c - 1, k - 1) / math.comb(G - 1, k - 1)) / (s + eps)
        out[b] = torch.where(rewards[b] == 1, *rewards.new_tensor([right, wrong]))  # its dtype
    return out


def pkpo_advantages(rewards: torch.Tensor, k: int) -> torch.Tensor:
    """PKPO's unbiased pass@k advantages with the leave-one-out-minus-one baseline (Walder
    and Karkhanis 2025, "loo-1"), ``(B, G) -> (B, G)``, for any rewards.

    ``A_i = (1 / C(n, k)) sum over the size-k subsets I holding i of (max_I r - max_{I - i} r)``:
    the sample's share of the group's pass@k estimate less what its subsets reach without
    it, so only a sample that is its subset's best gets credit. With the group sorted
    ascending and ``i`` at 1-based position ``p``:
    ``A = (C(p - 1, k - 1) r_(p) - sum_{q < p} C(q - 1, k - 2) r_(q)) / C(n, k)`` (ties
    give equal values). For 0/1 rewards a right sample gets ``C(n - c, k - 1) / C(n, k)`` and
    a wrong one 0. ``2 <= k <= G`` (``k = 1`` has no "best without it": use ``rloo``).
    """
    check_rewards(rewards, min_group=2)
    G = rewards.shape[1]
    _check_k(k, G)
    if k < 2:
        raise ValueError("pkpo needs k >= 2 (with k = 1 its baseline is RLOO's: advantage rloo)")
    out = torch.zeros_like(rewards)
    norm = math.comb(G, k)
    for b in range(rewards.shape[0]):
        values, order = torch.sort(rewards[b], stable=True)
        g = values.tolist()
        below = 0.0  # sum_{q < p} C(q - 1, k - 2) r_(q)
        for p, index in enumerate(order.tolist(), start=1):
            out[b, index] = (math.comb(p - 1, k - 1) * g[p - 1] - below) / norm
            below += math.comb(p - 1, k - 2) * g[p - 1]
    return out


def _check_k(k: object, G: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= G:
        raise ValueError(f"k must be an int in [1, G = {G}]; got {k!r}")


def wreinforce_advantages(rewards: torch.Tensor, positive_weight: float = 0.1) -> torch.Tensor:
    """W-REINFORCE (Zhu et al. 2025, "The Surprising Effectiveness of Negative Reinforcement
    in LLM Reasoning"), ``(B, G) -> (B, G)``: REINFORCE on the reward ``+1`` (right) / ``-1``
    (wrong) with no baseline, its positive part weighted by ``positive_weight`` (``lambda``,
    the authors' 0.1): ``A_i = lambda * r_i - (1 - r_i)`` for rewards in ``[0, 1]`` (0/1:
    ``lambda`` for a right sample, ``-1`` for a wrong one). Wrong samples are pushed down
    at full strength, right ones pulled up only a little, so the mass a wrong answer loses
    goes where the model already puts it, keeping its other right answers.

    >>> wreinforce_advantages(torch.tensor([[1.0, 0.0, 0.5]]), 0.1).tolist()
    [[0.10000000149011612, -1.0, -0.44999998807907104]]
    """
    check_rewards(rewards)
    if not bool(((rewards >= 0) & (rewards <= 1)).all()):
        raise ValueError("W-REINFORCE needs rewards in [0, 1] (1 right, 0 wrong); rescale the "
                         "rewards or use another objective.advantage")
    if not (isinstance(positive_weight, (int, float)) and 0 <= positive_weight <= 1):
        raise ValueError(f"positive_weight must be a number in [0, 1]; got {positive_weight!r}")
    return positive_weight * rewards - (1.0 - rewards)


#: the estimators of :func:`estimate_advantages`
ESTIMATORS = ("group", "rloo", "reinforce_pp", "reinforce_pp_baseline", "passk", "pkpo",
              "wreinforce")


def estimate_advantages(
    rewards: torch.Tensor, estimator: str = "group", scale: Scale = "group", eps: float = 1e-4,
    k: int = 4, positive_weight: float = 0.1,
) -> torch.Tensor:
    """Advantages ``(B, G) -> (B, G)`` by one of :data:`ESTIMATORS` (docs/ALGORITHM.md §1).

    - ``group``: GRPO's :func:`group_advantages` with ``scale``;
    - ``rloo``: :func:`leave_one_out_advantages`, then by ``scale``: ``"group"`` divides by
      the group's reward std ``+ eps``, ``"batch"`` is :func:`batch_normalised` (TRL's RLOO
      ``normalize_advantages``), ``"none"`` leaves them (RLOO's default);
    - ``reinforce_pp``: REINFORCE++ (Hu 2025) for outcome rewards, no group baseline:
      ``batch_normalised(r)``;
    - ``reinforce_pp_baseline``: REINFORCE++-baseline: ``batch_normalised(r - mean_group(r))``;
    - ``passk``: :func:`passk_advantages` with ``k`` (0/1 rewards);
    - ``pkpo``: :func:`pkpo_advantages` with ``k``;
    - ``wreinforce``: :func:`wreinforce_advantages` with ``positive_weight``.

    The batch is the optimizer step's whole batch, all ranks (the caller's ``rewards``).
    The REINFORCE++, pass@k and W-REINFORCE estimators scale by themselves: ``scale`` must be
    ``"group"`` (the option's default), any other value is refused.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}; got {estimator!r}")
    if estimator == "group":
        return group_advantages(rewards, scale=scale, eps=eps)
    if scale not in _SCALES:
        raise ValueError(f"scale must be one of 'group', 'batch', 'none'; got {scale!r}")
    if estimator == "rloo":
        adv = leave_one_out_advantages(rewards)
        if scale == "group":
            return _zero_constant(rewards, adv / (rewards.std(dim=1, keepdim=True, correction=1)
                                                  + eps))
        if scale == "batch":  # a constant group: exactly 0, as in the exact maths
            return _zero_constant(rewards, batch_normalised(adv, eps))
        return adv
    if scale != "group":
        raise ValueError(
            f"scale {scale!r} does not apply to {estimator}: it scales its advantages by "
            "itself (leave the scale at its default 'group')"
        )
    if estimator == "passk":
        return passk_advantages(rewards, k)
    if estimator == "pkpo":
        return pkpo_advantages(rewards, k)
    if estimator == "wreinforce":
        return wreinforce_advantages(rewards, positive_weight)
    check_rewards(rewards, min_group=2)
    if estimator == "reinforce_pp":
        return batch_normalised(rewards, eps)
    return _zero_constant(rewards, batch_normalised(
        _zero_constant(rewards, rewards - rewards.mean(dim=1, keepdim=True)), eps))


def _zero_constant(rewards: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """``adv`` with the rows of constant reward groups exactly 0 (no rounding residue)."""
    return torch.where(constant_groups(rewards)[:, None], torch.zeros_like(adv), adv)


def unlikeliness_rewards(
    rewards: torch.Tensor, seq_logps: torch.Tensor, penalty: float = 0.25
) -> torch.Tensor:
    """The unlikeliness reward (He, Fried and Welleck 2025, "Rewarding the Unlikely"),
    ``(B, G) -> (B, G)``: ``r_i * (1 - penalty * rank_i / G)``, where ``rank_i`` in
    ``0..G-1`` ranks sample ``i`` of its group by ``seq_logps`` (0 the least likely, ties
    broken by row order). Among right answers the one the policy finds most likely is paid
    least, so the gradient stops sharpening the policy onto its favourite; a reward of 0
    stays 0. ``seq_logps``: the samples' mean token log-probs under the behaviour policy
    (the authors' code ranks by those). ``0 <= penalty <= 1``; the authors used 0.25.

    >>> unlikeliness_rewards(torch.tensor([[1.0, 1.0, 0.0, 1.0]]),
    ...                      torch.tensor([[-0.1, -2.0, -0.5, -1.0]]), 0.25).tolist()
    [[0.8125, 1.0, 0.0, 0.9375]]
    """
    check_rewards(rewards)
    check_rewards(seq_logps, name="seq_logps")
    if seq_logps.shape != rewards.shape:
        raise ValueError(f"seq_logps must have the shape of rewards {tuple(rewards.shape)}; "
                         f"got {tuple(seq_logps.shape)}")
    if not (isinstance(penalty, (int, float)) and 0 <= penalty <= 1):
        raise ValueError(f"penalty must be a number in [0, 1]; got {penalty!r}")
    G = rewards.shape[1]
    order = torch.argsort(seq_logps.detach(), dim=1, stable=True)
    rank = torch.argsort(order, dim=1, stable=True).to(rewards.dtype)  # 0 = least likely
    return rewards * (1.0 - penalty * rank / G)


def repetition_penalty(answers: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The within-group repetition penalty of outcome-based exploration (Song, Kempe and
    Munos 2025, "batch exploration"), ``(B, G) -> (B, G)``:
    ``b_i = -(1/G) * #{j != i : a_j = a_i}``, with ``answers`` the group's answer classes
    (:func:`~maxent_grpo.core.answer_classes`; a sample with no answer is its own class).
    It applies to right and wrong answers alike; the objective adds ``c * b`` to the
    advantages. ``dtype``: the result's (the default dtype when None).

    >>> repetition_penalty(torch.tensor([[0, 0, 2, 0]])).tolist()
    [[-0.5, -0.5, -0.0, -0.5]]
    """
    if answers.dim() != 2:
        raise ValueError(f"answers must be (B, G); got {tuple(answers.shape)}")
    G = answers.shape[1]
    same = (answers[:, :, None] == answers[:, None, :]).sum(-1)  # (B, G), self included
    return -(same - 1).to(dtype or torch.get_default_dtype()) / G


def set_diversity_bonus(rewards: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """A set-level diversity bonus in the manner of SetPO (a sample's leave-one-out marginal
    contribution to its group's diversity), ``(B, G) -> (B, G)``. A group's diversity is
    ``D(S) = sum over its answers a of max_{i in S, a_i = a} r_i`` (for 0/1 rewards: its
    distinct right answers); sample ``i`` contributes ``m_i = D(S) - D(S - {i})``, which is
    ``r_i`` less the best other reward of its answer when ``i`` is its answer's best (ties:
    both 0), else 0. The bonus is ``m_i - mean_G m``, so a group's bonuses sum to 0, and a
    group of only distinct answers with equal rewards, or of one answer with one reward,
    gets none (within one answer, mixed rewards credit its best sample). ``answers``: the
    group's answer classes (:func:`answer_classes`); the objective adds ``c * bonus`` to the
    advantages.

    >>> set_diversity_bonus(torch.tensor([[1.0, 1.0, 1.0, 0.0]]),
    ...                     torch.tensor([[0, 0, 2, 3]])).tolist()
    [[-0.25, -0.25, 0.75, -0.25]]
    """
    check_rewards(rewards)
    if answers.shape != rewards.shape:
        raise ValueError(f"answers must have the shape of rewards {tuple(rewards.shape)}; "
                         f"got {tuple(answers.shape)}")
    same = answers[:, :, None] == answers[:, None, :]  # (B, G, G): j has i's answer
    G = rewards.shape[1]
    others = same & ~torch.eye(G, dtype=torch.bool, device=rewards.device)
    best_other = rewards[:, None, :].masked_fill(~others, -math.inf).amax(-1)  # (B, G)
    margin = torch.where(others.any(-1), (rewards - best_other).clamp(min=0), rewards)
    return margin - margin.mean(dim=1, keepdim=True)


# ----------------------------------------------------------- the structure of a group


def distinct_candidates(
    completion_ids: torch.Tensor, mask: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Which rows are candidates when a group's candidates are its *distinct* completions:
    ``(B*G, T), (B*G, T) -> (B, G)`` bool, True at the first occurrence of each completion.

    Two rows are the same completion when their masked tokens are equal (tokens outside
    ``mask`` are ignored). Example: completions ``[a, b, a, c]`` in one group give
    ``[True, True, False, True]``.
    """
    if completion_ids.dim() != 2 or mask.shape != completion_ids.shape:
        raise ValueError(
            "completion_ids and mask must be (B*G, T) tensors of one shape; got "
            f"{tuple(completion_ids.shape)} and {tuple(mask.shape)}"
        )
    if group_size < 1 or completion_ids.shape[0] % group_size:
        raise ValueError(f"group_size must divide the {completion_ids.shape[0]} rows")
    ids = torch.where(mask.bool(), completion_ids, -1).view(-1, group_size, mask.shape[1])
    same = (ids[:, :, None, :] == ids[:, None, :, :]).all(-1)  # (B, G, G)
    earlier = torch.ones(group_size, group_size, dtype=torch.bool, device=ids.device).tril(-1)
    return ~(same & earlier).any(-1)


def check_answer_classes(answers: torch.Tensor, candidates: torch.Tensor | None = None) -> None:
    """Check ``(B, G)`` answer classes: ``answers[b, i]`` is the index of the first row of
    group ``b`` with the same answer as row ``i`` (so ``answers[b, i] <= i`` and every class
    is named by its first row), and that first row is a candidate."""
    if answers.dim() != 2 or answers.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"answers must be a (B, G) integer tensor; got {answers.dtype} "
                         f"{tuple(answers.shape)}")
    index = torch.arange(answers.shape[1], device=answers.device).expand_as(answers)
    if bool(((answers < 0) | (answers > index)).any()) or not bool(
            (answers.gather(1, answers.long()) == answers).all()):
        raise ValueError("answers[b, i] must be the index of the first row of group b with "
                         "row i's answer (answer_classes builds them)")
    if candidates is not None and not bool(candidates[answers == index].all()):
        raise ValueError("the first row of every answer class must be a candidate")


def answer_classes(keys: list, group_size: int) -> torch.Tensor:
    """``(B, G)`` answer classes from ``B * G`` hashable answer keys (prompt-major): each row
    gets the index, inside its group, of the group's first row with an equal key.

    >>> answer_classes(["4 + 5", "2 + 7", "4 + 5", "x", "1", "1", "1", "1"], 4).tolist()
    [[0, 1, 0, 3], [0, 0, 0, 0]]
    """
    if group_size < 1 or len(keys) % group_size:
        raise ValueError(f"group_size must divide the {len(keys)} keys")
    rows = []
    for b in range(len(keys) // group_size):
        first: dict = {}
        group = keys[b * group_size:(b + 1) * group_size]
        rows.append([first.setdefault(key, i) for i, key in enumerate(group)])
    return torch.tensor(rows, dtype=torch.long)


def answer_entropy(keys: Sequence[object]) -> float:
    """The entropy (nats) of the empirical distribution of ``keys`` (one answer per sample,
    ``None`` counting as one more value); 0 for no keys.

    >>> round(answer_entropy(["8", "8", "7", None]), 6)
    1.039721
    """
    n = len(keys)
    return -sum(c / n * math.log(c / n) for c in Counter(keys).values()) if n else 0.0

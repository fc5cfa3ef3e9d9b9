"""MaxEnt objectives: listwise MaxEnt-GRPO and group MaxEnt weights on Dr.GRPO (§4.3-4.4).

Both turn a group's rewards into weights ``w`` (rows sum to 1) with an entropy temperature
``tau`` that :class:`~maxent_grpo.training.callbacks.TauController` may move;
:class:`ListwiseMaxEnt` fits the policy's softmax over the group to ``w``, while
:class:`GroupMaxEnt` scales the rows of the Dr.GRPO clipped surrogate by ``G*w``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from maxent_grpo.core import (
    answer_listwise_loss,
    answer_maxent_weights,
    group_advantages,
    group_utility,
    group_weights,
    kl_penalty,
    listwise_loss,
    maxent_weights,
    q_distribution,
    sequence_clip_loss,
)
from maxent_grpo.objectives.base import (
    ClipRule,
    CovSettings,
    GroupInputs,
    LossOutput,
    MicroBatch,
    Objective,
    RatioLevel,
    Targets,
    clip_range,
    clipped_token_loss,
    reduce_tokens,
    sequence_ref_loglik,
    surrogate_parts,
    token_sum,
    weight_stats,
)
from maxent_grpo.objectives.grpo import check_clip_range_read
from maxent_grpo.validation import check_bool, check_number, check_unused, defaults_of, require


class ListwiseMaxEnt(Objective):
    """Listwise MaxEnt-GRPO (docs/ALGORITHM.md §4.3).

    Per group: ``q = softmax(r / q_temperature)`` floored by ``q_epsilon``;
    ``w = softmax((log q + beta*rho) / (tau + beta))``; loss = mean over groups of
    ``-sum_i w_i log softmax_G(s)_i`` with ``s_i`` the sequence log-prob (divided by the
    length ``T_i`` when ``length_normalize``). Optional sequence-level clip term with
    coefficient ``clip_coef``. :meth:`prepare` returns ``q`` with the weights
    (:attr:`Targets.q`).

    Args:
        tau: entropy temperature of the weights; ``tau + beta`` must be > 0.
        beta: trust-region weight towards the reference (loads it when > 0).
        q_temperature: temperature ``T_q`` of the reward target (with 1.0 and tau = 0.5 a
            right answer's target is only e^2 times a wrong one's).
        q_epsilon: floor ``eps`` of the reward target.
        length_normalize: use ``s_i / T_i`` instead of ``s_i`` (with summed log-probs long
            junk completions escape the push down).
        distinct_candidates: the candidates of a group are its *distinct* completions (a
            completion sampled m times is one candidate, its first row), so a frequent
            answer does not get m times the target of a rare one that is as good.
        answer_level: the entropy and the target are over the group's distinct *answers*
            (canonical under the rows' ``answer_form``: expressions up to order by default,
            digit pairs in order, first integers; else the answer text), not its
            completions: ``q`` and ``w`` have one entry per answer, and the loss fits the
            policy's mass on each answer, summed over the distinct completions that give it
            (docs/ALGORITHM.md §4.3, answer level). Implies ``distinct_candidates``.
        kl_coef: a per-token ``KL(pi || pi_ref)`` penalty in the loss (``k3``, each
            completion's token mean, mean over rows: ``kl_coef * reduce_grpo(k3)``; loads the
            reference when > 0). Unlike ``beta``, which only tilts the target among the
            sampled completions, it acts on every token of every sample, so it also holds
            the mass of answers that are no longer sampled near the reference's (with a
            warm start that answers uniformly, the starting model's spread is the prior).
        right_only: with ``answer_level``, the target lives on the group's right answers
            only (mean reward at least ``right_reward``), and ``beta``'s reference is
            restricted to them: the maximiser over right answers, so neither the reward
            target's floor nor the reference's mass on wrong answers holds those up. A group
            with no right answer keeps the target over all its answers.
        right_reward: the mean reward at which an answer counts as right (``right_only``).
        clip_coef: coefficient of the sequence-level clip term (0 = off; not with
            ``distinct_candidates`` or ``answer_level``).
        epsilon: lower clip range of that term.
        epsilon_high: upper clip range; ``None`` means ``epsilon``.
    """

    tunable = ("tau", "beta")
    mutable = ("tau", "beta")

    def __init__(
        self, tau: float = 0.5, beta: float = 0.0, q_temperature: float = 0.2,
        q_epsilon: float = 1e-6, length_normalize: bool = True, distinct_candidates: bool = False,
        clip_coef: float = 0.0, epsilon: float = 0.2, epsilon_high: float | None = None,
        answer_level: bool = False, kl_coef: float = 0.0, right_only: bool = False,
        right_reward: float = 1.0,
    ) -> None:
        check_number("objective.beta", beta, minimum=0)
        check_number("objective.tau", tau, minimum=0)
        require(
            tau + beta > 0,
            "objective.tau must be > 0 when objective.beta = 0 (the weights need "
            f"tau + beta > 0); got tau={tau}, beta={beta}",
        )
        check_number("objective.q_temperature", q_temperature, minimum=0, strict=True)
        check_number("objective.q_epsilon", q_epsilon, minimum=0, strict=True)
        check_number("objective.clip_coef", clip_coef, minimum=0)
        self.epsilon, self.epsilon_high = clip_range(epsilon, epsilon_high)
        check_bool("objective.length_normalize", length_normalize)
        check_bool("objective.distinct_candidates", distinct_candidates)
        check_bool("objective.answer_level", answer_level)
        require(
            not ((distinct_candidates or answer_level) and clip_coef > 0),
            "objective.clip_coef must be 0 with objective.distinct_candidates or "
            "objective.answer_level: the sequence-level clip term is defined over all G rows",
        )
        self.answer_level = answer_level
        check_bool("objective.right_only", right_only)
        check_number("objective.right_reward", right_reward)
        require(not right_only or answer_level,
                "objective.right_only needs objective.answer_level: true (it restricts the "
                "target over answers)")
        self.right_only, self.right_reward = right_only, float(right_reward)
        d = defaults_of(ListwiseMaxEnt.__init__)
        check_unused({"objective.epsilon": (epsilon, d["epsilon"]),
                      "objective.epsilon_high": (epsilon_high, d["epsilon_high"])},
                     clip_coef > 0, "objective.clip_coef > 0 (the clip term they bound)")
        check_unused({"objective.right_reward": (right_reward, d["right_reward"])}, right_only,
                     "objective.right_only: true")
        check_number("objective.kl_coef", kl_coef, minimum=0)
        self.kl_coef = float(kl_coef)
        self.tau = float(tau)
        self.beta = float(beta)
        self.distinct_candidates = distinct_candidates
        self.q_temperature = q_temperature
        self.q_epsilon = q_epsilon
        self.length_normalize = length_normalize
        self.clip_coef = clip_coef

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0 or self.kl_coef > 0

    def state(self) -> dict[str, float]:
        return {"tau": self.tau, "beta": self.beta}

    def kl_weight(self) -> float:
        """``kl_coef``: beta tilts the target weights, it weighs no KL term in the loss."""
        return self.kl_coef

    def prepare(self, inputs: GroupInputs) -> Targets:
        rewards = inputs.rewards
        distinct = self.distinct_candidates or self.answer_level
        candidates = inputs.candidates if distinct else None
        ref = inputs.ref_seq_logps if self.beta > 0 else None
        if self.answer_level:
            answers = inputs.answers
            require(answers is not None, "objective.answer_level needs the answer classes "
                    "(GroupInputs.answers); the trainer passes them")
            q, w = answer_maxent_weights(rewards, answers, self.tau, self.beta, ref, candidates,
                                         self.q_temperature, self.q_epsilon,
                                         self.right_reward if self.right_only else None)
            return Targets(weights=w, stats=weight_stats(w), candidates=candidates, q=q,
                           answers=answers)
        q = q_distribution(rewards, self.q_temperature, self.q_epsilon, candidates)  # (B, G)
        w = maxent_weights(q.log(), self.tau, self.beta, ref, candidates)  # rows sum to 1
        return Targets(weights=w, stats=weight_stats(w), candidates=candidates, q=q)

    def _seq_logps(self, token_logps: Tensor, mask: Tensor, group_size: int) -> Tensor:
        if self.length_normalize:
            return sequence_ref_loglik(token_logps, mask, group_size)  # sum_t m*l / max(T_i, 1)
        s = token_logps.where(mask.bool(), 0).sum(-1)  # -inf * 0 at a padded token is NaN
        return s.view(-1, group_size)

    def loss(self, mb: MicroBatch) -> LossOutput:
        assert mb.weights is not None
        G = mb.group_size
        total_groups = mb.num_rows // G
        scale = mb.num_groups / total_groups  # sum over micro-batches = mean over groups
        s = self._seq_logps(mb.token_logps, mb.mask, G)  # (b, G)
        if mb.answers is not None:
            loss = answer_listwise_loss(s, mb.weights, mb.answers, mb.candidates) * scale
        else:
            loss = listwise_loss(s, mb.weights, mb.candidates) * scale
        sums: dict[str, tuple[Tensor, Tensor]] = {}
        groups = torch.tensor(float(mb.num_groups), dtype=torch.float32)
        sums["loss/policy"] = (loss.detach() / scale * groups, groups)
        if self.clip_coef > 0:
            s_old = self._seq_logps(mb.behaviour_logps, mb.mask, G)
            clip = sequence_clip_loss(s, s_old, mb.weights, self.epsilon, self.epsilon_high)
            loss = loss + self.clip_coef * clip * scale
            sums["loss/clip"] = (clip.detach() * groups, groups)
        if mb.ref_token_logps is not None:
            kl = kl_penalty(mb.token_logps, mb.ref_token_logps, mask=mb.mask)  # (n, T), k3
            sums["kl"] = token_sum(kl, mb.mask)
            if self.kl_coef > 0:
                loss = loss + self.kl_coef * reduce_tokens(kl, mb, "grpo")
        return LossOutput(loss, sums)


class GroupMaxEnt(Objective):
    """Group-level MaxEnt weights on Dr.GRPO, "xDr.GRPO" (docs/ALGORITHM.md §4.4).

    ``A_i = r_i - mean_group(r)``, ``U_i = A_i*T_i/T_max``,
    ``w = softmax((U + lam*rho)/(tau + lam))`` (constants); the loss is the Dr.GRPO token
    loss with row ``i`` scaled by ``G*w_i``:
    ``sum_i G*w_i sum_t m*(-surr) / (N*T_max)``. ``tau = lam = 0`` puts uniform weight
    on the argmax set; ``tau -> inf`` recovers Dr.GRPO. There is no ``beta`` (the reference
    enters through ``lam``, in the weights), so only ``tau`` is tunable.

    Args:
        tau: temperature of the group weights (>= 0).
        lam: weight of the reference log-likelihood (>= 0; loads the reference when > 0).
        epsilon: lower clip range.
        epsilon_high: upper clip range; ``None`` means ``epsilon``.
        ratio_level: the importance ratio: ``token``, ``sequence`` (GSPO) or
            ``sequence_token`` (GSPO-token) (docs/ALGORITHM.md §4.5).
        clip_rule: ``ppo``, ``cispo``, ``clip_cov`` or ``kl_cov`` (as
            :class:`~maxent_grpo.objectives.GRPO`, the last two with its default options).
    """

    tunable = ("tau",)
    mutable = ("tau",)

    supports_sampler_correction = True  # through the clipped surrogate

    def __init__(
        self, tau: float = 1.0, lam: float = 0.0, epsilon: float = 0.2,
        epsilon_high: float | None = None, ratio_level: RatioLevel = "token",
        clip_rule: ClipRule = "ppo",
    ) -> None:
        self.ratio_level, self.clip_rule = surrogate_parts(ratio_level, clip_rule)
        check_number("objective.tau", tau, minimum=0)
        check_number("objective.lam", lam, minimum=0)
        self.epsilon, self.epsilon_high = clip_range(epsilon, epsilon_high)
        check_clip_range_read(clip_rule, epsilon, epsilon_high, defaults_of(GroupMaxEnt.__init__))
        self.tau = float(tau)
        self.lam = float(lam)

    @property
    def needs_reference(self) -> bool:
        return self.lam > 0

    def state(self) -> dict[str, float]:
        return {"tau": self.tau, "lam": self.lam}

    def prepare(self, inputs: GroupInputs) -> Targets:
        rewards = inputs.rewards
        adv = group_advantages(rewards, scale="none")  # (B, G)
        utility = group_utility(rewards, inputs.lengths, inputs.max_completion_length)  # (B, G)
        ref = inputs.ref_seq_logps if self.lam > 0 else None
        w = group_weights(utility, self.tau, self.lam, ref)  # (B, G)
        return Targets(advantages=adv.reshape(-1), weights=w, stats=weight_stats(w))

    def loss(self, mb: MicroBatch) -> LossOutput:
        assert mb.advantages is not None and mb.weights is not None
        per_token, sums = clipped_token_loss(mb, mb.advantages, self.epsilon, self.epsilon_high,
                                             self.ratio_level, self.clip_rule, CovSettings())
        per_token = per_token * (mb.group_size * mb.weights).reshape(-1, 1)  # row i: G*w_i
        sums["loss/policy"] = token_sum(per_token, mb.mask)  # as trained (the weights in)
        if mb.ref_token_logps is not None:
            sums["kl"] = token_sum(kl_penalty(mb.token_logps, mb.ref_token_logps,
                                              mask=mb.mask), mb.mask)
        return LossOutput(reduce_tokens(per_token, mb, "dr_grpo"), sums)

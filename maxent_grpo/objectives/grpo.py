"""GRPO with its Dr.GRPO / DAPO variants, and entropy-regularised GRPO (docs/ALGORITHM.md §4.1-4.2).

Both optimise the clipped surrogate on group advantages, plus ``beta`` times a per-token KL
to the reference; :class:`EntropyMaxEnt` adds an exact token-entropy bonus.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from maxent_grpo.core import (
    constant_groups,
    entropy_gate_multiplier,
    estimate_advantages,
    importance_ratio_at,
    kl_penalty,
    repetition_penalty,
    set_diversity_bonus,
    top_entropy_mask,
    unlikeliness_rewards,
)
from maxent_grpo.objectives.base import (
    ClipRule,
    CovSettings,
    GroupInputs,
    LossOutput,
    LossType,
    MicroBatch,
    Objective,
    RatioLevel,
    Targets,
    clip_range,
    clipped_token_loss,
    reduce_tokens,
    surrogate_parts,
    token_sum,
)
from maxent_grpo.validation import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_unused,
    defaults_of,
    require,
)

ScaleRewards = Literal["group", "batch", "none"]
KLEstimator = Literal["k1", "k2", "k3"]
Advantage = Literal["group", "rloo", "reinforce_pp", "reinforce_pp_baseline", "passk", "pkpo",
                    "wreinforce"]
#: the estimators that scale by themselves (``scale_rewards`` stays at its default)
SELF_SCALED = ("reinforce_pp", "reinforce_pp_baseline", "passk", "pkpo", "wreinforce")
Shaping = Literal["none", "unlikeliness", "repetition", "set_diversity"]


def check_clip_range_read(clip_rule: str, epsilon: float, epsilon_high: float | None,
                          defaults: dict[str, Any]) -> None:
    """Refuse a clip range set away from its default (``defaults``) that ``clip_rule`` would
    not read: ``kl_cov`` clips nothing, ``cispo`` caps at ``1 + epsilon_high`` alone."""
    given = {"objective.epsilon": (epsilon, defaults["epsilon"]),
             "objective.epsilon_high": (epsilon_high, defaults["epsilon_high"])}
    check_unused(given, clip_rule != "kl_cov", "objective.clip_rule ppo or clip_cov (cispo "
                 "reads epsilon_high alone)")
    check_unused({"objective.epsilon": given["objective.epsilon"]},
                 clip_rule != "cispo" or epsilon_high is None,
                 "objective.epsilon_high null under clip_rule cispo (its one cap: 1 + "
                 "epsilon_high)")


class GRPO(Objective):
    """GRPO with the Dr.GRPO / DAPO variants (docs/ALGORITHM.md §4.1).

    ``L[i,t] = -min(c*A, clip(c, 1-eps_low, 1+eps_high)*A) + beta*KL[i,t]`` reduced by
    ``loss_type``; ``A`` from :func:`maxent_grpo.core.group_advantages` with
    ``scale_rewards``. Dr.GRPO is ``loss_type="dr_grpo", scale_rewards="none"``; DAPO is
    ``loss_type="dapo"`` with ``epsilon_high`` above ``epsilon``. The parts of
    docs/ALGORITHM.md §4.5 compose with all of these: ``advantage="rloo"`` is RLOO,
    ``ratio_level="sequence"`` GSPO, ``clip_rule="cispo"`` CISPO.

    Args:
        loss_type: token reduction: ``grpo``, ``bnpo``, ``dr_grpo`` or ``dapo``.
        scale_rewards: advantage scaling: ``group``, ``batch`` or ``none``.
        epsilon: lower clip range ``eps_low``.
        epsilon_high: upper clip range; ``None`` means ``epsilon``.
        beta: KL coefficient; 0 means the reference model is neither loaded nor run.
        kl_estimator: per-token KL estimator ``k1``, ``k2`` or ``k3``.
        advantage: the advantage estimator: ``group`` (GRPO), ``rloo`` (leave-one-out),
            ``reinforce_pp`` or ``reinforce_pp_baseline`` (REINFORCE++, normalised over the
            whole batch), ``passk`` (Pass@k Training's closed form, 0/1 rewards), ``pkpo``
            (PKPO's unbiased pass@k, any rewards) or ``wreinforce`` (W-REINFORCE: right
            samples ``+positive_weight``, wrong ones ``-1``, no baseline; rewards in [0, 1]);
            the last five leave ``scale_rewards`` at its default.
        pass_k: the ``k`` of ``passk`` (``1 <= k < G``) and ``pkpo`` (``2 <= k <= G``).
        ratio_level: the importance ratio: ``token``, ``sequence`` (GSPO) or
            ``sequence_token`` (GSPO-token).
        clip_rule: ``ppo`` (the clipped surrogate), ``cispo`` (clipped, stop-gradient
            importance weight on every token's REINFORCE gradient; cap ``1 + epsilon_high``),
            ``clip_cov`` (PPO's clip, and a few tokens of high log-prob/advantage covariance
            out of the gradient) or ``kl_cov`` (no clip; ``kl_cov_coef * |l - l_old|`` on the
            highest-covariance tokens), both after Cui et al. 2025.
        cov_fraction: the share of a micro-batch's tokens ``clip_cov`` / ``kl_cov`` choose
            (at least one; verl's default 2e-4).
        clip_cov_bounds: ``[low, high]``: ``clip_cov`` chooses among tokens whose
            covariance lies strictly between them.
        kl_cov_coef: ``kl_cov``'s coefficient.
        top_entropy_quantile: ``rho``: only the tokens whose entropy is at least the
            ``1 - rho`` quantile of the micro-batch's completion tokens keep their policy
            term (TRL's option, after "Beyond the 80/20 rule"; the KL term keeps every
            token); 1 = every token (off). Needs the token entropy (computed when < 1).
            The quantile is this rank's micro-batch's, with no collective: TRL gathers the
            micro-batch's entropies from every process first, so on several ranks (or
            micro-batches) the threshold differs from TRL's and from a 1-rank run's.
        kl_bias_correction: multiply the per-token KL by the importance ratio (with its
            gradient), which makes the KL term's gradient the unbiased gradient of
            ``KL(pi_theta || pi_ref)`` (DeepSeek-V3.2; TRL 1.16's ``use_bias_correction_kl``,
            on by default there). It changes the gradient even at ratio 1.
        answer_shaping: a diversity term on the group's answers (docs/ALGORITHM.md §4.5):
            ``unlikeliness`` multiplies each reward by ``1 - rank_penalty * rank / G``
            before the advantage, ``rank`` ordering the group by the samples' mean token
            log-prob under the behaviour policy (0 the least likely; "Rewarding the
            Unlikely", He et al. 2025); a group whose raw rewards are all equal keeps zero
            advantages, as the authors skip such groups; ``repetition`` adds
            ``repetition_coef * b_i`` to the advantages,
            ``b_i = -#(other samples with the same answer) / G``
            (outcome-based exploration's batch penalty, Song et al. 2025);
            ``set_diversity`` adds ``set_diversity_coef * (m_i - mean m)``, ``m_i`` the
            sample's leave-one-out contribution to the group's distinct right answers
            (:func:`~maxent_grpo.core.set_diversity_bonus`, in the manner of SetPO);
            ``none``: off.
        rank_penalty: the unlikeliness penalty in ``[0, 1]`` (the authors' 0.25).
        repetition_coef: the repetition penalty's coefficient ``c >= 0`` (0.2).
        set_diversity_coef: the set-diversity bonus's coefficient ``c >= 0`` (0.5).
        positive_weight: W-REINFORCE's weight ``lambda`` in ``[0, 1]`` on right samples
            (the authors' 0.1).
    """

    tunable = ("beta",)
    mutable = ("beta",)

    def __init__(
        self, loss_type: LossType = "grpo", scale_rewards: ScaleRewards = "group",
        epsilon: float = 0.2, epsilon_high: float | None = None, beta: float = 0.0,
        kl_estimator: KLEstimator = "k3", advantage: Advantage = "group",
        ratio_level: RatioLevel = "token", clip_rule: ClipRule = "ppo",
        kl_bias_correction: bool = False, pass_k: int = 4, cov_fraction: float = 2e-4,
        clip_cov_bounds: tuple[float, float] = (1.0, 5.0), kl_cov_coef: float = 1.0,
        top_entropy_quantile: float = 1.0, answer_shaping: Shaping = "none",
        rank_penalty: float = 0.25, repetition_coef: float = 0.2,
        set_diversity_coef: float = 0.5, positive_weight: float = 0.1,
    ) -> None:
        check_choice("objective.loss_type", loss_type, get_args(LossType))
        check_choice("objective.answer_shaping", answer_shaping, get_args(Shaping))
        check_number("objective.rank_penalty", rank_penalty, minimum=0, maximum=1)
        check_number("objective.repetition_coef", repetition_coef, minimum=0)
        require(answer_shaping != "unlikeliness" or advantage != "passk",
                "objective.answer_shaping unlikeliness makes the rewards fractional, and "
                "objective.advantage passk needs 0/1 rewards; use advantage pkpo (any rewards) "
                "or group")
        self.answer_shaping = answer_shaping
        self.rank_penalty = float(rank_penalty)
        self.repetition_coef = float(repetition_coef)
        check_number("objective.set_diversity_coef", set_diversity_coef, minimum=0)
        self.set_diversity_coef = float(set_diversity_coef)
        check_number("objective.positive_weight", positive_weight, minimum=0, maximum=1)
        self.positive_weight = float(positive_weight)
        check_number("objective.top_entropy_quantile", top_entropy_quantile, minimum=0,
                     maximum=1, strict=True)
        self.top_entropy_quantile = float(top_entropy_quantile)
        if self.top_entropy_quantile < 1.0:
            self.needs_entropy = True
        self.cov = CovSettings.checked(cov_fraction, clip_cov_bounds, kl_cov_coef)
        check_int("objective.pass_k", pass_k, minimum=1)
        require(advantage != "pkpo" or pass_k >= 2,
                "objective.pass_k must be >= 2 with objective.advantage pkpo (at k = 1 its "
                f"baseline is RLOO's: advantage rloo); got {pass_k}")
        self.pass_k = pass_k
        check_bool("objective.kl_bias_correction", kl_bias_correction)
        self.kl_bias_correction = kl_bias_correction
        check_choice("objective.scale_rewards", scale_rewards, get_args(ScaleRewards))
        check_choice("objective.advantage", advantage, get_args(Advantage))
        require(
            advantage not in SELF_SCALED or scale_rewards == "group",
            f"objective.scale_rewards={scale_rewards!r} does not apply to objective.advantage="
            f"{advantage!r}, which scales its advantages by itself; leave "
            "objective.scale_rewards at its default",
        )
        self.ratio_level, self.clip_rule = surrogate_parts(ratio_level, clip_rule)
        self.advantage = advantage
        self.epsilon, self.epsilon_high = clip_range(epsilon, epsilon_high)
        check_clip_range_read(clip_rule, epsilon, epsilon_high, defaults_of(GRPO.__init__))
        check_choice("objective.kl_estimator", kl_estimator, get_args(KLEstimator))
        check_number("objective.beta", beta, minimum=0)
        d = defaults_of(GRPO.__init__)
        for kind, option, value in (("unlikeliness", "rank_penalty", rank_penalty),
                                    ("repetition", "repetition_coef", repetition_coef),
                                    ("set_diversity", "set_diversity_coef", set_diversity_coef)):
            check_unused({f"objective.{option}": (value, d[option])}, answer_shaping == kind,
                         f"objective.answer_shaping {kind}")
        check_unused({"objective.positive_weight": (positive_weight, d["positive_weight"])},
                     advantage == "wreinforce", "objective.advantage wreinforce")
        check_unused({"objective.pass_k": (pass_k, d["pass_k"])},
                     advantage in ("passk", "pkpo"), "objective.advantage passk or pkpo")
        check_unused({"objective.cov_fraction": (cov_fraction, d["cov_fraction"])},
                     clip_rule in ("clip_cov", "kl_cov"), "objective.clip_rule clip_cov or kl_cov")
        check_unused({"objective.clip_cov_bounds": (clip_cov_bounds, d["clip_cov_bounds"])},
                     clip_rule == "clip_cov", "objective.clip_rule clip_cov")
        check_unused({"objective.kl_cov_coef": (kl_cov_coef, d["kl_cov_coef"])},
                     clip_rule == "kl_cov", "objective.clip_rule kl_cov")
        self.loss_type = loss_type
        self.scale_rewards = scale_rewards
        self.beta = float(beta)
        self.kl_estimator = kl_estimator

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0

    supports_sampler_correction = True  # through the clipped surrogate

    def loss_scale(self, world_size: int, rows: int, rows_all_ranks: int) -> float:
        """``dapo`` divides by the all-rank token count, so it is multiplied back by the
        world size W; ``bnpo`` is a mean of micro-batch means by definition (factor 1)."""
        if self.loss_type == "dapo":
            return float(world_size)
        if self.loss_type == "bnpo":
            return 1.0
        return super().loss_scale(world_size, rows, rows_all_ranks)

    @property
    def needs_sequence_logps(self) -> bool:
        return self.answer_shaping == "unlikeliness"

    def check_group_size(self, group_size: int) -> None:
        require(self.advantage not in ("passk", "pkpo") or self.pass_k <= group_size,
                f"objective.pass_k ({self.pass_k}) must be at most model.num_generations "
                f"({group_size}): pass@k is over subsets of a group")
        require(self.advantage != "passk" or self.pass_k < group_size,  # trained nothing
                f"objective.pass_k ({self.pass_k}) must be below model.num_generations "
                f"({group_size}) with objective.advantage passk: its one subset of k is the "
                "whole group, whose pass@k has no spread, so its advantage is 0 for every "
                "sample; lower pass_k or raise num_generations")

    def prepare(self, inputs: GroupInputs) -> Targets:
        rewards = inputs.rewards  # G was checked when the module was built (check_group_size)
        if self.answer_shaping == "unlikeliness":
            require(inputs.seq_logps is not None, "objective.answer_shaping unlikeliness "
                    "needs the samples' log-probs (GroupInputs.seq_logps); the trainer passes "
                    "them")
            solved_or_failed = constant_groups(rewards)  # as the authors, no push there
            rewards = unlikeliness_rewards(rewards, inputs.seq_logps, self.rank_penalty)
        adv = estimate_advantages(rewards, self.advantage, self.scale_rewards,
                                  k=self.pass_k, positive_weight=self.positive_weight)  # (B, G)
        if self.answer_shaping == "unlikeliness":
            adv = adv.masked_fill(solved_or_failed[:, None], 0.0)
        if self.answer_shaping in ("repetition", "set_diversity") and inputs.answers is None:
            raise ValueError(f"objective.answer_shaping {self.answer_shaping} needs the answer "
                             "classes (GroupInputs.answers); the trainer passes them")
        if self.answer_shaping == "repetition":
            adv = adv + self.repetition_coef * repetition_penalty(inputs.answers, adv.dtype)
        if self.answer_shaping == "set_diversity":
            adv = adv + self.set_diversity_coef * set_diversity_bonus(inputs.rewards,
                                                                      inputs.answers)
        return Targets(advantages=adv.reshape(-1))

    def state(self) -> dict[str, float]:
        return {"beta": self.beta}

    def loss(self, mb: MicroBatch) -> LossOutput:
        assert mb.advantages is not None
        per_token, sums = clipped_token_loss(mb, mb.advantages, self.epsilon, self.epsilon_high,
                                             self.ratio_level, self.clip_rule, self.cov)
        if self.top_entropy_quantile < 1.0:
            if mb.entropy is None:
                raise RuntimeError("top_entropy_quantile needs token entropy; none was passed")
            keep = top_entropy_mask(mb.entropy, mb.mask, self.top_entropy_quantile)
            per_token = per_token * keep
            sums["entropy_mask"] = (keep.sum().float(), mb.mask.sum().float())
        sums["loss/policy"] = token_sum(per_token, mb.mask)
        if mb.ref_token_logps is not None:
            kl = kl_penalty(mb.token_logps, mb.ref_token_logps, self.kl_estimator,
                            mb.mask)  # (n, T)
            sums["kl"] = token_sum(kl, mb.mask)
            if self.beta > 0 and self.kl_bias_correction:
                kl = kl * importance_ratio_at(mb.token_logps, mb.behaviour_logps, mb.mask,
                                              self.ratio_level)
            if self.beta > 0:
                per_token = per_token + self.beta * kl
        return LossOutput(reduce_tokens(per_token, mb, self.loss_type), sums)


class EntropyMaxEnt(GRPO):
    """Entropy-regularised GRPO, "token MaxEnt" (docs/ALGORITHM.md §4.2).

    ``L[i,t] = -surr + beta*KL - alpha_eff*H[i,t]`` with the exact, differentiable token
    entropy at the sampling temperature. With ``kl_gate_threshold`` set, ``alpha_eff =
    alpha * m(KL)`` (:func:`maxent_grpo.core.entropy_gate_multiplier`) with the token-mean
    KL of the *previous* training step (one rollout: with ``num_iterations`` k its k
    updates share the multiplier set by the mean KL of the rollout before; 1 at the first);
    gating loads the reference model.

    Args:
        alpha: entropy bonus coefficient (>= 0).
        kl_gate_threshold: ``kappa``; ``None`` disables gating.
        kl_gate_gain: gain ``g`` of the gate.
        kl_gate_min_multiplier: lower bound ``m_lo`` of the multiplier.
        kl_gate_max_multiplier: upper bound ``m_hi`` of the multiplier.
        disable_outside_trust_zone: switch the bonus off while KL is above ``kappa``.
        grpo_options: every option of :class:`GRPO`, by name.
    """

    needs_entropy = True
    mutable = ("beta", "alpha_multiplier")

    def __init__(
        self, alpha: float = 0.01, kl_gate_threshold: float | None = None,
        kl_gate_gain: float = 1.0, kl_gate_min_multiplier: float = 0.0,
        kl_gate_max_multiplier: float = 2.0, disable_outside_trust_zone: bool = False,
        **grpo_options: Any,
    ) -> None:
        super().__init__(**grpo_options)
        check_number("objective.alpha", alpha, minimum=0)
        check_number("objective.kl_gate_threshold", kl_gate_threshold, minimum=0, strict=True,
                     allow_none=True)
        check_number("objective.kl_gate_gain", kl_gate_gain, minimum=0)
        check_number("objective.kl_gate_min_multiplier", kl_gate_min_multiplier, minimum=0)
        check_number("objective.kl_gate_max_multiplier", kl_gate_max_multiplier, minimum=0)
        require(
            kl_gate_min_multiplier <= kl_gate_max_multiplier,
            "objective.kl_gate_min_multiplier must be <= objective.kl_gate_max_multiplier; "
            f"got {kl_gate_min_multiplier} > {kl_gate_max_multiplier}",
        )
        check_bool("objective.disable_outside_trust_zone", disable_outside_trust_zone)
        d = defaults_of(EntropyMaxEnt.__init__)
        gate = {"kl_gate_gain": kl_gate_gain, "kl_gate_min_multiplier": kl_gate_min_multiplier,
                "kl_gate_max_multiplier": kl_gate_max_multiplier,
                "disable_outside_trust_zone": disable_outside_trust_zone}
        check_unused({f"objective.{k}": (v, d[k]) for k, v in gate.items()},
                     kl_gate_threshold is not None, "objective.kl_gate_threshold set")
        check_unused({"objective.kl_gate_threshold": (kl_gate_threshold, None)}, alpha > 0,
                     "objective.alpha > 0 (the gate scales the bonus; it loads the reference)")
        self.alpha = float(alpha)
        self.kl_gate_threshold = kl_gate_threshold
        self.kl_gate_gain = kl_gate_gain
        self.kl_gate_min_multiplier = kl_gate_min_multiplier
        self.kl_gate_max_multiplier = kl_gate_max_multiplier
        self.disable_outside_trust_zone = disable_outside_trust_zone
        self.alpha_multiplier = 1.0

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0 or self.kl_gate_threshold is not None

    def observe(self, stats: dict[str, float]) -> None:
        """Update the gate from the step's measured token-mean KL (``stats["train/kl"]``); an
        unmeasured KL (every micro-batch non-finite) counts as non-finite, i.e. "above" (the
        module does not call this after a step whose every group was dropped)."""
        if self.kl_gate_threshold is None:
            return
        kl = stats.get("train/kl", float("nan"))
        self.alpha_multiplier = entropy_gate_multiplier(
            kl,
            kappa=self.kl_gate_threshold,
            gain=self.kl_gate_gain,
            m_lo=self.kl_gate_min_multiplier,
            m_hi=self.kl_gate_max_multiplier,
            disable_outside_trust_zone=self.disable_outside_trust_zone,
        )

    @property
    def alpha_effective(self) -> float:
        return self.alpha * self.alpha_multiplier

    def state(self) -> dict[str, float]:
        return {"beta": self.beta, "alpha": self.alpha_effective}

    def loss(self, mb: MicroBatch) -> LossOutput:
        out = super().loss(mb)
        if mb.entropy is None:
            raise RuntimeError("EntropyMaxEnt needs token entropy; the module did not pass it")
        out.sums["entropy"] = token_sum(mb.entropy, mb.mask)
        if self.alpha_effective > 0:
            bonus = reduce_tokens(mb.entropy, mb, self.loss_type)
            out.loss = out.loss - self.alpha_effective * bonus
        return out

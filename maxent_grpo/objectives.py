"""Training objectives: GRPO, entropy-regularised GRPO, listwise MaxEnt-GRPO, group MaxEnt.

Each objective is a small class with validated hyper-parameters, chosen in YAML with
``class_path`` (``../shared/ALGORITHM.md`` §4). The LightningModule drives them in two
phases per rollout:

1. :meth:`Objective.prepare` once per rollout, on whole groups: rewards ``(B, G)``,
   completion lengths ``(B, G)`` and, when :attr:`Objective.needs_reference`, the
   length-normalised reference log-likelihood ``rho`` ``(B, G)``. It returns
   :class:`Targets`: per-row advantages and/or per-group weights, all constants.
2. :meth:`Objective.loss` once per micro-batch of whole groups (never a split group), on
   token log-probs with gradient. The value is scaled so that the *sum* over the
   micro-batches of one optimizer step equals the loss of the whole batch.

All mathematics is delegated to :mod:`maxent_grpo.core`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from maxent_grpo.core import (
    clip_fractions,
    clipped_surrogate,
    entropy_gate_multiplier,
    group_advantages,
    group_utility,
    group_weights,
    importance_ratio,
    kl_penalty,
    listwise_loss,
    maxent_weights,
    q_distribution,
    reduce_token_loss,
    sequence_clip_loss,
    weight_entropy,
)

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
ScaleRewards = Literal["group", "batch", "none"]
KLEstimator = Literal["k1", "k2", "k3"]


@dataclass
class Targets:
    """What an objective derives from one rollout before any gradient is taken.

    Attributes:
        advantages: ``(B*G,)`` per-row advantages, or ``None`` (listwise).
        weights: ``(B, G)`` per-group weights summing to 1, or ``None`` (GRPO).
        stats: scalar diagnostics (0-d tensors) such as ``weight_entropy``.
        candidates: ``(B, G)`` bool, the rows that are candidates of the listwise softmax
            (its distinct completions), or ``None`` (every row).
    """

    advantages: Tensor | None = None
    weights: Tensor | None = None
    stats: dict[str, Tensor] = field(default_factory=dict)
    candidates: Tensor | None = None


@dataclass
class MicroBatch:
    """One micro-batch of whole prompt groups, as the objective's loss sees it.

    Attributes:
        token_logps: ``(n, T)`` policy log-probs at the sampling temperature, with grad.
        old_token_logps: ``(n, T)`` behaviour log-probs (detached); ``None`` when
            ``num_iterations == 1`` (the ratio is then exactly 1).
        ref_token_logps: ``(n, T)`` reference log-probs, or ``None`` when not needed.
        mask: ``(n, T)`` bool completion mask.
        entropy: ``(n, T)`` exact token entropy with grad, or ``None``.
        advantages: ``(n,)`` slice of :attr:`Targets.advantages`, or ``None``.
        weights: ``(n // G, G)`` slice of :attr:`Targets.weights`, or ``None``.
        group_size: ``G``.
        num_rows: ``N``, rows in the whole optimizer-step batch (this rank).
        num_micro_batches: how many micro-batches make up the optimizer step.
        max_completion_length: ``T_max``.
        num_global_tokens: completion tokens of the whole step, all ranks (``dapo``).
        candidates: ``(n // G, G)`` slice of :attr:`Targets.candidates`, or ``None``.
    """

    token_logps: Tensor
    old_token_logps: Tensor | None
    ref_token_logps: Tensor | None
    mask: Tensor
    entropy: Tensor | None
    advantages: Tensor | None
    weights: Tensor | None
    group_size: int
    num_rows: int
    num_micro_batches: int
    max_completion_length: int
    num_global_tokens: Tensor | float | None = None
    candidates: Tensor | None = None

    @property
    def num_groups(self) -> int:
        return self.mask.shape[0] // self.group_size


@dataclass
class LossOutput:
    """The loss of one micro-batch plus additive statistics for the step's metrics.

    ``sums`` holds ``(value_sum, count)`` pairs so that means are exact over
    micro-batches and ranks (token-weighted for token statistics).
    """

    loss: Tensor
    sums: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)


def _token_sum(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(sum over the mask, number of masked tokens)``, both detached float32."""
    m = mask.to(values.dtype)
    return (values.detach() * m).sum().float(), m.sum().float()


def sequence_ref_loglik(ref_token_logps: Tensor, mask: Tensor, group_size: int) -> Tensor:
    """``rho_i = sum_t m * l_ref / max(T_i, 1)`` reshaped to ``(B, G)`` (ALGORITHM §0)."""
    m = mask.to(ref_token_logps.dtype)
    rho = (ref_token_logps * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    return rho.view(-1, group_size)


def weight_stats(weights: Tensor) -> dict[str, Tensor]:
    """Mean, min and max over groups of the weight entropy ``H(w)`` of ``(B, G)`` weights."""
    h = weight_entropy(weights)  # (B,)
    return {"weight_entropy": h.mean(), "weight_entropy_min": h.min(),
            "weight_entropy_max": h.max()}


class Objective:
    """Base class. Subclasses set hyper-parameters in ``__init__`` and validate them."""

    #: Whether the loss needs exact token entropy with gradient.
    needs_entropy: bool = False

    @property
    def needs_reference(self) -> bool:
        """Whether reference log-probs must be computed (and the reference loaded)."""
        return False

    @property
    def needs_candidates(self) -> bool:
        """Whether :meth:`prepare` wants ``candidates``, the first occurrence of each distinct
        completion of a group (:func:`maxent_grpo.core.distinct_candidates`)."""
        return False

    def prepare(
        self,
        rewards: Tensor,
        lengths: Tensor,
        max_completion_length: int,
        ref_seq_logps: Tensor | None,
        candidates: Tensor | None = None,
    ) -> Targets:
        raise NotImplementedError

    def loss(self, mb: MicroBatch) -> LossOutput:
        raise NotImplementedError

    #: attributes that the adaptive controllers may move (``tau``, ``beta``)
    tunable: tuple[str, ...] = ()
    #: attributes that change during training and travel in the checkpoint: the tunable
    #: ones plus internal state such as the entropy gate's multiplier
    mutable: tuple[str, ...] = ()

    def state(self) -> dict[str, float]:
        """Scalars logged every step (``train/tau``, ``train/beta``, ...)."""
        return {}

    def state_dict(self) -> dict[str, float]:
        """The :attr:`mutable` attributes: the one record of tau / beta in a checkpoint."""
        return {name: float(getattr(self, name)) for name in self.mutable}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore :meth:`state_dict`; a key this objective does not have raises ValueError."""
        unknown = sorted(set(state) - set(self.mutable))
        if unknown:
            raise ValueError(
                f"{type(self).__name__} has no mutable state {unknown}; it keeps {list(self.mutable)}"
            )
        for name, value in state.items():
            setattr(self, name, float(value))

    def observe(self, stats: dict[str, float]) -> None:
        """Called once per training step, after its optimizer step(s), with the step's logged
        scalars (reduced over micro-batches and ranks, keys without ``train/``)."""

    def loss_scale(self, world_size: int, rows: int, rows_all_ranks: int) -> float:
        """Factor on this rank's loss so that the ranks' mean gradient (DDP averages) is the
        gradient of the formula over the whole batch of all ranks.

        The default suits losses normalised by this rank's rows or groups: when ranks keep
        different numbers of rows (``drop_constant_groups``) the factor
        ``W * rows / rows_all_ranks`` turns that normaliser into the all-rank count (it is
        1 when every rank keeps the same number).
        """
        if rows_all_ranks == 0:
            return 1.0
        return world_size * rows / rows_all_ranks


def _check_beta(beta: float, name: str = "beta") -> None:
    if not (beta >= 0 and math.isfinite(beta)):
        raise ValueError(f"objective.{name} must be a finite number >= 0; got {beta}")


def _check_clip(epsilon: float, epsilon_high: float | None) -> None:
    if not (0 <= epsilon < 1):
        raise ValueError(f"objective.epsilon must be in [0, 1); got {epsilon}")
    if epsilon_high is not None and not (epsilon_high >= 0 and math.isfinite(epsilon_high)):
        raise ValueError(
            f"objective.epsilon_high must be a finite number >= 0 (or null); got {epsilon_high}"
        )


class GRPO(Objective):
    """GRPO with the Dr.GRPO / DAPO variants (ALGORITHM §4.1).

    ``L[i,t] = -min(c*A, clip(c, 1-eps_low, 1+eps_high)*A) + beta*KL[i,t]`` reduced by
    ``loss_type``; ``A`` from :func:`maxent_grpo.core.group_advantages` with
    ``scale_rewards``. Dr.GRPO is ``loss_type="dr_grpo", scale_rewards="none"``; DAPO is
    ``loss_type="dapo"`` with ``epsilon_high`` above ``epsilon``.

    Args:
        loss_type: token reduction: ``grpo``, ``bnpo``, ``dr_grpo`` or ``dapo``.
        scale_rewards: advantage scaling: ``group``, ``batch`` or ``none``.
        epsilon: lower clip range ``eps_low``.
        epsilon_high: upper clip range; ``None`` means ``epsilon``.
        beta: KL coefficient; 0 means the reference model is neither loaded nor run.
        kl_estimator: per-token KL estimator ``k1``, ``k2`` or ``k3``.
    """

    def __init__(
        self,
        loss_type: LossType = "grpo",
        scale_rewards: ScaleRewards = "group",
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        beta: float = 0.0,
        kl_estimator: KLEstimator = "k3",
    ) -> None:
        if loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo"):
            raise ValueError(
                "objective.loss_type must be one of 'grpo', 'bnpo', 'dr_grpo', 'dapo'; "
                f"got {loss_type!r}"
            )
        if scale_rewards not in ("group", "batch", "none"):
            raise ValueError(
                "objective.scale_rewards must be one of 'group', 'batch', 'none'; "
                f"got {scale_rewards!r}"
            )
        _check_clip(epsilon, epsilon_high)
        if kl_estimator not in ("k1", "k2", "k3"):
            raise ValueError(
                f"objective.kl_estimator must be one of 'k1', 'k2', 'k3'; got {kl_estimator!r}"
            )
        _check_beta(beta)
        self.loss_type = loss_type
        self.scale_rewards = scale_rewards
        self.epsilon = epsilon
        self.epsilon_high = epsilon if epsilon_high is None else epsilon_high
        self.beta = float(beta)
        self.kl_estimator = kl_estimator

    tunable = ("beta",)
    mutable = ("beta",)

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0

    def loss_scale(self, world_size: int, rows: int, rows_all_ranks: int) -> float:
        """``dapo`` divides by the all-rank token count, so it is multiplied back by the
        world size W; ``bnpo`` is a mean of micro-batch means by definition (factor 1)."""
        if self.loss_type == "dapo":
            return float(world_size)
        if self.loss_type == "bnpo":
            return 1.0
        return super().loss_scale(world_size, rows, rows_all_ranks)

    def prepare(
        self, rewards, lengths, max_completion_length, ref_seq_logps, candidates=None
    ) -> Targets:
        adv = group_advantages(rewards, scale=self.scale_rewards)  # (B, G)
        return Targets(advantages=adv.reshape(-1))

    def state(self) -> dict[str, float]:
        return {"beta": self.beta}

    # --- pieces shared with the subclasses -------------------------------------------
    def _surrogate(self, mb: MicroBatch, advantages: Tensor) -> tuple[Tensor, dict]:
        """Per-token ``-surr`` (n, T) and clip statistics."""
        old = mb.old_token_logps if mb.old_token_logps is not None else mb.token_logps.detach()
        ratio = importance_ratio(mb.token_logps, old)  # (n, T)
        surr = clipped_surrogate(ratio, advantages, self.epsilon, self.epsilon_high)
        low, high, total = clip_fractions(
            ratio.detach(), advantages, mb.mask, self.epsilon, self.epsilon_high
        )
        n_tok = mb.mask.sum().float()
        sums = {
            "clip/low": (low * n_tok, n_tok),
            "clip/high": (high * n_tok, n_tok),
            "clip/total": (total * n_tok, n_tok),
        }
        return -surr, sums

    def _kl(self, mb: MicroBatch) -> Tensor | None:
        if mb.ref_token_logps is None:
            return None
        return kl_penalty(mb.token_logps, mb.ref_token_logps, self.kl_estimator)

    def _reduce(self, per_token: Tensor, mb: MicroBatch) -> Tensor:
        loss = reduce_token_loss(
            per_token,
            mb.mask,
            self.loss_type,
            max_completion_length=mb.max_completion_length,
            num_global_tokens=mb.num_global_tokens if self.loss_type == "dapo" else None,
            num_rows=mb.num_rows,
        )
        if self.loss_type == "bnpo":  # a mean of micro-batch token means
            loss = loss / mb.num_micro_batches
        return loss

    def loss(self, mb: MicroBatch) -> LossOutput:
        assert mb.advantages is not None
        per_token, sums = self._surrogate(mb, mb.advantages)
        sums["loss/policy"] = _token_sum(per_token, mb.mask)
        kl = self._kl(mb)
        if kl is not None:
            sums["kl"] = _token_sum(kl, mb.mask)
            if self.beta > 0:
                per_token = per_token + self.beta * kl
        return LossOutput(self._reduce(per_token, mb), sums)


class EntropyMaxEnt(GRPO):
    """Entropy-regularised GRPO, "token MaxEnt" (ALGORITHM §4.2).

    ``L[i,t] = -surr + beta*KL - alpha_eff*H[i,t]`` with the exact, differentiable token
    entropy at the sampling temperature. With ``kl_gate_threshold`` set, ``alpha_eff =
    alpha * m(KL)`` where ``m`` is :func:`maxent_grpo.core.entropy_gate_multiplier`. The
    KL that drives the gate is the token-mean KL measured over the *previous* optimizer
    step (the current step's KL is only known after its backward pass); the first step
    uses no gate (multiplier 1). Gating needs KL, so it loads the reference model.

    Args:
        alpha: entropy bonus coefficient (>= 0).
        kl_gate_threshold: ``kappa``; ``None`` disables gating.
        kl_gate_gain: gain ``g`` of the gate.
        kl_gate_min_multiplier: lower bound ``m_lo`` of the multiplier.
        kl_gate_max_multiplier: upper bound ``m_hi`` of the multiplier.
        disable_outside_trust_zone: switch the bonus off while KL is above ``kappa``.
        (other arguments as :class:`GRPO`)
    """

    needs_entropy = True

    def __init__(
        self,
        alpha: float = 0.01,
        kl_gate_threshold: float | None = None,
        kl_gate_gain: float = 1.0,
        kl_gate_min_multiplier: float = 0.0,
        kl_gate_max_multiplier: float = 2.0,
        disable_outside_trust_zone: bool = False,
        loss_type: LossType = "grpo",
        scale_rewards: ScaleRewards = "group",
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        beta: float = 0.0,
        kl_estimator: KLEstimator = "k3",
    ) -> None:
        super().__init__(loss_type, scale_rewards, epsilon, epsilon_high, beta, kl_estimator)
        _check_beta(alpha, "alpha")
        if kl_gate_threshold is not None:
            if not (kl_gate_threshold > 0 and math.isfinite(kl_gate_threshold)):
                raise ValueError(
                    "objective.kl_gate_threshold must be a finite number > 0 (or null to "
                    f"disable gating); got {kl_gate_threshold}"
                )
            _check_beta(kl_gate_gain, "kl_gate_gain")
            _check_beta(kl_gate_min_multiplier, "kl_gate_min_multiplier")
            _check_beta(kl_gate_max_multiplier, "kl_gate_max_multiplier")
            if kl_gate_min_multiplier > kl_gate_max_multiplier:
                raise ValueError(
                    "objective.kl_gate_min_multiplier must be <= "
                    f"objective.kl_gate_max_multiplier; got {kl_gate_min_multiplier} > "
                    f"{kl_gate_max_multiplier}"
                )
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

    mutable = ("beta", "alpha_multiplier")

    def observe(self, stats: dict[str, float]) -> None:
        """Update the gate from the step's measured token-mean KL (``stats["kl"]``); an
        unmeasured KL (every micro-batch non-finite) counts as non-finite, i.e. "above"."""
        if self.kl_gate_threshold is None:
            return
        kl = stats.get("kl", float("nan"))
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
        out.sums["entropy"] = _token_sum(mb.entropy, mb.mask)
        if self.alpha_effective > 0:
            out.loss = out.loss - self.alpha_effective * self._reduce(mb.entropy, mb)
        return out


class ListwiseMaxEnt(Objective):
    """Listwise MaxEnt-GRPO (ALGORITHM §4.3).

    Per group: ``q = softmax(r / q_temperature)`` floored by ``q_epsilon``;
    ``w = softmax((log q + beta*rho) / (tau + beta))``; loss = mean over groups of
    ``-sum_i w_i log softmax_G(s)_i`` with ``s_i`` the sequence log-prob (divided by the
    length ``T_i`` when ``length_normalize``). Optional sequence-level clip term with
    coefficient ``clip_coef``.

    Args:
        tau: entropy temperature of the weights; ``tau + beta`` must be > 0.
        beta: trust-region weight towards the reference (loads it when > 0).
        q_temperature: temperature ``T_q`` of the reward target.
        q_epsilon: floor ``eps`` of the reward target.
        length_normalize: use ``s_i / T_i`` instead of ``s_i``.
        distinct_candidates: the candidates of a group are its *distinct* completions: a
            completion sampled m times is one candidate (its first row; the others get no
            weight and leave the softmax), so ``softmax_G(s)`` is the policy restricted to
            the candidate set and a frequent answer does not get m times the target of a
            rare one that is as good.
        clip_coef: coefficient of the sequence-level clip term (0 = off; not with
            ``distinct_candidates``).
        epsilon: lower clip range of that term.
        epsilon_high: upper clip range; ``None`` means ``epsilon``.
    """

    def __init__(
        self,
        tau: float = 0.5,
        beta: float = 0.0,
        q_temperature: float = 1.0,
        q_epsilon: float = 1e-6,
        length_normalize: bool = False,
        distinct_candidates: bool = False,
        clip_coef: float = 0.0,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
    ) -> None:
        _check_beta(beta)
        if not (tau >= 0 and math.isfinite(tau)):
            raise ValueError(f"objective.tau must be a finite number >= 0; got {tau}")
        if tau + beta <= 0:
            raise ValueError(
                "objective.tau must be > 0 when objective.beta = 0 (the weights need "
                f"tau + beta > 0); got tau={tau}, beta={beta}"
            )
        if not (q_temperature > 0 and math.isfinite(q_temperature)):
            raise ValueError(f"objective.q_temperature must be > 0 and finite; got {q_temperature}")
        if not (q_epsilon > 0 and math.isfinite(q_epsilon)):
            raise ValueError(f"objective.q_epsilon must be > 0 and finite; got {q_epsilon}")
        if not (clip_coef >= 0 and math.isfinite(clip_coef)):
            raise ValueError(f"objective.clip_coef must be >= 0 and finite; got {clip_coef}")
        _check_clip(epsilon, epsilon_high)
        if not isinstance(distinct_candidates, bool):
            raise ValueError(
                f"objective.distinct_candidates must be true or false; got {distinct_candidates!r}"
            )
        if distinct_candidates and clip_coef > 0:
            raise ValueError(
                "objective.clip_coef must be 0 with objective.distinct_candidates: the "
                "sequence-level clip term is defined over all G rows"
            )
        self.tau = float(tau)
        self.beta = float(beta)
        self.distinct_candidates = distinct_candidates
        self.q_temperature = q_temperature
        self.q_epsilon = q_epsilon
        self.length_normalize = length_normalize
        self.clip_coef = clip_coef
        self.epsilon = epsilon
        self.epsilon_high = epsilon if epsilon_high is None else epsilon_high

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0

    tunable = ("tau", "beta")
    mutable = ("tau", "beta")

    @property
    def needs_candidates(self) -> bool:
        return self.distinct_candidates

    def state(self) -> dict[str, float]:
        return {"tau": self.tau, "beta": self.beta}

    def prepare(
        self, rewards, lengths, max_completion_length, ref_seq_logps, candidates=None
    ) -> Targets:
        q = q_distribution(rewards, self.q_temperature, self.q_epsilon, candidates)  # (B, G)
        ref = ref_seq_logps if self.beta > 0 else None
        w = maxent_weights(q.log(), self.tau, self.beta, ref, candidates)  # rows sum to 1
        return Targets(weights=w, stats=weight_stats(w), candidates=candidates)

    def _seq_logps(self, token_logps: Tensor, mask: Tensor, group_size: int) -> Tensor:
        m = mask.to(token_logps.dtype)
        s = (token_logps * m).sum(-1)  # (n,)
        if self.length_normalize:
            s = s / m.sum(-1).clamp(min=1.0)
        return s.view(-1, group_size)  # (n // G, G)

    def loss(self, mb: MicroBatch) -> LossOutput:
        assert mb.weights is not None
        G = mb.group_size
        total_groups = mb.num_rows // G
        scale = mb.num_groups / total_groups  # sum over micro-batches = mean over groups
        s = self._seq_logps(mb.token_logps, mb.mask, G)  # (b, G)
        loss = listwise_loss(s, mb.weights, mb.candidates) * scale
        sums: dict[str, tuple[Tensor, Tensor]] = {}
        groups = torch.tensor(float(mb.num_groups))
        sums["loss/policy"] = (loss.detach() / scale * groups, groups)
        if self.clip_coef > 0:
            old_tok = (
                mb.old_token_logps if mb.old_token_logps is not None else mb.token_logps.detach()
            )
            s_old = self._seq_logps(old_tok, mb.mask, G)
            clip = sequence_clip_loss(s, s_old, mb.weights, self.epsilon, self.epsilon_high)
            loss = loss + self.clip_coef * clip * scale
            sums["loss/clip"] = (clip.detach() * groups, groups)
        if mb.ref_token_logps is not None:
            sums["kl"] = _token_sum(kl_penalty(mb.token_logps, mb.ref_token_logps), mb.mask)
        return LossOutput(loss, sums)


class GroupMaxEnt(GRPO):
    """Group-level MaxEnt weights on Dr.GRPO, "xDr.GRPO" (ALGORITHM §4.4).

    ``A_i = r_i - mean_group(r)``, ``U_i = A_i*T_i/T_max``,
    ``w = softmax((U + lam*rho)/(tau + lam))`` (constants); the loss is the Dr.GRPO token
    loss with row ``i`` scaled by ``G*w_i``:
    ``sum_i G*w_i sum_t m*(-surr) / (N*T_max)``. ``tau = lam = 0`` puts uniform weight
    on the argmax set; ``tau -> inf`` recovers Dr.GRPO.

    Args:
        tau: temperature of the group weights (>= 0).
        lam: weight of the reference log-likelihood (>= 0; loads the reference when > 0).
        epsilon: lower clip range.
        epsilon_high: upper clip range; ``None`` means ``epsilon``.
    """

    def __init__(
        self,
        tau: float = 1.0,
        lam: float = 0.0,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
    ) -> None:
        super().__init__("dr_grpo", "none", epsilon, epsilon_high, 0.0, "k3")
        if not (tau >= 0 and math.isfinite(tau)):
            raise ValueError(f"objective.tau must be a finite number >= 0; got {tau}")
        _check_beta(lam, "lam")
        self.tau = float(tau)
        self.lam = float(lam)

    @property
    def needs_reference(self) -> bool:
        return self.lam > 0

    tunable = ("tau",)
    mutable = ("tau",)

    def state(self) -> dict[str, float]:
        return {"tau": self.tau, "lam": self.lam}

    def prepare(
        self, rewards, lengths, max_completion_length, ref_seq_logps, candidates=None
    ) -> Targets:
        adv = group_advantages(rewards, scale="none")  # (B, G)
        utility = group_utility(rewards, lengths, max_completion_length)  # (B, G)
        ref = ref_seq_logps if self.lam > 0 else None
        w = group_weights(utility, self.tau, self.lam, ref)  # (B, G)
        return Targets(advantages=adv.reshape(-1), weights=w, stats=weight_stats(w))

    def loss(self, mb: MicroBatch) -> LossOutput:
        assert mb.advantages is not None and mb.weights is not None
        per_token, sums = self._surrogate(mb, mb.advantages)  # (n, T)
        row_scale = (mb.group_size * mb.weights).reshape(-1, 1)  # (n, 1)
        sums["loss/policy"] = _token_sum(per_token, mb.mask)
        if mb.ref_token_logps is not None:
            sums["kl"] = _token_sum(kl_penalty(mb.token_logps, mb.ref_token_logps), mb.mask)
        return LossOutput(self._reduce(per_token * row_scale, mb), sums)

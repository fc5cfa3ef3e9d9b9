"""The interface between the trainer and an objective, and the parts objectives share.

:class:`GroupInputs` is what :meth:`Objective.prepare` reads of one rollout, :class:`Targets`
what it derives from it, :class:`MicroBatch` what :meth:`Objective.loss` sees,
:class:`LossOutput` what it returns (``docs/ALGORITHM.md`` §0-4). The trainer and the
controllers need nothing from an objective beyond the members of :class:`Objective`. The
objective is the one owner of tau and beta: controllers read and write them there, and a
checkpoint keeps them only in the module's entry (:meth:`Objective.state_dict`). The
clipped surrogate that GRPO, EntropyMaxEnt and GroupMaxEnt share
(:func:`clipped_token_loss`, :func:`reduce_tokens`) closes the module.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field, fields
from typing import Literal, get_args

import numpy as np
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
    weight_entropy,
)
from maxent_grpo.validation import UserCodeError, check_choice, check_number, is_number, require


@dataclass
class GroupInputs:
    """Everything an objective's :meth:`Objective.prepare` may read of one rollout: one row
    per prompt group, one column per sample, ``(B, G)``. The trainer builds it once per step
    and gathers it across ranks in one place, so ``B`` is the kept groups of every rank and
    every objective sees exactly what one process given all the prompts would.

    Attributes:
        rewards: ``(B, G)`` float rewards (the weighted sum of ``model.rewards``).
        lengths: ``(B, G)`` completion lengths ``T_i`` in tokens.
        max_completion_length: ``T_max``.
        ref_seq_logps: ``(B, G)`` ``rho``, the reference's mean token log-prob of each
            sample, or ``None`` when no reference is loaded (:attr:`Objective.needs_reference`).
        candidates: ``(B, G)`` bool, the first occurrence of each distinct completion of a
            group (:func:`maxent_grpo.core.distinct_candidates`), or ``None`` (every row).
        answers: ``(B, G)`` answer classes (:func:`maxent_grpo.core.answer_classes`; answers
            canonical under the rows' ``answer_form``, a sample without an answer its own
            completion's class), or ``None``.
        seq_logps: ``(B, G)`` mean token log-prob of each sample under the behaviour policy
            (no gradient), or ``None`` unless :attr:`Objective.needs_sequence_logps` (it
            costs a forward pass of the policy).
    """

    rewards: Tensor
    lengths: Tensor
    max_completion_length: int
    ref_seq_logps: Tensor | None = None
    candidates: Tensor | None = None
    answers: Tensor | None = None
    seq_logps: Tensor | None = None

    def tensors(self) -> dict[str, Tensor]:
        """The ``(B, G)`` fields that are set, by name (what travels between ranks)."""
        return {f.name: v for f in fields(self) if isinstance(v := getattr(self, f.name), Tensor)}


@dataclass
class Targets:
    """What an objective derives from one rollout before any gradient is taken.

    Attributes:
        advantages: ``(B*G,)`` per-row advantages, or ``None`` (listwise).
        weights: ``(B, G)`` per-group weights summing to 1, or ``None`` (GRPO).
        stats: scalar diagnostics (0-d tensors) such as ``weight_entropy``.
        candidates: ``(B, G)`` bool, the rows that are candidates of the listwise softmax
            (its distinct completions), or ``None`` (every row).
        q: ``(B, G)`` the reward target distribution ``q`` (rows sum to 1 over the
            candidates; :func:`maxent_grpo.core.q_distribution`) that ListwiseMaxEnt's
            weights were built from, or ``None`` (the other objectives).
        answers: ``(B, G)`` answer classes (:func:`maxent_grpo.core.answer_classes`) for
            a loss over distinct answers, or ``None``.
    """

    advantages: Tensor | None = None
    weights: Tensor | None = None
    stats: dict[str, Tensor] = field(default_factory=dict)
    candidates: Tensor | None = None
    q: Tensor | None = None
    answers: Tensor | None = None

    def check(self, objective: str, groups: int, group_size: int) -> None:
        """UserCodeError naming ``objective``'s ``prepare`` where a field is not a tensor of
        its shape for ``groups`` groups of ``group_size`` (a subclass's mistake, which was an
        index error deep in the step)."""
        rows = (groups, group_size)
        for name, shape in (("advantages", (groups * group_size,)), ("weights", rows),
                            ("candidates", rows), ("q", rows), ("answers", rows)):
            got = getattr(self, name)
            if got is not None and (not isinstance(got, Tensor) or tuple(got.shape) != shape):
                raise UserCodeError(
                    f"{objective}.prepare: Targets.{name} must be a {shape} tensor ({groups} "
                    f"groups x G={group_size}); got "
                    f"{tuple(got.shape) if isinstance(got, Tensor) else type(got).__name__}")

    def of_groups(self, groups: Tensor | slice, group_size: int) -> Targets:
        """The targets of these groups only (indices or a slice of the ``B`` groups): the
        one selection used for a rank's share of the batch and for a micro-batch."""

        def pick(values: Tensor | None) -> Tensor | None:
            return None if values is None else values[groups]

        adv = self.advantages
        return Targets(
            advantages=None if adv is None else adv.view(-1, group_size)[groups].reshape(-1),
            weights=pick(self.weights), stats=self.stats, candidates=pick(self.candidates),
            q=pick(self.q), answers=pick(self.answers),
        )

    def neutral(self, group_size: int, like: Tensor) -> Targets:
        """Targets for one group whose loss counts for nothing (a rank's ghost group, scored
        at weight 0 so that every rank makes the same backward passes), whatever the
        objective: zero advantages, uniform weights, every row a candidate, no ``q`` and,
        where these targets have answer classes, every answer its own; the step's ``stats``
        kept. Values take ``like``'s dtype and device (the rewards')."""
        G, device = group_size, like.device
        return Targets(
            advantages=like.new_zeros(G), weights=like.new_full((1, G), 1.0 / G),
            stats=self.stats,
            candidates=torch.ones(1, G, dtype=torch.bool, device=device),
            answers=None if self.answers is None else torch.arange(G, device=device)[None])


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
        correction: ``(n, T)`` detached importance weights for the sampler / trainer gap
            (``model.sampler_correction``), or ``None``; the clipped surrogate multiplies
            its per-token loss by them.
        answers: ``(n // G, G)`` slice of :attr:`Targets.answers`, or ``None``.
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
    correction: Tensor | None = None
    answers: Tensor | None = None

    @property
    def num_groups(self) -> int:
        return self.mask.shape[0] // self.group_size

    @property
    def behaviour_logps(self) -> Tensor:
        """:attr:`old_token_logps`, or the detached :attr:`token_logps` when it is None."""
        return self.token_logps.detach() if self.old_token_logps is None else self.old_token_logps


@dataclass
class LossOutput:
    """The loss of one micro-batch plus additive statistics for the step's metrics.

    ``sums`` holds ``(value_sum, count)`` pairs so that means are exact over micro-batches
    and ranks (token-weighted for token statistics)."""

    loss: Tensor
    sums: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)


def token_sum(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(sum over the mask, number of masked tokens)``, detached, float32 (float64 for
    float64 values): one token-weighted entry of :attr:`LossOutput.sums`."""
    m, dtype = mask.to(values.dtype), torch.promote_types(values.dtype, torch.float32)
    return values.detach().where(m.bool(), 0).sum().to(dtype), m.sum().to(dtype)  # where: inf*0


def sequence_ref_loglik(ref_token_logps: Tensor, mask: Tensor, group_size: int) -> Tensor:
    """``rho_i = sum_t m * l_ref / max(T_i, 1)`` reshaped to ``(B, G)`` (docs/ALGORITHM.md §0)."""
    m = mask.to(ref_token_logps.dtype)
    rho = ref_token_logps.where(m.bool(), 0).sum(-1) / m.sum(-1).clamp(min=1.0)
    return rho.view(-1, group_size)


def weight_stats(weights: Tensor) -> dict[str, Tensor]:
    """Mean, min and max over groups of the weight entropy ``H(w)`` of ``(B, G)`` weights."""
    h = weight_entropy(weights)  # (B,)
    return {"weight_entropy": h.mean(), "weight_entropy_min": h.min(),
            "weight_entropy_max": h.max()}


class Objective:
    """Base class. Subclasses set hyper-parameters in ``__init__`` and validate them with
    :mod:`maxent_grpo.validation` (messages name ``objective.<option>``)."""

    #: Whether the loss needs exact token entropy with gradient.
    needs_entropy: bool = False
    #: Whether the loss applies ``MicroBatch.correction`` (``model.sampler_correction``)
    supports_sampler_correction: bool = False
    #: attributes that the adaptive controllers may move (``tau``, ``beta``)
    tunable: tuple[str, ...] = ()
    #: attributes that change during training and travel in the checkpoint (the tunable
    #: ones plus internal state such as the entropy gate's multiplier)
    mutable: tuple[str, ...] = ()

    @property
    def needs_reference(self) -> bool:
        """Whether reference log-probs must be computed (and the reference loaded)."""
        return False

    @property
    def needs_sequence_logps(self) -> bool:
        """Whether :attr:`GroupInputs.seq_logps` must be computed: the samples' mean token
        log-probs under the behaviour policy, which cost a forward pass when the rollout is
        used once (``num_iterations == 1``). The cheap inputs are always there."""
        return False

    def check_group_size(self, group_size: int) -> None:
        """Refuse options that cannot work with ``G = group_size`` completions per prompt
        (ValueError naming the option); the module calls it when it is built, before any
        model loads."""

    def prepare(self, inputs: GroupInputs) -> Targets:
        """The rollout's :class:`Targets` from its :class:`GroupInputs`."""
        raise NotImplementedError

    def loss(self, mb: MicroBatch) -> LossOutput:
        """The loss of one micro-batch; the micro-batches of a step sum to the batch loss."""
        raise NotImplementedError

    def state(self) -> dict[str, float]:
        """Scalars logged every step (``train/tau``, ``train/beta``, ...)."""
        return {}

    def kl_weight(self) -> float:
        """The KL term's weight (``train/loss/weighted_kl``): :meth:`state`'s beta, else 0."""
        return float(self.state().get("beta", 0.0))

    def state_dict(self) -> dict[str, float]:
        """The :attr:`mutable` attributes: the one record of tau / beta in a checkpoint.
        Each is a number and keeps its kind (a bool, an int, else a float; a one-element
        tensor's value); anything else is a UserCodeError naming it (an int came back a
        float, a list index no more; a tensor failed the first save)."""
        state = {}
        for name in self.mutable:
            value = getattr(self, name, None)
            value = value.item() if isinstance(value, Tensor) and value.numel() == 1 else value
            if not isinstance(value, (numbers.Real, np.bool_)):
                raise UserCodeError(f"{type(self).__name__}.mutable: {name!r} must be a number "
                                    "(a bool, an int or a float: it travels in the checkpoint)"
                                    f"; got {type(value).__name__}")
            kind = bool if isinstance(value, (bool, np.bool_)) else (
                int if isinstance(value, numbers.Integral) else float)
            state[name] = kind(value)
        return state

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore :meth:`state_dict`; a key this objective does not have raises ValueError."""
        unknown = sorted(set(state) - set(self.mutable))
        if unknown:
            raise ValueError(
                f"{type(self).__name__} has no mutable state {unknown}; it keeps "
                f"{list(self.mutable)}"
            )
        for name, value in state.items():
            current = getattr(self, name, None)
            if isinstance(current, Tensor) and current.numel() == 1:
                current.fill_(value)  # a one-element tensor stays one
                continue
            if isinstance(value, float) and type(current) in (bool, int) and (value in (
                    0.0, 1.0) or type(current) is int and value.is_integer()):
                value = type(current)(value)  # an older checkpoint's float, without loss
            setattr(self, name, value)

    def observe(self, stats: dict[str, float]) -> None:
        """Called once per training step that trained, after its optimizer step(s), with the
        step's logged dict (``train/...`` names, reduced over micro-batches and ranks); not
        after a step whose every group was dropped, nor the first ``model.max_staleness``
        steps, which only start rollouts."""

    def loss_scale(self, world_size: int, rows: int, rows_all_ranks: int) -> float:
        """Factor on this rank's loss so that the ranks' mean gradient (DDP averages) is the
        gradient of the formula over the whole batch of all ranks.

        The default, ``W * rows / rows_all_ranks``, suits losses normalised by this rank's
        rows or groups when ranks keep different numbers of rows (``drop_constant_groups``).
        """
        if rows_all_ranks == 0:
            return 1.0
        return world_size * rows / rows_all_ranks


# ---------------------------------------------------------------- the clipped surrogate
# A component, not a base class (docs/ALGORITHM.md §2-3, §4.5): an objective that uses it
# keeps its own checked options (clip_range, surrogate_parts), so it inherits none it lacks.

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
RatioLevel = Literal["token", "sequence", "sequence_token"]
ClipRule = Literal["ppo", "cispo", "clip_cov", "kl_cov"]


def check_objective(objective: object) -> None:
    """Refuse what cannot train, before any model loads: not an :class:`Objective`, one
    without :meth:`Objective.prepare` and :meth:`Objective.loss` (the base class), or one
    whose ``tunable`` attribute is not in ``mutable`` (a resume lost a controller's value)."""
    require(isinstance(objective, Objective),
            "model.objective must be an Objective (class_path maxent_grpo.objectives.GRPO, "
            f"...); got {type(objective).__name__}")
    objective.state_dict()  # its mutable state: numbers, or named now, not at the first save
    missing = [name for name in ("prepare", "loss")
               if getattr(type(objective), name) is getattr(Objective, name)]
    require(not missing,
            f"model.objective: {type(objective).__name__} does not define "
            f"{' or '.join(missing)}; name an objective that trains "
            "(maxent_grpo.objectives.GRPO, EntropyMaxEnt, ListwiseMaxEnt, GroupMaxEnt, ...) "
            "or define them in your subclass")
    lost = [name for name in objective.tunable if name not in objective.mutable]
    require(not lost, f"model.objective: {type(objective).__name__}.tunable {lost} is not in "
            "its mutable: add it there, or a resume loses what a controller moved")


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


def clipped_token_loss(mb: MicroBatch, advantages: Tensor, epsilon: float, epsilon_high: float,
                       ratio_level: str, clip_rule: str, cov: CovSettings,
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
    old = mb.behaviour_logps
    ratio = importance_ratio_at(mb.token_logps, old, mb.mask, ratio_level)  # (n, T)
    n_tok = mb.mask.sum().float()
    chosen = None
    if clip_rule == "cispo":
        surr = cispo_surrogate(ratio, mb.token_logps, advantages, epsilon_high)
        capped = (ratio.detach() > 1.0 + epsilon_high) & mb.mask
        high = capped.sum().float() / n_tok.clamp(min=1)
        low, total = torch.zeros_like(high), high
    elif clip_rule == "kl_cov":
        surr, chosen = kl_cov_surrogate(ratio, mb.token_logps, old, advantages, mb.mask,
                                        cov.fraction, cov.coef)
        low = high = total = torch.zeros((), device=n_tok.device)
    else:
        if clip_rule == "clip_cov":
            surr, chosen = clip_cov_surrogate(ratio, mb.token_logps, advantages, mb.mask,
                                              epsilon, epsilon_high, cov.fraction, cov.bounds)
        else:
            surr = clipped_surrogate(ratio, advantages, epsilon, epsilon_high)
        low, high, total = clip_fractions(ratio.detach(), advantages, mb.mask, epsilon,
                                          epsilon_high)
    sums = {f"clip/{name}": ((value * n_tok).round(), n_tok)  # a count: 7/13 * 13 is 7
            for name, value in (("low", low), ("high", high), ("total", total))}
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

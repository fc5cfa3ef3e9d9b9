"""The interface between the trainer and an objective, and the helpers objectives share.

:class:`GroupInputs` is what :meth:`Objective.prepare` reads of one rollout,
:class:`Targets` what it derives from it,
:class:`MicroBatch` what :meth:`Objective.loss` sees, :class:`LossOutput` what it returns
(``docs/ALGORITHM.md`` §0-4). The trainer and the controllers need nothing from an
objective beyond the members of :class:`Objective`. The objective is the one owner of tau
and beta: controllers read and write them there, and a checkpoint keeps them only in the
module's entry (:meth:`Objective.state_dict`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from torch import Tensor

from maxent_grpo.core import weight_entropy


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

    def with_tensors(self, tensors: dict[str, Tensor]) -> GroupInputs:
        """A copy with these fields replaced (the gathered or kept groups)."""
        return replace(self, **tensors)


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


@dataclass
class LossOutput:
    """The loss of one micro-batch plus additive statistics for the step's metrics.

    ``sums`` holds ``(value_sum, count)`` pairs so that means are exact over
    micro-batches and ranks (token-weighted for token statistics).
    """

    loss: Tensor
    sums: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)


def token_sum(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(sum over the mask, number of masked tokens)``, both detached float32: one
    token-weighted entry of :attr:`LossOutput.sums`."""
    m = mask.to(values.dtype)
    return (values.detach() * m).sum().float(), m.sum().float()


def sequence_ref_loglik(ref_token_logps: Tensor, mask: Tensor, group_size: int) -> Tensor:
    """``rho_i = sum_t m * l_ref / max(T_i, 1)`` reshaped to ``(B, G)`` (docs/ALGORITHM.md §0)."""
    m = mask.to(ref_token_logps.dtype)
    rho = (ref_token_logps * m).sum(-1) / m.sum(-1).clamp(min=1.0)
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

    def prepare(self, inputs: GroupInputs) -> Targets:
        """The rollout's :class:`Targets` from its :class:`GroupInputs`."""
        raise NotImplementedError

    def loss(self, mb: MicroBatch) -> LossOutput:
        """The loss of one micro-batch; the micro-batches of a step sum to the batch loss."""
        raise NotImplementedError

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
                f"{type(self).__name__} has no mutable state {unknown}; it keeps "
                f"{list(self.mutable)}"
            )
        for name, value in state.items():
            setattr(self, name, float(value))

    def observe(self, stats: dict[str, float]) -> None:
        """Called once per training step, after its optimizer step(s), with the step's logged
        scalars (reduced over micro-batches and ranks, keys without ``train/``)."""

    def loss_scale(self, world_size: int, rows: int, rows_all_ranks: int) -> float:
        """Factor on this rank's loss so that the ranks' mean gradient (DDP averages) is the
        gradient of the formula over the whole batch of all ranks.

        The default, ``W * rows / rows_all_ranks``, suits losses normalised by this rank's
        rows or groups when ranks keep different numbers of rows (``drop_constant_groups``).
        """
        if rows_all_ranks == 0:
            return 1.0
        return world_size * rows / rows_all_ranks

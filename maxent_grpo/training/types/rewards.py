"""Rollout, reward and scoring data: what rewards and sequence weights are computed from.

Shape vocabulary: B prompts, G completions per prompt, T completion tokens. Flattened
sequences are prompt-major: row ``b * G + g`` is completion ``g`` of prompt ``b``.

Flow on the training path::

    rollout engine ──► GenerationBatch ──flatten()──► PromptCompletionBatch ──► reward fns
    reward fns ──► RewardComponentStats (per function), RewardMoments (total reward)
    objective  ──► AdvantageStats, QDistribution
    scoring    ──► SequenceScores  (chunked according to BatchingSettings)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# defined with the rollout layer that produces them; documented (and re-exported) here
from maxent_grpo.rollout.batch import GenerationBatch, PromptCompletionBatch
from maxent_grpo.validation import check_int

__all__ = [
    "AdvantageStats",
    "BatchingSettings",
    "GenerationBatch",
    "PromptCompletionBatch",
    "QDistribution",
    "RewardComponentStats",
    "RewardMoments",
    "SequenceScores",
]


# --------------------------------------------------------------------- rewards and targets


def _check_std(std: float) -> None:
    if std < 0:  # NaN passes on purpose: an empty or single-sample batch has no spread
        raise ValueError(f"std must be >= 0 (NaN allowed); got {std}")


@dataclass
class RewardComponentStats:
    """Mean and standard deviation of one reward function over the batch's B*G completions.

    Produced by the reward metric for each registered reward function; consumed by logging
    (one ``reward/<name>/mean``, ``…/std`` pair per function). ``std`` must be >= 0; NaN is
    allowed (undefined spread).
    """

    mean: float
    std: float

    def __post_init__(self) -> None:
        _check_std(self.std)


@dataclass
class RewardMoments:
    """Mean and standard deviation of the total (weighted-sum) sequence reward.

    Computed by the ``RewardMoments`` torchmetric from the B*G total rewards; consumed by
    logging and by controllers that react to the reward's spread. ``std`` must be >= 0;
    NaN is allowed (undefined spread).
    """

    mean: float
    std: float

    def __post_init__(self) -> None:
        _check_std(self.std)


@dataclass
class AdvantageStats:
    """Advantages per group and flattened (prompt-major), as plain floats.

    Built from the objective's targets for display (the loss reads the tensors);
    consumed by :class:`~maxent_grpo.training.callbacks.CompletionSamples`.

    Attributes:
        grouped: B lists; ``grouped[b][g]`` is the advantage of completion g of prompt b.
    """

    grouped: list[list[float]]


@dataclass
class QDistribution:
    """The sequence-level target distribution q over each prompt's group.

    Produced by the listwise objective (``core.listwise``): per group,
    ``q = softmax_G(r / T_q)`` followed by the floor ``q <- q * (1 - G * eps') + eps'``;
    shown by :class:`~maxent_grpo.training.callbacks.CompletionSamples`. Each group of
    ``grouped`` is a probability vector (positive, sums to 1); this is documented, not
    re-checked.

    Attributes:
        grouped: B lists of G probabilities.
    """

    grouped: list[list[float]]


# ---------------------------------------------------------------------------------- scoring


@dataclass
class SequenceScores:
    """Log-probability scores of N scored completions under the current policy, with
    gradient, and the behaviour policy's per-token log-probs they are compared with.

    Produced by :meth:`~maxent_grpo.training.step.scoring.Scorer.policy_scores` (a
    teacher-forced forward pass over prompt + completion, one micro-batch of whole groups
    within :class:`BatchingSettings`); consumed by the objective's loss (the per-token
    tensors) and by logging (``logp/sequence`` from ``cur_logp_sum``). Rows are prompt-major.

    Attributes:
        cur_logp_sum: (N,) sum over completion tokens of log pi_theta(y_t | x, y_<t).
        token_logp: (N, T) per-token log-probs under the current policy.
        token_mask: (N, T) bool mask of real (non-padding) completion tokens.
        old_token_logp: (N, T) per-token log-probs under the behaviour policy (detached),
            or None when the behaviour policy is the current one (``num_iterations = 1``).
    """

    cur_logp_sum: torch.Tensor
    token_logp: torch.Tensor
    token_mask: torch.Tensor
    old_token_logp: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.cur_logp_sum, torch.Tensor) or self.cur_logp_sum.dim() != 1:
            raise ValueError(f"cur_logp_sum must be a (N,) tensor; got {self.cur_logp_sum!r}")
        n = self.cur_logp_sum.shape[0]
        for name in ("token_logp", "token_mask", "old_token_logp"):
            value = getattr(self, name)
            if value is None and name == "old_token_logp":
                continue
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor; got {type(value).__name__}")
            if value.dim() != 2 or value.shape[0] != n:
                raise ValueError(f"{name} must have shape ({n}, T); got {tuple(value.shape)}")
            if value.shape != self.token_logp.shape:
                raise ValueError(
                    f"{name} must have the same (N, T) shape as token_logp "
                    f"{tuple(self.token_logp.shape)}; got {tuple(value.shape)}"
                )

    @property
    def num_sequences(self) -> int:
        """N = B*G, the number of scored sequences."""
        return int(self.cur_logp_sum.shape[0])


@dataclass
class BatchingSettings:
    """How scoring is chunked; read by the scorer on every training step.

    The trainer scores micro-batches of whole prompt groups
    (:func:`maxent_grpo.training.step.batching.plan_micro_batches`), so the two sizes below bound
    one micro-batch; ``None`` means no bound (the whole batch in one forward pass).

    Attributes:
        logprob_chunk_size: at most this many sequences per forward pass when computing
            log-probs (>= 1; whole groups: ``G * model.micro_batch_groups``), or None.
        score_slice: at most this many padded tokens (rows x columns) per scored slice
            (>= 1; ``model.micro_batch_tokens``), or None.
    """

    logprob_chunk_size: int | None
    score_slice: int | None

    def __post_init__(self) -> None:
        check_int("logprob_chunk_size", self.logprob_chunk_size, minimum=1, allow_none=True)
        check_int("score_slice", self.score_slice, minimum=1, allow_none=True)

"""Rollout, reward and scoring data: what rewards and sequence weights are computed from.

Shape vocabulary: B prompts, G completions per prompt, T completion tokens. Flattened
sequences are prompt-major: row ``b * G + g`` is completion ``g`` of prompt ``b``.
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


def _check_std(std: float) -> None:
    if std < 0:  # NaN passes on purpose: an empty or single-sample batch has no spread
        raise ValueError(f"std must be >= 0 (NaN allowed); got {std}")


@dataclass
class RewardComponentStats:
    """Mean and standard deviation of one reward function over the batch's B*G completions
    (logged as ``reward/<name>/mean`` and ``…/std``).

    Attributes:
        mean: the mean of the function's values.
        std: their std, >= 0 or NaN (undefined spread).
    """

    mean: float
    std: float

    def __post_init__(self) -> None:
        _check_std(self.std)


@dataclass
class RewardMoments:
    """Mean and standard deviation of the B*G total (weighted-sum) sequence rewards.

    Attributes:
        mean: the mean total reward.
        std: its std, >= 0 or NaN (undefined spread).
    """

    mean: float
    std: float

    def __post_init__(self) -> None:
        _check_std(self.std)


@dataclass
class AdvantageStats:
    """Advantages per group, as plain floats for display
    (:class:`~maxent_grpo.training.callbacks.CompletionSamples`; the loss reads the tensors).

    Attributes:
        grouped: B lists; ``grouped[b][g]`` is the advantage of completion g of prompt b.
    """

    grouped: list[list[float]]


@dataclass
class QDistribution:
    """The sequence-level target distribution q over each prompt's group.

    Produced by the listwise objective (``core.listwise``): per group,
    ``q = softmax_G(r / T_q)`` followed by the floor ``q <- q * (1 - G * eps') + eps'``.
    Each group of ``grouped`` is a probability vector (positive, sums to 1; not re-checked).

    Attributes:
        grouped: B lists of G probabilities.
    """

    grouped: list[list[float]]


@dataclass
class SequenceScores:
    """Log-probability scores of N scored completions (one micro-batch of whole groups,
    prompt-major) under the current policy, with gradient, and the behaviour policy's
    per-token log-probs they are compared with.

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
    """How scoring is chunked: the two sizes (>= 1, or None: no bound) bound one micro-batch
    of whole prompt groups (:func:`maxent_grpo.training.step.batching.plan_micro_batches`).

    Attributes:
        logprob_chunk_size: sequences per forward pass, ``G * model.micro_batch_groups``.
        score_slice: padded tokens (rows x columns) per forward pass, ``model.micro_batch_tokens``.
    """

    logprob_chunk_size: int | None
    score_slice: int | None

    def __post_init__(self) -> None:
        check_int("logprob_chunk_size", self.logprob_chunk_size, minimum=1, allow_none=True)
        check_int("score_slice", self.score_slice, minimum=1, allow_none=True)

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

from collections.abc import Callable
from dataclasses import dataclass

import torch

# defined with the rollout layer that produces them; documented (and re-exported) here
from maxent_grpo.rollout.batch import GenerationBatch, PromptCompletionBatch
from maxent_grpo.validation import check_int

__all__ = [
    "AdvantageStats",
    "BatchingSettings",
    "GenerationBatch",
    "PromptCacheEntry",
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


def _check_flat_matches(name: str, grouped: list[list[float]], samples: list[float]) -> None:
    total = sum(len(group) for group in grouped)
    if len(samples) != total:
        raise ValueError(
            f"{name}.samples must be the prompt-major flattening of {name}.grouped "
            f"({total} values); got {len(samples)}"
        )


@dataclass
class AdvantageStats:
    """Advantages per group and flattened (prompt-major), as plain floats.

    Produced by the objective from the grouped rewards (``core.advantages``); consumed by
    the loss (via ``samples``, aligned with SequenceScores rows) and by logging.

    Attributes:
        grouped: B lists; ``grouped[b][g]`` is the advantage of completion g of prompt b.
        samples: the same values flattened prompt-major (length B*G).
    """

    grouped: list[list[float]]
    samples: list[float]

    def __post_init__(self) -> None:
        _check_flat_matches("AdvantageStats", self.grouped, self.samples)

    @classmethod
    def from_grouped(cls, grouped: list[list[float]]) -> AdvantageStats:
        """Build from grouped values, flattening them prompt-major into ``samples``."""
        return cls(grouped=grouped, samples=[v for group in grouped for v in group])


@dataclass
class QDistribution:
    """The sequence-level target distribution q over each prompt's group.

    Produced by the listwise objective (``core.listwise``): per group,
    ``q = softmax_G(r / T_q)`` followed by the floor ``q <- q * (1 - G * eps') + eps'``;
    consumed by the closed-form MaxEnt weights and by logging. Each group of ``grouped``
    is a probability vector (positive, sums to 1); this is documented, not re-checked.

    Attributes:
        grouped: B lists of G probabilities.
        samples: the same values flattened prompt-major (length B*G).
    """

    grouped: list[list[float]]
    samples: list[float]

    def __post_init__(self) -> None:
        _check_flat_matches("QDistribution", self.grouped, self.samples)

    @classmethod
    def from_grouped(cls, grouped: list[list[float]]) -> QDistribution:
        """Build from grouped probabilities, flattening them prompt-major into ``samples``."""
        return cls(grouped=grouped, samples=[v for group in grouped for v in group])


# ---------------------------------------------------------------------------------- scoring


@dataclass
class SequenceScores:
    """Log-probability scores of the B*G completions under the current and behaviour policy.

    Produced by scoring (a teacher-forced forward pass over prompt + completion, chunked per
    :class:`BatchingSettings`); consumed by the objective's loss and by logging. Rows are
    prompt-major sequences (N = B*G).

    Attributes:
        cur_logp_sum: (N,) sum over completion tokens of log pi_theta(y_t | x, y_<t).
        behavior_logp_sum: (N,) the same sum under the behaviour policy that generated the
            completions (detached).
        log_ratio_train: (N,) ``cur_logp_sum - behavior_logp_sum``, the sequence log-ratio
            used by the loss.
        denom_tok_tensor: (N,) number of completion tokens of each sequence (the
            normaliser of per-token means).
        pooled_hidden: optional (N, H) pooled final hidden state of each sequence.
        policy_entropy_sum: optional (N,) sum over tokens of the policy's exact entropy.
        token_logp: optional (N, T) per-token log-probs under the current policy.
        token_mask: optional (N, T) bool mask of real (non-padding) completion tokens.
        old_token_logp: optional (N, T) per-token log-probs under the behaviour policy.
    """

    cur_logp_sum: torch.Tensor
    behavior_logp_sum: torch.Tensor
    log_ratio_train: torch.Tensor
    denom_tok_tensor: torch.Tensor
    pooled_hidden: torch.Tensor | None = None
    policy_entropy_sum: torch.Tensor | None = None
    token_logp: torch.Tensor | None = None
    token_mask: torch.Tensor | None = None
    old_token_logp: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name in ("cur_logp_sum", "behavior_logp_sum", "log_ratio_train", "denom_tok_tensor"):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor; got {type(value).__name__}")
            if value.dim() != 1:
                raise ValueError(f"{name} must have shape (N,); got {tuple(value.shape)}")
        n = self.cur_logp_sum.shape[0]
        for name in ("behavior_logp_sum", "log_ratio_train", "denom_tok_tensor"):
            if getattr(self, name).shape[0] != n:
                raise ValueError(
                    f"{name} must have shape ({n},) like cur_logp_sum; "
                    f"got {tuple(getattr(self, name).shape)}"
                )
        # optional tensors: name -> number of dims; all share N rows, per-token ones share T
        optional = {"pooled_hidden": 2, "policy_entropy_sum": 1}
        optional |= {"token_logp": 2, "token_mask": 2, "old_token_logp": 2}
        token_shape: tuple[int, ...] | None = None
        for name, dims in optional.items():
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor or None; got {type(value)}")
            if value.dim() != dims or value.shape[0] != n:
                want = f"({n},)" if dims == 1 else f"({n}, …)"
                raise ValueError(f"{name} must have shape {want}; got {tuple(value.shape)}")
            if name.startswith(("token_", "old_token_")):
                if token_shape is not None and tuple(value.shape) != token_shape:
                    raise ValueError(
                        f"{name} must have the same (N, T) shape as the other per-token "
                        f"tensors {token_shape}; got {tuple(value.shape)}"
                    )
                token_shape = tuple(value.shape)

    @property
    def num_sequences(self) -> int:
        """N = B*G, the number of scored sequences."""
        return int(self.cur_logp_sum.shape[0])


@dataclass
class PromptCacheEntry:
    """A tokenised prompt kept in the prompt cache so scoring does not re-tokenise it.

    Produced by the prompt-cache lookup (``BatchingSettings.prompt_length_cache_get`` /
    ``RuntimeHandles.prompt_cache_get``); consumed by scoring when it builds prompt +
    completion inputs.

    Attributes:
        input_ids: the prompt's P token ids.
        attention_mask: the prompt's P mask values (1 for real tokens).
    """

    input_ids: list[int]
    attention_mask: list[int]

    def __post_init__(self) -> None:
        if len(self.attention_mask) != len(self.input_ids):
            raise ValueError(
                f"attention_mask must have one value per input id ({len(self.input_ids)}); "
                f"got {len(self.attention_mask)}"
            )

    @property
    def length(self) -> int:
        """P, the number of prompt tokens."""
        return len(self.input_ids)


@dataclass
class BatchingSettings:
    """How scoring is chunked and cached; read by the scorer on every training step.

    The trainer scores micro-batches of whole prompt groups
    (:func:`maxent_grpo.training.step.batching.plan_micro_batches`), so the two sizes below bound
    one micro-batch; ``None`` means no bound (the whole batch in one forward pass).

    Attributes:
        logprob_chunk_size: at most this many sequences per forward pass when computing
            log-probs (>= 1; whole groups: ``G * model.micro_batch_groups``), or None.
        score_slice: at most this many padded tokens (rows x columns) per scored slice
            (>= 1; ``model.micro_batch_tokens``), or None.
        prompt_length_cache_get: lookup ``prompt -> PromptCacheEntry`` used to skip
            re-tokenising prompts, or ``None`` to tokenise every time (the trainer's engine
            tokenises each batch once, so it uses None).
        score_tail_tokens: if set (>= 1), only the last this many completion tokens are
            scored; ``None`` scores all T (the trainer always scores all T).
        slice_prefetch: slices prepared ahead of the one being scored (>= 0; the trainer
            prepares none).
        prompt_cache_size: maximum number of cached prompts (>= 0; 0 disables the cache).
    """

    logprob_chunk_size: int | None
    score_slice: int | None
    prompt_length_cache_get: Callable[[str], PromptCacheEntry] | None = None
    score_tail_tokens: int | None = None
    slice_prefetch: int = 0
    prompt_cache_size: int = 0

    def __post_init__(self) -> None:
        check_int("logprob_chunk_size", self.logprob_chunk_size, minimum=1, allow_none=True)
        check_int("score_slice", self.score_slice, minimum=1, allow_none=True)
        check_int("score_tail_tokens", self.score_tail_tokens, minimum=1, allow_none=True)
        check_int("slice_prefetch", self.slice_prefetch, minimum=0)
        check_int("prompt_cache_size", self.prompt_cache_size, minimum=0)
        if self.prompt_length_cache_get is not None and not callable(self.prompt_length_cache_get):
            raise TypeError("prompt_length_cache_get must be callable or None")

"""Rollout, reward and scoring data: what rewards and sequence weights are computed from.

Shape vocabulary: B prompts, G completions per prompt, T completion tokens. Flattened
sequences are prompt-major: row ``b * G + g`` is completion ``g`` of prompt ``b``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from typing import TypeVar

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


@dataclass
class _MeanStd:
    """What the two moment records share: ``std`` is checked >= 0 (or NaN)."""

    mean: float
    std: float

    def __post_init__(self) -> None:
        if self.std < 0:  # NaN passes on purpose: an empty or single-sample batch has no spread
            raise ValueError(f"std must be >= 0 (NaN allowed); got {self.std}")


@dataclass
class RewardComponentStats(_MeanStd):
    """Mean and standard deviation of one reward function over the batch's B*G completions
    (logged as ``reward/<name>/mean`` and ``…/std``).

    Attributes:
        mean: the mean of the function's values.
        std: their std, >= 0 or NaN (undefined spread).
    """


@dataclass
class RewardMoments(_MeanStd):
    """Mean and standard deviation of the B*G total (weighted-sum) sequence rewards.

    Attributes:
        mean: the mean total reward.
        std: its std, >= 0 or NaN (undefined spread).
    """


_Self = TypeVar("_Self", bound="_PerGroup")  # typing.Self is Python 3.11's


@dataclass
class _PerGroup:
    """What the two per-group records share: ``samples`` is ``grouped`` flattened."""

    grouped: list[list[float]]
    samples: list[float]

    def __post_init__(self) -> None:
        flat = [x for group in self.grouped for x in group]
        if len(flat) != len(self.samples):
            raise ValueError(f"{type(self).__name__}.samples must hold the {len(flat)} values "
                             f"of grouped, prompt-major; got {len(self.samples)}")

    @classmethod
    def of(cls: type[_Self], values: torch.Tensor) -> _Self:
        """From a ``(B, G)`` tensor."""
        return cls(values.tolist(), values.reshape(-1).tolist())


@dataclass
class AdvantageStats(_PerGroup):
    """Advantages per group and flattened, as plain floats for display
    (:class:`~maxent_grpo.training.callbacks.CompletionSamples`; the loss reads the tensors).
    Groups that ``drop_constant_groups`` left out hold NaN.

    Attributes:
        grouped: B lists; ``grouped[b][g]`` is the advantage of completion g of prompt b.
        samples: the same B*G values flattened prompt-major (row ``b * G + g``).
    """


@dataclass
class QDistribution(_PerGroup):
    """The sequence-level target distribution q over each prompt's group, per group and
    flattened.

    Produced by the listwise objective (``core.listwise``): per group,
    ``q = softmax_G(r / T_q)`` followed by the floor ``q <- q * (1 - G * eps') + eps'``.
    Each group of ``grouped`` is a probability vector (positive, sums to 1; not re-checked).

    Attributes:
        grouped: B lists of G probabilities.
        samples: the same B*G values flattened prompt-major (row ``b * G + g``).
    """


@dataclass
class SequenceScores:
    """Log-probability scores of N scored completions (one micro-batch of whole groups,
    prompt-major) under the current policy, and the behaviour policy's they are compared
    with. Built by :meth:`of` in the optimiser's forward pass
    (:meth:`~maxent_grpo.training.step.token_logps.Scorer.policy_scores`).

    The behaviour policy is the one that sampled the completions: the engine's own sampler
    where it reports its log-probs (the vLLM engines, a generation copy), else the policy as
    it was when it sampled (``old_token_logp`` when ``num_iterations > 1``, the current
    policy itself otherwise). Sums run over ``token_mask``, the loss mask.

    Attributes:
        cur_logp_sum: (N,) sum over completion tokens of log pi_theta(y_t | x, y_<t)
            (detached).
        behavior_logp_sum: (N,) the same sum under the behaviour policy.
        log_ratio_train: (N,) ``cur_logp_sum - behavior_logp_sum``, the sequence's log
            importance ratio of the trained policy against the one that sampled (logged as
            the token mean ``logp/log_ratio``).
        denom_tok_tensor: (N,) float, each sequence's tokens in the loss mask: the token
            normaliser of its per-sequence means.
        pooled_hidden: pooled hidden states per sequence; always None here (no objective of
            this trainer reads hidden states, and scoring computes none).
        policy_entropy_sum: (N,) sum of the policy's exact token entropies, where the
            objective needs the entropy (``needs_entropy``), else None.
        token_logp: (N, T) per-token log-probs under the current policy, with gradient.
        token_mask: (N, T) bool mask of the tokens in the loss.
        old_token_logp: (N, T) per-token log-probs under the policy before this rollout's
            first update (detached), or None when it is the current one
            (``num_iterations = 1``).
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
        if not isinstance(self.cur_logp_sum, torch.Tensor) or self.cur_logp_sum.dim() != 1:
            raise ValueError(f"cur_logp_sum must be a (N,) tensor; got {self.cur_logp_sum!r}")
        n = self.cur_logp_sum.shape[0]
        for name in ("behavior_logp_sum", "log_ratio_train", "denom_tok_tensor",
                     "policy_entropy_sum"):
            value = getattr(self, name)
            if value is None and name == "policy_entropy_sum":
                continue
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != (n,):
                raise ValueError(f"{name} must be a ({n},) tensor; got {value!r:.80}")
        if self.pooled_hidden is not None and (
                not isinstance(self.pooled_hidden, torch.Tensor)
                or self.pooled_hidden.shape[0] != n):
            raise ValueError(f"pooled_hidden must be None or a ({n}, H) tensor")
        for name in ("token_logp", "token_mask", "old_token_logp"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor; got {type(value).__name__}")
            if value.dim() != 2 or value.shape[0] != n:
                raise ValueError(f"{name} must have shape ({n}, T); got {tuple(value.shape)}")
            if self.token_logp is not None and value.shape != self.token_logp.shape:
                raise ValueError(
                    f"{name} must have the same (N, T) shape as token_logp "
                    f"{tuple(self.token_logp.shape)}; got {tuple(value.shape)}"
                )

    @classmethod
    def of(cls, token_logp: torch.Tensor, token_mask: torch.Tensor,
           old_token_logp: torch.Tensor | None = None,
           sampler_token_logp: torch.Tensor | None = None,
           entropy: torch.Tensor | None = None) -> SequenceScores:
        """The scores of ``(N, T)`` current log-probs over ``token_mask``; the behaviour
        policy's per-token log-probs are ``sampler_token_logp`` (an engine's own), else
        ``old_token_logp``, else the current ones; ``entropy`` ``(N, T)`` or None."""
        weight = token_mask.to(token_logp.dtype)
        current = token_logp.detach()
        behaviour = next(x for x in (sampler_token_logp, old_token_logp, current)
                         if x is not None)
        def total(x: torch.Tensor) -> torch.Tensor:  # selected: a -inf in padding stays out
            return torch.where(token_mask, x.to(current.dtype), 0.0).sum(-1)

        cur_sum, behaviour_sum = total(current), total(behaviour)
        return cls(
            cur_logp_sum=cur_sum, behavior_logp_sum=behaviour_sum,
            log_ratio_train=cur_sum - behaviour_sum, denom_tok_tensor=weight.sum(-1),
            policy_entropy_sum=None if entropy is None else total(entropy.detach()),
            token_logp=token_logp, token_mask=token_mask, old_token_logp=old_token_logp)

    @property
    def num_sequences(self) -> int:
        """N = B*G, the number of scored sequences."""
        return int(self.cur_logp_sum.shape[0])


@dataclass(frozen=True)
class PromptCacheEntry:
    """A prompt's tokenization as a prompt cache would hold it (the value type of
    :attr:`BatchingSettings.prompt_length_cache_get`).

    Attributes:
        input_ids: the prompt's token ids.
        attention_mask: 1 on each of them.
    """

    input_ids: list[int]
    attention_mask: list[int]


@dataclass(frozen=True)
class BatchingSettings:
    """How scoring is chunked: the two sizes (>= 1, or None: no bound) bound one micro-batch
    of whole prompt groups (:func:`maxent_grpo.training.step.token_logps.plan_micro_batches`).
    The starting document types both as ``int``; None, the options' default, is this
    trainer's addition.

    The last four fields describe a prompt cache, a scored tail and prefetching that this
    trainer does not have: it scores each micro-batch's ``[prompt | completion]`` rows as
    the rollout tokenized them, cut to the micro-batch's own longest prompt and
    completion. They hold their defaults; the scorer refuses other values
    (:class:`~maxent_grpo.training.step.token_logps.Scorer`) rather than ignore them.

    Attributes:
        logprob_chunk_size: sequences per forward pass, ``G * model.micro_batch_groups``.
        score_slice: padded tokens (rows x columns) per forward pass, ``model.micro_batch_tokens``.
        prompt_length_cache_get: a prompt's cached tokenization, or None (no cache).
        score_tail_tokens: score only the last this-many completion tokens, or None (all).
        slice_prefetch: micro-batches prepared ahead of the forward pass (0: none).
        prompt_cache_size: prompts a tokenization cache keeps (0: no cache).
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
        if self.prompt_length_cache_get is not None and not callable(
                self.prompt_length_cache_get):
            raise TypeError("prompt_length_cache_get must be None or a callable")

    def unsupported(self) -> list[str]:
        """The fields set away from their defaults; each field with a default is one this
        trainer has no use for."""
        return [f.name for f in fields(self)
                if f.default is not MISSING and getattr(self, f.name) != f.default]

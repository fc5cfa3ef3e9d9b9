"""Scoring: token log-probs of sampled completions under the policy, reference and behaviour.

A teacher-forced forward pass over ``[prompt | completion]`` rows gives the log-probability
of each completion token at the sampling temperature (docs/ALGORITHM.md §0)::

    logits  = model(ids, attention, position_ids)[:, -T-1:-1] / temperature   # (n, T, V)
    logps   = log_softmax(logits)[completion ids]                              # (n, T)
    entropy = -sum_v p_v log p_v                                               # (n, T), optional

Only the completion logits are materialised (``logits_to_keep = T + 1``), and the fused
:func:`~maxent_grpo.core.selective_log_softmax` never builds a float32 ``(n, T, V)`` copy.
Position ids follow the left padding exactly as in generation. The policy's scores, with
gradient, come back as the documented :class:`~maxent_grpo.training.types.SequenceScores`;
frozen models (reference, behaviour) are scored without gradient, micro-batch by
micro-batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from maxent_grpo.core import selective_log_softmax, selective_log_softmax_with_entropy
from maxent_grpo.training.batching import MicroBatchPlan, plan_micro_batches
from maxent_grpo.training.types import BatchingSettings, SequenceScores


class Scorer:
    """Log-probs of completions at ``temperature``, micro-batched per ``batching``."""

    def __init__(self, temperature: float, batching: BatchingSettings) -> None:
        self.temperature = float(temperature)
        self.batching = batching

    def plan(self, prompt_mask: Tensor, completion_mask: Tensor, G: int) -> list[MicroBatchPlan]:
        """The micro-batches of whole groups of a ``(N, P)`` / ``(N, T)`` batch within the
        row and token bounds of :attr:`batching` (none for an empty batch)."""
        if prompt_mask.shape[0] == 0:
            return []
        rows = self.batching.logprob_chunk_size
        return plan_micro_batches(
            prompt_mask, completion_mask, G,
            max_groups=None if rows is None else rows // G,
            max_tokens=self.batching.score_slice,
        )

    def token_logps(
        self, model: torch.nn.Module, input_ids: Tensor, attention: Tensor, T: int,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """Token log-probs ``(n, T)`` of the last ``T`` tokens of ``input_ids`` ``(n, P+T)``,
        and their exact entropy ``(n, T)`` when ``with_entropy`` (else None)."""
        positions = (attention.long().cumsum(-1) - 1).clamp(min=0)
        out = model(
            input_ids=input_ids, attention_mask=attention, position_ids=positions,
            logits_to_keep=T + 1, use_cache=False,
        )
        logits = out.logits[:, :-1, :]  # (n, T, V), a view
        if self.temperature != 1.0:  # a full (n, T, V) copy: only when it matters
            logits = logits / self.temperature
        index = input_ids[:, -T:]
        if with_entropy:  # one pass, one (n, T, V) gradient
            return selective_log_softmax_with_entropy(logits, index)
        return selective_log_softmax(logits, index), None

    def policy_scores(
        self, model: torch.nn.Module, input_ids: Tensor, attention: Tensor, mask: Tensor,
        old_logps: Tensor | None, with_entropy: bool,
    ) -> tuple[SequenceScores, Tensor | None]:
        """The policy's scores of one micro-batch, with gradient: :class:`SequenceScores`
        (``token_logp`` carries the gradient) and the token entropy ``(n, T)`` or None.

        ``mask`` ``(n, T)`` is the loss mask; ``old_logps`` the behaviour log-probs (None
        when the behaviour policy is the current one, ``num_iterations = 1``)."""
        logps, entropy = self.token_logps(model, input_ids, attention, mask.shape[1],
                                          with_entropy)
        m = mask.to(logps.dtype)
        cur = (logps.detach() * m).sum(-1)  # (n,)
        behaviour = cur if old_logps is None else (old_logps * m).sum(-1)
        scores = SequenceScores(
            cur_logp_sum=cur,
            behavior_logp_sum=behaviour,
            log_ratio_train=cur - behaviour,
            denom_tok_tensor=m.sum(-1),
            policy_entropy_sum=None if entropy is None else (entropy.detach() * m).sum(-1),
            token_logp=logps,
            token_mask=mask,
            old_token_logp=old_logps,
        )
        return scores, entropy

    @torch.no_grad()
    def frozen_logps(
        self, model: torch.nn.Module, input_ids: Tensor, attention: Tensor, T: int,
        chunks: list[MicroBatchPlan],
    ) -> Tensor:
        """Token log-probs ``(N, T)`` of a frozen model over all rows, micro-batch by
        micro-batch (columns a micro-batch does not keep are padding and hold 0)."""
        P = input_ids.shape[1] - T
        out: Tensor | None = None
        for chunk in chunks:
            rows, cols = chunk.rows, chunk.columns(P)
            logps = self.token_logps(
                model, input_ids[rows][:, cols], attention[rows][:, cols], chunk.completion_len,
                False,
            )[0]
            if out is None:
                out = logps.new_zeros((input_ids.shape[0], T))
            out[rows, : chunk.completion_len] = logps
        assert out is not None, "frozen_logps needs at least one micro-batch"
        return out

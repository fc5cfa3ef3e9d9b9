"""The sampler's own log-probabilities from ``model.generate``: what the Hugging Face engine
reports when it samples from a generation copy (``generation_dtype``), not from the policy
the trainer scores.

``generate`` applies its sampling warpers (temperature, top-k, top-p) after any logits
processor a caller passes, so a processor of ours would see the scores before them.
:class:`SampledLogps` therefore takes the warpers over: built from the request's
:class:`~transformers.GenerationConfig`, it applies transformers' own
``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and ``TopPLogitsWarper`` in generate's
order and sets the config's to "off", so the draws are the same, and keeps
``log_softmax`` of the final scores (float32) until the next step shows which token was
drawn. Each token's value is its log-probability after temperature, top-k and top-p, as
the vLLM engines report theirs (``processed_logprobs``). One ``(N, V)`` float32 row block
is alive at a time.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

__all__ = ["SampledLogps", "recorder"]


class SampledLogps(LogitsProcessor):
    """Applies ``config``'s warpers itself (and turns them off in ``config``) and records
    the log-probability of each drawn token; :meth:`of` gives them ``(N, T)``."""

    def __init__(self, config: GenerationConfig) -> None:
        self.warpers = LogitsProcessorList()
        if config.temperature is not None and config.temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(config.temperature))
        if config.top_k:
            self.warpers.append(TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
        if config.top_p is not None and config.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))
        config.temperature, config.top_k, config.top_p = 1.0, 0, 1.0
        self.taken: list[torch.Tensor] = []  # (N,) per drawn token, in order
        self._last: torch.Tensor | None = None  # the latest step's (N, V) log-probs

    def _take(self, drawn: torch.Tensor) -> None:
        if self._last is not None:
            self.taken.append(self._last.gather(-1, drawn[:, None]).squeeze(-1))
            self._last = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.Tensor:
        self._take(input_ids[:, -1])  # after the first step: drawn from the last scores
        scores = self.warpers(input_ids, scores)
        self._last = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def of(self, completion_ids: torch.Tensor) -> torch.Tensor | None:
        """``(N, T)`` float32 log-probs of the ``(N, T)`` generated ids (None when the
        steps seen do not cover them)."""
        T = completion_ids.shape[1]
        if len(self.taken) < T:
            self._take(completion_ids[:, len(self.taken)])
        if len(self.taken) < T:
            return None
        return torch.stack(self.taken[:T], dim=1)


def recorder(config: GenerationConfig) -> tuple[SampledLogps, dict]:
    """The :class:`SampledLogps` that takes over ``config``'s warpers, and ``generate``'s
    keyword argument for it."""
    record = SampledLogps(config)
    return record, {"logits_processor": LogitsProcessorList([record])}

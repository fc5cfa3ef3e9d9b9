"""What a rollout engine returns, and the interface every engine satisfies.

An engine turns B rendered prompts into G sampled completions each. Rows of every tensor
are prompt-major, ``[p0g0, p0g1, …, p0g(G-1), p1g0, …]``, so a ``(B*G, …)`` tensor
reshapes to ``(B, G, …)``. The same completions appear as text in :attr:`RolloutOutput.batch`
(a :class:`~maxent_grpo.training.types.GenerationBatch`), grouped per prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from maxent_grpo.training.types import GenerationBatch


@dataclass
class RolloutOutput:
    """B prompts × G completions, as text and as token ids.

    Attributes:
        batch: the texts; ``batch.grouped_completions[b][g]`` is row ``b*G + g`` decoded
            with ``skip_special_tokens=True`` (masked tokens only), and
            ``batch.grouped_completion_info[b][g] = {"num_tokens": T_i, "truncated": bool}``.
        prompt_ids: ``(B*G, P)`` long, left-padded with the pad id.
        prompt_mask: ``(B*G, P)`` bool, True on real prompt tokens.
        completion_ids: ``(B*G, T)`` long, pad id wherever ``completion_mask`` is False.
            ``T`` is the longest completion in the batch, ``T <= max_new_tokens``.
        completion_mask: ``(B*G, T)`` bool, ``m[i,t]`` True up to and including the first
            stop (EOS) token, False after; all True for a truncated row.
        truncated: ``(B*G,)`` bool, True when the row has no stop token (it hit
            ``max_new_tokens``). ``T_i = completion_mask[i].sum()``.
        generate_seconds: wall-clock time of the generation call.
    """

    batch: GenerationBatch
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    truncated: torch.Tensor
    generate_seconds: float

    def __post_init__(self) -> None:
        rows = self.batch.num_completions
        checks = {
            "prompt_ids": (self.prompt_ids, 2),
            "prompt_mask": (self.prompt_mask, 2),
            "completion_ids": (self.completion_ids, 2),
            "completion_mask": (self.completion_mask, 2),
            "truncated": (self.truncated, 1),
        }
        for name, (tensor, ndim) in checks.items():
            if tensor.dim() != ndim or tensor.shape[0] != rows:
                raise ValueError(
                    f"{name} must have {ndim} dims and {rows} rows (one per completion); "
                    f"got shape {tuple(tensor.shape)}"
                )
        if self.prompt_mask.shape != self.prompt_ids.shape:
            raise ValueError(
                f"prompt_mask shape {tuple(self.prompt_mask.shape)} must equal prompt_ids shape "
                f"{tuple(self.prompt_ids.shape)}"
            )
        if self.completion_mask.shape != self.completion_ids.shape:
            raise ValueError(
                f"completion_mask shape {tuple(self.completion_mask.shape)} must equal "
                f"completion_ids shape {tuple(self.completion_ids.shape)}"
            )
        for name in ("prompt_mask", "completion_mask", "truncated"):
            if getattr(self, name).dtype != torch.bool:
                raise ValueError(f"{name} must be a bool tensor; got {getattr(self, name).dtype}")

    @property
    def num_generations(self) -> int:
        """G, the completions per prompt (raises if the groups are ragged)."""
        return self.batch.group_size


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples completions for already-rendered prompts (chat template applied)."""

    def generate(
        self, prompts: list[str], answers: list[str], num_generations: int
    ) -> RolloutOutput:
        """Sample ``num_generations`` completions for each prompt; rows prompt-major."""
        ...

"""What a rollout produces as text: completions grouped per prompt, and their flat pairs.

Defined in the rollout layer (the engines build them) and re-exported by the documented
module :mod:`maxent_grpo.training.types`. Rows are prompt-major: flat row ``b * G + g`` is
completion ``g`` of prompt ``b``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["GenerationBatch", "PromptCompletionBatch"]


def _check_group_shape(name: str, grouped: Sequence[Sequence[Any]], ref: list[list[str]]) -> None:
    """Raise ValueError unless ``grouped`` has one group per prompt, each as long as ``ref``'s."""
    if len(grouped) != len(ref):
        raise ValueError(
            f"{name} must have one group per prompt ({len(ref)}); got {len(grouped)} groups"
        )
    for i, (group, completions) in enumerate(zip(grouped, ref, strict=True)):
        if len(group) != len(completions):
            raise ValueError(
                f"{name}[{i}] must have one entry per completion ({len(completions)}); "
                f"got {len(group)}"
            )


@dataclass
class PromptCompletionBatch:
    """Flattened prompt/completion pairs, one row per sequence (B*G rows, prompt-major).

    Produced by :meth:`GenerationBatch.flatten`; consumed by the reward functions, which
    score each ``(prompts[i], completions[i])`` pair, and by the completion-sample logger.

    Attributes:
        prompts: the prompt of each row (each prompt repeated once per completion).
        completions: the completion text of each row.
        metadata: optional per-row dict (e.g. the rollout engine's token counts); same
            length as ``completions`` when given.
    """

    prompts: list[str]
    completions: list[str]
    metadata: list[dict] | None = None

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.completions):
            raise ValueError(
                f"prompts and completions must have the same length; "
                f"got {len(self.prompts)} and {len(self.completions)}"
            )
        if self.metadata is not None and len(self.metadata) != len(self.completions):
            raise ValueError(
                f"metadata must have one entry per completion ({len(self.completions)}); "
                f"got {len(self.metadata)}"
            )


@dataclass
class GenerationBatch:
    """Completions grouped per prompt, after filtering: the rollout engine's return value.

    Produced by the rollout engine inside ``training_step``; consumed by the reward
    functions (via :meth:`flatten`) and by scoring, which tokenises prompt + completion.

    Attributes:
        prompts: the B prompt strings.
        answers: the B reference answers (what the reward functions check against).
        grouped_completions: B groups; group ``b`` holds the completions of ``prompts[b]``.
        grouped_ref_meta: per-completion data from the engine needed later to score
            against the reference/behaviour policy (e.g. behaviour log-probs), or ``None``.
        grouped_completion_info: per-completion dicts (token counts, finish reason, …) or
            ``None``; becomes :attr:`PromptCompletionBatch.metadata` on flattening.

    Groups may be ragged after filtering; :attr:`group_size` raises in that case.
    """

    prompts: list[str]
    answers: list[str]
    grouped_completions: list[list[str]]
    grouped_ref_meta: list[list[Any | None]] | None
    grouped_completion_info: list[list[dict]] | None = None

    def __post_init__(self) -> None:
        n = len(self.prompts)
        if len(self.answers) != n or len(self.grouped_completions) != n:
            raise ValueError(
                "prompts, answers and grouped_completions must have the same length; got "
                f"{n}, {len(self.answers)} and {len(self.grouped_completions)}"
            )
        if self.grouped_ref_meta is not None:
            _check_group_shape("grouped_ref_meta", self.grouped_ref_meta, self.grouped_completions)
        if self.grouped_completion_info is not None:
            _check_group_shape(
                "grouped_completion_info", self.grouped_completion_info, self.grouped_completions
            )

    @property
    def num_groups(self) -> int:
        """B, the number of prompts (one group each)."""
        return len(self.prompts)

    @property
    def num_completions(self) -> int:
        """Total number of completions over all groups (B*G when groups are even)."""
        return sum(len(group) for group in self.grouped_completions)

    @property
    def group_size(self) -> int:
        """G, the number of completions per prompt; ValueError if the batch is empty or ragged."""
        sizes = {len(group) for group in self.grouped_completions}
        if not sizes:
            raise ValueError("group_size is undefined for a GenerationBatch with no prompts")
        if len(sizes) > 1:
            raise ValueError(
                f"group_size is undefined: grouped_completions is ragged (sizes {sorted(sizes)})"
            )
        return sizes.pop()

    def flatten(self) -> PromptCompletionBatch:
        """Prompt-major flat pairs: each prompt repeated once per completion of its group.

        ``metadata`` is the flattened ``grouped_completion_info`` (``None`` if absent).
        """
        prompts = [
            prompt
            for prompt, group in zip(self.prompts, self.grouped_completions, strict=True)
            for _ in group
        ]
        completions = [c for group in self.grouped_completions for c in group]
        metadata = None
        if self.grouped_completion_info is not None:
            metadata = [info for group in self.grouped_completion_info for info in group]
        return PromptCompletionBatch(prompts=prompts, completions=completions, metadata=metadata)

"""What a rollout produces as text: completions grouped per prompt, and their flat pairs.

Defined in the rollout layer (the engines build them) and re-exported by the documented
module :mod:`maxent_grpo.training.types`. Rows are prompt-major: flat row ``b * G + g`` is
completion ``g`` of prompt ``b``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GenerationBatch", "PromptCompletionBatch"]


@dataclass
class PromptCompletionBatch:
    """Flattened prompt/completion pairs, one row per sequence (B*G rows, prompt-major).

    Produced by :meth:`GenerationBatch.flatten`; consumed by the reward functions, which
    score each ``(prompts[i], completions[i])`` pair.

    Attributes:
        prompts: the prompt of each row (each prompt repeated once per completion).
        completions: the completion text of each row (for the rewards of a multi-turn
            rollout, its messages: :meth:`RolloutOutput.reward_completions`).
    """

    prompts: list[str]
    completions: list[str]

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.completions):
            raise ValueError(
                f"prompts and completions must have the same length; "
                f"got {len(self.prompts)} and {len(self.completions)}"
            )


@dataclass
class GenerationBatch:
    """Completions grouped per prompt: the text of a rollout engine's return value.

    Produced by the rollout engine inside ``training_step``; consumed by the reward
    functions (via :meth:`flatten`), the evaluation and the completion samples.

    Attributes:
        prompts: the B prompt strings.
        grouped_completions: B groups; group ``b`` holds the completions of ``prompts[b]``.
    """

    prompts: list[str]
    grouped_completions: list[list[str]]

    def __post_init__(self) -> None:
        if len(self.grouped_completions) != len(self.prompts):
            raise ValueError(
                "prompts and grouped_completions must have the same length; got "
                f"{len(self.prompts)} and {len(self.grouped_completions)}"
            )

    @property
    def num_completions(self) -> int:
        """Total number of completions over all groups (B*G when groups are even)."""
        return sum(len(group) for group in self.grouped_completions)

    def flatten(self) -> PromptCompletionBatch:
        """Prompt-major flat pairs: each prompt repeated once per completion of its group."""
        prompts = [
            prompt
            for prompt, group in zip(self.prompts, self.grouped_completions, strict=True)
            for _ in group
        ]
        completions = [c for group in self.grouped_completions for c in group]
        return PromptCompletionBatch(prompts=prompts, completions=completions)

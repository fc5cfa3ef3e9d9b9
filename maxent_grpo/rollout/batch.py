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
            f"{name} must have one group per prompt ({len(ref)}); got {len(grouped)} groups")
    for i, (group, completions) in enumerate(zip(grouped, ref, strict=True)):
        if len(group) != len(completions):
            raise ValueError(f"{name}[{i}] must have one entry per completion "
                             f"({len(completions)}); got {len(group)}")


@dataclass
class PromptCompletionBatch:
    """Flattened prompt/completion pairs, one row per sequence (B*G rows, prompt-major).

    Produced by :meth:`GenerationBatch.flatten`; consumed by the reward functions, which
    score each ``(prompts[i], completions[i])`` pair.

    Attributes:
        prompts: the prompt of each row (each prompt repeated once per completion).
        completions: the completion text of each row (for the rewards of a multi-turn
            rollout, its messages: :meth:`RolloutOutput.reward_completions`).
        metadata: the flattened :attr:`GenerationBatch.grouped_completion_info`: one dict
            per row, whose entries every reward function receives as keyword arguments
            (a multi-turn rollout's ``tool_calls``, ...), or None (a single-turn rollout).
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
            raise ValueError(f"metadata must have one entry per completion "
                             f"({len(self.completions)}); got {len(self.metadata)}")

    def reward_columns(self) -> dict[str, list[Any]]:
        """:attr:`metadata` as reward keyword columns, ``name -> one value per row`` (``{}``
        without metadata); every row's dict must have the same keys."""
        if not self.metadata:
            return {}
        names = list(self.metadata[0])
        for i, info in enumerate(self.metadata):
            if list(info) != names:
                raise ValueError(f"metadata[{i}] has keys {sorted(info)}; every row must have "
                                 f"those of row 0, {sorted(names)}")
        return {name: [info[name] for info in self.metadata] for name in names}


@dataclass
class GenerationBatch:
    """Completions grouped per prompt: the text of a rollout engine's return value.

    Produced by the rollout engine inside ``training_step``; consumed by the reward
    functions (via :meth:`flatten`), the evaluation and the completion samples.

    Attributes:
        prompts: the B prompt strings.
        answers: the B reference answers the engine was given with the prompts (what the
            reward functions check against; shown with the completion samples).
        grouped_completions: B groups; group ``b`` holds the completions of ``prompts[b]``.
        grouped_ref_meta: per completion, the behaviour policy's log-probability of it as
            the sampler computed it (the sum over its tokens, a float), from an engine that
            reports its log-probs (the vLLM engines); None from one that samples from the
            scored policy itself (the Hugging Face engine).
        grouped_completion_info: per completion, a dict of what the rollout adds to every
            reward call (a multi-turn rollout's ``tool_calls``, ``tool_failures``,
            ``exchange_lengths`` and ``environments``), or None (a single-turn rollout);
            becomes :attr:`PromptCompletionBatch.metadata` on flattening.
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
            _check_group_shape("grouped_completion_info", self.grouped_completion_info,
                               self.grouped_completions)

    @classmethod
    def of_rows(cls, prompts: Sequence[str], answers: Sequence[str], texts: Sequence[str],
                ref_meta: Sequence[Any] | None = None,
                info: Sequence[dict] | None = None) -> GenerationBatch:
        """From prompt-major flat rows (``B * G`` texts, and per-row ``ref_meta`` and
        ``info`` when given), grouped ``G`` per prompt."""
        B = len(prompts)
        G = len(texts) // B if B else 0
        if B * G != len(texts):
            raise ValueError(f"{len(texts)} completions do not split into {B} equal groups")

        def grouped(rows: Sequence[Any] | None) -> list[list[Any]] | None:
            return None if rows is None else [list(rows[b * G:(b + 1) * G]) for b in range(B)]

        return cls(list(prompts), list(answers), grouped(texts), grouped(ref_meta), grouped(info))

    def select(self, groups: Sequence[int]) -> GenerationBatch:
        """The groups ``groups`` (indices of prompts), in that order, with all their fields."""
        def pick(values: list[Any] | None) -> list[Any] | None:
            return None if values is None else [values[g] for g in groups]

        return GenerationBatch(pick(self.prompts), pick(self.answers),
                               pick(self.grouped_completions), pick(self.grouped_ref_meta),
                               pick(self.grouped_completion_info))

    @staticmethod
    def cat(parts: Sequence[GenerationBatch]) -> GenerationBatch:
        """The groups of ``parts`` one after another (a field absent from one part is absent
        from the result)."""
        def join(name: str) -> list[Any] | None:
            values = [getattr(p, name) for p in parts]
            return None if any(v is None for v in values) else [x for v in values for x in v]

        return GenerationBatch(join("prompts"), join("answers"), join("grouped_completions"),
                               join("grouped_ref_meta"), join("grouped_completion_info"))

    @property
    def num_completions(self) -> int:
        """Total number of completions over all groups (B*G when groups are even)."""
        return sum(len(group) for group in self.grouped_completions)

    def flatten(self) -> PromptCompletionBatch:
        """Prompt-major flat pairs: each prompt repeated once per completion of its group;
        ``metadata`` is the flattened ``grouped_completion_info`` (None if absent)."""
        prompts = [
            prompt
            for prompt, group in zip(self.prompts, self.grouped_completions, strict=True)
            for _ in group
        ]
        completions = [c for group in self.grouped_completions for c in group]
        info = self.grouped_completion_info
        metadata = None if info is None else [i for group in info for i in group]
        return PromptCompletionBatch(prompts=prompts, completions=completions, metadata=metadata)

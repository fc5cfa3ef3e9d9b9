"""What a rollout engine returns, and the interface every engine satisfies.

An engine turns B rendered prompts into G sampled completions each. Rows of every tensor
are prompt-major, ``[p0g0, p0g1, …, p0g(G-1), p1g0, …]``, so a ``(B*G, …)`` tensor
reshapes to ``(B, G, …)``. The same completions appear as text in :attr:`RolloutOutput.batch`
(a :class:`~maxent_grpo.rollout.batch.GenerationBatch`), grouped per prompt.

Choosing an engine. The trainer builds its engine from a factory
(:data:`EngineFactory`, ``model.engine`` in YAML, chosen with ``class_path``): a class whose
constructor takes ``(model, tokenizer, sampling)`` first and its own options after, for
example::

    model:
      engine:
        class_path: maxent_grpo.rollout.HFGenerateEngine
        init_args: {share_prefill: true}

The trainer passes the policy, its tokenizer and the :class:`SamplingSettings` it scores
with (the same temperature, top-p, top-k), so the behaviour policy is the scored one.

The engine lives for the whole run. Before a rollout that follows a change of the policy's
weights (an optimizer step, a checkpoint loaded) the trainer calls ``engine.sync(policy)``:
an engine that samples from its own copy of the weights refreshes it there; one that
samples from the policy itself does nothing. Evaluation uses the same engine, passing other
``sampling`` (greedy decoding) to ``generate``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from maxent_grpo.rollout.batch import GenerationBatch
from maxent_grpo.validation import check_bool, check_int, check_number


@dataclass(frozen=True)
class SamplingSettings:
    """The sampling distribution of a rollout, shared by the engine and the scorer.

    Attributes:
        max_new_tokens: ``T_max``, the most tokens sampled per completion (>= 1).
        temperature: sampling temperature (> 0); log-probs are scored at the same one.
        top_p: nucleus threshold in (0, 1]; 1 = off.
        top_k: keep the k most likely tokens; 0 = off.
        max_prompt_length: keep only the last this-many prompt tokens (>= 1), or None.
        do_sample: sample (training) or decode greedily (``False``: evaluation's greedy
            pass@1; temperature, top-p and top-k are then unused).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_prompt_length: int | None = None
    do_sample: bool = True

    def __post_init__(self) -> None:
        check_int("max_new_tokens", self.max_new_tokens, minimum=1)
        check_number("temperature", self.temperature, minimum=0, strict=True)
        check_number("top_p", self.top_p, minimum=0, maximum=1, strict=True)
        check_int("top_k", self.top_k, minimum=0)
        check_int("max_prompt_length", self.max_prompt_length, minimum=1, allow_none=True)
        check_bool("do_sample", self.do_sample)


@dataclass
class ToolUsage:
    """What the tools or the environment did in a multi-turn rollout, per row (``N = B*G``,
    prompt-major; :mod:`maxent_grpo.rollout.multiturn`).

    Attributes:
        messages: each row's exchange as chat messages, ``assistant`` turns and the tool
            (or environment) messages between them; the last message is always the
            model's (empty when the row ended inside a tool message).
        turns: ``(N,)`` long, the model's turns.
        calls: ``(N,)`` long, the tool calls run (or environment steps taken).
        failures: failure kind (:data:`~maxent_grpo.rollout.toolcall.FAILURE_KINDS`) ->
            ``(N,)`` long, the calls of each row that failed so.
        environments: each row's environment after the rollout, or None (tools).
    """

    messages: list[list[dict[str, str]]]
    turns: torch.Tensor
    calls: torch.Tensor
    failures: dict[str, torch.Tensor]
    environments: list[Any] | None = None

    @property
    def failed(self) -> torch.Tensor:
        """``(N,)`` long, each row's failed calls, all kinds together."""
        return sum(self.failures.values(), torch.zeros_like(self.calls))

    def rows(self, index: list[int]) -> ToolUsage:
        """The rows ``index``, in that order."""
        at = torch.tensor(index, dtype=torch.long)
        return ToolUsage(
            messages=[self.messages[i] for i in index], turns=self.turns[at],
            calls=self.calls[at], failures={k: v[at] for k, v in self.failures.items()},
            environments=None if self.environments is None
            else [self.environments[i] for i in index])

    @staticmethod
    def cat(parts: list[ToolUsage]) -> ToolUsage:
        """The rows of ``parts`` one after another."""
        envs = [p.environments for p in parts]
        return ToolUsage(
            messages=[m for p in parts for m in p.messages],
            turns=torch.cat([p.turns for p in parts]), calls=torch.cat([p.calls for p in parts]),
            failures={k: torch.cat([p.failures[k] for p in parts]) for k in parts[0].failures},
            environments=None if any(e is None for e in envs) else [x for e in envs for x in e])


@dataclass(frozen=True)
class Continuation:
    """One row continued by :meth:`ContinuableEngine.continue_ids`: the new token ids (up to
    and including the first stop token), whether a stop token came (False: the budget ran
    out), and the sampler's log-probs of the ids (None when the engine does not report
    them)."""

    ids: list[int]
    stopped: bool
    logps: list[float] | None = None

    @classmethod
    def cut(cls, ids: list[int], stop_ids: tuple[int, ...],
            logps: list[float] | None = None) -> Continuation:
        """``ids`` cut after their first stop token (``stopped`` True), or whole (False).

        >>> Continuation.cut([5, 2, 7], (2,))
        Continuation(ids=[5, 2], stopped=True, logps=None)
        """
        first = next((t for t, token in enumerate(ids) if token in stop_ids), None)
        if first is None:
            return cls(list(ids), False, logps)
        return cls(list(ids[: first + 1]), True, None if logps is None else logps[: first + 1])


@dataclass
class RolloutOutput:
    """B prompts × G completions, as text and as token ids.

    Attributes:
        batch: the texts; ``batch.grouped_completions[b][g]`` is row ``b*G + g`` decoded
            with ``skip_special_tokens=True`` (masked tokens only; a multi-turn rollout's
            keep the chat template's special tokens, so the turns show).
        prompt_ids: ``(B*G, P)`` long, left-padded with the pad id.
        prompt_mask: ``(B*G, P)`` bool, True on real prompt tokens.
        completion_ids: ``(B*G, T)`` long, pad id wherever ``completion_mask`` is False.
            ``T`` is the longest completion in the batch, ``T <= max_new_tokens``.
        completion_mask: ``(B*G, T)`` bool, ``m[i,t]`` True up to and including the first
            stop (EOS) token, False after; all True for a truncated row. (A multi-turn row:
            True up to the end of its last turn, its earlier turns' stop tokens included.)
        truncated: ``(B*G,)`` bool, True when the row has no stop token (it hit
            ``max_new_tokens``; a multi-turn row: its last turn, or a tool message, was cut
            there). ``T_i = completion_mask[i].sum()``.
        generate_seconds: wall-clock time of the generation call.
        sampler_logps: ``(B*G, T)`` float, the sampler's own log-probability of each
            completion token at the sampling temperature (0 outside ``completion_mask``),
            or None when the engine does not report them (the Hugging Face engine).
        tool_mask: ``(B*G, T)`` bool, True on the completion's tokens the model did not
            write (tool and environment messages, with the chat template's text around
            them; always inside ``completion_mask``), or None for a single-turn rollout.
            The policy conditions on them; the loss and every token count leave them out.
        tools: the multi-turn rollout's per-row record (:class:`ToolUsage`), or None.
    """

    batch: GenerationBatch
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    truncated: torch.Tensor
    generate_seconds: float
    sampler_logps: torch.Tensor | None = None
    tool_mask: torch.Tensor | None = None
    tools: ToolUsage | None = None

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
        if self.sampler_logps is not None and self.sampler_logps.shape != self.completion_ids.shape:
            raise ValueError(
                f"sampler_logps shape {tuple(self.sampler_logps.shape)} must equal "
                f"completion_ids shape {tuple(self.completion_ids.shape)}"
            )
        if self.tool_mask is not None and (
            self.tool_mask.shape != self.completion_mask.shape
            or bool((self.tool_mask & ~self.completion_mask).any())
        ):
            raise ValueError("tool_mask must have completion_mask's shape and lie inside it")
        names = ("prompt_mask", "completion_mask", "truncated") + (
            ("tool_mask",) if self.tool_mask is not None else ())
        for name in names:
            if getattr(self, name).dtype != torch.bool:
                raise ValueError(f"{name} must be a bool tensor; got {getattr(self, name).dtype}")

    @property
    def model_mask(self) -> torch.Tensor:
        """``(B*G, T)`` bool, the completion tokens the model wrote: ``completion_mask``
        without ``tool_mask``."""
        if self.tool_mask is None:
            return self.completion_mask
        return self.completion_mask & ~self.tool_mask

    def reward_completions(self) -> list[Any]:
        """The ``B*G`` completions as the reward functions get them, prompt-major: the texts,
        or, for a multi-turn rollout, each exchange's messages (so a reward reads the
        model's last turn as the last message's content)."""
        if self.tools is not None:
            return list(self.tools.messages)
        return [c for group in self.batch.grouped_completions for c in group]


def check_request(
    prompts: list[str], answers: list[str], num_generations: int,
    sampling: SamplingSettings | None, default: SamplingSettings,
) -> SamplingSettings:
    """Check a ``generate`` call's arguments (ValueError / TypeError naming the argument)
    and return the sampling settings it uses (``sampling``, or the engine's ``default``)."""
    s = default if sampling is None else sampling
    if not isinstance(s, SamplingSettings):
        raise TypeError(f"sampling must be a SamplingSettings; got {type(s).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts must not be empty")
    if len(answers) != len(prompts):
        raise ValueError(
            f"answers must have one entry per prompt; got {len(answers)} answers for "
            f"{len(prompts)} prompts"
        )
    if isinstance(num_generations, bool) or not isinstance(num_generations, int) or (
        num_generations < 1
    ):
        raise ValueError(f"num_generations must be an int >= 1; got {num_generations!r}")
    return s


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples completions for already-rendered prompts (chat template applied)."""

    def generate(
        self, prompts: list[str], answers: list[str], num_generations: int,
        sampling: SamplingSettings | None = None,
    ) -> RolloutOutput:
        """Sample ``num_generations`` completions for each prompt, rows prompt-major, from
        ``sampling`` (None: the settings the engine was built with)."""
        ...

    def sync(self, model: Any) -> None:
        """Take ``model``'s current weights for the rollouts that follow."""
        ...


@runtime_checkable
class ContinuableEngine(RolloutEngine, Protocol):
    """An engine that can also continue given token sequences, which multi-turn rollouts
    (:class:`~maxent_grpo.rollout.multiturn.MultiTurnEngine`) need."""

    def continue_ids(
        self, sequences: list[list[int]], budgets: list[int], sampling: SamplingSettings,
    ) -> list[Continuation]:
        """Sample one continuation of each token sequence (prompt and completion so far),
        row ``i`` at most ``budgets[i]`` new tokens, stopping at the engine's stop ids."""
        ...


#: What ``model.engine`` holds: called as ``factory(model, tokenizer, sampling)``.
EngineFactory = Callable[[Any, Any, SamplingSettings], RolloutEngine]

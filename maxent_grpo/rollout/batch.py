"""The rollout's records: what a ``generate`` call takes and what it returns.

:class:`SamplingSettings` (and :func:`check_request`) describe a call; a call returns one
:class:`RolloutOutput`, the ids and masks of ``B`` prompts x ``G`` completions with their
texts grouped per prompt (:class:`GenerationBatch`), flattened for the reward functions
(:class:`PromptCompletionBatch`), and a multi-turn rollout's :class:`ToolUsage`. The two
text records are re-exported by the documented module :mod:`maxent_grpo.training.types`.
Rows are prompt-major: flat row ``b * G + g`` is completion ``g`` of prompt ``b``, so a
``(B*G, ...)`` tensor reshapes to ``(B, G, ...)``. The engines' interface is
:mod:`maxent_grpo.rollout.protocol`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from maxent_grpo.validation import UserCodeError, check_bool, check_int, check_number, require

__all__ = ["GenerationBatch", "PromptCompletionBatch", "RolloutOutput", "SamplingSettings",
           "ToolUsage", "check_request", "checked_rollout"]


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
            raise ValueError(f"prompts and completions must have the same length; "
                             f"got {len(self.prompts)} and {len(self.completions)}")
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
            reports its log-probs (the vLLM engines, the Hugging Face engine on a generation
            copy); None from one that samples from the scored policy itself (the Hugging
            Face engine without a copy).
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
            raise ValueError("prompts, answers and grouped_completions must have the same "
                             f"length; got {n}, {len(self.answers)} and "
                             f"{len(self.grouped_completions)}")
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
        values = [getattr(self, field.name) for field in dataclasses.fields(self)]
        return GenerationBatch(*(None if v is None else [v[g] for g in groups] for v in values))

    @staticmethod
    def cat(parts: Sequence[GenerationBatch]) -> GenerationBatch:
        """The groups of ``parts`` one after another (a field absent from one part is absent
        from the result)."""
        def join(name: str) -> list[Any] | None:
            values = [getattr(p, name) for p in parts]
            return None if any(v is None for v in values) else [x for v in values for x in v]

        return GenerationBatch(*(join(field.name) for field in dataclasses.fields(GenerationBatch)))

    @property
    def num_completions(self) -> int:
        """Total number of completions over all groups (B*G when groups are even)."""
        return sum(len(group) for group in self.grouped_completions)

    def flatten(self, prompts: Sequence[Any] | None = None,
                completions: Sequence[Any] | None = None) -> PromptCompletionBatch:
        """Prompt-major flat pairs: each group's prompt repeated once per completion of the
        group; ``metadata`` is the flattened ``grouped_completion_info`` (None if absent).

        ``prompts`` (one per group) replaces :attr:`prompts` as what each row carries (the
        dataset's own prompt, a string or chat messages); ``completions`` (one per row)
        replaces the texts (a multi-turn rollout's messages)."""
        if prompts is None:
            prompts = self.prompts
        elif len(prompts) != len(self.prompts):
            raise ValueError(f"prompts must have one entry per prompt of the batch "
                             f"({len(self.prompts)}); got {len(prompts)}")
        rows = [prompt for prompt, group in zip(prompts, self.grouped_completions, strict=True)
                for _ in group]
        if completions is None:
            completions = [c for group in self.grouped_completions for c in group]
        info = self.grouped_completion_info
        metadata = None if info is None else [i for group in info for i in group]
        return PromptCompletionBatch(prompts=rows, completions=list(completions),
                                     metadata=metadata)


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
        check_number("temperature", self.temperature)  # vLLM decodes greedily below 1e-5
        require(1e-5 <= self.temperature <= 3.4e38, "temperature must be from 1e-05 to 3.4e38 "
                "(log-probs are scored at it; greedy evaluation: model.eval_greedy, while "
                f"training samples: a group of equal completions trains nothing); got "
                f"{self.temperature!r}")
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


@dataclass
class RolloutOutput:
    """B prompts × G completions, as text and as token ids.

    Attributes:
        batch: the texts; ``batch.grouped_completions[b][g]`` is row ``b*G + g`` decoded
            without special tokens but the answer and call tags (masked tokens only; a
            multi-turn rollout's keep the template's special tokens, so the turns show).
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
            or None when the engine does not report them (the Hugging Face engine without a
            generation copy).
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
        sizes = {len(group) for group in self.batch.grouped_completions}
        if len(sizes) > 1:
            raise ValueError(f"a rollout has G completions for every prompt; got group sizes "
                             f"{sorted(sizes)}")
        dims = {"prompt_ids": 2, "prompt_mask": 2, "completion_ids": 2, "completion_mask": 2,
                "truncated": 1}
        for name, ndim in dims.items():
            tensor = getattr(self, name)
            if tensor.dim() != ndim or tensor.shape[0] != rows:
                raise ValueError(f"{name} must have {ndim} dims and {rows} rows (one per "
                                 f"completion); got shape {tuple(tensor.shape)}")
        for name, ref in (("prompt_mask", "prompt_ids"), ("completion_mask", "completion_ids"),
                          ("sampler_logps", "completion_ids")):
            tensor, expected = getattr(self, name), getattr(self, ref).shape
            if tensor is not None and tensor.shape != expected:
                raise ValueError(f"{name} shape {tuple(tensor.shape)} must equal {ref} shape "
                                 f"{tuple(expected)}")
        if self.tool_mask is not None and (self.tool_mask.shape != self.completion_mask.shape
                                           or bool((self.tool_mask & ~self.completion_mask).any())):
            raise ValueError("tool_mask must have completion_mask's shape and lie inside it")
        for name in ("prompt_mask", "completion_mask", "truncated", "tool_mask"):
            tensor = getattr(self, name)
            if tensor is not None and tensor.dtype != torch.bool:
                raise ValueError(f"{name} must be a bool tensor; got {tensor.dtype}")

    @property
    def model_mask(self) -> torch.Tensor:
        """``(B*G, T)`` bool, the completion tokens the model wrote: ``completion_mask``
        without ``tool_mask``."""
        if self.tool_mask is None:
            return self.completion_mask
        return self.completion_mask & ~self.tool_mask

    #: the tensor fields (the last two may be None)
    TENSORS: ClassVar[tuple[str, ...]] = ("prompt_ids", "prompt_mask", "completion_ids",
                                          "completion_mask", "truncated", "sampler_logps",
                                          "tool_mask")

    def to(self, device: torch.device | str) -> RolloutOutput:
        """This rollout with its tensors on ``device`` (itself when they are there already)."""
        if self.completion_ids.device == torch.device(device):
            return self
        return dataclasses.replace(self, **{name: getattr(self, name).to(device)
                                            for name in self.TENSORS
                                            if getattr(self, name) is not None})

    def state_dict(self) -> dict[str, Any]:
        """Everything of this rollout as plain data and CPU tensors (:meth:`from_state`
        rebuilds it), for a checkpoint. An environment's rollout cannot be stored."""
        state: dict[str, Any] = {name: None if getattr(self, name) is None
                                 else getattr(self, name).detach().cpu() for name in self.TENSORS}
        state.update(batch=dataclasses.asdict(self.batch),  # texts, answers, per-completion meta
                     generate_seconds=float(self.generate_seconds), tools=None)
        if self.tools is not None:
            if self.tools.environments is not None:
                raise ValueError("model.max_staleness >= 1 cannot store an environment's "
                                 "rollouts in a checkpoint; use max_staleness 0 with "
                                 "model.environment")
            state["tools"] = {"messages": self.tools.messages, "turns": self.tools.turns.cpu(),
                              "calls": self.tools.calls.cpu(),
                              "failures": {k: v.cpu() for k, v in self.tools.failures.items()}}
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RolloutOutput:
        """The rollout :meth:`state_dict` stored."""
        tools = state.get("tools")
        return cls(batch=GenerationBatch(**state["batch"]),
                   generate_seconds=state["generate_seconds"],
                   tools=None if tools is None else ToolUsage(**tools),
                   **{name: state[name] for name in cls.TENSORS})

    @property
    def group_size(self) -> int:
        """``G``, the completions of every prompt (0 for an empty rollout)."""
        groups = self.batch.grouped_completions
        return len(groups[0]) if groups else 0

    @property
    def texts(self) -> list[str]:
        """The ``B*G`` decoded completions, prompt-major (row ``b*G + g``)."""
        return [c for group in self.batch.grouped_completions for c in group]

    def reward_completions(self) -> list[Any]:
        """The ``B*G`` completions as the reward functions get them, prompt-major: the texts,
        or, for a multi-turn rollout, each exchange's messages (so a reward reads the
        model's last turn as the last message's content)."""
        if self.tools is not None:
            return list(self.tools.messages)
        return self.texts

    def pairs(self, prompts: Sequence[Any] | None = None) -> PromptCompletionBatch:
        """The rollout as the reward functions score it: each prompt (``prompts``: the
        dataset's, one per group, a string or chat messages; default: the rendered ones)
        once per completion, the completions as :meth:`reward_completions` gives them, and
        the per-completion keyword columns as ``metadata``."""
        return self.batch.flatten(prompts, self.reward_completions())


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
        raise ValueError(f"answers must have one entry per prompt; got {len(answers)} answers "
                         f"for {len(prompts)} prompts")
    # not check_int: validation.py would join the traced demo step (tests/test_trace_step.py)
    if isinstance(num_generations, bool) or not isinstance(num_generations, int) or (
            num_generations < 1):
        raise ValueError(f"num_generations must be an int >= 1; got {num_generations!r}")
    return s


def checked_rollout(engine: Any, out: Any, prompts: int, group_size: int,
                    policy: Any = None, max_new_tokens: int | None = None) -> RolloutOutput:
    """``out``, what ``engine.generate`` returned for ``prompts`` prompts of ``group_size``
    each, checked as the step reads it (type, count, width, ids in the ``policy``'s rows)."""
    rows = out.completion_ids.shape[0] if isinstance(out, RolloutOutput) else None
    name = f"{type(engine).__name__}.generate"
    if rows != prompts * group_size:
        raise UserCodeError(
            f"{name} must return a maxent_grpo.rollout.RolloutOutput (rollout.vllm_engine."
            f"assemble_rollout builds one); got {type(out).__name__}" if rows is None else
            f"{name} returned {rows} completions for {prompts} prompts x num_generations "
            f"{group_size}: one group of num_generations per prompt, prompt-major")
    if (width := out.completion_ids.shape[1]) > (max_new_tokens or width):
        raise UserCodeError(f"{name} returned completions of {width} tokens, more than "
                            f"model.max_completion_length {max_new_tokens}")
    try:  # the input embeddings' rows (a LoRA embedding's: its base layer's; 0: not said)
        layer = policy.get_input_embeddings()
        vocab = getattr(getattr(layer, "get_base_layer", lambda: layer)(), "num_embeddings", 0)
    except (NotImplementedError, AttributeError):  # no policy, or one that does not say
        vocab = 0
    ids = torch.cat([out.prompt_ids.flatten(), out.completion_ids.flatten()])
    lo, hi = torch.stack(ids.aminmax()).tolist() if vocab and ids.numel() else (0, 0)
    if not 0 <= lo <= hi < (vocab or 1):  # an IndexError in the log-probs, a GPU's assert
        raise UserCodeError(f"{name} returned token ids {lo}..{hi}, outside the policy's "
                            f"vocabulary [0, {vocab}): the engine's model or tokenizer is not "
                            "the policy's (a server of another model?)")
    return out

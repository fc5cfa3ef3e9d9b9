"""The interface every rollout engine satisfies.

An engine turns B rendered prompts into G sampled completions each and returns a
:class:`~maxent_grpo.rollout.batch.RolloutOutput`; the records a call takes and returns
(:class:`SamplingSettings`, :class:`RolloutOutput`, :class:`ToolUsage`, with the texts'
records) and the check of its arguments (:func:`check_request`) live in
:mod:`maxent_grpo.rollout.batch` and are importable from here too.

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

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from maxent_grpo.rollout.batch import RolloutOutput, SamplingSettings, ToolUsage, check_request
from maxent_grpo.validation import require

__all__ = ["Continuation", "ContinuableEngine", "EngineFactory", "RolloutEngine",
           "RolloutOutput", "SamplingSettings", "ToolUsage", "check_built_engine",
           "check_request", "stop_ids"]


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


def stop_ids(engine: str, model: Any, tokenizer: Any, extra: list[int] | None) -> tuple[int, ...]:
    """The ids that end a completion: the tokenizer's eos, the model's ``generation_config``
    eos ids (a chat model's end of turn, ``<|im_end|>``, ``<|eot_id|>``, where the
    tokenizer's may end the text only), the token the chat template ends an assistant turn
    with (:func:`turn_end`: a base model's generation_config names only its end of text,
    so with the template it never stopped) and ``extra`` (``stop_token_ids``)."""
    extra = list(extra or [])
    require(all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in extra),
            f"{engine}.stop_token_ids must be non-negative ints; got {extra!r}")
    declared = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    declared = [declared] if isinstance(declared, int) else list(declared or [])
    eos, turn = getattr(tokenizer, "eos_token_id", None), turn_end(tokenizer)
    stops = tuple(dict.fromkeys(int(i) for i in [eos, *declared, turn, *extra] if i is not None))
    require(bool(stops), f"{engine}: no token ends a completion (the tokenizer has no eos "
            "token, the model's generation_config and chat template name none); set eos_token "
            f"in the tokenizer's tokenizer_config.json or give {engine}.stop_token_ids")
    return stops


#: the tags the rewards, the answer statistics and the tool-call parser read: kept in a
#: completion's text where a tokenizer made them special tokens (``skip_special_tokens``
#: dropped them: the answer after ``</think>`` was never found, a call never ran)
READ_TAGS = ("<think>", "</think>", "<answer>", "</answer>", "<tool_call>", "</tool_call>")


def special_token_id(tokenizer: Any, token: str) -> int | None:
    """The id of ``token`` where it is a special token (``skip_special_tokens`` drops it)."""
    try:  # an unknown token's id is the unk's; a tokenizer that does not say: None
        i = tokenizer.convert_tokens_to_ids(token)
        if not isinstance(i, int) or tokenizer.convert_ids_to_tokens(i) != token:
            return None
    except (AttributeError, TypeError, ValueError, KeyError):
        return None
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special = i in set(getattr(tokenizer, "all_special_ids", None) or ())
    return i if special or getattr(added.get(i), "special", False) else None


def read_tags(tokenizer: Any) -> dict[int, str]:
    """``{id: tag}`` of the :data:`READ_TAGS` that ``tokenizer`` made special tokens (empty
    in the usual case)."""
    ids = {tag: special_token_id(tokenizer, tag) for tag in READ_TAGS}
    return {i: tag for tag, i in ids.items() if i is not None}


def decode_texts(tokenizer: Any, rows: list[list[int]], tags: dict[int, str]) -> list[str]:
    """Each row of ids as text without special tokens but the ``tags`` (:func:`read_tags`):
    the others taken out, then one decode (a piece decoded apart lost its leading space
    under a SentencePiece decoder)."""
    if not tags:
        return tokenizer.batch_decode(rows, skip_special_tokens=True)
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    drop = set(getattr(tokenizer, "all_special_ids", None) or ()).union(
        i for i, token in added.items() if getattr(token, "special", False)) - set(tags)
    return tokenizer.batch_decode([[i for i in row if i not in drop] for row in rows],
                                  skip_special_tokens=False)


def turn_end(tokenizer: Any) -> int | None:
    """The special token the tokenizer's chat template writes right after an assistant
    message (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``); None without a template or
    when plain text follows the message."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    mark = "Zq7 answer"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": mark}],
            tokenize=False)
    except Exception:  # noqa: BLE001 -- a template that takes no such conversation
        return None
    after = text.rpartition(mark)[2] if isinstance(text, str) and mark in text else ""
    ids = tokenizer(after.lstrip(" "), add_special_tokens=False)["input_ids"] if after else []
    added = getattr(tokenizer, "added_tokens_decoder", {})
    special = set(getattr(tokenizer, "all_special_ids", [])) | {
        i for i, token in added.items() if getattr(token, "special", False)}
    return int(ids[0]) if ids and ids[0] in special else None


def check_engine_factory(engine: object, asynchronous: bool = False) -> None:
    """Refuse an interface named as ``model.engine`` (a protocol or an abstract class, which
    cannot be built), and, for an ``asynchronous`` fit (``model.max_staleness >= 1``), an
    engine class that samples in the trainer's process (nothing would overlap), before any
    model loads; a factory that is not a class is checked when it has built its engine."""
    engine = engine_class(engine)
    require(callable(engine), "model.engine must be an engine class (maxent_grpo.rollout."
            f"HFGenerateEngine, VLLMEngine, VLLMServerEngine) or a factory; got {engine!r}")
    abstract = inspect.isclass(engine) and (
        getattr(engine, "_is_protocol", False) is True or inspect.isabstract(engine))
    require(not abstract,
            f"model.engine: {getattr(engine, '__name__', type(engine).__name__)} is an "
            "interface, not an engine; name one (maxent_grpo.rollout.HFGenerateEngine, "
            "VLLMEngine, VLLMServerEngine) or a class of yours that implements it")
    require(not (asynchronous and samples_here(engine)),
            staleness_needs_a_server(getattr(engine, "__name__", "")))


def engine_class(engine: object) -> object:
    """The class ``model.engine`` names (the CLI gives ``partial(build, class, **options)``),
    or ``engine`` itself."""
    while isinstance(engine, functools.partial):
        engine = next((a for a in engine.args if inspect.isclass(a)), engine.func)
    return engine


def samples_here(engine: object) -> bool:
    """Whether ``model.engine`` is a class that samples in the trainer's process."""
    engine = engine_class(engine)
    return inspect.isclass(engine) and not getattr(engine, "generates_elsewhere", False)


def check_built_engine(engine: Any) -> Any:
    """``engine`` (what ``model.engine`` built), refused (ValueError) unless it has a
    ``generate`` and a ``sync`` (:class:`RolloutEngine`): one without ``sync`` trained a
    step, then stopped on an AttributeError."""
    lacks = [name for name in ("generate", "sync") if not callable(getattr(engine, name, None))]
    if not lacks:  # the evaluation passes its sampling: it failed at the first validation
        try:
            inspect.signature(engine.generate).bind([], [], 1, None)
        except TypeError:
            lacks = ["generate taking a sampling argument"]
        except ValueError:  # a builtin's signature that cannot be read
            pass
    require(not lacks, f"model.engine built a {type(engine).__name__}, which has no "
            f"{' and no '.join(lacks)}: a rollout engine has generate(prompts, answers, "
            "num_generations, sampling=None) and sync(model), which takes the policy's new "
            "weights (a no-op for an engine that samples from the model itself)")
    return engine


def staleness_needs_a_server(name: str) -> str:
    """The message refusing ``model.max_staleness >= 1`` with engine class ``name``."""
    return ("model.max_staleness >= 1 needs an engine that generates outside the trainer's "
            f"process (maxent_grpo.rollout.VLLMServerEngine); {name} samples here, so nothing "
            "would overlap: set max_staleness 0")

"""Multi-turn rollouts: the model writes, a tool or an environment answers, the model goes on.

:class:`MultiTurnEngine` wraps a rollout engine that can continue token sequences
(``continue_ids``: :class:`~maxent_grpo.rollout.HFGenerateEngine`,
:class:`~maxent_grpo.rollout.VLLMEngine` and :class:`~maxent_grpo.rollout.VLLMServerEngine`),
so all run this one loop. Per sample:

1. the first turn is the inner engine's ``generate`` (G samples per prompt, as always);
2. while the turn ended with a stop token and fewer than ``max_tool_calls`` calls ran:

   - **tools** (``model.tools``): the calls in the turn's text
     (:func:`~maxent_grpo.rollout.toolcall.parse_tool_calls`) run, each within the time
     limit (:class:`~maxent_grpo.rollout.toolcall.Toolbox`); a turn without a call ends
     the sample; every fault is a tool message the model reads;
   - **an environment** (``model.environment``): ``observation, done =
     env.step(turn_text)`` after every turn of the model that ended (the last allowed
     included; one cut by ``max_completion_length`` is not stepped); ``done`` or
     the last allowed step ends the sample, else the observation is a message (role
     ``env.role``, default ``"user"``). One environment per sample, built by the factory and
     ``reset(prompt, answer)`` before the first turn. An exception in ``step`` is a message
     (kind ``error``); a time-out ends the sample (kind ``timeout``: its thread may still
     be running); a ``step`` that returns something else than ``(str, bool)`` is a bug in
     the environment and stops the run (a ``UserCodeError`` naming it), as one in ``reset`` does;

   the messages are rendered by the tokenizer's chat template (the text that follows the
   model's end of turn, its eos token, up to the opening of the next assistant turn) and
   tokenised (with the template's special tokens, so a tool's text that spells one is read
   as one: it only conditions the model, its tokens are out of the loss); the model
   continues from ``prompt + completion so far``. A turn that ends on another of the
   engine's ``stop_token_ids`` is followed by the same text.
3. **Budget**: the whole completion, the model's tokens and the messages, holds at most
   ``max_new_tokens``; a message that leaves the model no room is cut and the row is
   truncated (and ends with an empty assistant message for the rewards).

The output is one :class:`~maxent_grpo.rollout.RolloutOutput` whose ``tool_mask`` marks the
tokens the model did not write (out of the loss and of every token count) and whose
``tools`` (:class:`~maxent_grpo.rollout.batch.ToolUsage`) holds each row's messages,
turns, calls and failures. Its texts keep the chat template's special tokens, so logged
samples show the turns. With sharded parameters (FSDP2, ZeRO-3), where every generate is a
collective, the ranks continue together: a rank with nothing left generates one token of a
placeholder row while others go on.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from maxent_grpo.rollout.batch import GenerationBatch
from maxent_grpo.rollout.hf import _model_device
from maxent_grpo.rollout.protocol import (
    ContinuableEngine,
    Continuation,
    RolloutOutput,
    SamplingSettings,
    ToolUsage,
    check_request,
    decode_texts,
    read_tags,
)
from maxent_grpo.rollout.toolcall import (
    FAILURE_KINDS,
    Toolbox,
    check_call_format,
    error_text,
    parse_tool_calls,
    timed_call,
    valid_text,
)
from maxent_grpo.validation import UserCodeError, check_int, check_seconds, require

__all__ = ["MultiTurnEngine", "environment_factory", "message_segment"]

_MARK = "\x00assistant-turn\x00"  # stands for the model's turn when the template is diffed
_QUESTION = {"role": "user", "content": "?"}  # the turn before the model's, when diffed


def message_segment(tokenizer: Any, messages: list[dict[str, str]],
                    tools: list[Any] | None = None, stops: Sequence[str] = ()) -> str:
    r"""The text that follows the model's end of turn (its eos token, or the one of
    ``stops``, the engine's stop tokens' texts, that the template writes) to hand ``messages``
    (tool or user messages) to it and open its next turn, as the tokenizer's chat template
    writes it (with ``tools=`` when given). ValueError for a template that rewrites earlier
    turns when a message is added.

    >>> from maxent_grpo.builtin.catalog import build_tiny_tokenizer
    >>> message_segment(build_tiny_tokenizer(), [{"role": "tool", "content": "42"}])
    '\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
    """
    import jinja2  # transformers' chat templates are jinja2's

    extra = {"tools": tools} if tools else {}
    # a reasoning template (Qwen3's) gives a last turn without reasoning an empty block that
    # it drops once the turn is not last: a turn with reasoning, as the model writes, too
    for turn in (_MARK, "<think>\n.\n</think>\n\n" + _MARK):
        base = [_QUESTION, {"role": "assistant", "content": turn}]
        try:
            before = tokenizer.apply_chat_template(base, tokenize=False, **extra)
            after = tokenizer.apply_chat_template(base + messages, tokenize=False,
                                                  add_generation_prompt=True, **extra)
        except jinja2.exceptions.TemplateError as err:  # e.g. no "tool" role, strict turns
            ids = " (the trainer's tool messages carry no tool_call_id, and it reads calls " \
                "written as <tool_call> blocks: docs/TOOLS.md)" if any(
                    m.get("role") == "tool" for m in messages) else ""
            raise ValueError(
                "multi-turn rollouts need a chat template that takes the roles "
                f"{[m.get('role') for m in messages]} after the model's turn; this "
                f"tokenizer's refuses them ({type(err).__name__}: {err}){ids}") from err
        eos = tokenizer.eos_token or ""  # a template that ends a conversation with it (Phi-4)
        if eos and before.endswith(eos) and not after.startswith(before):
            before = before[:-len(eos)]
        if _MARK in before and after.startswith(before):
            break
    require(_MARK in before and after.startswith(before),
            "multi-turn rollouts need a chat template that renders a conversation by "
            "appending each message; this tokenizer's template rewrites earlier turns")
    tail = before[before.rindex(_MARK) + len(_MARK):]
    for stop in dict.fromkeys([tokenizer.eos_token or "", *stops]):
        if stop and tail.startswith(stop):  # the model's own stop token ends its turn
            tail = tail[len(stop):]
            break
    return tail + after[len(before):]


def _first_tokens(tokenizer: Any, text: str, room: int) -> list[int]:
    """``text``'s token ids, all of them when they fit in ``room``, else more than ``room``
    of its first ones: a reply far over the budget is tokenized by growing prefixes (4
    characters a token of the room, doubled until they give more than ``room`` tokens);
    tokenized whole it took seconds a megabyte, with the tokenizer's warning of a length
    the model never reads."""
    cut = 4 * (max(room, 0) + 1)
    while cut < len(text):
        ids = tokenizer(text[:cut], add_special_tokens=False)["input_ids"]
        if len(ids) > room:  # the whole text has at least room: the row is cut here
            return ids
        cut *= 2
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def environment_factory(spec: dict[str, Any] | str) -> Callable[[], Any]:
    """A zero-argument factory from ``model.environment``: ``{class_path: "pkg.mod.Class",
    init_args: {...}}``, or the class path alone (as ``--model.objective`` takes one;
    ``pkg.mod:Class`` also accepted). The class must have ``reset(prompt, answer)`` (the
    prompt as the model reads it, after the chat template, and the row's answer) and
    ``step(action) -> (observation, done)``; ValueError names what is missing."""
    spec = {"class_path": spec} if isinstance(spec, str) else spec
    require(isinstance(spec, dict) and isinstance(spec.get("class_path"), str),
            "model.environment must be {class_path: 'package.module.Class', init_args: {...}}; "
            f"got {spec!r}")
    unknown = set(spec) - {"class_path", "init_args"}
    require(not unknown, f"model.environment: unknown keys {sorted(unknown)}; "
            "only class_path and init_args")
    path, args = spec["class_path"], spec.get("init_args") or {}
    require(isinstance(args, dict), f"model.environment.init_args must be a mapping; got {args!r}")
    module, sep, name = path.partition(":")
    if not sep:
        module, _, name = path.rpartition(".")
    require(not module.startswith("."), f"model.environment: {path!r} is a relative path; give "
            "the whole one, e.g. 'mypackage.envs.Guess'")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"model.environment: cannot import {path!r} ({err})") from err
    for method in ("reset", "step"):
        require(callable(getattr(cls, method, None)),
                f"model.environment: {path} has no {method}() method; an environment needs "
                "reset(prompt, answer) and step(action) -> (observation, done)")
    try:  # a misspelt option fails here, not at the first rollout after the model loaded
        inspect.signature(cls).bind(**args)
    except TypeError as err:
        raise ValueError(f"model.environment.init_args do not fit {path}: {err}") from err
    except ValueError:  # a class whose signature Python cannot read: checked when built
        pass
    def build() -> Any:  # each instance its own copy of the options (a board, a list)
        return cls(**copy.deepcopy(args))

    build.__name__ = cls.__name__
    return build


def _is_flag(value: Any) -> bool:
    """Whether an environment's ``done`` is a truth value: a bool or int, or a one-element
    boolean NumPy value or tensor (``numpy.bool_``, ``torch.tensor(True)``)."""
    if isinstance(value, (bool, int)):
        return True
    return str(getattr(value, "dtype", "")) in ("bool", "torch.bool") and \
        getattr(value, "shape", None) in ((), torch.Size([]))


class MultiTurnEngine:
    """A rollout engine whose samples are multi-turn exchanges (see the module docstring).

    Args:
        engine: the inner engine; it must have ``continue_ids``.
        tokenizer: the policy's tokenizer, with the chat template that renders the messages.
        sampling: the default sampling settings (the inner engine's).
        toolbox: the tools, or None.
        environment: a zero-argument environment factory, or None (exactly one of the two).
        max_tool_calls: the most tool calls (or environment steps) per sample (>= 1).
        timeout: seconds an environment's ``step`` may take (the tools have the toolbox's).
    """

    def __init__(
        self, engine: ContinuableEngine, tokenizer: Any, sampling: SamplingSettings,
        toolbox: Toolbox | None = None, environment: Callable[[], Any] | None = None,
        max_tool_calls: int = 4, timeout: float = 10.0,
    ) -> None:
        require(callable(getattr(engine, "continue_ids", None)),
                f"model.tools / model.environment need an engine that continues token "
                f"sequences (HFGenerateEngine, VLLMEngine); {type(engine).__name__} has no "
                "continue_ids")
        require((toolbox is None) != (environment is None),
                "a multi-turn rollout takes model.tools or model.environment, not both")
        check_int("model.max_tool_calls", max_tool_calls, minimum=1)
        check_seconds("model.tool_timeout", timeout)
        self.engine, self.tokenizer, self.sampling = engine, tokenizer, sampling
        self.toolbox, self.environment = toolbox, environment
        self.max_tool_calls, self.timeout = max_tool_calls, float(timeout)
        self._schemas = toolbox.schemas if toolbox is not None else None
        # the texts of the tokens that end a turn: eos, a chat model's end of turn, ...
        self._stops = [t for t in dict.fromkeys([tokenizer.eos_token or "", *(
            tokenizer.decode([i]) for i in getattr(engine, "stop_token_ids", ()))]) if t]
        # a template that cannot render the messages fails now, not in the first rollout
        # (an environment's own role, when not "user", at its first rollout)
        self._roles_shown: set[str] = set()
        self._check_role("tool" if toolbox else "user")
        if toolbox is not None:
            check_call_format(tokenizer, toolbox)
        # special tokens are not a turn's text, but the call and answer tags are where a
        # tokenizer made them special (skipped, no call ever ran)
        self._tags = read_tags(tokenizer)

    def _text(self, ids: list[int]) -> str:
        """A model turn's text (parsed, rewarded): no special tokens but the read tags."""
        return decode_texts(self.tokenizer, [ids], self._tags)[0]

    def _check_role(self, role: str) -> None:
        """Refuse a chat template that leaves out ``role``'s messages: it would hide every
        reply from the model (checked once per role)."""
        if role in self._roles_shown:
            return
        probe = "maxent-grpo-probe-7351"
        require(probe in message_segment(self.tokenizer, [{"role": role, "content": probe}],
                                         self._schemas, self._stops),
                f"multi-turn rollouts need a chat template that shows {role!r} messages; this "
                "tokenizer's template leaves them out, so the model would never read a reply")
        self._roles_shown.add(role)

    def sync(self, model: Any) -> None:
        """The inner engine's ``sync``."""
        self.engine.sync(model)

    # ------------------------------------------------------------------ messages
    def _replies(self, row: int, text: str, calls: list[int], failures: dict[str, list[int]],
                 envs: list[Any] | None) -> list[dict[str, str]] | None:
        """The messages answering the model's turn ``text``, or None when the sample ends."""
        if envs is not None:  # every turn that ended is an action, the last one included
            env = envs[row]
            calls[row] += 1
            finished, value, error = timed_call(lambda: env.step(text), self.timeout,
                                                "environment")
            if not finished:  # its thread may still run: no further step on it
                failures["timeout"][row] += 1
                return None
            if error is not None:
                failures["error"][row] += 1
                observation, done = valid_text(error_text(error)), False
            elif (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str)
                  and _is_flag(value[1])):
                observation, done = valid_text(value[0]), bool(value[1])
            else:
                raise UserCodeError(f"{type(env).__name__}.step must return (observation: "
                                    f"str, done: bool); got {value!r:.200}")
            if done or calls[row] >= self.max_tool_calls:
                return None
            return [{"role": getattr(env, "role", "user"), "content": observation}]
        parsed = parse_tool_calls(text)
        left = self.max_tool_calls - calls[row]
        if not parsed:
            return None
        if left <= 0:  # calls past the limit end the sample, counted
            calls[row] += len(parsed)
            failures["over_limit"][row] += len(parsed)
            return None
        out = []
        for number, call in enumerate(parsed):
            calls[row] += 1
            if number >= left:  # said to the model, which would otherwise wait for a result
                failures["over_limit"][row] += 1
                out.append({"role": "tool", "content": valid_text(  # a model-written name
                    f"Error: {call.name or 'the call'} was not run: a sample runs at most "
                    f"{self.max_tool_calls} tool calls")})
                continue
            result = self.toolbox.run(call)
            if result.failure is not None:
                failures[result.failure][row] += 1
            out.append({"role": "tool", "content": result.text})
        return out

    # ------------------------------------------------------------------ the loop
    def _continue_together(self, go: bool) -> bool:
        """Whether any rank continues (every rank when the inner engine's generate is a
        collective), else this rank's ``go``."""
        dist = torch.distributed
        if not (getattr(self.engine, "collective", False) and dist.is_available()
                and dist.is_initialized()):
            return go
        flag = torch.tensor([int(go)], device=_model_device(getattr(self.engine, "model", None)))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def generate(
        self, prompts: list[str], answers: list[str], num_generations: int,
        sampling: SamplingSettings | None = None,
    ) -> RolloutOutput:
        """G = ``num_generations`` multi-turn samples per prompt (see the module docstring)."""
        s = check_request(prompts, answers, num_generations, sampling, self.sampling)
        start, G = time.perf_counter(), num_generations
        first = self.engine.generate(prompts, answers, G, s)
        N, budget, tok = first.completion_ids.shape[0], s.max_new_tokens, self.tokenizer
        lengths = first.completion_mask.sum(1).tolist()
        ids = [first.completion_ids[i, :n].tolist() for i, n in enumerate(lengths)]
        tool = [[False] * n for n in lengths]
        logps = None if first.sampler_logps is None else [
            first.sampler_logps[i, :n].tolist() for i, n in enumerate(lengths)]
        truncated = first.truncated.tolist()
        heads = [first.prompt_ids[i][first.prompt_mask[i]].tolist() for i in range(N)]
        turns, calls = [1] * N, [0] * N
        failures = {kind: [0] * N for kind in FAILURE_KINDS}
        envs = None
        if self.environment is not None:
            try:
                envs = [self.environment() for _ in range(N)]
            except (Exception, SystemExit) as err:  # sys.exit: not the run's end
                raise UserCodeError(f"{getattr(self.environment, '__name__', 'environment')}"
                                    f"() (model.environment) failed: {type(err).__name__}: "
                                    f"{err}") from err
            for role in dict.fromkeys(getattr(env, "role", "user") for env in envs):
                self._check_role(role)
            for i, env in enumerate(envs):
                try:
                    env.reset(prompts[i // G], answers[i // G])
                except (Exception, SystemExit) as err:  # sys.exit: not the run's end
                    raise UserCodeError(f"{type(env).__name__}.reset failed on prompt "
                                        f"{prompts[i // G]!r:.200}: {type(err).__name__}: "
                                        f"{err}") from err
        messages = [[{"role": "assistant", "content": self._text(x)}] for x in ids]

        def extend(i: int, new: list[int], is_tool: bool, new_logps: list[float] | None) -> None:
            ids[i] += new
            tool[i] += [is_tool] * len(new)
            if logps is not None:
                logps[i] += new_logps if new_logps is not None else [0.0] * len(new)

        active = [i for i in range(N) if not truncated[i]]
        while True:
            go = []
            for i in active:
                if len(ids[i]) >= budget and envs is None and calls[i] < self.max_tool_calls:
                    # no room for a tool's reply
                    if parse_tool_calls(messages[i][-1]["content"]):  # not run: cut here
                        truncated[i] = True
                        messages[i].append({"role": "assistant", "content": ""})
                    continue
                replies = self._replies(i, messages[i][-1]["content"], calls, failures, envs)
                if replies is None:
                    continue
                messages[i] += replies
                room = budget - len(ids[i])
                segment = _first_tokens(
                    tok, message_segment(tok, replies, self._schemas, self._stops), room)
                extend(i, segment[:room], True, None)
                if len(segment) >= room:  # no room left for the model to answer
                    truncated[i] = True
                    messages[i].append({"role": "assistant", "content": ""})
                else:
                    go.append(i)
            if not self._continue_together(bool(go)):
                break
            rows = go or [0]  # a placeholder row keeps a collective generate in step
            outs: list[Continuation] = self.engine.continue_ids(
                [heads[i] + ids[i] for i in rows],
                [budget - len(ids[i]) if go else 1 for i in rows], s)
            active = []
            for i, out in zip(go, outs, strict=False):
                extend(i, out.ids, False, out.logps)
                turns[i] += 1
                messages[i].append({"role": "assistant", "content": self._text(out.ids)})
                if out.stopped:
                    active.append(i)
                else:
                    truncated[i] = True
        return self._output(first, prompts, ids, tool, logps, truncated, messages,
                            turns, calls, failures, envs, time.perf_counter() - start)

    def _output(self, first: RolloutOutput, prompts: list[str], ids: list[list[int]],
                tool: list[list[bool]], logps: list[list[float]] | None, truncated: list[bool],
                messages: list[list[dict[str, str]]], turns: list[int], calls: list[int],
                failures: dict[str, list[int]], envs: list[Any] | None,
                seconds: float) -> RolloutOutput:
        """The rows as one :class:`RolloutOutput` (right-padded to the longest)."""
        N, T = len(ids), max(1, max(len(x) for x in ids))
        device, pad = first.completion_ids.device, self.tokenizer.pad_token_id
        completion_ids = torch.full((N, T), pad, dtype=torch.long)
        completion_mask = torch.zeros(N, T, dtype=torch.bool)
        tool_mask = torch.zeros(N, T, dtype=torch.bool)
        sampler = None if logps is None else torch.zeros(N, T, dtype=torch.float32)
        for i, row in enumerate(ids):
            completion_ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            completion_mask[i, :len(row)] = True
            tool_mask[i, :len(row)] = torch.tensor(tool[i], dtype=torch.bool)
            if sampler is not None:
                sampler[i, :len(row)] = torch.tensor(logps[i], dtype=torch.float32)
        texts = [self.tokenizer.decode(row, skip_special_tokens=False) for row in ids]
        texts = [next((t[: -len(e)] for e in self._stops if t.endswith(e)), t) for t in texts]
        long = torch.long
        info = [{"tool_calls": calls[i],  # what every reward call receives per completion
                 "tool_failures": sum(counts[i] for counts in failures.values()),
                 "exchange_lengths": len(ids[i]),
                 **({} if envs is None else {"environments": envs[i]})} for i in range(N)]
        return RolloutOutput(
            batch=GenerationBatch.of_rows(
                prompts, first.batch.answers, texts,
                None if sampler is None else sampler.sum(-1).tolist(), info),
            prompt_ids=first.prompt_ids, prompt_mask=first.prompt_mask,
            completion_ids=completion_ids.to(device), completion_mask=completion_mask.to(device),
            truncated=torch.tensor(truncated, dtype=torch.bool, device=device),
            generate_seconds=seconds,
            sampler_logps=None if sampler is None else sampler.to(device),
            tool_mask=tool_mask.to(device),
            tools=ToolUsage(
                messages=messages, turns=torch.tensor(turns, dtype=long),
                calls=torch.tensor(calls, dtype=long),
                failures={k: torch.tensor(v, dtype=long) for k, v in failures.items()},
                environments=envs),
        )

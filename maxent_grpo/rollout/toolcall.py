"""Tools the policy may call in a rollout: their schemas, the calls parsed from its text, and
running a call so that no fault of the tool or of the call stops training.

A tool is a plain Python function with typed arguments and a Google-style docstring, as
TRL users write them; its JSON schema (``transformers.utils.get_json_schema``) is what the
chat template shows the model (``apply_chat_template(..., tools=...)``)::

    def calculate(expression: str) -> str:
        \"\"\"Evaluate an arithmetic expression.

        Args:
            expression: the expression, e.g. "12 * (3 + 4)".
        \"\"\"

``model.tools`` names tools by import path (``package.module:function`` or
``package.module.function``) or by a built-in name (:data:`BUILTIN_TOOLS`).

Call format (:func:`parse_tool_calls`): the Hermes format of Qwen2.5's chat template, also
the built-in models' one: each call a JSON object between tags,
``<tool_call>{"name": "calculate", "arguments": {"expression": "2 + 3"}}</tool_call>``
(``"parameters"``, Llama's name, read as ``"arguments"`` where that is missing).

Faults. :meth:`Toolbox.run` never raises; each fault (a malformed call, an unknown tool,
bad arguments, the tool's exception, the time limit) becomes the text the model reads as
the tool's answer and a kind of :data:`FAILURE_KINDS`, counted in
``train/tools/failures/<kind>``: the table in docs/TOOLS.md, "Faults never stop training".

Where a call runs (``isolation``, ``model.tool_isolation``): ``"thread"`` (the default), a
daemon thread of this process, never through a shell; the rollout waits at most ``timeout``
seconds, but Python cannot stop a thread, so a call that never returns keeps its thread
until the process ends. ``"process"``: a fresh sandboxed process per call
(:mod:`maxent_grpo.rollout.sandbox`: rlimits, its own uid as root, no network, the host's
files read-only, killed with everything it started at the time limit), so a hung tool is
killed; the tool must be a module-level function, and what it returns comes back as text; a
failure of the sandbox itself is an ``error`` message too. The built-in ``python``
tool (:func:`~maxent_grpo.rollout.sandbox.python`, model-written code) always runs in the
sandbox, whatever the isolation, with the toolbox's time limit; its faults are in the
sandbox module's table (an exception, an exit status or a signal is ``error``).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import re
import threading
import typing
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from maxent_grpo.rollout import sandbox
from maxent_grpo.validation import UserCodeError, check_choice, check_seconds, require

__all__ = ["BUILTIN_TOOLS", "FAILURE_KINDS", "ISOLATIONS", "ToolCall", "ToolResult",
           "Toolbox", "error_text", "parse_tool_calls", "resolve_tool", "resolve_tools",
           "timed_call", "tool_list"]

#: built-in tool name -> import path
BUILTIN_TOOLS = {"calculate": "maxent_grpo.tasks.calculator:calculate",
                 "python": "maxent_grpo.rollout.sandbox:python"}

#: where a tool call runs (``model.tool_isolation``; the module docstring)
ISOLATIONS = ("thread", "process")
_POOL_LOCK = threading.Lock()


def _new_lock_after_fork() -> None:
    global _POOL_LOCK
    _POOL_LOCK = threading.Lock()  # a forked child never waits on its parent's threads


os.register_at_fork(after_in_child=_new_lock_after_fork)

#: the kinds of failed call, in the order they are logged
FAILURE_KINDS = ("malformed", "unknown_tool", "bad_arguments", "error", "timeout",
                 "over_limit")

_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_OPEN = "<tool_call>"
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list,), "object": (dict,), "null": (type(None),),
}


@dataclass(frozen=True)
class ToolCall:
    """One call parsed from the model's text.

    Attributes:
        name: the tool's name ("" when malformed).
        arguments: the keyword arguments (empty when malformed).
        malformed: why the call could not be read, or None.
    """

    name: str
    arguments: dict[str, Any]
    malformed: str | None = None


@dataclass(frozen=True)
class ToolResult:
    """What a call gave: ``text`` (the tool message the model reads) and ``failure``, one of
    :data:`FAILURE_KINDS`, or None when the tool returned."""

    text: str
    failure: str | None = None

    def __post_init__(self) -> None:  # a text the tokenizer and the JSONL files can take
        object.__setattr__(self, "text", valid_text(self.text))


def valid_text(text: str) -> str:
    """``text`` with what UTF-8 cannot encode (a lone surrogate: a model-written
    ``"\\ud800"`` in a call's JSON, echoed by a tool) replaced by ``?``; the tokenizer would
    refuse it and stop the rollout."""
    return text.encode("utf-8", "replace").decode("utf-8")


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The calls in ``text``, in order: every ``<tool_call>...</tool_call>`` block (an
    opening never closed, to the end or before the opening of a block that is read, is
    malformed; a block whose JSON holds the text ``<tool_call>`` is one call).

    >>> parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    [ToolCall(name='f', arguments={'x': 1}, malformed=None)]
    >>> parse_tool_calls("<tool_call>{oops</tool_call>")[0].malformed
    'not a JSON object'
    """
    calls = []
    for match in _CALL.finditer(text):
        body, closed = match.group(1), bool(match.group(2))
        whole = _read_call(body) if closed else None
        pieces = [body] if whole is not None and whole.malformed is None else body.split(_OPEN)
        for k, piece in enumerate(pieces):  # openings never closed, then the last one's block
            last = closed and k == len(pieces) - 1
            calls.append((whole if len(pieces) == 1 else _read_call(piece)) if last else ToolCall(
                "", {}, "no closing </tool_call>"))
    return calls


def _read_call(body: str) -> ToolCall:
    """The call a closed block's ``body`` holds, or the reason it cannot be read."""
    try:
        call = json.loads(body.strip())
    except ValueError:
        call = None
    except RecursionError:  # model-written text may nest brackets at any depth
        return ToolCall("", {}, "JSON nested too deeply")
    if not isinstance(call, dict):
        return ToolCall("", {}, "not a JSON object")
    key = "arguments" if "arguments" in call or "parameters" not in call else "parameters"
    name, arguments = call.get("name"), call.get(key, {})
    others = [k for k in call if k not in ("name", key, "id", "type")]
    if key not in call and others:  # "args": {...} dropped, the tool ran on its defaults
        return ToolCall("", {}, f'no "arguments" object (found {others})')
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        with contextlib.suppress(ValueError, RecursionError):  # left a string: refused below
            arguments = json.loads(arguments)
    if not isinstance(name, str) or not name:
        return ToolCall("", {}, 'no "name" string')
    if not isinstance(arguments, dict):
        return ToolCall(name, {}, '"arguments" is not an object')
    return ToolCall(name, arguments)


def check_call_format(tokenizer: Any, toolbox: Toolbox) -> None:
    """Warn when the chat template writes an assistant's tool call in another format than
    the ``<tool_call>`` blocks :func:`parse_tool_calls` reads (Llama 3's JSON, Mistral's
    ``[TOOL_CALLS]``): a model that calls as its template shows it never had a call run."""
    name, shown = toolbox.schemas[0]["function"]["name"], None
    for arguments in ({"x": "probe"}, '{"x": "probe"}'):  # as an object, as JSON text
        call = [{"id": "probe0001", "type": "function", "function": {  # (Mistral's: 9 long)
            "name": name, "arguments": arguments}}]
        try:
            plain, text = (tokenizer.apply_chat_template(
                [{"role": "user", "content": "?"}, {"role": "assistant", "content": "", **extra}],
                tokenize=False, tools=toolbox.schemas) for extra in ({}, {"tool_calls": call}))
        except Exception:  # noqa: BLE001 - a template that takes no such turn: the next form
            continue
        if any(c.name == name for c in parse_tool_calls(text)):
            return
        if plain != text and shown is None:  # it writes calls, in some other form
            at = text.find(name, len(os.path.commonprefix([plain, text])))
            shown = text[max(0, at - 40):at + 60] if at >= 0 else text[-100:]
    if shown is not None:
        warnings.warn(
            f"this tokenizer's chat template writes a tool call as {shown!r}, not as the "
            "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> blocks the trainer "
            "reads (docs/TOOLS.md): calls the model writes in its template's format will not "
            "run; show the model the <tool_call> format (data.system_prompt) or use a model "
            "whose template writes it (Qwen2.5's, Qwen3's)", stacklevel=3)


def tool_list(tools: Any) -> list[Any]:
    """``model.tools`` as a list: any sequence of entries, not one string (whose characters
    were taken for tool names)."""
    require(isinstance(tools, Iterable) and not isinstance(tools, (str, bytes, Mapping)),
            f"model.tools must be a list of tools; got {tools!r} (one tool: [{tools!r}])")
    return list(tools)


def resolve_tools(tools: Sequence[str | Callable[..., Any]] | None) -> tuple[Callable, ...]:
    """The functions of a list of ``model.tools`` entries (:func:`resolve_tool`)."""
    return tuple(resolve_tool(t) for t in ([] if tools is None else tool_list(tools)))


def resolve_tool(spec: str | Callable[..., Any]) -> Callable[..., Any]:
    """The function ``spec`` names: a built-in name (:data:`BUILTIN_TOOLS`), an import path
    ``package.module:function`` or ``package.module.function``, or a callable itself.
    ValueError names the entry of ``model.tools`` that cannot be found."""
    if callable(spec):
        return spec
    require(isinstance(spec, str) and spec.strip(),
            f"model.tools entries must be import paths or built-in names; got {spec!r}")
    path = BUILTIN_TOOLS.get(spec, spec)
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    require(not module_name.startswith("."), f"model.tools: {spec!r} is a relative path; give "
            "the whole one, e.g. 'maxent_grpo.tasks.calculator:calculate'")
    try:
        fn = getattr(importlib.import_module(module_name), attr) if module_name else None
    except (ImportError, AttributeError) as err:
        raise ValueError(
            f"model.tools: cannot import {spec!r} ({err}); give 'package.module:function' or "
            f"one of the built-in tools {sorted(BUILTIN_TOOLS)}") from err
    except Exception as err:  # the module's own code failed: a SyntaxError, its raise
        raise UserCodeError(f"model.tools: cannot import {spec!r}: importing {module_name!r} "
                            f"raised {type(err).__name__}: {err}") from err
    require(callable(fn), f"model.tools: {spec!r} is not a function; give "
            f"'package.module:function' or one of {sorted(BUILTIN_TOOLS)}")
    return fn


def timed_call(fn: Callable[[], Any], timeout: float,
               name: str) -> tuple[bool, Any, BaseException | None]:
    """``fn()`` in a daemon thread named ``name``, waited for at most ``timeout`` seconds:
    ``(finished, value, error)``, ``finished`` False when it is still running (Python cannot
    stop it: the thread is marked ``abandoned``), else its return value or what it raised
    (any ``BaseException``: a ``sys.exit`` inside it is its fault, not the caller's).

    >>> timed_call(lambda: 1 / 0, 1.0, "demo")[::2]
    (True, ZeroDivisionError('division by zero'))
    """
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as err:
            outcome["error"] = err

    worker = threading.Thread(target=work, name=name, daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        worker.abandoned = True  # (what it waits on may stop serving it: the verifier)
        return False, None, None
    return True, outcome.get("value"), outcome.get("error")


def _schema(fn: Callable[..., Any]) -> dict[str, Any]:
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(fn)
    except Exception as err:  # no docstring, an argument without a type or description
        raise ValueError(
            f"model.tools: the tool {getattr(fn, '__name__', fn)!r} needs type hints on every "
            f"argument and a docstring with an Args section describing each ({err})") from err
    # transformers 5.17 gives a bare ``list`` or ``tuple`` hint the type "object" (5.25: "array")
    hints = typing.get_type_hints(fn)
    for name, prop in schema.get("function", {}).get("parameters", {}).get(
            "properties", {}).items():
        if hints.get(name) in (list, tuple) and prop.get("type") == "object":
            prop["type"] = "array"
    return schema


class Toolbox:
    """The run's tools, by name, with their schemas and a time limit per call.

    Args:
        tools: functions or the names :func:`resolve_tool` accepts.
        timeout: seconds one call may take (> 0).
        isolation: ``"thread"`` or ``"process"`` (:data:`ISOLATIONS`; the module docstring).

    >>> def add(a: int, b: int) -> int:
    ...     '''Add.
    ...
    ...     Args:
    ...         a: first.
    ...         b: second.
    ...     '''
    ...     return a + b
    >>> box = Toolbox([add], timeout=1.0)
    >>> box.run(ToolCall("add", {"a": 2, "b": 3})), box.run(ToolCall("add", {"a": "2"})).failure
    (ToolResult(text='5', failure=None), 'bad_arguments')
    """

    def __init__(self, tools: Sequence[str | Callable[..., Any]], timeout: float = 10.0,
                 isolation: str = "thread") -> None:
        require(isinstance(tools, (list, tuple)) and len(tools) > 0,
                f"model.tools must be a non-empty list of tools; got {tools!r}")
        check_seconds("model.tool_timeout", timeout)
        check_choice("model.tool_isolation", isolation, ISOLATIONS)
        self.timeout, self.isolation = float(timeout), isolation
        self._sandbox: sandbox.Sandbox | None = None  # the process-isolation pool, on first use
        self.functions: dict[str, Callable[..., Any]] = {}
        self.schemas: list[dict[str, Any]] = []  # what the chat template shows, in order
        self._properties: dict[str, dict[str, Any]] = {}  # name -> its arguments' schemas
        for spec in tools:
            fn = resolve_tool(spec)
            require(not (inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)
                         or inspect.isgeneratorfunction(fn)),  # a sync wrapper passes
                    f"model.tools: {getattr(fn, '__qualname__', spec)} is an async or "
                    "generator function, which a call would not run (its result was shown "
                    "as '<coroutine object ...>' and counted a success): write the tool as a "
                    "plain def that returns its answer (an async one runs in it with "
                    "asyncio.run)")
            schema = _schema(fn)
            name = schema["function"]["name"]
            require(name not in self.functions, f"model.tools names the tool {name!r} twice")
            self.functions[name] = fn
            self.schemas.append(schema)
            self._properties[name] = schema["function"]["parameters"].get("properties", {})
            if isolation == "process" and fn is not sandbox.python:
                sandbox.tool_reference(fn)  # importable by a fresh process, or ValueError

    def _check_arguments(self, name: str, arguments: dict[str, Any]) -> str | None:
        """Why ``arguments`` do not fit tool ``name``'s signature and schema, or None."""
        fn = self.functions[name]
        try:
            inspect.signature(fn).bind(**arguments)
        except TypeError as err:
            return str(err)
        properties = self._properties[name]
        for key, value in arguments.items():
            if value is None and properties.get(key, {}).get("nullable"):
                continue  # an Optional[...] argument given null
            kinds = properties.get(key, {}).get("type")
            allowed = tuple(t for k in ([kinds] if isinstance(kinds, str) else kinds or [])
                            for t in _JSON_TYPES.get(k, (object,)))
            wrong_bool = isinstance(value, bool) and bool not in allowed and object not in allowed
            if allowed and (not isinstance(value, allowed) or wrong_bool):
                return f"{key!r} must be {kinds}; got {_shown(value)}"
        return None

    def run(self, call: ToolCall) -> ToolResult:
        """Run one call within the time limit; every fault is a :class:`ToolResult` with its
        kind (see the module docstring), never an exception."""
        if call.malformed is not None:
            return ToolResult(f"Error: malformed tool call ({call.malformed})", "malformed")
        if call.name not in self.functions:
            return ToolResult(f"Error: unknown tool {call.name!r}; the tools are: "
                              f"{', '.join(self.functions)}", "unknown_tool")
        problem = self._check_arguments(call.name, call.arguments)
        if problem is not None:
            return ToolResult(f"Error: bad arguments for {call.name}: {problem}", "bad_arguments")
        fn = self.functions[call.name]
        if fn is sandbox.python or self.isolation == "process":
            try:
                if fn is sandbox.python:
                    ran = sandbox.shared_sandbox().run(call.arguments["code"], self.timeout)
                else:
                    ran = self._pool().call(fn, call.arguments, self.timeout)
                return ToolResult(ran.message(call.name), ran.failure)
            except Exception as err:  # the sandbox's own fault: still only a message
                return ToolResult(f"Error: the sandbox could not run {call.name} "
                                  f"({type(err).__name__}: {err})", "error")
        finished, value, error = timed_call(lambda: fn(**call.arguments), self.timeout,
                                            f"tool:{call.name}")
        if not finished:
            return ToolResult(f"Error: {call.name} gave no result within {self.timeout:g} s",
                              "timeout")
        if error is not None:
            return ToolResult(error_text(error), "error")
        if isinstance(value, str):
            return ToolResult(value)
        return ToolResult(_shown(value, limit=None))

    def _pool(self) -> sandbox.Sandbox:
        with _POOL_LOCK:
            if self._sandbox is None:
                self._sandbox = sandbox.Sandbox(self.timeout, tools=[
                    f for f in self.functions.values() if f is not sandbox.python])
            return self._sandbox

    def close(self) -> None:
        """Stop the process-isolation pool, if one started, and the shared sandbox of the
        ``python`` tool, if this toolbox has it (a later call starts them again)."""
        pool, self._sandbox = self._sandbox, None
        if pool is not None:
            pool.close()
        if sandbox.python in self.functions.values():
            sandbox.close_shared_sandbox()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_sandbox": None}  # a copy starts its own pool


def _shown(value: Any, limit: int | None = 200) -> str:
    """``value`` as JSON (else ``str``), for a message the model reads; a value too deep to
    encode (model-written arguments can nest a thousand levels) or that ``str`` refuses (an
    int of more than 4,300 digits) is named, never raised."""
    try:
        text = json.dumps(value, ensure_ascii=False)  # the model reads Zürich, not Z\u00fcrich
    except (TypeError, ValueError, RecursionError):
        try:
            text = str(value)
        except RecursionError:
            return f"<a {type(value).__name__} nested too deeply to show>"
        except Exception as err:  # noqa: BLE001 - any __str__ may fail; the model reads this
            return f"<a {type(value).__name__} that cannot be shown ({type(err).__name__})>"
    return text if limit is None or len(text) <= limit else text[:limit] + "..."


def error_text(error: BaseException) -> str:
    """``Error: <type>: <message>`` for the model; the type alone when the message cannot
    be built (an exception whose text holds a value ``str`` refuses)."""
    try:
        return f"Error: {type(error).__name__}: {error}"
    except Exception:  # noqa: BLE001
        return f"Error: {type(error).__name__}"

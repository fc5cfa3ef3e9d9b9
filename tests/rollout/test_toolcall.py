"""Tools: calls parsed from the model's text, and every fault of a call turned into a tool
message and a counted kind, never an exception (the fault table of
:mod:`maxent_grpo.rollout.toolcall`)."""

from __future__ import annotations

import doctest
import time

import pytest

from maxent_grpo.rollout import multiturn, protocol, toolcall
from maxent_grpo.rollout.toolcall import (
    FAILURE_KINDS,
    Toolbox,
    ToolCall,
    ToolResult,
    parse_tool_calls,
    resolve_tool,
)
from maxent_grpo.tasks import calculator
from maxent_grpo.tasks.calculator import calculate, tool_arithmetic


def divide(a: int, b: int) -> float:
    """Divide a by b.

    Args:
        a: the dividend.
        b: the divisor.
    """
    return a / b


def nap(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: how long to sleep.
    """
    time.sleep(seconds)
    return "awake"


def listing(n: int) -> list:
    """The numbers below n.

    Args:
        n: the bound.
    """
    return list(range(n))


def no_docs(x: int) -> int:
    return x


def quits(code: int | None = None) -> str:
    """Exit the process.

    Args:
        code: the exit code, or null.
    """
    raise SystemExit(code)


@pytest.mark.parametrize("module", [toolcall, multiturn, protocol, calculator])
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.failed == 0 and result.attempted > 0


def test_calls_are_parsed_in_the_hermes_format():
    text = ('I will compute. <tool_call>{"name": "calculate", "arguments": {"expression": '
            '"2 + 3"}}</tool_call> and <tool_call>\n{"name": "divide", "arguments": '
            '"{\\"a\\": 6, \\"b\\": 3}"}\n</tool_call>')
    calls = parse_tool_calls(text)
    assert calls == [ToolCall("calculate", {"expression": "2 + 3"}),
                     ToolCall("divide", {"a": 6, "b": 3})]  # arguments as a JSON string too
    assert parse_tool_calls("no call here") == []
    assert parse_tool_calls("<tool_call>{oops}</tool_call>")[0].malformed == "not a JSON object"
    assert parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>')[0].malformed == (
        'no "name" string')
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": [1]}</tool_call>')[0] \
        .malformed == '"arguments" is not an object'
    unclosed = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}')
    assert unclosed[0].malformed == "no closing </tool_call>"
    # a call without arguments is a call with none
    assert parse_tool_calls('<tool_call>{"name": "f"}</tool_call>') == [ToolCall("f", {})]


def test_a_call_is_read_as_written_by_other_models():
    """A tool-formats hunt: an opening never closed swallowed the next call whole (one
    "not a JSON object"); Llama's ``"parameters"`` were dropped and the tool ran on its
    defaults, as any misnamed key's. Readers: a call whose code holds the text
    ``<tool_call>`` is one call; "arguments" come before "parameters"."""
    import json
    import signal

    good = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    assert parse_tool_calls('<tool_call>{"name": "g", ' + good) == [
        ToolCall("", {}, "no closing </tool_call>"), ToolCall("f", {"x": 1})]
    assert parse_tool_calls("I will use <tool_call> now: " + good) == [
        ToolCall("", {}, "no closing </tool_call>"), ToolCall("f", {"x": 1})]
    assert parse_tool_calls('<tool_call>{"name": "f", "parameters": {"x": 2}}</tool_call>') == [
        ToolCall("f", {"x": 2})]
    assert parse_tool_calls('<tool_call>{"name": "f", "args": {"x": 2}}</tool_call>')[0] \
        .malformed == "no \"arguments\" object (found ['args'])"
    assert parse_tool_calls('<tool_call>{"name": "f", "id": "a", "type": "function"}'
                            '</tool_call>') == [ToolCall("f", {})]
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": 1}, "parameters": {}}'
                            '</tool_call>') == [ToolCall("f", {"x": 1})]
    for code in ('print(re.sub(r"<think>.*?</think>", "", s))', "print('<tool_call>')"):
        call = '<tool_call>' + json.dumps({"name": "python", "arguments": {"code": code}})
        assert parse_tool_calls(call + "</tool_call>") == [ToolCall("python", {"code": code})]
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError("quadratic")))
    signal.alarm(30)  # a tenth of a second here
    try:
        assert len(parse_tool_calls("<tool_call>" * 30000)) == 30000
        assert len(parse_tool_calls("<think></think>" * 20000 + good * 20000)) == 20000
    finally:
        signal.alarm(0)


def test_a_template_that_writes_calls_in_another_format_is_warned_of():
    """Llama 3's template writes a call as bare JSON, Mistral's after ``[TOOL_CALLS]``: the
    model's calls never ran, and the run said nothing (a tool-formats hunt). Hermes's
    template, and one that writes no calls at all, say nothing."""
    import copy
    import warnings

    from maxent_grpo.builtin.catalog import builtin_tiny_model_and_tokenizer
    from maxent_grpo.rollout.toolcall import Toolbox, check_call_format

    hermes = builtin_tiny_model_and_tokenizer()[1]
    llama = copy.deepcopy(hermes)
    llama.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% for c in m.tool_calls or [] %}{\"name\": \"{{ c.function.name }}\", "
        "\"parameters\": {{ c.function.arguments | tojson }}}{% endfor %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    silent = copy.deepcopy(llama)
    silent.chat_template = llama.chat_template.replace("{% for c in m.tool_calls or [] %}",
                                                       "{% for c in [] %}")
    # readers: a template that joins the arguments as text (DeepSeek's) raised on an object
    # and said nothing; one that writes <tool_call> blocks with text arguments is right
    joined, hermes_text = copy.deepcopy(llama), copy.deepcopy(llama)
    written = ("{\"name\": \"{{ c.function.name }}\", "
               "\"parameters\": {{ c.function.arguments | tojson }}}")
    assert written in llama.chat_template
    joined.chat_template = llama.chat_template.replace(
        written, "{{ c.function.name + ' ```json ' + c.function.arguments + '```' }}")
    hermes_text.chat_template = llama.chat_template.replace(
        written, "<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
                 "{{ c.function.arguments }}}</tool_call>")
    toolbox, said = Toolbox(["calculate"], timeout=2.0), []
    for tokenizer in (llama, hermes, silent, joined, hermes_text):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_call_format(tokenizer, toolbox)
        said.append([str(w.message) for w in caught])
    assert [len(s) for s in said] == [1, 0, 0, 1, 0], said
    assert '"parameters"' in said[0][0] and "<tool_call>" in said[0][0]


@pytest.mark.parametrize(("call", "kind", "text"), [
    (ToolCall("", {}, "not a JSON object"), "malformed",
     "Error: malformed tool call (not a JSON object)"),
    (ToolCall("search", {"q": "x"}), "unknown_tool",
     "Error: unknown tool 'search'; the tools are: divide, nap, listing, calculate"),
    (ToolCall("divide", {"a": 1}), "bad_arguments",
     "Error: bad arguments for divide: missing a required argument: 'b'"),
    (ToolCall("divide", {"a": 1, "b": 2, "c": 3}), "bad_arguments",
     "Error: bad arguments for divide: got an unexpected keyword argument 'c'"),
    (ToolCall("divide", {"a": "1", "b": 2}), "bad_arguments",
     "Error: bad arguments for divide: 'a' must be integer; got \"1\""),
    (ToolCall("divide", {"a": True, "b": 2}), "bad_arguments",
     "Error: bad arguments for divide: 'a' must be integer; got true"),
    (ToolCall("divide", {"a": 1, "b": 0}), "error",
     "Error: ZeroDivisionError: division by zero"),
    (ToolCall("calculate", {"expression": "__import__('os').system('ls')"}), "error",
     "Error: ValueError: unsupported characters; use integers, + - * / // % and parentheses"),
    (ToolCall("nap", {"seconds": 5}), "timeout", "Error: nap gave no result within 0.2 s"),
])
def test_every_fault_becomes_a_message_and_a_kind(call, kind, text):
    # Only the napping call gets the short limit: a loaded machine cannot turn a quick tool
    # into a time-out. The nap (5 s) is far longer than the bound below, so a time-out that
    # waited for the tool would fail it however slow the machine.
    box = Toolbox([divide, nap, "tests.rollout.test_toolcall:listing", "calculate"],
                  timeout=0.2 if kind == "timeout" else 60)
    start = time.perf_counter()
    result = box.run(call)
    assert (result.failure, result.text) == (kind, text)
    assert kind in FAILURE_KINDS
    assert time.perf_counter() - start < 4.5  # the time-out does not wait for the tool


def test_a_tool_that_exits_is_an_error_and_null_fits_an_optional_argument():
    box = Toolbox([quits], timeout=2)
    assert box.run(ToolCall("quits", {"code": None})) == ToolResult(
        "Error: SystemExit: None", "error")  # null is allowed for Optional[int]
    assert box.run(ToolCall("quits", {"code": "x"})).failure == "bad_arguments"


def test_results_are_text_and_json():
    box = Toolbox([divide, listing, nap, "calculate"], timeout=5)
    assert box.run(ToolCall("divide", {"a": 6, "b": 4})).text == "1.5"
    assert box.run(ToolCall("listing", {"n": 3})).text == "[0, 1, 2]"
    assert box.run(ToolCall("nap", {"seconds": 0})) == box.run(ToolCall("nap", {"seconds": 0.0}))
    assert box.run(ToolCall("calculate", {"expression": "37 * 84"})).text == "3108"
    assert [s["function"]["name"] for s in box.schemas] == ["divide", "listing", "nap",
                                                           "calculate"]


def test_tools_are_named_by_import_path_or_builtin_name():
    assert resolve_tool("calculate") is calculate
    assert resolve_tool("maxent_grpo.tasks.calculator:calculate") is calculate
    assert resolve_tool("maxent_grpo.tasks.calculator.calculate") is calculate
    with pytest.raises(ValueError, match="cannot import 'nowhere:fn'"):
        resolve_tool("nowhere:fn")
    with pytest.raises(ValueError, match="'.calculator:calculate' is a relative path"):
        resolve_tool(".calculator:calculate")  # was Python's TypeError, naming no option
    with pytest.raises(ValueError, match="is not a function"):
        resolve_tool("maxent_grpo.tasks.calculator:MAX_DIGITS")
    with pytest.raises(ValueError, match="needs type hints on every argument and a docstring"):
        Toolbox([no_docs])
    with pytest.raises(ValueError, match="names the tool 'divide' twice"):
        Toolbox([divide, divide])

    async def later(a: int) -> int:
        """Half of it.

        Args:
            a: a number.
        """
        return a // 2

    def steps(a: int):
        """Its digits.

        Args:
            a: a number.
        """
        yield from str(a)

    for never_run in (later, steps):  # its call made a coroutine, shown and counted a success
        with pytest.raises(ValueError, match="is an async or generator function"):
            Toolbox([never_run])
    import asyncio
    import functools

    @functools.wraps(later)
    def synced(a: int) -> int:  # what the message advises: a plain def that runs it
        return asyncio.run(later(a))

    assert Toolbox([synced]).run(ToolCall("later", {"a": 8})).text == "4"
    with pytest.raises(ValueError, match="non-empty list"):
        Toolbox([])
    with pytest.raises(ValueError, match="model.tool_timeout"):
        Toolbox([divide], timeout=0)
    with pytest.raises(ValueError, match=r"model.tool_timeout must be a finite number in \(0, "):
        Toolbox([divide], timeout=1e12)  # longer than a thread's join takes: OverflowError


def test_the_calculator_runs_no_code():
    assert calculate("12 * (3 + 4) - 6 / 2") == "81"
    assert calculate("-7 // 2") == "-4" and calculate("7 % 3") == "1"
    for bad in ("2 ** 10", "x + 1", "open('f')", "(1).real", "[1, 2]", "1.5 * 2", ""):
        with pytest.raises(ValueError):
            calculate(bad)
    with pytest.raises(ValueError, match="not a whole number"):
        calculate("7 / 2")
    with pytest.raises(ValueError, match="longer than 60 digits"):
        calculate("9" * 40 + " * " + "9" * 40)


def test_the_task_needs_the_tool():
    rows = tool_arithmetic(50, seed=3)
    assert {r["task"] for r in rows} == {"tool_arithmetic"}
    for row in rows:
        a, op, b = row["expression"].split()
        assert op == "*" and len(a) == len(b) == 2
        assert row["prompt"] == f"What is {row['expression']}?"
        assert row["answer"] == str(int(a) * int(b))
    assert tool_arithmetic(5, seed=3) == rows[:5]
    with pytest.raises(ValueError, match="ops"):
        tool_arithmetic(1, seed=0, ops="/")


def test_deeply_nested_values_are_named_not_raised():
    """A value the JSON encoder cannot write (too deep for the recursion limit) in a bad
    argument's message, or as a tool's result, is named in the message, never raised."""
    deep: list = []
    for _ in range(5000):
        deep = [deep]

    def nested(x: int) -> list:
        """Return a deep list.

        Args:
            x: ignored.
        """
        return deep

    box = Toolbox([nested, divide], timeout=5)
    bad = box.run(ToolCall("divide", {"a": deep, "b": 1}))
    assert bad.failure == "bad_arguments" and "nested too deeply" in bad.text
    result = box.run(ToolCall("nested", {"x": 1}))
    assert result.failure is None and "nested too deeply" in result.text


def test_closing_a_toolbox_stops_the_python_tools_shared_sandbox(monkeypatch):
    """The module's teardown closes the toolbox: a toolbox with the ``python`` tool stops the
    shared sandbox's processes (a later call starts them again); one without it leaves the
    shared sandbox to whoever else uses it."""
    from maxent_grpo.rollout import sandbox

    stopped: list[bool] = []
    monkeypatch.setattr(sandbox, "close_shared_sandbox", lambda: stopped.append(True))
    Toolbox([divide]).close()
    assert stopped == []
    Toolbox([divide, "python"]).close()
    assert stopped == [True]


def multiply(a: int, b: int) -> int:
    """Multiply.

    Args:
        a: a factor.
        b: the other.
    """
    return a * b


def square_fails(a: int) -> int:
    """Refuse, naming the square.

    Args:
        a: a number.
    """
    raise ValueError(a * a)


def test_a_result_or_an_error_python_cannot_print_is_named_not_raised():
    """Model-written arguments make an 8,000-digit int, which neither ``json.dumps`` nor
    ``str`` will print (over 4,300 digits): the rollout crashed with that ValueError."""
    huge = int("9" * 3000)
    box = Toolbox([multiply, square_fails], timeout=5)
    shown = box.run(ToolCall("multiply", {"a": huge, "b": huge}))
    assert shown == ToolResult("<a int that cannot be shown (ValueError)>")
    assert box.run(ToolCall("square_fails", {"a": huge})) == ToolResult(
        "Error: ValueError", "error")
    assert box.run(ToolCall("square_fails", {"a": 3})) == ToolResult("Error: ValueError: 9",
                                                                     "error")

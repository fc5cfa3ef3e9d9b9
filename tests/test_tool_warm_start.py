"""The call-format warm start of builtin:tiny-tools-warm: on the task's question (a product
of two two-digit numbers) it shows only the call, never a value; its direct answers are
right only by chance; and the shipped weights are the built-in model's and call the tool on
the task about half the time."""

from __future__ import annotations

import doctest
import re

import pytest
import torch

import maxent_grpo.builtin.tool_warm_start as warm
from maxent_grpo.builtin.catalog import (
    WEIGHTS_TOOLS,
    build_tiny_model,
    build_tiny_tokenizer,
    builtin_tiny_model_and_tokenizer,
)
from maxent_grpo.models import load_policy
from maxent_grpo.tasks.calculator import calculate


def test_docstring_examples() -> None:
    result = doctest.testmod(warm)
    assert result.failed == 0 and result.attempted > 0


def test_no_product_value_is_shown_and_direct_answers_are_chance() -> None:
    rows = warm.examples(4500, seed=1)
    direct = right = calls = task_calls = 0
    for prompt, parts in rows:
        a, op, b = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", prompt).groups()
        assert (op, len(a), len(b)) in warm.KINDS
        value = calculate(f"{a} {op} {b}")
        call = ("model", warm.tool_call_text(f"{a} {op} {b}"))
        if len(parts) == 1 and parts[0] != call:  # a direct answer, drawn at random
            direct += 1
            right += parts[0][1] == value
            low, high = warm.answer_range(op, len(a), len(b))
            assert low <= int(parts[0][1]) <= high
        elif (op, len(a), len(b)) == warm.TASK_KIND:  # the task: the call, nothing after
            task_calls += 1
            assert parts == [call]
        else:  # the question's own expression, the tool's result copied
            calls += 1
            assert parts == [call, (warm.MESSAGE, value), ("model", value)]
    assert 2000 <= direct <= 2500 and direct + calls + task_calls == 4500
    assert 180 <= task_calls <= 320  # 1/9 of the rows, half of them calls
    assert right / direct < 0.05  # chance: 1 in 19 (one-digit sums) to 1 in 9702 per kind


def test_the_tool_message_is_out_of_the_warm_start_loss() -> None:
    _, tokenizer = builtin_tiny_model_and_tokenizer()
    prompt, parts = next(r for r in warm.examples(10, seed=0) if len(r[1]) == 3)
    ids, att, lab = warm._encode(tokenizer, [(prompt, parts)])
    learned = tokenizer.decode(lab[0][lab[0] >= 0])
    assert learned == parts[0][1] + "<|im_end|>" + parts[2][1] + "<|im_end|>"
    assert "<tool_response>" in tokenizer.decode(ids[0][att[0].bool()])


def test_the_shipped_weights_are_the_builtin_and_call_half_the_time(tmp_path) -> None:
    from safetensors.torch import load_file

    model = load_policy("builtin:tiny-tools-warm", cache_dir=tmp_path)
    raw = load_file(str(WEIGHTS_TOOLS))
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in raw.items())
    _, tokenizer = builtin_tiny_model_and_tokenizer()
    skill = warm.measure(model, tokenizer, prompts=8, samples=8)
    assert 0.2 <= skill["call_rate"] <= 0.8  # the format of a call, on a question never seen
    assert skill["right_call_rate"] <= skill["call_rate"]


def test_the_python_warm_start_differs_only_in_the_call_and_the_message() -> None:
    """``--tool python``: the same draws; the call prints the expression and the message is
    what ``print`` writes, which the python tool itself returns."""
    from maxent_grpo.rollout.toolcall import Toolbox, ToolCall

    plain, python = warm.examples(90, seed=3), warm.examples(90, seed=3, tool="python")
    assert [p for p, _ in plain] == [p for p, _ in python]
    box = Toolbox(["python"], timeout=30)
    checked = 0
    for (_, a), (prompt, b) in zip(plain, python, strict=True):
        expression = prompt.removeprefix("What is ").removesuffix("?")
        if len(a) == 1 and a[0][1] != warm.tool_call_text(expression):
            assert a == b  # a direct answer is the same
            continue
        assert b[0] == ("model", warm.tool_call_text(expression, "python"))
        if len(a) == 3:
            assert b[1:] == [(warm.MESSAGE, a[1][1] + "\n"), a[2]]
            if checked < 3:  # the message is what the real tool answers
                result = box.run(ToolCall("python", {"code": f"print({expression})"}))
                assert (result.failure, result.text) == (None, b[1][1])
                checked += 1
    assert checked == 3


def test_the_shipped_python_weights_are_the_builtin_and_call_python(tmp_path) -> None:
    from safetensors.torch import load_file

    from maxent_grpo.builtin.catalog import WEIGHTS_PYTHON

    model = load_policy("builtin:tiny-python-warm", cache_dir=tmp_path)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in load_file(str(WEIGHTS_PYTHON)).items())
    _, tokenizer = builtin_tiny_model_and_tokenizer()
    skill = warm.measure(model, tokenizer, prompts=8, samples=8, tool="python")
    assert 0.2 <= skill["call_rate"] <= 0.8
    assert skill["right_call_rate"] <= skill["call_rate"]


def test_the_python_warm_start_continues_from_the_calculate_weights(capsys) -> None:
    """``--retrain --tool python`` starts from ``builtin:tiny-tools-warm``'s shipped weights
    (one AdamW step away from them afterwards), not from a fresh ``builtin:tiny``, and
    reports its progress."""
    from safetensors.torch import load_file

    tokenizer = build_tiny_tokenizer()
    model = warm.retrain(build_tiny_model(tokenizer), tokenizer, "python", steps=1,
                         report=True)
    assert re.fullmatch(r"step 1/1: loss \d+\.\d{4}, \d+ s\n", capsys.readouterr().out)
    start = load_file(str(WEIGHTS_TOOLS))
    state = model.state_dict()
    moved = max(float((state[k] - v).abs().max()) for k, v in start.items())
    assert 0 < moved <= 2 * 3e-3  # one step of lr 3e-3 (Adam's step is at most ~lr)
    fresh = build_tiny_model(tokenizer).state_dict()
    assert max(float((state[k] - fresh[k]).abs().max()) for k in start) > 0.1


def test_the_script_refuses_a_step_count_below_one(capsys) -> None:
    with pytest.raises(SystemExit):
        warm._main(["--retrain", "--out", "x.safetensors", "--steps", "0"])
    assert "--steps must be at least 1; got 0" in capsys.readouterr().err

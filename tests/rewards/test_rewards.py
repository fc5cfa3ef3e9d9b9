"""Reward functions, the registry and score_completions (docs/ALGORITHM.md §1)."""

from __future__ import annotations

import doctest
import importlib
import json
import math
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from maxent_grpo.rewards import (
    REWARDS,
    RewardFunctionError,
    accuracy_reward,
    answer_format_reward,
    countdown_reward,
    extract_answer,
    format_reward,
    get_reward,
    list_rewards,
    register_reward,
    score_completions,
    tag_count_reward,
)

REWARD_MODULES = [
    "maxent_grpo.rewards.registry",
    "maxent_grpo.rewards.answers",
    "maxent_grpo.rewards.shaping",
    "maxent_grpo.rewards.combine",
    "maxent_grpo.rewards.options",
    "maxent_grpo.rewards.timeout",
    "maxent_grpo.rewards.task_rewards",
    "maxent_grpo.rewards.verify_worker",
]


@pytest.mark.parametrize("module", REWARD_MODULES)
def test_docstring_examples(module: str) -> None:
    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0 and result.attempted > 0


PENALTIES = {"overlong"}  # rewards in [-1, 0]: 0 is the pass, -1 the fail


def test_every_registered_reward_documents_a_pass_and_a_fail() -> None:
    for name, fn in REWARDS.items():
        examples = doctest.DocTestParser().get_examples(fn.__doc__ or "")
        wants = [ex.want.strip() for ex in examples]
        passing, failing = ("[0.0]", "[-1.0]") if name in PENALTIES else ("[1.0]", "[0.0]")
        assert passing in wants and failing in wants, name


# ---------------------------------------------------------------- registry


def test_registry() -> None:
    assert list_rewards() == [
        "accuracy", "answer_format", "countdown", "digit_pair", "first_number", "format",
        "in_set", "overlong", "tag_count",
    ]
    assert get_reward("format") is format_reward
    assert get_reward(tag_count_reward) is tag_count_reward
    assert get_reward("maxent_grpo.rewards.shaping:format_reward") is format_reward
    with pytest.raises(ValueError, match=r"'accuracy'.*'tag_count'.*got 'acc'"):
        get_reward("acc")
    with pytest.raises(ValueError, match="cannot import reward 'no_such_module:f'"):
        get_reward("no_such_module:f")
    with pytest.raises(ValueError, match="reward '.shaping:format_reward' is a relative path"):
        get_reward(".shaping:format_reward")  # relative: was Python's TypeError
    for path in ("./myrew.py:const", "myrew.py:const", "/tmp/x/myrew.py:const"):
        with pytest.raises(ValueError, match=rf"reward '{re.escape(path)}' names a file; give "
                                             r"its module: 'myrew:const' \(a module myrew.py"):
            get_reward(path)  # was "No module named 'myrew.py'", or "a relative path"


def test_a_reward_module_that_fails_to_import_is_the_users_error(tmp_path, monkeypatch):
    """A syntax error in the user's reward module, or a module raising as it imports, was
    "unexpected SyntaxError; this is a bug in maxent_grpo" (a hunt of the extension
    points); a tool module the same."""
    from maxent_grpo.cli.errors import find_user_error
    from maxent_grpo.rollout.toolcall import resolve_tool
    from maxent_grpo.validation import UserCodeError

    (tmp_path / "broken_syntax.py").write_text("def f(prompts, completions, **kw)\n    pass\n")
    (tmp_path / "broken_raise.py").write_text("raise RuntimeError('config file missing')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserCodeError, match=r"model.rewards: cannot import 'broken_syntax:f': "
                       r"importing 'broken_syntax' raised SyntaxError: expected ':' "
                       r"\(broken_syntax.py, line 1\)") as raised:
        get_reward("broken_syntax:f")
    assert find_user_error(raised.value)[1].endswith("line 1)")  # not importlib's frame
    with pytest.raises(UserCodeError, match=r"raised RuntimeError: config file missing") as raised:
        get_reward("broken_raise:f")
    assert find_user_error(raised.value)[1].endswith(f"(at {tmp_path / 'broken_raise.py'}:1)")
    with pytest.raises(UserCodeError, match=r"model.tools: cannot import 'broken_raise:f': "
                                            r"importing 'broken_raise' raised RuntimeError"):
        resolve_tool("broken_raise:f")


def test_register_reward() -> None:
    @register_reward("test_constant_half")
    def half(prompts: list, completions: list, **kwargs: object) -> list[float]:
        return [0.5] * len(completions)

    try:
        assert get_reward("test_constant_half") is half

        def other(prompts: list, completions: list, **kwargs: object) -> list[float]:
            return []

        with pytest.raises(ValueError, match="'test_constant_half' is already registered"):
            register_reward("test_constant_half")(other)
    finally:
        REWARDS.pop("test_constant_half")


# ---------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer>1</answer> then <answer> 2 </answer>", "2"),
        (r"\boxed{1} and \boxed{\frac{3}{4}}", r"\frac{3}{4}"),
        (r"<answer>5</answer> \boxed{6}", "5"),  # answer tags win
        (r"<answer>x = \boxed{7}</answer>", "7"),
        (r"\boxed{2} then \boxed{3", "2"),  # the last balanced box
        ("nothing here", None),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


# ---------------------------------------------------------------- accuracy


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("<think>.</think><answer>0.5</answer>", "1/2", 1.0),
        ("<think>.</think><answer>1/2</answer>", "0.5", 1.0),
        (r"so the answer is \boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"so the answer is \boxed{12}", "12", 1.0),
        ("<answer>13</answer>", "12", 0.0),
        ("12", "12", 0.0),  # no answer block, no box
        ("<answer>Paris</answer>", "Paris", 1.0),  # exact-string fallback
        ("<answer>paris</answer>", "Paris", 0.0),
        ("<answer>7</answer>", None, None),
        ("<answer>7</answer>", "  ", None),
    ],
)
def test_accuracy(completion: str, answer: str | None, expected: float | None) -> None:
    assert accuracy_reward(["q"], [completion], answer=[answer]) == [expected]


@pytest.mark.parametrize(
    ("prediction", "answer", "expected"),
    [  # math-verify reads LaTeX only in math mode: bare, these were read by a leading number
        (r"7+\sqrt{2}", "7", 0.0),
        (r"7\pi", "7", 0.0),
        ("7", r"7+\sqrt{2}", 0.0),
        (r"2^{10}", "1024", 1.0),
        (r"10^{6}", "1000000", 1.0),
        (r"\dfrac12", "0.5", 1.0),
        (r"\{2,1\}", r"\{1,2\}", 1.0),
        ("1+x^2", "x^2+1", 1.0),
        ("2^-1", "0.5", 1.0),  # a bare exponent is braced: in math mode 2^-1 read as 2
        ("2^-1", "2", 0.0),
        ("1, 2", r"\{1, 2\}", 1.0),  # both sides in one mode: bare, only the last number
        ("9**2", "81", 1.0),  # plain text is read as before: in math mode this is 9
        ("9**2", "9", 0.0),
        ("The answer is 7", "7", 1.0),
        ("paris", "Paris", 0.0),  # in math mode a product of symbols, equal to Paris's
        # only a numeric exponent is braced: x^{2y} is not x^2 y
        ("y x^{2}", "x^2y", 1.0),
        ("x^{2y}", "x^2y", 0.0),
        ("a^{2}b^{2}", "a^2b^2", 1.0),
        ("16x", "4^2x", 1.0),
        (r"\frac{x^{2}y}{2}", r"\frac{x^2y}{2}", 1.0),
        # an answer with its own delimiters is read as written, not wrapped in $...$ again
        (r"The value is $\sqrt{2}$", r"\sqrt{2}", 1.0),
        (r"the length is $\sqrt{2}$ units", r"\sqrt{2}", 1.0),
        (r"\[ \sqrt{2} \]", r"\sqrt{2}", 1.0),
        (r"It is $\sqrt{3}$", r"\sqrt{2}", 0.0),
        # an escaped dollar and an environment are no delimiters: still read in math mode
        ("18", r"\$18", 1.0),
        ("18.90", r"\$18.90", 1.0),
        ("5", r"\$5.00", 1.0),
        (r"\begin{pmatrix} 3 \\ 2 \end{pmatrix}", r"\begin{pmatrix} -1 \\ 2 \end{pmatrix}", 0.0),
        (r"$\begin{pmatrix} -1 \\ 2 \end{pmatrix}$", r"\begin{pmatrix} -1 \\ 2 \end{pmatrix}",
         1.0),
        # scientific notation written out; a Unicode minus read as minus
        ("3e8", "3", 0.0),
        ("3e8", "300000000", 1.0),
        ("0.00001", "1e-05", 1.0),
        ("1", "1e-05", 0.0),
        ("\u22122", "-2", 1.0),
        ("x \u2212 2", "x-2", 1.0),
        ("3 \u2212 2", "1", 0.0),  # a calculation left undone is no answer to a number
    ],
)
def test_accuracy_reads_latex_answers_whole(prediction: str, answer: str,
                                            expected: float) -> None:
    for completion in (f"<answer>{prediction}</answer>", f"so \\boxed{{{prediction}}}"):
        assert accuracy_reward(["q"], [completion], answer=[answer]) == [expected], completion


@pytest.mark.parametrize(
    ("prediction", "answer", "expected"),
    [  # a reference written as a formula without LaTeX is read as math: read bare, each
        # was one of its numbers, so a wrong answer sharing it scored 1 and a right one 0
        ("(9, 2)", "(1, 2)", 0.0), ("(-2, 1)", "(-2,1)", 1.0), ("[-2, 7]", "[-2,7]", 1.0),
        ("(-5, 7)", "[-2, 7]", 0.0), ("3, -2", "-2,3", 1.0), ("4", "2, 4", 0.0),
        ("6+5i", "6-5i", 0.0), ("6 - 5i", "6-5i", 1.0), ("2x+7", "2x+1", 0.0),
        ("1+x", "x+1", 1.0), ("y=2x-7", "y=2x+1", 0.0), ("2x+1", "y = 2x + 1", 1.0),
        ("2-sqrt(3)", "2+sqrt(3)", 0.0), ("3", "3pi", 0.0), ("1.2", "1,2", 0.0),
        ("C", "(C)", 1.0), ("B", "(C)", 0.0), ("5", "x=5", 1.0),
        # numbers and prose are read as before: a number reference against the last number
        ("1000", "1,000", 1.0), ("-886.0", "-886", 1.0), ("5 m", "5", 1.0),
        ("-2, 3", "3", 1.0), ("Paris", "Paris", 1.0),
        # Markdown's bold is no power; a square-root sign is a root; \text{...} is its text
        ("**1/2**", r"\frac{1}{2}", 1.0), ("**1/2**", "1", 0.0), ("**2^3**", "8", 1.0),
        ("The answer is **3/4**.", "3/4", 1.0), ("10√2", r"10\sqrt{2}", 1.0),
        ("√2", "2", 0.0), ("Evelyn", r"\text{Evelyn}", 1.0),
        # with a LaTeX reference, an answer in words is searched for its math too, not only
        # read as a product of symbols in $...$ (a long one took seconds); short, it is
        # still read in $...$, where math-verify drops the units it knows
        ("0.5 cups", r"\frac{1}{2}", 1.0), ("The answer is 7", r"\frac{14}{2}", 1.0),
        ("so it is 1/3 of them", r"\frac{1}{2}", 0.0), (r"\sqrt{2} meters", r"\sqrt{2}", 1.0),
        (r"12\pi cubic inches", r"12\pi", 1.0), (r"\$18 per day", "18", 1.0),
        (r"\dfrac{1}{2} hours", r"\frac{1}{2}", 1.0), (r"\mathbf{18} apples", "18", 1.0),
        ("the probability is " + "very " * 40 + r"surely \frac{1}{2}", r"\frac{1}{2}", 1.0),
        # a sentence's last period; words of mathematics; a power with spaces is no bold
        ("(1, 2).", "(1, 2)", 1.0), ("-2, 3.", "-2, 3", 1.0), (r"\frac{1}{2}.", "0.5", 1.0),
        ("[0, inf)", r"[0, \infty)", 1.0), ("inf", r"\infty", 1.0), ("2 ** 3", "8", 1.0),
        ("4", "4 L", 1.0),
        # as written, a LaTeX text's math between its words is read in $...$: bare,
        # math-verify stopped at the first command (2\sqrt{3} cm was 2, on both sides)
        (r"2\sqrt{3} cm", "2", 0.0), (r"7 + \sqrt{2} cm", "7", 0.0), (r"3 or \sqrt{2}", "3", 0.0),
        ("12", r"12\pi cubic inches", 0.0), ("2", r"2^{10} ways", 0.0),
        (r"\$18 each", "18", 1.0), (r"\frac12 cup", r"\frac{1}{2}", 1.0),
        ("The polynomial is x^2+1", "x^2+1", 1.0),
        # a GSM8K reference is a worked solution: its last number counts, with a power or a
        # dollar in it too (the power makes the pair LaTeX; the dollar, its own delimiter)
        ("72", "She sold 3^2 = <<3^2=9>>9 boxes.\nShe paid $10 more.\n#### 72", 1.0),
        ("9", "She sold 3^2 = <<3^2=9>>9 boxes.\nShe paid $10 more.\n#### 72", 0.0),
        ("72", "The area is 3^2 = <<3^2=9>>9 square feet,\nso 8*9 = <<8*9=72>>72\n#### 72", 1.0),
    ],
)
def test_accuracy_reads_formula_references_bold_roots_and_words(
        prediction: str, answer: str, expected: float) -> None:
    assert accuracy_reward(["q"], [f"<answer>{prediction}</answer>"], answer=[answer]) == [
        expected], prediction


@pytest.mark.parametrize(("reference", "final"), [
    ("Sam answered 20 questions first, then 15.\nIn all 20+15 = <<20+15=35>>35.\n#### 35", "35"),
    ("She got 80% of the answers right: 50*0.8 = <<50*0.8=40>>40\n#### 40", "40"),
    ("So the answer is 12+13 = <<12+13=25>>25\n#### 25", "25"),
    ("48+24 = <<48+24=72>>72 in all, then 3 were given away.\n####69", "69"),
    ("So the answer is 5^2 = <<5^2=25>>25\r\n#### 25\r\n", "25"),
    ("She sold 48/2 = <<48/2=24>>24 clips.\n#### ", None),
    # a MATH solution's Markdown heading on its last line is no final line
    ("Solve.\n$x=\\boxed{3}$\n#### Step 24", "3"),
])
def test_accuracy_grades_a_worked_solution_by_its_final_line(reference: str,
                                                              final: str | None) -> None:
    """math-verify reads a text's last number except after the word "answer" (the first
    number after it) and not ``####69``: a right answer scored 0 and a wrong one 1."""
    numbers = ["35", "20", "40", "0", "25", "12", "69", "3", "24"]
    scores = accuracy_reward(["q"] * len(numbers), [f"<answer>{n}</answer>" for n in numbers],
                             answer=[reference] * len(numbers))
    assert scores == [None if final is None else float(n == final) for n in numbers]


def test_accuracy_grades_a_list_of_guesses_as_its_last_guess() -> None:
    """A list of guesses is not an exploit: only its last number is read, so it scores
    exactly when that number alone would (a grader reading "any of" would pay for lists)."""
    guesses = ["5 or 7", "7 or 5", "2, 3, 4, 5, 6, 7", r"5 \vee 7", "x = 5 or x = 7"]
    for reference in ("5", "7", "4"):
        scores = accuracy_reward(["q"] * len(guesses),
                                 [f"<answer>{g}</answer>" for g in guesses],
                                 answer=[reference] * len(guesses))
        last = [float(g.split()[-1] == reference) for g in guesses]
        assert scores == last, reference


def test_accuracy_does_not_pay_for_the_question_copied() -> None:
    """The default task's and reward's pair (``arithmetic``, ``accuracy``) scored 1.0 for
    ``<answer>59 - 63 * 15</answer>``, the prompt's expression copied, on every row: the
    value was compared (a hunt of the tasks). A calculation left undone is no answer to a
    number; its result, a fraction or an equation ending in the value still are."""
    from maxent_grpo.tasks import build_task

    rows = build_task("arithmetic", 50, 0)
    copied = [f"<answer>{r['expression']}</answer>" for r in rows]
    assert accuracy_reward(["q"] * 50, copied, answer=[r["answer"] for r in rows]) == [0.0] * 50
    answers = ["59 - 63 * 15", "$3 \\times 4$", "(3 + 4)", "-886", "-886.", "1/2", "3 + 4 = 7",
               "2^{3}", "1,665"]
    references = ["-886", "12", "7", "-886", "-886", "0.5", "7", "8", "1665"]
    assert accuracy_reward(["q"] * 9, [f"<answer>{a}</answer>" for a in answers],
                           answer=references) == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    # against a reference that is itself an expression the values are compared as before
    assert accuracy_reward(["q"], ["<answer>1 + 1/2</answer>"], answer=["3/2"]) == [1.0]
    # a signed fraction, however written, is a number (a reader found these scored 0)
    fractions = ["\u22121/2", "(1/2)", "(1)/(2)", "-3/4", "$3/4$"]
    assert accuracy_reward(["q"] * 5, [f"<answer>{f}</answer>" for f in fractions],
                           answer=["-0.5", "0.5", "0.5", "-0.75", "0.75"]) == [1.0] * 5


def test_accuracy_conversational_and_extra_columns() -> None:
    completions = [
        [{"role": "assistant", "content": "<answer>4</answer>"}],
        [{"role": "assistant", "content": "<answer>5</answer>"}],
    ]
    scores = accuracy_reward(["q", "q"], completions, answer=["4", "4"], task=["a", "a"])
    assert scores == [1.0, 0.0]


def test_accuracy_needs_answer_column() -> None:
    with pytest.raises(ValueError, match="needs the dataset column 'answer'"):
        accuracy_reward(["q"], ["<answer>1</answer>"])
    with pytest.raises(ValueError, match="column 'answer' must be a list with one value"):
        accuracy_reward(["q"], ["<answer>1</answer>"], answer=["1", "2"])


def test_bad_completion_structure() -> None:
    with pytest.raises(ValueError, match="completions must hold str"):
        format_reward(["q"], [[{"role": "assistant"}]])


# ---------------------------------------------------------------- countdown


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("(3 + 5) * 2", 1.0),
        ("(3 + 5) × 2", 1.0),
        (r"(3 + 5) \times 2", 1.0),
        ("(3 + 5) * 2 = 16", 1.0),
        ("(3 + 5) * 2 = 17", 0.0),
        # as chat models write them (each scored 0: a hunt of the tasks)
        ("(3 + 5) * 2.", 1.0),
        ("(3 + 5) * 2 = 16.", 1.0),
        ("(3 + 5) * 2 = 16.0", 1.0),
        ("$(3 + 5) * 2$", 1.0),
        (r"\((3 + 5) \cdot 2\)", 1.0),
        (r"$$\frac{(3 + 5) * 2}{1}$$", 0.0),  # 1 is not given
        (r"\frac{(3 + 5) * 2 * 5}{5}", 0.0),  # 5 twice
        (r"2 * \frac{3 + 5}{1}", 0.0),
        ("$(3 + 5) * 2 = 17$", 0.0),
        ("3 + 5 * 2", 0.0),  # 13
        ("(3 + 3) * 2", 0.0),  # 3 reused
        ("__import__('os')", 0.0),
    ],
)
def test_countdown_reward(answer: str, expected: float) -> None:
    completion = f"<think>try</think><answer>{answer}</answer>"
    assert countdown_reward(["q"], [completion], numbers=[[2, 3, 5]], target=[16]) == [expected]


def test_countdown_reward_not_applicable_and_missing() -> None:
    scores = countdown_reward(
        ["q", "q", "q"],
        ["<answer>1 + 2</answer>", "<answer>3</answer>", "no answer"],
        numbers=[[1, 2], None, [1, 2]],
        target=[3, None, 3],
    )
    assert scores == [1.0, None, 0.0]
    with pytest.raises(ValueError, match="needs the dataset column 'numbers'"):
        countdown_reward(["q"], ["<answer>3</answer>"], target=[3])


def test_countdown_reads_csv_text_and_checks_every_row_first() -> None:
    """A CSV holds "[2, 3, 5]" and "16" as text: a completion without an answer scored 0.0
    and the first with one raised "target must be an int" mid-run; now the text is read,
    and a row that cannot be is refused before any completion is graded."""
    assert countdown_reward(["q", "q"], ["<answer>(3 + 5) * 2</answer>", "none"],
                            numbers=["[2, 3, 5]", "[2, 3, 5]"], target=["16", " 16"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match=r"countdown: the numbers and target given with "
                                         r"completion 1 of the step must be .* 'n/a'"):
        countdown_reward(["q", "q"], ["none", "none"], numbers=[[1], [1]], target=[1, "n/a"])
    for bad in ("--8", "\u00b2", "8.0"):
        with pytest.raises(ValueError, match="countdown: the numbers and target"):
            countdown_reward(["q"], ["none"], numbers=[[1]], target=[bad])
    assert countdown_reward(["q"], ["<answer>0 - 8</answer>"], numbers=[[0, 8]],
                            target=["-8"]) == [1.0]


# ---------------------------------------------------------------- shaping


@pytest.mark.parametrize(
    ("prompt", "completion", "expected"),
    [
        ("Q", "<think>a</think><answer>1</answer>", 1.0),
        ("Q", "  <think>\na\n</think>\n\n<answer>1</answer>\n", 1.0),
        ("Q", "<think></think><answer>1</answer>", 1.0),  # empty reasoning allowed
        ("Q", "<think>a</think><answer> </answer>", 0.0),  # blank answer
        ("Q", "<think>a</think><answer>1</answer> more", 0.0),
        ("Q", "x <think>a</think><answer>1</answer>", 0.0),
        ("Q", "<think>a<answer>0</answer></think><answer>1</answer>", 0.0),
        ("Q", "<answer>1</answer><think>a</think>", 0.0),
        ("Q", "a</think><answer>1</answer>", 0.0),
        ("Q <think>\n", "a</think><answer>1</answer>", 1.0),  # prompt opened the block
        ("Q <think>\n", "<think>a</think><answer>1</answer>", 0.0),  # opened twice
    ],
)
def test_format(prompt: str, completion: str, expected: float) -> None:
    assert format_reward([prompt], [completion]) == [expected]


def test_format_length_mismatch() -> None:
    with pytest.raises(ValueError, match="prompts and completions must have the same length"):
        format_reward(["a", "b"], ["x"])


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>a</think><answer>1</answer>", 1.0),
        ("<think>a</think> 1", 0.5),
        ("<think>a</think><answer>1", 0.75),
        ("<think><think>a</think><answer>1</answer></answer>", 0.5),
        ("1", 0.0),
    ],
)
def test_tag_count(completion: str, expected: float) -> None:
    assert tag_count_reward(["Q"], [completion]) == [expected]


def test_answer_format() -> None:
    completions = ["<answer></answer>", "<answer>\n3\n</answer> tail", "<answer>3", "3"]
    assert answer_format_reward(["Q"] * 4, completions) == [1.0, 1.0, 0.0, 0.0]


# ---------------------------------------------------------------- score_completions


def const(values: list) -> object:
    def fn(prompts: list, completions: list, **kwargs: object) -> list:
        return list(values)

    return fn


def test_score_completions_weighted_sum_with_none() -> None:
    funcs = [
        ("a", const([1.0, None, 0.0, None]), 2.0),
        ("b", const([0.5, 1.0, None, None]), -1.0),
    ]
    total, components = score_completions(funcs, ["p"] * 4, ["c"] * 4, {})
    assert total.dtype == torch.float32 and total.shape == (4,)
    assert components.dtype == torch.float32 and components.shape == (2, 4)
    # by hand: 2*1 - 0.5, -1*1, 2*0, nothing applies -> 0
    assert total.tolist() == [1.5, -1.0, 0.0, 0.0]
    assert components[0, 0] == 1.0 and math.isnan(components[0, 1])
    assert torch.isnan(components[:, 3]).all()


def test_score_completions_passes_columns_and_real_rewards() -> None:
    funcs = [("accuracy", accuracy_reward, 1.0), ("format", format_reward, 0.5)]
    completions = ["<think>x</think><answer>1/2</answer>", "<answer>3</answer>"]
    columns = {"answer": ["0.5", "4"], "task": ["t", "t"]}
    total, components = score_completions(funcs, ["q", "q"], completions, columns)
    assert components.tolist() == [[1.0, 0.0], [1.0, 0.0]]
    assert total.tolist() == [1.5, 0.0]


def test_score_completions_raising_function() -> None:
    def broken(prompts: list, completions: list, **kwargs: object) -> list:
        raise KeyError("boom")

    funcs = [("ok", const([1.0]), 1.0), ("broken", broken, 1.0)]
    with pytest.raises(RewardFunctionError, match=r"'broken' \(#1\) raised KeyError") as info:
        score_completions(funcs, ["p"], ["c"], {})
    assert isinstance(info.value.__cause__, KeyError)


def test_numpys_bools_are_read_as_trl_reads_them() -> None:
    """A list of ``np.bool_`` (``np.isclose`` per row) was refused as non-numeric; TRL takes
    it (a hunt of the extension points)."""
    def close(prompts: list, completions: list, **kw: object) -> list:
        return [np.isclose(len(c), 1) for c in completions]

    total, _ = score_completions([("close", close, 1.0)], ["p", "p"], ["a", "bb"], {})
    assert total.tolist() == [1.0, 0.0]


def test_a_reward_raising_on_one_row_names_that_row() -> None:
    """A reward that raises on a bad data row named the function only: the user searched
    the batch by hand (a reported defect). The call is repeated row by row, within a
    bound, to name the first row it raises on alone, its prompt, completion and columns."""
    calls = []

    def needs_int(prompts: list, completions: list, answer: list, **kw: object) -> list:
        calls.append(len(completions))
        return [float(int(a) == len(c)) for c, a in zip(completions, answer, strict=True)]

    with pytest.raises(RewardFunctionError, match=r"'mine' \(#0\) raised ValueError: invalid "
                       r"literal .*'two' \(it raises on completion 2 alone: prompt 'p2', "
                       r"completion 'bb', answer 'two', task 't'\)"):
        score_completions([("mine", needs_int, 1.0)], ["p0", "p1", "p2", "p3"],
                          ["a", "b", "bb", "ccc"],
                          {"answer": ["1", "1", "two", "3"], "task": ["t"] * 4})
    assert calls == [4, 1, 1, 1]  # the batch, then rows 0, 1 and 2

    def needs_a_key(prompts: list, completions: list, **kw: object) -> list:
        return [float(os.environ["MAXENT_GRPO_NO_SUCH_KEY"])] * len(completions)

    # every row alone raises it too: a setting, not a row (a second reader)
    with pytest.raises(RewardFunctionError, match=r"raised KeyError: 'MAXENT_GRPO_NO_SUCH_KEY'$"):
        score_completions([("key", needs_a_key, 1.0)], ["p0", "p1"], ["a", "b"], {})

    def by_groups(prompts: list, completions: list, **kw: object) -> list:
        if len(completions) % 2:
            raise ValueError(f"{len(completions)} completions: not whole groups of 2")
        raise ValueError("the groups disagree")

    with pytest.raises(RewardFunctionError, match=r"raised ValueError: the groups disagree$"):
        score_completions([("groups", by_groups, 1.0)], ["p0", "p1"], ["a", "b"], {})

    def slow(prompts: list, completions: list, **kw: object) -> list:
        time.sleep(0.2)
        raise ValueError("every row")

    with mock.patch("maxent_grpo.rewards.combine.ROW_SEARCH_S", 0.1):  # spent by the call
        with pytest.raises(RewardFunctionError, match=r"raised ValueError: every row$"):
            score_completions([("slow", slow, 1.0)], ["p0", "p1"], ["a", "b"], {})


def test_a_reward_that_calls_sys_exit_is_named_not_the_runs_end() -> None:
    """``sys.exit(0)`` in a reward (a library's, argparse's) ended the fit with exit code 0
    and no word, a job scheduler recording success (a hunt of distributed failures)."""
    def exits(prompts: list, completions: list, **kwargs: object) -> list:
        sys.exit(0)

    with pytest.raises(RewardFunctionError, match=r"'exits' \(#0\) raised SystemExit: 0"):
        score_completions([("exits", exits, 1.0)], ["p"], ["c"], {})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ((1.0 for _ in range(2)), r"'bad' \(#0\) must return a list of 2 values; got generator"),
        ([1.0], r"'bad' \(#0\) returned 1 values; expected 2"),
        ([1.0, "1"], r"'bad' \(#0\) returned a non-numeric value at row 1"),
        ([1.0, torch.tensor([1.0])], r"non-numeric value at row 1"),
        ([math.inf, 1.0], r"'bad' \(#0\) returned a non-finite value at row 0"),
        ([1.0, math.nan], r"non-finite value at row 1"),
        ([10**400, 1.0], r"non-finite value at row 0: 1000"),  # an OverflowError, "a bug"
        # finite in float64 only: refused later as "rewards must be finite", naming nothing
        ([1.0, 1e300], r"'bad' \(#0\) returned a non-finite value at row 1: 1e\+300 .*"
                       r"torch.float32: ±3.4e\+38"),
    ],
)
def test_score_completions_bad_values(values: object, message: str) -> None:
    def bad(prompts: list, completions: list, **kwargs: object) -> object:
        return values

    with pytest.raises(RewardFunctionError, match=message):
        score_completions([("bad", bad, 1.0)], ["p", "p"], ["c", "c"], {})


def test_a_weighted_sum_past_float32_names_the_rewards() -> None:
    """Two rewards within float32 whose weighted sum is not: named, not a non-finite reward
    later (a numerical-extremes hunt)."""
    def big(prompts: list, completions: list, **kwargs: object) -> list:
        return [3e38, 1.0]

    funcs = [("big", big, 1.0), ("also", big, 2.0)]
    with pytest.raises(RewardFunctionError, match=r"weighted sum of the rewards \['big', "
                       r"'also'\] is beyond torch.float32's range"):
        score_completions(funcs, ["p", "p"], ["c", "c"], {})
    total, _ = score_completions([("big", big, 1.0)], ["p", "p"], ["c", "c"], {})
    assert total.tolist() == pytest.approx([3e38, 1.0])


def test_a_trl_reward_module_drops_in_async_arrays_and_its_log_calls() -> None:
    """TRL awaits ``async def`` rewards, reads any sequence ``torch.tensor`` takes and passes
    ``log_metric`` and ``log_extra``: each was refused here ("got coroutine", "got ndarray",
    "missing 1 required positional argument: 'log_metric'")."""
    import asyncio

    import numpy as np

    async def slow_len(completions, **kwargs):
        await asyncio.sleep(0)
        return [float(len(c)) for c in completions]

    def as_array(completions, **kwargs):
        return np.array([1.0, 2.0])

    def scalars(completions, **kwargs):
        return [torch.tensor(0.5), np.float32(0.25)]

    def logs(completions, log_metric, log_extra, **kwargs):
        log_metric("my_metric", 1.0)
        log_extra("my_column", ["a", "b"])
        return [1.0, 0.0]

    funcs = [("a", slow_len, 1.0), ("b", as_array, 1.0), ("c", scalars, 1.0), ("d", logs, 1.0)]
    with pytest.warns(UserWarning, match="what it is given is dropped here"):
        total, parts = score_completions(funcs, ["p", "p"], ["xy", "xyz"], {})
    assert parts.tolist() == [[2.0, 3.0], [1.0, 2.0], [0.5, 0.25], [1.0, 0.0]]

    async def in_a_notebook():  # an event loop already runs in this thread
        return score_completions([("a", slow_len, 1.0)], ["p"], ["xy"], {})[0].tolist()

    assert asyncio.run(in_a_notebook()) == [2.0]
    with pytest.raises(ValueError, match="column 'log_metric' clashes"):
        score_completions(funcs[:1], ["p"], ["x"], {"log_metric": [1]})


def test_score_completions_bad_inputs() -> None:
    fn = const([1.0, 1.0])
    with pytest.raises(ValueError, match="column 'answer' must be a list with one value per"):
        score_completions([("f", fn, 1.0)], ["p", "p"], ["c", "c"], {"answer": ["1"]})
    with pytest.raises(ValueError, match="prompts must have one entry per completion"):
        score_completions([("f", fn, 1.0)], ["p"], ["c", "c"], {})
    with pytest.raises(ValueError, match="funcs must hold at least one"):
        score_completions([], ["p", "p"], ["c", "c"], {})
    with pytest.raises(ValueError, match="reward 'f': weight must be a finite number"):
        score_completions([("f", fn, math.inf)], ["p", "p"], ["c", "c"], {})
    with pytest.raises(ValueError, match="column 'prompts' clashes"):
        score_completions([("f", fn, 1.0)], ["p", "p"], ["c", "c"], {"prompts": [1, 2]})


def test_accuracy_runs_outside_the_main_thread() -> None:
    # math-verify's signal-based timeout only works in the main thread; elsewhere it is off
    import threading

    out: list = []
    worker = threading.Thread(
        target=lambda: out.append(accuracy_reward(["q"], ["<answer>0.5</answer>"], answer=["1/2"]))
    )
    worker.start()
    worker.join()
    assert out == [[1.0]]


def test_first_number_reward_reads_the_first_integer_only():
    from maxent_grpo.rewards import first_number_reward

    completions = [" 8", "8 or 9", "9 then 8", "-3", "no number", "08"]
    answers = ["8", "8", "8", "-3", "8", "8"]
    assert first_number_reward([""] * 6, completions, answer=answers) == [
        1.0, 1.0, 0.0, 1.0, 0.0, 1.0,
    ]
    assert first_number_reward(["q"], ["8"], answer=[None]) == [None]
    with pytest.raises(ValueError, match="completion 0 of the step must be an integer"):
        first_number_reward(["q"], ["8"], answer=["eight"])


def test_digit_pair_reward_reads_a_pair_as_chat_models_write_it() -> None:
    from maxent_grpo.rewards import digit_pair_reward

    completions = ["4 + 5.", "<answer>$4 + 5$</answer>", r"<answer>\(4 + 5\)</answer>",
                   "4 + 5 = 9", "$4 + 5 = 9$", "4 + 5.5"]
    assert digit_pair_reward(["q"] * 6, completions, target=[9] * 6) == [1.0, 1.0, 1.0, 0.0,
                                                                         0.0, 0.0]


def test_digit_pair_reward_agrees_with_the_answer_set() -> None:
    from maxent_grpo.rewards import digit_pair_reward
    from maxent_grpo.tasks import build_task

    for row in build_task("digit_pairs", 9, 0, min_target=0, max_target=18):
        candidates = [f"{a} + {b}" for a in range(10) for b in range(10)]
        scores = digit_pair_reward(["q"] * 100, candidates, target=[row["target"]] * 100)
        right = {c for c, s in zip(candidates, scores, strict=True) if s == 1.0}
        assert len(right) == sum(1 + (a != b) for a, b in (
            map(int, v.split(" + ")) for v in row["valid_answers"]
        ))  # ordered pairs: "a + b" and "b + a"
    assert digit_pair_reward(["q"], ["1 + 2"], target=[None]) == [None]
    with pytest.raises(ValueError, match="reward 'digit_pair' needs the dataset column 'target'"):
        digit_pair_reward(["q"], ["1 + 2"])


def test_a_number_longer_than_int_takes_is_a_wrong_answer_not_a_crash():
    """A model repeating a digit writes more than the 4300 digits ``int`` converts: the
    integer rewards score it 0 and its answer key is its digits."""
    from maxent_grpo.rewards import first_number_reward, in_set_reward
    from maxent_grpo.rewards.answers import canonical_answer

    long = " " + "1" * 4301
    assert first_number_reward(["q"], [long], answer=["7"]) == [0.0]
    assert in_set_reward(["q"], [long], valid_answers=[["7", "11"]]) == [0.0]
    assert canonical_answer(long, "first_number") == "1" * 4301
    assert canonical_answer("-000" + "2" * 4400, "first_number") == "-" + "2" * 4400
    assert canonical_answer("0" * 4400, "first_number") == "0"
    assert canonical_answer("-007", "first_number") == "-7"  # short ones as before
    # leading zeros do not count (int counts them): the reward and the key agree
    padded = "0" * 4400 + "7"
    assert first_number_reward(["q"], [padded], answer=["7"]) == [1.0]
    assert canonical_answer(padded, "first_number") == "7"


def test_answer_blocks_read_as_the_lazy_pattern_does_in_linear_time():
    """The answer blocks are the lazy regex's matches on every arrangement of tags; and
    text that made the regexes quadratic (unclosed tags, repeated blocks: seconds at 100k
    characters) is read in a fraction of that (a loose bound: it only catches the old
    behaviour)."""
    import itertools
    import re
    import time

    from maxent_grpo.rewards.answers import answer_blocks

    lazy = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
    parts = ["<answer>", "</answer>", "7", " ", "<think>", "</think>"]
    for n in range(1, 6):
        for combo in itertools.product(parts, repeat=n):
            text = "".join(combo)
            assert answer_blocks(text) == lazy.findall(text), text
            assert answer_format_reward(["q"], [text]) == [1.0 if lazy.search(text) else 0.0]
    start = time.perf_counter()
    extract_answer("<answer>7\n" * 30000)
    answer_format_reward(["q"], ["<answer>7\n" * 30000])
    format_reward(["q"], ["<think>" + "</think>\n<answer>7</answer>\n<think>" * 10000])
    assert time.perf_counter() - start < 10.0  # about 0.05 s; the regexes took minutes


OFF_MAIN_THREAD = """
import sys, threading
from maxent_grpo.rewards import accuracy_reward
from maxent_grpo.rewards.timeout import TimedReward
completions = ["<answer>9**(9*9*9*9*9*9*9*9*9)</answer>", "<answer>9**9**9</answer>",
               "<answer>2^3</answer>", "<answer>$y^2+x^2$</answer>",
               "<answer>30^{\\circ}, 60^{\\circ}</answer>"]
answers = ["4", "7", "8", "$x^2 + y^2$", "30^\\circ, 60^\\circ"]
out = []
worker = threading.Thread(target=lambda: out.append(accuracy_reward(["q"] * 5, completions,
                                                                    answer=answers)))
worker.start()
worker.join()
timed = TimedReward("accuracy", accuracy_reward, 1.0, None, True)  # None: the time-out
print(out[0], timed(prompts=["q"], completions=completions[1:2], answer=["7"]))
"""


def test_accuracy_off_the_main_thread_cannot_hold_the_process():
    """Off the main thread math-verify has no time limit: ``9**(9*9*...*9)`` had sympy
    compute the power in C, holding the GIL, and the process stopped (a reward ``timeout``
    never fired); a deny-list of such powers missed forms like this one. The comparisons
    now run in a worker process with the limit. Answers with separate powers are still
    compared mathematically there. (In a subprocess: before, it never ended.)"""
    run = subprocess.run([sys.executable, "-c", OFF_MAIN_THREAD], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    # the towers score 0.0 off the main thread; under a 1 s reward time-out, the time-out
    # (its fallback None) ends the call on time, where it never ended before (a power of
    # powers is a number to the check of calculations left undone: the verifier reads it)
    assert run.stdout.split("\n")[0] == "[0.0, 0.0, 1.0, 1.0, 1.0] [None]"


def test_the_verifier_kills_a_comparison_that_outlives_its_time_and_starts_again():
    from maxent_grpo.rewards.verify_worker import Verifier

    verifier = Verifier(call_seconds=1.0)
    try:
        assert verifier.equal("1/2", "0.5") is True
        first = verifier._process
        assert verifier.equal("4", "9**(9*9*9*9*9*9*9*9*9)") is False  # killed after 1 s
        assert verifier._process is None and first.poll() is not None
        assert verifier.equal("8", "2^3") is True  # a new worker
    finally:
        verifier.close()


def test_a_terminals_ctrl_c_leaves_the_verifier_worker_grading():
    """The worker shares the trainer's process group: a terminal's Ctrl-C reached it, and
    with several processes the batch goes on after a Ctrl-C (every process stops after it),
    so its comparisons were graded "not equal" by a dead worker."""
    import signal

    from maxent_grpo.rewards.verify_worker import Verifier

    verifier = Verifier()
    try:
        assert verifier.equal("1/2", "0.5") is True
        worker = verifier._process
        worker.send_signal(signal.SIGINT)
        assert verifier.equal("8", "2^3") is True and verifier._process is worker
        assert worker.poll() is None
    finally:
        verifier.close()


NOISY_WORKER = """
import os, sys
sys.path.insert(0, {root!r})
from maxent_grpo.rewards import verify_worker as w
real = w.math_equal

def noisy(gold, prediction, golds=None):
    os.write(1, b"[1, true]\\n")  # a C library writing to file descriptor 1
    print("stray", flush=True)
    return real(gold, prediction, golds)

w.math_equal = noisy
w.serve()
"""


def test_what_the_worker_prints_cannot_shift_its_verdicts(tmp_path):
    """Stray output on the worker's stdout was read as a verdict, and every later verdict
    was the one before it; a worker that cannot start names why at once."""
    from maxent_grpo.rewards.verify_worker import Verifier

    script = tmp_path / "noisy.py"
    script.write_text(NOISY_WORKER.format(root=str(Path(__file__).resolve().parents[2])))
    verifier = Verifier(command=[sys.executable, str(script)])
    try:
        pairs = [("1", "2", False), ("1/2", "0.5", True), ("3", "4", False), ("8", "2^3", True)]
        assert [verifier.equal(g, p) for g, p, _ in pairs] == [want for _, _, want in pairs]
    finally:
        verifier.close()
    broken = Verifier(command=[sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match="it exited with status 3"):
        broken.equal("1", "1")
    # a worker that ends at every call: started again once, then not equal (no
    # BrokenPipeError)
    gone = Verifier(command=[sys.executable, "-c", "print('ready', flush=True)"])
    gone._start()
    gone._process.wait()
    assert gone.equal("1", "1") is False and gone._process is None


DYING_ONCE_WORKER = """
import json, os, sys
print("ready", flush=True)
for line in sys.stdin:
    if not os.path.exists({marker!r}):
        open({marker!r}, "w").close()
        os._exit(9)  # ends while it compares, once
    call, gold, prediction = json.loads(line)
    print(json.dumps([call, gold == prediction]), flush=True)
"""


def test_a_verifier_worker_that_ends_during_a_comparison_is_asked_again(tmp_path, caplog):
    from maxent_grpo.rewards.verify_worker import Verifier

    script = tmp_path / "dying.py"
    script.write_text(DYING_ONCE_WORKER.format(marker=str(tmp_path / "died")))
    verifier = Verifier(command=[sys.executable, str(script)])
    try:
        with caplog.at_level("WARNING", logger="maxent_grpo.rewards.verify_worker"):
            assert verifier.equal("7", "7") is True
        assert "ended while comparing '7' with '7': once more on a new one" in caplog.text
    finally:
        verifier.close()


def test_a_killed_verifier_worker_is_started_again_and_the_answer_graded(caplog):
    """A worker killed between calls (the OOM killer) or during one: the next comparison
    scored 0.0 in silence, a right answer graded wrong."""
    import signal

    from maxent_grpo.rewards.verify_worker import Verifier

    verifier = Verifier()
    try:
        assert verifier.equal("1/2", "0.5") is True
        verifier._process.send_signal(signal.SIGKILL)
        verifier._process.wait()
        with caplog.at_level("WARNING", logger="maxent_grpo.rewards.verify_worker"):
            assert verifier.equal("8", "2^3") is True
        assert "had ended (SIGKILL: killed for memory?)" in caplog.text
        caplog.clear()
        with verifier._lock:  # a stop() while a verdict is returned: it kills, cannot close
            verifier.stop()
        with caplog.at_level("WARNING", logger="maxent_grpo.rewards.verify_worker"):
            assert verifier.equal("1/2", "0.5") is True
        assert "had ended" not in caplog.text  # its own kill: no worker died (readers)
    finally:
        verifier.close()


SLOW_WORKER = """
import json, sys, time
print("ready", flush=True)
for line in sys.stdin:
    call, gold, prediction = json.loads(line)
    if gold == "slow":
        time.sleep(600)
    print(json.dumps([call, gold == prediction]), flush=True)
"""


def test_a_reward_call_that_timed_out_leaves_the_verifier_to_the_next_calls(tmp_path,
                                                                          monkeypatch):
    """A call of the accuracy reward that timed out went on comparing in its abandoned
    thread, holding the math-verify worker: every later step's call waited behind it and
    timed out too (its reward the fallback at every step). Its comparison in flight is
    ended and it makes no more; the next call is graded."""
    import threading

    from maxent_grpo.rewards import timeout as timeout_module
    from maxent_grpo.rewards.timeout import TimedReward
    from maxent_grpo.rewards.verify_worker import Verifier

    script = tmp_path / "slow.py"
    script.write_text(SLOW_WORKER)
    verifier = Verifier(command=[sys.executable, str(script)], call_seconds=3600)
    monkeypatch.setattr(timeout_module, "VERIFIER", verifier)
    made: list[str] = []

    def graded(prompts, completions, answer, **kwargs):
        made.append(threading.current_thread().name)
        return [float(verifier.equal(a, c)) for a, c in zip(answer, completions, strict=True)]

    first = TimedReward("accuracy", graded, timeout=0.5, fallback=0.0, has_fallback=True)
    later = TimedReward("accuracy", graded, timeout=300, fallback=-1.0, has_fallback=True)
    try:
        # the first call hangs on "slow" and would then compare two more
        assert first(prompts=["p"] * 3, completions=["x", "y", "z"],
                     answer=["slow", "slow", "z"]) == [0.0, 0.0, 0.0]
        assert later(prompts=["p"] * 2, completions=["1", "2"], answer=["1", "3"]) == [1.0, 0.0]
        assert len(made) == 2 and verifier._process is not None  # a new worker graded it
    finally:
        verifier.stop()
    assert verifier._process is None or verifier._process.poll() is not None


def test_stopping_the_verifier_ends_its_worker_even_mid_comparison(tmp_path):
    """The end of a fit, validate or predict stops the worker (it was left running under
    the Python API), without waiting for a comparison in flight, which scores 0.0."""
    import threading

    from maxent_grpo.rewards.verify_worker import Verifier

    script = tmp_path / "slow.py"
    script.write_text(SLOW_WORKER)
    verifier = Verifier(command=[sys.executable, str(script)], call_seconds=3600)
    assert verifier.equal("1", "1") is True
    worker = verifier._process
    verifier.stop()
    assert worker.poll() is not None and verifier._process is None
    verdicts: list[bool] = []
    comparing = threading.Thread(target=lambda: verdicts.append(verifier.equal("slow", "x")))
    comparing.start()
    while verifier._calls < 2:  # its worker started, the comparison sent (or about to be)
        comparing.join(0.01)
    verifier.stop()  # returns at once; the comparison's thread closes the worker
    comparing.join(60)
    assert verdicts == [False] and verifier._process is None


def test_other_scripts_digits_are_no_answer_and_the_minus_sign_is_a_minus():
    """``\\d`` read Arabic-Indic or full-width digits as digits in the rewards while the
    canonical answers kept them as written: an ordered digit pair the reward called right
    was missing from the row's valid answers and the evaluation stopped at the end of a
    validation epoch. ``−`` (U+2212) was not read as a minus: ``−8`` was a right ``8``."""
    from maxent_grpo.rewards.answers import canonical_answer, first_number_reward, sample_answer
    from maxent_grpo.rewards.task_rewards import digit_pair_reward
    from maxent_grpo.tasks import build_task
    from maxent_grpo.training.run.evaluation import PromptRecord, evaluation_metrics

    row = build_task("digit_pairs", num_rows=1, seed=0, min_target=9, max_target=9,
                     ordered=True)[0]
    pairs = ["<answer>٤ + ٥</answer>", "<answer>４ + ５</answer>", "<answer>4 + 5</answer>"]
    scores = digit_pair_reward([row["prompt"]] * 3, pairs, target=[row["target"]] * 3)
    assert scores == [0.0, 0.0, 1.0]
    record = PromptRecord(correct=tuple(scores), answers=tuple(map(sample_answer, pairs)),
                          valid_answers=frozenset(row["valid_answers"]), task=row["task"],
                          answer_form=row["answer_form"])
    assert evaluation_metrics([record], [1], "val")["val/pass@1"] == pytest.approx(1 / 3)
    assert first_number_reward(["q"] * 4, [" −8", " −8", "٨", " 8"],
                               answer=["8", "-8", "8", "8"]) == [0.0, 1.0, 0.0, 1.0]
    assert canonical_answer("−8", "first_number") == "-8"
    assert canonical_answer("٨", "first_number") is None
    assert countdown_reward(["q"] * 3, ["<answer>(5 − 3) * 8</answer>",
                                        "<answer>5 · 3 + 1</answer>", "<answer>16 ∗ 1</answer>"],
                            numbers=[[5, 3, 8], [5, 3, 1], [16, 1]], target=[16] * 3) == [1.0] * 3


def test_integer_references_are_read_strictly() -> None:
    """``digit_pair`` truncated a 9.5 target to 9, and ``first_number`` read ``"٣"`` and
    ``"1_000"`` as integers that no completion (read in ASCII digits) could give."""
    from maxent_grpo.rewards import digit_pair_reward, first_number_reward

    assert digit_pair_reward(["q"] * 3, ["4 + 5"] * 3, target=[9, 9.0, " 9"]) == [1.0] * 3
    with pytest.raises(ValueError, match=r"digit_pair: the target given with completion 0 .* "
                                         r"integer; got 9\.5"):
        digit_pair_reward(["q"], ["4 + 5"], target=[9.5])
    for gold in ("\u0663", "1_000"):
        with pytest.raises(ValueError, match="first_number: the answer given with completion 0"):
            first_number_reward(["q"], ["3"], answer=[gold])
    assert first_number_reward(["q"], ["-3 apples"], answer=["-3"]) == [1.0]
    np = pytest.importorskip("numpy")  # a direct caller's pandas column
    assert digit_pair_reward(["q"], ["4 + 5"], target=[np.int64(9)]) == [1.0]
    assert first_number_reward(["q"], ["8"], answer=[np.int64(8)]) == [1.0]


def test_in_set_reads_a_json_cell_and_refuses_what_is_no_list_of_integers() -> None:
    """A string ``valid_answers`` was read a character at a time ("12" accepted 1 and 2)
    and an int raised a bare TypeError."""
    from maxent_grpo.rewards import in_set_reward

    completions = [" 1", " 2", " 12", " 19"]
    assert in_set_reward(["q"] * 4, completions, valid_answers=['["12", "19"]'] * 4) == [
        0.0, 0.0, 1.0, 1.0]
    for bad in ("12", 17, ["1", True], ["x"]):
        with pytest.raises(ValueError, match="in_set: the valid_answers given with completion 0 "
                                             "of the step must be a list of integers"):
            in_set_reward(["q"] * 4, completions, valid_answers=[bad] * 4)
    assert in_set_reward(["q"], [" 3"], valid_answers=[None]) == [None]


def no_kwargs(prompts, completions):
    """A reward without ``**kwargs``."""
    return [1.0] * len(completions)


class Scorer:
    """A class named as a reward (its instances would be)."""

    def __call__(self, prompts, completions, **kwargs):
        return [1.0] * len(completions)


def with_setting(completions, max_chars=None, **kwargs):
    """A reward with an optional setting of its own (no column)."""
    return [float(max_chars is None or len(c) <= max_chars) for c in completions]


def needs_solution(prompts, completions, solution, **kwargs):
    """A reward that takes a column by name, without a default."""
    return [float(s in c) for c, s in zip(completions, solution, strict=True)]


def needs_calls(prompts, completions, tool_calls, **kwargs):
    return [float(n) for n in tool_calls]


def needs_environments(prompts, completions, environments, **kwargs):
    return [0.0] * len(completions)


def test_a_reward_taking_what_only_another_kind_of_rollout_gives_is_named_at_the_start():
    """``tool_calls`` in a run without tools (the docs' comparison run, ``--model.tools
    null``) or ``environments`` in a tools run passed the start's check and was a TypeError
    at the first step (a multi-turn hunt)."""
    from types import SimpleNamespace

    from maxent_grpo.training.run.policy_models import check_arguments

    def check(fn, tools):
        rewards = SimpleNamespace(names=[fn.__name__], funcs=[fn])
        check_arguments(rewards, [{"answer": "1"}], "train", tools)

    toolbox, environment = (SimpleNamespace(environment=None),
                            SimpleNamespace(environment=object))
    check(needs_calls, toolbox)
    check(needs_calls, environment)
    check(needs_environments, environment)
    with pytest.raises(ValueError, match="needs_calls takes the argument 'tool_calls', which "
                                         "only model.tools or model.environment rollouts give"):
        check(needs_calls, None)
    with pytest.raises(ValueError, match="'environments', which only model.environment"):
        check(needs_environments, toolbox)
    rewards = SimpleNamespace(names=["needs_calls"], funcs=[needs_calls])  # a data column
    check_arguments(rewards, [{"answer": "1", "tool_calls": 2}], "train", None)
    with pytest.raises(ValueError, match="the train column 'tool_calls' clashes with the "
                                         "multi-turn rollout's reward argument"):
        check_arguments(rewards, [{"answer": "1", "tool_calls": 2}], "train", toolbox)
    with pytest.raises(ValueError, match="the train column 'environments' clashes"):
        check_arguments(SimpleNamespace(names=[], funcs=[]),
                        [{"environments": 1}], "train", environment)
    check_arguments(SimpleNamespace(names=[], funcs=[]), [{"environments": 1}], "train", toolbox)

def test_the_rewards_arguments_are_checked_against_the_columns_at_the_fit_start(
        cache_dir, tmp_path):
    """Three mistakes of the extension-points hunt, each now named when the fit starts: a
    column named ``completions`` crashed as "a bug" (the check of the references spread it
    beside the argument); a reward taking a column no row has was a TypeError at the first
    step, pointing into the package; ``first_number`` with no answers graded nothing, no
    word (``data.answer_column: null``)."""
    from tests.conftest import fit, make_data, make_module

    def data(rows, **options):
        path = tmp_path / "rows.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return make_data(cache_dir, task=None, task_options=None, data_files=str(path),
                         val_size=0, **options)

    rows = [{"prompt": f"{i} + 1 =", "answer": str(i + 1)} for i in range(8)]
    with pytest.raises(ValueError, match=r"the column 'completions' of data.data_files file "
                       r"'.*rows.jsonl' row 0 \(train prompt '0 \+ 1 ='\) clashes with the "
                       r"reward argument of that name; rename the dataset column"):
        fit(make_module(cache_dir, rewards={"first_number": 1.0}),
            data([row | {"completions": "x"} for row in rows]), steps=1)
    rewards = {f"{__name__}:needs_solution": 1.0}
    with pytest.raises(ValueError, match=rf"model.rewards.{__name__}:needs_solution takes the "
                       r"argument 'solution', which no train row has \(their columns: answer"):
        fit(make_module(cache_dir, rewards=rewards), data(rows), steps=1)
    with pytest.raises(ValueError, match=rf"model.rewards.{__name__}:no_kwargs does not take the "
                       r"argument 'completion_ids' \(nor \*\*kwargs\): every reward is called "
                       r"with prompts, completions, completion_ids, .* and each data column "
                       r"\(answer\)"):
        fit(make_module(cache_dir, rewards={f"{__name__}:no_kwargs": 1.0}), data(rows), steps=1)
    with pytest.raises(ValueError, match=rf"model.rewards.{__name__}:Scorer is a class: name a "
                                         r"function, or an instance"):
        fit(make_module(cache_dir, rewards={f"{__name__}:Scorer": 1.0}), data(rows), steps=1)
    no_answers = [{"prompt": row["prompt"]} for row in rows]
    with pytest.warns(UserWarning, match=r"model.rewards.first_number reads the column "
                                         r"'answer', which no train row fills"):
        fit(make_module(cache_dir, rewards={"first_number": 1.0, "format": 0.1}),
            data(no_answers, answer_column=None), steps=1)
    # an optional argument of the user's that no row has is a setting of it: not warned of
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*which no train row fills")
        fit(make_module(cache_dir, rewards={f"{__name__}:with_setting": 1.0}), data(rows),
            steps=1)


def test_a_reference_the_rewards_cannot_read_stops_the_fit_at_its_start(cache_dir, tmp_path):
    """A row whose answer ``first_number`` cannot read failed only when it was first
    sampled (steps into a run, and again at every resume); every row is read at the start."""
    from maxent_grpo.rewards import WeightedRewards
    from maxent_grpo.training.run.policy_models import check_references
    from tests.conftest import fit, make_data, make_module

    rewards = WeightedRewards({"first_number": 1.0, "format": 1.0})
    rows = [{"answer": str(i)} for i in range(5)]
    where = "row {}".format
    check_references(rewards.names, rows, where)  # readable: nothing
    rows[3] = {"answer": "eight"}
    with pytest.raises(ValueError, match=r"model.rewards.first_number cannot grade row 3: "
                                         r"first_number: the answer must be an integer; "
                                         r"got 'eight'"):
        check_references(rewards.names, rows, where)
    path = tmp_path / "train.jsonl"
    lines = [{"prompt": f"{i} + 1 =", "answer": str(i + 1)} for i in range(12)]
    lines[9]["answer"] = "ten"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    data = make_data(cache_dir, task=None, task_options=None, data_files=str(path), val_size=0)
    with pytest.raises(ValueError, match=r"cannot grade data.data_files file '.*train.jsonl' "
                                         r"row 9 \(train prompt '9 \+ 1 ='\)"):
        fit(make_module(cache_dir), data, steps=1)
    # two files: the second file and its own row (it was the row among all files, 11)
    first = tmp_path / "first.jsonl"
    first.write_text("".join(json.dumps(line) + "\n" for line in lines[:2]))
    data = make_data(cache_dir, task=None, task_options=None, shuffle=False,
                     data_files=[str(first), str(path)], val_size=0)
    with pytest.raises(ValueError, match=r"cannot grade data.data_files file '.*/train.jsonl' "
                                         r"row 9 \(train"):
        fit(make_module(cache_dir), data, steps=1)
    # a validation row: named before Lightning's sanity check validates (which raised the
    # reward's own error, naming no row)
    data = make_data(cache_dir, task=None, task_options=None, data_files=str(path), val_size=4)
    data.setup("fit")
    bad = data.val_dataset.examples[0].index
    lines[9]["answer"], lines[bad]["answer"] = "10", "many"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    data = make_data(cache_dir, task=None, task_options=None, data_files=str(path), val_size=4)
    with pytest.raises(ValueError, match=rf"cannot grade data.data_files .* row {bad} \(val "):
        fit(make_module(cache_dir), data, steps=1, limit_val_batches=1, num_sanity_val_steps=2)


def test_an_answer_form_that_is_no_form_stops_fit_and_validate_at_their_start(cache_dir,
                                                                              tmp_path):
    """A typo (``Ordered``) in the answer_form column passed the setup and the model's load,
    then stopped the run at its first step, naming no row; a blank cell (how a CSV holds a
    missing value, documented as the default form) did the same."""
    import lightning as L

    from maxent_grpo.rewards.answers import canonical_answer
    from tests.conftest import fit, make_data, make_module

    assert canonical_answer("5+4", "") == canonical_answer("5+4") == "4 + 5"
    path = tmp_path / "train.jsonl"
    lines = [{"prompt": f"{i} + 1 =", "answer": str(i + 1), "answer_form": ""}
             for i in range(12)]
    lines[7]["answer_form"] = "Ordered"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    expected = r"the answer_form of data.data_files file '.*train.jsonl' row 7 .* got 'Ordered'"
    with pytest.raises(ValueError, match=expected):
        fit(make_module(cache_dir), make_data(cache_dir, task=None, task_options=None,
                                              data_files=str(path), val_size=0), steps=1)
    # a validate reads its validation rows only (the typo in a training row is not its own)
    data = make_data(cache_dir, task=None, task_options=None, data_files=str(path), val_size=4)
    data.setup("validate")
    assert all(example.index != 7 for example in data.val_dataset.examples)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=1)
    trainer.validate(make_module(cache_dir), data)
    bad = data.val_dataset.examples[1].index
    lines[bad]["answer_form"] = "expressions"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(ValueError, match=rf"the answer_form of .* row {bad} \(val prompt .* got "
                                         r"'expressions'"):
        trainer.validate(make_module(cache_dir), make_data(
            cache_dir, task=None, task_options=None, data_files=str(path), val_size=4))
    # test and predict sample the validation rows too: checked at their start as well (they
    # failed after sampling, in the reward, naming neither file nor row)
    for run in (trainer.test, trainer.predict):
        with pytest.raises(ValueError, match=rf"the answer_form of .* row {bad} \(val prompt"):
            run(make_module(cache_dir), make_data(
                cache_dir, task=None, task_options=None, data_files=str(path), val_size=4))


def test_async_rewards_share_one_loop_and_keep_their_time_limit() -> None:
    """A loop per call closed what a reward module keeps across calls (a semaphore, a
    client: "bound to a different event loop" at the second step), and ``timeout`` timed
    only the coroutine's creation (a 2 s reward with timeout 0.1 returned after 2 s)."""
    import asyncio
    import time

    from maxent_grpo.rewards.timeout import TimedReward

    gate: list[asyncio.Semaphore] = []

    async def gated(completions, **kwargs):
        if not gate:
            gate.append(asyncio.Semaphore(1))
        async with gate[0]:
            return [1.0] * len(completions)

    for _ in range(2):  # the second call reuses the first call's semaphore
        assert score_completions([("g", gated, 1.0)], ["p"], ["x"], {})[0].tolist() == [1.0]

    async def slow(completions, **kwargs):
        await asyncio.sleep(2)
        return [1.0] * len(completions)

    timed = TimedReward("slow", slow, timeout=0.1, fallback=0.0, has_fallback=True)
    start = time.monotonic()
    assert timed(prompts=["p"], completions=["x"]) == [0.0]
    assert time.monotonic() - start < 1.5 and timed.timeouts == 1


def lengths_logged(completions, log_metric, **kwargs):
    """A TRL-style reward that logs a scalar of its own: the mean length it graded."""
    lengths = [float(len(c)) for c in completions]
    log_metric("mean.len", sum(lengths) / len(lengths))
    log_metric("mean_len", -1.0)  # another metric (their internal keys once met)
    log_metric("calls", 1.0)
    return lengths


def test_what_a_reward_function_gives_log_metric_is_logged_each_step(cache_dir, tmp_path):
    """``log_metric(name, value)`` (TRL's) was accepted and dropped; now it is logged as
    ``train/reward_log/<name>``, the mean of the step's calls, validation's left out."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    from tests.conftest import fit, make_data, make_module

    name = "tests.rewards.test_rewards:lengths_logged"
    module = make_module(cache_dir, rewards={name: 1.0})
    fit(module, make_data(cache_dir), steps=3, tmp_path=tmp_path, logger=CSVLogger(tmp_path),
        log_every_n_steps=1, limit_val_batches=1, val_check_interval=1)
    rows = [r for r in csv.DictReader(open(tmp_path / "lightning_logs/version_0/metrics.csv"))
            if r.get("train/reward_log/calls")]
    assert len(rows) == 3
    for row in rows:  # one call a step: its value is the function's own mean
        assert float(row["train/reward_log/calls"]) == 1.0
        assert float(row["train/reward_log/mean.len"]) == pytest.approx(
            float(row[f"train/reward/{name}/mean"]))
        assert float(row["train/reward_log/mean_len"]) == -1.0
    assert module.rewards.take_logged() == []  # the last validation's calls were dropped


def nan_logged(completions, log_metric, **kwargs):
    log_metric("nan", float("nan"))
    return [1.0] * len(completions)


def test_a_bad_log_metric_call_names_the_reward_function():
    from maxent_grpo.cli.errors import message_of
    from maxent_grpo.rewards import WeightedRewards
    from maxent_grpo.rollout.batch import PromptCompletionBatch

    rewards = WeightedRewards({"tests.rewards.test_rewards:nan_logged": 1.0})
    with pytest.raises(RewardFunctionError, match=r"nan_logged.*log_metric\(name, value\) "
                       r"needs a name and a finite number; got \('nan', nan\)") as raised:
        rewards(PromptCompletionBatch(["p"], ["c"]), {}, 1)
    line = nan_logged.__code__.co_firstlineno + 1  # its own call, not combine.py's check
    assert message_of(raised.value).endswith(f"(at {__file__}:{line})")


def late_logger(completions, log_metric, **kwargs):
    import time

    time.sleep(0.6)  # past its timeout: the call has ended when it logs
    log_metric("late", 1.0)
    return [1.0] * len(completions)


def test_a_reward_that_timed_out_logs_nothing_into_a_later_step():
    """A reward past its ``timeout`` goes on in its thread; what it logged afterwards was
    counted in whichever step took the logs next."""
    import time

    from maxent_grpo.rewards import WeightedRewards
    from maxent_grpo.rollout.batch import PromptCompletionBatch

    rewards = WeightedRewards({"tests.rewards.test_rewards:late_logger": {
        "weight": 1.0, "timeout": 0.2, "fallback": 0.0}})
    total, _ = rewards(PromptCompletionBatch(["p"], ["c"]), {}, 1)
    assert total.tolist() == [0.0]  # the fallback
    time.sleep(0.8)  # the function has logged by now
    assert rewards.take_logged() == []


def test_a_reasoning_models_answer_is_read_after_its_reasoning():
    """The last <answer> block or box anywhere won, the think block's scratch work too: a
    right final answer scored 0, a wrong one 1, and a completion cut off while thinking (the
    chat template opened <think>) scored its passing guess; the answer statistics alike."""
    from maxent_grpo.rewards import first_number_reward, in_set_reward
    from maxent_grpo.rewards.answers import answer_key, answer_keys, extract_answer

    mused = "Format: <answer>8</answer>? No, 3+4=7.\n</think>\n\n\\boxed{7}"
    wrong = "Is it <answer>7</answer>? No, I'm sure it's 8.\n</think>\n\nIt is \\boxed{8}."
    cut = "Let me see, 3+4... \\boxed{7} would be my first guess, but let me count: 3, 4"
    opened = "<|im_start|>assistant\n<think>\n"
    assert accuracy_reward(["q"] * 3, [mused, wrong, cut], answer=["7"] * 3,
                           rendered_prompts=[opened] * 3) == [1.0, 0.0, 0.0]
    # without a prompt that opens it, a completion's own unclosed <think> is reasoning too
    assert accuracy_reward(["q"] * 2, ["<think>" + cut, cut], answer=["7"] * 2) == [0.0, 1.0]
    assert [answer_key(c) for c in (mused, wrong)] == ["7", "8"]
    assert answer_keys([mused, cut], [opened, "q"], None, 1) == ["7", "7"]
    assert answer_keys([cut], [opened], None, 1) == [None]
    assert extract_answer(cut, opens_think=True) is None
    # reasoning opened again after its last close and cut off: no answer, for every reader
    reopened = "<think>a</think><answer>7</answer><think>more"
    assert accuracy_reward(["q"], [reopened], answer=["7"]) == [0.0]
    assert first_number_reward(["q"], [reopened], answer=["7"]) == [0.0]
    assert answer_key(reopened) is None
    # tags an answer quotes are its text, not reasoning
    quoting = "<think>r</think><answer>print('<think>')</answer>"
    assert answer_key(quoting) == "print('<think>')"
    assert answer_key("<think>r</think><answer>a</think>b</answer>") == "a</think>b"
    # a fraction or decimal that runs on is no number: 16/2.5 is not 8
    assert first_number_reward(["q"] * 4, [" 16/2.5", " 12/4/2023", " 3,000/1,000", " 7,11"],
                               answer=["8", "3", "3000", "7"]) == [0.0, 0.0, 0.0, 1.0]
    # the bare rewards read the first number after the reasoning, and a whole one only
    assert first_number_reward(["q"] * 5, ["<think>8?</think> 7", " 8.5", " 8/3", " 1,665", " 8."],
                               answer=["7", "8", "8", "1665", "8"]) == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert in_set_reward(["q"] * 2, [" 4.5", " 4, or 9"], valid_answers=[["4", "9"]] * 2) == [
        0.0, 1.0]


def test_a_template_that_closes_the_reasoning_block_leaves_the_layout_reachable():
    """A no-thinking template ends the prompt with ``<think>\\n\\n</think>``: ``format`` gave
    0.0 and ``tag_count`` 0.5 to every completion, whatever it wrote."""
    from maxent_grpo.rewards import format_reward, tag_count_reward

    closed = ["<|im_start|>assistant\n<think>\n\n</think>\n\n"]
    assert format_reward(["q"], ["<answer>7</answer>"], rendered_prompts=closed) == [1.0]
    assert tag_count_reward(["q"], ["<answer>7</answer>"], rendered_prompts=closed) == [1.0]
    # a model that writes its own block after the template's scores as before
    assert format_reward(["q"], ["<think>x</think><answer>7</answer>"],
                         rendered_prompts=closed) == [1.0]
    assert tag_count_reward(["q"], ["<think>x</think><answer>7</answer>"],
                            rendered_prompts=closed) == [1.0]
    assert format_reward(["q"], ["<answer> </answer>"], rendered_prompts=closed) == [0.0]
    assert format_reward(["q"], ["<answer>7</answer>"], rendered_prompts=["plain"]) == [0.0]


def test_countdown_reads_integral_floats_as_the_other_rewards_do():
    """pandas writes an integer column with blanks as floats (16.0): countdown refused the
    row where digit_pair and first_number read it."""
    from maxent_grpo.rewards import countdown_reward

    assert countdown_reward(["q"] * 2, ["<answer>(3 + 5) * 2</answer>"] * 2,
                            numbers=[[2.0, 3, 5], "[2, 3, 5]"], target=[16.0, "16"]) == [1.0, 1.0]
    with pytest.raises(ValueError, match="must be a list of ints and an int"):
        countdown_reward(["q"], ["<answer>1</answer>"], numbers=[[2, 3, 5]], target=[16.5])


def test_the_answer_keys_and_the_grader_read_bold_alike():
    """The worker script imports nothing of the package, so the bold pattern stands twice."""
    from maxent_grpo.rewards import answers, verify_worker

    assert answers.BOLD.pattern == verify_worker._BOLD.pattern


def test_the_answer_after_reasoning_is_found_in_one_pass_over_many_tags() -> None:
    """Each ``</think>`` inside an answer block searched the whole text again: 12.8 s for
    40,000 of them (320 KB) in every reward and in each step's answer keys, with no timeout
    (a fuzz of model-written text). Quoted tags stay the answer's text."""
    import signal

    from maxent_grpo.rewards.answers import final_text

    assert final_text("<think>a</think><answer>x </think> y</answer>") == (
        "<answer>x </think> y</answer>")
    assert final_text("<answer>x</answer><think>still") is None
    assert final_text("<think>a <answer>8</answer></think> 7") == " 7"
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError("a hang")))
    signal.alarm(30)  # about two minutes before at 80,000 tags; milliseconds now
    try:
        quoted = "<think>ok</think><answer>" + "</think>" * 80000 + "7</answer>"
        assert final_text(quoted).endswith("7</answer>")
    finally:
        signal.alarm(0)


def test_numbers_in_scientific_notation_are_written_out_from_the_last_within_a_budget():
    """A model writing ``1e999`` a thousand times made megabytes of digits for math-verify;
    the numbers are written out from the last (the answer) while they add at most
    ``SCIENTIFIC_DIGITS`` characters, the rest left as written."""
    from maxent_grpo.rewards.verify_worker import SCIENTIFIC_DIGITS, _plain

    assert _plain("3e8 and 1.5E-3, so 2e2.") == "300000000 and 0.0015, so 200"
    text = "1e999 " * 1000 + "so 3e8"
    plain = _plain(text)
    assert len(text) < len(plain) <= len(text) + SCIENTIFIC_DIGITS
    assert plain.endswith(" so 300000000") and plain.startswith("1e999 1e999 ")
    assert plain.count("0" * 999) == (SCIENTIFIC_DIGITS - 6) // 995


def test_prose_words_are_found_outside_latex_commands_as_the_pairwise_check_did():
    """``_words`` finds a word's command by bisection (a pairwise check took 12.5 s for 48 KB
    of ``\\a bb``); on random LaTeX it finds what the pairwise check found."""
    import random

    from maxent_grpo.rewards import verify_worker as vw

    def pairwise(text):
        commands = [m.span() for m in vw._COMMANDS.finditer(text)]
        return [m.span() for m in vw._PROSE_WORD.finditer(text)
                if m.group() not in vw._MATH_WORDS
                and not any(s <= m.start() < e for s, e in commands)]

    pieces = ["\\text{ab cd}", "\\frac", "{", "}", "ab", "x", "pi", " ", "\\mathrm{ kg }",
              "word", "\\alpha", "\\textbf{bold words}", "12", "\\begin{pmatrix}", "\\sqrt"]
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice(pieces) + rng.choice(["", " "])
                       for _ in range(rng.randint(0, 30)))
        assert vw._words(text) == pairwise(text), text
    assert vw._words("\\a bb " * 8000) == [(3 + 6 * i, 5 + 6 * i) for i in range(8000)]


def test_a_failed_run_stops_the_verifier_too(tmp_path, monkeypatch):
    """The end of a stage stopped the worker, but a failed run reaches no teardown of
    ``ModuleHooks``: its worker stayed until the process ended (a notebook's, a sweep's)."""
    from types import SimpleNamespace

    import maxent_grpo.training.callbacks.module_own as module_own
    from maxent_grpo.rewards.verify_worker import Verifier

    script = tmp_path / "slow.py"
    script.write_text(SLOW_WORKER)
    verifier = Verifier(command=[sys.executable, str(script)])
    monkeypatch.setattr(module_own, "VERIFIER", verifier)
    assert verifier.equal("1", "1") is True
    worker = verifier._process
    torn: list[str] = []
    module = SimpleNamespace(teardown=torn.append)
    module_own.CleanUp().on_exception(None, module, RuntimeError("the step failed"))
    assert torn == ["fit"] and worker.poll() is not None and verifier._process is None


def test_an_object_with_an_async_call_that_raises_is_not_called_again_row_by_row(
        monkeypatch) -> None:
    """The search for the row a reward fails on skips ``async def`` rewards (awaiting each
    call is theirs to pay); an object whose ``__call__`` is async was called again and its
    coroutines never awaited (a RuntimeWarning, no row named)."""
    from maxent_grpo.rewards import combine

    searched = []
    monkeypatch.setattr(combine, "failing_row", lambda *args, **kw: searched.append(1))

    class AsyncRaiser:
        async def __call__(self, completions, **kwargs):
            raise ValueError("bad row")

    async def raiser(completions, **kwargs):
        raise ValueError("bad row")

    for fn in (AsyncRaiser(), raiser):
        with pytest.raises(RewardFunctionError, match=r"raised ValueError: bad row$"):
            score_completions([("a", fn, 1.0)], ["p", "p"], ["c", "1"], {})
    assert searched == []


def test_math_verify_messages_quote_model_text_escaped_and_cut(caplog):
    """A timed-out parse logged the whole answer raw: a completion's terminal escapes (clear
    screen, window title) and 10 KB a sample reached the trainer's console (a hunt)."""
    import logging

    from maxent_grpo.rewards import verify_worker  # noqa: F401 - installs the filter

    evil = "{" * 5000 + "\x1b[2J\x1b]0;title\x07\rPWNED"
    with caplog.at_level(logging.WARNING, logger="math_verify"):
        logging.getLogger("math_verify.parser").warning(f"Timeout during parsing: {evil}")
        logging.getLogger("math_verify.grader").warning("Timeout during comparison")
    first, second = (r.getMessage() for r in caplog.records)
    assert first.startswith("Timeout during parsing: '{{{") and len(first) < 160
    assert "\x1b" not in first and "\r" not in first
    assert second == "Timeout during comparison"


def test_an_equation_whose_value_is_wrong_is_not_keyed_as_its_left_side() -> None:
    """``(3 + 5) * 2 = 17`` was keyed as ``(3 + 5) * 2``, the answer that the countdown reward
    pays for target 16, while it pays 0.0 for this one: the answer statistics and the
    answer-level objectives put a wrong and a right answer under one key (a hunt: ``6 = 7``
    as ``6``). The key and the reward read the value given alike (readers: in braces, with
    words, as a fraction; ``= {16}`` and ``= 16 apples`` scored 0.0)."""
    from maxent_grpo.rewards.answers import answer_key

    wrong = ["(3 + 5) * 2 = 17", "(3+5)*2 = {17}", "(3+5)*2 = (17)", "(3 + 5) * 2 = 17 apples",
             "(3+5)*2 = 17 (wrong)", "(3+5)*2 = 17\\%", "(3+5)*2 = \\frac{34}{2}",
             "(3+5)*2 = $17$", "(3+5)*2 = 17, so it is", "(3 + 5) * 2 = x", "(3 + 5) * 2 ="]
    right = ["(3 + 5) * 2", "2 * (5 + 3) = 16", "(3+5)*2 = {16}", "(3+5)*2 = 16.",
             "(3+5)*2 = 16 apples", "(3+5)*2 = \\frac{32}{2}", "(3+5)*2 = 4 \\times 4",
             "(3+5)*2 = 16, so it is"]
    texts = wrong + right
    rewards = countdown_reward(["q"] * len(texts), [f"<answer>{t}</answer>" for t in texts],
                               numbers=[[2, 3, 5]] * len(texts), target=[16] * len(texts))
    keys = [answer_key(f"<answer>{t}</answer>") for t in texts]
    assert rewards == [0.0] * len(wrong) + [1.0] * len(right)
    assert len(set(keys[len(wrong):])) == 1 and None not in keys
    assert not set(keys[:len(wrong)]) & set(keys[len(wrong):]), keys
    assert answer_key("6 = 7") != answer_key("6") == answer_key("6 = 6")

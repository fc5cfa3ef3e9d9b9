"""Answers: the final answer of a completion, its canonical form, and the correctness
rewards ``accuracy`` and ``first_number`` that grade it.

**Reading.** :func:`completion_text` is a completion's text; :func:`extract_answer` its final
answer (last ``<answer>...</answer>`` block, else last balanced ``\\boxed{...}``);
:func:`answer_key` the answer as the answer statistics and the answer-level objectives
compare it, under the task's ``answer_form`` (:func:`canonical_answer`).

**Grading** (here ``accuracy`` and ``first_number``; ``countdown``, ``digit_pair`` and
``in_set`` in :mod:`~maxent_grpo.rewards.task_rewards`): each reads the final answer; a
completion without one scores 0.0. A row whose reference columns hold ``None`` scores
``None`` (not applicable); a missing column raises ``ValueError`` (the reward does not fit
the task).
"""

from __future__ import annotations

import bisect
import numbers
import re
import sys
import threading
from collections.abc import Callable
from typing import Any

from maxent_grpo.rewards.registry import register_reward
from maxent_grpo.rewards.verify_worker import VERIFIER, math_equal, reference_answer
from maxent_grpo.tasks.expressions import (
    canonical_expression,
    given_value,
    number_value,
    split_equation,
    unworked,
    unwrap_math,
)

_BOXED_OPEN = re.compile(r"\\boxed\s*\{")


def answer_blocks(text: str) -> list[str]:
    """The contents of the ``<answer>...</answer>`` blocks of ``text``, in order (each
    opening tag closed by the next closing tag). A scan, not a lazy regex: unclosed tags
    repeated over a long text made the regex quadratic (5 s on 100k characters).

    >>> answer_blocks("<answer>1</answer> <answer><answer>2</answer> <answer>3")
    ['1', '<answer>2']
    """
    blocks, pos = [], 0
    while (start := text.find("<answer>", pos)) >= 0:
        end = text.find("</answer>", start + 8)
        if end < 0:
            break
        blocks.append(text[start + 8:end])
        pos = end + 9
    return blocks


#: a number as bare answers write it: ASCII digits (``int`` would read other scripts'
#: digits, which the canonical answers do not) after ``-`` or the minus sign ``−``, with
#: its thousands grouped or not, a decimal or a fraction, read by its value (``8``, ``1,665``,
#: ``8.5``, ``.5``, ``8/3``; ``16/2`` is 8)
NUMBER = re.compile(r"[-−]?(?:[0-9]+(?:,[0-9]{3})*(?![0-9])(?:\.[0-9]+)?|\.[0-9]+)(?:/[0-9]+)?")


def first_integer(text: str) -> int | None:
    """The first number of ``text`` (:data:`NUMBER`) when it is whole (``8``, ``1,665``,
    ``8.0``), else None (``8.5``, ``8/3``, none, or too long to read: a model repeating a
    digit): the integer answer of a bare prompt.

    >>> first_integer(" 1,665 apples"), first_integer(" 8.5"), first_integer(" 07, 11")
    (1665, None, 7)
    """
    key = _first_number(text)
    # ``int`` refuses more digits than its limit (4300 by default: a model repeating a digit)
    limit = getattr(sys, "get_int_max_str_digits", lambda: 0)()
    if key is None or (limit and len(key.lstrip("-")) > limit):
        return None
    return int(key)


def _first_number(text: str) -> str | None:
    """The first number of ``text`` written as an integer when it is whole (any length:
    ``-007`` is ``-7``), else None."""
    match = NUMBER.search(text)
    if match is None:
        return None
    if re.match(r"[.,/][0-9]", text[match.end():]) and re.search(r"[./]", match.group()):
        return None  # a fraction or decimal that runs on: 16/2.5, 12/4/2023, 3,000/1,000
    number = match.group().replace("−", "-").replace(",", "")
    if not re.fullmatch(r"-?[0-9]+", number):  # a decimal or a fraction: whole, or none
        value = number_value(number, False)
        return None if value is None or value.denominator != 1 else str(value)
    digits = number.lstrip("-").lstrip("0")  # str(int(number)), for any length
    return ("-" if number.startswith("-") and digits else "") + (digits or "0")


def completion_text(completion: str | list[dict]) -> str:
    """The text of one completion: a plain string, or the ``"content"`` of the last message
    of a TRL conversational completion (a list of ``{"role", "content"}`` dicts).

    >>> completion_text([{"role": "assistant", "content": "hi"}])
    'hi'
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content")
        if isinstance(content, str):
            return content
    raise ValueError(
        "completions must hold str or non-empty lists of message dicts whose last "
        f"'content' is a str; got {completion!r:.200}"
    )


def prompt_opens_think(prompt: object) -> bool:
    """True when a plain-string prompt ends with ``<think>`` (trailing whitespace aside), as
    chat templates of reasoning models do; the completion then starts inside the block."""
    return isinstance(prompt, str) and prompt.rstrip().endswith("<think>")


def final_text(text: str, opens_think: bool = False) -> str | None:
    """The part of a completion that gives its answer: the text after its last
    ``</think>``; None while a reasoning block is still open (opened by the completion, again
    after its last ``</think>``, or by the prompt: ``opens_think``,
    :func:`prompt_opens_think`), the model cut off thinking; else the whole text. A
    reasoning model's scratch work is not its answer.

    >>> final_text("<think>is it <answer>8</answer>? no</think> <answer>7</answer>")
    ' <answer>7</answer>'
    >>> final_text("3+4, \\\\boxed{7} maybe", opens_think=True) is None
    True
    """
    close = _outside_answers(text, "</think>")  # tags an answer quotes are its text
    if close >= 0:
        text = text[close + len("</think>"):]
    elif opens_think:
        return None
    return None if _outside_answers(text, "<think>") >= 0 else text  # opened, never closed


def _outside_answers(text: str, tag: str) -> int:
    """Where the last ``tag`` of ``text`` outside every ``<answer>...</answer>`` block is,
    or -1."""
    opens = [m.start() for m in re.finditer("<answer>", text)]  # once: a text of many tags
    closes = [m.start() for m in re.finditer("</answer>", text)]  # was quadratic (a fuzz)
    at = len(text)
    while (at := text.rfind(tag, 0, at)) >= 0:
        i = bisect.bisect_right(opens, at - len("<answer>")) - 1  # the last <answer> before
        j = bisect.bisect_right(closes, at - len("</answer>")) - 1  # the last </answer> too
        inside = i >= 0 and (j < 0 or closes[j] < opens[i]) and bool(closes) and closes[-1] >= at
        if not inside:
            return at
    return -1


def thinking(prompts: list, kwargs: dict) -> list[bool]:
    """Per completion of a reward's call, whether the text the model continued opened a
    reasoning block: the trainer's ``rendered_prompts`` among the call's ``kwargs``, else
    the prompts (a plain-string prompt is that text)."""
    rendered = kwargs.get("rendered_prompts")
    return [prompt_opens_think(p) for p in (prompts if rendered is None else rendered)]


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` whose braces balance, or None.

    >>> last_boxed(r"so \\boxed{\\frac{1}{2}}.")
    '\\\\frac{1}{2}'
    """
    opens = {m.end() - 1 for m in _BOXED_OPEN.finditer(text)}  # positions of their "{"
    stack: list[int] = []
    found: tuple[int, int] | None = None  # (start, end) of the latest-starting closed box
    for pos, char in enumerate(text):
        if char == "{":
            stack.append(pos)
        elif char == "}" and stack:
            start = stack.pop()
            if start in opens and (found is None or start > found[0]):
                found = (start + 1, pos)
    return None if found is None else text[found[0] : found[1]]


def extract_answer(text: str, opens_think: bool = False) -> str | None:
    """The final answer of a completion, stripped, or None when it gives none.

    Read in its :func:`final_text` (after its reasoning; None while that is open): the
    content of the last ``<answer>...</answer>`` block wins; otherwise the content of the
    last balanced ``\\boxed{...}``. A ``\\boxed{...}`` inside the chosen answer block is
    unwrapped.

    >>> extract_answer("<think>2+2</think><answer> \\\\boxed{4} </answer>")
    '4'
    >>> extract_answer("no final answer") is None
    True
    """
    text = final_text(text, opens_think)
    return None if text is None else _answer_in(text)


def _answer_in(text: str) -> str | None:
    """:func:`extract_answer` of a completion's :func:`final_text`."""
    blocks = answer_blocks(text)
    if blocks:
        answer = blocks[-1]
        boxed = last_boxed(answer)
        return (boxed if boxed is not None else answer).strip()
    boxed = last_boxed(text)
    return None if boxed is None else boxed.strip()


def require_column(reward: str, name: str, values: list | None, n: int) -> list:
    """The column ``name`` for reward ``reward``; ValueError when it is absent or not one
    value per completion (``n`` completions)."""
    if values is None:
        raise ValueError(f"reward {reward!r} needs the dataset column {name!r}; the rows have "
                         "no such column")
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise ValueError(f"reward {reward!r}: column {name!r} must be a list with one value per "
                         f"completion ({n}); got {got}")
    return list(values)


def sample_answer(completion: str | list[dict], opens_think: bool = False) -> str | None:
    """The answer of one sample: :func:`extract_answer`, else the stripped
    :func:`final_text` (``None`` when that is empty, or the reasoning is still open).

    >>> sample_answer("<answer> 8 </answer>"), sample_answer(" 8 because "), sample_answer(" ")
    ('8', '8 because', None)
    """
    text = final_text(completion_text(completion), opens_think)
    if text is None:
        return None
    answer = _answer_in(text)
    return (text.strip() if answer is None else answer) or None


def coverage_answer(answer: str | None) -> str | None:
    """The canonical form of an expression answer, for coverage@k: ``×``, ``÷``,
    ``\\times``, ``\\div``, ``\\cdot`` read as ``*`` and ``/``, the left side of one
    ``=`` kept, then :func:`canonical_expression` (``None`` when it is not an expression,
    or the ``=`` gives no value the left reaches (``given_value``), as the countdown reward
    reads it: ``3 + 4 = 8 apples``, ``3 + 4 = ?`` are not ``3 + 4 = {7}``, ``3 + 4``).

    >>> coverage_answer("5 × 3 + 1 = 16"), coverage_answer("hello"), coverage_answer("6 = 7")
    ('1 + 3 * 5', None, None)
    """
    if answer is None:
        return None
    left, right = split_equation(answer)
    value = None if right is None else given_value(right)  # = x, = ?: no value given
    same = right is None or (value is not None and value == number_value(left))
    return canonical_expression(left) if same else None


#: how a task's answers are compared (the rows' ``answer_form`` column; absent or blank:
#: ``expression``)
ANSWER_FORMS = ("expression", "ordered", "first_number", "value")


#: whitespace beside a character that is no letter or digit (a sign, a bracket, ``\``)
_SPACED = re.compile(r" ?([^\w ]) ?")
#: a signed fraction as ``unwrap_math`` writes ``-\frac{1}{2}``: ``-(1)/(2)``
_FRACTION = re.compile(r"([-+]?)\((-?\d+(?:\.\d+)?)\)/\((-?\d+(?:\.\d+)?)\)")


def canonical_answer(answer: str | None, form: str | None = None) -> str | None:
    """An answer's canonical form under a task's ``answer_form``: ``"expression"`` (the
    default, ``None``) is :func:`coverage_answer`, where ``"5 + 4"`` and ``"4 + 5"`` are one
    answer; ``"ordered"`` keeps the order and removes the whitespace and math delimiters only (as
    the ``digit_pair`` reward reads an answer), so they are two
    (the ``digit_pairs`` task with ``ordered=True``); ``"first_number"`` is the first
    integer of the answer (the ``number_sets`` task); ``"value"`` is the exact value of the
    number after one ``=`` (else of the answer: ``-886``, ``-886.0``, ``$-886$`` and
    ``59 - 63 * 15 = -886`` are one; the ``arithmetic`` task). An answer that is no
    expression but a number is its value in the ``expression`` form too (``$18`` is ``18``).
    ``None`` when there is no answer (or it is not of the form: no number, no integer).

    >>> canonical_answer("5 + 4"), canonical_answer("5 + 4", "ordered"), canonical_answer(None)
    ('4 + 5', '5+4', None)
    >>> canonical_answer(" 07, 11", "first_number"), canonical_answer("none", "first_number")
    ('7', None)
    """
    if form in (None, "", "expression", "value"):
        if answer is None:
            return None
        if form == "value":
            left, right = split_equation(answer)
            value = number_value(right or left)
        elif (key := coverage_answer(answer)) is not None:
            return key
        else:  # a number that is no expression, also a signed LaTeX fraction (-\frac{1}{2})
            value = number_value(answer, False)
            fraction = None if value is not None else _FRACTION.fullmatch(unwrap_math(answer))
            if fraction is not None:  # the whole answer one fraction: not 3\frac{1}{2}
                value = number_value(f"{fraction[1]}{fraction[2]}/{fraction[3]}", False)
        # a fraction as its expression is written: 0.5 and 1/2 are one
        return None if value is None else str(value).replace("/", " / ")
    if form == "ordered":  # unwrapped as the digit_pair reward reads it: $4 + 8$ is 4+8
        return None if answer is None else ("".join(unwrap_math(answer).split()) or None)
    if form == "first_number":
        return None if answer is None else _first_number(answer)
    raise ValueError(f"answer_form must be one of {ANSWER_FORMS}; got {form!r}")


def answer_key(completion: str | list[dict], form: str | None = None,
               opens_think: bool = False) -> str | None:
    """A sample's answer as the answer statistics and the answer-level objectives compare
    them: :func:`canonical_answer` of :func:`sample_answer`, else (not an expression) the
    answer with whitespace collapsed; ``None``: no answer.

    >>> answer_key("4 + 5") == answer_key(" 5+4"), answer_key(" 8 "), answer_key("  ")
    (True, '8', None)
    """
    return compared_answer(sample_answer(completion, opens_think), form)


def answer_keys(completions: list, prompts: list, forms: list | None, group: int
                ) -> list[str | None]:
    """:func:`answer_key` of each of the ``len(prompts) * group`` completions (``group`` a
    prompt), under its prompt's ``answer_form`` (``forms``; None: the default) and reasoning
    (:func:`prompt_opens_think`: the prompts as the model continued them)."""
    return [answer_key(c, forms[i // group] if forms else None,
                       prompt_opens_think(prompts[i // group])) for i, c in enumerate(completions)]


#: Markdown's bold, a pair of ``**`` around a text (``**72**``), not Python's power (``9**2``)
BOLD = re.compile(r"(?<![\w*])\*\*(?=\S)([^*\n]{1,200}?)(?<=\S)\*\*(?![\w*])")


def compared_answer(answer: str | None, form: str | None = None) -> str | None:
    """An extracted answer as :func:`answer_key` compares it, without Markdown's bold (as the
    accuracy reward reads it: ``**72**`` is ``72``): :func:`canonical_answer`, else the answer
    with whitespace collapsed, and none beside a sign or bracket (``None``: no answer)."""
    answer = None if answer is None else BOLD.sub(r"\1", answer)
    key = canonical_answer(answer, form)
    return key if key is not None or answer is None else _SPACED.sub(
        r"\1", " ".join(answer.split()))  # (1, 3] is (1,3], x = 5 is x=5, 2 \pi is 2\pi


# ---------------------------------------------------------------- the correctness rewards
@register_reward("accuracy")
def accuracy_reward(
    prompts: list, completions: list, answer: list | None = None, **kwargs: object,
) -> list[float | None]:
    """1.0 when the final answer equals the ``answer`` column mathematically, else 0.0.

    Both sides go through math-verify (``parse``, then ``verify(gold, prediction)``), so
    ``0.5``, ``1/2`` and ``\\frac{1}{2}`` agree; when either side is LaTeX, both are read as
    math (:func:`~maxent_grpo.rewards.verify_worker.math_equal`), so ``2^{10}`` is 1024. When
    math-verify extracts nothing from either side (e.g. the reference is a word), the two
    strings are compared exactly after collapsing runs of whitespace. A worked solution
    ending in ``#### 72`` (GSM8K's) is graded by what follows ``####``
    (:func:`~maxent_grpo.rewards.verify_worker.reference_answer`). A reference that is
    ``None`` or blank gives ``None``. Each comparison may take
    :data:`~maxent_grpo.rewards.verify_worker.MATH_VERIFY_TIMEOUT_S` per parse and verify
    (then it is 0.0); off the main thread (a reward ``timeout``, a worker thread), where
    math-verify's limit does not work, the comparisons run in a worker process
    (:class:`~maxent_grpo.rewards.verify_worker.Verifier`), so that an answer such as
    ``9**(9*9*9*9*9*9*9*9*9)`` cannot hold the process. Against a reference that is a plain
    number, an answer that is still a calculation of numbers (``59 - 63 * 15`` for -886,
    the question copied, in LaTeX layout or not) is 0.0: the final answer is asked for
    (``1/2``, ``2^{10}`` and ``1.5 \\times 10^3`` are numbers, and
    ``59 - 63 * 15 = -886`` is graded by its value).

    >>> accuracy_reward(["What is 1/2?"], ["<think>half</think><answer>0.5</answer>"],
    ...                 answer=["1/2"])
    [1.0]
    >>> accuracy_reward(["What is 1/2?"], ["<think>hmm</think><answer>2</answer>"],
    ...                 answer=["1/2"])
    [0.0]
    """
    golds = require_column("accuracy", "answer", answer, len(completions))
    main = threading.current_thread() is threading.main_thread()
    parsed_golds: dict = {}

    def right(prediction: str, gold: str) -> bool:
        if _PLAIN_NUMBER.fullmatch(gold.strip()) and unworked(prediction):
            return False
        if main:
            return math_equal(gold, prediction, parsed_golds)
        return VERIFIER.equal(gold, prediction)

    golds = [None if gold is None else reference_answer(str(gold)) for gold in golds]
    return _graded(completions, golds, right, thinking(prompts, kwargs), answer_only=True)


_PLAIN_NUMBER = re.compile(r"[-+]?\d[\d,]*(\.\d+)?")


@register_reward("first_number")
def first_number_reward(
    prompts: list, completions: list, answer: list | None = None, **kwargs: object,
) -> list[float | None]:
    """1.0 when the first number of the completion (after its reasoning, :func:`final_text`)
    is the integer ``answer``, else 0.0 (no tags needed: for bare prompts such as
    ``"3 + 5 ="``; ``8.5`` is not ``8``, ``1,665`` is ``1665``). A reference that is
    ``None`` or blank gives ``None``; a reference that is not an integer raises.

    >>> first_number_reward(["3 + 5 ="], [" 8 because 3+5"], answer=["8"])
    [1.0]
    >>> first_number_reward(["3 + 5 ="], ["35"], answer=["8"])
    [0.0]
    """
    golds = require_column("first_number", "answer", answer, len(completions))
    opens = thinking(prompts, kwargs)
    scores: list[float | None] = []
    for row, (completion, gold) in enumerate(zip(completions, golds, strict=True)):
        if gold is None or not str(gold).strip():
            scores.append(None)
            continue
        target = _integer("first_number", "answer", gold, row)
        text = final_text(completion_text(completion), opens[row])
        scores.append(1.0 if text is not None and first_integer(text) == target else 0.0)
    return scores


def _integer(reward: str, column: str, value: Any, row: int) -> int:
    """A reference integer: an int, an integral float, or the text of one in ASCII digits
    (a CSV cell); ValueError naming the reward and column for anything else (``9.5`` was
    truncated to 9, ``"٣"`` read as 3 where completions are read in ASCII digits)."""
    if isinstance(value, str) and re.fullmatch(r"[+-]?[0-9]+", value.strip()):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)  # numpy's integers too (a pandas column)
    raise ValueError(f"{reward}: the {column} given with completion {row} of the step must be "
                     f"an integer; got {value!r} (the data's {column} column)")


def _graded(completions: list, references: list, right: Callable[[str, Any], bool],
            opens: list[bool], answer_only: bool = False) -> list[float | None]:
    """Per row ``1.0 if right(answer, reference) else 0.0``, the answer being the final
    answer (:func:`extract_answer`) when there is one, else the :func:`final_text` (with
    ``answer_only``: 0.0; 0.0 too while the reasoning is open, ``opens``: the prompt opened
    it); ``None`` where the reference is ``None``."""
    scores: list[float | None] = []
    for completion, reference, opened in zip(completions, references, opens, strict=True):
        if reference is None:
            scores.append(None)
            continue
        text = final_text(completion_text(completion), opened)
        answer = None if text is None else _answer_in(text)
        if text is None or (answer is None and answer_only):
            scores.append(0.0)
            continue
        scores.append(1.0 if right(text if answer is None else answer, reference) else 0.0)
    return scores

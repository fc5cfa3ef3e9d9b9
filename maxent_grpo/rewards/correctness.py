"""Correctness rewards: is the final answer right?

Both read the final answer with :func:`~maxent_grpo.rewards.parsing.extract_answer` (last
``<answer>...</answer>`` block, else last balanced ``\\boxed{...}``); a completion without
one scores 0.0. A row whose reference columns hold ``None`` scores ``None`` (not
applicable); a missing column raises ``ValueError`` (the reward does not fit the task).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

from maxent_grpo.rewards.parsing import (
    INTEGER,
    SYMBOLS,
    completion_text,
    extract_answer,
    parse_int,
    require_column,
)
from maxent_grpo.rewards.registry import register_reward
from maxent_grpo.rewards.verify_worker import VERIFIER, math_equal
from maxent_grpo.tasks.countdown import check_countdown


@register_reward("accuracy")
def accuracy_reward(
    prompts: list, completions: list, answer: list | None = None, **kwargs: object,
) -> list[float | None]:
    """1.0 when the final answer equals the ``answer`` column mathematically, else 0.0.

    Both sides go through math-verify (``parse``, then ``verify(gold, prediction)``), so
    ``0.5``, ``1/2`` and ``\\frac{1}{2}`` agree. When math-verify extracts nothing from
    either side (e.g. the reference is a word), the two strings are compared exactly after
    collapsing runs of whitespace. A reference that is ``None`` or blank gives ``None``.
    Each comparison may take
    :data:`~maxent_grpo.rewards.verify_worker.MATH_VERIFY_TIMEOUT_S` per parse and verify (then it
    is 0.0); off the main thread (a reward ``timeout``, a worker thread), where
    math-verify's limit does not work, the comparisons run in a worker process
    (:class:`~maxent_grpo.rewards.verify_worker.Verifier`), so that an answer such as
    ``9**(9*9*9*9*9*9*9*9*9)`` cannot hold the process.

    >>> accuracy_reward(["What is 1/2?"], ["<think>half</think><answer>0.5</answer>"],
    ...                 answer=["1/2"])
    [1.0]
    >>> accuracy_reward(["What is 1/2?"], ["<think>hmm</think><answer>2</answer>"],
    ...                 answer=["1/2"])
    [0.0]
    """
    golds = require_column("accuracy", "answer", answer, len(completions))
    main = threading.current_thread() is threading.main_thread()
    parsed_golds: dict[str, list] = {}
    scores: list[float | None] = []
    for completion, gold in zip(completions, golds, strict=True):
        if gold is None or not str(gold).strip():
            scores.append(None)
            continue
        gold = str(gold).strip()
        prediction = extract_answer(completion_text(completion))
        if prediction is None:
            scores.append(0.0)
            continue
        correct = (math_equal(gold, prediction, parsed_golds) if main
                   else VERIFIER.equal(gold, prediction))
        scores.append(1.0 if correct else 0.0)
    return scores


def _countdown_expression(answer: str, target: int) -> str | None:
    """The expression part of a countdown answer, with the operator symbols
    (:data:`~maxent_grpo.rewards.parsing.SYMBOLS`: ×, ÷, −, ...) read as ``*``, ``/``,
    ``-``; an ``expr = target`` answer keeps ``expr`` (None when the right-hand side is not
    the target)."""
    for symbol, op in SYMBOLS.items():
        answer = answer.replace(symbol, op)
    if answer.count("=") == 1:
        answer, rhs = answer.split("=")
        if rhs.strip() != str(target):
            return None
    return answer


@register_reward("countdown")
def countdown_reward(
    prompts: list, completions: list, numbers: list | None = None, target: list | None = None,
    **kwargs: object,
) -> list[float | None]:
    """1.0 when the final answer is an expression that reaches ``target`` using each of
    ``numbers`` at most once (:func:`maxent_grpo.tasks.countdown.check_countdown`), else
    0.0; ``None`` for a row whose ``numbers`` or ``target`` is ``None``.

    >>> countdown_reward(["..."], ["<think>8*2</think><answer>(3 + 5) * 2</answer>"],
    ...                  numbers=[[2, 3, 5]], target=[16])
    [1.0]
    >>> countdown_reward(["..."], ["<think>5*3+3</think><answer>5 * 3 + 3</answer>"],
    ...                  numbers=[[2, 3, 5]], target=[18])
    [0.0]
    """
    n = len(completions)
    all_numbers = require_column("countdown", "numbers", numbers, n)
    targets = require_column("countdown", "target", target, n)
    scores: list[float | None] = []
    for completion, row_numbers, row_target in zip(completions, all_numbers, targets, strict=True):
        if row_numbers is None or row_target is None:
            scores.append(None)
            continue
        answer = extract_answer(completion_text(completion))
        expression = None if answer is None else _countdown_expression(answer, row_target)
        ok = expression is not None and check_countdown(expression, list(row_numbers), row_target)
        scores.append(1.0 if ok else 0.0)
    return scores


@register_reward("first_number")
def first_number_reward(
    prompts: list, completions: list, answer: list | None = None, **kwargs: object,
) -> list[float | None]:
    """1.0 when the first integer in the completion equals the integer ``answer``, else
    0.0 (no tags needed: for bare prompts such as ``"3 + 5 ="``). A reference that is
    ``None`` or blank gives ``None``; a reference that is not an integer raises.

    >>> first_number_reward(["3 + 5 ="], [" 8 because 3+5"], answer=["8"])
    [1.0]
    >>> first_number_reward(["3 + 5 ="], ["35"], answer=["8"])
    [0.0]
    """
    golds = require_column("first_number", "answer", answer, len(completions))
    scores: list[float | None] = []
    for row, (completion, gold) in enumerate(zip(completions, golds, strict=True)):
        if gold is None or not str(gold).strip():
            scores.append(None)
            continue
        try:
            target = int(str(gold).strip())
        except ValueError:
            raise ValueError(
                f"first_number: the answer of row {row} must be an integer; got {gold!r}"
            ) from None
        match = INTEGER.search(completion_text(completion))
        scores.append(1.0 if match is not None and parse_int(match.group()) == target else 0.0)
    return scores


_DIGIT_PAIR = re.compile(r"\s*([0-9])\s*\+\s*([0-9])\s*")  # ASCII digits, as the answers are


@register_reward("digit_pair")
def digit_pair_reward(
    prompts: list, completions: list, target: list | None = None, **kwargs: object,
) -> list[float | None]:
    """1.0 when the answer is exactly two digits ``a + b`` with ``a + b == target`` (the
    ``digit_pairs`` task), else 0.0. The answer is the ``<answer>`` block when there is one,
    else the whole completion (bare prompts); nothing but whitespace may surround the pair.
    A ``target`` of ``None`` gives ``None``.

    >>> digit_pair_reward(["? + ? = 9"], ["4 + 5"], target=[9])
    [1.0]
    >>> digit_pair_reward(["? + ? = 9"], ["4 + 4"], target=[9])
    [0.0]
    >>> digit_pair_reward(["q"] * 5, ["5+4", "<answer>0 + 9</answer>", "9", "4 + 5 = 9", "45 + 0"],
    ...                   target=[9] * 5)
    [1.0, 1.0, 0.0, 0.0, 0.0]
    """
    def right(answer: str, row_target: object) -> bool:
        match = _DIGIT_PAIR.fullmatch(answer)
        return match is not None and int(match[1]) + int(match[2]) == int(row_target)

    targets = require_column("digit_pair", "target", target, len(completions))
    return _graded(completions, targets, right)


def _graded(completions: list, references: list, right: Callable[[str, Any], bool],
            ) -> list[float | None]:
    """Per row ``1.0 if right(answer, reference) else 0.0``, the answer being the
    ``<answer>`` block when there is one, else the whole completion; ``None`` where the
    reference is ``None``."""
    scores: list[float | None] = []
    for completion, reference in zip(completions, references, strict=True):
        if reference is None:
            scores.append(None)
            continue
        text = completion_text(completion)
        answer = extract_answer(text)
        scores.append(1.0 if right(text if answer is None else answer, reference) else 0.0)
    return scores


@register_reward("in_set")
def in_set_reward(
    prompts: list, completions: list, valid_answers: list | None = None, **kwargs: object,
) -> list[float | None]:
    """1.0 when the first integer of the answer is one of the row's ``valid_answers``
    (integers written as strings; the ``number_sets`` and ``divisors`` tasks), else 0.0.
    The answer is the ``<answer>`` block when there is one, else the whole completion.
    ``valid_answers`` of ``None`` gives ``None``.

    >>> in_set_reward(["A prime number less than 20:"], [" 7, 11"], valid_answers=[["7", "11"]])
    [1.0]
    >>> in_set_reward(["A prime number less than 20:"], [" 8"], valid_answers=[["7", "11"]])
    [0.0]
    """
    def right(answer: str, members: Any) -> bool:
        try:
            valid = {int(str(m).strip()) for m in members}
        except ValueError:
            raise ValueError(f"in_set: valid_answers must hold integers; got {members!r}") from None
        match = INTEGER.search(answer)
        return match is not None and parse_int(match.group()) in valid

    sets = require_column("in_set", "valid_answers", valid_answers, len(completions))
    return _graded(completions, sets, right)

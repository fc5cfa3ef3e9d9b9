"""The built-in tasks' correctness rewards: ``countdown`` (an expression reaching a target
with the given numbers), ``digit_pair`` (two digits summing to a target) and ``in_set``
(an integer in a row's ``valid_answers``), graded as :mod:`maxent_grpo.rewards.answers`
says ("Grading").
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any

from maxent_grpo.rewards.answers import (
    _graded,
    _integer,
    first_integer,
    require_column,
    thinking,
)
from maxent_grpo.rewards.registry import register_reward
from maxent_grpo.tasks.countdown import check_countdown
from maxent_grpo.tasks.expressions import given_value, split_equation, unwrap_math


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
    def right(answer: str, row: tuple) -> bool:
        # SYMBOLS read as operators; ``expr = target`` keeps expr (``= {16}``, ``= 16 apples``,
        # ``\frac{32}{2}``: the value given, as the answer keys read it); another one fails
        expression, rhs = split_equation(answer)
        return (rhs is None or given_value(rhs) == row[1]) and check_countdown(
            expression, list(row[0]), row[1])

    n = len(completions)
    rows = zip(require_column("countdown", "numbers", numbers, n),
               require_column("countdown", "target", target, n), strict=True)
    references = [None if row_numbers is None or row_target is None
                  else _countdown_reference(row_numbers, row_target, row)
                  for row, (row_numbers, row_target) in enumerate(rows)]
    return _graded(completions, references, right, thinking(prompts, kwargs), answer_only=True)


def _countdown_reference(numbers: Any, target: Any, row: int) -> tuple[list[int], int]:
    """A row's ``(numbers, target)``, read from text as a CSV cell holds them (``"[1, 2]"``,
    ``"9"``) and from integral floats as pandas writes a column with blanks (``16.0``),
    checked for every row before any is graded (a bad one raised only when a completion had
    an answer to check)."""
    def whole(value: Any) -> Any:  # an int, an integral float or its text (a CSV cell)
        with contextlib.suppress(ValueError):
            return _integer("countdown", "target", value, row)
        return value

    numbers, target = json_cell(numbers), whole(target)
    if isinstance(numbers, (list, tuple)):
        numbers = [whole(x) for x in numbers]
    if (isinstance(target, bool) or not isinstance(target, int)
            or not isinstance(numbers, (list, tuple))
            or any(isinstance(x, bool) or not isinstance(x, int) for x in numbers)):
        raise ValueError(f"countdown: the numbers and target given with completion {row} of "
                         f"the step must be a list of ints and an int; got {numbers!r} and "
                         f"{target!r} (the data's numbers and target columns)")
    return list(numbers), target


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
    def right(answer: str, row_target: int) -> bool:
        match = _DIGIT_PAIR.fullmatch(unwrap_math(answer))
        return match is not None and int(match[1]) + int(match[2]) == row_target

    targets = [None if value is None else _integer("digit_pair", "target", value, row)
               for row, value in enumerate(require_column("digit_pair", "target", target,
                                                          len(completions)))]
    return _graded(completions, targets, right, thinking(prompts, kwargs))


@register_reward("in_set")
def in_set_reward(
    prompts: list, completions: list, valid_answers: list | None = None, **kwargs: object,
) -> list[float | None]:
    """1.0 when the first number of the answer is a whole one of the row's ``valid_answers``
    (integers written as strings; the ``number_sets`` and ``divisors`` tasks), else 0.0.
    The answer is the ``<answer>`` block when there is one, else the whole completion.
    ``valid_answers`` of ``None`` gives ``None``.

    >>> in_set_reward(["A prime number less than 20:"], [" 7, 11"], valid_answers=[["7", "11"]])
    [1.0]
    >>> in_set_reward(["A prime number less than 20:"], [" 8"], valid_answers=[["7", "11"]])
    [0.0]
    """
    def right(answer: str, valid: set[int]) -> bool:
        return first_integer(answer) in valid

    sets = require_column("in_set", "valid_answers", valid_answers, len(completions))
    sets = [None if m is None else _valid_set(m, row) for row, m in enumerate(sets)]
    return _graded(completions, sets, right, thinking(prompts, kwargs))


def _valid_set(members: Any, row: int) -> set[int]:
    """A row's ``valid_answers`` as integers: a list of ints or integer strings, or that list
    as JSON text (a CSV cell); checked for every row before any is graded (a string was read
    a character at a time)."""
    members = json_cell(members)
    if isinstance(members, (list, tuple)) and not any(isinstance(m, bool) for m in members):
        with contextlib.suppress(ValueError):
            return {int(str(m).strip()) for m in members}
    raise ValueError(f"in_set: the valid_answers given with completion {row} of the step must "
                     f"be a list of integers; got {members!r} (the data's valid_answers column)")


def json_cell(value: Any) -> Any:
    """``value``, or the JSON it holds when it is text that parses as JSON (a CSV cell)."""
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return json.loads(value)
    return value

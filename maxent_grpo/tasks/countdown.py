"""Countdown: combine the given numbers with + - * / to reach a target.

Every prompt is solvable: the target is the exact (:class:`fractions.Fraction`) value of a
random expression tree over all the numbers, redrawn until it is a positive integer (at most
``max_target``). That expression is the row's ``answer``; :func:`check_countdown` (also the
``countdown`` reward's verifier) accepts any solution:

- parsed with :mod:`ast` (never ``eval``): only integer literals, the binary operators
  ``+ - * /`` and parentheses (no unary minus or plus, ``**``, ``//``, floats, names, ...);
- each given number used **at most once** (multiset inclusion; not all are required);
- the exact value must equal the target; a division by zero makes it invalid.
"""

from __future__ import annotations

import random
from collections import Counter
from fractions import Fraction

from maxent_grpo.tasks.expressions import _APPLY, _evaluate, _parse
from maxent_grpo.tasks.spec import ANSWER_INSTRUCTION
from maxent_grpo.validation import check_int

_MAX_DRAWS = 10_000


def check_countdown(expression: str, numbers: list[int], target: int) -> bool:
    """True when ``expression`` uses each of ``numbers`` at most once and equals ``target``
    (the rules of the module docstring; safe for any string, nothing is executed).

    >>> check_countdown("(3 + 5) * 2", [2, 3, 5], 16)
    True
    >>> check_countdown("3 * 5 + 3", [2, 3, 5], 18)  # 3 used twice
    False
    """
    check_int("target", target)
    if not isinstance(numbers, (list, tuple)) or any(
        isinstance(n, bool) or not isinstance(n, int) for n in numbers
    ):
        raise ValueError(f"numbers must be a list of ints; got {numbers!r}")
    parsed = _parse(expression)
    if parsed is None:
        return False
    tree, used = parsed
    if Counter(used) - Counter(numbers):  # some literal is not available often enough
        return False
    try:
        value = _evaluate(tree.body)
    except (ZeroDivisionError, RecursionError):  # a long chain, called from a deep stack
        return False
    return value == target


def countdown_prompt(numbers: list[int], target: int, note: str = "") -> str:
    """The prompt of a countdown row; ``note`` follows "each number at most once"."""
    return (
        f"Using the numbers {numbers}, write an arithmetic expression that equals "
        f"{target}. You may use +, -, *, / and parentheses, and each number at most "
        f"once{note}. {ANSWER_INSTRUCTION} The answer is the expression only, for example "
        "<answer>(1 + 2) * 3</answer>."
    )


def _random_expression(rng: random.Random, numbers: list[int]) -> tuple[str, Fraction]:
    """Combine all ``numbers`` pairwise in random order with random operators;
    ZeroDivisionError when a division by zero is drawn (the caller redraws)."""
    items: list[tuple[str, Fraction, bool]] = [(str(n), Fraction(n), True) for n in numbers]
    while len(items) > 1:
        i, j = rng.sample(range(len(items)), 2)
        (left, lval, lleaf), (right, rval, rleaf) = items[i], items[j]
        op = rng.choice("+-*/")
        value = _APPLY[op](lval, rval)
        text = f"{left if lleaf else f'({left})'} {op} {right if rleaf else f'({right})'}"
        items = [item for k, item in enumerate(items) if k not in (i, j)]
        items.append((text, value, False))
    return items[0][0], items[0][1]


def countdown(
    num_rows: int, seed: int, *, num_numbers: int = 4, min_value: int = 1, max_value: int = 20,
    max_target: int | None = None,
) -> list[dict]:
    """``num_rows`` countdown prompts drawn from ``random.Random(seed)``.

    Each row: ``prompt`` (user message), ``answer`` (one valid expression), ``task``
    (``"countdown"``), ``numbers`` (``num_numbers`` ints drawn uniformly from
    ``[min_value, max_value]``, repeats possible) and ``target`` (positive int, at most
    ``max_target`` when given, never one of the numbers: the number alone would be an
    answer). A longer list with the same seed starts with the shorter one.
    """
    check_int("num_rows", num_rows, minimum=1)
    check_int("seed", seed, minimum=0)
    check_int("num_numbers", num_numbers, minimum=2, maximum=6)
    check_int("min_value", min_value, minimum=0)
    check_int("max_value", max_value, minimum=max(min_value, 1))
    if max_target is not None:
        check_int("max_target", max_target, minimum=1)
    rng = random.Random(seed)
    rows: list[dict] = []
    for _ in range(num_rows):
        for _ in range(_MAX_DRAWS):
            numbers = [rng.randint(min_value, max_value) for _ in range(num_numbers)]
            try:
                expression, value = _random_expression(rng, numbers)
            except ZeroDivisionError:
                continue
            if value.denominator == 1 and value > 0 and value not in numbers and (
                    max_target is None or value <= max_target):  # a number given: no problem
                break
        else:
            raise ValueError(
                f"countdown could not draw a positive integer target <= {max_target}, not one "
                f"of the numbers, from numbers in [{min_value}, {max_value}] in {_MAX_DRAWS} "
                "tries; widen max_target or the value range"
            )
        target = int(value)
        rows.append({
            "prompt": countdown_prompt(numbers, target), "answer": expression, "task": "countdown",
            "numbers": numbers, "target": target,
        })
    return rows

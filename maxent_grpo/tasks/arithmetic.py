"""Arithmetic: evaluate an integer expression such as ``37 + 5 * 12``.

Operands are drawn uniformly among the numbers with exactly ``digits`` digits
(``digits = 1`` means 0..9), operators uniformly from ``ops``; the usual precedence
applies (``*`` before ``+`` and ``-``, left to right otherwise). Division is not offered
so every answer is an exact integer; answers may be negative when ``-`` is allowed.
``arithmetic_easy`` (one-digit sums of two numbers, answers 0..18) suits a tiny-model demo.
"""

from __future__ import annotations

import random

from maxent_grpo.tasks.spec import ANSWER_INSTRUCTION, digit_range
from maxent_grpo.validation import check_int

ALLOWED_OPS = "+-*"


def _value(operands: list[int], ops: list[str]) -> int:
    """Exact value of ``operands[0] ops[0] operands[1] ...`` with ``*`` binding tighter."""
    total, term = 0, operands[0]
    sign = 1
    for op, operand in zip(ops, operands[1:], strict=True):
        if op == "*":
            term *= operand
        else:
            total += sign * term
            sign, term = (1 if op == "+" else -1), operand
    return total + sign * term


def arithmetic(
    num_rows: int, seed: int, *, digits: int = 2, num_operands: int = 3, ops: str = "+-*",
    bare: bool = False,
) -> list[dict]:
    """``num_rows`` arithmetic prompts drawn from ``random.Random(seed)``.

    With ``bare=True`` the prompt is only ``"<expression> ="``, answered with a plain number
    (reward ``first_number``); otherwise it asks for ``<think>``/``<answer>`` tags.

    Each row: ``prompt``, ``answer`` (the exact integer as a string), ``task``
    (``"arithmetic"``), ``expression`` (e.g. ``"37 + 5 * 12"``) and ``operands``
    (list[int]) and ``answer_form``: ``"first_number"`` for bare rows (the answer statistics
    read a completion's first number, as the reward does), else ``"value"`` (one answer
    however the number is written). ``ops`` is a string of distinct characters from ``"+-*"``.
    """
    check_int("num_rows", num_rows, minimum=1)
    check_int("seed", seed, minimum=0)
    check_int("digits", digits, minimum=1, maximum=18)
    check_int("num_operands", num_operands, minimum=2, maximum=16)
    if (
        not isinstance(ops, str)
        or not ops
        or any(op not in ALLOWED_OPS for op in ops)
        or len(set(ops)) != len(ops)
    ):
        raise ValueError(f"ops must be distinct characters from {ALLOWED_OPS!r}; got {ops!r}")
    low, high = digit_range(digits)
    if not isinstance(bare, bool):
        raise ValueError(f"bare must be a bool; got {bare!r}")
    rng = random.Random(seed)
    rows: list[dict] = []
    for _ in range(num_rows):
        operands = [rng.randint(low, high) for _ in range(num_operands)]
        chosen = [rng.choice(ops) for _ in range(num_operands - 1)]
        expression = str(operands[0]) + "".join(
            f" {op} {operand}" for op, operand in zip(chosen, operands[1:], strict=True)
        )
        prompt = (f"{expression} =" if bare
                  else f"What is {expression}? {ANSWER_INSTRUCTION} The answer is an integer.")
        # bare rows are graded by first_number, the answer statistics compare first numbers
        # too; the others by value (``-886``, ``-886.0`` and ``59 - 63 * 15 = -886`` are one)
        rows.append({
            "prompt": prompt, "answer": str(_value(operands, chosen)), "task": "arithmetic",
            "expression": expression, "operands": operands,
            "answer_form": "first_number" if bare else "value",
        })
    return rows


def arithmetic_easy(
    num_rows: int, seed: int, *, digits: int = 1, num_operands: int = 2, ops: str = "+",
    bare: bool = False,
) -> list[dict]:
    """:func:`arithmetic` with easy defaults (``3 + 5``); rows labelled ``"arithmetic_easy"``."""
    rows = arithmetic(num_rows, seed, digits=digits, num_operands=num_operands, ops=ops, bare=bare)
    for row in rows:
        row["task"] = "arithmetic_easy"
    return rows

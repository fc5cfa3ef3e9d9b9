"""The ``tool_arithmetic`` task and its tool, ``calculate``: products too large for a tiny
model to work out, exact with the tool.

``tool_arithmetic`` asks ``"What is 37 * 84?"`` (operands of ``digits`` digits; answer the
exact integer, graded by the ``first_number`` reward on the model's last turn). With
``model.tools: [calculate]`` the model can call ``calculate`` and copy its result; without
it, it must multiply in its head.

``calculate`` evaluates integer arithmetic by walking the expression's syntax tree: numbers,
``+ - * // %``, ``/`` (exact division only), unary minus and parentheses. Anything else
(names, calls, attributes, powers) is refused with ValueError, so a call can never run code;
numbers are capped in size so that no call runs long.

>>> calculate("12 * (3 + 4)"), calculate("-7 // 2")
('84', '-4')
"""

from __future__ import annotations

import ast
import operator
import random
from collections.abc import Callable

from maxent_grpo.tasks.expressions import ARITHMETIC
from maxent_grpo.tasks.spec import digit_range
from maxent_grpo.validation import check_int

__all__ = ["calculate", "tool_arithmetic"]

MAX_DIGITS = 60
"""Operands and results longer than this many digits are refused."""

#: ``/`` is ``//`` once it is known to divide exactly
_BINARY: dict[type, Callable[[int, int], int]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.floordiv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _evaluate(node.operand)
        value = -inner if isinstance(node.op, ast.USub) else inner
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if right == 0 and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
            raise ZeroDivisionError("division by zero")
        if isinstance(node.op, ast.Div) and left % right:
            raise ValueError(f"{left} / {right} is not a whole number; use // for the quotient")
        value = _BINARY[type(node.op)](left, right)
    else:
        kind = node.op if isinstance(node, (ast.BinOp, ast.UnaryOp)) else node
        raise ValueError(f"unsupported {type(kind).__name__}; use integers, + - * / // % "
                         "and parentheses")
    if len(str(abs(value))) > MAX_DIGITS:
        raise ValueError(f"a number longer than {MAX_DIGITS} digits")
    return value


def calculate(expression: str) -> str:
    """Evaluate an integer arithmetic expression.

    Args:
        expression: integers with + - * / // % and parentheses, e.g. "12 * (3 + 4)".
    """
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError("expression must be a non-empty string")
    if len(expression) > 4 * MAX_DIGITS:
        raise ValueError(f"expression longer than {4 * MAX_DIGITS} characters")
    if not ARITHMETIC.fullmatch(expression):
        raise ValueError("unsupported characters; use integers, + - * / // % and parentheses")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an arithmetic expression: {err.msg}") from None
    return str(_evaluate(tree.body))


def tool_arithmetic(
    num_rows: int, seed: int, *, digits: int = 2, ops: str = "*",
) -> list[dict]:
    """``num_rows`` prompts ``"What is a <op> b?"`` from ``random.Random(seed)``, ``a`` and
    ``b`` of exactly ``digits`` digits, ``<op>`` drawn from ``ops`` (characters of
    ``"+-*"``). Each row: ``prompt``, ``answer`` (the exact integer), ``task``
    (``"tool_arithmetic"``), ``expression`` and ``answer_form: "first_number"`` (graded by
    ``first_number``).

    >>> tool_arithmetic(1, seed=0)[0]["prompt"]
    'What is 59 * 63?'
    """
    check_int("num_rows", num_rows, minimum=1)
    check_int("seed", seed, minimum=0)
    check_int("digits", digits, minimum=1, maximum=9)
    if not isinstance(ops, str) or not ops or any(o not in "+-*" for o in ops):
        raise ValueError(f"ops must be characters from '+-*'; got {ops!r}")
    rng = random.Random(seed)
    low, high = digit_range(digits)
    rows = []
    for _ in range(num_rows):
        a, b, op = rng.randint(low, high), rng.randint(low, high), rng.choice(ops)
        expression = f"{a} {op} {b}"
        rows.append({"prompt": f"What is {expression}?", "answer": calculate(expression),
                     "task": "tool_arithmetic", "expression": expression,
                     "answer_form": "first_number"})  # graded by first_number
    return rows

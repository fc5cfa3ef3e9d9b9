"""Arithmetic answers: parsed safely, evaluated exactly, and put in one canonical form.

An expression here is a string of integer literals, the binary operators ``+ - * /`` and
parentheses, parsed with :mod:`ast` (never ``eval``) and evaluated with
:class:`fractions.Fraction`. The countdown tasks (:mod:`maxent_grpo.tasks.countdown`,
:mod:`maxent_grpo.tasks.multi_answer`) check and enumerate solutions with it, and the answer
statistics compare the samples' answers in its canonical form
(:func:`maxent_grpo.rewards.answers.coverage_answer`).

Two expressions are the same solution when they have the same canonical form
(:func:`canonical_expression`), built bottom-up by flattening chains of ``+``/``-`` into
signed terms and chains of ``*``/``/`` into factors with exponent ``+1`` or ``-1``
(absorbing associativity and identities such as ``a - (b - c) = a - b + c``), sorting the
positive and the negative parts separately (commutativity) and dropping redundant
parentheses. It reads ``t1 + t2 - t3`` / ``f1 * f2 / f3``, with parentheses only around a
sum used as a factor, e.g. ``(2 + 3) * 4 / 5``. Nothing else is identified: ``x * 1``
against ``x``, distributivity and cancellation (``a - a + b``) give different solutions.
For any string ``e``, ``check_countdown(e, numbers, target)`` holds exactly when
``canonical_expression(e) in valid_answers``.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass
from fractions import Fraction

#: the characters an arithmetic expression may hold: anything else is no expression, and
#: Python's parser printed a SyntaxWarning (or DeprecationWarning) at text like "12in" or
#: "\\d" at every completion (a warnings filter around it is not thread-safe)
ARITHMETIC = re.compile(r"[0-9_+\-*/%().\s]*")

MAX_EXPRESSION_CHARS = 1000
"""Longer answer strings are rejected before parsing (bounds the parser's work)."""

_OPERATORS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
#: what each operator does to two Fractions (``/`` by zero: ZeroDivisionError, which the
#: callers handle)
_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


def _literals(tree: ast.Expression) -> list[int] | None:
    """The integer literals of ``tree``, or None when it contains any other kind of node."""
    found: list[int] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, int):
                return None
            found.append(node.value)
        elif isinstance(node, ast.BinOp):
            if type(node.op) not in _OPERATORS:
                return None
        elif not isinstance(node, (ast.Expression, *_OPERATORS)):
            return None
    return found


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    assert isinstance(node, ast.BinOp)  # guaranteed by _literals
    return _APPLY[_OPERATORS[type(node.op)]](_evaluate(node.left), _evaluate(node.right))


def _parse(expression: object) -> tuple[ast.Expression, list[int]] | None:
    """The syntax tree and integer literals of an expression, or None when it is not a
    string of at most ``MAX_EXPRESSION_CHARS`` with only literals, ``+ - * /`` and ``()``."""
    if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION_CHARS:
        return None
    if not ARITHMETIC.fullmatch(expression):  # before ast.parse, which warns at "12in"
        return None
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    used = _literals(tree)
    return (tree, used) if used else None


@dataclass(frozen=True)
class _Expr:
    """A canonical expression: a leaf (``kind == "n"``), a sum (``"+"``: ``pos`` terms
    added, ``neg`` subtracted) or a product (``"*"``: ``pos`` factors multiplied, ``neg``
    divided). ``pos``/``neg`` are sorted; ``text`` is the rendering, ``value`` exact."""

    kind: str
    text: str
    value: Fraction
    pos: tuple[_Expr, ...] = ()
    neg: tuple[_Expr, ...] = ()


def _key(e: _Expr) -> tuple[int, Fraction, str]:
    """Sort order inside a chain: numbers by value first, then compound parts by text."""
    return (0, e.value, "") if e.kind == "n" else (1, Fraction(0), e.text)


def _leaf(value: int) -> _Expr:
    return _Expr("n", str(value), Fraction(value))


def _combine(op: str, a: _Expr, b: _Expr) -> _Expr:
    """The canonical form of ``a op b``; ZeroDivisionError for a division by zero."""
    kind = "+" if op in "+-" else "*"
    a_pos, a_neg = (a.pos, a.neg) if a.kind == kind else ((a,), ())
    b_pos, b_neg = (b.pos, b.neg) if b.kind == kind else ((b,), ())
    if op in "-/":
        b_pos, b_neg = b_neg, b_pos
    pos = tuple(sorted(a_pos + b_pos, key=_key))
    neg = tuple(sorted(a_neg + b_neg, key=_key))
    value = _APPLY[op](a.value, b.value)
    if kind == "+":
        text = " + ".join(t.text for t in pos) + "".join(f" - {t.text}" for t in neg)
    else:

        def factor(t: _Expr) -> str:
            return f"({t.text})" if t.kind == "+" else t.text

        text = " * ".join(map(factor, pos)) + "".join(f" / {factor(t)}" for t in neg)
    return _Expr(kind, text, value, pos, neg)


def _from_ast(node: ast.AST) -> _Expr:
    if isinstance(node, ast.Constant):
        return _leaf(node.value)
    assert isinstance(node, ast.BinOp)  # guaranteed by _parse
    return _combine(_OPERATORS[type(node.op)], _from_ast(node.left), _from_ast(node.right))


def canonical_expression(expr: str) -> str | None:
    """The canonical form of a countdown expression (see the module docstring), or None
    when :func:`~maxent_grpo.tasks.countdown.check_countdown` would reject it whatever the
    numbers: not a string, too long, not only integer literals with ``+ - * /`` and
    parentheses, or a division by zero.

    >>> canonical_expression("5 + 3"), canonical_expression("(3 + 5)")
    ('3 + 5', '3 + 5')
    >>> canonical_expression("2 * (5 - (3 - 1))")
    '2 * (1 + 5 - 3)'
    >>> canonical_expression("4 / (2 - 2)") is None, canonical_expression("-3 + 5") is None
    (True, True)
    """
    parsed = _parse(expr)
    if parsed is None:
        return None
    try:
        return _from_ast(parsed[0].body).text
    except (ZeroDivisionError, RecursionError):
        return None


#: a number as answers write it, once ``$``, ``\$`` and thousands separators are dropped:
#: an integer, a decimal or a fraction (``-886``, ``2.50``, ``.5``, ``1/2``)
_NUMBER = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]+|/[0-9]+)?|\.[0-9]+)")
#: a thousands separator: a comma or a space before three digits (``3,717``, ``3 717``)
_GROUPING = re.compile(r"(?<=[0-9])[, ](?=[0-9]{3}(?![0-9]))")


def number_value(text: str, expressions: bool = True) -> Fraction | None:
    """The exact value of a number as answers write it (``-886``, ``−886``, ``-886.0``,
    ``$-886$``, ``3,717``, ``1/2``, ``.5``, ``+5``) or, with ``expressions``, of an
    arithmetic expression (as :func:`canonical_expression` reads one: ``59 - 63 * 15``),
    or None.

    >>> number_value("$-886.0$"), number_value("3,717"), number_value("5 * 3 + 1")
    (Fraction(-886, 1), Fraction(3717, 1), Fraction(16, 1))
    >>> number_value("2, 3") is None, number_value("1/0") is None
    (True, True)
    """
    text = text.replace("\u2212", "-").replace("\\$", "").replace("$", "").strip().rstrip(".")
    text = _GROUPING.sub("", text)
    if len(text) > MAX_EXPRESSION_CHARS:  # its key would not print (4300 digits at most)
        return None
    try:
        if _NUMBER.fullmatch(text):
            return Fraction(text)
        parsed = _parse(text) if expressions else None
        return None if parsed is None else _evaluate(parsed[0].body)
    except (ValueError, ZeroDivisionError, RecursionError):  # ValueError: too many digits
        return None


#: operator symbols read as ``*``, ``/`` and ``-`` in answers (``−`` is U+2212, the minus sign)
SYMBOLS = {"×": "*", "÷": "/", "\\times": "*", "\\div": "/", "\\cdot": "*", "·": "*", "⋅": "*",
           "∗": "*", "−": "-"}


_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")


_LEADING = re.compile(r"[\s({\[]*([-+]?\d+(?:,\d{3})*(?:\.\d+)?)")  # 17 apples, {17}, 17\%


def given_value(side: str) -> Fraction | None:
    """The value the right side of an ``=`` gives: :func:`number_value` of it (``\\frac{34}
    {2}`` as :func:`unwrap_math` writes it, ``-16``, ``1,665``), else the number it starts
    with (``17 apples``, ``{17}``, ``17\\%``); None where it starts with no number (``x``).

    >>> given_value("(34)/(2)"), given_value(" {17} apples"), given_value("x") is None
    (Fraction(17, 1), Fraction(17, 1), True)
    """
    side = side.replace("\\$", "").replace("$", "")
    value = number_value(side)
    leading = None if value is not None else _LEADING.match(side)
    return value if leading is None else number_value(leading[1], False)


def unwrap_math(answer: str) -> str:
    """``answer`` without what a chat model writes around a formula: a final period, the
    math delimiters ``$...$``, ``$$...$$``, ``\\(...\\)``, ``\\[...\\]``; and with
    ``\\frac{a}{b}`` as ``(a)/(b)``.

    >>> unwrap_math("$8 + \\\\frac{12}{3}$."), unwrap_math("4 + 5.")
    ('8 + (12)/(3)', '4 + 5')
    """
    text = answer.strip().removesuffix(".").strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(text) > len(left + right) and text.startswith(left) and text.endswith(right):
            text = text[len(left):-len(right)].strip().removesuffix(".").strip()
            break
    return _FRAC.sub(r"(\1)/(\2)", text)


def split_equation(answer: str) -> tuple[str, str | None]:
    """``answer`` (:func:`unwrap_math`) with the :data:`SYMBOLS` read as ``*``, ``/``,
    ``-``, as ``(left, right)`` of its one ``=`` (``right`` None unless it has exactly
    one)."""
    answer = unwrap_math(answer)
    for symbol, op in SYMBOLS.items():
        answer = answer.replace(symbol, op)
    if answer.count("=") == 1:
        left, right = answer.split("=")
        return left, right
    return answer, None


_TIMES_X = re.compile(r"(?<=[\d)])\s*[xX]\s*(?=[\d(])")  # 5 x 3: an operator
_ARITHMETIC = re.compile(r"\d+(?:\.\d+)?|[-+*/()^]")  # the tokens read
#: text commands (``\text{ apples}``): their words, which are left out; every other command
#: name (layout as ``\left``, ``\quad``, ``\large``, and ``\sum``, ``\lim``, ``\max``, which
#: math-verify passes over: the copy after them scored 1.0) and spacing: left out, their
#: arguments read as parentheses
_LATEX_TEXT = re.compile(r"\\(?:text[a-z]*|math(?:rm|bf|it|sf|tt)|mbox|operatorname)"
                         r"\s*\{([^{}]*)\}")
_LATEX_LAYOUT = re.compile(  # \sum_{i}'s bound; \hspace{1em}, \tag{1}, \kern 2pt: not terms; \{ \}
    r"\\(?:[hv]?phantom|tag\*?|label|(?:eq|page)?ref|cite|[hvm]space\*?|(?:text)?color)\s*"
    r"\{(?:[^{}]|\{[^{}]*\})*\}|\\[hvm]?(?:skip|kern)\s*[-+]?[\d.]+\s*(?:pt|em|ex|mu|[cm]m|in)"
    r"|\\(?:[A-Za-z]+(?:\s*_\s*(?:\{[^{}]*\}|\w))?|[,;:! {}])")
#: a number in scientific notation (``1.5 * 10^3``, ``10^(3)``, ``10^3 * 1.5``): one number
_POWER_OF_10 = r"10\s*\^\s*(?:\(\s*[-+]?\d+\s*\)|[-+]?\d+)"
_SCIENTIFIC = re.compile(rf"(?<![\d.])(?:{_POWER_OF_10}\s*\*\s*\d+(?:\.\d+)?(?![\d.^])|"
                         rf"(?:\d+(?:\.\d+)?\s*\*\s*)?{_POWER_OF_10})")
#: math delimiters anywhere (``The answer is $59 - 63 * 15$.``), and brackets that hold only
#: words (``\text{ (apples)}``): left out
_MATH_MARKS = re.compile(r"(?<!\\)\$|\\[()\[\]]")
_WORDS_IN_BRACKETS = re.compile(r"\([^()\d]*\)")
#: what gives a value as ``=`` does (``59 - 63 \cdot 15 \approx -886``; a reader: these scored
#: 0.0 once command names were left out, the value's minus read as a subtraction)
_GIVES = re.compile(r"\\(?:approx|simeq|cong|equiv|to|implies|(?:[Ll]ong)?[Rr]ightarrow)"
                    r"(?![A-Za-z])|[≈≃→⇒⟹]")
_AROUND = re.compile(r"[^\W\d_]+|[\s?!:;#~≈→]|\.(?!\d)")  # words around them, left out
#: a side of an ``=`` that gives a value: a number ($18, 18.00, 1,800, 18%, 18 (dollars)) that
#: no operator follows
_VALUE = re.compile(  # each \s* after a part that is there: three in a row were cubic on spaces
    r"\s*(?:[(\[]\s*)?(?:\\?\$\s*)?[-+]?\d[\d,]*(?:\.\d+)?(?!\s*[-+*/^\d])")


def unworked(answer: str) -> bool:
    """``answer`` (as :func:`split_equation` reads it:
    delimiters, a final period and the operator symbols aside) is arithmetic of numbers with
    no ``=`` giving its value: words around it (``The answer is 3 + 4``, ``3 + 4 apples``)
    and an ``=`` with no number after it (``3 + 4 =``, ``= ?``, ``= 3 + 4``) do not make it
    one; a side of an ``=`` that starts with a number is its value (``3 * 6 = $18``, ``18 =
    3 * 6``); a fraction (``- 1/2``, ``\\frac{1}{2^5}``) is a number, and so is a power of
    numbers (``2^{10}``); a product of them (``2^2 \\cdot 3``) is a calculation. Linear in the
    answer's length (a pattern of this had taken minutes on a sum of 12 spaced terms)."""
    text, value = split_equation(_GIVES.sub("=", answer))
    parts = [_plain(p) for side in (text, value or "") for p in side.split("=")]
    if (value is not None or len(parts) > 2) and any(_VALUE.match(p) for p in parts):
        return False  # = -886 (apples): its value given
    sides = [_tokens(_TIMES_X.sub("*", part)) for part in parts]
    return any(tokens is not None and _operators(tokens) > (1 if "/" in tokens else 0)
               for tokens in sides)  # one "/": a fraction, a number (1/2, \frac{1}{2^5})


def _plain(text: str) -> str:
    """``text`` with its LaTeX layout left out, braces read as parentheses, ``**`` as ``^``
    and a number in scientific notation as one number: ``\\left(59 - {63} * 15\\right)
    \\text{ apples}``, ``59 - 63 * 15^1`` are the question copied (they scored 1.0), while
    ``2^{10}`` and ``1.5 \\times 10^3`` are numbers."""
    text = _LATEX_LAYOUT.sub(" ", _LATEX_TEXT.sub(r" \1 ", _MATH_MARKS.sub(" ", text)))
    text = text.replace("{", "(").replace("}", ")").replace("**", "^")
    return _WORDS_IN_BRACKETS.sub(" ", _SCIENTIFIC.sub("1", text))


def _tokens(text: str) -> list[str] | None:
    """The numbers, operators and parentheses of ``text`` with the words around them left
    out, or None where anything else is in it (``3, -2``, ``\\sqrt{2}``: not plain arithmetic,
    which the grader reads)."""
    if _ARITHMETIC.sub("", _AROUND.sub("", text)).strip():
        return None
    return _ARITHMETIC.findall(text)


def _operators(tokens: list[str]) -> int:
    """The binary operators of ``tokens`` when they are numbers (each maybe signed, in
    parentheses or a power of numbers) joined by operators, else -1 (0: one number)."""
    n, count = len(tokens), 0

    def literal(i: int) -> int:  # the index after a literal at i (a power: one), or -1
        while True:
            while i < n and tokens[i] == "(":
                i += 1
            if i < n and tokens[i] in ("+", "-"):
                i += 1
            while i < n and tokens[i] == "(":
                i += 1
            if i >= n or not tokens[i][0].isdigit():
                return -1
            i += 1
            while i < n and tokens[i] == ")":
                i += 1
            if i >= n or tokens[i] != "^":
                return i
            i += 1  # 2^{10}: a number written as a power

    i = literal(1 if n and tokens[0] == "*" else 0)  # \cdot 59 - 63 * 15: a mark before it
    while 0 <= i < n:
        if tokens[i] not in ("+", "-", "*", "/"):
            return -1
        i, count = literal(i + 1), count + 1
    return count if i >= 0 else -1

"""Reading completions: the text of a completion and the final answer inside it."""

from __future__ import annotations

import re
import sys

from maxent_grpo.tasks.expressions import canonical_expression

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


#: an integer as answers write it: ASCII digits (``int`` would read other scripts' digits,
#: which the canonical answers do not), after ``-`` or the minus sign ``−``
INTEGER = re.compile(r"[-−]?[0-9]+")


def parse_int(text: str) -> int | None:
    """``int(text)`` for an :data:`INTEGER` match, None when it has more digits (leading
    zeros aside) than ``int`` converts (4300 by default: a model repeating a digit writes
    them)."""
    text = text.replace("−", "-")
    digits = text.lstrip("-").lstrip("0") or "0"  # int counts leading zeros too
    limit = getattr(sys, "get_int_max_str_digits", lambda: 0)()
    if limit and len(digits) > limit:
        return None
    return -int(digits) if text.startswith("-") else int(digits)


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


def extract_answer(text: str) -> str | None:
    """The final answer of a completion, stripped, or None when it gives none.

    The content of the last ``<answer>...</answer>`` block wins; otherwise the content of
    the last balanced ``\\boxed{...}``. A ``\\boxed{...}`` inside the chosen answer block is
    unwrapped.

    >>> extract_answer("<think>2+2</think><answer> \\\\boxed{4} </answer>")
    '4'
    >>> extract_answer("no final answer") is None
    True
    """
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
        raise ValueError(
            f"reward {reward!r} needs the dataset column {name!r}; the rows have no such column"
        )
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise ValueError(
            f"reward {reward!r}: column {name!r} must be a list with one value per "
            f"completion ({n}); got {got}"
        )
    return list(values)


#: operator symbols read as ``*``, ``/`` and ``-`` in answers (``−`` is U+2212, the minus sign)
SYMBOLS = {"×": "*", "÷": "/", "\\times": "*", "\\div": "/", "\\cdot": "*", "·": "*", "⋅": "*",
           "∗": "*", "−": "-"}


def sample_answer(completion: str | list[dict]) -> str | None:
    """The answer of one sample: :func:`extract_answer`, else the stripped completion
    (``None`` when that is empty).

    >>> sample_answer("<answer> 8 </answer>"), sample_answer(" 8 because "), sample_answer(" ")
    ('8', '8 because', None)
    """
    text = completion_text(completion)
    answer = extract_answer(text)
    if answer is None:
        answer = text.strip()
    return answer or None


def coverage_answer(answer: str | None) -> str | None:
    """The canonical form of an expression answer, for coverage@k: ``×``, ``÷``,
    ``\\times``, ``\\div``, ``\\cdot`` read as ``*`` and ``/``, the left side of one
    ``=`` kept, then :func:`canonical_expression` (``None`` when it is not an expression).

    >>> coverage_answer("5 × 3 + 1 = 16"), coverage_answer("hello") is None
    ('1 + 3 * 5', True)
    """
    if answer is None:
        return None
    for symbol, op in SYMBOLS.items():
        answer = answer.replace(symbol, op)
    if answer.count("=") == 1:
        answer = answer.split("=")[0]
    return canonical_expression(answer)


#: how a task's answers are compared (the rows' ``answer_form`` column; absent: ``expression``)
ANSWER_FORMS = ("expression", "ordered", "first_number")


def canonical_answer(answer: str | None, form: str | None = None) -> str | None:
    """An answer's canonical form under a task's ``answer_form``: ``"expression"`` (the
    default, ``None``) is :func:`coverage_answer`, where ``"5 + 4"`` and ``"4 + 5"`` are one
    answer; ``"ordered"`` keeps the order and removes the whitespace only, so they are two
    (the ``digit_pairs`` task with ``ordered=True``); ``"first_number"`` is the first
    integer of the answer (the ``number_sets`` task). ``None`` when there is no answer (or
    it is not of the form: not an expression, no integer).

    >>> canonical_answer("5 + 4"), canonical_answer("5 + 4", "ordered"), canonical_answer(None)
    ('4 + 5', '5+4', None)
    >>> canonical_answer(" 07, 11", "first_number"), canonical_answer("none", "first_number")
    ('7', None)
    """
    if form in (None, "expression"):
        return coverage_answer(answer)
    if form == "ordered":
        return None if answer is None else ("".join(answer.split()) or None)
    if form == "first_number":
        match = None if answer is None else INTEGER.search(answer)
        if match is None:
            return None
        text = match.group().replace("−", "-")
        value = parse_int(text)
        if value is not None:
            return str(value)
        digits = text.lstrip("-").lstrip("0")  # too long for int: no leading zeros
        return ("-" if text.startswith("-") and digits else "") + (digits or "0")
    raise ValueError(f"answer_form must be one of {ANSWER_FORMS}; got {form!r}")


def answer_key(completion: str | list[dict], form: str | None = None) -> str | None:
    """A sample's answer as the answer statistics and the answer-level objectives compare
    them: :func:`canonical_answer` of :func:`sample_answer`, else (not an expression) the
    answer with whitespace collapsed; ``None``: no answer.

    >>> answer_key("4 + 5") == answer_key(" 5+4"), answer_key(" 8 "), answer_key("  ")
    (True, '8', None)
    """
    return compared_answer(sample_answer(completion), form)


def compared_answer(answer: str | None, form: str | None = None) -> str | None:
    """An extracted answer as :func:`answer_key` compares it: :func:`canonical_answer`,
    else the answer with whitespace collapsed (``None``: no answer)."""
    key = canonical_answer(answer, form)
    return key if key is not None or answer is None else " ".join(answer.split())

"""Digit pairs: write a target as the sum of two digits; several answers are right.

A prompt asks for two digits ``a, b`` in ``0..9`` with ``a + b = target``. A target has
``min(target, 18 - target) // 2 + 1`` solutions up to order, all listed in the row's
``valid_answers`` in the canonical form of
:func:`~maxent_grpo.tasks.expressions.canonical_expression` (smaller digit first), so
coverage@k is exact. A multi-answer task a tiny model learns in minutes; the
``digit_pair`` reward checks it.

>>> row = digit_pairs(1, 0, min_target=9, max_target=9, bare=True)[0]
>>> row["prompt"], row["valid_answers"]
('? + ? = 9', ['0 + 9', '1 + 8', '2 + 7', '3 + 6', '4 + 5'])

With ``ordered=True`` the order of the two digits matters (``"4 + 5"`` and ``"5 + 4"``
are two answers): a target ``t`` has ``min(t, 18 - t) + 1`` answers, 6 to 10 for the
default targets 5..13, and the rows carry ``answer_form: "ordered"``, which tells coverage@k
and the answer statistics to compare answers without reordering them
(:func:`~maxent_grpo.rewards.answers.canonical_answer`). The prompt and the reward are the
same, so the model sees the same question with a larger answer set.

>>> digit_pairs(1, 0, min_target=5, max_target=5, bare=True, ordered=True)[0]["valid_answers"]
['0 + 5', '1 + 4', '2 + 3', '3 + 2', '4 + 1', '5 + 0']
"""

from __future__ import annotations

import random

from maxent_grpo.tasks.spec import ANSWER_INSTRUCTION, in_blocks
from maxent_grpo.validation import check_int


def pair_solutions(target: int, ordered: bool = False) -> list[str]:
    """The canonical solutions ``"a + b"`` (``a <= b``, digits) of ``a + b = target``; with
    ``ordered``, every ordered pair of digits.

    >>> pair_solutions(3), pair_solutions(18), pair_solutions(19), pair_solutions(1, True)
    (['0 + 3', '1 + 2'], ['9 + 9'], [], ['0 + 1', '1 + 0'])
    """
    if ordered:
        return [f"{a} + {target - a}" for a in range(10) if 0 <= target - a <= 9]
    return [f"{a} + {target - a}" for a in range(10) if a <= target - a <= 9]


def digit_pairs(
    num_rows: int, seed: int, *, min_target: int = 5, max_target: int = 13, bare: bool = False,
    ordered: bool = False,
) -> list[dict]:
    """``num_rows`` digit-pair prompts from ``random.Random(seed)``.

    Targets cycle through ``[min_target, max_target]`` in a fresh random order every
    ``max_target - min_target + 1`` rows, so each such block holds every target once. The
    defaults (5..13) give every prompt 3 to 5 solutions. With ``bare=True`` the prompt is
    ``"? + ? = <target>"`` (answer ``a + b`` alone); otherwise it asks for
    ``<think>``/``<answer>`` tags.

    Each row: ``prompt``, ``answer`` (one solution), ``task`` (``"digit_pairs"``),
    ``target`` (int) and ``valid_answers`` (the sorted canonical solutions); with
    ``ordered=True`` (order matters, see the module docstring) also ``answer_form``
    (``"ordered"``) and ``task`` is ``"digit_pairs_ordered"``.
    """
    check_int("num_rows", num_rows, minimum=1)
    check_int("seed", seed, minimum=0)
    check_int("min_target", min_target, minimum=0, maximum=18)
    check_int("max_target", max_target, minimum=min_target, maximum=18)
    for name, flag in (("bare", bare), ("ordered", ordered)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be a bool; got {flag!r}")
    rng = random.Random(seed)
    targets = list(range(min_target, max_target + 1))
    rows: list[dict] = []
    for target in in_blocks(rng, targets, num_rows):
        valid = pair_solutions(target, ordered)
        prompt = (
            f"? + ? = {target}"
            if bare
            else f"Write {target} as the sum of two digits (0 to 9), as 'a + b'. "
            f"{ANSWER_INSTRUCTION}"
        )
        row = {
            "prompt": prompt, "answer": rng.choice(valid),
            "task": "digit_pairs_ordered" if ordered else "digit_pairs",
            "target": target, "valid_answers": valid,
        }
        if ordered:
            row["answer_form"] = "ordered"
        rows.append(row)
    return rows

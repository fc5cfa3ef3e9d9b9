"""Digit pairs: write a target as the sum of two digits; several answers are right.

A prompt asks for two digits ``a, b`` in ``0..9`` with ``a + b = target``. A target has
``min(target, 18 - target) // 2 + 1`` solutions up to order, all listed in the row's
``valid_answers`` in the canonical form of
:func:`~maxent_grpo.tasks.multi_answer.canonical_expression` (smaller digit first), so
coverage@k is exact. A multi-answer task a tiny model learns in minutes; the
``digit_pair`` reward checks it.

>>> row = digit_pairs(1, 0, min_target=9, max_target=9, bare=True)[0]
>>> row["prompt"], row["valid_answers"]
('? + ? = 9', ['0 + 9', '1 + 8', '2 + 7', '3 + 6', '4 + 5'])
"""

from __future__ import annotations

import random

from maxent_grpo.tasks.spec import ANSWER_INSTRUCTION, check_int


def pair_solutions(target: int) -> list[str]:
    """The canonical solutions ``"a + b"`` (``a <= b``, digits) of ``a + b = target``.

    >>> pair_solutions(3), pair_solutions(18), pair_solutions(19)
    (['0 + 3', '1 + 2'], ['9 + 9'], [])
    """
    return [f"{a} + {target - a}" for a in range(10) if a <= target - a <= 9]


def digit_pairs(
    num_rows: int, seed: int, *, min_target: int = 5, max_target: int = 13, bare: bool = False,
) -> list[dict]:
    """``num_rows`` digit-pair prompts from ``random.Random(seed)``.

    Targets cycle through ``[min_target, max_target]`` in a fresh random order every
    ``max_target - min_target + 1`` rows, so each such block holds every target once. The
    defaults (5..13) give every prompt 3 to 5 solutions. With ``bare=True`` the prompt is
    ``"? + ? = <target>"`` (answer ``a + b`` alone); otherwise it asks for
    ``<think>``/``<answer>`` tags.

    Each row: ``prompt``, ``answer`` (one solution), ``task`` (``"digit_pairs"``),
    ``target`` (int) and ``valid_answers`` (the sorted canonical solutions).
    """
    check_int("num_rows", num_rows, minimum=1)
    check_int("seed", seed, minimum=0)
    check_int("min_target", min_target, minimum=0, maximum=18)
    check_int("max_target", max_target, minimum=min_target, maximum=18)
    if not isinstance(bare, bool):
        raise ValueError(f"bare must be a bool; got {bare!r}")
    rng = random.Random(seed)
    targets = list(range(min_target, max_target + 1))
    rows: list[dict] = []
    order: list[int] = []
    for _ in range(num_rows):
        if not order:
            order = rng.sample(targets, len(targets))
        target = order.pop()
        valid = pair_solutions(target)
        prompt = (
            f"? + ? = {target}"
            if bare
            else f"Write {target} as the sum of two digits (0 to 9), as 'a + b'. "
            f"{ANSWER_INSTRUCTION}"
        )
        rows.append({
            "prompt": prompt, "answer": rng.choice(valid), "task": "digit_pairs",
            "target": target, "valid_answers": valid,
        })
    return rows

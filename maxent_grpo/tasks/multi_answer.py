"""Countdown with a known answer set: every distinct solution is enumerated offline.

``countdown_multi`` rows are countdown instances (the rules and verifier of
:mod:`maxent_grpo.tasks.countdown`) whose **complete** set of solutions, up to the
equivalence below, is listed in ``valid_answers``, so coverage@k (docs/ALGORITHM.md §6) is
measurable offline.

Two expressions are the same solution when they have the same canonical form
(:func:`maxent_grpo.tasks.expressions.canonical_expression`, which says what it
identifies). For any string ``e``, ``check_countdown(e, numbers, target)`` holds exactly
when ``canonical_expression(e) in valid_answers``.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
from collections.abc import Sequence
from functools import lru_cache

from maxent_grpo.tasks.countdown import countdown_prompt
from maxent_grpo.tasks.expressions import _combine, _Expr, _leaf
from maxent_grpo.validation import check_int

MAX_NUMBERS = 4
"""Largest instance enumerated (4 numbers: about 10^4 trees; 5 would take ~100x longer)."""

_MAX_DRAWS = 10_000
_WARN_DRAWS = 1_000
logger = logging.getLogger(__name__)


@lru_cache(maxsize=4096)
def _expressions(values: tuple[int, ...]) -> tuple[_Expr, ...]:
    """Canonical forms of all expressions using each of the sorted ``values`` exactly once
    (all binary trees, leaf orders and operators; divisions by zero left out)."""
    if len(values) == 1:
        return (_leaf(values[0]),)
    splits: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    for size in range(1, len(values)):
        for chosen in itertools.combinations(range(len(values)), size):
            left = tuple(values[i] for i in chosen)
            right = tuple(values[i] for i in range(len(values)) if i not in chosen)
            splits.add((left, right))
    found: dict[str, _Expr] = {}
    for left, right in sorted(splits):
        for a in _expressions(left):
            for b in _expressions(right):
                # + and * are commutative: the split (right, left) gives the same forms
                ops = "+-*/" if left <= right else "-/"
                for op in ops:
                    try:
                        e = _combine(op, a, b)
                    except ZeroDivisionError:
                        continue
                    found.setdefault(e.text, e)
    return tuple(found.values())


def _subsets(numbers: Sequence[int]) -> set[tuple[int, ...]]:
    """The distinct non-empty sub-multisets of ``numbers``, each sorted."""
    ordered = sorted(numbers)
    return {c for size in range(1, len(ordered) + 1)
            for c in itertools.combinations(ordered, size)}


@lru_cache(maxsize=1024)
def _solutions_by_target(numbers: tuple[int, ...]) -> dict[int, tuple[str, ...]]:
    """For sorted ``numbers``: every positive integer value reachable with each number used
    at most once, mapped to its sorted canonical solutions."""
    by_target: dict[int, set[str]] = {}
    for subset in _subsets(numbers):
        for e in _expressions(subset):
            if e.value.denominator == 1 and e.value > 0:
                by_target.setdefault(int(e.value), set()).add(e.text)
    return {t: tuple(sorted(texts)) for t, texts in by_target.items()}


def countdown_solutions(numbers: Sequence[int], target: int) -> list[str]:
    """All canonical solutions of a countdown instance (each number at most once), sorted.

    >>> countdown_solutions([2, 3, 5], 10)
    ['2 * 5', '2 + 3 + 5']
    """
    if (
        not isinstance(numbers, (list, tuple))
        or not 1 <= len(numbers) <= MAX_NUMBERS
        or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in numbers)
    ):
        raise ValueError(
            f"numbers must be a list of 1 to {MAX_NUMBERS} non-negative ints; got {numbers!r}"
        )
    check_int("target", target)
    if target <= 0:  # the enumeration keeps positive targets only; do it directly
        return sorted({e.text for s in _subsets(numbers) for e in _expressions(s)
                       if e.value == target})
    return list(_solutions_by_target(tuple(sorted(numbers))).get(target, ()))


def countdown_multi(
    num_rows: int, seed: int, *, num_numbers: int = 3, min_value: int = 2, max_value: int = 12,
    max_target: int | None = None, min_solutions: int = 2, max_solutions: int = 20,
) -> list[dict]:
    """``num_rows`` countdown prompts with their full solution sets, from
    ``random.Random(seed)``.

    Per row: ``num_numbers`` numbers drawn uniformly from ``[min_value, max_value]``
    (repeats possible); the target drawn uniformly among the positive integers (at most
    ``max_target``) that are not one of the numbers and have ``min_solutions`` to
    ``max_solutions`` canonical solutions (else the numbers are redrawn). The default
    ``min_value = 2`` keeps out ``x * 1``, ``x / 1`` next to ``x``.

    Each row: ``prompt``, ``answer`` (one solution), ``task`` (``"countdown_multi"``),
    ``numbers``, ``target`` and ``valid_answers`` (the sorted canonical solutions). The
    ``countdown`` reward scores these rows.
    """
    check_int("num_rows", num_rows, minimum=1)
    check_int("seed", seed, minimum=0)
    check_int("num_numbers", num_numbers, minimum=2, maximum=MAX_NUMBERS)
    check_int("min_value", min_value, minimum=0)
    check_int("max_value", max_value, minimum=max(min_value, 1))
    if max_target is not None:
        check_int("max_target", max_target, minimum=1)
    check_int("min_solutions", min_solutions, minimum=1)
    check_int("max_solutions", max_solutions, minimum=min_solutions)
    rng = random.Random(seed)
    rows: list[dict] = []
    # the distinct sorted draws: once each has failed, no further draw can succeed
    draws = math.comb(max_value - min_value + num_numbers, num_numbers)
    failed: set[tuple[int, ...]] = set()
    for _ in range(num_rows):
        for draw in range(1, _MAX_DRAWS + 1):
            numbers = [rng.randint(min_value, max_value) for _ in range(num_numbers)]
            drawn = tuple(sorted(numbers))
            by_target = _solutions_by_target(drawn)
            targets = [
                t
                for t in sorted(by_target)
                if t not in numbers
                and (max_target is None or t <= max_target)
                and min_solutions <= len(by_target[t]) <= max_solutions
            ]
            if targets:
                break
            failed.add(drawn)
            if len(failed) == draws:
                break
            if draw == _WARN_DRAWS:  # 4 numbers take about 15 ms a draw
                logger.warning("countdown_multi: %d draws of numbers found no target with "
                               "%d to %d solutions; trying up to %d", draw, min_solutions,
                               max_solutions, _MAX_DRAWS)
        if not targets:
            raise ValueError(
                f"countdown_multi found no target with {min_solutions} to {max_solutions} "
                f"solutions in {draw} draws of numbers in [{min_value}, {max_value}]"
                f"{' (every possible draw)' if len(failed) == draws else ''}; widen "
                "min_solutions/max_solutions, max_target or the value range"
            )
        target = rng.choice(targets)
        valid = list(by_target[target])
        prompt = countdown_prompt(numbers, target, " (not every number has to be used); "
                                  "several expressions work, give one")
        rows.append({
            "prompt": prompt, "answer": rng.choice(valid), "task": "countdown_multi",
            "numbers": numbers, "target": target, "valid_answers": valid,
        })
    return rows

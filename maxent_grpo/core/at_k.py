"""Sampling-based evaluation metrics (docs/ALGORITHM.md §6).

For one prompt with ``n`` i.i.d. samples, ``c`` of them correct, every ``@k`` metric
describes ``k <= n`` samples. The first ``k`` samples are an unbiased draw of ``k``; the
average over all ``C(n, k)`` subsets is unbiased too, with lower variance:

- ``pass@k`` (:func:`pass_at_k`): the all-subsets average, ``1 - C(n-c, k) / C(n, k)``;
- ``mean@k`` (:func:`mean_at_k`): the all-subsets average, i.e. the mean over all ``n``;
- ``distinct@k`` / ``coverage@k``: :func:`distinct_at_k` and :func:`coverage_at_k` count
  over the first ``k`` samples; :func:`expected_distinct_at_k` and
  :func:`expected_coverage_at_k` give the all-subsets averages in closed form, which
  :func:`aggregate` uses.

Answers are compared as strings; callers with a task-specific canonical form (e.g.
:func:`maxent_grpo.tasks.expressions.canonical_expression`) pass that form. Plain Python,
no tensors.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Sequence

__all__ = [
    "aggregate", "coverage_at_k", "distinct_at_k", "expected_coverage_at_k",
    "expected_distinct_at_k", "mean_at_k", "normalise_answer", "pass_at_k",
]


def _check_count(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int; got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")
    return value


def _check_k(k: object, n: int, what: str = "n") -> int:
    """``k`` must be an int with ``1 <= k <= n`` (``what`` names ``n`` in the message)."""
    k = _check_count("k", k, minimum=1)
    if k > n:
        raise ValueError(f"k must be <= {what} (the number of samples); got k={k}, {what}={n}")
    return k


def _check_sequence(name: str, values: object) -> Sequence:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(f"{name} must be a sequence (list or tuple); got {type(values)!r}")
    return values


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` correct: ``1 - C(n-c, k) / C(n, k)``.

    The ratio is computed as ``prod_{j=0}^{k-1} (n-c-j) / (n-j)`` (no large binomials);
    ``n - c < k`` gives exactly ``1.0`` and ``c = 0`` exactly ``0.0``.

    >>> pass_at_k(5, 2, 1), round(pass_at_k(5, 2, 2), 12)
    (0.4, 0.7)
    """
    n = _check_count("n", n, minimum=0)
    c = _check_count("c", c, minimum=0)
    if c > n:
        raise ValueError(f"c must be <= n (correct samples among n); got c={c}, n={n}")
    k = _check_k(k, n)
    if n - c < k:
        return 1.0
    all_wrong = 1.0
    for j in range(k):
        all_wrong *= (n - c - j) / (n - j)
    return 1.0 - all_wrong


def _check_correctness(correct: object, *, binary: bool) -> list[float]:
    values = _check_sequence("correct", correct)
    out: list[float] = []
    for i, value in enumerate(values):
        if isinstance(value, bool):
            out.append(float(value))
            continue
        if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:  # NaN fails too
            raise ValueError(f"correct[{i}] must be a bool or a number in [0, 1]; got {value!r}")
        if binary and value not in (0, 1):
            raise ValueError(f"correct[{i}] must be 0 or 1 (or a bool); got {value!r}")
        out.append(float(value))
    return out


def mean_at_k(correct: Sequence[bool | float], k: int) -> float:
    """mean@k: the mean correctness of ``k`` samples, averaged over all ``k``-subsets of the
    ``n = len(correct)`` samples.

    ``(1 / C(n, k)) * sum_{|S|=k} (1/k) sum_{i in S} correct[i] = (1/n) sum_i correct[i]``
    for every valid ``k`` (``k`` is only checked, ``1 <= k <= n``). Values are bools or
    numbers in ``[0, 1]`` (partial credit allowed).

    >>> mean_at_k([True, False, True, True], 2)
    0.75
    """
    values = _check_correctness(correct, binary=False)
    _check_k(k, len(values), "len(correct)")
    return math.fsum(values) / len(values)


def normalise_answer(answer: str | None) -> str | None:
    """``answer`` with runs of whitespace collapsed to one space and ends stripped; ``None``
    for ``None`` or an answer that is empty after stripping.

    >>> normalise_answer("  (3 +  5)\\n* 2 "), normalise_answer("  ")
    ('(3 + 5) * 2', None)
    """
    if answer is None:
        return None
    if not isinstance(answer, str):
        raise ValueError(f"answers must hold str or None; got {answer!r}")
    collapsed = " ".join(answer.split())
    return collapsed or None


def _normalised_answers(answers: object) -> list[str | None]:
    values = _check_sequence("answers", answers)
    out: list[str | None] = []
    for i, value in enumerate(values):
        if value is not None and not isinstance(value, str):
            raise ValueError(f"answers[{i}] must be a str or None; got {value!r}")
        out.append(normalise_answer(value))
    return out


def distinct_at_k(answers: Sequence[str | None], k: int) -> int:
    """distinct@k: the number of distinct answers among the first ``k`` samples, compared
    after :func:`normalise_answer` (``None`` and empty answers are not counted).

    >>> distinct_at_k(["8", " 8", None, "9", "7"], 4)
    2
    """
    values = _normalised_answers(answers)
    _check_k(k, len(values), "len(answers)")
    return len({a for a in values[:k] if a is not None})


def expected_distinct_at_k(answers: Sequence[str | None], k: int) -> float:
    """The number of distinct answers in ``k`` samples, averaged over all ``k``-subsets of
    the ``n = len(answers)`` samples.

    An answer given by ``m`` of the ``n`` samples appears in a random ``k``-subset with
    probability ``1 - C(n-m, k) / C(n, k) = pass_at_k(n, m, k)``, so by linearity
    ``E[distinct] = sum_a pass_at_k(n, m_a, k)`` over the distinct answers ``a``
    (normalised as in :func:`distinct_at_k`; ``None`` samples still count in ``n``).

    >>> expected_distinct_at_k(["a", "a", "b"], 3), round(expected_distinct_at_k(["a", "b"], 1), 12)
    (2.0, 1.0)
    """
    values = _normalised_answers(answers)
    n = len(values)
    _check_k(k, n, "len(answers)")
    counts = Counter(a for a in values if a is not None)
    return math.fsum(pass_at_k(n, m, k) for m in counts.values())


def _check_coverage_args(
    correct_answers: object, valid_answers: object, k: object
) -> tuple[list[str | None], frozenset[str], int]:
    values = list(_check_sequence("correct_answers", correct_answers))
    if not isinstance(valid_answers, (set, frozenset)) or not valid_answers:
        raise ValueError(
            f"valid_answers must be a non-empty set of str; got {valid_answers!r:.200}"
        )
    if any(not isinstance(a, str) for a in valid_answers):
        raise ValueError(f"valid_answers must hold only str; got {valid_answers!r:.200}")
    for i, value in enumerate(values):
        if value is not None and value not in valid_answers:
            raise ValueError(
                f"correct_answers[{i}] = {value!r} is not in valid_answers: pass the canonical "
                "form of a correct answer, or None for an incorrect or missing one"
            )
    k = _check_k(k, len(values), "len(correct_answers)")
    return values, frozenset(valid_answers), k


def coverage_at_k(
    correct_answers: Sequence[str | None], valid_answers: set[str] | frozenset[str], k: int
) -> float:
    """coverage@k: distinct correct answers among the first ``k`` samples / ``|valid|``.

    ``correct_answers[i]`` is the canonical form of sample ``i``'s answer when it is
    correct and ``None`` otherwise; a string not in ``valid_answers`` raises ``ValueError``
    (the verifier and the canonical form disagree). Answers are compared exactly.

    >>> coverage_at_k(["3 + 5", None, "3 + 5", "2 * 4"], {"3 + 5", "2 * 4", "10 - 2"}, 3)
    0.3333333333333333
    """
    values, valid, k = _check_coverage_args(correct_answers, valid_answers, k)
    return len({a for a in values[:k] if a is not None}) / len(valid)


def expected_coverage_at_k(
    correct_answers: Sequence[str | None], valid_answers: set[str] | frozenset[str], k: int
) -> float:
    """coverage@k averaged over all ``k``-subsets of the ``n`` samples:
    ``(1 / |valid|) * sum_{a in valid} pass_at_k(n, m_a, k)``, where ``m_a`` is the number
    of samples whose correct answer is ``a`` (arguments as in :func:`coverage_at_k`).

    >>> expected_coverage_at_k(["x", None, "y", "x"], {"x", "y", "z"}, 4)
    0.6666666666666666
    """
    values, valid, k = _check_coverage_args(correct_answers, valid_answers, k)
    counts = Counter(a for a in values if a is not None)
    n = len(values)
    return math.fsum(pass_at_k(n, m, k) for m in counts.values()) / len(valid)


def aggregate(
    correct: Sequence[Sequence[bool | float]], ks: Sequence[int], *,
    answers: Sequence[Sequence[str | None]] | None = None,
    valid_answers: Sequence[Collection[str] | None] | None = None,
) -> dict[str, float]:
    """Means over prompts of the ``@k`` metrics, for every ``k`` in ``ks``.

    ``correct[p]`` holds the 0/1 correctness of the samples of prompt ``p`` (prompts may
    have different sample counts ``n_p``; every ``k`` must be ``<= min_p n_p``). Returns
    ``{"pass@k": ..., "mean@k": ...}`` for each ``k`` (``mean@k`` is the same for every
    ``k``, see :func:`mean_at_k`), plus

    - ``"distinct@k"`` (:func:`expected_distinct_at_k`) when ``answers`` is given
      (``answers[p][i]`` is sample ``i``'s answer or ``None``, canonical where the task
      has a canonical form), and ``"distinct_correct@k"``, the same count over the correct
      samples only (the number of different right answers among ``k`` samples);
    - ``"coverage@k"`` (:func:`expected_coverage_at_k`) when ``answers`` and
      ``valid_answers`` are given: prompt ``p``'s correct answers are the ``answers[p][i]``
      with ``correct[p][i] == 1``; prompts whose ``valid_answers[p]`` is ``None`` are left
      out of the mean (no key when none has a valid-answer set).

    >>> aggregate([[1, 0], [0, 0]], [1, 2])
    {'pass@1': 0.25, 'mean@1': 0.25, 'pass@2': 0.5, 'mean@2': 0.25}
    """
    rows = _check_sequence("correct", correct)
    if not rows:
        raise ValueError("correct must hold at least one prompt; got an empty sequence")
    ks = list(_check_sequence("ks", ks))
    if not ks:
        raise ValueError("ks must hold at least one k; got an empty sequence")
    binary: list[list[float]] = []
    for p, row in enumerate(rows):
        try:
            binary.append(_check_correctness(row, binary=True))
        except ValueError as err:
            raise ValueError(f"correct[{p}]: {err}") from None
        if not binary[-1]:
            raise ValueError(f"correct[{p}] must hold at least one sample; got none")
    min_n = min(len(row) for row in binary)
    for k in ks:
        _check_k(k, min_n, "the smallest number of samples of a prompt")
    if answers is not None:
        answers = _check_sequence("answers", answers)
        if len(answers) != len(binary) or any(
            len(_check_sequence(f"answers[{p}]", a)) != len(binary[p])
            for p, a in enumerate(answers)
        ):
            raise ValueError("answers must have the same shape as correct (one per sample)")
    if valid_answers is not None:
        if answers is None:
            raise ValueError("valid_answers needs answers (the samples' canonical answers)")
        valid_answers = _check_sequence("valid_answers", valid_answers)
        if len(valid_answers) != len(binary):
            raise ValueError(
                f"valid_answers must hold one entry per prompt ({len(binary)}); "
                f"got {len(valid_answers)}"
            )

    def mean(values: list[float]) -> float:
        return math.fsum(values) / len(values)

    out: dict[str, float] = {}
    for k in ks:
        out[f"pass@{k}"] = mean([pass_at_k(len(r), int(sum(r)), k) for r in binary])
        out[f"mean@{k}"] = mean([mean_at_k(r, k) for r in binary])
        if answers is not None:
            out[f"distinct@{k}"] = mean([expected_distinct_at_k(a, k) for a in answers])
            out[f"distinct_correct@{k}"] = mean([
                expected_distinct_at_k([x if ok else None for x, ok in zip(a, r, strict=True)], k)
                for a, r in zip(answers, binary, strict=True)
            ])
        if answers is not None and valid_answers is not None:
            covered = [
                _prompt_coverage(p, answers[p], binary[p], valid, k)
                for p, valid in enumerate(valid_answers)
                if valid is not None
            ]
            if covered:
                out[f"coverage@{k}"] = mean(covered)
    return out


def _prompt_coverage(
    p: int, answers: Sequence[str | None], correct: list[float], valid: object, k: int
) -> float:
    """:func:`expected_coverage_at_k` of prompt ``p``; errors name the prompt."""
    if isinstance(valid, (str, bytes)) or not isinstance(valid, Collection):
        raise ValueError(
            f"valid_answers[{p}] must be a collection of str or None; got {valid!r:.200}"
        )
    chosen = [a if ok else None for a, ok in zip(answers, correct, strict=True)]
    try:
        return expected_coverage_at_k(chosen, frozenset(valid), k)
    except ValueError as err:
        raise ValueError(f"prompt {p}: {err}") from None

"""Evaluation metrics: hand values, brute force over all k-subsets, edge cases and errors."""

from __future__ import annotations

import doctest
import itertools
import math
import random
from fractions import Fraction

import pytest

import maxent_grpo.core.at_k as at_k
from maxent_grpo.core.at_k import (
    aggregate,
    coverage_at_k,
    distinct_at_k,
    expected_coverage_at_k,
    expected_distinct_at_k,
    mean_at_k,
    normalise_answer,
    pass_at_k,
)


def _subsets_mean(values: list, k: int, metric) -> float:
    """Average of ``metric(subset)`` over all k-subsets (by position) of ``values``."""
    subsets = list(itertools.combinations(values, k))
    return sum(metric(s) for s in subsets) / len(subsets)


def test_docstring_examples() -> None:
    result = doctest.testmod(at_k)
    assert result.failed == 0 and result.attempted > 0


def test_pass_at_k_hand_values() -> None:
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4, abs=1e-15)  # c / n
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10, abs=1e-15)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(5, 4, 2) == 1.0  # n - c = 1 < k: every pair holds a correct sample
    assert pass_at_k(1, 1, 1) == 1.0 and pass_at_k(1, 0, 1) == 0.0


def test_pass_at_k_matches_brute_force() -> None:
    for n in range(1, 8):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                brute = _subsets_mean(samples, k, any)
                assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)


def test_pass_at_k_large_n_is_accurate() -> None:
    # C(1000, 100) ~ 1e139: the product form stays accurate; compare with exact fractions
    for n, c, k in [(1000, 10, 100), (1000, 1, 1), (2000, 3, 1000), (1000, 900, 50)]:
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15)
    assert pass_at_k(1000, 901, 100) == 1.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((5, 2, 6), r"k must be <= n .*k=6, n=5"),
        ((5, 2, 0), r"k must be >= 1; got 0"),
        ((-1, 0, 1), r"n must be >= 0; got -1"),
        ((5, -1, 1), r"c must be >= 0; got -1"),
        ((5, 6, 1), r"c must be <= n .*c=6, n=5"),
        ((5.0, 2, 1), r"n must be an int; got 5.0"),
        ((5, True, 1), r"c must be an int; got True"),
        ((5, 2, "1"), r"k must be an int; got '1'"),
    ],
)
def test_pass_at_k_errors(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pass_at_k(*args)


def test_mean_at_k_is_the_all_subsets_average() -> None:
    rng = random.Random(0)
    for n in range(1, 7):
        values = [rng.choice([0.0, 1.0, 0.5, True, False]) for _ in range(n)]
        for k in range(1, n + 1):
            brute = _subsets_mean([float(v) for v in values], k, lambda s: sum(s) / len(s))
            assert mean_at_k(values, k) == pytest.approx(brute, abs=1e-12)
            assert mean_at_k(values, k) == pytest.approx(sum(map(float, values)) / n)
    assert mean_at_k([True, False, False, False], 1) == 0.25  # not the first sample's 1.0


@pytest.mark.parametrize(
    ("correct", "k", "message"),
    [
        ([True, False], 3, r"k must be <= len\(correct\).*k=3, len\(correct\)=2"),
        ([], 1, r"k must be <= len\(correct\).*k=1, len\(correct\)=0"),
        ([True, 1.5], 1, r"correct\[1\] must be a bool or a number in \[0, 1\]; got 1.5"),
        ([float("nan")], 1, r"correct\[0\] must be"),
        ([True, "1"], 1, r"correct\[1\] must be"),
        ("10", 1, r"correct must be a sequence"),
    ],
)
def test_mean_at_k_errors(correct: object, k: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mean_at_k(correct, k)


def test_distinct_at_k_counts_the_first_k() -> None:
    answers = ["8", " 8 ", None, "", "9", "3 +  5", "3 + 5", "7"]
    assert [distinct_at_k(answers, k) for k in range(1, 9)] == [1, 1, 1, 1, 2, 3, 3, 4]
    assert normalise_answer("\t3 +\n5 ") == "3 + 5" and normalise_answer("") is None
    assert distinct_at_k([None, None], 2) == 0


def test_expected_distinct_matches_brute_force() -> None:
    rng = random.Random(1)
    for n in range(1, 8):
        answers = [rng.choice(["a", "b", "c", " a", None]) for _ in range(n)]
        for k in range(1, n + 1):
            brute = _subsets_mean(
                answers, k, lambda s: len({normalise_answer(a) for a in s} - {None})
            )
            assert expected_distinct_at_k(answers, k) == pytest.approx(brute, abs=1e-12)
    # k = n: every sample is taken, so the expectation is the plain distinct count
    assert expected_distinct_at_k(["a", "b", "a", None], 4) == 2.0


@pytest.mark.parametrize("fn", [distinct_at_k, expected_distinct_at_k])
def test_distinct_errors(fn) -> None:
    with pytest.raises(ValueError, match=r"k must be <= len\(answers\).*k=3, len\(answers\)=2"):
        fn(["a", "b"], 3)
    with pytest.raises(ValueError, match=r"answers\[1\] must be a str or None; got 7"):
        fn(["a", 7], 1)
    with pytest.raises(ValueError, match="answers must be a sequence"):
        fn("ab", 1)


def test_coverage_at_k_hand_values() -> None:
    valid = {"3 + 5", "2 * 4", "10 - 2", "16 / 2"}
    samples = ["3 + 5", None, "3 + 5", "2 * 4", None, "16 / 2"]
    assert [coverage_at_k(samples, valid, k) for k in range(1, 7)] == [
        0.25, 0.25, 0.25, 0.5, 0.5, 0.75
    ]
    assert coverage_at_k([None, None], frozenset({"x"}), 2) == 0.0


def test_expected_coverage_matches_brute_force() -> None:
    rng = random.Random(2)
    valid = {"x", "y", "z"}
    for n in range(1, 8):
        samples = [rng.choice(["x", "y", None, None]) for _ in range(n)]
        for k in range(1, n + 1):
            brute = _subsets_mean(samples, k, lambda s: len(set(s) - {None}) / 3)
            assert expected_coverage_at_k(samples, valid, k) == pytest.approx(brute, abs=1e-12)


@pytest.mark.parametrize("fn", [coverage_at_k, expected_coverage_at_k])
def test_coverage_errors(fn) -> None:
    with pytest.raises(ValueError, match=r"correct_answers\[1\] = '5 \+ 3' is not in valid"):
        fn(["3 + 5", "5 + 3"], {"3 + 5"}, 1)
    with pytest.raises(ValueError, match="valid_answers must be a non-empty set"):
        fn(["a"], set(), 1)
    with pytest.raises(ValueError, match="valid_answers must be a non-empty set"):
        fn(["a"], ["a"], 1)
    with pytest.raises(ValueError, match=r"k must be <= len\(correct_answers\).*k=2"):
        fn(["a"], {"a"}, 2)


def test_aggregate_hand_values() -> None:
    correct = [[1, 0, 0, 1], [False, False, False, False], [1.0, 1.0, 0.0, 1.0]]
    answers = [["3 + 5", "9", None, "2 * 4"], [None, "1", "1", "2"], ["a", "a", "b", "a"]]
    valid = [["3 + 5", "2 * 4", "10 - 2"], None, {"a", "c"}]
    out = aggregate(correct, [1, 4], answers=answers, valid_answers=valid)
    # pass@1 = mean(c/n) = mean(2/4, 0, 3/4); pass@4 = mean(1, 0, 1)
    assert out["pass@1"] == pytest.approx((0.5 + 0 + 0.75) / 3)
    assert out["pass@4"] == pytest.approx(2 / 3)
    assert out["mean@1"] == out["mean@4"] == pytest.approx((0.5 + 0 + 0.75) / 3)
    # distinct@4 = mean(3, 2, 2); distinct@1 = 1 - (share of None answers) per prompt
    assert out["distinct@4"] == pytest.approx(7 / 3)
    assert out["distinct@1"] == pytest.approx((0.75 + 0.75 + 1) / 3)
    # coverage over prompts 0 and 2 only: k=4 -> mean(2/3, 1/2); k=1 -> mean(2/4/3, 3/4/2)
    assert out["coverage@4"] == pytest.approx((2 / 3 + 1 / 2) / 2)
    assert out["coverage@1"] == pytest.approx((0.5 / 3 + 0.75 / 2) / 2)
    # distinct correct answers: prompt 0 has "3 + 5" and "2 * 4", prompt 1 none, prompt 2
    # only "a" (3 of 4 samples); k=1: the chance the sample is correct
    assert out["distinct_correct@4"] == pytest.approx((2 + 0 + 1) / 3)
    assert out["distinct_correct@1"] == pytest.approx((0.5 + 0 + 0.75) / 3)
    assert set(aggregate(correct, [2])) == {"pass@2", "mean@2"}
    no_sets = aggregate(correct, [2], answers=answers, valid_answers=[None, None, None])
    assert set(no_sets) == {"pass@2", "mean@2", "distinct@2", "distinct_correct@2"}


def test_aggregate_errors() -> None:
    with pytest.raises(ValueError, match=r"k must be <= the smallest number of samples.*k=3"):
        aggregate([[1, 0, 1], [1, 0]], [1, 3])
    with pytest.raises(ValueError, match=r"correct\[1\]: correct\[0\] must be 0 or 1.*0.5"):
        aggregate([[1], [0.5]], [1])
    with pytest.raises(ValueError, match="ks must hold at least one k"):
        aggregate([[1]], [])
    with pytest.raises(ValueError, match="correct must hold at least one prompt"):
        aggregate([], [1])
    with pytest.raises(ValueError, match="answers must have the same shape as correct"):
        aggregate([[1, 0]], [1], answers=[["a"]])
    with pytest.raises(ValueError, match="valid_answers needs answers"):
        aggregate([[1, 0]], [1], valid_answers=[{"a"}])
    with pytest.raises(ValueError, match=r"valid_answers must hold one entry per prompt \(1\)"):
        aggregate([[1, 0]], [1], answers=[["a", "b"]], valid_answers=[{"a"}, {"b"}])
    with pytest.raises(ValueError, match=r"prompt 0: correct_answers\[1\] = 'b' is not in"):
        aggregate([[1, 1]], [1], answers=[["a", "b"]], valid_answers=[{"a"}])
    with pytest.raises(ValueError, match=r"valid_answers\[0\] must be a collection"):
        aggregate([[1, 1]], [1], answers=[["a", "a"]], valid_answers=["a"])

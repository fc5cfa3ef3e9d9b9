"""countdown_multi: complete solution sets, canonical forms, agreement with the verifier."""

from __future__ import annotations

import doctest
import itertools
import logging
import time
from fractions import Fraction

import pytest

import maxent_grpo.tasks.multi_answer as multi_answer
from maxent_grpo.rewards import countdown_reward
from maxent_grpo.tasks import build_task, check_countdown, task_options
from maxent_grpo.tasks.expressions import canonical_expression
from maxent_grpo.tasks.multi_answer import countdown_multi, countdown_solutions


def _all_expressions(numbers: list[int]) -> dict[str, Fraction | None]:
    """Every fully parenthesised expression over every sub-multiset of ``numbers`` (each
    used at most once), built by repeatedly joining two items of the pool in either order
    with any operator (an exhaustive version of how ``countdown`` draws its answers), with
    its exact value (None after a division by zero)."""

    def join(pool: tuple[tuple[str, Fraction | None], ...]) -> dict[str, Fraction | None]:
        if len(pool) == 1:
            return dict(pool)
        out: dict[str, Fraction | None] = {}
        for i, j in itertools.permutations(range(len(pool)), 2):
            rest = tuple(p for m, p in enumerate(pool) if m not in (i, j))
            (left, a), (right, b) = pool[i], pool[j]
            for op in "+-*/":
                if a is None or b is None or (op == "/" and b == 0):
                    value = None
                else:
                    value = {"+": a + b, "-": a - b, "*": a * b}[op] if op != "/" else a / b
                out.update(join((*rest, (f"({left} {op} {right})", value))))
        return out

    found: dict[str, Fraction | None] = {}
    for size in range(1, len(numbers) + 1):
        for chosen in itertools.combinations(numbers, size):
            found.update(join(tuple((str(n), Fraction(n)) for n in chosen)))
    return found


def test_docstring_examples() -> None:
    result = doctest.testmod(multi_answer)
    assert result.failed == 0 and result.attempted > 0


def test_hand_counted_instances() -> None:
    # 10 from {2, 3, 5}: 2 * 5 and 2 + 3 + 5 (checked by hand: nothing else reaches 10)
    assert countdown_solutions([2, 3, 5], 10) == ["2 * 5", "2 + 3 + 5"]
    # 2 from {2, 4}: the number 2 itself (using a subset is allowed), 4 - 2 and 4 / 2
    assert countdown_solutions([4, 2], 2) == ["2", "4 - 2", "4 / 2"]
    assert countdown_solutions([2, 2], 4) == ["2 * 2", "2 + 2"]
    assert countdown_solutions([2, 3], 7) == []


@pytest.mark.parametrize("numbers", [[2, 3, 5], [3, 3, 6], [0, 2, 4], [1, 2, 2], [7, 4, 2]])
def test_independent_brute_force_agrees(numbers: list[int]) -> None:
    expressions = _all_expressions(numbers)
    targets = range(-12, 40)
    by_target: dict[int, set[str]] = {t: set() for t in targets}
    for expr, value in expressions.items():
        canon = canonical_expression(expr)
        if value is None:  # a division by zero: rejected by both
            assert canon is None and not check_countdown(expr, numbers, 1)
            continue
        assert canon is not None
        if value.denominator == 1 and int(value) in by_target:
            assert check_countdown(expr, numbers, int(value))
            by_target[int(value)].add(canon)
    assert sum(map(len, by_target.values())) > 20  # the instances reach many targets
    solutions = {t: countdown_solutions(numbers, t) for t in targets}
    for t in targets:
        assert solutions[t] == sorted(by_target[t]), t
    # the verifier accepts an expression exactly when its canonical form is listed
    for expr in expressions:
        canon = canonical_expression(expr)
        for t in (-1, 0, 1, 2, 3, 8, 10, 16):
            assert check_countdown(expr, numbers, t) == (canon in solutions[t]), (expr, t)


def test_canonical_forms_merge_commutative_and_associative_variants() -> None:
    same = [
        ("3+5", "5 + 3", "(3 + 5)", "((5)+(3))"),
        ("(2*3)*4", "4*(3*2)", "2*(3*4)", "3 * 4 * 2"),
        ("7-(4-2)", "7+2-4", "2+7-4", "(7 - 4) + 2"),
        ("8/(4/2)", "8*2/4", "2/4*8", "(8/4)*2"),
        ("(1+2)*3", "3*(2+1)"),
        ("9 - 2 - 3", "9 - (3 + 2)", "9 - (2 + 3)"),
    ]
    forms = []
    for group in same:
        canon = {canonical_expression(e) for e in group}
        assert len(canon) == 1 and None not in canon, group
        forms.append(canon.pop())
    assert len(set(forms)) == len(forms)
    for form in forms:
        assert canonical_expression(form) == form  # idempotent
    # different number usage or a different tree shape are different solutions
    assert canonical_expression("6 * 1") != canonical_expression("6")
    assert canonical_expression("(2 + 3) * 4") != canonical_expression("2 * 4 + 3 * 4")
    assert canonical_expression("5 - 3") != canonical_expression("3 - 5")


@pytest.mark.parametrize(
    "expr", ["-3 + 5", "2 ** 3", "x + 1", "3.0 + 1", "True + 1", "", "4 / (2 - 2)", "3 // 2",
             "1 + " * 300 + "1", "(", 12]
)
def test_canonical_expression_rejects_what_the_verifier_rejects(expr: object) -> None:
    assert canonical_expression(expr) is None


def _check_rows(rows: list[dict], num_numbers: int) -> None:
    for row in rows:
        assert row["task"] == "countdown_multi"
        numbers, target, valid = row["numbers"], row["target"], row["valid_answers"]
        assert len(numbers) == num_numbers and target > 0 and target not in numbers
        assert 2 <= len(valid) <= 20 and len(set(valid)) == len(valid) and valid == sorted(valid)
        assert row["answer"] in valid
        assert str(numbers) in row["prompt"] and str(target) in row["prompt"]
        for expr in valid:
            assert check_countdown(expr, numbers, target), (expr, row)
            assert canonical_expression(expr) == expr


def test_rows_hold_verified_complete_solution_sets() -> None:
    rows = countdown_multi(30, 0)
    _check_rows(rows, 3)
    assert len({len(r["valid_answers"]) for r in rows}) > 1
    _check_rows(countdown_multi(3, 5, num_numbers=4), 4)
    _check_rows(countdown_multi(10, 1, num_numbers=2, max_value=30), 2)
    bounded = countdown_multi(20, 2, max_target=10, min_solutions=3, max_solutions=4)
    assert all(r["target"] <= 10 and 3 <= len(r["valid_answers"]) <= 4 for r in bounded)


def test_countdown_reward_accepts_every_listed_answer() -> None:
    rows = countdown_multi(5, 3)
    answers = [a for r in rows for a in r["valid_answers"]]
    completions = [f"<think>x</think><answer>{a}</answer>" for a in answers]
    numbers = [r["numbers"] for r in rows for _ in r["valid_answers"]]
    targets = [r["target"] for r in rows for _ in r["valid_answers"]]
    scores = countdown_reward(["p"] * len(answers), completions, numbers=numbers, target=targets)
    assert scores == [1.0] * len(completions)


def test_deterministic_from_the_seed() -> None:
    assert countdown_multi(20, 7) == countdown_multi(20, 7)
    assert countdown_multi(20, 7)[:5] == countdown_multi(5, 7)
    assert countdown_multi(20, 7) != countdown_multi(20, 8)
    multi_answer._expressions.cache_clear()
    multi_answer._solutions_by_target.cache_clear()
    assert build_task("countdown_multi", 20, 7) == countdown_multi(20, 7)  # cold cache too


def test_generation_does_not_hang() -> None:
    # Only a hang is caught here (about 0.5 s cold on a 2-core CPU; the bound is 100x that),
    # so that a loaded machine cannot fail it.
    multi_answer._expressions.cache_clear()
    multi_answer._solutions_by_target.cache_clear()
    start = time.perf_counter()
    assert len(countdown_multi(100, 11)) == 100
    assert time.perf_counter() - start < 60.0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_numbers": 1}, "num_numbers must be an int >= 2"),
        ({"num_numbers": 5}, "num_numbers must be an int >= 2 and <= 4"),
        ({"min_value": 5, "max_value": 4}, "max_value must be an int >= 5"),
        ({"min_solutions": 0}, "min_solutions must be an int >= 1"),
        ({"min_solutions": 5, "max_solutions": 4}, "max_solutions must be an int >= 5"),
        ({"max_target": 0}, "max_target must be an int >= 1"),
        ({"min_value": 2, "max_value": 3, "min_solutions": 1000, "max_solutions": 1000},
         r"found no target with 1000 to 1000 solutions in \d+ draws .*\(every possible draw\)"),
    ],
)
def test_bad_options(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_task("countdown_multi", 2, 0, **options)


def test_a_long_search_says_so_before_it_fails(caplog, monkeypatch) -> None:
    """An unreachable min_solutions over a wide range is not known until the draws run out
    (10,000; with 4 numbers about 15 ms each): the user is told after 1,000 of them."""
    monkeypatch.setattr(multi_answer, "_MAX_DRAWS", 1200)  # the test's time
    with caplog.at_level(logging.WARNING, logger=multi_answer.__name__), \
            pytest.raises(ValueError, match=r"in 1200 draws of numbers in \[2, 60\]; widen"):
        countdown_multi(1, 0, max_value=60, min_solutions=1000, max_solutions=1000)
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == ["countdown_multi: 1000 draws of numbers found no target with 1000 to "
                        "1000 solutions; trying up to 1200"]


def test_registry_and_bad_arguments() -> None:
    assert task_options("countdown_multi")["num_numbers"] == 3
    with pytest.raises(ValueError, match="unknown option 'numbers'"):
        build_task("countdown_multi", 2, 0, numbers=3)
    with pytest.raises(ValueError, match="numbers must be a list of 1 to 4 non-negative ints"):
        countdown_solutions([1, 2, 3, 4, 5], 3)
    with pytest.raises(ValueError, match="numbers must be a list"):
        countdown_solutions([-1], 3)
    with pytest.raises(ValueError, match="target must be an int"):
        countdown_solutions([1, 2], 1.0)


def test_model_text_that_python_warns_about_is_read_without_a_warning():
    """"12in" or "2*8if" made ``ast.parse`` print "SyntaxWarning: invalid decimal literal"
    at every such completion (compile-time warnings are not deduplicated)."""
    import warnings

    from maxent_grpo.tasks.calculator import calculate
    from maxent_grpo.tasks.expressions import canonical_expression

    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        assert canonical_expression("12in") is None and canonical_expression("2*8if") is None
        assert canonical_expression("\\d + 1") is None  # a DeprecationWarning before
        for text in ("2*8if", "\\d + 1"):
            with pytest.raises(ValueError, match="unsupported characters"):
                calculate(text)
        assert calculate("12 * (3 + 4)") == "84" and canonical_expression("3 + 5") == "3 + 5"
    assert [str(w.message) for w in shown] == []

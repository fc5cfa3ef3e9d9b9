"""Built-in tasks: determinism, solvable countdown rows, a safe verifier, exact arithmetic."""

from __future__ import annotations

import ast
import doctest
import json
import re

import pytest

import maxent_grpo.tasks
import maxent_grpo.tasks.countdown
import maxent_grpo.tasks.digit_pairs as digit_pairs_module
import maxent_grpo.tasks.number_sets as number_sets_module
from maxent_grpo.tasks import TASKS, build_task, check_countdown, list_tasks, task_options


def test_docstring_examples() -> None:
    for module in (maxent_grpo.tasks, maxent_grpo.tasks.countdown, digit_pairs_module,
                   number_sets_module):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0


def test_registry_names_and_errors() -> None:
    assert list_tasks() == [
        "arithmetic", "arithmetic_easy", "countdown", "countdown_multi", "digit_pairs",
        "divisors", "number_sets", "tool_arithmetic",
    ]
    assert set(TASKS) == set(list_tasks())
    with pytest.raises(ValueError, match=r"'arithmetic'.*'countdown'.*got 'sudoku'"):
        build_task("sudoku", 3, 0)
    with pytest.raises(ValueError, match=r"unknown option 'num_digits'.*'digits'"):
        build_task("arithmetic", 3, 0, num_digits=2)
    assert task_options("countdown") == {
        "num_numbers": 4,
        "min_value": 1,
        "max_value": 20,
        "max_target": None,
    }


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("countdown", {"num_numbers": 1}, "num_numbers must be an int >= 2"),
        ("countdown", {"min_value": 5, "max_value": 4}, "max_value must be an int >= 5"),
        ("arithmetic", {"ops": "+/"}, "ops must be distinct characters from '\\+-\\*'"),
        ("arithmetic", {"ops": "++"}, "ops must be distinct"),
        ("arithmetic", {"digits": 0}, "digits must be an int >= 1"),
        ("arithmetic", {"num_operands": 1.5}, "num_operands must be an int"),
        ("digit_pairs", {"max_target": 19}, "max_target must be an int >= 5 and <= 18"),
        ("digit_pairs", {"min_target": 9, "max_target": 8}, "max_target must be an int >= 9"),
        ("digit_pairs", {"bare": "yes"}, "bare must be a bool"),
    ],
)
def test_bad_option_values(name: str, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_task(name, 2, 0, **options)


def test_bad_num_rows_and_seed() -> None:
    with pytest.raises(ValueError, match="num_rows must be an int >= 1"):
        build_task("countdown", 0, 0)
    with pytest.raises(ValueError, match="seed must be an int"):
        build_task("countdown", 2, "0")


def test_check_int_bounds_and_message() -> None:
    """The one int check of the package (tasks and options alike): both bounds, a bool
    refused, the message naming the option, its bounds and the value."""
    from maxent_grpo.validation import check_int

    check_int("x", 4, minimum=2, maximum=4)
    check_int("x", None, minimum=1, allow_none=True)
    for value in (1, 5, True, 3.0):
        with pytest.raises(ValueError) as err:
            check_int("x", value, minimum=2, maximum=4)
        assert str(err.value) == f"x must be an int >= 2 and <= 4; got {value!r}"
    with pytest.raises(ValueError, match=r"^x must be an int <= 4; got 9$"):
        check_int("x", 9, maximum=4)


@pytest.mark.parametrize("name", ["countdown", "arithmetic", "arithmetic_easy"])
def test_deterministic_from_seed(name: str) -> None:
    import random

    random.seed(123)  # the global state must not matter
    first = build_task(name, 20, seed=7)
    random.seed(456)
    assert build_task(name, 20, seed=7) == first
    assert build_task(name, 20, seed=8) != first
    assert build_task(name, 5, seed=7) == first[:5]  # a longer list extends a shorter one
    for row in first:
        assert isinstance(row["prompt"], str) and "<answer>" in row["prompt"]
        assert isinstance(row["answer"], str) and row["task"] == name


@pytest.mark.parametrize("num_numbers", [3, 4])
def test_countdown_rows_verify_with_their_own_answer(num_numbers: int) -> None:
    rows = build_task("countdown", 200, seed=1, num_numbers=num_numbers, min_value=1, max_value=9)
    for row in rows:
        numbers, target = row["numbers"], row["target"]
        assert len(numbers) == num_numbers and all(1 <= n <= 9 for n in numbers)
        assert isinstance(target, int) and target > 0
        assert target not in numbers  # it was on 6-11% of rows: the number alone scored 1
        assert check_countdown(row["answer"], numbers, target), row
        assert str(numbers) in row["prompt"] and str(target) in row["prompt"]
        # independent check: the answer's literals are exactly the numbers, and Python's
        # float evaluation of the answer agrees with the target
        literals = sorted(int(tok) for tok in re.findall(r"\d+", row["answer"]))
        assert literals == sorted(numbers)
        assert abs(eval(row["answer"]) - target) < 1e-9  # our own generated digits and ops


def test_a_countdown_problem_shown_in_another_order_is_held_out_of_training() -> None:
    """The holdout compared prompts, so 57 of the 128 validation problems of the countdown
    configs were training problems with their numbers reordered (a hunt of the tasks)."""
    from maxent_grpo.training.data.sources import task_sources

    options = {"num_numbers": 3, "max_target": 100}
    sources = task_sources("countdown", options, 2000, 64, 0, "prompt", True)
    problem = lambda r: (tuple(sorted(r["numbers"])), r["target"])  # noqa: E731
    held = {problem(r) for r in sources.val.rows}
    assert len(held) > 40 and not [r for r in sources.train.rows if problem(r) in held]
    every = task_sources("countdown", options, 2000, 64, 0, "prompt", False)
    assert len(every.train.rows) > len(sources.train.rows)  # there were some to drop
    # validation rows read from a CSV file hold text: the same problems, and their prompts
    from maxent_grpo.training.data.sources import SplitRows

    train = every.train.rows
    cells = [{"prompt": train[0]["prompt"], "numbers": "[1, 2]", "target": "3"},
             {"prompt": "mine", "numbers": json.dumps(train[1]["numbers"][::-1]),
              "target": str(train[1]["target"])}]
    read = task_sources("countdown", options, 2000, 64, 0, "prompt", True,
                        SplitRows.whole(cells, "val.csv"))
    assert [r for r in train if problem(r) in {problem(train[0]), problem(train[1])}] and not [
        r for r in read.train.rows if problem(r) in {problem(train[0]), problem(train[1])}]
    # the same for countdown_multi, whose rows list every answer
    multi = task_sources("countdown_multi", {}, 500, 32, 0, "prompt", True)
    held = {problem(r) for r in multi.val.rows}
    assert not [r for r in multi.train.rows if problem(r) in held]


def test_countdown_max_target() -> None:
    rows = build_task("countdown", 50, seed=3, max_target=30)
    assert all(0 < row["target"] <= 30 for row in rows)


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("(3 + 5) * 2", True),
        ("2 * (5 + 3)", True),
        (" 3*5+2 - 1 ", False),  # 1 is not given
        ("3 * 5 + 3 - 2", False),  # 3 used twice
        ("3 + 5", False),  # 8, not 16
        ("5 * 3 + 2 - 1", False),
        ("16", False),
        ("(5 - 5) / 2", False),  # 5 reused
        ("3 / (5 - 5)", False),
        ("-2 + 18", False),  # unary minus not allowed
        ("2 ** 4", False),
        ("2 // 1 * 8", False),
        ("2.0 * 8", False),
        ("True * 16", False),
        ("__import__('os')", False),
        ("__import__('os').system('echo hi')", False),
        ("1e308**9", False),
        ("(lambda: 16)()", False),
        ("", False),
        ("3 +", False),
        ("(" * 500 + "2" + ")" * 500, False),
        ("9" * 5000, False),
        ("2 +" * 400 + "2", False),  # over MAX_EXPRESSION_CHARS
        ("2+" * 300 + "2", False),  # parses, but 2 is given once
    ],
)
def test_check_countdown(expression: str, expected: bool) -> None:
    assert check_countdown(expression, [2, 3, 5], 16) is expected


def test_check_countdown_division_and_multiset() -> None:
    assert check_countdown("6 / 4 * 2", [6, 4, 2], 3)  # exact fractions: 1.5 * 2
    assert check_countdown("7 / (1 - 5 / 6)", [7, 1, 5, 6], 42)
    assert not check_countdown("1 / 3 * 3", [1, 3], 1)  # 3 needed twice
    assert check_countdown("1 / 3 * 3", [1, 3, 3], 1)  # now given twice
    assert not check_countdown("4 / (2 - 2)", [4, 2, 2], 1)  # division by zero


def test_check_countdown_rejects_bad_reference() -> None:
    with pytest.raises(ValueError, match="numbers must be a list of ints"):
        check_countdown("1", [1.0], 1)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="target must be an int"):
        check_countdown("1", [1], "1")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "options",
    [{}, {"digits": 1, "num_operands": 2, "ops": "+"}, {"digits": 3, "num_operands": 5}],
)
def test_arithmetic_answers_are_exact(options: dict) -> None:
    rows = build_task("arithmetic", 100, seed=2, **options)
    ops = options.get("ops", "+-*")
    for row in rows:
        expression = row["expression"]
        assert re.fullmatch(r"\d+( [" + re.escape(ops) + r"] \d+)*", expression)
        assert len(row["operands"]) == options.get("num_operands", 3)
        # independent exact evaluation: Python ints via ast on a digits-and-operators string
        assert int(row["answer"]) == eval(compile(ast.parse(expression, mode="eval"), "", "eval"))
        assert expression in row["prompt"]


def test_arithmetic_easy() -> None:
    rows = build_task("arithmetic_easy", 100, seed=0)
    for row in rows:
        a, b = row["operands"]
        assert 0 <= a <= 9 and 0 <= b <= 9
        assert row["expression"] == f"{a} + {b}" and row["answer"] == str(a + b)
        assert row["task"] == "arithmetic_easy"
    assert len({row["expression"] for row in rows}) > 30  # not degenerate


def test_arithmetic_digit_ranges() -> None:
    rows = build_task("arithmetic", 50, seed=4, digits=2)
    assert all(10 <= n <= 99 for row in rows for n in row["operands"])


def test_bare_arithmetic_prompt_is_the_expression_only():
    rows = build_task("arithmetic_easy", 5, 3, bare=True)
    for row in rows:
        assert row["prompt"] == f"{row['expression']} ="
        a, b = row["operands"]
        assert int(row["answer"]) == a + b
    with pytest.raises(ValueError, match="bare"):
        build_task("arithmetic", 1, 0, bare="yes")


def test_digit_pairs_answer_sets_are_complete_and_targets_cycle() -> None:
    from maxent_grpo.tasks.expressions import canonical_expression

    rows = build_task("digit_pairs", 27, 4, bare=True)
    for block in (rows[:9], rows[9:18], rows[18:]):  # every target once per 9 rows
        assert sorted(r["target"] for r in block) == list(range(5, 14))
    for row in rows:
        target = row["target"]
        brute = {canonical_expression(f"{a} + {b}") for a in range(10) for b in range(10)
                 if a + b == target}
        assert set(row["valid_answers"]) == brute  # every solution, in canonical form
        assert row["answer"] in row["valid_answers"] and row["prompt"] == f"? + ? = {target}"
        assert 3 <= len(row["valid_answers"]) <= 5
    assert build_task("digit_pairs", 27, 4, bare=True) == rows
    assert "<answer>" in build_task("digit_pairs", 1, 0)[0]["prompt"]


def test_ordered_digit_pairs_have_six_to_ten_answers_and_say_how_to_compare_them():
    from maxent_grpo.rewards import digit_pair_reward
    from maxent_grpo.rewards.answers import answer_key, canonical_answer

    rows = build_task("digit_pairs", 18, 0, bare=True, ordered=True)
    assert {r["target"] for r in rows} == set(range(5, 14))
    for row in rows:
        t, valid = row["target"], row["valid_answers"]
        assert len(valid) == min(t, 18 - t) + 1 >= 6 and row["answer_form"] == "ordered"
        assert row["task"] == "digit_pairs_ordered" and row["prompt"] == f"? + ? = {t}"
        assert digit_pair_reward([row["prompt"]] * len(valid), valid,
                                 target=[t] * len(valid)) == [1.0] * len(valid)
        assert len({canonical_answer(v, "ordered") for v in valid}) == len(valid)
    plain = build_task("digit_pairs", 1, 0, bare=True)[0]
    assert "answer_form" not in plain and plain["task"] == "digit_pairs"
    assert answer_key("4 + 5", "ordered") != answer_key("5+4", "ordered")
    assert answer_key("4 + 5", "ordered") == answer_key(" 4+5", "ordered") == "4+5"
    # read as the reward reads them: in math delimiters or with a last period, one answer
    wrapped = ["$4 + 5$", "\\(4+5\\)", "4 + 5.", "$$ 4 + 5 $$"]
    assert digit_pair_reward(["q"] * 4, wrapped, target=[9] * 4) == [1.0] * 4
    assert {answer_key(w, "ordered") for w in wrapped} == {"4+5"}
    with pytest.raises(ValueError, match="answer_form"):
        canonical_answer("1", "sorted")
    with pytest.raises(ValueError, match="ordered must be a bool"):
        build_task("digit_pairs", 1, 0, ordered="yes")


def test_number_sets_list_every_member_and_are_graded_by_the_first_integer():
    from maxent_grpo.rewards import in_set_reward
    from maxent_grpo.rewards.answers import answer_key

    rows = build_task("number_sets", 14, 3)
    assert sorted(r["set"] for r in rows[:7]) == sorted(number_sets_module.SETS)
    for row in rows:
        valid = row["valid_answers"]
        assert len(valid) >= 8 and row["answer_form"] == "first_number"
        assert row["answer"] in valid
        assert in_set_reward([row["prompt"]] * len(valid), [f" {v}, and" for v in valid],
                             valid_answers=[valid] * len(valid)) == [1.0] * len(valid)
    primes = number_sets_module.SETS["prime"][1]
    assert all(all(p % d for d in range(2, p)) for p in primes) and len(primes) == 8
    assert answer_key(" 7, 11", "first_number") == answer_key("7.", "first_number") == "7"
    assert in_set_reward(["q"], ["<answer>4</answer> 7"], valid_answers=[["7"]]) == [0.0]
    assert in_set_reward(["q"], ["7"], valid_answers=[None]) == [None]
    with pytest.raises(ValueError, match="sets must name"):
        build_task("number_sets", 1, 0, sets=["cubes"])
    # one name, not a list: its letters were taken as names (a hunt of the tasks)
    with pytest.raises(ValueError, match=r"sets must be a list of set names \(e.g. \[prime\]\); "
                                         "got 'prime'"):
        build_task("number_sets", 1, 0, sets="prime")


def test_divisors_list_every_proper_divisor_and_refuse_primes():
    from maxent_grpo.rewards import in_set_reward

    rows = build_task("divisors", 20, 1)
    numbers = number_sets_module.DIVISOR_NUMBERS
    assert sorted(r["number"] for r in rows[:10]) == sorted(numbers)  # each once per block
    for row in rows:
        n, valid = row["number"], row["valid_answers"]
        assert row["prompt"] == f"A divisor of {n}:" and row["answer"] in valid
        assert valid == [str(d) for d in range(2, n) if n % d == 0]  # neither 1 nor n
        assert 6 <= len(valid) <= 10 and row["answer_form"] == "first_number"
    row = rows[0]
    n = row["number"]
    graded = in_set_reward([row["prompt"]] * 4, [" 1", f" {n}", f" {row['answer']}.", " 7"],
                           valid_answers=[row["valid_answers"]] * 4)
    assert graded[:3] == [0.0, 0.0, 1.0] and graded[3] == float(n % 7 == 0)
    assert build_task("divisors", 3, 0, numbers=[15])[0]["valid_answers"] == ["3", "5"]
    with pytest.raises(ValueError, match="composite.*prime 13"):
        build_task("divisors", 1, 0, numbers=[12, 13])
    with pytest.raises(ValueError, match="numbers"):
        build_task("divisors", 1, 0, numbers=[2])
    with pytest.raises(ValueError, match=r"numbers must be a list of numbers \(e.g. \[36\]\); "
                                         "got 36"):  # a TypeError, "a bug in maxent_grpo"
        build_task("divisors", 1, 0, numbers=36)
    with pytest.raises(ValueError, match="distinct"):
        build_task("divisors", 1, 0, numbers=[12, 12])


def test_a_long_countdown_chain_from_a_deep_stack_is_no_answer_not_a_crash():
    """A 499-term chain (the most a 1000-character answer holds) evaluated where the stack is
    already deep raised RecursionError out of the reward; the canonical answer of the same
    text already fell back to None."""
    import sys

    from maxent_grpo.tasks.countdown import check_countdown

    chain = "+".join(["1"] * 499)
    limit = sys.getrecursionlimit()

    def deep(n: int) -> bool:
        return deep(n - 1) if n else check_countdown(chain, [1] * 499, 499)

    sys.setrecursionlimit(1000)
    try:
        assert deep(600) is False
    finally:
        sys.setrecursionlimit(limit)
    assert check_countdown(chain, [1] * 499, 499) is True  # from a shallow stack it is right


def test_rows_graded_by_first_number_compare_answers_by_first_number():
    """Bare arithmetic and tool_arithmetic rows are graded by ``first_number``, but had no
    ``answer_form``: " 8", " 8\\n3 +" and " 8. 4" counted as three answers in
    distinct_correct, answer_entropy and the answer-level objective."""
    from maxent_grpo.rewards.answers import canonical_answer
    from maxent_grpo.tasks.arithmetic import arithmetic, arithmetic_easy
    from maxent_grpo.tasks.calculator import tool_arithmetic

    for rows in (arithmetic(3, 0, bare=True), arithmetic_easy(3, 0, bare=True),
                 tool_arithmetic(3, 0)):
        assert {row["answer_form"] for row in rows} == {"first_number"}
    keys = {canonical_answer(c, "first_number") for c in (" 8", " 8\n3 +", " 8. 4", " 8 ")}
    assert keys == {"8"}


def test_the_question_copied_with_an_equals_sign_or_words_is_no_answer():
    """Only the bare copy scored 0.0: ``59 - 63 * 15 =``, ``= ?``, a word after it or before
    it scored 1.0 on the default task and reward (a fuzz of model-written text), and a
    spaced sum of 11 terms before a word took 41 s in one pattern match (minutes at 12,
    beyond a reward's timeout, which cannot stop a match)."""
    import signal

    from maxent_grpo.rewards.answers import accuracy_reward
    from maxent_grpo.tasks.expressions import unworked

    copies = ["59 - 63 * 15 =", "59 - 63 * 15 = ?", "= 59 - 63 * 15", "59 - 63 * 15 = x",
              "59 - 63 * 15 in total", "The answer is 59 - 63 * 15", "59 - 63 * 15 :",
              "59 - 63 * 15 = 59 - 63 * 15", "(59) - (63 * 15)", "59 - 63 x 15",
              # LaTeX layout, braces and powers of 1 around it scored 1.0 (a hunt)
              "{59 - 63 * 15}", "\\left(59 - 63 * 15\\right)", "\\displaystyle 59 - 63 * 15",
              "59 - 63 * 15 \\quad", "59 - 63 * 15 \\,", "59 - 63 * 15 \\text{ apples}",
              "\\text{}59 - 63 * 15", "59 - {63} * 15", "59 - 63 \\times{15}", "59 - 63 * 15^1",
              "59 - 63 ** 1 * 15", "The answer is $59 - 63 * 15$.",
              "\\(59 - 63 \\times 15\\) apples", "59 - 63 \\times 15 \\text{ (apples)}",
              # commands math-verify passes over scored 1.0 (a hunt: \sum; the fix: any name)
              "\\sum 59 - 63 * 15", "\\lim 59 - 63 * 15", "\\max(59 - 63 * 15)",
              "\\large 59 - 63 * 15", "59 - 63 * 15 \\nonumber", "\\cdot 59 - 63 * 15",
              "\\sum_{i} 59 - 63 * 15", "\\{59 - 63 \\cdot 15\\}", "\\phantom{0}59 - 63 * 15",
              "\\tag{1} 59 - 63 * 15", "59 - 63 * 15 \\tag*{2}", "\\label{eq:1}59 - 63 * 15",
              # the argument of any such command is no term (readers)
              "\\hspace{1em} 59 - 63 * 15", "\\vspace{2pt}59 - 63 * 15",
              "\\eqref{1} 59 - 63 * 15", "\\ref{1} 59 - 63 * 15", "\\hskip 2pt 59 - 63 * 15",
              "\\label{eq:{1}} 59 - 63 * 15", "\\kern3pt 59 - 63 * 15",
              "\\textcolor{red}{59 - 63 * 15}", "\\mkern 2mu 59 - 63 * 15"]
    worked = ["-886", "59 - 63 * 15 = -886", "59 - 63*15 = -886 apples", "-1772/2",
              "\\boxed{-886}", "It is -886.", "{-886}", "\\left(-886\\right)",
              "-886 \\text{ apples}", "59 - 63 * 15 = {-886}", "-8.86 \\times 10^2",
              "-\\sqrt{784996}",  # a function of one number is graded
              # a value given as = gives it (readers: 0.0 with command names left out)
              "59 - 63 \\cdot 15 \\approx -886", "59 - 63 \u00d7 15 \u2248 -886",
              "59 - 63 * 15 \\Rightarrow -886", "59 - 63 * 15 \\Longrightarrow -886",
              "59 - 63 * 15 \\to -886", "\\tag{1} -886", "\\hspace{1em} -886",
              "\\color{red} -886", "59 - 63 \\cdot 15 = \\space -886", "\\mspace{2mu} -886",
              "\\kern 2pt -886"]
    texts = copies + worked
    assert accuracy_reward(["q"] * len(texts), [f"<answer>{t}</answer>" for t in texts],
                           answer=["-886"] * len(texts)) == [0.0] * len(copies) + [1.0] * len(
                               worked)
    assert not unworked("- 1/2") and not unworked("(-886)") and not unworked("3 and 4")
    # a side of an = that starts with a number gives the value: GSM8K's forms (a reader
    # found these scored 0.0 with the first version of this check)
    given = ["3 * 6 = $18", "The total is 3 + 15 = $18", "3 * 6 = $18.00", "0.2 * 90 = 18%",
             "3 * 6 = 18 (dollars)", "6 + 12 = 18 [apples]", "3 * 6 = 18, which is it",
             "18 = 3 * 6", "3*6 = 18 = 18", "3 * 600 = 1,800"]
    assert accuracy_reward(["q"] * len(given), [f"<answer>{g}</answer>" for g in given],
                           answer=["18"] * (len(given) - 1) + ["1800"]) == [1.0] * len(given)
    assert all(unworked(c) for c in ("3 * 6 = x = ?", "3 * 6 ;", "3 * 6 #"))
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError("a hang")))
    signal.alarm(30)  # hours before; microseconds now: a hang fails here, not the suite
    try:
        assert unworked(" + ".join(["12"] * 14) + " cookies")
        assert not unworked(" + ".join(["12"] * 14) + " = 168 cookies")
        for long in ("\\text{" * 30000, "\\hspace{" * 30000, "\\label{{" * 20000,
                     "1" * 100000 + " * 10^", "\\left" * 30000,
                     "x =" + "\n" * 5000 + "?", "x =" + "\\," * 5000 + "?"):  # (readers: cubic)
            unworked(long)
    finally:
        signal.alarm(0)
    # a fraction or a power of numbers is a number; a product of powers a calculation (readers)
    numbers = ["\\frac{1}{2^5}", "(1/2)^5", "1/2^5", "\\frac{5^3}{2}", "10^3 \\times 1.5"]
    assert not any(unworked(n) for n in numbers) and unworked("2^2 \\cdot 3")


def test_arithmetic_answers_are_one_however_the_number_is_written():
    """Rows graded by accuracy had the expression form: ``-886`` (a unary minus is no
    expression), ``-886.0``, ``$-886$`` and ``59 - 63 * 15 = -886``, all graded right, were
    four distinct correct answers in distinct_correct and answer_entropy."""
    from maxent_grpo.rewards.answers import accuracy_reward, answer_key
    from maxent_grpo.tasks.arithmetic import arithmetic

    row = arithmetic(1, 0)[0]
    assert row["answer"] == "-886" and row["answer_form"] == "value"
    written = ["-886", "\u2212886", "-886.0", "$-886$", "59 - 63 * 15 = -886", "59 - 63*15"]
    completions = [f"<answer>{w}</answer>" for w in written]
    # the question copied, a calculation left undone, is no answer (it scored 1.0)
    assert accuracy_reward([row["prompt"]] * 6, completions, answer=[row["answer"]] * 6) == [
        1.0] * 5 + [0.0]
    assert {answer_key(c, "value") for c in completions} == {"-886"}
    assert answer_key("<answer>-885</answer>", "value") == "-885"
    assert answer_key("<answer>minus 886</answer>", "value") == "minus 886"  # as text
    # the default form: an expression is kept, a number that is no expression is its value
    assert {answer_key(f"<answer>{w}</answer>") for w in ("18", "$18", "18.00", "\\$18")} == {
        "18"}
    assert answer_key("<answer>3,717</answer>") == answer_key("<answer>3717</answer>")
    assert answer_key("<answer>2, 3</answer>") == "2,3"  # two numbers: no value, the text
    assert answer_key("<answer>4 + 5</answer>") == answer_key("<answer>5+4</answer>") == "4 + 5"
    assert answer_key("<answer>0.5</answer>") == answer_key("<answer>1/2</answer>") == "1 / 2"
    # Markdown's bold is no part of the answer, as the accuracy reward reads it
    assert answer_key("<answer>**72**</answer>") == answer_key("<answer>72</answer>") == "72"
    assert answer_key("The answer is **Paris**.") == "The answer is Paris."
    assert answer_key("<answer>.50</answer>") == "1 / 2"
    assert answer_key("<answer>+5</answer>") == "5"
    # a number too long to print as a key (a run of digits) is its text, not a crash
    long = "1" * 3000 + "." + "1" * 3000
    assert answer_key(f"<answer>{long}</answer>") == long
    # only numbers: an expression the form does not read stays text, not its value
    # ($...$ are the formula's delimiters: the expression, as written without them)
    assert answer_key("<answer>$5 * 3 + 1$</answer>") == answer_key(
        "<answer>5 * 3 + 1</answer>") == "1 + 3 * 5"


def test_number_sets_list_every_answer_their_prompts_admit():
    """"A multiple of 5 less than 50" and "A perfect square less than 100" admit 0 (and
    negative multiples), which their lists left out: right answers graded 0 and missing
    from coverage@k. Every prompt's list is every integer in its range with its property."""
    import math
    import re

    properties = {
        "prime": lambda n: n > 1 and all(n % d for d in range(2, n)),
        "even": lambda n: n % 2 == 0, "odd": lambda n: n % 2 == 1,
        "multiple_of_3": lambda n: n % 3 == 0, "multiple_of_5": lambda n: n % 5 == 0,
        "square": lambda n: n >= 0 and math.isqrt(n) ** 2 == n, "between_10_and_20": bool,
    }
    assert set(properties) == set(number_sets_module.SETS)
    for name, (prompt, members) in number_sets_module.SETS.items():
        between = re.search(r"between (\d+) and (\d+)", prompt)
        low, high = ((int(between[1]), int(between[2])) if between
                     else (0 if "positive" in prompt else -10**6,
                           int(re.search(r"less than (\d+)", prompt)[1])))
        admitted = [n for n in range(max(low + 1, -1000), high) if properties[name](n)]
        assert list(members) == admitted, (name, prompt)

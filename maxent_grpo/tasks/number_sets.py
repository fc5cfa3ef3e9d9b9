"""Number sets: name one member of a small set of integers; every prompt has 8 to 10 right
answers, all listed.

A prompt names a set (``"A prime number less than 20:"``) and a completion is right when its
first integer is a member (the ``in_set`` reward). The rows carry the whole set as
``valid_answers`` and ``answer_form: "first_number"``, so coverage@k and the answer
statistics compare the first integers of the samples (``"7, 11"`` and ``" 7."`` are one
answer). Written for a small pretrained model without a chat template: SmolLM2-135M-Instruct
names a member about 1 time in 5 at temperature 0.7 (measured in
``benchmarks/MAXENT_VS_GRPO.md``), so the task is partly solved at the start and its answer
spread can be watched. The tiny built-in model was never taught it.

``divisors`` asks the same way for arithmetic instead of a remembered list: ``"A divisor of
36:"``, right when the first integer is a proper divisor (neither 1 nor the number itself,
which the model can copy from the prompt): 6 to 10 answers per number. SmolLM2-135M names one
about 2 times in 5 at first (mean@8 0.40 and 0.43 on the study's seeds 0 and 1, task v of
``benchmarks/maxent_vs_grpo.py``; 0.16 to 0.59 per number).

>>> [len(s) for _, s in SETS.values()]
[8, 9, 10, 9, 9, 9, 9]
>>> row = number_sets(1, 0, sets=["prime"])[0]
>>> row["prompt"], row["valid_answers"][:4], row["answer_form"]
('A prime number less than 20:', ['2', '3', '5', '7'], 'first_number')
>>> row = divisors(1, 0, numbers=[36])[0]
>>> row["prompt"], row["valid_answers"]
('A divisor of 36:', ['2', '3', '4', '6', '9', '12', '18'])
"""

from __future__ import annotations

import random

from maxent_grpo.tasks.spec import in_blocks
from maxent_grpo.validation import check_int, require

#: name -> (prompt, members)
SETS: dict[str, tuple[str, tuple[int, ...]]] = {
    "prime": ("A prime number less than 20:", (2, 3, 5, 7, 11, 13, 17, 19)),
    "even": ("An even number between 1 and 19:", tuple(range(2, 19, 2))),
    "odd": ("An odd number between 0 and 20:", tuple(range(1, 20, 2))),
    "multiple_of_3": ("A multiple of 3 between 1 and 29:", tuple(range(3, 30, 3))),
    "multiple_of_5": ("A multiple of 5 between 1 and 49:", tuple(range(5, 50, 5))),
    "square": ("A positive perfect square less than 100:", tuple(n * n for n in range(1, 10))),
    "between_10_and_20": ("A number between 10 and 20:", tuple(range(11, 20))),
}


def number_sets(num_rows: int, seed: int, *, sets: list[str] | None = None) -> list[dict]:
    """``num_rows`` prompts from ``random.Random(seed)``: the chosen ``sets`` (default all of
    :data:`SETS`) in a fresh random order every ``len(sets)`` rows, so each block asks each
    set once.

    Each row: ``prompt``, ``answer`` (one member), ``task`` (``"number_sets"``), ``set``
    (its name), ``valid_answers`` (the members as strings, ascending) and ``answer_form``
    (``"first_number"``).
    """
    check_int("num_rows", num_rows, minimum=1)
    check_int("seed", seed, minimum=0)
    require(sets is None or isinstance(sets, (list, tuple)),
            f"sets must be a list of set names (e.g. [prime]); got {sets!r}")
    names = list(SETS) if sets is None else list(sets)
    unknown = [n for n in names if n not in SETS]
    if not names or unknown:
        raise ValueError(f"sets must name some of {', '.join(SETS)}; got {sets!r}")
    rng = random.Random(seed)
    rows: list[dict] = []
    for name in in_blocks(rng, names, num_rows):
        prompt, members = SETS[name]
        valid = [str(m) for m in members]
        rows.append({
            "prompt": prompt, "answer": rng.choice(valid), "task": "number_sets", "set": name,
            "valid_answers": valid, "answer_form": "first_number",
        })
    return rows


#: the numbers ``divisors`` asks about: 24 to 96, each with 6 to 10 proper divisors (all
#: even: ``2`` is right on every row, an answer a collapsing policy finds)
DIVISOR_NUMBERS = (24, 30, 36, 40, 48, 60, 72, 84, 90, 96)


def divisors(num_rows: int, seed: int, *, numbers: list[int] | None = None) -> list[dict]:
    """``num_rows`` prompts ``"A divisor of <n>:"`` from ``random.Random(seed)``, for the
    ``numbers`` (default :data:`DIVISOR_NUMBERS`; each a composite >= 4) in a fresh random
    order every ``len(numbers)`` rows.

    Each row: ``prompt``, ``answer`` (one proper divisor), ``task`` (``"divisors"``),
    ``number``, ``valid_answers`` (its divisors other than 1 and itself, as strings,
    ascending: the ``in_set`` reward reads them) and ``answer_form`` (``"first_number"``).
    """
    check_int("num_rows", num_rows, minimum=1)
    check_int("seed", seed, minimum=0)
    require(numbers is None or isinstance(numbers, (list, tuple)),
            f"numbers must be a list of numbers (e.g. [36]); got {numbers!r}")
    chosen = list(DIVISOR_NUMBERS if numbers is None else numbers)
    if not chosen or len(set(chosen)) != len(chosen):
        raise ValueError(f"numbers must name distinct numbers, at least one; got {numbers!r}")
    table: dict[int, list[str]] = {}
    for n in chosen:
        check_int("each of numbers", n, minimum=4)
        table[n] = [str(d) for d in range(2, n // 2 + 1) if n % d == 0]
        if not table[n]:
            raise ValueError(f"numbers must be composite (a divisor besides 1 and itself); "
                             f"got the prime {n}")
    rng = random.Random(seed)
    rows: list[dict] = []
    for n in in_blocks(rng, chosen, num_rows):
        valid = table[n]
        rows.append({
            "prompt": f"A divisor of {n}:", "answer": rng.choice(valid), "task": "divisors",
            "number": n, "valid_answers": valid, "answer_form": "first_number",
        })
    return rows

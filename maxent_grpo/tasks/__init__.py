"""Built-in prompt tasks, generated offline and deterministically from a seed.

Every task is a function ``task(num_rows, seed, **options) -> list[dict]`` drawing from its
own ``random.Random(seed)``. Each row holds at least ``prompt`` (the user message),
``answer`` (str) and ``task`` (its name), plus the task's own columns (``numbers``/``target``
for countdown, ...), which the reward functions receive as keyword columns.

>>> rows = build_task("arithmetic_easy", num_rows=2, seed=0)
>>> sorted(rows[0])
['answer', 'answer_form', 'expression', 'operands', 'prompt', 'task']
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from maxent_grpo.tasks import (
    arithmetic,
    calculator,
    countdown,
    digit_pairs,
    multi_answer,
    number_sets,
)
from maxent_grpo.tasks.countdown import check_countdown
from maxent_grpo.tasks.spec import ANSWER_INSTRUCTION

# The generator functions are reached through TASKS (or their modules), so that the names
# ``maxent_grpo.tasks.countdown`` / ``.arithmetic`` keep meaning the submodules.
TASKS: dict[str, Callable[..., list[dict]]] = {
    "arithmetic": arithmetic.arithmetic,
    "arithmetic_easy": arithmetic.arithmetic_easy,
    "countdown": countdown.countdown,
    "countdown_multi": multi_answer.countdown_multi,
    "digit_pairs": digit_pairs.digit_pairs,
    "divisors": number_sets.divisors,
    "number_sets": number_sets.number_sets,
    "tool_arithmetic": calculator.tool_arithmetic,
}


def list_tasks() -> list[str]:
    """Names of the built-in tasks, sorted."""
    return sorted(TASKS)


def task_options(name: str) -> dict[str, object]:
    """The options of task ``name`` and their defaults."""
    if name not in TASKS:
        raise ValueError(f"task must be one of {', '.join(map(repr, list_tasks()))}; got {name!r}")
    params = inspect.signature(TASKS[name]).parameters.values()
    return {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def build_task(name: str, num_rows: int, seed: int, **options: object) -> list[dict]:
    """Generate ``num_rows`` rows of task ``name`` from ``seed`` with the given options.

    Unknown task names and unknown options raise ``ValueError`` listing the allowed ones.
    """
    allowed = task_options(name)  # checks the name
    for key in options:
        if key not in allowed:
            raise ValueError(
                f"unknown option {key!r} for task {name!r}; allowed options: "
                f"{', '.join(map(repr, allowed)) or 'none'}"
            )
    return TASKS[name](num_rows, seed, **options)


__all__ = [
    "ANSWER_INSTRUCTION", "TASKS", "build_task", "check_countdown", "list_tasks", "task_options",
]

"""What every built-in task shares: the answer instruction, the range of a number of
``digits`` digits and the order of a closed task's prompts."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")

ANSWER_INSTRUCTION = (
    "Reason briefly inside <think> </think>, then give only the final answer inside "
    "<answer> </answer>."
)
"""Appended to every built-in prompt; matches the ``format`` and ``accuracy`` rewards."""


def digit_range(digits: int) -> tuple[int, int]:
    """The smallest and largest integer of exactly ``digits`` digits (``0`` has one)."""
    return (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1


def in_blocks(rng: random.Random, keys: Sequence[T], num_rows: int) -> Iterator[T]:
    """``num_rows`` of ``keys``, in a fresh order (``rng.sample``) every ``len(keys)`` rows,
    so each such block holds every key once; drawn lazily, between the caller's own draws."""
    order: list[T] = []
    for _ in range(num_rows):
        if not order:
            order = rng.sample(list(keys), len(keys))
        yield order.pop()

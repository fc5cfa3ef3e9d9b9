"""What every built-in task shares: the answer instruction and the argument checks."""

from __future__ import annotations

ANSWER_INSTRUCTION = (
    "Reason briefly inside <think> </think>, then give only the final answer inside "
    "<answer> </answer>."
)
"""Appended to every built-in prompt; matches the ``format`` and ``accuracy`` rewards."""


def check_int(name: str, value: object, *, minimum: int, maximum: int | None = None) -> None:
    """Raise ``ValueError`` unless ``value`` is an ``int`` (not ``bool``) in the closed range."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int; got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        upper = "" if maximum is None else f" and <= {maximum}"
        raise ValueError(f"{name} must be >= {minimum}{upper}; got {value}")

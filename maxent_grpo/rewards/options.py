"""The ``model.rewards`` option: reward names to weights, or to per-reward options
(:class:`RewardOptions`; an example: docs/REWARDS.md, "Per-reward options").

A key is a registered reward name, a ``package.module:function`` path, or
``model:<hub name or local folder>`` (a :class:`~maxent_grpo.rewards.reward_model.RewardModel`).
Every option is checked when the trainer is built; an error names the option.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from maxent_grpo.rewards.reward_model import DTYPES
from maxent_grpo.validation import (
    check_choice,
    check_int,
    check_number,
    check_seconds,
    is_number,
    require,
)

__all__ = ["MODEL_PREFIX", "RewardOptions", "parse_reward_options"]

MODEL_PREFIX = "model:"
_COMMON_KEYS = ("weight", "timeout", "fallback")
_MODEL_KEYS = ("batch_size", "dtype")
#: the reward whose options include ``buffer`` (DAPO's overlong shaping, ``rewards.shaping``)
OVERLONG = "overlong"


@dataclass(frozen=True)
class RewardOptions:
    """One entry of ``model.rewards``, checked.

    Attributes:
        name: the key as written (the reward's name in logs and in ``model.eval_reward``).
        weight: ``w_k`` of the total ``Σ_k w_k R_k``.
        timeout: seconds a call may take, or None (no limit).
        fallback: the value of every row when a call times out (None = not applicable);
            only used when ``has_fallback``.
        has_fallback: a fallback was given; without one a time-out stops the step.
        model: the reward model's hub name or folder (keys ``model:<...>``), else None.
        batch_size: rows per forward pass of a reward model.
        dtype: parameter dtype of a reward model.
        buffer: the ``overlong`` reward's ``L_cache`` (None: a quarter of
            ``max_completion_length``).
    """

    name: str
    weight: float = 1.0
    timeout: float | None = None
    fallback: float | None = None
    has_fallback: bool = False
    model: str | None = None
    batch_size: int = 32
    dtype: str = "float32"
    buffer: int | None = None


def parse_reward_options(rewards: Mapping[str, Any]) -> list[RewardOptions]:
    """Check ``model.rewards`` and return one :class:`RewardOptions` per entry, in order.

    >>> [o.weight for o in parse_reward_options({"format": 0.5, "accuracy": {"weight": 2}})]
    [0.5, 2.0]
    """
    example = (f" (e.g. {{{', '.join(f'{n!r}: 1.0' for n in rewards)}}})"
               if isinstance(rewards, (list, tuple)) and rewards else "")
    require(isinstance(rewards, Mapping), "model.rewards must map reward names to weights or "
            f"options; got {rewards!r}{example}")
    require(len(rewards) > 0, "model.rewards must name at least one reward function")
    options = [_entry(name, value) for name, value in rewards.items()]
    require(any(o.weight != 0 for o in options),
            "model.rewards: every weight is 0, so every sample's reward is 0 and nothing is "
            "learned; give at least one reward function a non-zero weight")
    return options


def _entry(name: Any, value: Any) -> RewardOptions:
    require(isinstance(name, str) and name.strip() != "",
            f"model.rewards keys must be non-empty reward names; got {name!r}" + (
                f" (a function is named by its import path, 'package.module:{name.__name__}'"
                f", or '__main__:{name.__name__}' in a script)" if callable(name)
                and hasattr(name, "__name__") else ""))
    where = f"model.rewards.{name}"
    model = None
    if name.startswith(MODEL_PREFIX):
        model = name[len(MODEL_PREFIX):].strip()
        require(model != "", f"{where}: 'model:' must be followed by a hub name or a folder "
                             "of a sequence-classification model")
    if not isinstance(value, Mapping):
        check_number(where, value)
        return RewardOptions(name=name, weight=float(value), model=model)
    allowed = _COMMON_KEYS + (_MODEL_KEYS if model is not None else ()) + (
        ("buffer",) if name == OVERLONG else ())
    for key in value:
        require(key in allowed, f"{where} has no option {key!r}; options: {', '.join(allowed)}"
                + (f" (a reward named package.module:function cannot be a dotted option: give "
                   f"--model.rewards '{{\"{name}.{key}\": ...}}')" if ":" in str(key) else ""))
    weight = value.get("weight", 1.0)
    check_number(f"{where}.weight", weight)
    timeout = value.get("timeout")
    check_seconds(f"{where}.timeout", timeout, allow_none=True)
    has_fallback = "fallback" in value
    require(model is None or (timeout is None and not has_fallback),
            f"{where}: a reward model takes no timeout or fallback; it runs in this process "
            "and a time-out cannot stop it (its thread would go on holding the device, and a "
            "process that exits while it runs aborts); leave timeout and fallback unset, and "
            "bound its cost with batch_size")
    fallback = value.get("fallback")
    require(fallback is None or is_number(fallback),
            f"{where}.fallback must be a finite number or null (not applicable); "
            f"got {fallback!r}")
    require(not has_fallback or timeout is not None,
            f"{where}.fallback is the value on a time-out, so it needs {where}.timeout")
    batch_size = value.get("batch_size", 32)
    check_int(f"{where}.batch_size", batch_size, minimum=1)
    dtype = value.get("dtype", "float32")
    check_choice(f"{where}.dtype", dtype, tuple(DTYPES))  # a list value: no TypeError
    buffer = value.get("buffer")
    check_int(f"{where}.buffer", buffer, minimum=1, allow_none=True)
    return RewardOptions(
        name=name, weight=float(weight), timeout=None if timeout is None else float(timeout),
        fallback=None if fallback is None else float(fallback), has_fallback=has_fallback,
        model=model, batch_size=batch_size, dtype=dtype, buffer=buffer,
    )

"""The reward registry: names (as written in configs) to reward functions.

A reward function (TRL's convention, :mod:`maxent_grpo.rewards.combine`) returns one value
per completion, ``None`` meaning "does not apply to this row"; it takes the arguments it
needs by name and must accept and ignore the rest through ``**kwargs``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from maxent_grpo.validation import UserCodeError

RewardFn = Callable[..., list]

REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator adding a function to :data:`REWARDS` under ``name``.

    A name already taken by another function raises ``ValueError`` (re-importing the same
    module, e.g. ``importlib.reload``, replaces the entry).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str; got {name!r}")

    def decorator(fn: RewardFn) -> RewardFn:
        if not callable(fn):
            raise ValueError(f"reward {name!r} must be callable; got {type(fn)!r}")
        old = REWARDS.get(name)
        reloaded = old is not None and (old.__module__, old.__qualname__) == (
            getattr(fn, "__module__", None),
            getattr(fn, "__qualname__", None),
        )
        if old is not None and old is not fn and not reloaded:
            raise ValueError(f"a reward named {name!r} is already registered")
        REWARDS[name] = fn
        return fn

    return decorator


def list_rewards() -> list[str]:
    """Registered reward names, sorted."""
    return sorted(REWARDS)


def get_reward(name_or_callable: str | RewardFn) -> RewardFn:
    """The reward function for a registered name, a ``"package.module:function"`` path, or a
    callable (returned unchanged).

    >>> get_reward("format").__name__
    'format_reward'
    """
    if callable(name_or_callable):
        return name_or_callable
    if not isinstance(name_or_callable, str):
        raise ValueError(
            f"reward must be a registered name, 'module:function' or a callable; "
            f"got {name_or_callable!r}"
        )
    if name_or_callable in REWARDS:
        return REWARDS[name_or_callable]
    if ":" in name_or_callable:
        module_name, _, attr = name_or_callable.partition(":")
        stem = module_name.removesuffix(".py").replace("\\", "/").rsplit("/", 1)[-1]
        if module_name.endswith(".py") or "/" in module_name.replace("\\", "/"):
            raise ValueError(f"reward {name_or_callable!r} names a file; give its module: "
                             f"'{stem}:{attr}' (a module {stem}.py in the working folder or on "
                             "PYTHONPATH; a package's as 'package.module:function')")
        if module_name.startswith("."):
            raise ValueError(f"reward {name_or_callable!r} is a relative path; give the whole "
                             "one, e.g. 'maxent_grpo.rewards.shaping:format_reward'")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"cannot import reward {name_or_callable!r}: {err}") from err
        except Exception as err:  # the module's own code failed: a SyntaxError, its raise
            raise UserCodeError(f"model.rewards: cannot import {name_or_callable!r}: importing "
                                f"{module_name!r} raised {type(err).__name__}: {err}") from err
        if not callable(fn):
            raise ValueError(f"reward {name_or_callable!r} is not callable")
        return fn
    raise ValueError(
        f"reward must be one of {', '.join(map(repr, list_rewards()))} or a "
        f"'module:function' path; got {name_or_callable!r}"
    )

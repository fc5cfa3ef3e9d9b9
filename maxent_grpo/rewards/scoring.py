"""Combining reward functions into one reward per completion (docs/ALGORITHM.md §1).

With ``K`` weighted reward functions and ``N`` completions (``N = B*G``, prompt-major):

    components[k, i] = R_k(i)                  (NaN where R_k returned None)
    total[i]         = Σ_k w_k · R_k(i)        over the k with R_k(i) not None

A row where every component is ``None`` gets ``total = 0.0`` (as TRL's ``nansum``); its
components stay NaN, so the logs show that nothing applied.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence

import torch

from maxent_grpo.rewards.registry import get_reward
from maxent_grpo.rollout.batch import PromptCompletionBatch


class RewardFunctionError(Exception):
    """A reward function raised, or returned something other than one finite number or None
    per completion. The message names the function; the original error is ``__cause__``."""


def _check_inputs(
    funcs: Sequence[tuple[str, Callable, float]],
    prompts: list,
    completions: list,
    columns: dict[str, list],
) -> None:
    if not funcs:
        raise ValueError("funcs must hold at least one (name, function, weight) triple")
    for entry in funcs:
        if not (isinstance(entry, tuple) and len(entry) == 3):
            raise ValueError(f"funcs must hold (name, function, weight) triples; got {entry!r}")
        name, fn, weight = entry
        if not callable(fn):
            raise ValueError(f"reward {name!r}: function must be callable; got {fn!r}")
        if (
            isinstance(weight, bool)
            or not isinstance(weight, numbers.Real)
            or not math.isfinite(weight)
        ):
            raise ValueError(f"reward {name!r}: weight must be a finite number; got {weight!r}")
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"prompts must have one entry per completion ({n}); got {len(prompts)}")
    for key, values in columns.items():
        if key in ("prompts", "completions"):
            raise ValueError(f"column {key!r} clashes with the reward argument of that name")
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise ValueError(
                f"column {key!r} must be a list with one value per completion ({n}); got {got}"
            )


def _call(
    k: int, name: str, fn: Callable, prompts: list, completions: list, columns: dict[str, list]
) -> list[float]:
    """Values of reward ``k`` as floats (NaN for None), checked."""
    label = f"reward function {name!r} (#{k})"
    try:
        values = fn(prompts=prompts, completions=completions, **columns)
    except Exception as err:
        raise RewardFunctionError(f"{label} raised {type(err).__name__}: {err}") from err
    n = len(completions)
    if not isinstance(values, (list, tuple)):
        raise RewardFunctionError(
            f"{label} must return a list of {n} values; got {type(values).__name__}"
        )
    if len(values) != n:
        raise RewardFunctionError(f"{label} returned {len(values)} values; expected {n}")
    out: list[float] = []
    for i, value in enumerate(values):
        if value is None:
            out.append(math.nan)
            continue
        if not isinstance(value, numbers.Real):
            raise RewardFunctionError(
                f"{label} returned a non-numeric value at row {i}: {value!r:.80} "
                "(use a float, or None for 'not applicable')"
            )
        if not math.isfinite(value):
            raise RewardFunctionError(
                f"{label} returned a non-finite value at row {i}: {value!r} "
                "(use None for 'not applicable')"
            )
        out.append(float(value))
    return out


def score_completions(
    funcs: Sequence[tuple[str, Callable, float]],
    prompts: list,
    completions: list,
    columns: dict[str, list],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Score ``N`` completions with ``K`` weighted reward functions.

    ``funcs`` holds ``(name, function, weight)``; each function is called as
    ``fn(prompts=prompts, completions=completions, **columns)`` (the TRL convention) with
    ``columns`` mapping each dataset column to its ``N`` per-completion values.

    Returns ``(total, components)``: ``total`` float32 ``(N,)`` is the weighted sum skipping
    ``None`` (a row with no applicable reward gets 0.0); ``components`` float32 ``(K, N)``
    holds the raw values with NaN for ``None``.

    >>> total, comps = score_completions(
    ...     [("a", lambda prompts, completions, **kw: [1.0, None], 2.0),
    ...      ("b", lambda prompts, completions, **kw: [0.5, 1.0], 1.0)],
    ...     ["p", "p"], ["x", "y"], {})
    >>> total.tolist()
    [2.5, 1.0]
    """
    _check_inputs(funcs, prompts, completions, columns)
    rows = [
        _call(k, name, fn, prompts, completions, columns) for k, (name, fn, _) in enumerate(funcs)
    ]
    components = torch.tensor(rows, dtype=torch.float64).reshape(len(funcs), len(completions))
    weights = torch.tensor([float(w) for _, _, w in funcs], dtype=torch.float64)  # (K,)
    total = torch.nansum(weights[:, None] * components, dim=0)  # (N,); NaN·w stays NaN
    return total.float(), components.float()


class WeightedRewards:
    """The trainer's reward: ``{name: weight}`` (``model.rewards``) resolved once.

    Names are registered rewards or ``package.module:function`` paths
    (:func:`~maxent_grpo.rewards.registry.get_reward`); weights must be finite. Called on the
    flat prompt/completion pairs of ``B`` prompts x ``G`` completions, with the dataset's
    other columns given once per prompt (they are repeated per completion here).
    """

    def __init__(self, rewards: dict[str, float]) -> None:
        if not rewards:
            raise ValueError("model.rewards must name at least one reward function")
        self.names = list(rewards)
        self.weights = [float(w) for w in rewards.values()]
        for name, weight in zip(self.names, self.weights, strict=True):
            if not math.isfinite(weight):
                raise ValueError(f"model.rewards: the weight of {name!r} must be finite; "
                                 f"got {weight}")
        try:
            self.funcs = [get_reward(name) for name in self.names]
        except ValueError as err:
            raise ValueError(f"model.rewards: {err}") from err

    def __call__(
        self, pairs: PromptCompletionBatch, columns: dict[str, list], group_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(total (B*G,), components (K, B*G))`` of :func:`score_completions`;
        ``columns`` hold one value per prompt."""
        per_row = {k: [v for v in vals for _ in range(group_size)] for k, vals in columns.items()}
        funcs = list(zip(self.names, self.funcs, self.weights, strict=True))
        return score_completions(funcs, pairs.prompts, pairs.completions, per_row)

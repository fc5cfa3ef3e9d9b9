"""Training metrics as torchmetrics ``Metric`` classes whose states are sums, minima and maxima.

Every state is reduced across ranks with ``dist_reduce_fx`` "sum", "min" or "max", and a
micro-batch update only adds to those states, so a value computed after any number of
updates on any number of ranks equals the value computed once over all the data (never an
average of averages).

Shape vocabulary: B prompts, G generations per prompt, N = B*G sequences (prompt-major rows),
P prompt tokens, T completion tokens, K reward functions.

Conventions:

* Floating-point states are float64 and counters are int64, so sums of many micro-batches
  stay exact to float64 rounding. ``compute()`` returns 0-d float64 tensors.
* A metric that has seen no data computes NaN for every mean, std, min, max and fraction
  (and 0 for plain token sums); it does not raise.
* ``module.to(torch.bfloat16)`` (what Lightning's "bf16-true"/"16-true" precision does)
  casts float64 metric states too. ``update`` casts a state back quietly while it holds no
  data, and raises RuntimeError rather than sum in low precision once it had accumulated
  data before the cast; call ``metric.set_dtype(torch.float64)`` after such a cast.

:func:`all_gather_objects` is the one gather of picklable values over the ranks (the step's
metric names, checkpoint states, evaluation records).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.aggregation import MeanMetric

from maxent_grpo.core import constant_groups
from maxent_grpo.training.types import RewardComponentStats, RewardMoments, TokenUsageStats

__all__ = [
    "all_gather_objects",
    "RewardComponentsMetric",
    "RewardMomentsMetric",
    "TokenMean",
    "TokenUsageMetric",
    "divide_or_nan",
    "mean_std_from_sums",
]


def all_gather_objects(value: Any) -> list[Any]:
    """``[value of rank 0, rank 1, ...]`` over the default process group
    (``all_gather_object``); ``[value]`` without a process group or with one process."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, value)
        return out
    return [value]

_INT64_MAX = torch.iinfo(torch.int64).max


def divide_or_nan(numerator: Tensor, denominator: Tensor) -> Tensor:
    """``numerator / denominator`` in float64 (broadcast like ``torch.div``), NaN wherever
    ``denominator == 0``."""
    den = denominator.to(torch.float64)
    quotient = numerator.to(torch.float64) / den
    return torch.where(den != 0, quotient, torch.full_like(quotient, math.nan))


def mean_std_from_sums(total: Tensor, total_sq: Tensor, count: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and unbiased (ddof=1) standard deviation from ``sum x``, ``sum x^2`` and ``n``.

    ``mean = S1 / n`` and ``std = sqrt((S2 - S1^2 / n) / (n - 1))``, elementwise in float64
    (rounding's tiny negative variances clamped to 0); NaN where ``n == 0`` / ``n < 2``.
    """
    s1 = total.to(torch.float64)
    s2 = total_sq.to(torch.float64)
    n = count.to(torch.float64)
    mean = divide_or_nan(s1, n)
    centered = (s2 - torch.where(n > 0, s1 * mean, torch.zeros_like(s1))).clamp(min=0.0)
    var = divide_or_nan(centered, torch.where(n >= 2, n - 1, torch.zeros_like(n)))
    return mean, var.sqrt()


def _check_float64_states(metric: Metric, names: tuple[str, ...]) -> None:
    """Keep the float states float64 under a module-wide ``.to(dtype)`` cast (such as
    ``trainer.precision: bf16-true``): a state with no data yet (0 or +-inf, exact in every
    float dtype) is upcast back; one cast after it had accumulated data raises RuntimeError.
    """
    for name in names:
        state = getattr(metric, name)
        if state.dtype == torch.float64:
            continue
        if metric.update_count <= 1:  # this update is the first since reset
            setattr(metric, name, state.to(torch.float64))
            continue
        raise RuntimeError(
            f"{type(metric).__name__} state {name!r} is {state.dtype}, not torch.float64: a "
            "module-wide .to(dtype) cast it after it had accumulated data"
        )


def _check_tensor(name: str, value: Any, dtype: Literal["bool", "real"],
                  dims: int | None = None) -> None:
    """``value`` is a tensor (of ``dims`` dimensions when given), bool or real per ``dtype``."""
    if not isinstance(value, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor; got {type(value).__name__}")
    if dims is not None and value.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions; got shape {tuple(value.shape)}")
    if dtype == "real":
        _check_real(name, value)
    elif value.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor; got dtype {value.dtype}")


def _check_real(name: str, value: Tensor) -> None:
    if value.dtype == torch.bool or value.is_complex():
        raise ValueError(f"{name} must be a real floating or integer tensor; got {value.dtype}")


def _as_scalar(name: str, value: Tensor | float, device: torch.device) -> Tensor:
    if isinstance(value, Tensor):
        if value.dim() != 0:
            raise ValueError(f"{name} must be a 0-d tensor or a number; got {tuple(value.shape)}")
        _check_real(name, value)
        return value.detach().to(device=device, dtype=torch.float64)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a 0-d tensor or a number; got {type(value).__name__}")
    return torch.tensor(float(value), dtype=torch.float64, device=device)


def _float64(value: float, device: torch.device | None = None) -> Tensor:
    return torch.tensor(value, dtype=torch.float64, device=device)


def _int64(value: int) -> Tensor:
    return torch.tensor(value, dtype=torch.int64)


class RewardMomentsMetric(Metric):
    """Moments of the total sequence reward over every (prompt, generation) seen.

    ``update(rewards)`` takes the (B, G) total rewards of one micro-batch. ``compute()``
    returns 0-d float64 tensors:

    * ``mean``: ``sum r / n`` over all n rewards seen;
    * ``std``: unbiased (ddof=1) std over all n rewards pooled; NaN when n < 2;
    * ``min``, ``max``: extreme rewards;
    * ``zero_std_frac``: fraction of groups whose G rewards are all exactly equal.

    All are NaN before any data.
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = True

    _FLOAT_STATES = ("total", "total_sq", "min_value", "max_value")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("total", _float64(0.0), dist_reduce_fx="sum")
        self.add_state("total_sq", _float64(0.0), dist_reduce_fx="sum")
        self.add_state("count", _int64(0), dist_reduce_fx="sum")
        self.add_state("min_value", _float64(math.inf), dist_reduce_fx="min")
        self.add_state("max_value", _float64(-math.inf), dist_reduce_fx="max")
        self.add_state("num_groups", _int64(0), dist_reduce_fx="sum")
        self.add_state("num_constant_groups", _int64(0), dist_reduce_fx="sum")

    def update(self, rewards: Tensor) -> None:
        """Add one micro-batch of total rewards, shape (B, G); values must be finite."""
        _check_tensor("rewards", rewards, "real", dims=2)
        _check_float64_states(self, self._FLOAT_STATES)
        if rewards.shape[1] == 0:
            raise ValueError(f"rewards must have G >= 1 per group; got {tuple(rewards.shape)}")
        if rewards.shape[0] == 0:
            return
        r = rewards.detach().to(device=self.total.device, dtype=torch.float64)  # (B, G)
        if not bool(torch.isfinite(r).all()):
            raise ValueError("rewards must be finite (no NaN or inf)")
        self.total += r.sum()
        self.total_sq += (r * r).sum()
        self.count += r.numel()
        self.min_value = torch.minimum(self.min_value, r.min())
        self.max_value = torch.maximum(self.max_value, r.max())
        self.num_groups += r.shape[0]
        self.num_constant_groups += constant_groups(r).sum()

    def compute(self) -> dict[str, Tensor]:
        """``{"mean", "std", "min", "max", "zero_std_frac"}`` as 0-d float64 tensors."""
        mean, std = mean_std_from_sums(self.total, self.total_sq, self.count)
        seen = self.count > 0
        nan = torch.full_like(self.min_value, math.nan)
        return {
            "mean": mean,
            "std": std,
            "min": torch.where(seen, self.min_value, nan),
            "max": torch.where(seen, self.max_value, nan),
            "zero_std_frac": divide_or_nan(self.num_constant_groups, self.num_groups),
        }

    def summary(self) -> RewardMoments:
        """The :class:`maxent_grpo.training.types.RewardMoments` (mean, std) of :meth:`compute`."""
        values = self.compute()
        return RewardMoments(mean=float(values["mean"]), std=float(values["std"]))


class RewardComponentsMetric(Metric):
    """Mean and std of each reward function's values, skipping "not applicable" entries.

    ``update(components)`` takes a (K, N) tensor: row k holds reward function ``names[k]``
    on the N sequences of a micro-batch, NaN where the function does not apply to that
    sequence (it is then left out of that component's count). ``compute()`` returns
    ``{f"{name}/mean", f"{name}/std"}`` per component (0-d float64; std unbiased, ddof=1,
    over the component's applicable values); NaN where a component has too few values.
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = True

    _FLOAT_STATES = ("total", "total_sq")

    def __init__(self, names: list[str], **kwargs: Any) -> None:
        if not isinstance(names, (list, tuple)) or len(names) == 0:
            raise ValueError(f"names must be a non-empty list of reward names; got {names!r}")
        if any(not isinstance(name, str) or not name for name in names):
            raise ValueError(f"names must contain only non-empty strings; got {names!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"names must be unique; got {names!r}")
        super().__init__(**kwargs)
        self.names = list(names)
        k = len(self.names)
        self.add_state("total", torch.zeros(k, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total_sq", torch.zeros(k, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros(k, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, components: Tensor) -> None:
        """Add a (K, N) micro-batch of per-function rewards; NaN = not applicable, inf rejected."""
        _check_tensor("components", components, "real", dims=2)
        if components.shape[0] != len(self.names):
            raise ValueError(
                f"components must have one row per name ({len(self.names)}: {self.names}); "
                f"got shape {tuple(components.shape)}"
            )
        _check_float64_states(self, self._FLOAT_STATES)
        x = components.detach().to(device=self.total.device, dtype=torch.float64)  # (K, N)
        if bool(torch.isinf(x).any()):
            raise ValueError("components must be finite or NaN (not applicable); got inf")
        applies = ~torch.isnan(x)  # (K, N)
        x = torch.where(applies, x, torch.zeros_like(x))
        self.total += x.sum(dim=1)
        self.total_sq += (x * x).sum(dim=1)
        self.count += applies.sum(dim=1)

    def compute(self) -> dict[str, Tensor]:
        """``{f"{name}/mean", f"{name}/std"}`` for every name, 0-d float64 tensors."""
        mean, std = mean_std_from_sums(self.total, self.total_sq, self.count)  # (K,), (K,)
        return {f"{name}/{stat}": values[k] for k, name in enumerate(self.names)
                for stat, values in (("mean", mean), ("std", std))}

    def summaries(self) -> dict[str, RewardComponentStats]:
        """``{name: RewardComponentStats(mean, std)}`` from :meth:`compute`."""
        values = self.compute()
        return {
            name: RewardComponentStats(
                mean=float(values[f"{name}/mean"]), std=float(values[f"{name}/std"])
            )
            for name in self.names
        }


class TokenUsageMetric(Metric):
    """Prompt and completion token counts, completion lengths and the truncation rate.

    ``update(prompt_mask, completion_mask, truncated)`` takes bool masks (N, P) and (N, T)
    of real (non-padding) tokens and an (N,) bool flag for completions cut at the length
    limit. ``compute()`` returns 0-d float64 tensors:

    * ``prompt_tokens``, ``completion_tokens``: total real tokens (0 before any data);
    * ``completion_length/mean``: ``completion_tokens / N``; ``/min``, ``/max`` over rows;
    * ``truncated_frac``: truncated rows / N.

    Means, extremes and the fraction are NaN before any row is seen.
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("prompt_tokens", _int64(0), dist_reduce_fx="sum")
        self.add_state("completion_tokens", _int64(0), dist_reduce_fx="sum")
        self.add_state("num_sequences", _int64(0), dist_reduce_fx="sum")
        self.add_state("num_truncated", _int64(0), dist_reduce_fx="sum")
        self.add_state("min_length", _int64(_INT64_MAX), dist_reduce_fx="min")
        self.add_state("max_length", _int64(0), dist_reduce_fx="max")

    def update(self, prompt_mask: Tensor, completion_mask: Tensor, truncated: Tensor) -> None:
        """Add N rows: ``prompt_mask`` (N, P), ``completion_mask`` (N, T), ``truncated`` (N,)."""
        _check_tensor("prompt_mask", prompt_mask, "bool", dims=2)
        _check_tensor("completion_mask", completion_mask, "bool", dims=2)
        _check_tensor("truncated", truncated, "bool", dims=1)
        n = prompt_mask.shape[0]
        if completion_mask.shape[0] != n or truncated.shape[0] != n:
            raise ValueError(
                "prompt_mask, completion_mask and truncated must have the same number of rows N; "
                f"got {prompt_mask.shape[0]}, {completion_mask.shape[0]} and {truncated.shape[0]}"
            )
        if n == 0:
            return
        device = self.num_sequences.device
        lengths = completion_mask.to(device).sum(dim=1)  # (N,) int64
        self.prompt_tokens += prompt_mask.to(device).sum()
        self.completion_tokens += lengths.sum()
        self.num_sequences += n
        self.num_truncated += truncated.to(device).sum()
        self.min_length = torch.minimum(self.min_length, lengths.min())
        self.max_length = torch.maximum(self.max_length, lengths.max())

    def compute(self) -> dict[str, Tensor]:
        """Token totals, completion-length mean/min/max and ``truncated_frac`` (0-d float64)."""
        seen = self.num_sequences > 0
        nan = _float64(math.nan, device=self.num_sequences.device)
        return {
            "prompt_tokens": self.prompt_tokens.to(torch.float64),
            "completion_tokens": self.completion_tokens.to(torch.float64),
            "completion_length/mean": divide_or_nan(self.completion_tokens, self.num_sequences),
            "completion_length/min": torch.where(seen, self.min_length.to(torch.float64), nan),
            "completion_length/max": torch.where(seen, self.max_length.to(torch.float64), nan),
            "truncated_frac": divide_or_nan(self.num_truncated, self.num_sequences),
        }

    def summary(self) -> TokenUsageStats:
        """:class:`TokenUsageStats`; ``num_input_tokens = prompt_tokens + completion_tokens``,
        the tokens of the teacher-forced forward pass that the loss reads (a multi-turn
        rollout's tool messages are scored as context but not counted:
        ``train/tools/message_tokens_per_sample`` counts them)."""
        values = self.compute()
        return TokenUsageStats(
            avg_completion_tokens=float(values["completion_length/mean"]),
            num_completion_tokens=float(values["completion_tokens"]),
            num_input_tokens=float(values["prompt_tokens"] + values["completion_tokens"]),
        )


class TokenMean(MeanMetric):
    """Weighted mean ``sum(value * weight) / sum(weight)``: torchmetrics' ``MeanMetric``
    states (``mean_value`` the weighted sum, ``weight`` the weights) in float64. The sums
    are added here, not by ``MeanMetric.update``: its ``nan_strategy="disable"`` drops the
    weights (torchmetrics 1.9) and its other strategies sync the host at each update.

    Given per-token values, e.g. (N, T), and the bool mask of real tokens, the result is
    the mean over every real token seen, on every rank and micro-batch. Values under a
    False mask are ignored even if they are NaN or inf. ``compute()`` returns a 0-d
    float64 tensor, NaN while the total weight is 0.
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    _FLOAT_STATES = ("mean_value", "weight")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.set_dtype(torch.float64)

    def update(
        self, values: Tensor, mask: Tensor | None = None, count: Tensor | float | None = None
    ) -> None:
        """Add ``values`` (any shape) over the True entries of ``mask`` (same shape, bool).

        ``mask=None`` counts every entry. With ``count`` given, ``values`` is a precomputed
        ``sum(value * weight)`` and ``count`` its ``sum(weight)`` (0-d or numbers); a numeric
        ``count`` must be >= 0 (a tensor one is not checked: no device sync).
        """
        _check_float64_states(self, self._FLOAT_STATES)
        if count is not None:
            device = self.mean_value.device
            total_t, count_t = _as_scalar("total", values, device), _as_scalar("count", count,
                                                                             device)
            if not isinstance(count, Tensor) and count < 0:
                raise ValueError(f"count must be >= 0; got {count}")
            self.mean_value += total_t
            self.weight += count_t
            return
        _check_tensor("values", values, "real")
        v = values.detach().to(device=self.mean_value.device, dtype=torch.float64)
        if mask is None:
            self.mean_value += v.sum()
            self.weight += v.numel()
            return
        _check_tensor("mask", mask, "bool")
        if mask.shape != values.shape:
            raise ValueError(
                f"mask must have the shape of values {tuple(values.shape)}; got {tuple(mask.shape)}"
            )
        m = mask.to(self.mean_value.device)
        self.mean_value += torch.where(m, v, torch.zeros_like(v)).sum()
        self.weight += m.sum()

    def compute(self) -> Tensor:
        """``mean_value / weight`` as a 0-d float64 tensor; NaN when ``weight == 0``."""
        return divide_or_nan(self.mean_value, self.weight)

"""Logging data of a training step: scalar bundles, their flat views and the writer protocol.

Their values are already reduced over micro-batches and ranks.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "LogStepArtifacts",
    "LoggingConfigView",
    "LossScalarBundle",
    "MetricWriter",
    "TokenUsageStats",
    "TrainingScalarStats",
]


@dataclass
class TokenUsageStats:
    """Token counts of one optimizer step (all three must be >= 0).

    Attributes:
        avg_completion_tokens: mean completion length ``mean_i T_i`` over the B*G rows.
        num_completion_tokens: total completion tokens ``sum_i T_i`` (all ranks).
        num_input_tokens: total tokens fed to the model (prompt + completion, all ranks).
    """

    avg_completion_tokens: float
    num_completion_tokens: float
    num_input_tokens: float

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value < 0:
                raise ValueError(f"{f.name} must be >= 0; got {value}")

    def as_dict(self) -> dict[str, float]:
        """The logged names: ``completion_length/mean``, ``completion_tokens``,
        ``input_tokens``."""
        return {"completion_length/mean": self.avg_completion_tokens,
                "completion_tokens": self.num_completion_tokens,
                "input_tokens": self.num_input_tokens}


@dataclass
class TrainingScalarStats:
    """Step-level scalars that are not losses: reference log-prob, tokens, lr, entropy.

    Attributes:
        ref_logp_mean: mean reference log-prob per completion token (NaN: not measured).
        tokens: the step's :class:`TokenUsageStats`.
        current_lr: the learning rate used for this step (NaN: the update was skipped).
        policy_entropy: mean token entropy of the policy, if computed.
    """

    ref_logp_mean: float
    tokens: TokenUsageStats
    current_lr: float
    policy_entropy: float | None = None

    def as_dict(self) -> dict[str, float | None]:
        """``logp/ref_token``, ``lr``, ``entropy`` and ``tokens/<name>`` (see
        :meth:`TokenUsageStats.as_dict`); values not measured (None, NaN) are left out."""
        out: dict[str, float | None] = {
            "logp/ref_token": self.ref_logp_mean, "lr": self.current_lr,
            "entropy": self.policy_entropy,
        }
        out.update({f"tokens/{k}": v for k, v in self.tokens.as_dict().items()})
        return {k: v for k, v in out.items() if v is not None and not math.isnan(v)}


@dataclass
class LossScalarBundle:
    """Scalar values of the loss terms of one optimizer step (detached floats).

    Attributes:
        total_loss: the optimised loss.
        policy_loss: the policy (surrogate or listwise cross-entropy) term.
        clip_loss: the sequence-level clip term, or ``None`` when the objective has none.
        kl_loss: the token-mean KL to the reference (unweighted).
        weighted_kl_loss: ``beta * kl_loss``, the KL term as it enters ``total_loss``.
    """

    total_loss: float
    policy_loss: float
    clip_loss: float | None
    kl_loss: float
    weighted_kl_loss: float

    def as_dict(self) -> dict[str, float | None]:
        """All five fields by name, in field order; ``clip_loss`` may be ``None``."""
        return asdict(self)


def _scalar(key: str, value: Any) -> float:
    """``value`` as a Python float; a one-element tensor is read with ``.item()``."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{key} must be a scalar; got a tensor of shape {tuple(value.shape)}")
        return float(value.detach().item())
    if isinstance(value, numbers.Real):
        return float(value)
    raise ValueError(f"{key} must be a real number or a one-element tensor; got {value!r}")


@dataclass
class LogStepArtifacts:
    """Everything the logger needs from one optimizer step, with a flat scalar view.

    Attributes:
        loss_outputs: a :class:`LossScalarBundle` or a mapping ``name -> scalar``.
        diagnostics: mapping ``name -> scalar`` (nested mappings allowed), keys already
            namespaced (``"clip/low_frac"``).
        grad_norm_scalar: total gradient norm, or ``None`` if not measured.
        epoch_progress: fractional epoch (``batch_idx / batches per epoch``).
        scalars: the step's :class:`TrainingScalarStats`, or None.
    """

    loss_outputs: LossScalarBundle | Mapping[str, Any]
    diagnostics: Mapping[str, Any]
    grad_norm_scalar: float | None
    epoch_progress: float
    scalars: TrainingScalarStats | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.loss_outputs, LossScalarBundle | Mapping):
            raise TypeError(
                "loss_outputs must be a LossScalarBundle or a mapping; "
                f"got {type(self.loss_outputs).__name__}"
            )
        if not isinstance(self.diagnostics, Mapping):
            raise TypeError(f"diagnostics must be a mapping; got {type(self.diagnostics).__name__}")

    def as_dict(self) -> dict[str, Any]:
        """One flat ``{key: float}`` dict; entries whose value is ``None`` are left out.

        Keys:
            - ``"loss/<name>"`` for each loss output, with a trailing ``"_loss"`` removed
              (``loss/total``, ...);
            - the keys of :meth:`TrainingScalarStats.as_dict` (``lr``, ``tokens/...``);
            - each diagnostics key unchanged; a nested mapping is joined with ``"/"``
              (``{"clip": {"low_frac": x}}`` -> ``"clip/low_frac"``);
            - ``"grad_norm"`` and ``"epoch_progress"``.

        Values are Python floats (one-element tensors are read with ``.item()``). A key
        produced twice raises ValueError; a non-scalar value raises ValueError naming it.
        """
        out: dict[str, Any] = {}

        def put(key: str, value: Any) -> None:
            if value is None:
                return
            if key in out:
                raise ValueError(f"LogStepArtifacts.as_dict: key {key!r} is produced twice")
            out[key] = _scalar(key, value)

        losses = self.loss_outputs
        loss_items = losses.as_dict() if isinstance(losses, LossScalarBundle) else losses
        for name, value in loss_items.items():
            put("loss/" + name.removesuffix("_loss"), value)

        def walk(prefix: str, mapping: Mapping[str, Any]) -> None:
            for name, value in mapping.items():
                key = f"{prefix}/{name}" if prefix else str(name)
                if isinstance(value, Mapping):
                    walk(key, value)
                else:
                    put(key, value)

        if self.scalars is not None:
            for key, value in self.scalars.as_dict().items():
                put(key, value)
        walk("", self.diagnostics)
        put("grad_norm", self.grad_norm_scalar)
        put("epoch_progress", self.epoch_progress)
        return out


@dataclass
class LoggingConfigView:
    """The configuration the logger reads to label and gate metrics (a read-only view).

    Attributes:
        weighting: the objective, whose ``state()`` (tau, beta, lam, alpha: the weighting
            values the step used) is logged, and whose beta weighs ``loss/weighted_kl``.
        clipping: the gradient-clipping norm (``model.gradient_clip_val``) or None; when
            set, ``grad_clipped`` records whether the step's norm exceeded it.
    """

    weighting: Any
    clipping: Any


@runtime_checkable
class MetricWriter(Protocol):
    """Anything that accepts flat metric dicts, such as
    :class:`~maxent_grpo.training.step.step_log.LightningWriter`.
    ``isinstance(x, MetricWriter)`` checks only that ``log`` and ``flush`` exist.
    """

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Record ``metrics`` (flat ``name -> scalar``) at global step ``step``."""

    def flush(self) -> None:
        """Write buffered metrics to their destination."""

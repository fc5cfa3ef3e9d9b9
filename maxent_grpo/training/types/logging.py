"""Logging data of a training step: scalar bundles, their flat views and the writer protocol.

Their values are already reduced over micro-batches and ranks.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from maxent_grpo.objectives import Objective
    from maxent_grpo.training.settings import ScheduleSettings

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
    """Step-level scalars that are not losses: reference log-prob, tokens, lr, gradient
    norm, progress, rollout latency, entropy and the entropy bonus.

    Attributes:
        ref_logp_mean: mean reference log-prob per completion token (NaN: not measured).
        tokens: the step's :class:`TokenUsageStats`.
        current_lr: the learning rate used for this step (NaN: the update was skipped).
        grad_norm_scalar: the total gradient norm before clipping, or None (not measured:
            no update, or a strategy that reports none).
        epoch_progress: fractional epoch (``batch_idx / batches per epoch``).
        vllm_latency_ms: the rollout engine's generation time for this step, in
            milliseconds (any engine: vLLM's, a server's or the Hugging Face one), or None.
        policy_entropy: mean token entropy of the policy, if computed.
        entropy_bonus_coef: the entropy bonus coefficient the step used (``alpha`` of
            :class:`~maxent_grpo.objectives.EntropyMaxEnt`, after its KL gate), or None
            (an objective without one).
        entropy_bonus_reward_std: the std over the step's sequences of the bonus in reward
            units, ``alpha * mean_t H`` per sequence: how much the bonus separates a
            group's completions, to compare with ``reward/std``; None without a bonus.
    """

    ref_logp_mean: float
    tokens: TokenUsageStats
    current_lr: float
    grad_norm_scalar: float | None
    epoch_progress: float
    vllm_latency_ms: float | None
    policy_entropy: float | None = None
    entropy_bonus_coef: float | None = None
    entropy_bonus_reward_std: float | None = None

    @property
    def avg_completion_tokens(self) -> float:
        """:attr:`TokenUsageStats.avg_completion_tokens` of :attr:`tokens`."""
        return self.tokens.avg_completion_tokens

    @property
    def num_completion_tokens(self) -> float:
        """:attr:`TokenUsageStats.num_completion_tokens` of :attr:`tokens`."""
        return self.tokens.num_completion_tokens

    @property
    def num_input_tokens(self) -> float:
        """:attr:`TokenUsageStats.num_input_tokens` of :attr:`tokens`."""
        return self.tokens.num_input_tokens

    def as_dict(self) -> dict[str, float | None]:
        """``logp/ref_token``, ``lr``, ``entropy``, ``perf/generate_s`` (the latency in
        seconds), ``entropy_bonus/{coef,reward_std}`` and ``tokens/<name>`` (see
        :meth:`TokenUsageStats.as_dict`); values not measured (None, NaN) are left out. The
        gradient norm and the progress are logged by :class:`LogStepArtifacts`, which
        carries them."""
        out: dict[str, float | None] = {
            "logp/ref_token": self.ref_logp_mean, "lr": self.current_lr,
            "entropy": self.policy_entropy, "perf/generate_s": None if self.vllm_latency_ms is None
            else self.vllm_latency_ms / 1000.0,
            "entropy_bonus/coef": self.entropy_bonus_coef,
            "entropy_bonus/reward_std": self.entropy_bonus_reward_std,
        }
        out.update({f"tokens/{k}": v for k, v in self.tokens.as_dict().items()})
        return {k: v for k, v in out.items() if v is not None and not math.isnan(v)}


@dataclass
class LossScalarBundle:
    """Scalar values of the loss terms of one optimizer step (detached floats).

    Attributes:
        total_loss: the optimised loss (reduced by the objective's ``loss_type``).
        policy_loss: the policy (surrogate or listwise cross-entropy) term.
        clip_loss: the sequence-level clip term, or ``None`` when the objective has none.
        kl_loss: the token-mean KL to the reference (unweighted).
        weighted_kl_loss: ``kl_loss`` times the objective's ``kl_weight()`` (``beta``;
            ListwiseMaxEnt's ``kl_coef``). The parts are means over the step's tokens
            (ListwiseMaxEnt's policy and clip: over its groups); they add up to
            ``total_loss`` only under ``loss_type: bnpo`` with one micro-batch
            (``EntropyMaxEnt``'s entropy bonus aside).
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
            namespaced (``"clip/low"``).
        grad_norm_scalar: total gradient norm, or ``None`` if not measured.
        epoch_progress: fractional epoch (``batch_idx / batches per epoch``).

    The step (:meth:`~maxent_grpo.training.step.step_log.StepMetrics.artifacts`) puts its
    :class:`TrainingScalarStats` into ``diagnostics`` (:meth:`TrainingScalarStats.as_dict`)
    and its gradient norm and progress into the two fields.
    """

    loss_outputs: LossScalarBundle | Mapping[str, Any]
    diagnostics: Mapping[str, Any]
    grad_norm_scalar: float | None
    epoch_progress: float

    def __post_init__(self) -> None:
        if not isinstance(self.loss_outputs, LossScalarBundle | Mapping):
            raise TypeError(
                "loss_outputs must be a LossScalarBundle or a mapping; "
                f"got {type(self.loss_outputs).__name__}"
            )
        if not isinstance(self.diagnostics, Mapping):
            raise TypeError(f"diagnostics must be a mapping; got {type(self.diagnostics).__name__}")

    def as_dict(self) -> dict[str, Any]:
        """The step's logged dict: one flat ``{"train/<name>": float}``, the names TensorBoard,
        ``trainer.callback_metrics``, the controllers and the progress bar all use; a value
        not measured this step (None or NaN) is left out.

        Names, each under ``train/``:
            - ``"loss/<name>"`` for each loss output, with a trailing ``"_loss"`` removed
              (``train/loss/total``, ...);
            - each diagnostics key (``"clip/low"``); a nested mapping is joined with
              ``"/"`` (``{"clip": {"low": x}}`` -> ``"train/clip/low"``);
            - ``"grad_norm"`` and ``"epoch_progress"``.

        Values are Python floats (one-element tensors are read with ``.item()``). A name
        produced twice raises ValueError; a non-scalar value raises ValueError naming it.
        """
        out: dict[str, Any] = {}
        seen: set[str] = set()  # a name given twice is refused even when one value is NaN

        def put(key: str, value: Any) -> None:
            if value is None:
                return
            key = "train/" + key
            if key in seen:
                raise ValueError(f"LogStepArtifacts.as_dict: key {key!r} is produced twice")
            seen.add(key)
            value = _scalar(key, value)
            if not math.isnan(value):
                out[key] = value

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

        walk("", self.diagnostics)
        put("grad_norm", self.grad_norm_scalar)
        put("epoch_progress", self.epoch_progress)
        return out


@dataclass(frozen=True)
class LoggingConfigView:
    """The configuration the logger reads to label and gate metrics (a read-only view).

    Attributes:
        weighting: the objective, whose ``state()`` (tau, beta, lam, alpha: the weighting
            values the step used) is logged, and whose ``kl_weight()`` weighs
            ``loss/weighted_kl``.
        clipping: the gradient-clipping norm (``model.gradient_clip_val``) or None; when
            set, ``grad_clipped`` records whether the step's norm exceeded it.
        schedule: the optimisation schedule
            (:class:`~maxent_grpo.training.settings.ScheduleSettings`); while its
            ``lr_warmup_steps`` run, ``lr_warmup`` records the warm-up's progress.
    """

    weighting: Objective
    clipping: float | None
    schedule: ScheduleSettings


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

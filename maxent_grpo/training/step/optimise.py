"""Optimise: one optimizer step on a collected ``Trajectory``.

The second half of a training step, run ``num_iterations`` times per rollout::

    for each micro-batch of whole groups:
        scores = log pi_theta(completion)                   # SequenceScores, with grad
        backward(objective.loss(micro-batch) * s)           # parts sum to the batch loss
    clip gradients; optimizer.step(); scheduler.step()     # -> Update(grad_norm, lr, skipped)

``s`` is the trajectory's ``loss_scale`` (``Objective.loss_scale``), which makes the ranks'
averaged gradient the gradient of the formula over the whole batch of all ranks. A
non-finite loss or gradient on any rank skips the whole update on every rank (the gradients
are zeroed), so the replicas never diverge; :func:`count_update` stops the run with
:class:`NonFiniteLossError` after ``max_consecutive_nonfinite`` skips in a row.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, Strategy
from torch import Tensor

from maxent_grpo.core import sampler_correction_weights
from maxent_grpo.objectives import LossOutput, MicroBatch
from maxent_grpo.training.step.step_log import objective_values
from maxent_grpo.training.step.trajectory import StepTimer, Trajectory
from maxent_grpo.validation import UserCodeError, require

if TYPE_CHECKING:
    from maxent_grpo.training.step.step_log import StepMetrics
    from maxent_grpo.training.step.token_logps import MicroBatchPlan
    from maxent_grpo.training.step.trajectory import StepContext

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """Raised after ``max_consecutive_nonfinite`` skipped updates in a row (on every rank
    at once: the skip is decided over all of them, so a checkpoint may be saved on it)."""

    every_rank = True


@dataclass
class StepCounters:
    """Counters of a run that travel in the checkpoint.

    Attributes:
        nonfinite_in_a_row: skipped (non-finite) updates since the last finite one.
        nonfinite_total: skipped updates in the whole run.
        empty_steps: steps whose every group was dropped (``drop_constant_groups``).
    """

    nonfinite_in_a_row: int = 0
    nonfinite_total: int = 0
    empty_steps: int = 0


@dataclass(frozen=True)
class Update:
    """What one optimizer step did.

    Attributes:
        grad_norm: the gradient norm before clipping, or None (skipped, no gradient, or a
            strategy that clips by itself).
        lr: the learning rate of the update (NaN when it was skipped).
        skipped: the loss or gradient was non-finite on some rank: nothing changed.
        overflow: skipped because ``16-mixed``'s scaled gradients overflowed, the loss
            being finite and the scale still >= 1: the scale backed off (not counted as a
            non-finite update).
    """

    grad_norm: Tensor | None
    lr: float
    skipped: bool = False
    overflow: bool = False


def _cut(values: Tensor | None, chunk: MicroBatchPlan) -> Tensor | None:
    """``(n, Tc)``: a micro-batch's rows of ``(N, T)`` values, cut to its longest completion."""
    return None if values is None else values[chunk.rows][:, :chunk.completion_len]


def optimizer_step(
    ctx: StepContext, trajectory: Trajectory, sums: StepMetrics, timer: StepTimer,
    first: bool = True,
) -> Update:
    """One optimizer step over the trajectory's micro-batches; the losses' statistics go
    to ``sums`` (the step's torchmetrics, on the device: one host sync per optimizer step,
    the finite check). On the ``first`` step of a rollout, where the policy is still the
    one that sampled, an engine's own log-probs are compared with the scored ones:
    ``rollout/logp_gap/{mean,max}`` of ``|log pi_sampler - log pi_theta|`` per token."""
    opt, sched = ctx.optimizer, ctx.scheduler
    scaler = loss_scaler(ctx.strategy)
    if trajectory.kept_groups == 0:  # every group of every rank is constant: no gradient,
        lr = opt.param_groups[0]["lr"]
        with _without_scaler(ctx.strategy):  # a scaler refuses a step with no gradient
            opt.step()  # but the step counts (parameters without a gradient stay put)
        sched.step()
        return Update(None, lr)
    t = trajectory
    G, P = ctx.generation.num_generations, t.prompt_len
    finite = torch.ones((), dtype=torch.bool, device=ctx.device)
    last = len(t.chunks) - 1
    real = sum(not chunk.padding for chunk in t.chunks)  # the step's own micro-batches
    for i, chunk in enumerate(t.chunks):
        timer.start()
        rows, cols = chunk.rows, chunk.columns(P)
        old, sampler = _cut(t.old_logps, chunk), _cut(t.sampler_logps, chunk)
        scores, entropy = ctx.scorer.policy_scores(
            ctx.policy, t.input_ids[rows][:, cols], t.attention[rows][:, cols],
            _cut(t.mask, chunk),
            old, ctx.objective.needs_entropy, sampler)
        if chunk.padding:  # only keeps the ranks' collectives in step: weight zero
            timer.stop("forward")
            with opt.toggle_model(sync_grad=i == last):
                ctx.backward(scores.token_logp.nan_to_num(0.0, 0.0, 0.0).sum() * 0.0)
            timer.stop("backward")
            continue
        # the ghost group's tokens count in no statistic
        counted = torch.zeros_like(scores.token_mask) if t.ghost else scores.token_mask
        mine = t.targets.of_groups(chunk.groups, G)  # this micro-batch's groups
        correction = None
        if ctx.generation.sampler_correction is not None:
            require(t.sampler_logps is not None,
                    "model.sampler_correction needs a rollout engine that reports its "
                    "log-probs (the vLLM engines, or HFGenerateEngine with generation_dtype "
                    "bfloat16 or float16, which samples from a copy, on a model in another "
                    "dtype); the Hugging Face engine without a copy reports none (it samples "
                    "from the scored policy itself): set it to null")
            behaviour = scores.token_logp.detach() if old is None else old
            correction = sampler_correction_weights(
                behaviour, sampler, scores.token_mask,
                ctx.generation.sampler_correction, ctx.generation.sampler_correction_cap)
            sums.mean("rollout/correction/mean").update(correction, counted)
        out = ctx.objective.loss(MicroBatch(
            token_logps=scores.token_logp,
            old_token_logps=scores.old_token_logp,
            ref_token_logps=_cut(t.ref_logps, chunk),
            mask=scores.token_mask,
            entropy=entropy,
            advantages=mine.advantages, weights=mine.weights, candidates=mine.candidates,
            answers=mine.answers,
            group_size=G,
            num_rows=t.num_rows,
            num_micro_batches=real,
            max_completion_length=ctx.generation.sampling.max_new_tokens,
            num_global_tokens=t.num_global_tokens,
            correction=correction,
        ))
        if not isinstance(out, LossOutput):  # e.g. a subclass returning its bare loss tensor
            raise UserCodeError(f"{type(ctx.objective).__name__}.loss must return a "
                                f"maxent_grpo.objectives.LossOutput; got {type(out).__name__}")
        if not (isinstance(out.loss, Tensor) and out.loss.dim() == 0
                and out.loss.grad_fn is not None):  # a leaf trained nothing, without a word
            got = (f"shape {tuple(out.loss.shape)}, requires_grad {out.loss.requires_grad}, "
                   f"computed from the policy {out.loss.grad_fn is not None}"
                   if isinstance(out.loss, Tensor) else type(out.loss).__name__)
            raise UserCodeError(f"{type(ctx.objective).__name__}.loss: LossOutput.loss must be "
                                "a scalar tensor with a gradient (a mean or sum of the token "
                                f"log-probs' terms, not detached); got {got}")
        finite &= torch.isfinite(out.loss)
        if first and sampler is not None:
            gap = (scores.token_logp.detach() - sampler).abs()
            sums.mean("rollout/logp_gap/mean").update(gap, counted)
            # the masked maximum without a boolean index (no host sync); no counted token
            # (a ghost rank) adds -inf, which no maximum keeps
            sums.maximum("rollout/logp_gap/max").update(
                torch.where(counted, gap, -math.inf).amax())
        timer.stop("forward")
        # DDP all-reduces the accumulated gradient once, in the last micro-batch's backward
        with opt.toggle_model(sync_grad=i == last):
            ctx.backward(out.loss * t.loss_scale)
        timer.stop("backward")
        # parts sum to the step's loss: count 1/real each -> mean over passes and
        # ranks (scaled like their gradient, their mean over the ranks is the batch loss)
        sums.add("loss/total", out.loss * t.loss_scale, 1.0 / real)
        weight = 0.0 if t.ghost else 1.0
        rows_in = scores.denom_tok_tensor > 0  # rows the loss hides whole do not count
        sums.add("logp/sequence", (scores.cur_logp_sum * rows_in).sum(), rows_in.sum(),
                 weight=weight)
        sums.add("logp/behavior_sequence", (scores.behavior_logp_sum * rows_in).sum(),
                 rows_in.sum(), weight=weight)
        # the trained policy against the one that sampled, per token (0 on a rollout's
        # first update from the policy itself)
        sums.add("logp/log_ratio", scores.log_ratio_train.sum(), scores.denom_tok_tensor.sum(),
                 weight=weight)
        if scores.policy_entropy_sum is not None:  # each sequence's mean token entropy, in
            # float64: its square's mean less the mean's square is the spread
            h = scores.policy_entropy_sum.double() / scores.denom_tok_tensor.clamp(min=1) * rows_in
            sums.add("entropy/sequence", h.sum(), rows_in.sum(), weight=weight)
            sums.add("entropy/sequence_sq", h.square().sum(), rows_in.sum(), weight=weight)
        owner = f"{type(ctx.objective).__name__}.loss: LossOutput.sums"
        for key, (value, count) in objective_values(owner, out.sums, pairs=True,
                                                    taken=ctx.objective.state()).items():
            sums.add(key, value, count, weight=weight)
    timer.start()
    # 16-mixed: the gradients are the loss scaler's multiple until the step unscales them;
    # clipping the scaled ones at max_norm x scale is clipping the true ones at max_norm
    scale = 1.0 if scaler is None else scaler.get_scale()
    grad_norm = clip_gradients(ctx.strategy, ctx.policy.parameters(),
                               (ctx.schedule.gradient_clip_val or float("inf")) * scale)
    loss_finite = finite
    if grad_norm is not None:
        grad_norm = grad_norm / scale
        finite = finite & torch.isfinite(grad_norm)
    if not ctx.all_ranks(bool(finite)):
        opt.zero_grad(set_to_none=True)  # the update is skipped on every rank; it counts
        with warnings.catch_warnings():  # as a step (count_update), of the schedule too
            warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
            sched.step()  # (torch warns of a schedule stepped before its optimizer)
        if scaler is None:
            return Update(None, math.nan, skipped=True)
        # the scale backs off and its growth count restarts, as the scaler's own skip does;
        # a finite loss whose scaled gradients overflowed is the scaler's routine, not a
        # fault, while the scale stays >= 1 (below, the true gradients are not finite)
        lower = scale * scaler.get_backoff_factor()
        scaler.update(lower)
        if getattr(scaler, "_growth_tracker", None) is not None:
            scaler._growth_tracker.zero_()
        return Update(None, math.nan, skipped=True,
                      overflow=ctx.all_ranks(bool(loss_finite)) and lower >= 1.0)
    lr = opt.param_groups[0]["lr"]  # the rate of this update (logged)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    timer.stop("optimizer")
    return Update(grad_norm, lr)


def loss_scaler(strategy: Strategy) -> Any:
    """The precision plugin's ``GradScaler`` (``16-mixed``), or None."""
    scaler = getattr(getattr(strategy, "precision_plugin", None), "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None


@contextlib.contextmanager
def _without_scaler(strategy: Strategy) -> Iterator[None]:
    """The optimizer steps as without a scaler (a step with no gradient at all)."""
    plugin = getattr(strategy, "precision_plugin", None)
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None:
        plugin.scaler = None
    try:
        yield
    finally:
        if scaler is not None:
            plugin.scaler = scaler


def check_low_precision_weights(parameters: list[torch.nn.Parameter], optimizer: Any,
                                strategy: Strategy) -> None:
    """Refuse float16 weights that cannot train: under ``16-mixed`` (its scaler cannot
    unscale float16 gradients), or with an adaptive optimizer (a parameter group with an
    ``eps``: Adam, AdamW, RMSprop, Adagrad, ...), which keeps its squared-gradient moments
    in float16: ``(1 - beta2) g^2`` is 0 there for most gradients, so an update is
    ``lr g / eps``, plain SGD at a learning rate of ``lr / eps`` (with eps 1e-8, 0 in float16,
    every weight NaN; with eps 1e-4, the tiny model's KL 100 times float32's in 3 steps).
    Then warn when the learning rate is too small for bfloat16 weights
    (:func:`warn_rounded_updates`)."""
    if isinstance(strategy, DeepSpeedStrategy):
        return  # DeepSpeed keeps float32 master weights for low-precision training
    if any(p.dtype == torch.float16 for p in parameters):
        require(loss_scaler(strategy) is None,
                "trainer.precision 16-mixed needs float32 weights (model.dtype: float32); the "
                "loss scaler cannot unscale float16 gradients")
        require(not any("eps" in group for group in optimizer.param_groups),
                f"float16 weights (model.dtype: float16, or trainer.precision 16-true) with "
                f"{type(optimizer).__name__}, whose squared-gradient moments underflow to 0 in "
                "float16: each update is the gradient divided by eps, and the policy "
                "collapses; use 16-mixed with float32 weights (model.dtype: float32) or bf16 "
                "(bf16-mixed or bf16-true)")
    warn_rounded_updates(optimizer)


def warn_rounded_updates(optimizer: Any, share: float = 0.5) -> float | None:
    """Warn when an adaptive optimizer's step (about ``lr`` per weight for Adam's kind: a
    parameter group with an ``eps``) would leave most bfloat16 or float16 weights as they
    are: a weight moves only by at least half its spacing, ``|w| 2^-9`` in bfloat16 (8
    significant bits). On the tiny model in bfloat16, a step of 1e-6 changes 2% of the
    weights, 1e-5 15%, 1e-4 88%. Tensors above 2^20 elements are sampled (evenly spaced);
    under FSDP2, rank 0's shards. Returns the share changed (None: nothing low-precision).
    Optimizers that keep float32 master weights or round stochastically need no warning:
    a group marked ``kahan_sum`` or ``bf16_stochastic_round`` (optimi's, torchao's) is left
    out; others are not told apart. A group without ``eps`` (SGD's kind, whose step ``lr |g|``
    cannot be known before a gradient) is warned of as such."""
    from lightning.pytorch.utilities import rank_zero_warn

    changed = total = 0.0
    rates, unmeasured = set(), False
    with torch.no_grad():
        for group in optimizer.param_groups:
            low = [p for p in group["params"] if p.requires_grad
                   and p.dtype in (torch.bfloat16, torch.float16)]
            compensated = group.get("kahan_sum") or group.get("bf16_stochastic_round")
            unmeasured |= bool(low) and "eps" not in group and not compensated
            if "eps" not in group or not low or group.get("lr") is None or compensated:
                continue
            lr = float(group.get("initial_lr", group["lr"]))
            rates.add(lr)
            for p in low:
                w = (p.to_local() if hasattr(p, "to_local") else p).reshape(-1)
                every = max(1, w.numel() // 2**20)
                sample = w[::every]  # a DTensor's local shard above
                if sample.numel():
                    changed += w.numel() * float(((sample + lr) != sample).float().mean())
                    total += w.numel()
    if unmeasured:  # once per optimizer
        rank_zero_warn(
            f"{type(optimizer).__name__} over bfloat16/float16 weights: a step smaller than "
            "half a weight's spacing (|w| 2^-9 in bfloat16) rounds back to the old value, "
            "and this optimizer's steps (lr x gradient, for SGD) cannot be checked before a "
            "gradient; train float32 weights (model.dtype: float32) under trainer.precision "
            "bf16-mixed")
    if total == 0:
        return None
    moved = changed / total
    if moved < share:
        lrs = "/".join(f"{r:g}" for r in sorted(rates))
        rank_zero_warn(
            f"{type(optimizer).__name__} at lr {lrs} over bfloat16/float16 weights: a step "
            f"of that size changes {moved:.1%} of them (the rest round back to their old "
            "value) and the policy barely trains; train float32 weights (model.dtype: "
            "float32) under trainer.precision bf16-mixed, or raise the learning rate")
    return moved


def clip_gradients(
    strategy: Strategy, parameters: Iterable[torch.nn.Parameter], max_norm: float
) -> Tensor | None:
    """Clip the gradients to global norm ``max_norm``; return that norm (the same on every
    rank: FSDP2's ``clip_grad_norm_`` reduces the DTensor shards' norms over the mesh), or
    None where the strategy clips by itself (DeepSpeed, inside its ``step``)."""
    if isinstance(strategy, DeepSpeedStrategy):
        return None
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def count_update(counters: StepCounters, update: Update, trainer: Any, limit: int) -> None:
    """Count a skipped update (warn; raise :class:`NonFiniteLossError` at ``limit`` in a
    row) or reset the run of skips after one that was taken.

    A skipped update still counts as an optimizer step in ``trainer.global_step`` (the
    learning-rate schedule steps too; only the weights stay as they were), as Lightning's
    own loop and Hugging Face's count a loss scaler's skipped step: the count always moves
    by ``num_iterations`` per training step, so the multiples that
    :func:`~maxent_grpo.training.step.strategy.check_step_multiples` requires of
    ``max_steps`` and ``every_n_train_steps`` are met exactly (docs/SCALING.md)."""
    if not update.skipped:
        counters.nonfinite_in_a_row = 0
        return
    step = 0 if trainer is None else trainer.global_step
    if trainer is not None:  # Lightning counts the steps its optimizer wrapper took
        progress = trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        progress.increment_ready()
        progress.increment_completed()
    if update.overflow:  # the loss scaler's routine back-off, not a fault
        log.info("step %d: float16 gradients overflowed at this loss scale; update skipped, "
                 "scale backed off", step)
        return
    counters.nonfinite_in_a_row += 1
    counters.nonfinite_total += 1
    log.warning(
        "non-finite loss or gradient at step %d: update skipped (%d in a row, %d in all)",
        step, counters.nonfinite_in_a_row, counters.nonfinite_total,
    )
    if counters.nonfinite_in_a_row >= limit:
        raise NonFiniteLossError(
            f"{counters.nonfinite_in_a_row} non-finite updates in a row; stopping. Lower the "
            "learning rate or check the rewards, or raise model.max_consecutive_nonfinite."
        )

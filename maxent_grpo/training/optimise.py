"""Optimise: one optimizer step on a collected :class:`~maxent_grpo.training.trajectory.Trajectory`.

The second half of a training step, run ``num_iterations`` times per rollout::

    for each micro-batch of whole groups:
        scores = log pi_theta(completion)                   # SequenceScores, with grad
        manual_backward(objective.loss(micro-batch) * s)    # parts sum to the batch loss
    clip gradients; optimizer.step(); scheduler.step()

``s`` is the trajectory's ``loss_scale`` (``Objective.loss_scale``), which makes the ranks'
averaged gradient the gradient of the formula over the whole batch of all ranks. Under DDP
every micro-batch but the last runs its backward without gradient synchronisation
(``LightningOptimizer.toggle_model(sync_grad=False)``, DDP's ``no_sync``): the gradients
accumulate locally and are all-reduced once per optimizer step. A
non-finite loss or gradient on any rank skips the whole update on every rank (the
gradients are zeroed), so the replicas never diverge; ``max_consecutive_nonfinite``
skips in a row stop the run with :class:`NonFiniteLossError`.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from maxent_grpo.objectives import MicroBatch
from maxent_grpo.training.strategy import clip_gradients
from maxent_grpo.training.timing import StepTimer
from maxent_grpo.training.trajectory import Trajectory

if TYPE_CHECKING:
    from maxent_grpo.training.module import MaxEntGRPOModule

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """Raised after ``max_consecutive_nonfinite`` skipped updates in a row."""


class LossSums:
    """``(value_sum, count)`` pairs of the losses' statistics over micro-batches and
    iterations, kept on the device (one host sync per optimizer step: the finite check)."""

    def __init__(self, device: torch.device) -> None:
        zero = torch.zeros((), device=device)
        self.device = device
        self.sums: dict[str, list[Tensor]] = defaultdict(lambda: [zero, zero])

    def add(self, key: str, value: Tensor, count: Tensor | float, weight: float = 1.0) -> None:
        entry = self.sums[key]
        entry[0] = entry[0] + weight * value.detach().float().to(self.device)
        entry[1] = entry[1] + weight * torch.as_tensor(count).float().to(self.device)


def optimizer_step(
    module: MaxEntGRPOModule, trajectory: Trajectory, sums: LossSums, timer: StepTimer
) -> Tensor | None:
    """One optimizer step over the trajectory's micro-batches; returns the gradient norm
    (None when the update was skipped or the strategy clips by itself)."""
    schedule = module.loop.optimization.schedule
    opt, sched = module.loop.optimization.handles
    if trajectory.kept_groups == 0:  # every group of every rank is constant: no gradient,
        opt.step()  # but the step counts (parameters without a gradient stay put)
        sched.step()
        return None
    t = trajectory
    G, P = module.loop.generation.num_generations, t.prompt_len
    finite = torch.ones((), dtype=torch.bool, device=module.device)
    last = len(t.chunks) - 1
    for i, chunk in enumerate(t.chunks):
        timer.start()
        rows, cols, Tc = chunk.rows, chunk.columns(P), chunk.completion_len
        scores, entropy = module.scorer.policy_scores(
            module.policy, t.input_ids[rows][:, cols], t.attention[rows][:, cols],
            t.mask[rows][:, :Tc], None if t.old_logps is None else t.old_logps[rows][:, :Tc],
            module.objective.needs_entropy,
        )
        targets = t.targets
        out = module.objective.loss(MicroBatch(
            token_logps=scores.token_logp,
            old_token_logps=scores.old_token_logp,
            ref_token_logps=None if t.ref_logps is None else t.ref_logps[rows][:, :Tc],
            mask=scores.token_mask,
            entropy=entropy,
            advantages=None if targets.advantages is None else targets.advantages[rows],
            weights=None if targets.weights is None else targets.weights[chunk.groups],
            candidates=None if targets.candidates is None else targets.candidates[chunk.groups],
            group_size=G,
            num_rows=t.num_rows,
            num_micro_batches=len(t.chunks),
            max_completion_length=module.loop.generation.sampling.max_new_tokens,
            num_global_tokens=t.num_global_tokens,
        ))
        finite &= torch.isfinite(out.loss)
        timer.stop("forward")
        # DDP all-reduces the accumulated gradient once, in the last micro-batch's backward
        with opt.toggle_model(sync_grad=i == last):
            module.manual_backward(out.loss * t.loss_scale)
        timer.stop("backward")
        # parts sum to the step's loss: count 1/len(chunks) each -> mean over passes and
        # ranks (scaled like their gradient, their mean over the ranks is the batch loss)
        sums.add("loss/total", out.loss * t.loss_scale, 1.0 / len(t.chunks))
        sums.add("logp/sequence", scores.cur_logp_sum.sum(), float(scores.num_sequences),
                 weight=0.0 if t.ghost else 1.0)
        for key, (value, count) in out.sums.items():
            sums.add(key, value, count, weight=0.0 if t.ghost else 1.0)
    timer.start()
    grad_norm = clip_gradients(module.trainer.strategy, module.policy.parameters(),
                               schedule.gradient_clip_val or float("inf"))
    if grad_norm is not None:
        finite = finite & torch.isfinite(grad_norm)
    if not module.trainer.strategy.reduce_boolean_decision(bool(finite), all=True):
        skip_update(module, opt)
        return None
    module.counters.nonfinite_in_a_row = 0
    module.lr_used = opt.param_groups[0]["lr"]  # the rate of this update (logged)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    timer.stop("optimizer")
    return grad_norm


def skip_update(module: MaxEntGRPOModule, opt) -> None:
    """Zero the gradients of a non-finite update and count it (raise after too many)."""
    counters = module.counters
    opt.zero_grad(set_to_none=True)
    counters.nonfinite_in_a_row += 1
    counters.nonfinite_total += 1
    log.warning(
        "non-finite loss or gradient at step %d: update skipped (%d in a row, %d in all)",
        module.global_step, counters.nonfinite_in_a_row, counters.nonfinite_total,
    )
    if counters.nonfinite_in_a_row >= module.loop.optimization.schedule.max_consecutive_nonfinite:
        raise NonFiniteLossError(
            f"{counters.nonfinite_in_a_row} non-finite updates in a row; stopping. Lower the "
            "learning rate or check the rewards, or raise model.max_consecutive_nonfinite."
        )

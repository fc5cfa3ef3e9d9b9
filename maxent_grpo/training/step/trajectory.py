"""Collect: one rollout turned into a typed :class:`Trajectory`, ready to optimise over.

``collect`` is the first half of a training step (docs/ALGORITHM.md §0-§4)::

    rollout  = engine.generate(prompts, G)                 # GenerationBatch + ids, no grad
    rewards  = sum_k w_k R_k(pairs)                        # (B, G), on the flat pairs
                                                           # (PromptCompletionBatch)
    refill   = more prompts while too few groups vary      # (refill_rounds; step/refill.py)
    keep     = groups that take part                       # (B,) (drop_constant_groups)
    answers  = canonical answers, their classes per group  # answer statistics, answer_level
    ref      = log pi_ref(completion)   if needed          # (N, T), no grad
    old      = log pi_old(completion)   if num_iterations > 1
    targets  = objective.prepare(GroupInputs(...))         # over the kept groups of all ranks

``N`` counts the rows that take part on this rank: the ``G`` rows of every kept group, or,
on a rank that keeps none while others do (DDP), one "ghost" group scored at weight zero so
that every rank makes the same backward passes. Rows stay prompt-major.

Both halves of the step (``collect`` and ``optimise.optimizer_step``) get the step's parts as
one typed :class:`StepContext`; they never see the LightningModule and *return* what they
produce, so both run without a ``Trainer`` (a Lightning ``Strategy`` such as
``SingleDeviceStrategy`` stands in for the ranks).
"""

from __future__ import annotations

import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from maxent_grpo.core import answer_classes, distinct_candidates, droppable_groups
from maxent_grpo.objectives import GroupInputs, Targets, sequence_ref_loglik
from maxent_grpo.rewards.answers import answer_keys
from maxent_grpo.rewards.combine import TrainerState
from maxent_grpo.rollout import GenerationBatch, RolloutOutput, checked_rollout
from maxent_grpo.training.step.refill import Scored, pad_id, refill
from maxent_grpo.training.step.token_logps import MicroBatchPlan, equal_passes
from maxent_grpo.training.types import AdvantageStats, QDistribution
from maxent_grpo.validation import UserCodeError, require

if TYPE_CHECKING:
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.strategies import Strategy
    from torch.optim.lr_scheduler import LRScheduler

    from maxent_grpo.objectives import Objective
    from maxent_grpo.rewards import WeightedRewards
    from maxent_grpo.rollout import RolloutEngine
    from maxent_grpo.training.settings import GenerationSettings, ScheduleSettings
    from maxent_grpo.training.step.token_logps import Scorer


@dataclass
class StepContext:
    """The parts of one training step.

    Attributes:
        engine: the run-long rollout engine, already in step with ``policy``'s weights.
        rewards: the weighted reward functions (``model.rewards``).
        scorer: teacher-forced log-probs and micro-batch plans.
        objective: the training objective (``prepare`` / ``loss``).
        policy: the model being trained.
        reference: the frozen reference when the step needs it, else None.
        generation: ``G``, the sampling settings, the row filters.
        schedule: iterations per rollout, clipping, the non-finite limit.
        strategy: Lightning's strategy: the ranks and their collectives (``all_gather``,
            ``reduce_boolean_decision``; :mod:`~maxent_grpo.training.step.strategy`).
        backward: ``loss -> None``, the strategy's backward (``manual_backward``).
        optimizer: the optimizer (Lightning's ``LightningOptimizer``, whose
            ``toggle_model(sync_grad=...)`` defers DDP's all-reduce to the last micro-batch).
        scheduler: the learning-rate scheduler, stepped once per optimizer step.
        step: the global step (the optimizer steps taken so far).
        refill: ``n -> batch``: ``n`` more prompts of the refill stream
            (:meth:`~maxent_grpo.training.data.PromptDataModule.refill_batch`), when
            ``generation.refill_rounds > 0``; else None.
        trainer_state: the training progress the reward functions are given
            (:meth:`~maxent_grpo.rewards.combine.TrainerState.from_trainer`).
    """

    engine: RolloutEngine
    rewards: WeightedRewards
    scorer: Scorer
    objective: Objective
    policy: torch.nn.Module
    reference: torch.nn.Module | None
    generation: GenerationSettings
    schedule: ScheduleSettings
    strategy: Strategy
    backward: Callable[[Tensor], None]
    optimizer: LightningOptimizer
    scheduler: LRScheduler | None
    step: int
    refill: Callable[..., dict[str, Any]] | None = None
    trainer_state: TrainerState = TrainerState()

    @property
    def world_size(self) -> int:
        """``W``, the data-parallel ranks."""
        return self.strategy.world_size

    @property
    def rank(self) -> int:
        """This rank's index in ``[0, W)``."""
        return self.strategy.global_rank

    @property
    def device(self) -> torch.device:
        """The device this rank computes on."""
        return self.strategy.root_device

    def gather(self, data: Tensor | dict[str, Tensor]) -> Any:
        """Every rank's ``data`` stacked along a new first dim ``(W, ...)`` (a tensor or
        each tensor of a dict); ``data`` itself when there is one rank."""
        if self.world_size == 1:
            return data
        if isinstance(data, dict):
            return {k: self.strategy.all_gather(v) for k, v in data.items()}
        return self.strategy.all_gather(data)

    def all_ranks(self, flag: bool) -> bool:
        """True when ``flag`` is True on every rank."""
        return bool(self.strategy.reduce_boolean_decision(flag, all=True))

    def any_rank(self, flag: bool) -> bool:
        """True when ``flag`` is True on some rank."""
        return bool(self.strategy.reduce_boolean_decision(flag, all=False))


class StepTimer:
    """The step's clock: seconds per named phase, for the ``perf/...`` metrics.

    ``stop(name)`` charges the time since the last ``start()`` or ``stop()`` to ``name``
    (consecutive phases: one ``start``, several ``stop`` calls). :meth:`summary` reports
    ``reward_s`` (the reward functions), ``score_s`` (the forward passes that produce
    log-probs), ``backward_s`` (backward passes, clipping and the optimizer step),
    ``step_s`` (the whole step) and ``tokens_per_s`` (this rank's completion tokens over
    ``step_s``); the rollout's own time is the engine's (``perf/generate_s``). On CUDA each
    boundary synchronises the device: kernels are charged to the phase that launched them."""

    def __init__(self, device: torch.device | str | None = None, clock=time.perf_counter) -> None:
        self._cuda = torch.device(device or "cpu").type == "cuda"
        self._clock = clock  # seconds; injectable so that tests need no real sleeps
        self._begin = self._last = self._now()
        self.seconds: dict[str, float] = defaultdict(float)

    def _now(self) -> float:
        if self._cuda:
            torch.cuda.synchronize()
        return self._clock()

    def start(self) -> None:
        self._last = self._now()

    def stop(self, phase: str) -> None:
        now = self._now()
        self.seconds[phase] += now - self._last
        self._last = now

    def summary(self, completion_tokens: int) -> dict[str, float]:
        """The ``perf/...`` values of the step (keys without the prefix)."""
        step = self._now() - self._begin
        s = self.seconds
        return {
            "reward_s": s["reward"],
            "score_s": s["frozen"] + s["forward"],
            "backward_s": s["backward"] + s["optimizer"],
            "step_s": step,
            "tokens_per_s": completion_tokens / step if step > 0 else float("nan"),
        }


@dataclass
class RolloutSamples:
    """What a step sampled and how it was scored, on the CPU, for display
    (:class:`~maxent_grpo.training.callbacks.samples.CompletionSamples`). Groups that
    ``drop_constant_groups`` left out have NaN advantages, weights and q.

    Attributes:
        step: ``trainer.global_step`` of the step that trained on the rollout (with
            ``model.max_staleness`` k, it was sampled k optimizer steps earlier).
        prompts: the ``B`` prompts as the dataset gave them.
        generation: the completions, grouped per prompt.
        rewards: ``(B, G)`` total rewards.
        components: reward name -> ``(B, G)`` values (NaN where it returned None).
        advantages: the per-row advantages, or None (listwise, or an empty step).
        weights: ``(B, G)`` MaxEnt weights, or None (GRPO, or an empty step).
        q: the listwise target distribution, or None.
    """

    step: int
    prompts: list[Any]
    generation: GenerationBatch
    rewards: Tensor
    components: dict[str, Tensor]
    advantages: AdvantageStats | None
    weights: Tensor | None
    q: QDistribution | None


@dataclass
class Trajectory:
    """One rollout of this rank, scored and with its targets: the hand-off from collecting
    to optimising. ``B`` prompts, ``G`` completions, ``N`` rows taking part, ``P + T``
    columns.

    Attributes:
        rollout: the engine's output: texts and ``(B*G, ...)`` ids and masks.
        rewards: ``(B, G)`` total rewards; ``components`` ``(K, B*G)`` per reward.
        loss_mask: ``(B*G, T)`` completion mask of the loss: the tokens the model wrote
            (a multi-turn rollout's tool messages left out), truncated rows zeroed with
            ``mask_truncated_completions``.
        keep: ``(B,)`` bool, the groups that take part.
        input_ids, attention: ``(N, P + T)`` rows ``[prompt | completion]`` taking part.
        mask: ``(N, T)`` their loss mask.
        ref_logps: ``(N, T)`` reference log-probs, or None when not needed.
        old_logps: ``(N, T)`` behaviour log-probs, or None (``num_iterations = 1``).
        sampler_logps: ``(N, T)`` the rollout engine's own log-probs, or None.
        targets: the objective's targets of the ``N`` rows.
        chunks: micro-batches of whole groups over the ``N`` rows.
        kept_groups: groups taking part on all ranks.
        dropped_groups: groups left out on all ranks (``drop_constant_groups``).
        ghost: this rank scores a zero-weight ghost group.
        num_global_tokens: completion tokens taking part on all ranks, at least 1 (``dapo``).
        loss_scale: factor on this rank's loss (``Objective.loss_scale``; 0 for a ghost).
        samples: the CPU record for display.
        refill_rounds: extra rollouts of ``B`` prompts this step drew
            (``model.refill_rounds``; the same on every rank).
        answer_keys: the ``B*G`` samples' answers as the answer statistics and the
            answer-level objectives compare them (:func:`~maxent_grpo.rewards.answers.answer_key`
            under each row's ``answer_form``; ``None``: no answer).
        reward_logs: ``(name, value)`` of the reward functions' ``log_metric`` calls.
    """

    rollout: RolloutOutput
    rewards: Tensor
    components: Tensor
    loss_mask: Tensor
    keep: Tensor
    input_ids: Tensor
    attention: Tensor
    mask: Tensor
    ref_logps: Tensor | None
    old_logps: Tensor | None
    sampler_logps: Tensor | None
    targets: Targets
    chunks: list[MicroBatchPlan]
    kept_groups: int
    dropped_groups: int
    ghost: bool
    num_global_tokens: Tensor
    loss_scale: float
    samples: RolloutSamples
    refill_rounds: int = 0
    answer_keys: list[str | None] = field(default_factory=list)
    reward_logs: list[tuple[str, float]] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        """``N``, the rows scored on this rank (the ghost group's included)."""
        return self.input_ids.shape[0]

    @property
    def prompt_len(self) -> int:
        """``P``, the prompt columns."""
        return self.input_ids.shape[1] - self.mask.shape[1]


def collect(ctx: StepContext, batch: dict[str, Any], timer: StepTimer) -> Trajectory:
    """Rollout, rewards, frozen log-probs and targets of one training batch (module docs)."""
    gen, world, B = ctx.generation, ctx.world_size, len(batch["prompts"])
    G, T_max = gen.num_generations, gen.sampling.max_new_tokens
    weighted = [k for k, w in enumerate(ctx.rewards.weights) if w != 0]
    dtype = torch.promote_types(next(ctx.policy.parameters()).dtype, torch.float32)  # rewards'

    def roll_out(prompts: dict[str, Any]) -> Scored:
        out = checked_rollout(ctx.engine, ctx.engine.generate(prompts["prompts"], prompts[
            "answers"], G), len(prompts["prompts"]), G, ctx.policy, T_max)
        timer.start()
        total, parts = ctx.rewards.score_rollout(  # (B*G,), (K, B*G), on the CPU
            out, prompts["raw_prompts"], prompts["columns"], ctx.trainer_state, ctx.device, dtype)
        timer.stop("reward")
        if ctx.rank == 0 and bool(parts[weighted].isnan().all()):
            warnings.warn(  # shown once per process (the message does not change)
                "no weighted reward function graded any completion of a training step "
                "(every value None, 'not applicable'), so every reward is 0 and that step "
                "learns nothing: check the dataset columns the functions read (an answer "
                "column that is not set, or empty?)", stacklevel=1)
        return prompts, out, total.to(ctx.device).view(-1, G), parts.to(ctx.device)

    scored, rounds = roll_out(batch), 0
    if gen.refill_rounds:
        require(ctx.refill is not None, "model.refill_rounds needs StepContext.refill, the "
                "DataModule's refill_batch (the module passes it; see step/refill.py)")
        scored, rounds = refill(scored, ctx.refill, roll_out, gen.refill_rounds, ctx.any_rank,
                                pad_id(scored[1], ctx.engine), gen.solved_reward)
    (batch, rollout, rewards, components), reward_logs = scored, ctx.rewards.take_logged()
    loss_mask = rollout.model_mask.clone()  # (B*G, T) bool: the tokens the model wrote
    if gen.mask_truncated_completions:
        loss_mask &= ~rollout.truncated[:, None]
        if ctx.rank == 0 and bool(rollout.truncated.all()):
            warnings.warn(  # shown once per process (the message does not change)
                "every completion of a training step (on rank 0) reached "
                "model.max_completion_length, and model.mask_truncated_completions leaves "
                "them all out of the loss: they teach nothing (train/tokens/truncated_frac); "
                "raise model.max_completion_length", stacklevel=1)
    lengths = loss_mask.sum(-1).view(B, G).to(rewards.dtype)
    keys = answer_keys(rollout.reward_completions(), rollout.batch.prompts,
                       batch["columns"].get("answer_form"), G)

    # the groups that take part; a rank that keeps none scores its first group at weight 0
    keep = torch.ones(B, dtype=torch.bool, device=rewards.device)
    ghost = False
    rows: Tensor | slice = slice(None)  # all rows, as views
    if gen.drop_constant_groups:
        keep = ~droppable_groups(rewards, gen.solved_reward)  # (B,) varies, or solved
        ghost = world > 1 and not bool(keep.any())
        scored = keep.clone()
        scored[0] |= ghost
        rows = scored.repeat_interleave(G)  # (B*G,)
    prompt_mask, completion_mask = rollout.prompt_mask[rows], rollout.completion_mask[rows]
    completion_ids, mask = rollout.completion_ids[rows], loss_mask[rows]
    sampled = rollout.model_mask[rows]  # the model's tokens, also in rows the loss mask hides
    input_ids = torch.cat([rollout.prompt_ids[rows], completion_ids], 1)  # (N, P + T)
    attention = torch.cat([prompt_mask, completion_mask], 1).long()
    T = completion_ids.shape[1]
    n_kept = 0 if ghost else input_ids.shape[0]  # this rank's kept rows

    chunks = ctx.scorer.plan(prompt_mask, completion_mask, G)
    if world > 1:  # as many passes as the rank that planned the most (FSDP2 collectives)
        passes = ctx.gather(torch.tensor(len(chunks), device=ctx.device))
        chunks = equal_passes(chunks, int(passes.max()))
    ref_logps = old_logps = rho = None
    timer.start()
    if ctx.reference is not None and chunks:
        ref_logps = ctx.scorer.frozen_logps(ctx.reference, input_ids, attention, T, chunks)
        rho = sequence_ref_loglik(ref_logps, sampled, G)[: n_kept // G]  # hidden: not 0
    if ctx.schedule.num_iterations > 1 and chunks:
        old_logps = ctx.scorer.frozen_logps(ctx.policy, input_ids, attention, T, chunks)
    seq_logps = None
    if ctx.objective.needs_sequence_logps and chunks:  # mean token log-prob, behaviour policy
        behaviour = old_logps if old_logps is not None else ctx.scorer.frozen_logps(
            ctx.policy, input_ids, attention, T, chunks)
        seq_logps = sequence_ref_loglik(behaviour, sampled, G)[: n_kept // G]  # hidden: ranks
    timer.stop("frozen")

    # the first occurrence of each distinct completion (the whole exchange: what tools said
    # tells exchanges apart too); a sample with no answer is its own completion's class
    candidates = torch.ones_like(rewards, dtype=torch.bool)  # (B, G)
    candidates[keep] = distinct_candidates(completion_ids, completion_mask, G)[: n_kept // G]
    answers = answer_classes(
        [k if k is not None else ("", c) for k, c in zip(keys, rollout.texts, strict=True)],
        G).to(rewards.device)  # (B, G)
    inputs = GroupInputs(rewards.clone(), lengths, T_max, kept_rows(rho, keep), candidates,
                         answers, kept_rows(seq_logps, keep))  # edited in place: logs changed
    targets, kept_groups = prepare_targets(ctx, inputs, keep)
    samples = rollout_samples(ctx, batch, rollout.batch, rewards, components, targets, keep)
    if ghost:  # its loss is multiplied by 0
        targets = targets.neutral(G, rewards)
    num_tokens = mask.sum() * (not ghost)
    global_tokens = ctx.gather(num_tokens).sum().clamp(min=1)  # none: the loss's sum is 0
    return Trajectory(
        rollout=rollout, rewards=rewards, components=components,
        loss_mask=loss_mask, keep=keep, input_ids=input_ids, attention=attention, mask=mask,
        ref_logps=ref_logps, old_logps=old_logps, targets=targets, chunks=chunks,
        sampler_logps=None if rollout.sampler_logps is None else rollout.sampler_logps[rows],
        kept_groups=kept_groups, dropped_groups=world * B - kept_groups, ghost=ghost,
        num_global_tokens=global_tokens,
        loss_scale=0.0 if ghost else ctx.objective.loss_scale(world, n_kept, kept_groups * G),
        samples=samples, refill_rounds=rounds, answer_keys=keys, reward_logs=reward_logs,
    )


def kept_rows(values: Tensor | None, keep: Tensor, fill: float = 0.0) -> Tensor | None:
    """``(kept, G)`` values of the kept groups as ``(B, G)``, ``fill`` in the groups left out."""
    if values is None:
        return None
    return values.new_full((keep.shape[0], values.shape[1]), fill).index_copy_(
        0, keep.nonzero()[:, 0], values)


def prepare_targets(ctx: StepContext, inputs: GroupInputs, keep: Tensor) -> tuple[Targets, int]:
    """``objective.prepare`` over the kept groups of the optimizer step's whole batch, all
    ranks together; returns this rank's kept groups' targets and the number of groups kept
    on all ranks.

    ``inputs`` holds this rank's ``(B, G)`` tensors and ``keep`` ``(B,)`` marks the groups
    that take part. With W > 1 ranks every rank's inputs are gathered (every rank has the
    same B), the kept groups of all ``W*B`` are prepared at once, exactly as one process
    given the same prompts would (``scale_rewards="batch"``, ``targets.stats``), and each
    rank keeps the targets of its own (rank ``r``'s kept groups follow those of ranks 0..r-1).
    """
    world, B = ctx.world_size, keep.shape[0]
    every = {**inputs.tensors(), "keep": keep}
    start = 0
    if world > 1:
        every = {k: v.reshape(world * B, -1) for k, v in ctx.gather(every).items()}
        every["keep"] = every["keep"].reshape(-1)
        start = int(every["keep"][: ctx.rank * B].sum())
    sel = every.pop("keep")
    kept_total = int(sel.sum()) if ctx.generation.drop_constant_groups else sel.numel()
    if kept_total == 0:
        return Targets(), 0
    if kept_total < sel.numel():
        every = {k: v[sel] for k, v in every.items()}
    targets, G = ctx.objective.prepare(replace(inputs, **every)), inputs.rewards.shape[1]
    name = type(ctx.objective).__name__
    if not isinstance(targets, Targets):  # e.g. a subclass returning its advantages tensor
        raise UserCodeError(f"{name}.prepare must return a maxent_grpo.objectives.Targets; "
                            f"got {type(targets).__name__}")
    targets.check(name, kept_total, G)
    if world == 1:
        return targets, kept_total
    return targets.of_groups(slice(start, start + int(keep.sum())), G), kept_total


def rollout_samples(
    ctx: StepContext, batch: dict[str, Any], generation: GenerationBatch,
    rewards: Tensor, components: Tensor, targets: Targets, keep: Tensor,
) -> RolloutSamples:
    """The CPU :class:`RolloutSamples` of a step (NaN in the groups left out)."""
    B, G = rewards.shape

    def full(values: Tensor | None) -> Tensor | None:
        if values is None:
            return None
        return kept_rows(values.detach().view(-1, G).to(rewards.dtype), keep, float("nan")).cpu()

    adv, q = full(targets.advantages), full(targets.q)
    return RolloutSamples(
        step=ctx.step,
        prompts=list(batch["raw_prompts"]),
        generation=generation,
        rewards=rewards.detach().cpu(),
        components={
            name: components[k].detach().cpu().view(B, G)
            for k, name in enumerate(ctx.rewards.names)
        },
        advantages=None if adv is None else AdvantageStats.of(adv),
        weights=full(targets.weights),
        q=None if q is None else QDistribution.of(q),
    )

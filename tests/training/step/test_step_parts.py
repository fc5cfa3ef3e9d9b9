"""The step's two halves without a LightningModule or a Trainer: ``collect`` and
``optimizer_step`` run on a :class:`StepContext` built from the pieces, return what they
produce, and do what the module's ``training_step`` does with them."""

from __future__ import annotations

import contextlib
import math
import statistics

import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy

from maxent_grpo.models import load_policy, load_tokenizer
from maxent_grpo.objectives import GRPO
from maxent_grpo.rewards import WeightedRewards
from maxent_grpo.rollout import HFGenerateEngine
from maxent_grpo.training.data import collate_prompts
from maxent_grpo.training.option_groups import build_loop_settings
from maxent_grpo.training.step.optimise import (
    StepCounters,
    Update,
    count_update,
    optimizer_step,
)
from maxent_grpo.training.step.step_log import StepMetrics
from maxent_grpo.training.step.token_logps import Scorer
from maxent_grpo.training.step.trajectory import StepContext, StepTimer, collect
from maxent_grpo.training.types import LoggingConfigView
from tests.conftest import make_data


class PlainOptimizer:
    """A torch optimizer with the one method Lightning's ``LightningOptimizer`` adds that
    the step uses (``toggle_model``, DDP's deferred all-reduce: nothing to defer here)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.step, self.zero_grad = optimizer.step, optimizer.zero_grad

    def toggle_model(self, sync_grad: bool = True):
        return contextlib.nullcontext()


def alternating(prompts, completions, **kw):
    return [float(i % 2 == 0) for i in range(len(completions))]


def context(cache_dir, objective):
    """A step's context on the tiny model: 4 samples a prompt, one group a micro-batch."""
    torch.manual_seed(0)
    tokenizer = load_tokenizer("builtin:tiny", cache_dir=cache_dir)
    policy = load_policy("builtin:tiny", cache_dir=cache_dir).train()
    options = dict(
        num_generations=4, max_completion_length=4, num_iterations=1, drop_constant_groups=False,
        refill_rounds=0,
        mask_truncated_completions=False, micro_batch_groups=1, micro_batch_tokens=None,
        gradient_clip_val=1.0, lr_warmup_steps=0, fused_lm_head=None,
        max_consecutive_nonfinite=3, eval_num_generations=2, eval_reward=None,
        eval_correct_threshold=1.0, eval_k=None, eval_greedy=False, temperature=1.0,
        top_p=1.0, top_k=0, max_prompt_length=32, lr_scheduler=None, sampler_correction=None,
        sampler_correction_cap=2.0,
    )
    rewards = WeightedRewards({"tests.training.step.test_step_parts:alternating": 1.0})
    loop = build_loop_settings(options, rewards.names)
    sgd = torch.optim.SGD(policy.parameters(), lr=0.5)
    ctx = StepContext(
        engine=HFGenerateEngine(policy, tokenizer, loop.generation.sampling),
        rewards=rewards, scorer=Scorer(1.0, loop.scoring, None), objective=objective,
        policy=policy, reference=None, generation=loop.generation,
        schedule=loop.optimization.schedule, strategy=SingleDeviceStrategy(torch.device("cpu")),
        backward=lambda loss: loss.backward(), optimizer=PlainOptimizer(sgd),
        scheduler=torch.optim.lr_scheduler.ConstantLR(sgd, factor=1.0, total_iters=0), step=0,
    )
    return ctx, policy


def test_collect_and_optimise_run_on_a_context_without_a_trainer(cache_dir):
    ctx, policy = context(cache_dir, GRPO())
    data = make_data(cache_dir)
    data.setup("fit")
    batch = collate_prompts(data.train_dataset.examples[:2])
    timer = StepTimer(torch.device("cpu"))
    trajectory = collect(ctx, batch, timer)
    assert trajectory.rewards.tolist() == [[1.0, 0.0, 1.0, 0.0]] * 2
    assert trajectory.kept_groups == 2 and trajectory.dropped_groups == 0
    assert len(trajectory.chunks) == 2  # micro_batch_groups=1: one group per micro-batch
    before = {k: v.detach().clone() for k, v in policy.named_parameters()}
    metrics = StepMetrics(ctx.rewards.names)
    update = optimizer_step(ctx, trajectory, metrics, timer)
    assert not update.skipped and update.lr == 0.5 and torch.isfinite(update.grad_norm)
    assert any(not torch.equal(before[k], v) for k, v in policy.named_parameters())
    counters = StepCounters(nonfinite_in_a_row=2)
    count_update(counters, update, trainer=None, limit=3)
    assert counters.nonfinite_in_a_row == 0  # a taken update ends a run of skips
    metrics.observe(trajectory)
    view = LoggingConfigView(weighting=ctx.objective, clipping=1.0, schedule=ctx.schedule)
    logged = metrics.artifacts(view, updates=[update], epoch_progress=0.0, latency_ms=2.0,
                               step=1, extra={}).as_dict()
    assert logged["train/perf/generate_s"] == 0.002
    assert logged["train/reward/mean"] == 0.5 and logged["train/lr"] == 0.5
    assert logged["train/grad_norm"] == float(update.grad_norm)
    # num_iterations passes: lr, grad_norm and grad_clipped are their means, as every other
    # value is (they were the last pass's: a pass clipped earlier logged grad_clipped 0, the
    # warm-up's rates of the earlier passes never showed); a skipped pass counts in none
    metrics.observe(trajectory)
    passes = [Update(torch.tensor(1.5), 0.1), Update(torch.tensor(0.5), 0.2),
              Update(None, math.nan, skipped=True)]
    logged = metrics.artifacts(view, updates=passes, epoch_progress=0.0, latency_ms=2.0,
                               step=3, extra={}).as_dict()
    assert logged["train/grad_norm"] == 1.0 and logged["train/grad_clipped"] == 0.5
    assert logged["train/lr"] == statistics.fmean([0.1, 0.2])


def test_the_entropy_bonus_spread_is_the_sequences_std_in_float64(cache_dir):
    """``train/entropy_bonus/reward_std`` is ``alpha`` x the std of the sequences' mean token
    entropies, from their mean and mean square: squared in float32, those lost most of their
    digits (entropies near 4.5 apart by 0.007: 1.5% off, and moved by micro-batching)."""
    from maxent_grpo.objectives import EntropyMaxEnt

    ctx, _ = context(cache_dir, EntropyMaxEnt(alpha=0.5))
    data = make_data(cache_dir)
    data.setup("fit")
    trajectory = collect(ctx, collate_prompts(data.train_dataset.examples[:4]),
                         StepTimer(torch.device("cpu")))
    entropies = []
    policy_scores = ctx.scorer.policy_scores

    def recording(*args, **kwargs):  # each micro-batch's sequences, as the step scores them
        scores, entropy = policy_scores(*args, **kwargs)
        entropies.append(scores.policy_entropy_sum.double()
                          / scores.denom_tok_tensor.clamp(min=1).double())
        return scores, entropy

    ctx.scorer.policy_scores = recording
    metrics = StepMetrics(ctx.rewards.names)
    update = optimizer_step(ctx, trajectory, metrics, StepTimer(torch.device("cpu")))
    metrics.observe(trajectory)
    view = LoggingConfigView(weighting=ctx.objective, clipping=1.0, schedule=ctx.schedule)
    logged = metrics.artifacts(view, updates=[update], epoch_progress=0.0, latency_ms=None,
                               step=1, extra={}).as_dict()
    h = torch.cat(entropies)
    assert len(h) == 16
    expected = 0.5 * float(h.std(unbiased=False))
    assert logged["train/entropy_bonus/reward_std"] == pytest.approx(expected, rel=1e-9)


def test_the_step_maxima_are_float64_under_a_true_precision():
    """Created on first use inside the step, where ``bf16-true`` makes bfloat16 torch's
    default dtype: ``train/rollout/logp_gap/max`` was logged rounded (0.0732 for 0.07312)."""
    from lightning.pytorch.plugins.precision import HalfPrecision

    metrics = StepMetrics(["accuracy"])
    with HalfPrecision("bf16-true").forward_context():
        gap = torch.tensor(0.07312, dtype=torch.float32)  # as the step computes it
        metrics.maximum("rollout/logp_gap/max").update(gap)
        metrics.mean("rollout/logp_gap/mean").update(gap)
    assert metrics.maximum("rollout/logp_gap/max").compute().item() == \
        torch.tensor(0.07312, dtype=torch.float32).item()

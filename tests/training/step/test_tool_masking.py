"""Tool messages are in the completion but out of the loss: through the real step (``collect``
then ``optimizer_step`` on a :class:`StepContext` whose engine is a multi-turn engine),
changing what a tool returned changes no gradient, except through the tokens the model
wrote after it; and no objective counts the tool's tokens."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy

from maxent_grpo.models import load_policy, load_tokenizer
from maxent_grpo.objectives import GRPO, EntropyMaxEnt, GroupMaxEnt, ListwiseMaxEnt
from maxent_grpo.rewards import WeightedRewards
from maxent_grpo.rollout.multiturn import MultiTurnEngine
from maxent_grpo.rollout.toolcall import Toolbox
from maxent_grpo.training.data import collate_prompts
from maxent_grpo.training.option_groups import build_loop_settings
from maxent_grpo.training.step.optimise import optimizer_step
from maxent_grpo.training.step.step_log import StepMetrics
from maxent_grpo.training.step.token_logps import Scorer
from maxent_grpo.training.step.trajectory import StepContext, StepTimer, collect
from tests.conftest import make_data
from tests.rollout.test_multiturn import Scripted, ids
from tests.training.step.test_step_parts import PlainOptimizer

VALUE = ["111"]
CALL = '<tool_call>{"name": "lookup", "arguments": {"key": "k"}}</tool_call>'
SEGMENT = ("\n<|im_start|>user\n<tool_response>\n111\n</tool_response><|im_end|>\n"
           "<|im_start|>assistant\n")


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: the key.
    """
    return VALUE[0]


def alternating(prompts, completions, **kw):
    return [float(i % 2 == 0) for i in range(len(completions))]


class Recording(PlainOptimizer):
    """Keeps a copy of the gradients at every ``step``."""

    def __init__(self, optimizer, policy):
        super().__init__(optimizer)
        self.policy, self.grads = policy, []

        def step():
            self.grads.append({n: p.grad.clone() for n, p in policy.named_parameters()
                               if p.grad is not None})
        self.step = step


def run_step(cache_dir, value: str, budget: int, objective):
    """One step on 2 prompts x 4 samples, every sample calling ``lookup`` (which returns
    ``value``) and, when the budget leaves room, answering "7"."""
    VALUE[0] = value
    tokenizer = load_tokenizer("builtin:tiny", cache_dir=cache_dir)
    torch.manual_seed(0)
    policy = load_policy("builtin:tiny", cache_dir=cache_dir).train()
    options = dict(
        num_generations=4, max_completion_length=budget, num_iterations=1,
        drop_constant_groups=False, refill_rounds=0, mask_truncated_completions=False,
        micro_batch_groups=1, micro_batch_tokens=None, gradient_clip_val=None,
        lr_warmup_steps=0, fused_lm_head=None, max_consecutive_nonfinite=3,
        eval_num_generations=2, eval_reward=None, eval_correct_threshold=1.0, eval_k=None,
        eval_greedy=False, temperature=1.0, top_p=1.0, top_k=0, max_prompt_length=32,
        lr_scheduler=None, sampler_correction=None, sampler_correction_cap=2.0,
        tools=["tests.training.step.test_tool_masking:lookup"], objective=objective,
    )
    rewards = WeightedRewards({"tests.training.step.test_tool_masking:alternating": 1.0})
    loop = build_loop_settings(options, rewards.names)
    sampling = loop.generation.sampling
    engine = MultiTurnEngine(Scripted([CALL, "7"]), tokenizer, sampling,
                             toolbox=Toolbox([lookup]))
    optimizer = Recording(torch.optim.SGD(policy.parameters(), lr=0.0), policy)
    ctx = StepContext(
        engine=engine, rewards=rewards, scorer=Scorer(1.0, loop.scoring, None),
        objective=objective, policy=policy,
        reference=load_policy("builtin:tiny", cache_dir=cache_dir) if objective.needs_reference
        else None, generation=loop.generation, schedule=loop.optimization.schedule,
        strategy=SingleDeviceStrategy(torch.device("cpu")), backward=lambda loss: loss.backward(),
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.ConstantLR(optimizer.optimizer, factor=1.0,
                                                      total_iters=0), step=0)
    data = make_data(cache_dir)
    data.setup("fit")
    batch = collate_prompts(data.train_dataset.examples[:2])
    timer = StepTimer(torch.device("cpu"))
    trajectory = collect(ctx, batch, timer)
    optimizer_step(ctx, trajectory, StepMetrics(rewards.names), timer)
    return trajectory, optimizer.grads[0]


OBJECTIVES = {
    "grpo_dapo": lambda: GRPO(loss_type="dapo", beta=0.1),
    "grpo_dr": lambda: GRPO(loss_type="dr_grpo"),
    "entropy_maxent": lambda: EntropyMaxEnt(),
    "listwise": lambda: ListwiseMaxEnt(tau=0.5, beta=0.05),
    "group_maxent": lambda: GroupMaxEnt(),
}


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_a_tool_output_changes_no_gradient_but_through_later_model_tokens(cache_dir, name):
    call = len(ids(CALL)) + 1  # the call and its end of turn
    segment = len(ids(SEGMENT))
    # the row ends with the tool's message: nothing the model wrote comes after it
    t1, g1 = run_step(cache_dir, "111", call + segment, OBJECTIVES[name]())
    t2, g2 = run_step(cache_dir, "999", call + segment, OBJECTIVES[name]())
    assert not torch.equal(t1.input_ids, t2.input_ids)  # the tool's tokens differ
    assert bool(t1.rollout.tool_mask[:, call:].all()) and bool(t1.rollout.truncated.all())
    # the loss sees only the model's tokens, in every count an objective reads
    assert t1.mask.sum(1).tolist() == [call] * 8 and int(t1.num_global_tokens) == 8 * call
    assert t1.loss_mask[:, call:].sum() == 0
    assert set(g1) == set(g2) and all(torch.equal(g1[k], g2[k]) for k in g1)
    assert any(bool(g.abs().sum() > 0) for g in g1.values())  # a gradient there is
    # the model answers after the message: its answer's log-prob reads the tool's output
    t3, g3 = run_step(cache_dir, "111", call + segment + 4, OBJECTIVES[name]())
    t4, g4 = run_step(cache_dir, "999", call + segment + 4, OBJECTIVES[name]())
    assert t3.mask.sum(1).tolist() == [call + 2] * 8  # "7" and its end of turn
    assert not t3.rollout.truncated.any()
    assert any(not torch.equal(g3[k], g4[k]) for k in g3)


def test_exchanges_that_differ_only_in_what_a_tool_returned_are_distinct_candidates(
        cache_dir, monkeypatch):
    """Every sample writes the same tokens, but each call returns another value: the
    exchanges differ, so each is its own candidate (compared over the model's tokens only,
    all but the first of a group were dropped as duplicates, with their rewards)."""
    import itertools

    counter = itertools.count()

    def lookup(key: str) -> str:
        """Look a key up.

        Args:
            key: the key.
        """
        return str(100 + next(counter))

    seen = []

    class Recorder(ListwiseMaxEnt):
        def prepare(self, inputs):
            seen.append(inputs.candidates.clone())
            return super().prepare(inputs)

    monkeypatch.setitem(globals(), "lookup", lookup)  # the module run_step reads it from
    budget = len(ids(CALL)) + 1 + len(ids(SEGMENT)) + 4  # the call, its answer, then "7"
    trajectory, _ = run_step(cache_dir, "unused", budget,
                             Recorder(tau=0.5, distinct_candidates=True))
    assert next(counter) == 8  # every sample called the tool
    assert len(set(map(tuple, trajectory.input_ids.tolist()))) == 8
    assert bool(seen[0].all()), seen

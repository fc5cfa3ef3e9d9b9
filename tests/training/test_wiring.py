"""The step is wired the right way round: an update raises the log-probability of what was
rewarded (for every objective), and a rollout reused for several optimizer steps keeps its
behaviour log-probs. A flipped advantage, or a rollout regenerated between iterations,
fails these tests; "some parameter moved" would not."""

from __future__ import annotations

import pytest
import torch

from maxent_grpo.objectives import GRPO, EntropyMaxEnt, GroupMaxEnt, ListwiseMaxEnt
from tests.conftest import fit, make_data, make_module


def sequence_logps(policy, trajectory) -> torch.Tensor:
    """``(N,)`` summed log-probs of each kept row's completion under ``policy`` (temperature 1)."""
    ids, attention, mask = trajectory.input_ids, trajectory.attention, trajectory.mask
    with torch.no_grad():
        logits = policy(input_ids=ids, attention_mask=attention).logits.float()
    T = mask.shape[1]
    logps = torch.log_softmax(logits[:, -T - 1:-1], dim=-1)
    token = logps.gather(-1, ids[:, -T:].unsqueeze(-1)).squeeze(-1)
    return (token * mask).sum(-1)


OBJECTIVES = {
    "grpo": GRPO(),
    "dr_grpo": GRPO(loss_type="dr_grpo", scale_rewards="none"),
    "dapo+kl": GRPO(loss_type="dapo", beta=0.05, kl_estimator="k3"),
    "bnpo": GRPO(loss_type="bnpo"),
    "entropy": EntropyMaxEnt(alpha=0.01),
    "listwise": ListwiseMaxEnt(tau=0.5, beta=0.1),
    "group": GroupMaxEnt(tau=0.5),
}


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_one_step_raises_what_was_rewarded(cache_dir, name):
    """After one small SGD step, the rows rewarded above their group's mean gained
    log-probability relative to the others: ``sum_i (r_i - mean_g r) * delta logp_i > 0``.
    To first order this is ``lr * |sum_i A_i grad logp_i|^2`` for every objective here, so it
    is positive unless the update points the wrong way (a flipped advantage makes it
    negative)."""
    import copy

    module = make_module(cache_dir, objective=copy.deepcopy(OBJECTIVES[name]),
                         rewards={"tests.conftest:alternating": 1.0},
                         optimizer=lambda p: torch.optim.SGD(p, lr=0.02))
    module.configure_model()
    before = copy.deepcopy(module.policy)
    fit(module, make_data(cache_dir), steps=1)
    trajectory = module.trajectory
    assert trajectory.keep.all() and trajectory.num_rows == trajectory.rewards.numel()
    rewards = trajectory.rewards.float()
    centred = (rewards - rewards.mean(dim=1, keepdim=True)).reshape(-1)
    assert centred.abs().sum() > 0
    delta = sequence_logps(module.policy, trajectory) - sequence_logps(before, trajectory)
    assert delta.abs().max() > 1e-6, "the step changed nothing"
    moved = float((centred * delta).sum())
    assert moved > 0, f"the update lowered the rewarded rows: sum A * dlogp = {moved:.3g}"


class Recording(GRPO):
    """GRPO that keeps, per loss call, what it was given (detached)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.calls: list[dict] = []

    def loss(self, mb):
        self.calls.append({"logps": mb.token_logps.detach().clone(),
                           "old": None if mb.old_token_logps is None
                           else mb.old_token_logps.clone(),
                           "advantages": mb.advantages.clone()})
        return super().loss(mb)


def test_a_rollout_reused_keeps_its_behaviour_logps(cache_dir):
    """``num_iterations = 2``: both optimizer steps see the same rollout (same advantages,
    same old log-probs), the old log-probs are the policy's before the first step, and the
    second step's policy log-probs have moved away from them (so the ratio is not 1)."""
    objective = Recording()
    module = make_module(cache_dir, objective=objective, num_iterations=2,
                         micro_batch_groups=2, rewards={"tests.conftest:alternating": 1.0},
                         optimizer=lambda p: torch.optim.SGD(p, lr=0.05))
    trainer = fit(module, make_data(cache_dir), steps=2)
    assert trainer.global_step == 2
    calls = objective.calls
    assert len(calls) == 4  # two micro-batches, two iterations
    first, second = calls[:2], calls[2:]
    for a, b in zip(first, second, strict=True):
        assert a["old"] is not None and b["old"] is not None
        torch.testing.assert_close(b["old"], a["old"], rtol=0, atol=0)
        torch.testing.assert_close(b["advantages"], a["advantages"], rtol=0, atol=0)
        # the first iteration runs at the behaviour policy: ratio 1
        torch.testing.assert_close(a["logps"], a["old"], rtol=1e-5, atol=1e-5)
    moved = max(float((b["logps"] - b["old"]).abs().max()) for b in second)
    assert moved > 1e-4, "the second iteration scored the rollout with the old weights"

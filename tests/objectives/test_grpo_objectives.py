"""GRPO and EntropyMaxEnt: prepare and loss against naive float64 formulas."""

from __future__ import annotations

import math

import pytest
import torch

from maxent_grpo import core
from maxent_grpo.objectives import GRPO, EntropyMaxEnt, GroupInputs, MicroBatch
from tests.objectives.conftest import (
    F64,
    G2,
    LENGTHS,
    LOSS_TYPES,
    REWARDS,
    T4,
    T_MAX5,
    _grpo_setup,
    _k3,
    _mask,
    _mb,
    _naive_adv,
    _old_or_none,
    _row_weight,
)

# ------------------------------------------------------------------ GRPO


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_prepare_is_flat_group_advantages(scale: str) -> None:
    rewards = torch.tensor(REWARDS, dtype=F64)
    targets = GRPO(scale_rewards=scale).prepare(
        GroupInputs(rewards, torch.ones_like(rewards), T_MAX5, None))
    assert targets.weights is None
    assert torch.equal(targets.advantages, core.group_advantages(rewards, scale=scale).reshape(-1))
    assert targets.advantages.tolist() == pytest.approx(_naive_adv(REWARDS, scale), abs=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.3])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_grpo_loss_matches_naive_at_ratio_one(loss_type: str, beta: float) -> None:
    logps, ref, mask, adv = _grpo_setup(beta)
    n = logps.shape[0]
    x = logps.clone().requires_grad_(True)
    obj = GRPO(loss_type=loss_type, beta=beta)
    out = obj.loss(_mb(x, mask, G=G2, num_rows=n, t_max=T_MAX5, advantages=adv, ref=ref,
                       num_global_tokens=mask.sum()))
    out.loss.backward()

    lp, A = logps.tolist(), adv.tolist()
    rf = ref.tolist() if ref is not None else None
    rw = _row_weight(loss_type, LENGTHS, n, T_MAX5)
    value = 0.0
    grad = torch.zeros_like(logps)
    for i in range(n):
        for t in range(LENGTHS[i]):
            per_tok = -A[i]  # ratio == 1: -min(A, clip(1)*A) = -A
            d_tok = -A[i]
            if beta > 0:
                per_tok += beta * _k3(lp[i][t], rf[i][t])
                d_tok += beta * (1.0 - math.exp(rf[i][t] - lp[i][t]))  # d k3 / d logp
            value += rw[i] * per_tok
            grad[i, t] = rw[i] * d_tok
    assert out.loss.item() == pytest.approx(value, rel=1e-12, abs=1e-14)
    assert torch.allclose(x.grad, grad, rtol=1e-10, atol=1e-14)
    # masked positions (incl. the fully masked row) get no gradient
    assert torch.equal(x.grad[~mask], torch.zeros_like(x.grad[~mask]))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_grpo_sampler_correction_weights_each_tokens_policy_loss(loss_type: str) -> None:
    """With ``MicroBatch.correction`` w the per-token policy loss is ``-w*A`` (ratio 1), the
    KL term unweighted; value and gradient against the naive float64 sum."""
    beta = 0.3
    logps, ref, mask, adv = _grpo_setup(beta)
    n = logps.shape[0]
    w = torch.rand(n, T4, dtype=F64, generator=torch.Generator().manual_seed(3)) * 2
    x = logps.clone().requires_grad_(True)
    out = GRPO(loss_type=loss_type, beta=beta).loss(_mb(
        x, mask, G=G2, num_rows=n, t_max=T_MAX5, advantages=adv, ref=ref,
        num_global_tokens=mask.sum(), correction=w))
    out.loss.backward()
    lp, rf, A, W = logps.tolist(), ref.tolist(), adv.tolist(), w.tolist()
    rw = _row_weight(loss_type, LENGTHS, n, T_MAX5)
    value, grad = 0.0, torch.zeros_like(logps)
    for i in range(n):
        for t in range(LENGTHS[i]):
            value += rw[i] * (-W[i][t] * A[i] + beta * _k3(lp[i][t], rf[i][t]))
            grad[i, t] = rw[i] * (-W[i][t] * A[i] + beta * (1.0 - math.exp(rf[i][t] - lp[i][t])))
    assert out.loss.item() == pytest.approx(value, rel=1e-12, abs=1e-14)
    assert torch.allclose(x.grad, grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_grpo_beta_adds_beta_times_reduced_k3(loss_type: str) -> None:
    logps, ref, mask, adv = _grpo_setup(0.3)
    n = logps.shape[0]

    def run(beta: float) -> float:
        mb = _mb(logps, mask, G=G2, num_rows=n, t_max=T_MAX5, advantages=adv, ref=ref,
                 num_global_tokens=mask.sum())
        return GRPO(loss_type=loss_type, beta=beta).loss(mb).loss.item()

    rw = _row_weight(loss_type, LENGTHS, n, T_MAX5)
    lp, rf = logps.tolist(), ref.tolist()
    k3 = sum(rw[i] * _k3(lp[i][t], rf[i][t]) for i in range(n) for t in range(LENGTHS[i]))
    # beta = 0 with a reference passed: KL is logged, not added.
    assert run(0.7) - run(0.0) == pytest.approx(0.7 * k3, rel=1e-10)


def test_grpo_clipped_surrogate_with_old_logps_matches_naive() -> None:
    logps, _, mask, adv = _grpo_setup(0.0)
    n = logps.shape[0]
    gen = torch.Generator().manual_seed(10)
    old = logps + 0.4 * torch.randn(logps.shape, generator=gen, dtype=F64)
    obj = GRPO(loss_type="dr_grpo", epsilon=0.2, epsilon_high=0.28)
    out = obj.loss(_mb(logps.clone(), mask, G=G2, num_rows=n, t_max=T_MAX5, advantages=adv,
                       old=old))
    lp, ol, A = logps.tolist(), old.tolist(), adv.tolist()
    value, low, high = 0.0, 0, 0
    for i in range(n):
        for t in range(LENGTHS[i]):
            c = math.exp(lp[i][t] - ol[i][t])
            value -= min(c * A[i], min(max(c, 0.8), 1.28) * A[i])
            low += c < 0.8 and A[i] < 0
            high += c > 1.28 and A[i] > 0
    value /= n * T_MAX5
    assert out.loss.item() == pytest.approx(value, rel=1e-12)
    assert low > 0 and high > 0  # the fixture exercises both clip sides
    n_tok = float(sum(LENGTHS))
    s_low, c_low = out.sums["clip/low"]
    s_high, c_high = out.sums["clip/high"]
    assert (s_low.item(), c_low.item()) == (low, n_tok)  # counts, exactly (not a fraction
    assert (s_high.item(), c_high.item()) == (high, n_tok)  # times the count: 1e-8 off)


@pytest.mark.parametrize("old_kind", ["none", "perturbed"])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_grpo_micro_batches_sum_to_whole(loss_type: str, old_kind: str) -> None:
    logps, ref, mask, adv = _grpo_setup(0.3)
    old = _old_or_none(old_kind, logps)
    n = logps.shape[0]
    obj = GRPO(loss_type=loss_type, beta=0.3)
    ngt = mask.sum()

    def mb(x: torch.Tensor, rows: slice, k: int) -> MicroBatch:
        return _mb(x[rows], mask[rows], G=G2, num_rows=n, t_max=T_MAX5, advantages=adv[rows],
                   old=None if old is None else old[rows], ref=ref[rows],
                   num_micro_batches=k, num_global_tokens=ngt)

    whole_x = logps.clone().requires_grad_(True)
    whole = obj.loss(mb(whole_x, slice(0, n), 1)).loss
    whole.backward()
    parts_x = logps.clone().requires_grad_(True)
    parts = obj.loss(mb(parts_x, slice(0, 2), 2)).loss + obj.loss(mb(parts_x, slice(2, 6), 2)).loss
    parts.backward()
    assert parts.item() == pytest.approx(whole.item(), rel=1e-12, abs=1e-15)
    assert torch.allclose(parts_x.grad, whole_x.grad, rtol=1e-12, atol=1e-15)


def test_grpo_bnpo_is_mean_of_micro_batch_token_means() -> None:
    logps, _, mask, adv = _grpo_setup(0.0)
    n = logps.shape[0]
    obj = GRPO(loss_type="bnpo")
    parts = [
        obj.loss(_mb(logps[r], mask[r], G=G2, num_rows=n, t_max=T_MAX5, advantages=adv[r],
                     num_micro_batches=2)).loss.item()
        for r in (slice(0, 2), slice(2, 6))
    ]
    A = adv.tolist()

    def token_mean(rows: range) -> float:
        return sum(-A[i] * LENGTHS[i] for i in rows) / sum(LENGTHS[i] for i in rows)

    expected = 0.5 * (token_mean(range(0, 2)) + token_mean(range(2, 6)))
    assert sum(parts) == pytest.approx(expected, rel=1e-12)
    # ... which is not the whole-batch token mean (the check has power).
    assert sum(parts) != pytest.approx(token_mean(range(6)), rel=1e-6)


# ------------------------------------------------------------------ EntropyMaxEnt


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_entropy_maxent_loss_is_grpo_minus_alpha_entropy(loss_type: str) -> None:
    logps, ref, mask, adv = _grpo_setup(0.2)
    n = logps.shape[0]
    gen = torch.Generator().manual_seed(3)
    ent = 2.0 * torch.rand(n, T4, generator=gen, dtype=F64)
    h = ent.clone().requires_grad_(True)
    kw = dict(G=G2, num_rows=n, t_max=T_MAX5, advantages=adv, ref=ref,
              num_global_tokens=mask.sum())
    base = GRPO(loss_type=loss_type, beta=0.2).loss(_mb(logps, mask, **kw)).loss.item()
    out = EntropyMaxEnt(alpha=0.05, loss_type=loss_type, beta=0.2).loss(
        _mb(logps, mask, entropy=h, **kw))
    out.loss.backward()
    rw = _row_weight(loss_type, LENGTHS, n, T_MAX5)
    e = ent.tolist()
    reduced_h = sum(rw[i] * e[i][t] for i in range(n) for t in range(LENGTHS[i]))
    assert out.loss.item() == pytest.approx(base - 0.05 * reduced_h, rel=1e-12)
    expected_grad = torch.tensor([[-0.05 * rw[i] * (t < LENGTHS[i]) for t in range(T4)]
                                  for i in range(n)], dtype=F64)
    assert torch.allclose(h.grad, expected_grad, rtol=1e-12, atol=1e-15)
    s, c = out.sums["entropy"]
    assert (s.item(), c.item()) == pytest.approx(
        (sum(e[i][t] for i in range(n) for t in range(LENGTHS[i])), float(sum(LENGTHS))))


def test_entropy_maxent_requires_entropy() -> None:
    logps, _, mask, adv = _grpo_setup(0.0)
    with pytest.raises(RuntimeError, match="entropy"):
        EntropyMaxEnt().loss(_mb(logps, mask, G=G2, num_rows=6, t_max=T_MAX5, advantages=adv))


def test_entropy_gate_observe() -> None:
    # kappa = 0.1, g = 1, bounds [0.25, 1.8]
    kw = dict(alpha=0.2, kl_gate_threshold=0.1, kl_gate_gain=1.0,
              kl_gate_min_multiplier=0.25, kl_gate_max_multiplier=1.8)
    obj = EntropyMaxEnt(**kw)
    assert obj.alpha_effective == 0.2  # first step: no gate
    obj.observe({"train/kl": 0.05})  # below: 1 + (0.1 - 0.05)/0.1 = 1.5
    assert obj.alpha_effective == pytest.approx(0.2 * 1.5)
    obj.observe({"train/kl": 0.0})  # below: 2, clipped to m_hi = 1.8
    assert obj.alpha_effective == pytest.approx(0.2 * 1.8)
    obj.observe({"train/kl": 0.2})  # above: 1 / (1 + (0.2 - 0.1)/0.1) = 0.5
    assert obj.alpha_effective == pytest.approx(0.2 * 0.5)
    obj.observe({"train/kl": 1.0})  # above: 1/10, clipped to m_lo = 0.25
    assert obj.alpha_effective == pytest.approx(0.2 * 0.25)
    obj.observe({"train/kl": math.nan})  # non-finite counts as above: 0 -> m_lo
    assert obj.alpha_effective == pytest.approx(0.2 * 0.25)

    off = EntropyMaxEnt(**kw, disable_outside_trust_zone=True)
    off.observe({"train/kl": 0.2})
    assert off.alpha_effective == 0.0
    off.observe({"train/kl": 0.05})
    assert off.alpha_effective == pytest.approx(0.3)

    ungated = EntropyMaxEnt(alpha=0.2)
    ungated.observe({"train/kl": 5.0})  # no threshold: no-op
    assert ungated.alpha_effective == 0.2


def test_entropy_gate_changes_the_loss() -> None:
    logps, ref, mask, adv = _grpo_setup(0.2)
    n = logps.shape[0]
    ent = torch.full((n, T4), 0.7, dtype=F64)
    obj = EntropyMaxEnt(alpha=0.2, kl_gate_threshold=0.1, loss_type="dr_grpo")
    mb = _mb(logps, mask, G=G2, num_rows=n, t_max=T_MAX5, advantages=adv, ref=ref, entropy=ent)
    grpo = GRPO(loss_type="dr_grpo").loss(mb).loss.item()
    reduced_h = 0.7 * sum(LENGTHS) / (n * T_MAX5)
    assert obj.loss(mb).loss.item() == pytest.approx(grpo - 0.2 * reduced_h, rel=1e-12)
    obj.observe({"train/kl": 0.2})  # multiplier 0.5
    assert obj.loss(mb).loss.item() == pytest.approx(grpo - 0.1 * reduced_h, rel=1e-12)
    off = EntropyMaxEnt(alpha=0.2, kl_gate_threshold=0.1, disable_outside_trust_zone=True,
                        loss_type="dr_grpo")
    off.observe({"train/kl": 0.2})
    assert off.loss(mb).loss.item() == pytest.approx(grpo, rel=1e-12)


@pytest.mark.parametrize("clip_rule", ["ppo", "cispo"])
def test_clip_counts_are_whole_numbers_of_tokens(clip_rule) -> None:
    """The clip entries of ``LossOutput.sums`` are ``(clipped tokens, tokens)``: they were a
    float32 fraction times the token count (7/13 * 13 was 7.0000005), so the logged
    fraction changed with the micro-batch split by about 1e-8."""
    n, T = 2, 13
    logps = torch.zeros(n, T, dtype=F64)
    old = torch.zeros(n, T, dtype=F64)
    old[0, :7] = -1.0  # ratio e > 1.28 on 7 of row 0's tokens, advantage > 0
    mask = _mask([13, 0], T)
    out = GRPO(epsilon=0.2, epsilon_high=0.28, clip_rule=clip_rule).loss(
        _mb(logps, mask, G=2, num_rows=n, t_max=T, advantages=torch.tensor([1.0, -1.0],
            dtype=F64), old=old))
    clipped, tokens = out.sums["clip/high"]
    assert (clipped.item(), tokens.item()) == (7.0, 13.0)
    assert out.sums["clip/total"][0].item() == 7.0

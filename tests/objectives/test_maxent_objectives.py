"""ListwiseMaxEnt and GroupMaxEnt: weights, losses and gradients against naive float64
formulas."""

from __future__ import annotations

import math

import pytest
import torch

from maxent_grpo import core
from maxent_grpo.objectives import GRPO, GroupInputs, GroupMaxEnt, ListwiseMaxEnt, MicroBatch
from tests.objectives.conftest import (
    F64,
    G2,
    LENGTHS,
    REWARDS,
    T_MAX5,
    _grpo_setup,
    _k3,
    _logps,
    _mask,
    _mb,
    _old_or_none,
    _softmax,
)

# ------------------------------------------------------------------ ListwiseMaxEnt

# B = 3 groups of G = 3, T = 4; every row has at least one token.
LW_G = 3
LW_LENGTHS = [4, 2, 3, 1, 4, 2, 3, 3, 1]
LW_REWARDS = [[1.0, 0.0, 0.5], [2.0, 2.0, -1.0], [0.0, 1.0, 3.0]]
LW_RHO = [[-0.5, -1.0, -0.2], [-2.0, -0.1, -0.7], [-0.3, -0.3, -1.5]]


def _naive_listwise_weights(tau: float, beta: float, tq: float, eps: float) -> list[list[float]]:
    out = []
    for r, rho in zip(LW_REWARDS, LW_RHO, strict=True):
        G = len(r)
        floor = min(eps, 1.0 / G - 1e-8)
        q = [v * (1 - G * floor) + floor for v in _softmax([x / tq for x in r])]
        out.append(_softmax([(math.log(qi) + beta * p) / (tau + beta)
                             for qi, p in zip(q, rho, strict=True)]))
    return out


@pytest.mark.parametrize(("tau", "beta", "tq"), [(0.5, 0.0, 1.0), (0.3, 0.2, 0.5)])
def test_listwise_prepare_weights_and_stats(tau: float, beta: float, tq: float) -> None:
    obj = ListwiseMaxEnt(tau=tau, beta=beta, q_temperature=tq)
    rewards = torch.tensor(LW_REWARDS, dtype=F64)
    rho = torch.tensor(LW_RHO, dtype=F64)
    targets = obj.prepare(GroupInputs(rewards, torch.ones_like(rewards), 4, rho))
    w = targets.weights
    assert targets.advantages is None
    q = core.q_distribution(rewards, tq, 1e-6)
    assert torch.equal(w, core.maxent_weights(q.log(), tau, beta, rho if beta > 0 else None))
    naive = _naive_listwise_weights(tau, beta, tq, 1e-6)
    assert torch.allclose(w, torch.tensor(naive, dtype=F64), rtol=1e-10, atol=1e-14)
    assert torch.allclose(w.sum(-1), torch.ones(3, dtype=F64), atol=1e-12)
    h = [-sum(x * math.log(x) for x in row) for row in naive]
    assert targets.stats["weight_entropy"].item() == pytest.approx(sum(h) / 3, rel=1e-10)
    assert targets.stats["weight_entropy_min"].item() == pytest.approx(min(h), rel=1e-10)
    assert targets.stats["weight_entropy_max"].item() == pytest.approx(max(h), rel=1e-10)


def test_listwise_targets_carry_q() -> None:
    rewards = torch.tensor(LW_REWARDS, dtype=F64)
    ones = torch.ones_like(rewards)
    targets = ListwiseMaxEnt(tau=0.5, q_temperature=0.5).prepare(
        GroupInputs(rewards, ones, 4, None))
    assert torch.equal(targets.q, core.q_distribution(rewards, 0.5, 1e-6))
    assert torch.allclose(targets.q.sum(-1), torch.ones(3, dtype=F64), atol=1e-12)
    # with distinct candidates q lives on the candidates only
    cand = torch.tensor([[True, True, False], [True, False, True], [True, True, True]])
    obj = ListwiseMaxEnt(tau=0.5, distinct_candidates=True)
    targets = obj.prepare(GroupInputs(rewards, ones, 4, None, cand))
    assert torch.equal(targets.q, core.q_distribution(rewards, obj.q_temperature, 1e-6, cand))
    assert torch.equal(targets.candidates, cand)
    # the trainer always gives the candidates: without distinct_candidates they are ignored
    plain = ListwiseMaxEnt(tau=0.5)
    given = plain.prepare(GroupInputs(rewards, ones, 4, None, cand))
    assert given.candidates is None
    assert torch.equal(given.weights, plain.prepare(GroupInputs(rewards, ones, 4, None)).weights)
    # the other objectives have no target distribution
    assert GRPO().prepare(GroupInputs(rewards, ones, 4, None)).q is None
    assert GroupMaxEnt().prepare(GroupInputs(rewards, ones, 4, None)).q is None


def test_listwise_prepare_ignores_reference_when_beta_zero() -> None:
    obj = ListwiseMaxEnt(tau=0.5)
    rewards = torch.tensor(LW_REWARDS, dtype=F64)
    with_rho = obj.prepare(
        GroupInputs(rewards, torch.ones_like(rewards), 4, torch.tensor(LW_RHO, dtype=F64)))
    without = obj.prepare(GroupInputs(rewards, torch.ones_like(rewards), 4, None))
    assert torch.equal(with_rho.weights, without.weights)


def _listwise_setup(seed: int = 5):
    obj_w = ListwiseMaxEnt(tau=0.5).prepare(GroupInputs(
        torch.tensor(LW_REWARDS, dtype=F64), torch.ones(3, 3, dtype=F64), 4, None
    )).weights
    return _logps(seed, 9, 4), _mask(LW_LENGTHS, 4), obj_w


def _naive_seq(logps: torch.Tensor, lengths: list[int], normalize: bool) -> list[float]:
    lp = logps.tolist()
    return [sum(lp[i][:n]) / (n if normalize else 1) for i, n in enumerate(lengths)]


@pytest.mark.parametrize("normalize", [False, True])
def test_listwise_loss_and_gradient_match_naive(normalize: bool) -> None:
    logps, mask, w = _listwise_setup()
    x = logps.clone().requires_grad_(True)
    obj = ListwiseMaxEnt(tau=0.5, length_normalize=normalize)
    out = obj.loss(_mb(x, mask, G=LW_G, num_rows=9, t_max=4, weights=w))
    out.loss.backward()
    s = _naive_seq(logps, LW_LENGTHS, normalize)
    W = w.tolist()
    B = 3
    value = 0.0
    grad = torch.zeros_like(logps)
    for b in range(B):
        sg = s[b * LW_G:(b + 1) * LW_G]
        p = _softmax(sg)
        top = max(sg)
        lse = top + math.log(sum(math.exp(v - top) for v in sg))
        value += -sum(W[b][i] * (sg[i] - lse) for i in range(LW_G)) / B
        for i in range(LW_G):
            row = b * LW_G + i
            n = LW_LENGTHS[row]
            # d loss / d s_i = (p_i - w_i) / B; each masked token carries it (/T_i if normalised)
            grad[row, :n] = (p[i] - W[b][i]) / B / (n if normalize else 1)
    assert out.loss.item() == pytest.approx(value, rel=1e-12)
    assert torch.allclose(x.grad, grad, rtol=1e-10, atol=1e-14)
    s_pol, c_pol = out.sums["loss/policy"]
    assert (s_pol.item(), c_pol.item()) == pytest.approx((value * B, B))


@pytest.mark.parametrize("clip_coef", [0.0, 0.5])
def test_listwise_micro_batches_sum_to_whole(clip_coef: float) -> None:
    logps, mask, w = _listwise_setup()
    gen = torch.Generator().manual_seed(2)
    old = logps + 0.3 * torch.randn(logps.shape, generator=gen, dtype=F64)
    obj = ListwiseMaxEnt(tau=0.5, clip_coef=clip_coef)

    def mb(x: torch.Tensor, groups: slice, k: int) -> MicroBatch:
        rows = slice(groups.start * LW_G, groups.stop * LW_G)
        return _mb(x[rows], mask[rows], G=LW_G, num_rows=9, t_max=4, weights=w[groups],
                   old=old[rows], num_micro_batches=k)

    whole_x = logps.clone().requires_grad_(True)
    whole = obj.loss(mb(whole_x, slice(0, 3), 1))
    whole.loss.backward()
    parts_x = logps.clone().requires_grad_(True)
    outs = [obj.loss(mb(parts_x, slice(0, 1), 2)), obj.loss(mb(parts_x, slice(1, 3), 2))]
    parts = outs[0].loss + outs[1].loss
    parts.backward()
    assert parts.item() == pytest.approx(whole.loss.item(), rel=1e-12)
    assert torch.allclose(parts_x.grad, whole_x.grad, rtol=1e-12, atol=1e-15)
    for key in whole.sums:
        total = sum(o.sums[key][0] for o in outs)
        count = sum(o.sums[key][1] for o in outs)
        assert (total.item(), count.item()) == pytest.approx(
            (whole.sums[key][0].item(), whole.sums[key][1].item()), rel=1e-10)


def test_listwise_clip_term_is_zero_at_old_equals_current() -> None:
    logps, mask, w = _listwise_setup()
    B = 3
    kw = dict(G=LW_G, num_rows=9, t_max=4, weights=w)
    x0 = logps.clone().requires_grad_(True)
    plain = ListwiseMaxEnt(tau=0.5, length_normalize=False).loss(_mb(x0, mask, **kw)).loss
    plain.backward()
    for old in (None, logps.clone()):
        x = logps.clone().requires_grad_(True)
        out = ListwiseMaxEnt(tau=0.5, clip_coef=0.5, length_normalize=False).loss(
            _mb(x, mask, old=old, **kw))
        # -mean_groups sum_i (w_i - 1/G) * 1 = 0, since each row of w sums to 1
        assert out.sums["loss/clip"][0].item() == pytest.approx(0.0, abs=1e-14)
        assert out.loss.item() == pytest.approx(plain.item(), rel=1e-12)
        out.loss.backward()
        # ... but its gradient on s_i is -(w_i - 1/G)/B, carried by every masked token
        a_hat = (w - 1.0 / LW_G).reshape(-1, 1).expand(9, 4)
        expected = x0.grad - 0.5 * a_hat / B * mask
        assert torch.allclose(x.grad, expected, rtol=1e-10, atol=1e-14)


def test_listwise_clip_term_with_old_logps_matches_naive() -> None:
    logps, mask, w = _listwise_setup()
    gen = torch.Generator().manual_seed(4)
    old = logps + 0.3 * torch.randn(logps.shape, generator=gen, dtype=F64)
    obj = ListwiseMaxEnt(tau=0.5, clip_coef=0.5, epsilon=0.2, epsilon_high=0.3,
                         length_normalize=False)
    out = obj.loss(_mb(logps, mask, G=LW_G, num_rows=9, t_max=4, weights=w, old=old))
    s = _naive_seq(logps, LW_LENGTHS, False)
    s_old = _naive_seq(old, LW_LENGTHS, False)
    W = w.tolist()
    B = 3
    ce, clip, n_clipped = 0.0, 0.0, 0
    for b in range(B):
        sg = s[b * LW_G:(b + 1) * LW_G]
        p = _softmax(sg)
        ce += -sum(W[b][i] * math.log(p[i]) for i in range(LW_G)) / B
        for i in range(LW_G):
            a = W[b][i] - 1.0 / LW_G
            r = math.exp(sg[i] - s_old[b * LW_G + i])
            n_clipped += not 0.8 <= r <= 1.3
            clip += -min(r * a, min(max(r, 0.8), 1.3) * a) / B
    assert n_clipped > 0  # the fixture reaches the clip range
    assert out.sums["loss/clip"][0].item() / B == pytest.approx(clip, rel=1e-10)
    assert out.loss.item() == pytest.approx(ce + 0.5 * clip, rel=1e-10)


def test_listwise_logs_kl_when_reference_given() -> None:
    logps, mask, w = _listwise_setup()
    ref = _logps(9, 9, 4)
    out = ListwiseMaxEnt(tau=0.1, beta=0.2).loss(
        _mb(logps, mask, G=LW_G, num_rows=9, t_max=4, weights=w, ref=ref))
    lp, rf = logps.tolist(), ref.tolist()
    k3 = sum(_k3(lp[i][t], rf[i][t]) for i in range(9) for t in range(LW_LENGTHS[i]))
    s, c = out.sums["kl"]
    assert (s.item(), c.item()) == pytest.approx((k3, float(sum(LW_LENGTHS))), rel=1e-6)


# ------------------------------------------------------------------ GroupMaxEnt

GM_REWARDS = [[1.0, 0.0, 0.0, 1.0]]
GM_LENGTHS = [3, 2, 3, 1]
GM_EXPECTED_GW = [1.8902112237, 0.5415545827, 0.4217631331, 1.1464710605]  # docs/ALGORITHM.md §4.4


def _gm_prepare(obj: GroupMaxEnt, rho: torch.Tensor | None = None):
    rewards = torch.tensor(GM_REWARDS, dtype=F64)
    lengths = torch.tensor([GM_LENGTHS], dtype=F64)
    return obj.prepare(GroupInputs(rewards, lengths, 4, rho))


def test_group_maxent_prepare_reproduces_spec_example() -> None:
    targets = _gm_prepare(GroupMaxEnt(tau=0.5))
    assert targets.advantages.tolist() == [0.5, -0.5, -0.5, 0.5]
    gw = (4 * targets.weights).reshape(-1).tolist()
    assert gw == pytest.approx(GM_EXPECTED_GW, abs=1e-9)
    # by hand: U = A*T/T_max = [.375, -.25, -.375, .125]; G*softmax(U/0.5)
    naive = [4 * v for v in _softmax([0.75, -0.5, -0.75, 0.25])]
    assert gw == pytest.approx(naive, rel=1e-12)
    h = -sum(v / 4 * math.log(v / 4) for v in naive)
    assert targets.stats["weight_entropy"].item() == pytest.approx(h, rel=1e-10)


def test_group_maxent_prepare_with_reference() -> None:
    rho = torch.tensor([[-0.5, -1.0, -0.2, -2.0]], dtype=F64)
    targets = _gm_prepare(GroupMaxEnt(tau=0.5, lam=0.25), rho)
    u = [0.375, -0.25, -0.375, 0.125]
    naive = _softmax([(ui + 0.25 * p) / 0.75 for ui, p in zip(u, rho[0].tolist(), strict=True)])
    assert targets.weights.reshape(-1).tolist() == pytest.approx(naive, rel=1e-12)


def test_group_maxent_loss_at_ratio_one() -> None:
    obj = GroupMaxEnt(tau=0.5)
    targets = _gm_prepare(obj)
    logps = _logps(1, 4, 4)
    mask = _mask(GM_LENGTHS, 4)
    x = logps.clone().requires_grad_(True)
    out = obj.loss(_mb(x, mask, G=4, num_rows=4, t_max=4, advantages=targets.advantages,
                       weights=targets.weights))
    out.loss.backward()
    A = [0.5, -0.5, -0.5, 0.5]
    # sum_i G w_i sum_t m (-A_i) / (N T_max), N = T_max = 4
    value = sum(gw * n * -a for gw, n, a in zip(GM_EXPECTED_GW, GM_LENGTHS, A, strict=True)) / 16
    assert out.loss.item() == pytest.approx(value, abs=1e-10)
    grad = torch.tensor([[-gw * a / 16] * 4 for gw, a in zip(GM_EXPECTED_GW, A, strict=True)],
                        dtype=F64) * mask
    assert torch.allclose(x.grad, grad, atol=1e-10)
    # the logged policy part is the loss as trained, per token: the weights G*w_i in (it was
    # the unweighted Dr.GRPO surrogate, the same for every tau)
    s_pol, c_pol = out.sums["loss/policy"]
    assert (s_pol.item(), c_pol.item()) == pytest.approx((value * 16, sum(GM_LENGTHS)))


def test_group_maxent_micro_batches_sum_to_whole() -> None:
    obj = GroupMaxEnt(tau=0.5)
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 2.0, 1.0, 0.5]], dtype=F64)
    lengths_l = [3, 2, 3, 1, 4, 1, 2, 4]
    lengths = torch.tensor(lengths_l, dtype=F64).view(2, 4)
    targets = obj.prepare(GroupInputs(rewards, lengths, 4, None))
    logps = _logps(8, 8, 4)
    gen = torch.Generator().manual_seed(8)
    old = logps + 0.4 * torch.randn(logps.shape, generator=gen, dtype=F64)
    mask = _mask(lengths_l, 4)

    def mb(x: torch.Tensor, g: slice, k: int) -> MicroBatch:
        rows = slice(g.start * 4, g.stop * 4)
        return _mb(x[rows], mask[rows], G=4, num_rows=8, t_max=4, old=old[rows],
                   advantages=targets.advantages[rows], weights=targets.weights[g],
                   num_micro_batches=k)

    whole_x = logps.clone().requires_grad_(True)
    whole = obj.loss(mb(whole_x, slice(0, 2), 1)).loss
    whole.backward()
    parts_x = logps.clone().requires_grad_(True)
    parts = obj.loss(mb(parts_x, slice(0, 1), 2)).loss + obj.loss(mb(parts_x, slice(1, 2), 2)).loss
    parts.backward()
    assert parts.item() == pytest.approx(whole.item(), rel=1e-12)
    assert torch.allclose(parts_x.grad, whole_x.grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("old_kind", ["none", "perturbed"])
def test_group_maxent_large_tau_is_dr_grpo(old_kind: str) -> None:
    rewards = torch.tensor(REWARDS, dtype=F64)
    lengths = torch.tensor(LENGTHS, dtype=F64).view(3, 2)
    logps, _, mask, _ = _grpo_setup(0.0)
    old = _old_or_none(old_kind, logps)
    gm = GroupMaxEnt(tau=1e6)
    gm_t = gm.prepare(GroupInputs(rewards, lengths, T_MAX5, None))
    dr = GRPO(loss_type="dr_grpo", scale_rewards="none")
    dr_t = dr.prepare(GroupInputs(rewards, lengths, T_MAX5, None))
    assert torch.equal(gm_t.advantages, dr_t.advantages)
    assert torch.allclose(G2 * gm_t.weights, torch.ones(3, 2, dtype=F64), atol=1e-5)
    kw = dict(G=G2, num_rows=6, t_max=T_MAX5, old=old)
    gm_loss = gm.loss(_mb(logps, mask, advantages=gm_t.advantages, weights=gm_t.weights, **kw))
    dr_loss = dr.loss(_mb(logps, mask, advantages=dr_t.advantages, **kw))
    assert abs(dr_loss.loss.item()) > 1e-2  # non-trivial comparison
    assert gm_loss.loss.item() == pytest.approx(dr_loss.loss.item(), rel=1e-5, abs=1e-9)

"""The policy-gradient parts (docs/ALGORITHM.md §4.5), each against a float64 hand computation.

Advantage estimators (RLOO, REINFORCE++ and its baseline variant), the ratio's level
(GSPO's sequence ratio and GSPO-token), the clipping rule (CISPO), and their composition
with GRPO and GroupMaxEnt. Every expected number is written out in plain Python floats.
"""

from __future__ import annotations

import math

import pytest
import torch

from maxent_grpo.core import (
    cispo_surrogate,
    estimate_advantages,
    importance_ratio_at,
    leave_one_out_advantages,
    passk_advantages,
)
from maxent_grpo.objectives import GRPO, EntropyMaxEnt, GroupInputs, GroupMaxEnt
from tests.objectives.conftest import F64, _logps, _mask, _mb

EPS = 1e-4


def _std(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


# ------------------------------------------------------------------ advantage estimators


def test_rloo_is_the_reward_minus_the_mean_of_the_others():
    rewards = [[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0], [5.0, 5.0, 5.0, 5.0]]
    got = leave_one_out_advantages(torch.tensor(rewards, dtype=F64))
    for b, group in enumerate(rewards):
        for i, r in enumerate(group):
            others = [x for j, x in enumerate(group) if j != i]
            assert got[b, i].item() == pytest.approx(r - sum(others) / 3, abs=1e-12)
    assert got[2].abs().max().item() == 0.0  # a constant group: exactly 0


@pytest.mark.parametrize("scale", ["none", "group", "batch"])
def test_rloo_scales(scale):
    rewards = [[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 0.5]]
    loo = [[r - (sum(g) - r) / 3 for r in g] for g in rewards]
    flat = [a for g in loo for a in g]
    if scale == "none":
        expected = flat
    elif scale == "group":
        expected = [a / (_std(g) + EPS) for g, row in zip(rewards, loo, strict=True) for a in row]
    else:  # TRL's normalize_advantages: (A - mean A) / (std A + 1e-4), over the batch
        mean = sum(flat) / len(flat)
        expected = [(a - mean) / (_std(flat) + EPS) for a in flat]
    got = estimate_advantages(torch.tensor(rewards, dtype=F64), "rloo", scale).reshape(-1)
    assert got.tolist() == pytest.approx(expected, abs=1e-12)


def test_reinforce_pp_normalises_the_rewards_over_the_batch():
    rewards = [[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]
    flat = [r for g in rewards for r in g]
    mean = sum(flat) / len(flat)
    expected = [(r - mean) / (_std(flat) + EPS) for r in flat]
    got = estimate_advantages(torch.tensor(rewards, dtype=F64), "reinforce_pp")
    assert got.reshape(-1).tolist() == pytest.approx(expected, abs=1e-12)
    assert got[1, 0] > 0  # no group baseline: an all-correct group is pushed up


def test_reinforce_pp_baseline_centres_each_group_then_normalises_the_batch():
    rewards = [[1.0, 0.0, 0.0], [2.0, 2.0, 5.0]]
    centred = [r - sum(g) / len(g) for g in rewards for r in g]
    mean = sum(centred) / len(centred)
    expected = [(a - mean) / (_std(centred) + EPS) for a in centred]
    got = estimate_advantages(torch.tensor(rewards, dtype=F64), "reinforce_pp_baseline")
    assert got.reshape(-1).tolist() == pytest.approx(expected, abs=1e-12)


def test_batch_scaled_rloo_is_reinforce_pp_baseline_up_to_the_epsilon():
    """docs/ALGORITHM.md §4.5: the G/(G-1) factor of RLOO cancels in the normalisation."""
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 0.5]], dtype=F64)
    rloo = estimate_advantages(rewards, "rloo", "batch")
    baseline = estimate_advantages(rewards, "reinforce_pp_baseline")
    assert torch.allclose(rloo, baseline, rtol=1e-3) and not torch.equal(rloo, baseline)
    assert torch.allclose(estimate_advantages(rewards, "rloo", "batch", eps=0.0),
                          estimate_advantages(rewards, "reinforce_pp_baseline", eps=0.0),
                          rtol=1e-12)


def test_reinforce_pp_refuses_a_scale_it_would_ignore():
    with pytest.raises(ValueError, match="objective.scale_rewards='none' does not apply"):
        GRPO(advantage="reinforce_pp", scale_rewards="none")
    with pytest.raises(ValueError, match="objective.advantage"):
        GRPO(advantage="ppo")
    with pytest.raises(ValueError, match="objective.ratio_level"):
        GroupMaxEnt(ratio_level="seq")
    with pytest.raises(ValueError, match="objective.clip_rule"):
        EntropyMaxEnt(clip_rule="sapo")


# ------------------------------------------------------------------ ratio levels


def _pair(seed: int = 0):
    lengths = [3, 1, 0, 2]
    mask = _mask(lengths, 4)
    logps = _logps(seed, 4, 4).requires_grad_(True)
    old = (logps.detach() + 0.3 * _logps(seed + 1, 4, 4) + 0.6)
    return lengths, mask, logps, old


def test_sequence_ratio_is_gspos_length_normalised_ratio_and_its_gradient():
    lengths, mask, logps, old = _pair()
    c = importance_ratio_at(logps, old, mask, "sequence")
    g = torch.linspace(0.5, 2.0, 16, dtype=F64).view(4, 4)
    (c * g * mask).sum().backward()
    lp, old_lp = logps.detach().tolist(), old.tolist()
    for i, n in enumerate(lengths):
        d = sum(lp[i][t] - old_lp[i][t] for t in range(n))
        s = math.exp(d / max(n, 1))
        assert c[i].tolist() == pytest.approx([s] * 4, rel=1e-12)
        row_g = sum(g[i, t].item() for t in range(n))
        for t in range(4):  # d/dl_t sum_u c_u g_u = s / T_i * sum_u g_u on the mask
            want = s / n * row_g if t < n else 0.0
            assert logps.grad[i, t].item() == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_sequence_token_ratio_has_the_sequence_value_and_a_tokens_gradient():
    lengths, mask, logps, old = _pair(3)
    c = importance_ratio_at(logps, old, mask, "sequence_token")
    seq = importance_ratio_at(logps.detach(), old, mask, "sequence")
    assert torch.allclose(c.detach(), seq, rtol=1e-12)
    g = torch.linspace(-1.0, 1.0, 16, dtype=F64).view(4, 4)
    (c * g * mask).sum().backward()
    want = seq * g * mask  # d c[i,t] / d l[i,t] = s_i, no cross-token terms
    assert torch.allclose(logps.grad, want, rtol=1e-12, atol=1e-15)


def test_token_level_is_the_plain_ratio():
    _, mask, logps, old = _pair(5)
    c = importance_ratio_at(logps, old, mask, "token")
    assert torch.allclose(c, torch.exp(logps - old), rtol=1e-12)


# ------------------------------------------------------------------ CISPO


def test_cispo_keeps_the_gradient_of_capped_tokens():
    logps = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64, requires_grad=True)
    ratio = torch.tensor([[0.5, 1.1, 3.0]], dtype=F64)  # the last is above 1 + 0.28
    adv = torch.tensor([2.0], dtype=F64)
    surr = cispo_surrogate(ratio, logps, adv, eps_high=0.28)
    weights = [0.5, 1.1, 1.28]  # min(c, 1 + eps_high); no lower bound
    assert surr[0].tolist() == pytest.approx(
        [w * 2.0 * lp for w, lp in zip(weights, [-1.0, -2.0, -0.5], strict=True)], rel=1e-12)
    surr.sum().backward()
    assert logps.grad[0].tolist() == pytest.approx([w * 2.0 for w in weights], rel=1e-12)


def test_grpo_cispo_loss_and_clip_count_match_a_hand_computation():
    lengths = [3, 2]
    mask = _mask(lengths, 3)
    logps = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -1.5, -9.0]], dtype=F64,
                         requires_grad=True)
    old = torch.tensor([[-1.5, -0.4, -2.0], [-0.3, -0.2, -1.0]], dtype=F64)
    adv = torch.tensor([1.0, -0.5], dtype=F64)
    objective = GRPO(loss_type="dapo", clip_rule="cispo", epsilon_high=0.2)
    mb = _mb(logps, mask, G=2, num_rows=2, t_max=3, advantages=adv, old=old,
             num_global_tokens=torch.tensor(5.0, dtype=F64))
    out = objective.loss(mb)
    lp, old_lp = logps.detach().tolist(), old.tolist()
    total, grads, capped = 0.0, [[0.0] * 3 for _ in range(2)], 0
    for i, n in enumerate(lengths):
        for t in range(n):
            c = math.exp(lp[i][t] - old_lp[i][t])
            w = min(c, 1.2)
            capped += c > 1.2
            total += -w * adv[i].item() * lp[i][t]
            grads[i][t] = -w * adv[i].item() / 5
    assert out.loss.item() == pytest.approx(total / 5, rel=1e-12)
    out.loss.backward()
    assert logps.grad.tolist() == [pytest.approx(row, abs=1e-15) for row in grads]
    high, count = out.sums["clip/high"]
    assert (high / count).item() == pytest.approx(capped / 5)


# ------------------------------------------------------------------ composition


@pytest.mark.parametrize("objective_cls", [GRPO, GroupMaxEnt])
def test_a_sequence_ratio_composes_with_the_objectives_clipped_surrogate(objective_cls):
    """GSPO's ratio inside GRPO (grpo reduction) and inside GroupMaxEnt (its weights, the
    Dr.GRPO reduction), against the formula: -min(s A, clip(s) A) per token."""
    lengths = [3, 2, 1, 3]
    mask = _mask(lengths, 3)
    logps = _logps(7, 4, 3).requires_grad_(True)
    old = logps.detach() + torch.tensor([[0.3], [-0.4], [0.05], [0.0]], dtype=F64)
    rewards = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=F64)
    objective = objective_cls(ratio_level="sequence")
    group_lengths = torch.tensor([[3.0, 2.0], [1.0, 3.0]], dtype=F64)
    targets = objective.prepare(GroupInputs(rewards, group_lengths, 3, None))
    mb = _mb(logps, mask, G=2, num_rows=4, t_max=3, advantages=targets.advantages,
             weights=targets.weights, old=old)
    loss = objective.loss(mb).loss
    lp, old_lp = logps.detach().tolist(), old.tolist()
    adv = targets.advantages.tolist()
    w = None if targets.weights is None else targets.weights.reshape(-1).tolist()
    expected = 0.0
    for i, n in enumerate(lengths):
        s = math.exp(sum(lp[i][t] - old_lp[i][t] for t in range(n)) / n)
        per_token = -min(s * adv[i], min(max(s, 0.8), 1.2) * adv[i])
        if objective_cls is GRPO:  # mean of the row's token means over the 4 rows
            expected += per_token / 4
        else:  # row scaled by G * w_i, summed over tokens / (N * T_max)
            expected += 2 * w[i] * per_token * n / (4 * 3)
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_the_default_parts_are_todays_objective():
    """advantage=group, ratio_level=token, clip_rule=ppo give the same loss and gradient
    as GRPO built without naming them."""
    mask = _mask([3, 2, 3, 1], 3)
    old = _logps(2, 4, 3)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=F64)
    losses, grads = [], []
    for objective in (GRPO(), GRPO(advantage="group", ratio_level="token", clip_rule="ppo")):
        logps = _logps(1, 4, 3).requires_grad_(True)
        loss = objective.loss(_mb(logps, mask, G=2, num_rows=4, t_max=3, advantages=adv,
                                  old=old)).loss
        loss.backward()
        losses.append(loss.item())
        grads.append(logps.grad)
    assert losses[0] == losses[1] and torch.equal(grads[0], grads[1])


def test_kl_bias_correction_makes_the_kl_gradient_log_pi_over_pi_ref():
    """At ratio 1 the value is unchanged and d(c * k3)/dl = k3' + k3 = l - l_ref per token
    (the unbiased KL(pi || pi_ref) gradient); without it the gradient is 1 - exp(l_ref - l)."""
    lengths = [3, 1, 2, 2]
    mask = _mask(lengths, 3)
    ref = _logps(4, 4, 3)
    zero = torch.zeros(4, dtype=F64)  # no policy term: the KL alone
    results = {}
    for corrected in (False, True):
        logps = _logps(9, 4, 3).requires_grad_(True)
        objective = GRPO(beta=0.1, kl_bias_correction=corrected)
        loss = objective.loss(_mb(logps, mask, G=2, num_rows=4, t_max=3, advantages=zero,
                                  ref=ref)).loss
        loss.backward()
        results[corrected] = (loss.item(), logps.grad, logps.detach())
    assert results[True][0] == pytest.approx(results[False][0], rel=1e-12)
    lp = results[True][2]
    for i, n in enumerate(lengths):
        for t in range(3):
            d = lp[i, t].item() - ref[i, t].item()
            scale = 0.1 / n / 4 if t < n else 0.0  # beta, the row's token mean, 4 rows
            assert results[True][1][i, t].item() == pytest.approx(scale * d, abs=1e-15)
            assert results[False][1][i, t].item() == pytest.approx(
                scale * (1 - math.exp(-d)), abs=1e-15)


# ------------------------------------------------------------------ pass@k estimators


def _brute_passk(r: list[float], k: int) -> list[float]:
    """Chen et al.: the mean over the size-k subsets holding i of (max - mean) / std."""
    import itertools

    subsets = list(itertools.combinations(range(len(r)), k))
    best = [max(r[j] for j in s) for s in subsets]
    mean = sum(best) / len(best)
    std = math.sqrt(sum((v - mean) ** 2 for v in best) / len(best))
    if std == 0:  # every subset reaches the same pass@k: no signal
        return [0.0] * len(r)
    return [sum((best[n] - mean) / std for n, s in enumerate(subsets) if i in s)
            / sum(1 for s in subsets if i in s) for i in range(len(r))]


def _brute_pkpo(g: list[float], k: int) -> list[float]:
    """PKPO loo-1: sum over the size-k subsets holding i of (max - max without i) / C(n, k)."""
    import itertools

    out = []
    for i in range(len(g)):
        total = 0.0
        for s in itertools.combinations(range(len(g)), k):
            if i in s:
                total += max(g[j] for j in s) - max(g[j] for j in s if j != i)
        out.append(total / math.comb(len(g), k))
    return out


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_passk_advantages_are_the_subset_means(k):
    rows = [[1.0, 0.0, 0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0, 1.0, 0.0],
            [1.0] * 6, [0.0] * 6]
    got = estimate_advantages(torch.tensor(rows, dtype=F64), "passk", k=k)
    exact = passk_advantages(torch.tensor(rows, dtype=F64), k, eps=0.0)
    for b, r in enumerate(rows):
        expected = _brute_passk(r, k)
        assert got[b].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-9)  # eps 1e-6
        # float64 to rounding (the two values per group were float32: 2.7e-8 off)
        assert exact[b].tolist() == pytest.approx(expected, rel=1e-13, abs=1e-15)


@pytest.mark.parametrize("k", [2, 3, 6])
def test_pkpo_advantages_are_the_loo_minus_one_estimator(k):
    rows = [[0.3, 0.9, 0.1, 0.5, 0.9, 0.0], [1.0, 0.0, 0.0, 1.0, 0.0, 0.0],
            [2.0, -1.0, 0.5, 0.5, 3.0, 1.0]]
    got = estimate_advantages(torch.tensor(rows, dtype=F64), "pkpo", k=k)
    for b, g in enumerate(rows):
        assert got[b].tolist() == pytest.approx(_brute_pkpo(g, k), abs=1e-12)
    # binary closed form: a right sample gets C(n - c, k - 1) / C(n, k), a wrong one 0
    c = 2
    assert got[1].tolist() == pytest.approx(
        [math.comb(6 - c, k - 1) / math.comb(6, k) if r else 0.0 for r in rows[1]])


def test_the_pass_at_k_options_are_checked():
    with pytest.raises(ValueError, match="exactly 0 or 1"):
        estimate_advantages(torch.tensor([[0.5, 1.0]], dtype=F64), "passk", k=2)
    with pytest.raises(ValueError, match="objective.pass_k must be >= 2"):
        GRPO(advantage="pkpo", pass_k=1)
    with pytest.raises(ValueError, match="scales its advantages by itself"):
        GRPO(advantage="passk", scale_rewards="none")
    objective = GRPO(advantage="passk", pass_k=8)
    with pytest.raises(ValueError, match=r"k must be an int in \[1, G = 4\]; got 8"):
        objective.prepare(  # called directly: the estimator's own check
            GroupInputs(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), torch.ones(1, 4), 4, None))
    # and when the module is built, before any model loads (the name is never loaded)
    from maxent_grpo.training.module import MaxEntGRPOModule

    with pytest.raises(ValueError, match=r"objective.pass_k \(8\) must be at most model."
                                         r"num_generations \(4\)"):
        MaxEntGRPOModule(model_name_or_path="no/such-model", objective=objective,
                         num_generations=4)
    # k = G: the one subset is the whole group, so every advantage was 0 (a hunt: the
    # default pass_k 4 with num_generations 4 trained nothing without a word)
    assert not estimate_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), "passk", k=4).any()
    with pytest.raises(ValueError, match=r"objective.pass_k \(4\) must be below model."
                                         r"num_generations \(4\) with objective.advantage "
                                         "passk: .* lower pass_k or raise num_generations"):
        MaxEntGRPOModule(model_name_or_path="no/such-model",
                         objective=GRPO(advantage="passk"), num_generations=4)
    MaxEntGRPOModule(model_name_or_path="no/such-model", objective=GRPO(advantage="pkpo"),
                     num_generations=4)  # pkpo at k = G: a lone right answer gets credit


# ------------------------------------------------------------------ Clip-Cov and KL-Cov


def _cov_case():
    logps = torch.tensor([[-1.0, -0.2, -3.0, -0.5], [-2.0, -0.1, -0.4, -9.0]], dtype=F64,
                         requires_grad=True)
    old = torch.tensor([[-1.1, -0.2, -2.0, -0.6], [-2.0, -0.3, -0.4, -1.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]).bool()
    adv = torch.tensor([2.0, -1.0], dtype=F64)
    return logps, old, mask, adv


def _covariance(lp, adv, mask):
    cells = [(i, t) for i in range(2) for t in range(4) if mask[i, t]]
    a_mean = sum(adv[i] for i, _ in cells) / len(cells)
    l_mean = sum(lp[i][t] for i, t in cells) / len(cells)
    return {(i, t): (adv[i] - a_mean) * (lp[i][t] - l_mean) for i, t in cells}


def test_token_covariance_is_centred_over_the_masked_tokens():
    from maxent_grpo.core import token_covariance

    logps, _, mask, adv = _cov_case()
    got = token_covariance(logps, adv, mask)
    for (i, t), want in _covariance(logps.detach().tolist(), adv.tolist(), mask).items():
        assert got[i, t].item() == pytest.approx(want, rel=1e-12)
    assert got[1, 3].item() == -math.inf


def test_kl_cov_penalises_the_highest_covariance_token_and_does_not_clip():
    logps, old, mask, adv = _cov_case()
    objective = GRPO(loss_type="dapo", clip_rule="kl_cov", cov_fraction=0.2, kl_cov_coef=0.5)
    out = objective.loss(_mb(logps, mask, G=2, num_rows=2, t_max=4, advantages=adv, old=old,
                             num_global_tokens=torch.tensor(7.0, dtype=F64)))
    cov = _covariance(logps.detach().tolist(), adv.tolist(), mask)
    top = max(cov, key=cov.get)  # int(0.2 * 7) = 1 token
    lp, o = logps.detach().tolist(), old.tolist()
    total = 0.0
    for (i, t) in cov:
        c = math.exp(lp[i][t] - o[i][t])
        term = -c * adv[i].item()  # no clip, however far the ratio is from 1
        if (i, t) == top:
            term += 0.5 * abs(lp[i][t] - o[i][t])
        total += term
    assert out.loss.item() == pytest.approx(total / 7, rel=1e-12)
    assert out.sums["clip/cov"][0].item() == 1


def test_clip_cov_zeroes_a_chosen_tokens_gradient_and_keeps_the_rest():
    logps, old, mask, adv = _cov_case()
    torch.manual_seed(0)
    wide = GRPO(loss_type="dapo", clip_rule="clip_cov", cov_fraction=1.0, epsilon=0.9,
                epsilon_high=5.0, clip_cov_bounds=(-100.0, 100.0))  # every token eligible
    out = wide.loss(_mb(logps, mask, G=2, num_rows=2, t_max=4, advantages=adv, old=old,
                        num_global_tokens=torch.tensor(7.0, dtype=F64)))
    assert out.loss.item() == 0.0 and out.sums["clip/cov"][0].item() == 7
    narrow = GRPO(loss_type="dapo", clip_rule="clip_cov", epsilon=0.9, epsilon_high=5.0,
                  clip_cov_bounds=(-100.0, 100.0))  # one token of seven
    plain = GRPO(loss_type="dapo", epsilon=0.9, epsilon_high=5.0)
    grads = []
    for objective in (narrow, plain):
        lp = logps.detach().clone().requires_grad_(True)
        objective.loss(_mb(lp, mask, G=2, num_rows=2, t_max=4, advantages=adv, old=old,
                           num_global_tokens=torch.tensor(7.0, dtype=F64))).loss.backward()
        grads.append(lp.grad)
    differs = (grads[0] != grads[1])
    assert int(differs.sum()) == 1 and grads[0][differs].item() == 0.0


def test_the_cov_options_are_checked():
    with pytest.raises(ValueError, match="objective.clip_cov_bounds"):
        GRPO(clip_rule="clip_cov", clip_cov_bounds=(5.0, 1.0))
    with pytest.raises(ValueError, match="objective.cov_fraction"):
        GRPO(clip_rule="kl_cov", cov_fraction=0.0)
    with pytest.raises(ValueError, match="objective.kl_cov_coef"):
        GRPO(clip_rule="kl_cov", kl_cov_coef=-1.0)
    with pytest.raises(ValueError, match="objective.top_entropy_quantile"):
        GRPO(top_entropy_quantile=0.0)
    with pytest.raises(ValueError, match="objective.kl_bias_correction"):
        GRPO(kl_bias_correction="yes")


# ------------------------------------------------------------------ top-entropy token mask


def _quantile(values: list[float], p: float) -> float:
    """Linear interpolation between the sorted values (torch.quantile's default)."""
    v = sorted(values)
    pos = p * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def test_only_the_high_entropy_tokens_keep_their_policy_term():
    lengths = [3, 2, 4, 1]
    mask = _mask(lengths, 4)
    logps = _logps(11, 4, 4).requires_grad_(True)
    entropy = torch.linspace(0.1, 2.5, 16, dtype=F64).view(4, 4).flip(1)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=F64)
    objective = GRPO(loss_type="dapo", top_entropy_quantile=0.25)
    assert objective.needs_entropy and not GRPO().needs_entropy
    assert EntropyMaxEnt(top_entropy_quantile=1.0).needs_entropy  # still its own
    out = objective.loss(_mb(logps, mask, G=2, num_rows=4, t_max=4, advantages=adv,
                             entropy=entropy, num_global_tokens=torch.tensor(10.0, dtype=F64)))
    values = [entropy[i, t].item() for i, n in enumerate(lengths) for t in range(n)]
    threshold = _quantile(values, 0.75)
    kept = [(i, t) for i, n in enumerate(lengths) for t in range(n)
            if entropy[i, t].item() >= threshold]
    # at ratio 1 the policy term of a kept token is -A (value), gradient -A / 10
    assert out.loss.item() == pytest.approx(sum(-adv[i].item() for i, _ in kept) / 10,
                                            rel=1e-12)
    out.loss.backward()
    for i in range(4):
        for t in range(4):
            want = -adv[i].item() / 10 if (i, t) in kept else 0.0
            assert logps.grad[i, t].item() == pytest.approx(want, abs=1e-15)
    assert out.sums["entropy_mask"][0].item() == len(kept)


def test_a_ghost_group_gets_neutral_targets_of_the_same_kinds() -> None:
    from maxent_grpo.objectives import Targets

    stats = {"weight_entropy": torch.tensor(0.5)}
    with_answers = Targets(advantages=torch.ones(6), stats=stats,
                           answers=torch.zeros(2, 3, dtype=torch.long))
    like = torch.zeros(2, 3, dtype=torch.float64)
    ghost = with_answers.neutral(3, like)
    assert ghost.advantages.dtype == torch.float64 and ghost.advantages.tolist() == [0.0] * 3
    assert ghost.weights.tolist() == [[1 / 3] * 3] and ghost.candidates.all()
    assert ghost.answers.tolist() == [[0, 1, 2]] and ghost.stats is stats and ghost.q is None
    assert Targets(stats=stats).neutral(3, like).answers is None  # no answer classes asked


def test_a_non_finite_log_prob_at_a_padded_token_touches_no_statistic():
    """Masked tokens are left out with ``where``: a product with the mask turned an infinite
    value at a padded position (a KL term that overflowed, a -inf log-prob) into NaN in
    ``train/kl``, rho and the listwise sequence log-probs."""
    from maxent_grpo.objectives import ListwiseMaxEnt, MicroBatch
    from maxent_grpo.objectives.base import sequence_ref_loglik

    logps = torch.tensor([[-1.0, -100.0], [-1.0, -1.0]], requires_grad=True)  # [0, 1] padded
    ref = torch.tensor([[-1.1, -5.0], [-1.2, -1.0]])  # exp(95) overflows float32 there
    mask = torch.tensor([[True, False], [True, True]])
    mb = MicroBatch(token_logps=logps, old_token_logps=None, ref_token_logps=ref, mask=mask,
                    entropy=None, advantages=torch.tensor([0.7, -0.7]), weights=None,
                    group_size=2, num_rows=2, num_micro_batches=1, max_completion_length=2,
                    num_global_tokens=torch.tensor(3))
    out = GRPO(beta=0.1).loss(mb)
    kl_sum, count = out.sums["kl"]
    assert torch.isfinite(kl_sum) and count == 3
    # and the gradient: the KL masked after its overflow made it NaN (inf * 0; a hunt: the
    # whole update was skipped as non-finite)
    (grad,) = torch.autograd.grad(out.loss, logps)
    assert torch.isfinite(grad).all() and grad[0, 1] == 0
    # a -inf log-prob in padding: Clip-Cov's covariance (NaN everywhere: no token clipped)
    # and the logged sequence log-probs (NaN) read the masked tokens only
    from maxent_grpo.core import token_covariance
    from maxent_grpo.training.types import SequenceScores

    padded = logps.detach().clone()
    padded[0, 1] = -math.inf
    cov = token_covariance(padded, torch.tensor([0.7, -0.7]), mask)
    assert torch.isfinite(cov[mask]).all() and torch.equal(
        cov[mask], token_covariance(logps.detach(), torch.tensor([0.7, -0.7]), mask)[mask])
    scores = SequenceScores.of(padded, mask, entropy=torch.where(mask, 1.0, math.inf))
    assert scores.cur_logp_sum.tolist() == [-1.0, -2.0]
    assert scores.policy_entropy_sum.tolist() == [1.0, 2.0]
    ref[0, 1] = -math.inf
    assert torch.isfinite(sequence_ref_loglik(ref, mask, 2)).all()
    listwise = ListwiseMaxEnt(length_normalize=False)._seq_logps(padded, mask, 2)
    assert torch.equal(listwise, torch.tensor([[-1.0, -2.0]]))


@pytest.mark.parametrize(("estimator", "scale"), [("reinforce_pp", "group"),
                                                  ("reinforce_pp_baseline", "group"),
                                                  ("rloo", "batch")])
def test_batch_normalised_estimators_give_constant_rewards_exactly_zero(estimator, scale):
    """float32 left a rounding residue in ``r - mean(r)`` that ``batch_normalised`` divided
    by ``eps`` alone (x 10^4): every reward 0.1 moved the weights by the full Adam step (a
    numerical-extremes hunt). An all-equal batch, and every constant group of the
    group-centred estimators, give exactly 0."""
    same = torch.full((4, 8), 0.1)
    assert estimate_advantages(same, estimator, scale).abs().max().item() == 0.0
    groups = torch.tensor([[0.1] * 8, [0.3] * 8, [0.7] * 8])
    if estimator != "reinforce_pp":  # it has no group baseline: a group above the mean is up
        assert estimate_advantages(groups, estimator, scale).abs().max().item() == 0.0
        mixed = torch.tensor([[0.1] * 4, [0.3, 0.1, 0.7, 0.2]])
        assert estimate_advantages(mixed, estimator, scale)[0].abs().max().item() == 0.0

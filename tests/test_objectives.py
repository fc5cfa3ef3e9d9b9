"""Tests for maxent_grpo.objectives: GRPO, EntropyMaxEnt, ListwiseMaxEnt, GroupMaxEnt.

No model: every ``MicroBatch`` is built from small float64 tensors, and each loss is compared
with a naive formula written out in plain Python floats (docs/ALGORITHM.md §3-4).
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from maxent_grpo import core
from maxent_grpo.objectives import (
    GRPO,
    EntropyMaxEnt,
    GroupMaxEnt,
    ListwiseMaxEnt,
    MicroBatch,
)

F64 = torch.float64
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")

# GRPO fixture: B = 3 prompts, G = 2, T = 4 padded tokens, T_max = 5 (> T, so dr_grpo's
# normaliser is visibly T_max, not T). Row 4 is fully masked (a truncated completion).
G2 = 2
T4 = 4
T_MAX5 = 5
LENGTHS = [4, 2, 3, 1, 0, 3]
REWARDS = [[1.0, 0.0], [0.5, 2.0], [3.0, -1.0]]


# ------------------------------------------------------------------ helpers


def _mask(lengths: list[int], T: int) -> torch.Tensor:
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]


def _logps(seed: int, n: int, T: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return -3.0 * torch.rand(n, T, generator=gen, dtype=F64) - 0.05


def _mb(
    logps: torch.Tensor,
    mask: torch.Tensor,
    *,
    G: int,
    num_rows: int,
    t_max: int,
    advantages: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    old: torch.Tensor | None = None,
    ref: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    num_micro_batches: int = 1,
    num_global_tokens: torch.Tensor | None = None,
) -> MicroBatch:
    return MicroBatch(
        token_logps=logps,
        old_token_logps=old,
        ref_token_logps=ref,
        mask=mask,
        entropy=entropy,
        advantages=advantages,
        weights=weights,
        group_size=G,
        num_rows=num_rows,
        num_micro_batches=num_micro_batches,
        max_completion_length=t_max,
        num_global_tokens=num_global_tokens,
    )


def _naive_adv(rewards: list[list[float]], scale: str) -> list[float]:
    """Flattened group advantages: r - mean, divided by (ddof-1 std + 1e-4) for 'group'."""
    flat = [r for group in rewards for r in group]
    out = []
    for group in rewards:
        mean = sum(group) / len(group)
        for r in group:
            a = r - mean
            if scale == "group":
                a /= statistics.stdev(group) + 1e-4
            elif scale == "batch":
                a /= statistics.stdev(flat) + 1e-4
            out.append(a)
    return out


def _row_weight(loss_type: str, lengths: list[int], n_rows: int, t_max: int) -> list[float]:
    """Factor each masked token of row i gets in the reduction (docs/ALGORITHM.md §3)."""
    total = sum(lengths)
    if loss_type == "grpo":
        return [1.0 / (n_rows * max(n, 1)) for n in lengths]
    if loss_type == "bnpo":
        return [1.0 / max(total, 1)] * len(lengths)
    if loss_type == "dr_grpo":
        return [1.0 / (n_rows * t_max)] * len(lengths)
    return [1.0 / total] * len(lengths)  # dapo, one micro-batch = the whole step


def _softmax(xs: list[float]) -> list[float]:
    top = max(xs)
    e = [math.exp(x - top) for x in xs]
    return [v / sum(e) for v in e]


def _k3(logp: float, ref: float) -> float:
    d = ref - logp
    return math.exp(d) - d - 1.0


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss_type": "ppo"}, r"objective\.loss_type.*'grpo', 'bnpo', 'dr_grpo', 'dapo'"),
        ({"scale_rewards": "std"}, r"objective\.scale_rewards.*'group', 'batch', 'none'"),
        ({"epsilon": 1.0}, r"objective\.epsilon must be in \[0, 1\)"),
        ({"epsilon": -0.1}, r"objective\.epsilon must be in \[0, 1\)"),
        ({"epsilon_high": -0.1}, r"objective\.epsilon_high must be a finite number >= 0"),
        ({"kl_estimator": "k4"}, r"objective\.kl_estimator.*'k1', 'k2', 'k3'"),
        ({"beta": -0.1}, r"objective\.beta must be a finite number >= 0"),
        ({"beta": math.nan}, r"objective\.beta"),
        ({"beta": math.inf}, r"objective\.beta"),
    ],
)
def test_grpo_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GRPO(**kwargs)
    # EntropyMaxEnt inherits every GRPO check.
    with pytest.raises(ValueError, match=match):
        EntropyMaxEnt(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"alpha": -0.01}, r"objective\.alpha must be a finite number >= 0"),
        ({"alpha": math.inf}, r"objective\.alpha"),
        ({"kl_gate_threshold": 0.0}, r"objective\.kl_gate_threshold must be a finite number > 0"),
        ({"kl_gate_threshold": -1.0}, r"objective\.kl_gate_threshold must be a finite number"),
        ({"kl_gate_threshold": 0.1, "kl_gate_gain": -1.0}, r"objective\.kl_gate_gain must be"),
        (
            {"kl_gate_threshold": 0.1, "kl_gate_min_multiplier": -0.5},
            r"objective\.kl_gate_min_multiplier must be a finite number >= 0",
        ),
        (
            {"kl_gate_threshold": 0.1, "kl_gate_min_multiplier": 1.5,
             "kl_gate_max_multiplier": 1.0},
            r"objective\.kl_gate_min_multiplier must be <= objective\.kl_gate_max_multiplier",
        ),
    ],
)
def test_entropy_maxent_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EntropyMaxEnt(**kwargs)


def test_entropy_gate_errors_name_the_objective_argument() -> None:
    with pytest.raises(ValueError, match=r"objective\.kl_gate_threshold"):
        EntropyMaxEnt(kl_gate_threshold=0.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"beta": -0.1}, r"objective\.beta must be a finite number >= 0"),
        ({"tau": -0.1}, r"objective\.tau must be a finite number >= 0"),
        ({"tau": math.nan}, r"objective\.tau"),
        ({"tau": math.inf}, r"objective\.tau"),
        ({"tau": 0.0, "beta": 0.0}, r"objective\.tau must be > 0 when objective\.beta = 0"),
        ({"q_temperature": 0.0}, r"objective\.q_temperature must be a finite number > 0"),
        ({"q_temperature": -1.0}, r"objective\.q_temperature must be a finite number > 0"),
        ({"q_epsilon": 0.0}, r"objective\.q_epsilon must be a finite number > 0"),
        ({"clip_coef": -0.5}, r"objective\.clip_coef must be a finite number >= 0"),
        ({"distinct_candidates": 1}, r"objective\.distinct_candidates must be true or false"),
        ({"distinct_candidates": True, "clip_coef": 0.1},
         r"objective\.clip_coef must be 0 with objective\.distinct_candidates"),
        ({"epsilon": 1.0}, r"objective\.epsilon must be in \[0, 1\)"),
    ],
)
def test_listwise_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ListwiseMaxEnt(**kwargs)


def test_listwise_tau_zero_allowed_with_beta() -> None:
    obj = ListwiseMaxEnt(tau=0.0, beta=0.1)
    assert obj.tau == 0.0 and obj.beta == 0.1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tau": -1.0}, r"objective\.tau must be a finite number >= 0"),
        ({"tau": math.inf}, r"objective\.tau"),
        ({"lam": -0.1}, r"objective\.lam must be a finite number >= 0"),
        ({"epsilon": 1.0}, r"objective\.epsilon must be in \[0, 1\)"),
        ({"epsilon_high": -0.1}, r"objective\.epsilon_high must be a finite number >= 0"),
    ],
)
def test_group_maxent_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GroupMaxEnt(**kwargs)


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        pytest.param(ListwiseMaxEnt, {"epsilon_high": -0.1}, r"objective\.epsilon_high"),
        pytest.param(ListwiseMaxEnt, {"clip_coef": math.nan}, r"objective\.clip_coef",
                     ),
        pytest.param(ListwiseMaxEnt, {"q_temperature": math.inf}, r"objective\.q_temperature"),
        pytest.param(GRPO, {"epsilon_high": math.nan}, r"objective\.epsilon_high"),
        pytest.param(GRPO, {"epsilon_high": math.inf}, r"objective\.epsilon_high"),
    ],
)
def test_non_finite_or_negative_hyperparameters_rejected_at_construction(
    cls: type, kwargs: dict, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


# ------------------------------------------------------------------ flags and state


def test_needs_reference_and_entropy_flags() -> None:
    assert not GRPO().needs_reference and not GRPO().needs_entropy
    assert GRPO(beta=0.04).needs_reference
    assert EntropyMaxEnt().needs_entropy and not EntropyMaxEnt().needs_reference
    assert EntropyMaxEnt(beta=0.1).needs_reference
    assert EntropyMaxEnt(kl_gate_threshold=0.05).needs_reference  # the gate needs KL
    assert not ListwiseMaxEnt().needs_reference and not ListwiseMaxEnt().needs_entropy
    assert ListwiseMaxEnt(beta=0.2).needs_reference
    assert not GroupMaxEnt().needs_reference and not GroupMaxEnt().needs_entropy
    assert GroupMaxEnt(lam=0.3).needs_reference
    # Flags follow attributes that controllers change.
    obj = GRPO()
    obj.beta = 0.5
    assert obj.needs_reference


def test_state_contents() -> None:
    assert GRPO(beta=0.1).state() == {"beta": 0.1}
    ent = EntropyMaxEnt(alpha=0.2, beta=0.1, kl_gate_threshold=0.1, kl_gate_gain=1.0)
    assert ent.state() == {"beta": 0.1, "alpha": 0.2}
    ent.observe({"kl": 0.05})  # multiplier 1 + (0.1 - 0.05)/0.1 = 1.5
    assert ent.state() == pytest.approx({"beta": 0.1, "alpha": 0.3})
    lw = ListwiseMaxEnt(tau=1, beta=0)
    assert lw.state() == {"tau": 1.0, "beta": 0.0}
    assert all(isinstance(v, float) for v in lw.state().values())
    lw.tau = 0.7  # as a controller would
    assert lw.state()["tau"] == 0.7
    assert GroupMaxEnt(tau=2.0, lam=0.5).state() == {"tau": 2.0, "lam": 0.5}


def test_tunable_and_mutable_attributes() -> None:
    assert GRPO.tunable == EntropyMaxEnt.tunable == ("beta",)
    assert ListwiseMaxEnt.tunable == ("tau", "beta")
    assert GroupMaxEnt.tunable == ("tau",)
    for obj in (GRPO(), EntropyMaxEnt(), ListwiseMaxEnt(), GroupMaxEnt()):
        assert set(obj.tunable) <= set(obj.mutable)
        for name in obj.mutable:
            assert isinstance(getattr(obj, name), float), (type(obj).__name__, name)
    assert EntropyMaxEnt.mutable == ("beta", "alpha_multiplier")


def test_group_maxent_has_no_beta_and_is_not_grpo() -> None:
    obj = GroupMaxEnt(tau=0.5, lam=0.2)
    assert not isinstance(obj, GRPO)
    assert not hasattr(obj, "beta") and not hasattr(obj, "loss_type")
    assert "beta" not in obj.state() and "beta" not in obj.state_dict()
    # Dr.GRPO divides by this rank's rows: the base factor W * rows / rows_all_ranks
    assert obj.loss_scale(2, 6, 8) == pytest.approx(1.5)
    assert obj.loss_scale(2, 4, 0) == 1.0
    assert obj.epsilon == obj.epsilon_high == 0.2
    assert GroupMaxEnt(epsilon=0.1, epsilon_high=0.3).epsilon_high == 0.3


@pytest.mark.parametrize(
    ("make", "moved"),
    [
        (lambda: GRPO(beta=0.1), {"beta": 0.25}),
        (lambda: EntropyMaxEnt(beta=0.1, kl_gate_threshold=0.1),
         {"beta": 0.3, "alpha_multiplier": 1.5}),
        (lambda: ListwiseMaxEnt(tau=0.5, beta=0.1), {"tau": 0.7, "beta": 0.02}),
        (lambda: GroupMaxEnt(tau=2.0), {"tau": 0.4}),
    ],
)
def test_state_dict_round_trip(make, moved: dict) -> None:
    obj = make()
    for name, value in moved.items():  # as a controller or the entropy gate would
        setattr(obj, name, value)
    saved = obj.state_dict()
    assert saved == moved and set(saved) == set(obj.mutable)
    fresh = make()
    assert fresh.state_dict() != saved
    fresh.load_state_dict(saved)
    assert fresh.state_dict() == saved and fresh.state() == obj.state()


def test_load_state_dict_refuses_an_unknown_key() -> None:
    obj = GroupMaxEnt(tau=1.0)
    with pytest.raises(ValueError, match=r"GroupMaxEnt has no mutable state \['beta'\]"):
        obj.load_state_dict({"tau": 0.5, "beta": 0.1})
    assert obj.tau == 1.0  # nothing applied
    with pytest.raises(ValueError, match=r"GRPO has no mutable state \['tau'\]"):
        GRPO().load_state_dict({"tau": 0.5})


# ------------------------------------------------------------------ GRPO


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_prepare_is_flat_group_advantages(scale: str) -> None:
    rewards = torch.tensor(REWARDS, dtype=F64)
    targets = GRPO(scale_rewards=scale).prepare(rewards, torch.ones_like(rewards), T_MAX5, None)
    assert targets.weights is None
    assert torch.equal(targets.advantages, core.group_advantages(rewards, scale=scale).reshape(-1))
    assert targets.advantages.tolist() == pytest.approx(_naive_adv(REWARDS, scale), abs=1e-12)


def _grpo_setup(beta: float, seed: int = 0):
    n = len(LENGTHS)
    logps = _logps(seed, n, T4)
    ref = _logps(seed + 1, n, T4) if beta > 0 else None
    mask = _mask(LENGTHS, T4)
    adv = torch.tensor(_naive_adv(REWARDS, "group"), dtype=F64)
    return logps, ref, mask, adv


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
    assert (s_low.item(), c_low.item()) == pytest.approx((low, n_tok))
    assert (s_high.item(), c_high.item()) == pytest.approx((high, n_tok))


def _old_or_none(kind: str, logps: torch.Tensor) -> torch.Tensor | None:
    if kind == "none":
        return None
    gen = torch.Generator().manual_seed(11)
    return logps + 0.4 * torch.randn(logps.shape, generator=gen, dtype=F64)


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
    obj.observe({"kl": 0.05})  # below: 1 + (0.1 - 0.05)/0.1 = 1.5
    assert obj.alpha_effective == pytest.approx(0.2 * 1.5)
    obj.observe({"kl": 0.0})  # below: 2, clipped to m_hi = 1.8
    assert obj.alpha_effective == pytest.approx(0.2 * 1.8)
    obj.observe({"kl": 0.2})  # above: 1 / (1 + (0.2 - 0.1)/0.1) = 0.5
    assert obj.alpha_effective == pytest.approx(0.2 * 0.5)
    obj.observe({"kl": 1.0})  # above: 1/10, clipped to m_lo = 0.25
    assert obj.alpha_effective == pytest.approx(0.2 * 0.25)
    obj.observe({"kl": math.nan})  # non-finite counts as above: 0 -> m_lo
    assert obj.alpha_effective == pytest.approx(0.2 * 0.25)

    off = EntropyMaxEnt(**kw, disable_outside_trust_zone=True)
    off.observe({"kl": 0.2})
    assert off.alpha_effective == 0.0
    off.observe({"kl": 0.05})
    assert off.alpha_effective == pytest.approx(0.3)

    ungated = EntropyMaxEnt(alpha=0.2)
    ungated.observe({"kl": 5.0})  # no threshold: no-op
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
    obj.observe({"kl": 0.2})  # multiplier 0.5
    assert obj.loss(mb).loss.item() == pytest.approx(grpo - 0.1 * reduced_h, rel=1e-12)
    off = EntropyMaxEnt(alpha=0.2, kl_gate_threshold=0.1, disable_outside_trust_zone=True,
                        loss_type="dr_grpo")
    off.observe({"kl": 0.2})
    assert off.loss(mb).loss.item() == pytest.approx(grpo, rel=1e-12)


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
    targets = obj.prepare(rewards, torch.ones_like(rewards), 4, rho)
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
    targets = ListwiseMaxEnt(tau=0.5, q_temperature=0.5).prepare(rewards, ones, 4, None)
    assert torch.equal(targets.q, core.q_distribution(rewards, 0.5, 1e-6))
    assert torch.allclose(targets.q.sum(-1), torch.ones(3, dtype=F64), atol=1e-12)
    # with distinct candidates q lives on the candidates only
    cand = torch.tensor([[True, True, False], [True, False, True], [True, True, True]])
    obj = ListwiseMaxEnt(tau=0.5, distinct_candidates=True)
    targets = obj.prepare(rewards, ones, 4, None, cand)
    assert torch.equal(targets.q, core.q_distribution(rewards, obj.q_temperature, 1e-6, cand))
    assert torch.equal(targets.candidates, cand)
    # the other objectives have no target distribution
    assert GRPO().prepare(rewards, ones, 4, None).q is None
    assert GroupMaxEnt().prepare(rewards, ones, 4, None).q is None


def test_listwise_prepare_ignores_reference_when_beta_zero() -> None:
    obj = ListwiseMaxEnt(tau=0.5)
    rewards = torch.tensor(LW_REWARDS, dtype=F64)
    with_rho = obj.prepare(rewards, torch.ones_like(rewards), 4, torch.tensor(LW_RHO, dtype=F64))
    without = obj.prepare(rewards, torch.ones_like(rewards), 4, None)
    assert torch.equal(with_rho.weights, without.weights)


def _listwise_setup(seed: int = 5):
    obj_w = ListwiseMaxEnt(tau=0.5).prepare(
        torch.tensor(LW_REWARDS, dtype=F64), torch.ones(3, 3, dtype=F64), 4, None
    ).weights
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
    return obj.prepare(rewards, lengths, 4, rho)


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


def test_group_maxent_micro_batches_sum_to_whole() -> None:
    obj = GroupMaxEnt(tau=0.5)
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 2.0, 1.0, 0.5]], dtype=F64)
    lengths_l = [3, 2, 3, 1, 4, 1, 2, 4]
    targets = obj.prepare(rewards, torch.tensor(lengths_l, dtype=F64).view(2, 4), 4, None)
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
    gm_t = gm.prepare(rewards, lengths, T_MAX5, None)
    dr = GRPO(loss_type="dr_grpo", scale_rewards="none")
    dr_t = dr.prepare(rewards, lengths, T_MAX5, None)
    assert torch.equal(gm_t.advantages, dr_t.advantages)
    assert torch.allclose(G2 * gm_t.weights, torch.ones(3, 2, dtype=F64), atol=1e-5)
    kw = dict(G=G2, num_rows=6, t_max=T_MAX5, old=old)
    gm_loss = gm.loss(_mb(logps, mask, advantages=gm_t.advantages, weights=gm_t.weights, **kw))
    dr_loss = dr.loss(_mb(logps, mask, advantages=dr_t.advantages, **kw))
    assert abs(dr_loss.loss.item()) > 1e-2  # non-trivial comparison
    assert gm_loss.loss.item() == pytest.approx(dr_loss.loss.item(), rel=1e-5, abs=1e-9)

"""Listwise and group MaxEnt weights (docs/ALGORITHM.md §4.3 and §4.4)."""

from __future__ import annotations

import math

import pytest
import torch

from maxent_grpo.core.listwise import (
    group_utility,
    group_weights,
    maxent_weights,
    q_distribution,
    weight_entropy,
)

F64 = torch.float64


def naive_softmax(xs: list[float]) -> list[float]:
    top = max(xs)
    exps = [math.exp(x - top) for x in xs]
    return [e / sum(exps) for e in exps]


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def dirichlet_points(n: int, g: int, seed: int) -> torch.Tensor:
    """``n`` points uniform on the simplex (Dirichlet(1, ..., 1)) as normalised exponentials."""
    u = torch.rand(n, g, generator=torch.Generator().manual_seed(seed), dtype=F64)
    e = -torch.log1p(-u)
    return e / e.sum(dim=1, keepdim=True)


# ---------------------------------------------------------------- q_distribution


def test_q_floor_by_hand() -> None:
    q = q_distribution(torch.tensor([[1000.0, 0.0, 0.0, 0.0]], dtype=F64), epsilon=1e-6)
    expected = torch.tensor([[1 - 3e-6, 1e-6, 1e-6, 1e-6]], dtype=F64)
    torch.testing.assert_close(q, expected, rtol=0, atol=1e-15)


def test_q_matches_naive_loop() -> None:
    r = randn(4, 5, seed=1) * 3
    temperature, eps = 0.7, 1e-3
    q = q_distribution(r, temperature=temperature, epsilon=eps)
    for b, row in enumerate(r.tolist()):
        p = naive_softmax([x / temperature for x in row])
        want = [x * (1 - 5 * eps) + eps for x in p]
        assert q[b].tolist() == pytest.approx(want, rel=1e-12, abs=1e-15)
    torch.testing.assert_close(q.sum(dim=1), torch.ones(4, dtype=F64))


@pytest.mark.parametrize("epsilon", [1e-6, 0.05, 0.3, 10.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_q_floor_holds_and_rows_sum_to_one(epsilon: float, dtype: torch.dtype) -> None:
    r = (randn(6, 4, seed=2) * 50).to(dtype)
    q = q_distribution(r, epsilon=epsilon)
    floor = min(epsilon, 1 / 4 - 1e-8)
    assert q.dtype == dtype
    assert float(q.min()) >= floor - (1e-7 if dtype == torch.float32 else 0.0)
    torch.testing.assert_close(q.sum(dim=1), torch.ones(6, dtype=dtype))


def test_q_single_candidate_is_one() -> None:
    assert q_distribution(torch.tensor([[3.0]])).tolist() == [[1.0]]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((torch.tensor([[1.0, float("nan")]]),), "rewards must be finite"),
        ((torch.tensor([1.0, 0.0]),), r"rewards must have shape \(B, G\)"),
        ((torch.tensor([[1, 0]]),), "rewards must be a floating-point"),
        ((torch.tensor([[1.0, 0.0]]), 0.0), "temperature must be"),
        ((torch.tensor([[1.0, 0.0]]), -1.0), "temperature must be"),
        ((torch.tensor([[1.0, 0.0]]), 1.0, 0.0), "epsilon must be"),
        ((torch.tensor([[1.0, 0.0]]), 1.0, float("inf")), "epsilon must be"),
    ],
)
def test_q_validation(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        q_distribution(*args)


# ---------------------------------------------------------------- maxent_weights


def test_maxent_weights_by_hand() -> None:
    q = torch.tensor([[0.5, 0.3, 0.2]], dtype=F64)
    # tau = 1, beta = 0: w = q. tau = 0.5: w ∝ q^2 = [.25, .09, .04] / .38.
    torch.testing.assert_close(maxent_weights(q.log(), 1.0), q)
    want = torch.tensor([[0.25, 0.09, 0.04]], dtype=F64) / 0.38
    torch.testing.assert_close(maxent_weights(q.log(), 0.5), want)
    # tau = 0, beta = 1: w ∝ q * pi_ref; with rho = log [.2, .3, .5]: [.1, .09, .1] / .29.
    rho = torch.tensor([[0.2, 0.3, 0.5]], dtype=F64).log()
    want = torch.tensor([[0.1, 0.09, 0.1]], dtype=F64) / 0.29
    torch.testing.assert_close(maxent_weights(q.log(), 0.0, 1.0, rho), want)


@pytest.mark.parametrize(
    ("tau", "beta"), [(1.0, 0.0), (0.3, 0.0), (0.5, 0.2), (0.0, 0.7), (2.0, 1.5)]
)
def test_maxent_weights_match_naive_loop(tau: float, beta: float) -> None:
    log_q = q_distribution(randn(3, 5, seed=3)).log()
    rho = randn(3, 5, seed=4)
    w = maxent_weights(log_q, tau, beta, rho)
    for b in range(3):
        logits = [
            (lq + beta * r) / (tau + beta)
            for lq, r in zip(log_q[b].tolist(), rho[b].tolist(), strict=True)
        ]
        assert w[b].tolist() == pytest.approx(naive_softmax(logits), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(w.sum(dim=1), torch.ones(3, dtype=F64))


def maxent_objective(
    w: torch.Tensor, log_q: torch.Tensor, rho: torch.Tensor, tau: float, beta: float
) -> torch.Tensor:
    """``<w, log q> + tau * H(w) - beta * KL(w || softmax(rho))`` per row, float64."""
    log_ref = torch.log_softmax(rho, dim=-1)
    xlogx = torch.special.xlogy(w, w)
    entropy = -xlogx.sum(-1)
    kl = (xlogx - w * log_ref).sum(-1)
    return (w * log_q).sum(-1) + tau * entropy - beta * kl


@pytest.mark.parametrize(
    ("tau", "beta"), [(1.0, 0.0), (0.2, 0.0), (0.5, 0.5), (0.0, 0.8), (3.0, 0.3)]
)
def test_maxent_weights_maximise_objective(tau: float, beta: float) -> None:
    g = 5
    log_q = q_distribution(randn(1, g, seed=5) * 2).log()[0]
    rho = randn(1, g, seed=6)[0] * 2
    w = maxent_weights(log_q[None], tau, beta, rho[None])[0]
    best = maxent_objective(w, log_q, rho, tau, beta)
    points = dirichlet_points(200, g, seed=7)
    for t in (1.0, 0.3, 0.1, 1e-2, 1e-3):
        values = maxent_objective((1 - t) * w + t * points, log_q, rho, tau, beta)
        assert bool((values <= best + 1e-12).all()), (t, float(values.max() - best))
    if beta > 0 and tau > 0:
        # The earlier public variant divides by tau alone: it is not the maximiser.
        other = torch.softmax((log_q + beta * rho) / tau, dim=-1)
        assert float(maxent_objective(other, log_q, rho, tau, beta)) < float(best) - 1e-6


def test_maxent_weights_are_detached() -> None:
    log_q = q_distribution(randn(2, 4, seed=8)).log().requires_grad_(True)
    rho = randn(2, 4, seed=9).requires_grad_(True)
    w = maxent_weights(log_q, 0.5, 0.5, rho)
    assert not w.requires_grad and w.grad_fn is None


def test_maxent_weights_at_a_tiny_temperature_are_the_argmax_not_nan() -> None:
    # log_q / 1e-39 overflows float32: the rows' largest entries share the mass
    log_q = torch.tensor([[0.5, 0.3, 0.2], [0.4, 0.4, 0.2]]).log()
    w = maxent_weights(log_q, 1e-39)
    assert torch.equal(w, torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]]))
    cands = torch.tensor([[False, True, True], [True, True, True]])
    assert torch.equal(maxent_weights(log_q, 1e-39, candidates=cands)[0],
                       torch.tensor([0.0, 1.0, 0.0]))
    with pytest.raises(ValueError, match=r"beta=1e\+39 is too large"):
        maxent_weights(log_q, 0.0, 1e39, -torch.ones(2, 3))
    utility = torch.tensor([[0.5, -0.25, 0.5]])
    assert torch.equal(group_weights(utility, 1e-39), torch.tensor([[0.5, 0.0, 0.5]]))
    q = q_distribution(utility, temperature=1e-39, epsilon=1e-6)
    assert torch.isfinite(q).all() and q[0, 1] == pytest.approx(1e-6)


@pytest.mark.parametrize("tiny", [1e-46, 1e-300])
def test_a_temperature_that_is_0_in_float32_gives_the_argmax_not_nan(tiny) -> None:
    """Below float32's least denormal the temperature is 0 in the division: the limit's
    fallback divided the row's largest entry 0 by 0 (NaN; a numerical-extremes hunt)."""
    log_q = torch.tensor([[0.5, 0.3, 0.2], [0.4, 0.4, 0.2]]).log()
    assert torch.equal(maxent_weights(log_q, tiny), torch.tensor([[1.0, 0.0, 0.0],
                                                                   [0.5, 0.5, 0.0]]))
    cands = torch.tensor([[False, True, True], [True, True, True]])
    assert torch.equal(maxent_weights(log_q, tiny, candidates=cands)[0],
                       torch.tensor([0.0, 1.0, 0.0]))
    utility = torch.tensor([[0.5, -0.25, 0.5]])
    assert torch.equal(group_weights(utility, tiny), torch.tensor([[0.5, 0.0, 0.5]]))
    q = q_distribution(utility, temperature=tiny, epsilon=1e-6)
    assert torch.isfinite(q).all() and q[0, 1] == pytest.approx(1e-6)


def test_maxent_weights_validation() -> None:
    log_q = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"tau \+ beta must be > 0"):
        maxent_weights(log_q, 0.0, 0.0)
    with pytest.raises(ValueError, match="tau must be"):
        maxent_weights(log_q, -0.1)
    with pytest.raises(ValueError, match="tau must be"):
        maxent_weights(log_q, float("nan"))
    with pytest.raises(ValueError, match="beta must be"):
        maxent_weights(log_q, 1.0, -0.1)
    with pytest.raises(ValueError, match="ref_seq_logps is required when beta > 0"):
        maxent_weights(log_q, 1.0, 0.1)
    with pytest.raises(ValueError, match="ref_seq_logps must have the same shape"):
        maxent_weights(log_q, 1.0, 0.1, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="ref_seq_logps must be finite"):
        maxent_weights(log_q, 1.0, 0.1, torch.full((2, 3), float("-inf")))
    with pytest.raises(ValueError, match="log_q must be finite"):
        maxent_weights(torch.tensor([[0.0, float("-inf")]]), 1.0)
    with pytest.raises(ValueError, match=r"log_q must have shape \(B, G\)"):
        maxent_weights(torch.zeros(3), 1.0)


# ---------------------------------------------------------------- group_utility / weights


def example_utility() -> torch.Tensor:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]], dtype=F64)  # A = [.5, -.5, -.5, .5]
    return group_utility(rewards, torch.tensor([[3, 2, 3, 1]]), 4)


def test_group_utility_by_hand() -> None:
    u = example_utility()
    want = torch.tensor([[0.375, -0.25, -0.375, 0.125]], dtype=F64)  # A * T / 4
    torch.testing.assert_close(u, want, rtol=0, atol=0)
    constant = group_utility(torch.full((1, 3), 0.1, dtype=F64), torch.tensor([[1, 2, 3]]), 3)
    assert torch.equal(constant, torch.zeros(1, 3, dtype=F64))


def test_group_weights_algorithm_example() -> None:
    gw = 4 * group_weights(example_utility(), 0.5)
    want = torch.tensor([[1.8902112237, 0.5415545827, 0.4217631331, 1.1464710605]], dtype=F64)
    torch.testing.assert_close(gw, want, rtol=0, atol=1e-10)
    # Independently: exp([.75, -.5, -.75, .25]) normalised, times 4.
    assert gw[0].tolist() == pytest.approx(
        [4 * p for p in naive_softmax([0.75, -0.5, -0.75, 0.25])]
    )


@pytest.mark.parametrize(("tau", "lam"), [(0.5, 0.0), (0.1, 0.3), (0.0, 0.4), (2.0, 2.0)])
def test_group_weights_match_naive_loop(tau: float, lam: float) -> None:
    u = randn(3, 6, seed=10)
    rho = randn(3, 6, seed=11)
    w = group_weights(u, tau, lam, rho)
    for b in range(3):
        logits = [
            (x + lam * r) / (tau + lam) for x, r in zip(u[b].tolist(), rho[b].tolist(), strict=True)
        ]
        assert w[b].tolist() == pytest.approx(naive_softmax(logits), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(w.sum(dim=1), torch.ones(3, dtype=F64))


def test_group_weights_tend_to_uniform_as_tau_grows() -> None:
    u = randn(4, 5, seed=12)
    w = group_weights(u, 1e6)
    torch.testing.assert_close(w, torch.full((4, 5), 0.2, dtype=F64), rtol=0, atol=1e-6)


def test_group_weights_tau_zero_is_argmax_set_with_ties() -> None:
    u = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, -1.0, 0.5, 1.9], [0.0, 0.0, 0.0, 0.0]], dtype=F64)
    exact = group_weights(u, 0.0)
    want = torch.tensor([[0, 0.5, 0.5, 0], [1, 0, 0, 0], [0.25] * 4], dtype=F64)
    assert torch.equal(exact, want)
    torch.testing.assert_close(group_weights(u, 1e-6), exact, rtol=0, atol=1e-12)
    u32 = u.float()
    assert torch.equal(group_weights(u32, 0.0), want.float())


def test_group_weights_are_detached() -> None:
    u = randn(2, 4, seed=13).requires_grad_(True)
    for tau in (0.0, 0.5):
        w = group_weights(u, tau)
        assert not w.requires_grad and w.grad_fn is None


def test_group_utility_and_weights_validation() -> None:
    r = torch.tensor([[1.0, 0.0]])
    with pytest.raises(ValueError, match="lengths must be a tensor with the shape of rewards"):
        group_utility(r, torch.tensor([[1, 2, 3]]), 4)
    with pytest.raises(ValueError, match="lengths must lie in"):
        group_utility(r, torch.tensor([[1, 5]]), 4)
    with pytest.raises(ValueError, match="max_completion_length must be an integer >= 1"):
        group_utility(r, torch.tensor([[0, 0]]), 0)
    with pytest.raises(ValueError, match="rewards must be finite"):
        group_utility(torch.tensor([[1.0, float("nan")]]), torch.tensor([[1, 1]]), 4)
    u = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="tau must be"):
        group_weights(u, -1.0)
    with pytest.raises(ValueError, match="lam must be"):
        group_weights(u, 1.0, -1.0)
    with pytest.raises(ValueError, match="ref_seq_logps is required when lam > 0"):
        group_weights(u, 1.0, 0.5)
    with pytest.raises(ValueError, match="ref_seq_logps must have the same shape"):
        group_weights(u, 1.0, 0.5, torch.zeros(3, 2))
    with pytest.raises(ValueError, match="utility must be finite"):
        group_weights(torch.tensor([[float("inf"), 0.0]]), 1.0)


# ---------------------------------------------------------------- weight_entropy


def test_weight_entropy_by_hand_and_naive() -> None:
    w = torch.tensor([[0.25] * 4, [1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]], dtype=F64)
    h = weight_entropy(w)
    assert h.shape == (3,)
    torch.testing.assert_close(h, torch.tensor([math.log(4), 0.0, math.log(2)], dtype=F64))
    p = torch.softmax(randn(3, 7, seed=14), dim=1)
    naive = [-sum(x * math.log(x) for x in row) for row in p.tolist()]
    assert weight_entropy(p).tolist() == pytest.approx(naive, rel=1e-12)


def test_weight_entropy_validation() -> None:
    with pytest.raises(ValueError, match="weights must be non-negative"):
        weight_entropy(torch.tensor([[1.5, -0.5]]))
    with pytest.raises(ValueError, match="weights must be finite"):
        weight_entropy(torch.tensor([[float("nan"), 1.0]]))


# ---------------------------------------------------------------- distinct candidates


def test_distinct_candidates_mark_first_occurrences_ignoring_padding() -> None:
    from maxent_grpo.core import distinct_candidates

    ids = torch.tensor([[5, 6, 0], [7, 0, 0], [5, 6, 9], [7, 1, 1],   # group 0
                        [1, 1, 1], [1, 1, 1], [1, 1, 2], [2, 2, 2]])  # group 1
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 0], [1, 0, 0],
                         [1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]]).bool()
    # row 2 equals row 0 and row 3 equals row 1 on their masked tokens
    assert distinct_candidates(ids, mask, 4).tolist() == [
        [True, True, False, False], [True, False, True, True]
    ]
    assert distinct_candidates(ids[:0], mask[:0], 4).shape == (0, 4)  # every group dropped
    with pytest.raises(ValueError, match="group_size must divide"):
        distinct_candidates(ids, mask, 3)


def test_candidates_restrict_q_weights_and_loss_to_the_distinct_completions() -> None:
    """A group [a, b, a, c] with candidates [a, b, c] gives the targets and the loss of the
    three-candidate group [a, b, c]: duplicates get no weight and leave the softmax."""
    from maxent_grpo.core import listwise_loss

    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.5]], dtype=F64)
    cand = torch.tensor([[True, True, False, True]])
    dedup = rewards[:, [0, 1, 3]]
    q = q_distribution(rewards, 0.5, 1e-3, cand)
    torch.testing.assert_close(q[:, [0, 1, 3]], q_distribution(dedup, 0.5, 1e-3))
    assert q[0, 2] == 0
    w = maxent_weights(q.log(), 0.7, candidates=cand)
    torch.testing.assert_close(
        w[:, [0, 1, 3]], maxent_weights(q_distribution(dedup, 0.5, 1e-3).log(), 0.7)
    )
    assert w[0, 2] == 0
    s = torch.tensor([[-1.0, -2.0, -1.0, -3.0]], dtype=F64, requires_grad=True)
    loss = listwise_loss(s, w, cand)
    s_d = s.detach()[:, [0, 1, 3]].clone().requires_grad_(True)
    expected = listwise_loss(s_d, w[:, [0, 1, 3]])
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    assert s.grad[0, 2] == 0  # the duplicate row gets no gradient
    torch.testing.assert_close(s.grad[:, [0, 1, 3]], s_d.grad)
    with pytest.raises(ValueError, match="at least one True per row"):
        q_distribution(rewards, 1.0, 1e-6, torch.zeros_like(cand))

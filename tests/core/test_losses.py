"""Tests for the losses: surrogate and reductions (core.losses), listwise and sequence-clip
losses (core.listwise)."""

from __future__ import annotations

import math

import pytest
import torch

from maxent_grpo.core.listwise import listwise_loss, sequence_clip_loss
from maxent_grpo.core.losses import clipped_surrogate, reduce_token_loss

# ---------------------------------------------------------------- clipped_surrogate


def test_surrogate_hand_values() -> None:
    # eps = 0.2, clip range [0.8, 1.2].
    # A = +1: min(c, clip(c)) -> 0.5 -> 0.5, 1.0 -> 1.0, 1.5 -> 1.2.
    # A = -1: min(-c, -clip(c)) -> 0.5 -> -0.8, 1.0 -> -1.0, 1.5 -> -1.5.
    ratio = torch.tensor([[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]])
    surr = clipped_surrogate(ratio, torch.tensor([1.0, -1.0]))
    assert torch.allclose(surr, torch.tensor([[0.5, 1.0, 1.2], [-0.8, -1.0, -1.5]]))
    # eps_high = 0.4 (range [0.8, 1.4]): 1.5 with A = +1 -> 1.4.
    surr = clipped_surrogate(ratio, torch.tensor([1.0, -1.0]), eps_low=0.2, eps_high=0.4)
    assert surr[0, 2].item() == pytest.approx(1.4)
    # Per-token advantages: A = 2 everywhere doubles the A = +1 row.
    per_token = clipped_surrogate(ratio, torch.full((2, 3), 2.0))
    assert torch.allclose(per_token[0], torch.tensor([1.0, 2.0, 2.4]))


def test_surrogate_matches_naive_and_gradient_is_zero_where_clipped() -> None:
    gen = torch.Generator().manual_seed(0)
    ratio = (0.3 * torch.randn(5, 7, generator=gen, dtype=torch.float64)).exp()
    adv = torch.randn(5, generator=gen, dtype=torch.float64)
    x = ratio.clone().requires_grad_(True)
    surr = clipped_surrogate(x, adv, eps_low=0.2, eps_high=0.28)
    a = adv[:, None]
    naive = torch.minimum(ratio * a, ratio.clamp(0.8, 1.28) * a)
    assert torch.allclose(surr, naive, atol=1e-12, rtol=0)
    surr.sum().backward()
    clipped = ((ratio > 1.28) & (a > 0)) | ((ratio < 0.8) & (a < 0))
    assert torch.equal(x.grad[clipped], torch.zeros_like(x.grad[clipped]))
    assert torch.allclose(x.grad[~clipped], a.expand_as(ratio)[~clipped])


def test_surrogate_validation() -> None:
    ratio = torch.ones(2, 3)
    with pytest.raises(ValueError, match="eps_low"):
        clipped_surrogate(ratio, torch.ones(2), eps_low=1.0)
    with pytest.raises(ValueError, match="eps_low"):
        clipped_surrogate(ratio, torch.ones(2), eps_low=-0.01)
    with pytest.raises(ValueError, match="eps_high"):
        clipped_surrogate(ratio, torch.ones(2), eps_high=-0.01)
    with pytest.raises(ValueError, match="eps_high"):
        clipped_surrogate(ratio, torch.ones(2), eps_high=math.inf)
    with pytest.raises(ValueError, match="advantages"):
        clipped_surrogate(ratio, torch.ones(3))
    with pytest.raises(ValueError, match="advantages"):
        clipped_surrogate(ratio, torch.ones(2, 1))
    with pytest.raises(ValueError, match="ratio"):
        clipped_surrogate(torch.ones(6), torch.ones(6))


# ---------------------------------------------------------------- reduce_token_loss

# Hand example: L = [[1, 2, 3], [4, 5, 6]], m = [[1, 1, 0], [1, 0, 0]], so T_i = [2, 1].
L_HAND = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M_HAND = torch.tensor([[True, True, False], [True, False, False]])


def test_reductions_hand_example() -> None:
    # grpo:    (1/2) * ((1+2)/2 + 4/1) = (1.5 + 4) / 2 = 2.75
    assert reduce_token_loss(L_HAND, M_HAND, "grpo").item() == pytest.approx(2.75)
    # bnpo:    (1+2+4) / 3 = 7/3
    assert reduce_token_loss(L_HAND, M_HAND, "bnpo").item() == pytest.approx(7 / 3)
    # dr_grpo: 7 / (N * T_max) = 7 / (2 * 4) = 0.875
    value = reduce_token_loss(L_HAND, M_HAND, "dr_grpo", max_completion_length=4)
    assert value.item() == pytest.approx(0.875)
    # dapo:    7 / num_global_tokens = 7 / 10 = 0.7 (int or 0-d tensor)
    assert reduce_token_loss(L_HAND, M_HAND, "dapo", num_global_tokens=10).item() == (
        pytest.approx(0.7)
    )
    value = reduce_token_loss(L_HAND, M_HAND, "dapo", num_global_tokens=torch.tensor(10))
    assert value.item() == pytest.approx(0.7)
    # num_rows = 4 (these 2 rows are half of the batch): grpo 5.5/4, dr_grpo 7/(4*4).
    assert reduce_token_loss(L_HAND, M_HAND, "grpo", num_rows=4).item() == pytest.approx(1.375)
    value = reduce_token_loss(L_HAND, M_HAND, "dr_grpo", max_completion_length=4, num_rows=4)
    assert value.item() == pytest.approx(0.4375)


def test_reductions_ignore_masked_non_finite_values_and_empty_rows() -> None:
    loss = L_HAND.clone()
    loss[0, 2] = math.inf
    loss[1, 1] = math.nan
    assert reduce_token_loss(loss, M_HAND, "grpo").item() == pytest.approx(2.75)
    # A row with no tokens counts as a row with zero loss (T_i clamped to 1).
    mask = M_HAND.clone()
    mask[1] = False
    assert reduce_token_loss(L_HAND, mask, "grpo").item() == pytest.approx(1.5 / 2)
    empty = torch.zeros(2, 3, dtype=torch.bool)
    assert reduce_token_loss(L_HAND, empty, "bnpo").item() == 0.0


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """6 rows, T = 5, random lengths (one empty row), and a shared parameter theta."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([5, 2, 0, 3, 1, 4])
    mask = torch.arange(5)[None, :] < lengths[:, None]
    theta = torch.tensor([0.7, -0.3], dtype=torch.float64)
    return x, mask, theta


def _per_token(theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # A per-token loss depending non-linearly on shared parameters, like a model's.
    return theta[0] * x + (theta[1] * x).exp()


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_micro_batches_add_up_to_the_whole_batch(loss_type: str) -> None:
    x, mask, theta = _batch()
    kwargs = {"max_completion_length": 8, "num_global_tokens": int(mask.sum()), "num_rows": 6}
    whole_theta = theta.clone().requires_grad_(True)
    whole = reduce_token_loss(_per_token(whole_theta, x), mask, loss_type, **kwargs)
    whole.backward()
    acc_theta = theta.clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    for rows in (slice(0, 2), slice(2, 6)):  # micro-batches of 2 + 4 rows
        part = reduce_token_loss(_per_token(acc_theta, x[rows]), mask[rows], loss_type, **kwargs)
        part.backward()  # gradients accumulate in acc_theta.grad, as in training
        total = total + part.detach()
    assert total.item() == pytest.approx(whole.item(), abs=1e-12)
    assert torch.allclose(acc_theta.grad, whole_theta.grad, atol=1e-12, rtol=0)


def test_micro_batch_formulas_match_naive_whole_batch() -> None:
    x, mask, theta = _batch(1)
    loss = _per_token(theta, x)
    m = mask.double()
    lengths = m.sum(-1)
    naive_grpo = ((m * loss).sum(-1) / lengths.clamp(min=1)).mean()
    naive_dr = (m * loss).sum() / (6 * 8)
    naive_dapo = (m * loss).sum() / m.sum()
    assert reduce_token_loss(loss, mask, "grpo").item() == pytest.approx(naive_grpo.item())
    value = reduce_token_loss(loss, mask, "dr_grpo", max_completion_length=8)
    assert value.item() == pytest.approx(naive_dr.item())
    value = reduce_token_loss(loss, mask, "dapo", num_global_tokens=int(mask.sum()))
    assert value.item() == pytest.approx(naive_dapo.item())


def test_bnpo_is_a_mean_of_micro_batch_token_means() -> None:
    x, mask, theta = _batch(2)
    loss = _per_token(theta, x)
    parts = [(loss[:2], mask[:2]), (loss[2:], mask[2:])]
    # Each micro-batch: its own token mean, num_rows is irrelevant.
    for part_loss, part_mask in parts:
        naive = part_loss[part_mask].mean()
        value = reduce_token_loss(part_loss, part_mask, "bnpo", num_rows=6)
        assert value.item() == pytest.approx(naive.item(), abs=1e-12)
    accumulated = sum(reduce_token_loss(pl, pm, "bnpo") for pl, pm in parts) / 2
    mean_of_means = (loss[:2][mask[:2]].mean() + loss[2:][mask[2:]].mean()) / 2
    assert accumulated.item() == pytest.approx(mean_of_means.item(), abs=1e-12)
    # ...which differs from the token mean of the whole batch (7 vs 8 tokens per micro-batch).
    assert accumulated.item() != pytest.approx(loss[mask].mean().item(), abs=1e-6)


def test_reduce_validation() -> None:
    loss, mask = L_HAND, M_HAND
    with pytest.raises(ValueError, match="loss_type"):
        reduce_token_loss(loss, mask, "mean")
    with pytest.raises(ValueError, match="mask"):
        reduce_token_loss(loss, mask.float(), "grpo")
    with pytest.raises(ValueError, match="mask"):
        reduce_token_loss(loss, mask[:, :2], "grpo")
    with pytest.raises(ValueError, match="per_token_loss"):
        reduce_token_loss(loss.flatten(), mask.flatten(), "grpo")
    with pytest.raises(ValueError, match="per_token_loss"):
        reduce_token_loss(loss.long(), mask, "grpo")
    with pytest.raises(ValueError, match="max_completion_length"):
        reduce_token_loss(loss, mask, "dr_grpo")
    with pytest.raises(ValueError, match="max_completion_length"):
        reduce_token_loss(loss, mask, "dr_grpo", max_completion_length=2)  # < T = 3
    with pytest.raises(ValueError, match="max_completion_length"):
        reduce_token_loss(loss, mask, "dr_grpo", max_completion_length=0)
    with pytest.raises(ValueError, match="num_global_tokens"):
        reduce_token_loss(loss, mask, "dapo")
    with pytest.raises(ValueError, match="num_global_tokens"):
        reduce_token_loss(loss, mask, "dapo", num_global_tokens=0)
    with pytest.raises(ValueError, match="num_global_tokens"):
        reduce_token_loss(loss, mask, "dapo", num_global_tokens=torch.tensor(0.0))
    with pytest.raises(ValueError, match="num_global_tokens"):
        reduce_token_loss(loss, mask, "dapo", num_global_tokens=torch.tensor([3]))
    with pytest.raises(ValueError, match="num_global_tokens"):
        reduce_token_loss(loss, mask, "dapo", num_global_tokens=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_rows"):
        reduce_token_loss(loss, mask, "grpo", num_rows=0)
    with pytest.raises(ValueError, match="num_rows"):
        reduce_token_loss(loss, mask, "grpo", num_rows=1)  # fewer than the 2 rows given
    with pytest.raises(ValueError, match="num_rows"):
        reduce_token_loss(loss, mask, "grpo", num_rows=True)  # type: ignore[arg-type]


# ---------------------------------------------------------------- listwise_loss


def test_listwise_hand_example() -> None:
    # One group, s = [0, 0] -> p = [1/2, 1/2]; w = [1, 0] -> loss = -ln(1/2) = ln 2.
    # Gradient p - w = [-1/2, 1/2].
    s = torch.zeros(1, 2, requires_grad=True)
    loss = listwise_loss(s, torch.tensor([[1.0, 0.0]]))
    assert loss.item() == pytest.approx(math.log(2.0))
    loss.backward()
    assert torch.allclose(s.grad, torch.tensor([[-0.5, 0.5]]))


def test_listwise_value_and_gradient_p_minus_w_over_b() -> None:
    gen = torch.Generator().manual_seed(0)
    s = 4.0 * torch.randn(3, 4, generator=gen, dtype=torch.float64)
    w = torch.softmax(torch.randn(3, 4, generator=gen, dtype=torch.float64), -1)
    w_param = w.clone().requires_grad_(True)  # must be treated as a constant
    x = s.clone().requires_grad_(True)
    loss = listwise_loss(x, w_param)
    naive = -(w * torch.log_softmax(s, -1)).sum(-1).mean()
    assert loss.item() == pytest.approx(naive.item(), abs=1e-12)
    loss.backward()
    # Per group the gradient is p - w; the mean over B = 3 groups divides it by 3.
    assert torch.allclose(x.grad, (torch.softmax(s, -1) - w) / 3, atol=1e-12, rtol=0)
    assert w_param.grad is None


def test_listwise_validation() -> None:
    s = torch.zeros(2, 3)
    w = torch.full((2, 3), 1 / 3)
    with pytest.raises(ValueError, match="weights"):
        listwise_loss(s, torch.tensor([[0.5, 0.6, -0.1], [1 / 3, 1 / 3, 1 / 3]]))
    with pytest.raises(ValueError, match="weights"):
        listwise_loss(s, torch.full((2, 3), 0.3))  # rows sum to 0.9
    with pytest.raises(ValueError, match="weights"):
        listwise_loss(s, torch.full((2, 2), 0.5))
    with pytest.raises(ValueError, match="weights"):
        listwise_loss(s, torch.tensor([[math.nan, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]]))
    # Within tolerance (1e-4) is accepted.
    listwise_loss(s, w + 2e-5)
    with pytest.raises(ValueError, match="seq_logps"):
        listwise_loss(torch.zeros(6), torch.full((6,), 1 / 6))
    with pytest.raises(ValueError, match="seq_logps"):
        listwise_loss(torch.zeros(0, 3), torch.zeros(0, 3))


# ---------------------------------------------------------------- sequence_clip_loss


def test_sequence_clip_on_policy_value_zero_gradient_minus_a_hat() -> None:
    gen = torch.Generator().manual_seed(1)
    s = -20.0 * torch.rand(2, 4, generator=gen, dtype=torch.float64)
    w = torch.softmax(torch.randn(2, 4, generator=gen, dtype=torch.float64), -1)
    x = s.clone().requires_grad_(True)
    term = sequence_clip_loss(x, x.detach(), w)
    # ratio = 1 and sum_i a_hat_i = sum_i w_i - 1 = 0 -> value 0; gradient -(w - 1/G) / B.
    assert term.item() == pytest.approx(0.0, abs=1e-12)
    term.backward()
    assert torch.allclose(x.grad, -(w - 0.25) / 2, atol=1e-12, rtol=0)


def test_sequence_clip_hand_example() -> None:
    # G = 2, w = [0.8, 0.2] -> a_hat = [0.3, -0.3]; ratios [1.5, 0.5] (s - s_old = ln 1.5, ln .5)
    # i=0: min(1.5*0.3, 1.2*0.3) = 0.36; i=1: min(0.5*-0.3, 0.8*-0.3) = -0.24.
    # term = -(0.36 - 0.24) = -0.12, and both are clipped: zero gradient.
    s_old = torch.tensor([[-3.0, -4.0]], dtype=torch.float64)
    s = s_old + torch.tensor([[math.log(1.5), math.log(0.5)]], dtype=torch.float64)
    w = torch.tensor([[0.8, 0.2]], dtype=torch.float64)
    x = s.clone().requires_grad_(True)
    term = sequence_clip_loss(x, s_old, w)
    assert term.item() == pytest.approx(-0.12, abs=1e-12)
    term.backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    # A wider upper range (eps_high = 0.6 -> [0.8, 1.6]) leaves i=0 unclipped: 0.45 - 0.24.
    value = sequence_clip_loss(s, s_old, w, eps_high=0.6)
    assert value.item() == pytest.approx(-(0.45 - 0.24), abs=1e-12)


def test_sequence_clip_validation() -> None:
    s = torch.zeros(2, 3)
    w = torch.full((2, 3), 1 / 3)
    with pytest.raises(ValueError, match="old_seq_logps"):
        sequence_clip_loss(s, torch.zeros(2, 4), w)
    with pytest.raises(ValueError, match="weights"):
        sequence_clip_loss(s, s, torch.full((2, 3), 0.5))
    with pytest.raises(ValueError, match="eps_low"):
        sequence_clip_loss(s, s, w, eps_low=1.5)
    with pytest.raises(ValueError, match="max_log_ratio"):
        sequence_clip_loss(s, s, w, max_log_ratio=0.0)

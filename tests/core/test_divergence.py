"""Tests for maxent_grpo.core.losses' parts: KL estimators, importance ratio, clip fractions."""

from __future__ import annotations

import math

import pytest
import torch

from maxent_grpo.core.losses import (
    clip_fractions,
    importance_ratio,
    importance_ratio_at,
    kl_penalty,
    sampler_correction_weights,
)

LN2 = math.log(2.0)


def _pair(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logps = -3.0 * torch.rand(4, 6, generator=gen, dtype=torch.float64)
    ref = -3.0 * torch.rand(4, 6, generator=gen, dtype=torch.float64)
    return logps, ref


# ---------------------------------------------------------------- kl_penalty


def test_kl_hand_values() -> None:
    # logps = ln 1/2, ref = ln 1/4 -> d = ref - logps = -ln 2.
    # k1 = ln 2; k2 = (ln 2)^2 / 2; k3 = e^{-ln 2} + ln 2 - 1 = 1/2 + ln 2 - 1.
    logps = torch.tensor([[math.log(0.5)]], dtype=torch.float64)
    ref = torch.tensor([[math.log(0.25)]], dtype=torch.float64)
    assert kl_penalty(logps, ref, "k1").item() == pytest.approx(LN2, abs=1e-15)
    assert kl_penalty(logps, ref, "k2").item() == pytest.approx(LN2**2 / 2, abs=1e-15)
    assert kl_penalty(logps, ref, "k3").item() == pytest.approx(LN2 - 0.5, abs=1e-15)
    assert kl_penalty(logps, ref).item() == pytest.approx(LN2 - 0.5, abs=1e-15)  # default k3


def test_kl_matches_naive_float64() -> None:
    logps, ref = _pair()
    d = ref - logps
    assert torch.allclose(kl_penalty(logps, ref, "k1"), -d, atol=1e-12, rtol=0)
    assert torch.allclose(kl_penalty(logps, ref, "k2"), d**2 / 2, atol=1e-12, rtol=0)
    assert torch.allclose(kl_penalty(logps, ref, "k3"), d.exp() - d - 1, atol=1e-12, rtol=0)
    assert torch.allclose(
        kl_penalty(logps.float(), ref.float(), "k3").double(), d.exp() - d - 1, atol=1e-5, rtol=0
    )


def test_kl_properties_on_random_inputs() -> None:
    gen = torch.Generator().manual_seed(1)
    logps = 5.0 * torch.randn(64, 32, generator=gen)
    ref = 5.0 * torch.randn(64, 32, generator=gen)
    assert (kl_penalty(logps, ref, "k2") >= 0).all()
    assert (kl_penalty(logps, ref, "k3") >= 0).all()
    for est in ("k1", "k2", "k3"):
        assert torch.equal(kl_penalty(logps, logps, est), torch.zeros_like(logps))


def test_k3_gradient() -> None:
    # k3 = e^d - d - 1 with d = ref - logps: d k3 / d logps = 1 - e^d.
    logps, ref = _pair(2)
    x = logps.clone().requires_grad_(True)
    kl_penalty(x, ref, "k3").sum().backward()
    assert torch.allclose(x.grad, 1 - (ref - logps).exp(), atol=1e-12, rtol=0)


def test_kl_validation() -> None:
    a = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="estimator"):
        kl_penalty(a, a, "k4")
    with pytest.raises(ValueError, match="ref_logps"):
        kl_penalty(a, torch.zeros(3, 2))
    with pytest.raises(ValueError, match="ref_logps"):
        kl_penalty(a, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="logps"):
        kl_penalty([0.0], a)  # type: ignore[arg-type]


# ---------------------------------------------------------------- importance_ratio


def test_ratio_values_and_bound() -> None:
    # log-ratios [ln 2, 0, -ln 2, 50, -50] -> [2, 1, 1/2, e^20, e^-20] with the default bound.
    logps = torch.tensor([[LN2, 0.0, -LN2, 50.0, -50.0]], dtype=torch.float64)
    old = torch.zeros_like(logps)
    expected = torch.tensor([[2.0, 1.0, 0.5, math.exp(20), math.exp(-20)]], dtype=torch.float64)
    assert torch.allclose(importance_ratio(logps, old), expected, rtol=1e-12, atol=0)
    assert importance_ratio(logps, old, max_log_ratio=0.5)[0, 0].item() == pytest.approx(
        math.exp(0.5)
    )
    # float32 does not overflow even for huge log-ratios.
    huge = importance_ratio(torch.tensor([1e6]), torch.tensor([0.0]))
    assert torch.isfinite(huge).all()


@pytest.mark.parametrize("level", ["token", "sequence", "sequence_token"])
def test_ratio_stays_finite_in_float16(level) -> None:
    # e^20 is past float16's largest value (65504): the bound there is log(65504) - 1
    logps = torch.tensor([[15.0, -15.0, 14.0]], dtype=torch.float16)
    old = torch.zeros_like(logps)
    mask = torch.tensor([[True, False, True]])
    ratio = importance_ratio_at(logps, old, mask, level=level)
    assert torch.isfinite(ratio).all()
    bound = math.log(65504) - 1
    assert ratio[0, 0].item() == pytest.approx(math.exp(bound), rel=1e-2)
    if level == "token":
        assert ratio[0, 1].item() == pytest.approx(math.exp(-bound), rel=1e-2)
    # float32 keeps the bound asked for
    assert importance_ratio(logps.float(), old.float())[0, 0].item() == pytest.approx(
        math.exp(15.0), rel=1e-6)


def test_ratio_on_policy_is_one_with_gradient_of_logps() -> None:
    logps, _ = _pair(3)
    x = logps.clone().requires_grad_(True)
    ratio = importance_ratio(x, x.detach())
    assert torch.equal(ratio, torch.ones_like(ratio))
    ratio.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_ratio_old_logps_is_constant_and_clamp_kills_gradient() -> None:
    x = torch.tensor([0.3, 30.0], requires_grad=True)
    old = torch.zeros(2, requires_grad=True)
    importance_ratio(x, old).sum().backward()
    assert old.grad is None
    assert x.grad[0].item() == pytest.approx(math.exp(0.3), rel=1e-6)
    assert x.grad[1].item() == 0.0


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan, True, "20"])
def test_ratio_validation_bound(bad: object) -> None:
    a = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="max_log_ratio"):
        importance_ratio(a, a, max_log_ratio=bad)  # type: ignore[arg-type]


def test_ratio_validation_shapes() -> None:
    with pytest.raises(ValueError, match="old_logps"):
        importance_ratio(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="logps"):
        importance_ratio(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3))


# ---------------------------------------------------------------- clip_fractions


def test_clip_fractions_hand_example() -> None:
    # eps = 0.2: low needs ratio < 0.8 and A < 0; high needs ratio > 1.2 and A > 0.
    # row 0 (A = -1): ratios 0.5 (low), 0.9, 1.5 (A < 0: not high), 0.1 (masked out)
    # row 1 (A = +1): ratios 0.5 (A > 0: not low), 1.3 (high), 1.25 (high), 2.0 (masked out)
    ratio = torch.tensor([[0.5, 0.9, 1.5, 0.1], [0.5, 1.3, 1.25, 2.0]])
    adv = torch.tensor([-1.0, 1.0])
    mask = torch.tensor([[True, True, True, False], [True, True, True, False]])
    low, high, total = clip_fractions(ratio, adv, mask)
    # 6 unmasked tokens: 1 low, 2 high.
    assert low.item() == pytest.approx(1 / 6)
    assert high.item() == pytest.approx(2 / 6)
    assert total.item() == pytest.approx(3 / 6)
    assert low.dim() == 0 and low.dtype == torch.float32
    # eps_high = 0.28: 1.3 is still high, 1.25 no longer.
    _, high, total = clip_fractions(ratio, adv, mask, eps_low=0.2, eps_high=0.28)
    assert high.item() == pytest.approx(1 / 6)
    assert total.item() == pytest.approx(2 / 6)
    # Per-token advantages give the same result as the broadcast row advantages.
    per_token = adv.unsqueeze(-1).expand(2, 4).clone()
    assert clip_fractions(ratio, per_token, mask)[2].item() == pytest.approx(3 / 6)


def test_clip_fractions_empty_mask_and_no_grad() -> None:
    ratio = torch.full((2, 3), 5.0, requires_grad=True)
    low, high, total = clip_fractions(ratio, torch.ones(2), torch.zeros(2, 3, dtype=torch.bool))
    assert (low.item(), high.item(), total.item()) == (0.0, 0.0, 0.0)
    assert not total.requires_grad


def test_clip_fractions_validation() -> None:
    ratio = torch.ones(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="mask"):
        clip_fractions(ratio, torch.ones(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask"):
        clip_fractions(ratio, torch.ones(2), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="advantages"):
        clip_fractions(ratio, torch.ones(3), mask)
    with pytest.raises(ValueError, match="ratio"):
        clip_fractions(torch.ones(6), torch.ones(6), mask)
    with pytest.raises(ValueError, match="eps_low"):
        clip_fractions(ratio, torch.ones(2), mask, eps_low=1.0)
    with pytest.raises(ValueError, match="eps_low"):
        clip_fractions(ratio, torch.ones(2), mask, eps_low=-0.1)
    with pytest.raises(ValueError, match="eps_high"):
        clip_fractions(ratio, torch.ones(2), mask, eps_high=-0.1)


# sampler correction (docs/ALGORITHM.md §2): d = logps - sampler_logps = [0.5, -1.0, masked]
LOGPS = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
SAMPLER = torch.tensor([[-1.5, -1.0, 7.0]], dtype=torch.float64)  # garbage under the mask
MASK3 = torch.tensor([[True, True, False]])
E_HALF, E_MINUS1, E_MINUS_HALF = math.exp(0.5), math.exp(-1.0), math.exp(-0.5)


@pytest.mark.parametrize(("mode", "cap", "expected"), [
    ("token_tis", 1.5, [1.5, E_MINUS1, 0.0]),  # e^0.5 = 1.649 truncated at 1.5
    ("token_mis", 1.5, [0.0, E_MINUS1, 0.0]),  # e^0.5 > 1.5 is masked
    ("token_tis", 2.0, [E_HALF, E_MINUS1, 0.0]),
    ("sequence_tis", 1.5, [E_MINUS_HALF] * 2 + [0.0]),  # exp(0.5 - 1.0) for every token
    ("sequence_tis", 0.5, [0.5, 0.5, 0.0]),
    ("sequence_mis", 1.5, [E_MINUS_HALF] * 2 + [0.0]),
    ("sequence_mis", 0.5, [0.0, 0.0, 0.0]),
])
def test_sampler_correction_weights_by_hand(mode: str, cap: float, expected: list[float]) -> None:
    w = sampler_correction_weights(LOGPS.requires_grad_(), SAMPLER, MASK3, mode, cap)
    assert w.requires_grad is False
    assert w[0].tolist() == pytest.approx(expected, rel=1e-15, abs=0.0)


def test_sampler_correction_weights_refuse_bad_modes_and_caps() -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        sampler_correction_weights(LOGPS, SAMPLER, MASK3, "tis", 2.0)
    with pytest.raises(ValueError, match="cap must be > 0"):
        sampler_correction_weights(LOGPS, SAMPLER, MASK3, "token_tis", 0.0)

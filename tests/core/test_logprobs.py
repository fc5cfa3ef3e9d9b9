"""Tests for maxent_grpo.core.logprobs: selective log-softmax and exact token entropy."""

from __future__ import annotations

import math

import pytest
import torch

from maxent_grpo.core import logprobs
from maxent_grpo.core.logprobs import selective_log_softmax, token_entropy


def naive_logp(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)


def naive_entropy(logits: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(logits, -1)
    return -(p * torch.log_softmax(logits, -1)).sum(-1)


def _inputs(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = (3.0 * torch.randn(3, 5, 11, generator=gen, dtype=torch.float64)).to(dtype)
    index = torch.randint(0, 11, (3, 5), generator=gen)
    return logits, index


# ---------------------------------------------------------------- hand-checkable values


def test_entropy_spec_example() -> None:
    # p = e^[2,1,0] / (e^2 + e + 1); H = -sum p log p = 0.8323955818399389 (docs/ALGORITHM.md §2).
    z = torch.tensor([[[2.0, 1.0, 0.0]]], dtype=torch.float64)
    assert token_entropy(z).item() == pytest.approx(0.8323955818399389, abs=1e-15)
    assert token_entropy(z.float()).item() == pytest.approx(0.8323955818399389, abs=1e-6)


def test_entropy_uniform_and_one_hot() -> None:
    # Equal logits over V tokens: H = log V. One dominant logit: H ~ 0.
    flat = torch.zeros(1, 2, 8)
    assert torch.allclose(token_entropy(flat), torch.full((1, 2), math.log(8.0)))
    peaked = torch.tensor([[[0.0, -1e4, -1e4]]])
    assert token_entropy(peaked).item() == pytest.approx(0.0, abs=1e-6)


def test_selective_hand_example() -> None:
    # logits [0, 0, ln 2] -> p = [1/4, 1/4, 1/2]; index 2 -> ln(1/2); index 0 -> ln(1/4).
    z = torch.tensor([[[0.0, 0.0, math.log(2.0)], [0.0, 0.0, math.log(2.0)]]])
    out = selective_log_softmax(z, torch.tensor([[2, 0]]))
    assert out.dtype == torch.float32
    assert torch.allclose(out, torch.tensor([[math.log(0.5), math.log(0.25)]]), atol=1e-7)


# ---------------------------------------------------------------- against naive formulas


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_selective_matches_naive_values_and_grads(dtype: torch.dtype, tol: float) -> None:
    logits, index = _inputs(dtype)
    upstream = torch.randn(3, 5, dtype=dtype, generator=torch.Generator().manual_seed(1))
    mine_in = logits.clone().requires_grad_(True)
    ref_in = logits.double().requires_grad_(True)
    mine = selective_log_softmax(mine_in, index)
    ref = naive_logp(ref_in, index)
    assert mine.dtype == dtype
    assert torch.allclose(mine.double(), ref, atol=tol, rtol=0)
    (mine * upstream).sum().backward()
    (ref * upstream.double()).sum().backward()
    assert mine_in.grad is not None and mine_in.grad.dtype == dtype
    assert torch.allclose(mine_in.grad.double(), ref_in.grad, atol=tol, rtol=0)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_entropy_matches_naive_values_and_grads(dtype: torch.dtype, tol: float) -> None:
    logits, _ = _inputs(dtype, seed=2)
    upstream = torch.randn(3, 5, dtype=dtype, generator=torch.Generator().manual_seed(3))
    mine_in = logits.clone().requires_grad_(True)
    ref_in = logits.double().requires_grad_(True)
    mine = token_entropy(mine_in)
    ref = naive_entropy(ref_in)
    assert mine.dtype == dtype
    assert torch.allclose(mine.double(), ref, atol=tol, rtol=0)
    (mine * upstream).sum().backward()
    (ref * upstream.double()).sum().backward()
    assert torch.allclose(mine_in.grad.double(), ref_in.grad, atol=tol, rtol=0)


def test_gradcheck_float64() -> None:
    logits, index = _inputs(torch.float64, seed=4)
    x = logits[:2, :3, :6].clone().requires_grad_(True)
    idx = index[:2, :3] % 6
    assert torch.autograd.gradcheck(lambda z: selective_log_softmax(z, idx), (x,))
    assert torch.autograd.gradcheck(token_entropy, (x,))


@pytest.mark.parametrize("block", [22, 110])
def test_blocks_give_same_result(monkeypatch: pytest.MonkeyPatch, block: int) -> None:
    # 22 values / V=11: blocks of 2 tokens, every row of T=5 cut into 3 blocks;
    # 110 values: 2 whole rows of 5 x 11 per block, so N=3 rows make blocks of 2 and 1.
    logits, index = _inputs(torch.float64, seed=5)
    monkeypatch.setattr(logprobs, "BLOCK_ELEMENTS", block)
    expected = [(slice(0, 2), slice(0, 5)), (slice(2, 3), slice(0, 5))] if block == 110 else None
    if expected is not None:
        assert list(logprobs._blocks(logits)) == expected
    x = logits.clone().requires_grad_(True)
    (selective_log_softmax(x, index).sum() + token_entropy(x).sum()).backward()
    y = logits.clone().requires_grad_(True)
    (naive_logp(y, index).sum() + naive_entropy(y).sum()).backward()
    assert torch.allclose(x.grad, y.grad, atol=1e-12, rtol=0)


def test_bf16_input_matches_float32_reference() -> None:
    logits, index = _inputs(torch.bfloat16, seed=6)
    upstream = torch.randn(3, 5, generator=torch.Generator().manual_seed(7))
    x = logits.clone().requires_grad_(True)
    lp, ent = selective_log_softmax(x, index), token_entropy(x)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    # The same bf16 values, upcast: the computation itself is float32, so this is tight.
    ref_in = logits.float().requires_grad_(True)
    ref_lp, ref_ent = naive_logp(ref_in, index), naive_entropy(ref_in)
    assert torch.allclose(lp, ref_lp, atol=1e-5, rtol=0)
    assert torch.allclose(ent, ref_ent, atol=1e-5, rtol=0)
    ((lp + ent) * upstream).sum().backward()
    ((ref_lp + ref_ent) * upstream).sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.bfloat16
    # The gradient is rounded to bf16 (8 mantissa bits): relative error <= 2^-8.
    assert torch.allclose(x.grad.float(), ref_in.grad, atol=1e-3, rtol=2**-7)


def test_large_common_offset_stays_accurate_in_float32() -> None:
    # Logits ~1e4: the float32 spacing there is ~1e-3, yet results must keep ~1e-5 accuracy.
    logits, index = _inputs(torch.float64, seed=8)
    shifted = (logits + 1e4).float()
    assert torch.allclose(
        token_entropy(shifted).double(), naive_entropy(shifted.double()), atol=1e-5, rtol=0
    )
    assert torch.allclose(
        selective_log_softmax(shifted, index).double(),
        naive_logp(shifted.double(), index),
        atol=1e-5,
        rtol=0,
    )


def test_minus_inf_logits_are_zero_probability_tokens() -> None:
    # [0, 0, -inf]: two equally likely tokens -> H = ln 2; the -inf token has log p = -inf.
    z = torch.tensor([[[0.0, 0.0, -math.inf]]], requires_grad=True)
    ent = token_entropy(z)
    lp = selective_log_softmax(z, torch.tensor([[0]]))
    assert ent.item() == pytest.approx(math.log(2.0), abs=1e-7)
    assert lp.item() == pytest.approx(math.log(0.5), abs=1e-7)
    (ent + lp).sum().backward()
    assert torch.isfinite(z.grad).all()
    assert selective_log_softmax(z.detach(), torch.tensor([[2]])).item() == -math.inf


def test_empty_batch() -> None:
    z = torch.zeros(0, 4, 5)
    assert selective_log_softmax(z, torch.zeros(0, 4, dtype=torch.long)).shape == (0, 4)
    assert token_entropy(z).shape == (0, 4)


def test_non_contiguous_logits() -> None:
    # The usual call slices the model output: logits[:, :-1] is not contiguous.
    logits, index = _inputs(torch.float64, seed=9)
    full = torch.cat([logits, logits[:, :1]], dim=1)[:, :-1]
    assert not full.is_contiguous()
    assert torch.allclose(selective_log_softmax(full, index), naive_logp(logits, index))
    assert torch.allclose(token_entropy(full), naive_entropy(logits))


# ---------------------------------------------------------------- validation


def test_logits_validation() -> None:
    idx = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="logits"):
        selective_log_softmax(torch.zeros(2, 3), idx)
    with pytest.raises(ValueError, match="logits"):
        token_entropy(torch.zeros(2, 3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="logits"):
        token_entropy(torch.zeros(2, 3, 0))
    with pytest.raises(ValueError, match="logits"):
        token_entropy([[[0.0]]])  # type: ignore[arg-type]


def test_index_validation() -> None:
    z = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="index"):
        selective_log_softmax(z, torch.zeros(2, 3))  # float ids
    with pytest.raises(ValueError, match="index"):
        selective_log_softmax(z, torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="index"):
        selective_log_softmax(z, torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="index"):
        selective_log_softmax(z, torch.zeros(2, 3, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="index"):
        selective_log_softmax(z, torch.full((2, 3), 4))
    with pytest.raises(ValueError, match="index"):
        selective_log_softmax(z, torch.full((2, 3), -1))


# ---------------------------------------------------------------- the fused pass


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_fused_matches_naive_values_and_grads(
    dtype: torch.dtype, tol: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logprobs, "BLOCK_ELEMENTS", 22)  # several blocks per row
    logits, index = _inputs(dtype, seed=8)
    logits[0, 0, 3] = -math.inf  # a zero-probability token
    gen = torch.Generator().manual_seed(9)
    up_logp = torch.randn(3, 5, dtype=torch.float64, generator=gen)
    up_ent = torch.randn(3, 5, dtype=torch.float64, generator=gen)
    mine_in = logits.clone().requires_grad_(True)
    ref_in = logits.double().requires_grad_(True)
    logp, ent = logprobs.selective_log_softmax_with_entropy(mine_in, index)
    p = torch.softmax(ref_in, -1)
    log_p = torch.log_softmax(ref_in, -1)
    ref_logp = log_p.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(p * torch.where(p > 0, log_p, torch.zeros_like(log_p))).sum(-1)
    assert torch.allclose(logp.double(), ref_logp, atol=tol, rtol=0)
    assert torch.allclose(ent.double(), ref_ent, atol=tol, rtol=0)
    ((logp.double() * up_logp).sum() + (ent.double() * up_ent).sum()).backward()
    ((ref_logp * up_logp).sum() + (ref_ent * up_ent).sum()).backward()
    assert mine_in.grad.dtype == dtype
    assert torch.allclose(mine_in.grad.double(), ref_in.grad, atol=tol, rtol=0)


def test_fused_with_one_output_unused_and_gradcheck() -> None:
    logits, index = _inputs(torch.float64, seed=10)
    x = logits.clone().requires_grad_(True)
    logp, _ = logprobs.selective_log_softmax_with_entropy(x, index)
    logp.sum().backward()  # the entropy output takes no part: its gradient is zero
    y = logits.clone().requires_grad_(True)
    selective_log_softmax(y, index).sum().backward()
    assert torch.allclose(x.grad, y.grad, atol=1e-12, rtol=0)
    z = logits[:2, :3, :6].clone().requires_grad_(True)
    idx = index[:2, :3] % 6
    assert torch.autograd.gradcheck(
        lambda t: logprobs.selective_log_softmax_with_entropy(t, idx), (z,)
    )


def test_block_size_by_device() -> None:
    """CPU: the measured 2 Mi values; CUDA: a 32nd of the logits, never below that."""
    issue13 = 16 * 1024 * 151936  # the GPU workload's policy logits
    assert logprobs.block_elements(issue13, "cpu") == logprobs.BLOCK_ELEMENTS == 1 << 21
    cuda = logprobs.block_elements(issue13, "cuda")
    assert cuda == issue13 // 32 and 4 * cuda / (2 * issue13) == 1 / 16  # float32 vs bf16
    assert logprobs.block_elements(1000, "cuda") == logprobs.BLOCK_ELEMENTS


# ---------------------------------------------------------------- the temperature
@pytest.mark.parametrize("with_entropy", [False, True])
def test_temperature_is_the_division_it_replaces(with_entropy: bool) -> None:
    """float32: dividing inside the blocks gives the bits of ``logits / T`` divided first,
    values and gradients (the demo's runs do not move)."""
    logits, index = _inputs(torch.float32, seed=3)
    grads = []
    outs = []
    for inside in (True, False):
        x = logits.clone().requires_grad_(True)
        if with_entropy:
            args = (x, index, 0.7) if inside else (x / 0.7, index)
            logp, ent = logprobs.selective_log_softmax_with_entropy(*args)
            (logp.sum() + 0.3 * ent.sum()).backward()
            outs.append(torch.cat([logp, ent]))
        else:
            logp = selective_log_softmax(x, index, 0.7) if inside else selective_log_softmax(
                x / 0.7, index)
            logp.sum().backward()
            outs.append(logp)
        grads.append(x.grad)
    assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])


def test_float16_logits_at_a_low_temperature_stay_finite() -> None:
    """Half-precision logits divided by a small temperature overflowed to inf (NaN
    log-probs); divided after the float32 upcast they match float64."""
    logits, index = _inputs(torch.float64, seed=4)
    logits = 10.0 * logits  # |z| ~ 30, as a real model's
    T = 2e-4
    half = logits.half()
    assert not torch.isfinite(half / T).all()  # the old order
    x = half.clone().requires_grad_(True)
    logp, ent = logprobs.selective_log_softmax_with_entropy(x, index, T)
    ref = half.double() / T
    assert torch.allclose(logp.double(), naive_logp(ref, index), atol=1e-3, rtol=0)
    assert torch.allclose(ent.double(), naive_entropy(ref), atol=1e-3, rtol=0)
    (logp.sum() + ent.sum()).backward()
    assert x.grad.dtype == torch.float16 and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), True, "1"])
def test_temperature_is_checked(bad: object) -> None:
    logits, index = _inputs(torch.float32)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        selective_log_softmax(logits, index, bad)

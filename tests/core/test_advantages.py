"""Group advantages (docs/ALGORITHM.md §1) against hand numbers and naive float64 loops."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from maxent_grpo.core.advantages import group_advantages, zero_std_fraction


def naive_advantages(rows: list[list[float]], scale: str, eps: float = 1e-4) -> list[list[float]]:
    flat = [x for row in rows for x in row]
    out = []
    for row in rows:
        mean = sum(row) / len(row)
        if scale == "group":
            div = statistics.stdev(row) + eps
        elif scale == "batch":
            div = statistics.stdev(flat) + eps
        else:
            div = 1.0
        out.append([(x - mean) / div for x in row])
    return out


def test_algorithm_example_group_and_none() -> None:
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    a = 0.8658754297607016  # 0.5 / (sqrt(1/3) + 1e-4)
    assert 0.5 / (math.sqrt(1 / 3) + 1e-4) == pytest.approx(a, abs=1e-15)
    expected = torch.tensor([[a, -a, -a, a]], dtype=torch.float64)
    torch.testing.assert_close(group_advantages(r, "group"), expected, rtol=0, atol=1e-15)
    half = torch.tensor([[0.5, -0.5, -0.5, 0.5]], dtype=torch.float64)
    torch.testing.assert_close(group_advantages(r, "none"), half, rtol=0, atol=0)


def test_batch_scale_by_hand() -> None:
    # Rewards 1,0,0,1 | 2,2,2,2: batch mean 10/8 = 1.25, squared deviations
    # 2 * 0.0625 + 2 * 1.5625 + 4 * 0.5625 = 5.5, unbiased std sqrt(5.5 / 7) = sqrt(11/14).
    # The first group is centred at 0.5 (A = +-0.5 before scaling), the second is constant.
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]], dtype=torch.float64)
    a = 0.5 / (math.sqrt(11 / 14) + 1e-4)
    expected = torch.tensor([[a, -a, -a, a], [0.0] * 4], dtype=torch.float64)
    torch.testing.assert_close(group_advantages(r, "batch"), expected, rtol=0, atol=1e-15)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_naive_loops(scale: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    r = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    out = group_advantages(r.to(dtype), scale)
    assert out.dtype == dtype and out.shape == (5, 6)
    expected = torch.tensor(naive_advantages(r.tolist(), scale), dtype=torch.float64)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_equal_rewards_give_exact_zero(scale: str) -> None:
    # 0.1 * 3 / 3 is not exactly 0.1 in binary: the zero must be enforced, not rounded.
    r = torch.tensor([[0.1, 0.1, 0.1], [0.7, 0.7, 0.7]], dtype=torch.float64)
    assert torch.equal(group_advantages(r, scale), torch.zeros(2, 3, dtype=torch.float64))
    assert torch.equal(group_advantages(r, scale, eps=0.0), torch.zeros(2, 3, dtype=torch.float64))
    mixed = torch.tensor([[0.1, 0.1, 0.1], [0.0, 1.0, 0.5]])
    out = group_advantages(mixed, scale)
    assert torch.equal(out[0], torch.zeros(3)) and bool((out[1] != 0).any())


def test_zero_std_fraction() -> None:
    r = torch.tensor([[1.0, 1.0], [0.0, 1.0], [3.0, 3.0], [2.0, 5.0]])
    frac = zero_std_fraction(r)
    assert frac.dim() == 0 and frac.item() == 0.5
    assert zero_std_fraction(torch.tensor([[0.0, 1.0]])).item() == 0.0
    assert zero_std_fraction(torch.tensor([[4.0]], dtype=torch.float64)).item() == 1.0


@pytest.mark.parametrize(
    ("rewards", "kwargs", "match"),
    [
        (torch.tensor([[1, 0]]), {}, "rewards must be a floating-point"),
        (torch.tensor([1.0, 0.0]), {}, r"rewards must have shape \(B, G\)"),
        (torch.tensor([[1.0], [0.0]]), {}, "rewards .*G >= 2"),
        (torch.zeros(0, 3), {}, "rewards .*B >= 1"),
        (torch.tensor([[1.0, float("nan")]]), {}, "rewards must be finite"),
        (torch.tensor([[1.0, float("inf")]]), {}, "rewards must be finite"),
        ([[1.0, 0.0]], {}, "rewards must be a torch.Tensor"),
        (torch.tensor([[1.0, 0.0]]), {"scale": "foo"}, "scale must be one of 'group', 'batch'"),
        (torch.tensor([[1.0, 0.0]]), {"eps": -1e-4}, "eps must be"),
        (torch.tensor([[1.0, 0.0]]), {"eps": float("nan")}, "eps must be"),
    ],
)
def test_validation(rewards: object, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, **kwargs)  # type: ignore[arg-type]


def test_zero_std_fraction_validation() -> None:
    with pytest.raises(ValueError, match="rewards must be finite"):
        zero_std_fraction(torch.tensor([[float("nan"), 1.0]]))
    with pytest.raises(ValueError, match="rewards must be a floating-point"):
        zero_std_fraction(torch.tensor([[1, 1]]))

"""Tests for maxent_grpo.training.step.metrics: hand-checkable values and exact accumulation.

"Exact" here means: updating one metric with all the data gives the same numbers as
splitting the data into uneven micro-batches, or across simulated ranks, and reducing the
states. Each such test also checks that the naive average of the parts' averages differs,
so it would catch a metric that stored averages.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import pytest
import torch
from torchmetrics import Metric

from maxent_grpo.training import types
from maxent_grpo.training.step.metrics import (
    RewardComponentsMetric,
    RewardMomentsMetric,
    TokenMean,
    TokenUsageMetric,
    divide_or_nan,
    mean_std_from_sums,
)

F64 = torch.float64
NAN = math.nan


def values_of(out: dict[str, torch.Tensor]) -> dict[str, float]:
    return {key: float(value) for key, value in out.items()}


def assert_same(a: dict[str, float], b: dict[str, float]) -> None:
    """Equal keys and values (NaN equals NaN), to float64 rounding."""
    assert a.keys() == b.keys()
    for key in a:
        assert a[key] == pytest.approx(b[key], rel=1e-12, abs=1e-12, nan_ok=True), key


def quiet_compute(metric: Metric) -> dict[str, float]:
    """compute() of a metric that may have had no update (torchmetrics warns then)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return values_of(metric.compute())


def two_ranks(make: Callable[..., Metric]) -> tuple[Metric, Metric]:
    """Two metrics acting as ranks 0 and 1; rank 0's compute() syncs through dist_reduce_fx.

    The fake all-gather returns [rank-0 state, rank-1 state] for whichever state torchmetrics
    asks for, so compute() runs the same stack-and-reduce path as under DDP.
    """
    rank1 = make()

    def gather(tensor: torch.Tensor, group: object = None) -> list[torch.Tensor]:
        for name, value in rank0.metric_state.items():
            if value is tensor:
                return [tensor, rank1.metric_state[name]]
        raise AssertionError("gather called with a tensor that is not a metric state")

    rank0 = make(dist_sync_fn=gather, distributed_available_fn=lambda: True)
    return rank0, rank1


# ------------------------------------------------------------------------------ pure math


def test_mean_std_from_sums_matches_torch_unbiased_std() -> None:
    x = torch.tensor([0.5, 2.0, -1.0, 3.5, 0.0], dtype=F64)
    mean, std = mean_std_from_sums(x.sum(), (x * x).sum(), torch.tensor(5))
    assert float(mean) == pytest.approx(float(x.mean()), rel=1e-14)
    assert float(std) == pytest.approx(float(x.std(unbiased=True)), rel=1e-12)


def test_mean_std_from_sums_small_counts_and_elementwise() -> None:
    # three components: n = 0 (no data), n = 1 (no spread defined), n = 2 (values 1 and 3)
    total = torch.tensor([0.0, 4.0, 4.0])
    total_sq = torch.tensor([0.0, 16.0, 10.0])
    count = torch.tensor([0, 1, 2])
    mean, std = mean_std_from_sums(total, total_sq, count)
    assert math.isnan(mean[0]) and math.isnan(std[0])
    assert float(mean[1]) == 4.0 and math.isnan(std[1])
    assert float(mean[2]) == 2.0 and float(std[2]) == pytest.approx(math.sqrt(2.0))


def test_mean_std_from_sums_clamps_rounding_to_zero() -> None:
    x = torch.full((7,), 0.1, dtype=F64)  # sum x^2 - (sum x)^2 / n may round below 0
    _, std = mean_std_from_sums(x.sum(), (x * x).sum(), torch.tensor(7))
    assert float(std) == pytest.approx(0.0, abs=1e-7)
    assert not math.isnan(std)


def test_divide_or_nan() -> None:
    out = divide_or_nan(torch.tensor([1, 3, 0]), torch.tensor([2, 0, 0]))
    assert out.dtype == F64
    assert float(out[0]) == 0.5 and math.isnan(out[1]) and math.isnan(out[2])


# ------------------------------------------------------------------------------ RewardMomentsMetric


def test_reward_moments_hand_values() -> None:
    # rewards 0, 1, 1, 1: mean 3/4; squared deviations 9/16 + 3 * 1/16 = 3/4; / (n-1) = 1/4
    rewards = torch.tensor([[0.0, 1.0], [1.0, 1.0]])
    metric = RewardMomentsMetric()
    metric.update(rewards)
    out = values_of(metric.compute())
    assert out == {"mean": 0.75, "std": 0.5, "min": 0.0, "max": 1.0, "zero_std_frac": 0.5}
    flat = rewards.flatten().to(F64)
    assert out["std"] == pytest.approx(float(flat.std(unbiased=True)))


def test_reward_moments_summary_dataclass() -> None:
    metric = RewardMomentsMetric()
    metric.update(torch.tensor([[0.0, 1.0], [1.0, 1.0]]))
    summary = metric.summary()
    assert isinstance(summary, types.RewardMoments)
    assert (summary.mean, summary.std) == (0.75, 0.5)


# whole batch: groups [0,0] | [1,1] [1,0] [1,1]  (an uneven split: 1 group, then 3)
REWARDS_A = torch.tensor([[0.0, 0.0]])
REWARDS_B = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
REWARDS_ALL = torch.cat([REWARDS_A, REWARDS_B])


def whole_reward_moments() -> dict[str, float]:
    metric = RewardMomentsMetric()
    metric.update(REWARDS_ALL)
    return values_of(metric.compute())


def test_reward_moments_whole_matches_naive_formulas() -> None:
    flat = REWARDS_ALL.flatten().to(F64)
    expected = {
        "mean": 5 / 8,
        "std": float(flat.std(unbiased=True)),  # sqrt((5 - 8 * (5/8)^2) / 7)
        "min": 0.0,
        "max": 1.0,
        "zero_std_frac": 3 / 4,
    }
    assert_same(whole_reward_moments(), expected)
    assert expected["std"] == pytest.approx(math.sqrt(1.875 / 7))


def test_reward_moments_micro_batches_are_exact_not_average_of_averages() -> None:
    metric = RewardMomentsMetric()
    metric.update(REWARDS_A)
    metric.update(REWARDS_B)
    whole = whole_reward_moments()
    assert_same(values_of(metric.compute()), whole)
    naive_mean = (REWARDS_A.mean() + REWARDS_B.mean()) / 2  # (0 + 5/6) / 2
    assert float(naive_mean) != pytest.approx(whole["mean"])
    naive_frac = (1 / 1 + 2 / 3) / 2
    assert naive_frac != pytest.approx(whole["zero_std_frac"])


def test_reward_moments_merge_state_across_ranks() -> None:
    rank0, rank1 = RewardMomentsMetric(), RewardMomentsMetric()
    rank0.update(REWARDS_A)
    rank1.update(REWARDS_B)
    rank0.merge_state(rank1)
    assert_same(values_of(rank0.compute()), whole_reward_moments())


def test_reward_moments_simulated_ddp_sync() -> None:
    rank0, rank1 = two_ranks(RewardMomentsMetric)
    rank0.update(REWARDS_A)
    rank1.update(REWARDS_B)
    assert_same(values_of(rank0.compute()), whole_reward_moments())
    # the sync is undone after compute: rank 0 keeps only its own states
    assert int(rank0.metric_state["count"]) == 2


def test_reward_moments_rank_without_data_does_not_disturb_min_max() -> None:
    rank0, rank1 = two_ranks(RewardMomentsMetric)
    rank0.update(REWARDS_B)
    out = values_of(rank0.compute())
    assert (out["min"], out["max"]) == (0.0, 1.0)  # rank 1's +inf / -inf sentinels ignored
    assert out["mean"] == pytest.approx(5 / 6)


def test_reward_moments_forward_returns_batch_value_and_accumulates() -> None:
    metric = RewardMomentsMetric()
    batch_a = values_of(metric(REWARDS_A))
    assert batch_a["mean"] == 0.0
    batch_b = values_of(metric(REWARDS_B))
    assert batch_b["mean"] == pytest.approx(5 / 6)
    assert_same(values_of(metric.compute()), whole_reward_moments())


def test_reward_moments_empty_is_nan() -> None:
    metric = RewardMomentsMetric()
    out = quiet_compute(metric)
    assert all(math.isnan(v) for v in out.values()), out
    metric.update(torch.zeros(0, 4))  # zero groups: no-op
    assert all(math.isnan(v) for v in quiet_compute(metric).values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        summary = metric.summary()
    assert math.isnan(summary.mean) and math.isnan(summary.std)


def test_reward_moments_single_reward_has_nan_std() -> None:
    metric = RewardMomentsMetric()
    metric.update(torch.tensor([[0.25]]))
    out = values_of(metric.compute())
    assert out["mean"] == 0.25 and math.isnan(out["std"])
    assert out["zero_std_frac"] == 1.0


@pytest.mark.parametrize(
    ("rewards", "match"),
    [
        (torch.tensor([1.0, 2.0]), "rewards must have 2 dimensions"),
        (torch.zeros(2, 0), "G >= 1"),
        (torch.tensor([[1.0, NAN]]), "rewards must be finite"),
        (torch.tensor([[1.0, math.inf]]), "rewards must be finite"),
        (torch.tensor([[True, False]]), "rewards must be a real"),
        ([[1.0, 2.0]], "rewards must be a torch.Tensor"),
    ],
)
def test_reward_moments_rejects_bad_input(rewards: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RewardMomentsMetric().update(rewards)  # type: ignore[arg-type]


def test_a_bf16_cast_before_any_data_keeps_float64_sums() -> None:
    """What ``bf16-true`` precision does to a whole module: the states (still defaults) are
    upcast back at the first update, every step (reset restores cast defaults), so the
    values equal float64 ones; a cast after data arrived is refused."""
    metric = RewardMomentsMetric()
    metric.to(dtype=torch.bfloat16)
    assert metric.total.dtype == torch.bfloat16
    for _ in range(2):
        metric.update(REWARDS_ALL[:2])
        metric.update(REWARDS_ALL[2:])
        assert metric.total.dtype == torch.float64
        assert_same(values_of(metric.compute()), whole_reward_moments())
        metric.reset()
    mean = TokenMean().to(dtype=torch.bfloat16)
    mean.update(torch.tensor([1.0, 2.0]))
    mean.to(dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="after it had accumulated data"):
        mean.update(torch.tensor([3.0]))


# --------------------------------------------------------------------------- RewardComponentsMetric

COMPONENTS = torch.tensor(
    [
        [1.0, 0.0, NAN, 1.0],  # "accuracy": applies to 3 of 4 completions
        [NAN, NAN, 0.5, NAN],  # "format": applies to 1 completion only
    ]
)


def test_reward_components_skip_nan_hand_values() -> None:
    metric = RewardComponentsMetric(["accuracy", "format"])
    metric.update(COMPONENTS)
    out = values_of(metric.compute())
    # accuracy 1, 0, 1: mean 2/3; deviations 1/3, -2/3, 1/3 -> (1/9 + 4/9 + 1/9) / 2 = 1/3
    assert out["accuracy/mean"] == pytest.approx(2 / 3)
    assert out["accuracy/std"] == pytest.approx(math.sqrt(1 / 3))
    assert out["format/mean"] == 0.5
    assert math.isnan(out["format/std"])  # a single applicable value has no spread
    assert list(out) == ["accuracy/mean", "accuracy/std", "format/mean", "format/std"]
    row = COMPONENTS[0][~COMPONENTS[0].isnan()].to(F64)
    assert out["accuracy/std"] == pytest.approx(float(row.std(unbiased=True)))
    assert out["accuracy/mean"] == pytest.approx(float(COMPONENTS[0].nanmean()))


def test_reward_components_summaries() -> None:
    metric = RewardComponentsMetric(["accuracy", "format"])
    metric.update(COMPONENTS)
    summaries = metric.summaries()
    assert list(summaries) == ["accuracy", "format"]
    assert isinstance(summaries["accuracy"], types.RewardComponentStats)
    assert summaries["accuracy"].mean == pytest.approx(2 / 3)
    assert summaries["format"].mean == 0.5 and math.isnan(summaries["format"].std)


def test_reward_components_split_is_exact_not_average_of_averages() -> None:
    whole = RewardComponentsMetric(["accuracy", "format"])
    whole.update(COMPONENTS)
    part_a, part_b = COMPONENTS[:, :1], COMPONENTS[:, 1:]  # accuracy: [1] | [0, nan, 1]
    rank0, rank1 = two_ranks(lambda **kw: RewardComponentsMetric(["accuracy", "format"], **kw))
    rank0.update(part_a)
    rank1.update(part_b)
    merged = values_of(rank0.compute())
    assert_same(merged, values_of(whole.compute()))
    micro = RewardComponentsMetric(["accuracy", "format"])
    micro.update(part_a)
    micro.update(part_b)
    assert_same(values_of(micro.compute()), merged)
    naive = (float(part_a[0].nanmean()) + float(part_b[0].nanmean())) / 2  # (1 + 1/2) / 2
    assert naive != pytest.approx(merged["accuracy/mean"])


def test_reward_components_all_nan_component_is_nan() -> None:
    metric = RewardComponentsMetric(["accuracy", "format"])
    metric.update(torch.tensor([[1.0, 3.0], [NAN, NAN]]))
    out = values_of(metric.compute())
    assert (out["accuracy/mean"], out["accuracy/std"]) == (2.0, pytest.approx(math.sqrt(2)))
    assert math.isnan(out["format/mean"]) and math.isnan(out["format/std"])


@pytest.mark.parametrize(
    ("names", "match"),
    [([], "non-empty list"), (["a", "a"], "unique"), (["a", ""], "non-empty strings")],
)
def test_reward_components_rejects_bad_names(names: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RewardComponentsMetric(names)


@pytest.mark.parametrize(
    ("components", "match"),
    [
        (torch.zeros(3, 4), "one row per name"),
        (torch.zeros(4), "components must have 2 dimensions"),
        (torch.tensor([[1.0], [math.inf]]), "got inf"),
        (torch.zeros(2, 4, dtype=torch.bool), "components must be a real"),
    ],
)
def test_reward_components_rejects_bad_input(components: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RewardComponentsMetric(["accuracy", "format"]).update(components)


# --------------------------------------------------------------------------------- TokenUsageMetric

T, F = True, False
PROMPT_MASK = torch.tensor([[F, T, T], [T, T, T], [F, F, T]])  # left-padded: 2 + 3 + 1 = 6
COMPLETION_MASK = torch.tensor(  # lengths 4, 1, 2 -> 7 tokens
    [[T, T, T, T], [T, F, F, F], [T, T, F, F]]
)
TRUNCATED = torch.tensor([T, F, F])


def whole_token_usage() -> TokenUsageMetric:
    metric = TokenUsageMetric()
    metric.update(PROMPT_MASK, COMPLETION_MASK, TRUNCATED)
    return metric


def test_token_usage_hand_masks() -> None:
    out = values_of(whole_token_usage().compute())
    assert out == {
        "prompt_tokens": 6.0,
        "completion_tokens": 7.0,
        "completion_length/mean": pytest.approx(7 / 3),
        "completion_length/min": 1.0,
        "completion_length/max": 4.0,
        "truncated_frac": pytest.approx(1 / 3),
    }


def test_token_usage_summary_dataclass() -> None:
    summary = whole_token_usage().summary()
    assert isinstance(summary, types.TokenUsageStats)
    assert summary.avg_completion_tokens == pytest.approx(7 / 3)
    assert summary.num_completion_tokens == 7.0
    assert summary.num_input_tokens == 13.0  # prompt 6 + completion 7: the forward pass


def test_token_usage_split_is_exact_not_average_of_averages() -> None:
    rank0, rank1 = two_ranks(TokenUsageMetric)
    rank0.update(PROMPT_MASK[:1], COMPLETION_MASK[:1], TRUNCATED[:1])  # 1 row, length 4
    rank1.update(PROMPT_MASK[1:], COMPLETION_MASK[1:], TRUNCATED[1:])  # 2 rows, lengths 1, 2
    merged = values_of(rank0.compute())
    assert_same(merged, values_of(whole_token_usage().compute()))
    assert (4 + 1.5) / 2 != pytest.approx(merged["completion_length/mean"])
    assert (1 / 1 + 0 / 2) / 2 != pytest.approx(merged["truncated_frac"])


def test_token_usage_empty() -> None:
    metric = TokenUsageMetric()
    metric.update(
        torch.zeros(0, 3, dtype=torch.bool),
        torch.zeros(0, 4, dtype=torch.bool),
        torch.zeros(0, dtype=torch.bool),
    )
    out = quiet_compute(metric)
    assert out["prompt_tokens"] == 0.0 and out["completion_tokens"] == 0.0
    for key in (
        "completion_length/mean",
        "completion_length/min",
        "completion_length/max",
        "truncated_frac",
    ):
        assert math.isnan(out[key]), key


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((PROMPT_MASK.long(), COMPLETION_MASK, TRUNCATED), "prompt_mask must be a bool"),
        ((PROMPT_MASK, COMPLETION_MASK.float(), TRUNCATED), "completion_mask must be a bool"),
        ((PROMPT_MASK, COMPLETION_MASK, TRUNCATED.int()), "truncated must be a bool"),
        ((PROMPT_MASK, COMPLETION_MASK[:2], TRUNCATED), "same number of rows"),
        ((PROMPT_MASK, COMPLETION_MASK, TRUNCATED[:2]), "same number of rows"),
        ((PROMPT_MASK[0], COMPLETION_MASK, TRUNCATED), "prompt_mask must have 2 dimensions"),
        ((PROMPT_MASK, COMPLETION_MASK, TRUNCATED[:, None]), "truncated must have 1 dim"),
    ],
)
def test_token_usage_rejects_bad_input(args: tuple[torch.Tensor, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TokenUsageMetric().update(*args)


# ---------------------------------------------------------------------------------- TokenMean

# per-token values of two sequences; padding holds garbage that the mask must hide
VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, NAN, -math.inf]])
MASK = torch.tensor([[T, T, T], [T, F, F]])  # 4 real tokens: (1 + 2 + 3 + 4) / 4 = 2.5


def test_token_mean_masked_hand_value() -> None:
    metric = TokenMean()
    metric.update(VALUES, MASK)
    assert float(metric.compute()) == 2.5
    # a mean of per-sequence means would give (2 + 4) / 2 = 3
    assert (VALUES[0].mean() + VALUES[1, 0]) / 2 != 2.5


def test_token_mean_without_mask_counts_every_entry() -> None:
    metric = TokenMean()
    metric.update(torch.tensor([[1.0, 2.0], [3.0, 6.0]]))
    assert float(metric.compute()) == 3.0


def test_token_mean_split_by_sequence_is_exact() -> None:
    rank0, rank1 = two_ranks(TokenMean)
    rank0.update(VALUES[:1], MASK[:1])
    rank1.update(VALUES[1:], MASK[1:])
    assert float(rank0.compute()) == 2.5
    micro = TokenMean()
    micro.update(VALUES[:1], MASK[:1])
    micro.update(VALUES[1:], MASK[1:])
    assert float(micro.compute()) == 2.5


def test_token_mean_sum_and_count_combine_with_values() -> None:
    metric = TokenMean()
    metric.update(torch.tensor(6.0), count=torch.tensor(3))  # three tokens summing to 6
    metric.update(4.0, count=1)
    metric.update(torch.tensor([10.0]))
    assert float(metric.compute()) == pytest.approx(20 / 5)


def test_token_mean_empty_and_zero_weight_are_nan() -> None:
    metric = TokenMean()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert math.isnan(metric.compute())
    metric.update(VALUES, torch.zeros_like(MASK))
    assert math.isnan(metric.compute())


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m: m.update(VALUES, MASK[:1]), "mask must have the shape of values"),
        (lambda m: m.update(VALUES, MASK.float()), "mask must be a bool"),
        (lambda m: m.update([1.0, 2.0]), "values must be a torch.Tensor"),
        (lambda m: m.update(1.0, count=-1), "count must be >= 0"),
        (lambda m: m.update(torch.ones(2), count=2), "total must be a 0-d"),
        (lambda m: m.update(1.0, count="3"), "count must be a 0-d"),
    ],
)
def test_token_mean_rejects_bad_input(call: Callable[[TokenMean], None], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call(TokenMean())


# ------------------------------------------------------------------------------ class contract


@pytest.mark.parametrize(
    ("make", "higher_is_better"),
    [
        (RewardMomentsMetric, True),
        (lambda: RewardComponentsMetric(["a"]), True),
        (TokenUsageMetric, None),
        (TokenMean, None),
    ],
)
def test_metric_class_attributes(make: Callable[[], Metric], higher_is_better: bool | None) -> None:
    metric = make()
    assert metric.full_state_update is False
    assert metric.is_differentiable is False
    assert metric.higher_is_better is higher_is_better


def test_reset_clears_states() -> None:
    metric = whole_token_usage()
    metric.reset()
    metric.update(PROMPT_MASK[:1], COMPLETION_MASK[:1], TRUNCATED[:1])
    out = values_of(metric.compute())
    assert (out["completion_length/min"], out["completion_length/max"]) == (4.0, 4.0)
    assert out["prompt_tokens"] == 2.0

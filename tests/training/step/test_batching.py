"""plan_micro_batches: whole groups, longest first, within the group and token limits,
trimmed to the columns in use."""

from __future__ import annotations

import pytest
import torch

from maxent_grpo.training.step.token_logps import plan_micro_batches


def masks(prompt_lens: list[int], completion_lens: list[int], P: int = 6, T: int = 5):
    """Left-padded prompt masks and prefix completion masks of the given lengths."""
    prompt = torch.tensor([[c >= P - n for c in range(P)] for n in prompt_lens])
    completion = torch.tensor([[c < n for c in range(T)] for n in completion_lens])
    return prompt, completion


# G = 2, three groups: group 0 rows (3+1, 2+2) -> width 3+2 = 5; group 1 (6+5, 1+1) -> 11;
# group 2 (2+3, 2+3) -> 5.
PROMPT = [3, 2, 6, 1, 2, 2]
COMPLETION = [1, 2, 5, 1, 3, 3]


def test_no_limit_is_one_trimmed_micro_batch():
    (plan,) = plan_micro_batches(*masks(PROMPT, COMPLETION), group_size=2)
    assert plan.groups.tolist() == [0, 1, 2]
    assert plan.rows.tolist() == [0, 1, 2, 3, 4, 5]
    assert (plan.prompt_start, plan.completion_len) == (0, 5)
    assert plan.columns(6) == slice(0, 11)


@pytest.mark.parametrize("max_rows", [4, 5])  # whole groups of 2: 5 rows hold 2 groups
def test_max_rows_takes_the_longest_groups_first(max_rows):
    plans = plan_micro_batches(*masks(PROMPT, COMPLETION), group_size=2, max_rows=max_rows)
    # lengths 5, 11, 5: group 1 first, then 0 (ties keep their order), then 2
    assert [p.groups.tolist() for p in plans] == [[0, 1], [2]]
    assert [p.rows.tolist() for p in plans] == [[0, 1, 2, 3], [4, 5]]
    second = plans[1]
    assert (second.prompt_start, second.completion_len) == (4, 3)  # prompts of 2, answers 3
    assert second.columns(6) == slice(4, 9)


def test_token_budget_packs_by_padded_size():
    prompt, completion = masks(PROMPT, COMPLETION)
    # group 1 alone is 2 rows x 11 columns = 22; groups 0 and 2 together 4 x (3 + 3) = 24
    plans = plan_micro_batches(prompt, completion, group_size=2, max_tokens=24)
    assert [p.groups.tolist() for p in plans] == [[1], [0, 2]]
    assert (plans[1].prompt_start, plans[1].completion_len) == (3, 3)
    # a budget below one group's size leaves each group alone, never splits one
    plans = plan_micro_batches(prompt, completion, group_size=2, max_tokens=1)
    assert sorted(p.groups.tolist() for p in plans) == [[0], [1], [2]]
    rows = torch.cat([p.rows for p in plans]).sort().values
    assert rows.tolist() == list(range(6))  # every row exactly once


def test_the_kept_columns_hold_every_real_token():
    torch.manual_seed(0)
    G, B, P, T = 3, 7, 9, 8
    prompt_lens = torch.randint(1, P + 1, (B * G,)).tolist()
    completion_lens = torch.randint(1, T + 1, (B * G,)).tolist()
    prompt, completion = masks(prompt_lens, completion_lens, P, T)
    full = torch.cat([prompt, completion], 1)
    for plan in plan_micro_batches(prompt, completion, G, max_tokens=60):
        kept = full[plan.rows][:, plan.columns(P)]
        assert kept.sum() == full[plan.rows].sum()  # nothing real was cut
        assert kept[:, 0].any() and kept[:, -1].any()  # and no column is all padding


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"group_size": 4}, "group_size must divide the 6 rows"),
        ({"group_size": 2, "max_rows": 0}, "max_rows must be None or >= 1"),
        ({"group_size": 2, "max_tokens": 0}, "max_tokens must be None or >= 1"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_micro_batches(*masks(PROMPT, COMPLETION), **kwargs)


def test_equal_passes_pads_with_zero_weight_passes_of_one_group():
    from maxent_grpo.training.step.token_logps import equal_passes

    G = 2
    prompt_mask = torch.ones(6, 3, dtype=torch.bool)
    completion_mask = torch.tensor([[1, 1, 0], [1, 0, 0]] * 3, dtype=torch.bool)
    plans = plan_micro_batches(prompt_mask, completion_mask, G, max_rows=2 * G)
    assert len(plans) == 2
    padded = equal_passes(plans, 4)
    assert padded[:2] == plans and len(padded) == 4
    for pad in padded[2:]:
        assert pad.padding and pad.completion_len == 1 and pad.groups.tolist() == [
            plans[-1].groups[0].item()]
        assert pad.rows.tolist() == plans[-1].rows[:G].tolist()
    assert equal_passes(plans, 2) is plans
    with pytest.raises(ValueError, match="at least one micro-batch"):
        equal_passes([], 1)


def test_a_token_budget_below_one_group_is_warned_of_once(monkeypatch):
    """``model.micro_batch_tokens`` under one group's padded size was exceeded without a
    word (a GPU user lowering it to save memory): said once, with the size it takes."""
    import warnings

    import maxent_grpo.training.step.token_logps as planner

    monkeypatch.setattr(planner, "_SAID_OVER", set())
    prompt, completion = masks(PROMPT, COMPLETION)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan_micro_batches(prompt, completion, group_size=2, max_tokens=24)  # fits
        assert not caught
        for limit in (10, 10, 16):  # another value (a later run of the process): said
            plan_micro_batches(prompt, completion, group_size=2, max_tokens=limit)
    said = [str(w.message) for w in caught]
    assert [s.split(" is less")[0] for s in said] == [f"model.micro_batch_tokens {n}"
                                                      for n in (10, 16)]
    assert said[0].startswith("model.micro_batch_tokens 10 is less than one prompt group's "
                              "padded size (22 tokens, 2 sequences)")

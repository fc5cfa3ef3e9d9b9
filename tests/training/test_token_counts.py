"""The logged token counts against what the rollout holds."""

from __future__ import annotations

from tests.conftest import fit, make_data, make_module


def test_token_counts_include_the_rows_the_loss_leaves_out(cache_dir):
    """``train/tokens/*`` read the loss mask, so under ``mask_truncated_completions`` a
    truncated completion counted as 0 tokens and the mean length fell as truncation rose
    (a defect hunt); they count the tokens the model wrote."""
    module = make_module(cache_dir, rewards={"tests.conftest:alternating": 1.0},
                         max_completion_length=2, mask_truncated_completions=True)
    fit(module, make_data(cache_dir), steps=1)
    stats, rollout = module.step_metrics_dict, module.trajectory.rollout
    assert stats["train/tokens/truncated_frac"] > 0
    assert stats["train/tokens/completion_tokens"] == int(rollout.model_mask.sum())
    assert stats["train/tokens/completion_length/min"] >= 1

"""Lightning Trainer flags that automatic optimisation honours and this trainer's own
optimizer step cannot: ``fit`` stops before any work with a message naming the option to
use instead (Lightning's own "switch to automatic optimization" names nothing a user here
can do)."""

from __future__ import annotations

import pytest

from tests.conftest import fit, make_data, make_module


@pytest.mark.parametrize("flags, expected", [
    ({"gradient_clip_val": 0.5}, r"--model.gradient_clip_val=0.5 \(now 1.0"),
    ({"accumulate_grad_batches": 2},
     r"--data.batch_size to 2x its value.*--model.micro_batch_groups"),
])
def test_trainer_flags_we_cannot_honour_name_our_option(cache_dir, tmp_path, flags, expected):
    module = make_module(cache_dir)
    with pytest.raises(ValueError, match=expected):
        fit(module, make_data(cache_dir), tmp_path=tmp_path, **flags)
    assert module.policy is None  # stopped before the model was even loaded


def test_validate_with_the_same_flags_is_not_refused(cache_dir, tmp_path):
    """The check is for ``fit``: a config shared with ``validate`` still evaluates."""
    import lightning as L

    module = make_module(cache_dir)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=1,
                        gradient_clip_val=0.5, default_root_dir=tmp_path)
    trainer.validate(module, make_data(cache_dir))
    assert "val/pass@1" in trainer.callback_metrics

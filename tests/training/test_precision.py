"""Precisions beyond the defaults (a defect hunt): ``16-mixed``'s loss scaler around our own
optimizer step (clipping, skips, a step without gradient), float16 weights that cannot
train, and the reference model under a ``-true`` precision. On the CPU Lightning turns
``precision="16-mixed"`` into bf16, so the scaler is the plugin given directly, the code
path a GPU takes."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision

from maxent_grpo.objectives import GRPO
from tests.conftest import fit, make_data, make_module, params


def fp16_scaler(init_scale: float = 2.0**16) -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu",
                                                                        init_scale=init_scale))


def test_16_mixed_clips_and_logs_the_true_gradient(cache_dir):
    """The gradients were clipped while still the scaler's multiple: the logged norm was
    65,536 times the true one and every update clipped to 1/65,536 of its size."""
    steps = {}
    for name, plugins in (("fp32", []), ("fp16", [fp16_scaler()])):
        module = make_module(cache_dir, rewards={"tests.conftest:alternating": 1.0},
                             gradient_clip_val=1e9)  # a norm, not a clip
        module.configure_model()
        before = params(module)
        fit(module, make_data(cache_dir), steps=1, plugins=plugins)
        change = sum((v.float() - before[k]).abs().sum() for k, v in params(module).items())
        steps[name] = (module.step_metrics_dict["train/grad_norm"], float(change))
    (norm32, change32), (norm16, change16) = steps["fp32"], steps["fp16"]
    assert norm16 == pytest.approx(norm32, rel=0.05) and change16 == pytest.approx(change32,
                                                                                  rel=0.05)


def test_16_mixed_clipping_bounds_the_true_norm(cache_dir):
    module = make_module(cache_dir, rewards={"tests.conftest:alternating": 1.0},
                         gradient_clip_val=1e-3)
    module.configure_model()
    before = params(module)
    fit(module, make_data(cache_dir), steps=1, plugins=[fp16_scaler()])
    moved = torch.sqrt(sum(((v.float() - before[k]) ** 2).sum()
                           for k, v in params(module).items()))
    assert float(moved) == pytest.approx(0.5 * 1e-3, rel=0.02)  # SGD lr 0.5 x the clip


def test_a_skipped_16_mixed_update_backs_the_scale_off(cache_dir):
    """A skip returned before the scaler's update, so the scale never fell and every later
    step overflowed again until the run stopped (after max_consecutive_nonfinite = 3). An
    overflow of the scaled gradients with a finite loss is the scaler's routine: the scale
    backs off and no non-finite update is counted."""
    plugin = fp16_scaler(init_scale=2.0**40)  # float16 gradients overflow at once
    module = make_module(cache_dir, rewards={"tests.conftest:alternating": 1.0})
    trainer = fit(module, make_data(cache_dir), steps=4, plugins=[plugin])
    # the four skipped updates count as steps (the scaler's routine, as Lightning counts it)
    assert trainer.global_step == 4 and module.counters.nonfinite_total == 0
    assert plugin.scaler.get_scale() == 2.0**36  # backed off more than the 3 skips allowed


def test_a_16_mixed_step_without_any_gradient_counts(cache_dir):
    """Every group constant and dropped: the step with no gradient at all failed in the
    scaler ("Attempted unscale_ but _scale is None")."""
    module = make_module(cache_dir, rewards={"tests.conftest:always_one": 1.0},
                         drop_constant_groups=True)
    module.configure_model()
    before = params(module)
    trainer = fit(module, make_data(cache_dir), steps=2, plugins=[fp16_scaler()])
    assert trainer.global_step == 2
    assert all(torch.equal(v, before[k]) for k, v in params(module).items())


@pytest.mark.parametrize("plugins, eps, match", [
    ([], 1e-8, "with AdamW, whose squared-gradient moments underflow to 0 in float16"),
    ([], 1e-4, "with AdamW, whose squared-gradient moments underflow to 0 in float16"),
    ("fp16", 1e-8, "16-mixed needs float32 weights"),
])
def test_float16_weights_that_cannot_train_are_refused(cache_dir, plugins, eps, match):
    """AdamW's eps 1e-8 is 0 in float16: the first update made every weight NaN, and the
    next rollout failed in generate; with eps 1e-4 its float16 moments are 0 for most
    gradients, each step lr g / eps, and the policy collapsed; under 16-mixed the scaler
    cannot unscale float16 gradients."""
    module = make_module(cache_dir, dtype="float16",
                         optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3, eps=eps))
    with pytest.raises(ValueError, match=match):
        fit(module, make_data(cache_dir), steps=1,
            plugins=[fp16_scaler()] if plugins == "fp16" else [])


def test_the_reference_takes_the_policys_true_precision(cache_dir):
    """bf16-true cast the policy only: a float32 reference gave a KL of 3e-5 at the start."""
    module = make_module(cache_dir, objective=GRPO(beta=0.04),
                         rewards={"tests.conftest:alternating": 1.0})
    fit(module, make_data(cache_dir), steps=1, precision="bf16-true")
    assert next(module.reference.parameters()).dtype == torch.bfloat16
    assert module.step_metrics_dict["train/kl"] == 0.0  # the first step: the same weights


def test_a_sharded_reference_takes_the_policys_true_precision(cache_dir):
    """Under FSDP2 (a device mesh) the sharded reference was left float32 beside a bf16
    policy. Lightning converts a sharded module with ``.to(dtype)``; so does the module for
    the reference (measured on 2 processes: both ranks' shards bfloat16). Here the mesh is a
    stand-in set after the models load, so nothing is sharded."""
    import lightning.pytorch as pl

    module = make_module(cache_dir, objective=GRPO(beta=0.04))
    module.configure_model()
    module._device_mesh = object()  # what ModelParallelStrategy sets
    trainer = pl.Trainer(accelerator="cpu", devices=1, precision="bf16-true", logger=False)
    module.trainer = trainer
    module.on_fit_start()
    assert {p.dtype for p in module.reference.parameters()} == {torch.bfloat16}


def test_gradients_that_no_scale_makes_finite_still_stop_the_run(cache_dir):
    """An overflow is forgiven only while the scale stays >= 1: NaN gradients behind a
    finite loss backed the scale off to 0 and skipped every step, forever."""
    from maxent_grpo.training.module import NonFiniteLossError

    module = make_module(cache_dir, rewards={"tests.conftest:alternating": 1.0},
                         max_consecutive_nonfinite=3)
    module.configure_model()
    next(module.policy.parameters()).register_hook(lambda grad: grad * float("nan"))
    plugin = fp16_scaler(init_scale=2.0**4)
    with pytest.raises(NonFiniteLossError, match="3 non-finite updates in a row"):
        # 4 forgiven overflows (scale 16 to 1), then 3 non-finite skips (each a step)
        fit(module, make_data(cache_dir), steps=10, plugins=[plugin], max_epochs=50)
    assert plugin.scaler.get_scale() < 1.0



def test_a_learning_rate_that_bfloat16_weights_round_away_is_warned(cache_dir):
    """AdamW's step is about lr per weight; in bfloat16 (8 significant bits) a step of 1e-6
    is under half the spacing of most weights, which stay as they were: warned at the start,
    with the share that can move."""
    import warnings

    from maxent_grpo.training.step.optimise import warn_rounded_updates

    module = make_module(cache_dir, dtype="bfloat16", rewards={"tests.conftest:alternating": 1.0},
                         optimizer=lambda p: torch.optim.AdamW(p, lr=1e-6))
    module.configure_model()
    before = params(module)
    with pytest.warns(UserWarning, match=r"lr 1e-06 .* changes \d\.\d% of them"):
        fit(module, make_data(cache_dir), steps=1)
    after = params(module)
    moved = sum(int((after[k] != v).sum()) for k, v in before.items())
    assert moved / sum(v.numel() for v in before.values()) < 0.1  # the warning was right
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a learning rate bfloat16 can follow: no warning
        share = warn_rounded_updates(torch.optim.AdamW(module.policy.parameters(), lr=1e-3))
    assert share is not None and share > 0.9
    # SGD's step lr |g| cannot be known before a gradient: it went without a word (4 steps at
    # lr 0.01 in bf16-true moved 1.3% of the weights, a hunt measured)
    groups = [{"params": [p]} for p in module.policy.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert warn_rounded_updates(torch.optim.SGD(groups, lr=0.01)) is None
    assert sum("SGD over bfloat16/float16 weights" in str(w.message) for w in caught) == 1
    compensated = torch.optim.SGD(module.policy.parameters(), lr=0.01)
    compensated.param_groups[0]["kahan_sum"] = True  # as optimi's SGD(kahan_sum=True) keeps
    adam = torch.optim.AdamW(module.policy.parameters(), lr=1e-6)  # with an eps: measured
    adam.param_groups[0]["bf16_stochastic_round"] = True  # as torchao's AdamW keeps
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_rounded_updates(compensated)
        assert warn_rounded_updates(adam) is None  # its rounded steps still move the weights


def test_a_module_cast_before_its_policy_loads_is_warned_of(cache_dir):
    """``module.half()`` before a fit reached no weights (the policy loads later, in
    ``configure_model``): the run trained float32 while ``module.dtype`` said float16."""
    module = make_module(cache_dir)
    module.half()
    with pytest.warns(UserWarning, match=r"cast to torch.float16 before its policy loaded .* "
                                         r"set model.dtype or trainer.precision"):
        module.configure_model()
    assert module.policy.dtype == torch.float32

"""The LightningModule end to end on the tiny offline model: every objective trains a few
steps, micro-batching does not change the update, bad input stops the run clearly."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import random
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch

from maxent_grpo.objectives import GRPO, EntropyMaxEnt, GroupMaxEnt, ListwiseMaxEnt, LossOutput
from maxent_grpo.rewards import RewardFunctionError
from maxent_grpo.training.callbacks.module_own import ModuleHooks
from maxent_grpo.training.module import MaxEntGRPOModule, NonFiniteLossError
from maxent_grpo.training.settings import ScheduleSettings, build_lr_scheduler
from tests.conftest import alternating, always_one, fit, make_data, make_module, params  # noqa: F401


@pytest.mark.parametrize(
    "objective, needs_ref",
    [
        (GRPO(loss_type="dr_grpo", scale_rewards="none"), False),
        (GRPO(loss_type="dapo", beta=0.05, kl_estimator="k3"), True),
        (EntropyMaxEnt(alpha=0.01, kl_gate_threshold=0.05), True),
        (ListwiseMaxEnt(tau=0.5, beta=0.1, clip_coef=0.1), True),
        (GroupMaxEnt(tau=0.5), False),
        (ListwiseMaxEnt(tau=0.5, length_normalize=True, distinct_candidates=True), False),
        (ListwiseMaxEnt(tau=0.5, beta=0.1, answer_level=True), True),
        (GRPO(answer_shaping="unlikeliness"), False),
        (GRPO(answer_shaping="repetition"), False),
    ],
    ids=["dr_grpo", "dapo+kl", "entropy", "listwise", "group", "listwise-distinct",
         "listwise-answers", "unlikeliness", "repetition"],
)
def test_every_objective_trains(cache_dir, objective, needs_ref):
    module = make_module(
        cache_dir, objective=objective,
        rewards={"tests.conftest:alternating": 1.0},
    )
    module.configure_model()
    before = params(module)
    trainer = fit(module, make_data(cache_dir))
    assert trainer.global_step == 2
    assert (module.reference is not None) == needs_ref
    changed = [k for k, v in params(module).items() if not torch.equal(v, before[k])]
    assert changed, "no parameter moved"
    logged = trainer.callback_metrics
    assert logged["train/reward/mean"] == pytest.approx(0.5)
    assert "train/loss/total" in logged and "train/tokens/completion_tokens" in logged
    assert ("train/kl" in logged) == needs_ref
    if isinstance(objective, (ListwiseMaxEnt, GroupMaxEnt)):
        assert 0 <= float(logged["train/weight_entropy"]) <= math.log(4) + 1e-6
    if isinstance(objective, EntropyMaxEnt):
        assert float(logged["train/entropy"]) > 0


@pytest.mark.parametrize(
    "objective",
    [GRPO(loss_type="dr_grpo"), GRPO(loss_type="grpo", beta=0.1), ListwiseMaxEnt(tau=0.3)],
    ids=["dr_grpo", "grpo+kl", "listwise"],
)
def test_micro_batches_do_not_change_the_update(cache_dir, objective, monkeypatch):
    """One step with the whole batch equals one step in micro-batches: one group each, or
    packed by a token budget (groups re-ordered by length, columns trimmed)."""
    import maxent_grpo.training.step.token_logps as module_file

    plans: list[int] = []
    real_plan = module_file.plan_micro_batches

    def spy(*args, **kwargs):
        out = real_plan(*args, **kwargs)
        plans.append(len(out))
        return out

    monkeypatch.setattr(module_file, "plan_micro_batches", spy)
    results = []
    for split in ({}, {"micro_batch_groups": 1}, {"micro_batch_tokens": 1},
                  {"micro_batch_tokens": 300}):
        module = make_module(
            cache_dir, objective=copy.deepcopy(objective),
            rewards={"tests.conftest:alternating": 1.0}, **split,
        )
        fit(module, make_data(cache_dir), steps=1)
        results.append(params(module))
    assert plans[:3] == [1, 4, 4] and 1 < plans[3] < 4  # 4 groups of 4 rows, ~45 columns
    for other in results[1:]:
        for key in results[0]:
            torch.testing.assert_close(results[0][key], other[key], atol=1e-6, rtol=1e-5)


def test_a_float64_run_keeps_its_rewards_and_logged_sums_in_float64(cache_dir):
    """Under ``64-true`` the rewards were float32 (advantages 6e-9 off the float64 formula)
    and each micro-batch's token sum was rounded to float32 (the logged token means changed
    with the split, about 1e-8); now one batch and micro-batches log the same to rounding."""
    logged = []
    for split in ({}, {"micro_batch_groups": 1}):
        module = make_module(cache_dir, objective=GRPO(beta=0.1), max_completion_length=12,
                             rewards={"tests.conftest:alternating": 0.1}, **split)
        fit(module, make_data(cache_dir), steps=2, precision="64-true")  # the 2nd has a KL
        trajectory = module.trajectory
        assert trajectory.rewards.dtype == trajectory.targets.advantages.dtype == torch.float64
        rewards = trajectory.rewards
        assert torch.equal(rewards.unique(), torch.tensor([0.0, 0.1], dtype=torch.float64))
        logged.append(dict(module.step_metrics_dict))
        kl, total = logged[-1]["train/kl"], logged[-1]["train/loss/total"]
        assert kl > 0 and 0.1 * kl == pytest.approx(total, rel=1e-13, abs=0)  # policy's 0: constant
    for key in ("train/loss/policy", "train/kl", "train/loss/total"):
        assert logged[1][key] == pytest.approx(logged[0][key], rel=1e-13, abs=1e-18), key


class CentresInPlace(GRPO):
    """Centres the rewards in place before GRPO's group advantage (which the centring does
    not change): the objective's inputs are its own copy."""

    def prepare(self, inputs):
        inputs.rewards -= inputs.rewards.mean(1, keepdim=True)
        return super().prepare(inputs)


def test_an_objective_editing_its_inputs_in_place_leaves_the_logged_rewards(cache_dir):
    """The objective's rewards were the step's own tensor: an objective that edited them in
    place changed train/reward/* and the samples (a hunt of extensions)."""
    logged = []
    for objective in (GRPO(), CentresInPlace()):
        module = make_module(cache_dir, objective=objective,
                             rewards={"tests.conftest:alternating": 1.0})
        fit(module, make_data(cache_dir), steps=1)
        logged.append({k: v for k, v in module.step_metrics_dict.items() if "perf/" not in k})
        assert module.trajectory.rewards.min() == 0  # the rewards, not the centred ones
    assert logged[0] == logged[1]


def test_zero_advantage_groups_leave_the_policy_unchanged(cache_dir):
    module = make_module(
        cache_dir, objective=GRPO(), rewards={"tests.conftest:always_one": 1.0}
    )
    module.configure_model()
    before = params(module)
    trainer = fit(module, make_data(cache_dir), steps=1)
    assert trainer.callback_metrics["train/reward/zero_std_frac"] == 1.0
    for key, value in params(module).items():
        torch.testing.assert_close(value, before[key])


def test_several_iterations_per_rollout(cache_dir):
    module = make_module(
        cache_dir, objective=GRPO(), num_iterations=2, micro_batch_groups=2,
        rewards={"tests.conftest:alternating": 1.0},
    )
    trainer = fit(module, make_data(cache_dir), steps=4)
    assert trainer.global_step == 4  # two rollouts, two optimizer steps each


class NaNObjective(GRPO):
    def loss(self, mb):
        out = super().loss(mb)
        return LossOutput(out.loss * float("nan"), out.sums)


def test_non_finite_loss_skips_updates_then_stops(cache_dir):
    module = make_module(
        cache_dir, objective=NaNObjective(), max_consecutive_nonfinite=2,
        rewards={"tests.conftest:alternating": 1.0},
    )
    module.configure_model()
    before = params(module)
    with pytest.raises(NonFiniteLossError, match="max_consecutive_nonfinite"):
        fit(module, make_data(cache_dir), steps=5)
    assert module.counters.nonfinite_total == 2
    for key, value in params(module).items():
        torch.testing.assert_close(value, before[key])


class NaNFirst(GRPO):
    """NaN in the first micro-batch of the run only: its update is skipped."""

    def loss(self, mb):
        out = super().loss(mb)
        self.calls = getattr(self, "calls", 0) + 1
        return LossOutput(out.loss * float("nan"), out.sums) if self.calls == 1 else out


def test_a_skipped_update_counts_as_a_step(cache_dir, tmp_path):
    """With num_iterations 2 the step count moves by 2 per rollout, skipped update or not:
    uncounted, one skip left it odd (1, 3, 5: max_steps 4 ran 5 steps, and
    every_n_train_steps=2 never saved)."""
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    seen = []

    class Steps(Callback):
        def on_train_batch_end(self, trainer, *args):
            seen.append(trainer.global_step)

    module = make_module(cache_dir, objective=NaNFirst(), num_iterations=2,
                         micro_batch_groups=None, rewards={"tests.conftest:alternating": 1.0})
    every = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2, save_top_k=-1)
    fit(module, make_data(cache_dir), steps=4, tmp_path=tmp_path, callbacks=[every, Steps()],
        enable_checkpointing=True)
    assert module.counters.nonfinite_total == 1 and seen == [2, 4]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]


def broken_reward(prompts, completions, **kw):
    raise KeyError("boom")


def test_a_failing_reward_names_the_function_before_any_checkpoint(cache_dir, tmp_path):
    module = make_module(cache_dir, rewards={"tests.training.test_module:broken_reward": 1.0})
    trainer = L.Trainer(
        max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path,
    )
    with pytest.raises(RewardFunctionError, match="broken_reward"):
        trainer.fit(module, make_data(cache_dir))
    assert not list(tmp_path.rglob("*.ckpt"))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_generations": 1}, "model.num_generations"),
        ({"max_completion_length": 0}, "model.max_completion_length"),
        ({"num_iterations": 0}, "model.num_iterations"),
        ({"micro_batch_groups": 0}, "model.micro_batch_groups"),
        ({"drop_constant_groups": "yes"}, "model.drop_constant_groups"),
        ({"micro_batch_tokens": 0}, "model.micro_batch_tokens"),
        ({"rewards": {}}, "model.rewards"),
        ({"rewards": {"no_such_reward": 1.0}}, "no_such_reward"),
        ({"rewards": {"first_number": float("nan")}}, "first_number"),
        ({"gradient_clip_val": 0.0}, "model.gradient_clip_val"),
        ({"max_consecutive_nonfinite": 0}, "model.max_consecutive_nonfinite"),
        # wrong types from Python failed at the fit as a TypeError, or named a character
        ({"optimizer": "torch.optim.AdamW"}, "model.optimizer must be a callable"),
        ({"lr_scheduler": {"class_path": "torch.optim.lr_scheduler.LinearLR"}},
         "model.lr_scheduler must be a callable"),
        ({"eval_k": 4}, r"model.eval_k must hold ints .* got 4$"),
        ({"tools": "calculate"}, r"model.tools must be a list of tools; got 'calculate' \(one"),
        ({"model_name_or_path": Path("m")}, "model.model_name_or_path must be a hub name"),
        # was refused at the model's load, after the trainer started, without model.
        ({"dtype": "float64"}, r"model.dtype must be one of 'auto', .*; got 'float64'"),
    ],
)
def test_bad_module_options_name_the_option(cache_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_module(cache_dir, **kwargs)


def test_top_k_1_is_warned_to_train_nothing(cache_dir):
    """The temperature's error advised top_k: 1 for greedy completions: each group's G
    completions are then equal and a run trained nothing without a word (a hunt)."""
    with pytest.warns(UserWarning, match=r"model.top_k: 1 samples a prompt's likeliest "
                                         r"completion each time: .* nothing trains"):
        make_module(cache_dir, top_k=1)


def test_sequences_of_other_types_are_taken_for_list_options(cache_dir):
    """eval_k and tools take any sequence (a range, a tuple), only not one int or string."""
    module = make_module(cache_dir, eval_num_generations=4, eval_k=range(1, 5),
                         tools=("calculate",))
    assert module.loop.evaluation.k == (1, 2, 3, 4)
    assert list(module.loop.generation.tools.toolbox.functions) == ["calculate"]


def test_listwise_requires_positive_tau_without_beta():
    with pytest.raises(ValueError, match=r"objective\.tau must be > 0 when objective\.beta = 0"):
        ListwiseMaxEnt(tau=0.0, beta=0.0)


def lr_factors(steps: int, **kwargs) -> list[float]:
    """The learning-rate multipliers of ``build_lr_scheduler`` at optimizer steps 0..steps-1."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    options = dict(num_iterations=1, gradient_clip_val=None, lr_warmup_steps=0,
                   max_consecutive_nonfinite=3)
    factory = kwargs.pop("factory", None)
    sched = build_lr_scheduler(opt, ScheduleSettings(**{**options, **kwargs}), factory)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_learning_rate_schedules_by_hand():
    cosine = functools.partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=8)
    f = lr_factors(11, lr_warmup_steps=2, factory=cosine)
    assert f[0] == 0.5 and f[1] == 1.0 and f[2] == pytest.approx(1.0)  # (t + 1) / W, then 1
    assert f[6] == pytest.approx(0.5) and f[10] == pytest.approx(0.0, abs=1e-12)  # cos half, end
    assert lr_factors(4) == [1.0] * 4  # no scheduler, no warm-up: constant
    assert lr_factors(4, lr_warmup_steps=4) == [0.25, 0.5, 0.75, 1.0]
    with pytest.raises(ValueError, match="not ReduceLROnPlateau"):
        lr_factors(1, factory=torch.optim.lr_scheduler.ReduceLROnPlateau)


def test_a_cosine_that_does_not_end_with_the_run_is_warned_of(recwarn):
    """The shipped configs write T_max for their max_steps; --trainer.max_steps 2000 on
    tiny (T_max 795) brought the rate back to its peak by step 1595 without a word. Read
    when training starts, from the schedule a resume restored (whose T_max the config's
    does not change: the advice differs)."""

    from maxent_grpo.training.settings import warn_unended_cosine

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    cosine = functools.partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=795)
    warm = ScheduleSettings(num_iterations=1, gradient_clip_val=None, lr_warmup_steps=5,
                            max_consecutive_nonfinite=3)
    scheduler = build_lr_scheduler(opt, warm, cosine)

    def run(max_steps, ckpt_path=None, schedule=scheduler, max_epochs=None):
        return SimpleNamespace(max_steps=max_steps, ckpt_path=ckpt_path, max_epochs=max_epochs,
                               lr_scheduler_configs=[SimpleNamespace(scheduler=schedule)])

    def warn(trainer, steps=None):  # the run's length: max_steps, or fewer by its epochs
        warn_unended_cosine(trainer, trainer.max_steps if steps is None else steps)

    with pytest.warns(UserWarning, match=r"the cosine ends after 5 \+ 795 steps .* "
                                         r"trainer.max_steps is 2000, so the learning rate rises "
                                         r"again after its low; set --model.lr_scheduler.init_"
                                         r"args.T_max 1995"):
        warn(run(2000))
    with pytest.warns(UserWarning, match="stops short of eta_min; a resume keeps the "
                                         "checkpoint's schedule"):
        warn(run(50, "last.ckpt"))
    recwarn.clear()
    bare = build_lr_scheduler(opt, ScheduleSettings(1, None, 0, 3), cosine)  # no warm-up
    for trainer in (run(800), run(-1), run(5), run(795, schedule=bare)):  # ends with the run,
        warn(trainer)  # no step limit, ends in its warm-up, no warm-up
    assert not [w for w in recwarn if "cosine" in str(w.message)]
    with pytest.warns(UserWarning, match=r"ends after 0 \+ 795 steps"):
        warn(run(800, schedule=bare))
    # max_epochs ends the run first (12 steps): it went without a word (a hunt)
    with pytest.warns(UserWarning, match=r"while the run is 12 steps \(trainer.max_epochs 3\), "
                                         r"so the learning rate stops short of eta_min; set "
                                         r"--model.lr_scheduler.init_args.T_max 7"):
        warn(run(100, max_epochs=3), 12)


def test_validation_points_that_shift_at_each_epoch_are_warned_of(recwarn):
    """The multi-GPU configs validated every 50 steps of each 493-step epoch (Lightning's
    check_val_every_n_epoch 1): at 50..450, then at none of the last steps of a 500-step
    run (a hunt of the shipped configs)."""
    from maxent_grpo.training.settings import warn_epoch_bound_validation

    def trainer(every=50, epochs=1, batches=493, limit=1.0):
        return SimpleNamespace(val_check_interval=every, check_val_every_n_epoch=epochs,
                               num_training_batches=batches, limit_val_batches=limit)

    with pytest.warns(UserWarning, match=r"val_check_interval 50 counts the rollouts of each "
                                         r"epoch \(trainer.check_val_every_n_epoch 1\), and an "
                                         r"epoch has 493: .* set trainer.check_val_every_n_"
                                         r"epoch: null"):
        warn_epoch_bound_validation(trainer(), 500)
    with pytest.warns(UserWarning, match="and an epoch has 493"):
        warn_epoch_bound_validation(trainer(), -1)  # a run of max_epochs: as long as it is
    recwarn.clear()
    for quiet, rollouts in ((trainer(epochs=None), 500), (trainer(batches=500), 1000),
                            (trainer(), 493), (trainer(every=1.0), 500),
                            (trainer(batches=float("inf")), 500), (trainer(limit=0), 500)):
        warn_epoch_bound_validation(quiet, rollouts)  # counted over the run, a multiple,
    assert not recwarn.list  # one epoch, a fraction, a loader without a length, no validation


@pytest.mark.parametrize("factory", [
    functools.partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=0),
    functools.partial(torch.optim.lr_scheduler.StepLR, step_size=0),
], ids=["cosine-T_max-0", "step-size-0"])
def test_a_scheduler_that_cannot_step_fails_when_built(factory):
    """It failed inside torch at the first (or, after a warm-up, a later) optimizer step."""
    with pytest.raises(ValueError, match=r"model\.lr_scheduler \(\w+\) cannot take its first "
                                         r"step: ZeroDivisionError"):
        lr_factors(0, lr_warmup_steps=5, factory=factory)


def test_validation_logs_rewards(cache_dir):
    module = make_module(
        cache_dir, eval_num_generations=2,
        rewards={"tests.conftest:alternating": 1.0},
    )
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    out = trainer.validate(module, make_data(cache_dir))
    assert out[0]["val/reward/mean"] == pytest.approx(0.5)


def test_kl_options_without_a_kl_are_refused(cache_dir):
    """With beta 0 and nothing that raises it no reference is loaded and no KL computed:
    ``kl_estimator: k1`` trained as if unset, without a word."""
    for options in ({"kl_estimator": "k1"}, {"kl_bias_correction": True}):
        module = make_module(cache_dir, objective=GRPO(**options))
        with pytest.raises(ValueError, match=rf"objective.{next(iter(options))}=.* would do "
                                             r"nothing: only with objective.beta > 0"):
            module.configure_model()
        module = make_module(cache_dir, objective=GRPO(beta=0.1, **options))
        module.configure_model()
        assert module.reference is not None
        module = make_module(cache_dir, objective=GRPO(**options))
        module.require_reference()  # a callback that raises beta loads the reference
        module.configure_model()
    # EntropyMaxEnt's gate measures the KL (with the estimator), and weights none at beta 0
    gate = {"kl_gate_threshold": 0.1}
    make_module(cache_dir, objective=EntropyMaxEnt(kl_estimator="k1", **gate)).configure_model()
    with pytest.raises(ValueError, match=r"objective.kl_bias_correction=True would do nothing"):
        make_module(cache_dir, objective=EntropyMaxEnt(kl_bias_correction=True, **gate)
                    ).configure_model()


# ------------------------------------------------------------------ checkpoints and resume


def test_checkpoint_restores_objective_state_counters_and_random_state(cache_dir, tmp_path):
    objective = EntropyMaxEnt(alpha=0.01, kl_gate_threshold=0.05, beta=0.1)
    module = make_module(cache_dir, objective=objective)
    objective.beta, objective.alpha_multiplier = 0.3, 1.7
    module.counters.nonfinite_in_a_row, module.counters.nonfinite_total = 1, 4
    torch.manual_seed(5)
    random.seed(6)
    np.random.seed(7)
    checkpoint: dict = {}
    module.on_save_checkpoint(checkpoint)
    expected = (torch.rand(3), random.random(), np.random.rand())
    # the checkpoint holds plain values only: it loads with weights_only=True
    torch.save(checkpoint, tmp_path / "c.ckpt")
    checkpoint = torch.load(tmp_path / "c.ckpt", weights_only=True)

    fresh = make_module(cache_dir, objective=EntropyMaxEnt(alpha=0.01, kl_gate_threshold=0.05,
                                                           beta=0.1))
    fresh.on_load_checkpoint(checkpoint)  # load_from_checkpoint: the weights only
    assert (fresh.objective.beta, fresh._rng_to_restore, fresh.counters.nonfinite_total) == (
        0.1, None, 0)
    fresh._trainer = SimpleNamespace(state=SimpleNamespace(fn="fit"), global_rank=0,
                                     world_size=1)  # a fit resumed from it
    fresh.on_load_checkpoint(checkpoint)
    assert (fresh.objective.beta, fresh.objective.alpha_multiplier) == (0.3, 1.7)
    assert (fresh.counters.nonfinite_in_a_row, fresh.counters.nonfinite_total) == (1, 4)
    torch.manual_seed(0)  # whatever runs between the restore and the first batch ...
    hooks = ModuleHooks()  # the module's callback, first of the user's callbacks
    hooks.on_train_batch_start(None, fresh, None, 0)  # ... the state is restored right here
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
    hooks.on_train_batch_start(None, fresh, None, 1)  # only once
    assert not torch.equal(torch.rand(3), expected[0])


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"model_name_or_path": "builtin:smollm2-135m-instruct"}, "model.model_name_or_path"),
        ({"objective": GRPO()}, "model.objective ListwiseMaxEnt, but this run has GRPO; use the "
                                r"config the fit ran with \(in Python: objective=ListwiseMaxEnt"),
    ],
)
def test_a_checkpoint_of_another_config_is_refused(cache_dir, kw, match):
    checkpoint: dict = {}
    make_module(cache_dir, objective=ListwiseMaxEnt(tau=0.5)).on_save_checkpoint(checkpoint)
    other = make_module(cache_dir, **{"objective": ListwiseMaxEnt(tau=0.9), **kw})
    with pytest.raises(ValueError, match=match):
        other.on_load_checkpoint(checkpoint)
    assert other.objective.state().get("tau") != 0.5  # nothing was applied
    with pytest.raises(ValueError, match="no 'maxent_grpo' entry"):
        other.on_load_checkpoint({"state_dict": {}})


def test_the_entropy_gate_follows_each_steps_kl(cache_dir):
    from maxent_grpo.core import entropy_gate_multiplier

    objective = EntropyMaxEnt(alpha=0.01, kl_gate_threshold=1e-6, kl_gate_gain=1.0)
    module = make_module(
        cache_dir, objective=objective, rewards={"tests.conftest:alternating": 1.0}
    )
    fit(module, make_data(cache_dir), steps=2)
    kl = module.step_metrics_dict["train/kl"]
    assert kl > 1e-6  # the policy moved away from the reference after one update
    assert objective.alpha_multiplier == entropy_gate_multiplier(
        kl, kappa=1e-6, gain=1.0, m_lo=0.0, m_hi=2.0
    )
    assert objective.alpha_multiplier < 1  # above the threshold: the bonus shrinks


def test_evaluation_does_not_shift_the_training_random_stream(cache_dir):
    from maxent_grpo.training.data.datamodule import collate_prompts

    module = make_module(cache_dir, eval_num_generations=2)
    module.configure_model()
    data = make_data(cache_dir)
    data.setup("fit")
    batch = collate_prompts(data.val_dataset.examples[:2])
    torch.manual_seed(3)
    module.validation_step(batch, 0)
    after_eval = torch.rand(2)
    torch.manual_seed(3)
    assert torch.equal(torch.rand(2), after_eval)
    assert module.evaluator.reward.update_count == 1


def test_logged_learning_rate_is_the_one_the_update_used(cache_dir):
    module = make_module(
        cache_dir, lr_warmup_steps=2, rewards={"tests.conftest:alternating": 1.0}
    )
    fit(module, make_data(cache_dir), steps=1)
    assert module.step_metrics_dict["train/lr"] == pytest.approx(0.25)  # 0.5 * (0 + 1) / 2


def test_trajectory_samples_record_what_the_step_scored(cache_dir):
    module = make_module(
        cache_dir, objective=ListwiseMaxEnt(tau=0.5),
        rewards={"tests.conftest:alternating": 1.0},
    )
    fit(module, make_data(cache_dir), steps=1)
    record = module.trajectory.samples
    assert len(record.prompts) == 4
    assert all(len(g) == 4 for g in record.generation.grouped_completions)
    assert record.rewards.shape == (4, 4)
    assert record.rewards[0].tolist() == [1.0, 0.0, 1.0, 0.0]
    torch.testing.assert_close(record.components["tests.conftest:alternating"],
                               record.rewards)
    torch.testing.assert_close(record.weights.sum(-1), torch.ones(4))
    assert record.advantages is None


def test_module_and_data_may_differ_in_max_prompt_length_with_a_logger(cache_dir, tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger

    module = make_module(cache_dir, max_prompt_length=256,
                         rewards={"tests.conftest:alternating": 1.0})
    trainer = L.Trainer(
        max_steps=1, accelerator="cpu", logger=TensorBoardLogger(str(tmp_path)),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(module, make_data(cache_dir, max_prompt_length=32))
    assert trainer.global_step == 1


def test_step_timings_are_logged_and_add_up(cache_dir):
    module = make_module(
        cache_dir, objective=GRPO(beta=0.1),
        rewards={"tests.conftest:alternating": 1.0},
    )
    fit(module, make_data(cache_dir), steps=1)
    perf = {k.removeprefix("train/perf/"): v for k, v in module.step_metrics_dict.items()
            if k.startswith("train/perf/")}
    assert set(perf) == {
        "generate_s", "reward_s", "score_s", "backward_s", "step_s", "tokens_per_s",
        "sync_seconds",
    }
    assert perf["sync_seconds"] == 0.0  # the first rollout needs no sync
    parts = perf["generate_s"] + perf["reward_s"] + perf["score_s"] + perf["backward_s"]
    assert all(perf[k] > 0 for k in ("generate_s", "score_s", "backward_s"))
    assert parts <= perf["step_s"] + 1e-6  # phases are disjoint parts of the step
    tokens = module.step_metrics_dict["train/tokens/completion_tokens"]
    assert perf["tokens_per_s"] == pytest.approx(tokens / perf["step_s"], rel=1e-6)


def half_constant(prompts, completions, **kw):
    """Groups of 4: even groups all 1.0 (constant), odd groups 1, 0, 1, 0."""
    return [1.0 if (i // 4) % 2 == 0 else float(i % 2 == 0) for i in range(len(completions))]


def _sgd_delta(cache_dir, objective, reward, **kw) -> tuple[dict, MaxEntGRPOModule, L.Trainer]:
    module = make_module(
        cache_dir, objective=objective, rewards={f"tests.training.test_module:{reward}": 1.0},
        gradient_clip_val=None, **kw,
    )
    module.configure_model()
    before = params(module)
    trainer = fit(module, make_data(cache_dir), steps=1)
    return {k: v - before[k] for k, v in params(module).items()}, module, trainer


def test_dropping_constant_groups_renormalises_grpo_over_the_kept_groups(cache_dir):
    """GRPO gives constant groups zero advantage, so dropping them only changes the
    normaliser: dr_grpo divides by the 8 kept rows instead of all 16, and the SGD update of
    the same rollout doubles."""
    kept, module, trainer = _sgd_delta(
        cache_dir, GRPO(loss_type="dr_grpo"), "half_constant", drop_constant_groups=True
    )
    everything, _, _ = _sgd_delta(cache_dir, GRPO(loss_type="dr_grpo"), "half_constant")
    assert trainer.callback_metrics["train/dropped_groups"] == 2
    assert trainer.callback_metrics["train/empty_steps"] == 0
    moved = [k for k in kept if everything[k].abs().max() > 0]
    assert moved
    for key in moved:
        torch.testing.assert_close(kept[key], 2 * everything[key], atol=1e-6, rtol=1e-4)
    advantages = torch.tensor(module.trajectory.samples.advantages.grouped)  # (B, G)
    assert torch.isnan(advantages[0]).all() and torch.isnan(advantages[2]).all()  # dropped
    assert not torch.isnan(advantages[1]).any()


def test_listwise_flattens_constant_groups_unless_they_are_dropped(cache_dir):
    """A group whose rewards are all equal has uniform listwise weights: its loss pulls the
    sampled completions towards equal probability. Dropped, an all-constant step changes no
    weight but still counts as a step."""
    pulled, _, _ = _sgd_delta(cache_dir, ListwiseMaxEnt(tau=0.5), "always_one")
    assert max(float(d.abs().max()) for d in pulled.values()) > 0
    still, module, trainer = _sgd_delta(
        cache_dir, ListwiseMaxEnt(tau=0.5), "always_one", drop_constant_groups=True
    )
    assert all(float(d.abs().max()) == 0 for d in still.values())
    assert trainer.global_step == 1 and module.counters.empty_steps == 1
    assert trainer.callback_metrics["train/dropped_groups"] == 4
    assert module.trajectory.samples.weights is None


def test_an_empty_step_moves_neither_the_entropy_gate_nor_a_controller(cache_dir):
    """A step whose every group was dropped measures no KL: the entropy gate kept its
    multiplier and the BetaController its beta (they read the missing KL as "above" and
    switched the bonus off, or raised beta, on no data at all)."""
    from maxent_grpo.training.callbacks import BetaController

    objective = EntropyMaxEnt(alpha=0.1, beta=0.04, kl_gate_threshold=0.05)
    controller = BetaController(kl_target=0.5, horizon=2.0, step_bound=0.5)
    module = make_module(cache_dir, objective=objective, drop_constant_groups=True,
                         rewards={"tests.conftest:always_one": 1.0})
    trainer = fit(module, make_data(cache_dir), steps=2, callbacks=[controller])
    assert module.counters.empty_steps == 2 and trainer.global_step == 2
    assert (objective.alpha_multiplier, objective.beta, controller.steps) == (1.0, 0.04, 0)


def test_wreinforce_keeps_the_constant_groups_it_trains_on(cache_dir):
    with pytest.raises(ValueError, match="set model.drop_constant_groups: false"):
        make_module(cache_dir, objective=GRPO(advantage="wreinforce"), drop_constant_groups=True)
    make_module(cache_dir, objective=GRPO(advantage="wreinforce"))


def test_solved_groups_stay_for_the_answer_level_target(cache_dir):
    """With ``solved_reward`` the all-right groups stay in the update: their answer-level
    listwise target spreads weight over the different answers they hold, so the weights
    move where plain dropping leaves them still."""
    moved, module, trainer = _sgd_delta(
        cache_dir, ListwiseMaxEnt(tau=0.5, answer_level=True), "always_one",
        drop_constant_groups=True, solved_reward=1.0)
    assert trainer.callback_metrics["train/dropped_groups"] == 0
    assert max(float(d.abs().max()) for d in moved.values()) > 0
    answers = module.trajectory.targets.answers
    weights = module.trajectory.targets.weights
    assert answers is not None and bool((weights[answers != torch.arange(4)] == 0).all())
    still, _, trainer = _sgd_delta(
        cache_dir, ListwiseMaxEnt(tau=0.5, answer_level=True), "always_one",
        drop_constant_groups=True, solved_reward=2.0)
    assert trainer.callback_metrics["train/dropped_groups"] == 4
    assert all(float(d.abs().max()) == 0 for d in still.values())
    with pytest.raises(ValueError, match="solved_reward"):
        make_module(cache_dir, solved_reward=1.0)


def test_dropped_groups_do_not_depend_on_the_micro_batches(cache_dir):
    results = [
        _sgd_delta(cache_dir, ListwiseMaxEnt(tau=0.5, length_normalize=True), "half_constant",
                   drop_constant_groups=True, **split)[0]
        for split in ({}, {"micro_batch_groups": 1})
    ]
    for key in results[0]:
        torch.testing.assert_close(results[0][key], results[1][key], atol=1e-6, rtol=1e-5)


def test_bf16_true_precision_trains_and_validates(cache_dir):
    """``trainer.precision: bf16-true`` casts the whole module, metric states included; the
    metrics keep float64 sums and the step and validation run."""
    module = make_module(cache_dir, rewards={"tests.conftest:alternating": 1.0})
    before = params(module.configure_model() or module)
    fit(module, make_data(cache_dir), steps=2, precision="bf16-true")
    assert next(module.policy.parameters()).dtype == torch.bfloat16
    assert module.step_metrics_dict["train/reward/mean"] == 0.5  # alternating 1, 0: exact
    assert any(not torch.equal(before[k], v.float()) for k, v in params(module).items())
    evaluator = L.Trainer(accelerator="cpu", devices=1, logger=False, precision="bf16-true",
                          limit_val_batches=1, enable_progress_bar=False)
    metrics = evaluator.validate(module, make_data(cache_dir), verbose=False)[0]
    assert metrics["val/reward/mean"] == 0.5


def test_static_cache_engine_trains_exactly_like_the_default(cache_dir):
    """``model.engine`` with a static cache and prompt buckets: same samples, and the extra
    prompt padding is trimmed before scoring, so the update is the default engine's."""
    from maxent_grpo.rollout import HFGenerateEngine

    results = []
    for engine in (HFGenerateEngine,
                   functools.partial(HFGenerateEngine, cache="static", prompt_bucket=16)):
        module = make_module(cache_dir, engine=engine,
                             rewards={"tests.conftest:alternating": 1.0})
        fit(module, make_data(cache_dir), steps=2)
        results.append(params(module))
    for key, value in results[0].items():
        torch.testing.assert_close(results[1][key], value, rtol=0, atol=1e-6)


def test_sampler_correction_names_what_it_needs(cache_dir):
    """The correction needs an objective with the clipped surrogate, and an engine that
    reports its log-probs: the Hugging Face engine samples from the scored policy."""
    with pytest.raises(ValueError, match="needs an objective with the clipped surrogate"):
        make_module(cache_dir, objective=ListwiseMaxEnt(tau=0.5), sampler_correction="token_tis")
    with pytest.raises(ValueError, match=r"model\.sampler_correction must be one of"):
        make_module(cache_dir, sampler_correction="tis")
    with pytest.raises(ValueError, match=r"model\.sampler_correction_cap"):
        make_module(cache_dir, sampler_correction_cap=0.0)
    with pytest.raises(ValueError, match=r"model\.sampler_correction_cap=3.0 would do nothing: "
                                         r"only with model\.sampler_correction set"):
        make_module(cache_dir, sampler_correction_cap=3.0)
    module = make_module(cache_dir, sampler_correction="token_tis",
                         rewards={"tests.conftest:alternating": 1.0})
    with pytest.raises(ValueError, match="reports its log-probs"):
        fit(module, make_data(cache_dir), steps=1)


def test_a_generation_copy_measures_and_corrects_its_gap(cache_dir):
    """Sampling from a bfloat16 copy, the engine reports the copy's log-probs: the step logs
    the gap to the float32 policy it trains and takes ``sampler_correction``."""
    from maxent_grpo.rollout import HFGenerateEngine

    module = make_module(cache_dir, sampler_correction="token_tis",
                         engine=functools.partial(HFGenerateEngine, generation_dtype="bfloat16"),
                         rewards={"tests.conftest:alternating": 1.0})
    logged = fit(module, make_data(cache_dir), steps=2).callback_metrics
    assert 1e-5 < float(logged["train/rollout/logp_gap/mean"]) < 0.1
    assert 0.5 < float(logged["train/rollout/correction/mean"]) <= 2.0


@pytest.mark.parametrize("answer_level", [True, False])
def test_listwise_refuses_rows_masked_out_whole(cache_dir, answer_level):
    """``mask_truncated_completions`` hides whole rows, which the listwise softmax over a
    group's sequence log-probs (and the answer-level target) would count as completions of
    log-prob 0, the likeliest: refused at build, naming the option. GRPO takes it."""
    with pytest.raises(ValueError, match="mask_truncated_completions: false"):
        make_module(cache_dir, objective=ListwiseMaxEnt(tau=0.5, answer_level=answer_level),
                    mask_truncated_completions=True)
    make_module(cache_dir, objective=GRPO(), mask_truncated_completions=True)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_a_step_whose_every_completion_is_masked_is_warned(cache_dir, loss_type):
    """``max_completion_length: 1`` with ``mask_truncated_completions``: every completion is
    cut and left out of the loss, the gradient is 0 at every step, and nothing said so.
    (``dapo`` divides by the step's tokens: with none, the run stopped with a ValueError.)"""
    module = make_module(cache_dir, max_completion_length=1, mask_truncated_completions=True,
                         objective=GRPO(loss_type=loss_type))
    with pytest.warns(UserWarning, match=r"every completion of a training step \(on rank 0\) "
                                         "reached model.max_completion_length"):
        fit(module, make_data(cache_dir), steps=1)
    assert module.step_metrics_dict["train/tokens/truncated_frac"] == 1.0
    assert module.step_metrics_dict["train/loss/total"] == 0.0
    # no completion the loss reads: no mean log-prob (it was 0.0, as if certain)
    assert "train/logp/sequence" not in module.step_metrics_dict
    assert "train/logp/behavior_sequence" not in module.step_metrics_dict


def test_a_step_no_weighted_reward_graded_is_warned(cache_dir):
    """``data.answer_column: null`` with a reward that reads the answer: every value None,
    every reward 0, and the run trained on nothing without a word."""
    module = make_module(cache_dir, rewards={"first_number": 1.0, "format": 0.0})
    with pytest.warns(UserWarning, match="no weighted reward function graded any completion"):
        fit(module, make_data(cache_dir, answer_column=None), steps=1)
    assert module.step_metrics_dict["train/reward/mean"] == 0.0


def test_group_maxent_reads_a_hidden_rows_reference_log_likelihood(cache_dir):
    """``mask_truncated_completions`` hides truncated rows from the loss; their reference
    log-likelihood ``rho`` still comes from the tokens sampled (it was 0, the likeliest,
    which gave a row that trains nothing the largest weight of its group)."""
    seen = []

    class Recorder(GroupMaxEnt):
        def prepare(self, inputs):
            seen.append(inputs.ref_seq_logps.clone())
            return super().prepare(inputs)

    module = make_module(cache_dir, max_completion_length=1, mask_truncated_completions=True,
                         objective=Recorder(tau=0.5, lam=0.5))
    with pytest.warns(UserWarning, match="reached model.max_completion_length"):
        fit(module, make_data(cache_dir), steps=1)
    assert seen and bool((seen[0] < 0).all()), seen  # every row truncated, none log-lik 0


def test_the_weighted_kl_is_the_kl_term_the_loss_holds(cache_dir):
    """ListwiseMaxEnt's beta tilts its target weights and weighs no KL term in the loss
    (kl_coef does): ``loss/weighted_kl`` was ``beta * kl`` for it, a term not in the loss."""
    for beta, kl_coef in ((8.0, 0.0), (0.0, 1.0)):
        module = make_module(cache_dir, objective=ListwiseMaxEnt(tau=0.5, beta=beta,
                                                                 kl_coef=kl_coef))
        fit(module, make_data(cache_dir), steps=2)
        logged = module.step_metrics_dict
        assert logged["train/kl"] > 0
        assert logged["train/loss/weighted_kl"] == pytest.approx(kl_coef * logged["train/kl"])


def test_a_policy_with_dropout_is_scored_as_it_samples(cache_dir, tmp_path):
    """A model with dropout was scored in training mode: its log-probs were noised, the KL
    to the reference was 2.9 at step 0 and a ratio's old and new values differed."""
    from maxent_grpo.models import load_policy, load_tokenizer

    model = load_policy("builtin:tiny", cache_dir=cache_dir)
    model.config.attention_dropout = 0.3
    model.save_pretrained(tmp_path / "drop")
    load_tokenizer("builtin:tiny", cache_dir=cache_dir).save_pretrained(tmp_path / "drop")
    module = make_module(cache_dir, model_name_or_path=str(tmp_path / "drop"))
    with pytest.warns(UserWarning, match="dropout is set to 0"):
        module.configure_model()
    assert module.policy.training
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    runs = [module.policy(input_ids=ids).logits for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    module.policy.eval()
    assert torch.equal(module.policy(input_ids=ids).logits, runs[0])


class BareLoss(GRPO):
    """A subclass whose loss returns its bare tensor, as a first try often does."""

    def loss(self, mb):
        return super().loss(mb).loss


class BareTargets(GRPO):
    def prepare(self, inputs):
        return super().prepare(inputs).advantages


class PerPromptAdvantages(GRPO):
    """One advantage per prompt, not per completion."""

    def prepare(self, inputs):
        targets = super().prepare(inputs)
        return dataclasses.replace(targets, advantages=targets.advantages.view(
            -1, inputs.rewards.shape[1]).mean(-1))


class VectorLoss(GRPO):
    def loss(self, mb):
        out = super().loss(mb)
        return dataclasses.replace(out, loss=out.loss.expand(3))


class DetachedLoss(GRPO):
    def loss(self, mb):
        out = super().loss(mb)
        return dataclasses.replace(out, loss=out.loss.detach())


class LeafLoss(GRPO):
    """A loss that requires grad but is no function of the policy: nothing trained."""

    def loss(self, mb):
        out = super().loss(mb)
        return dataclasses.replace(out, loss=out.loss.detach().clone().requires_grad_())


class StatsAs(GRPO):
    """A subclass adding ``stats`` to its targets and ``sums`` to its loss's."""

    def __init__(self, stats=None, sums=None):
        super().__init__()
        self.extra_stats, self.extra_sums = stats or {}, sums or {}

    def prepare(self, inputs):
        targets = super().prepare(inputs)
        targets.stats.update(self.extra_stats(inputs) if callable(self.extra_stats)
                             else self.extra_stats)
        return targets

    def loss(self, mb):
        out = super().loss(mb)
        out.sums.update(self.extra_sums)
        return out


@pytest.mark.parametrize("objective, message", [
    (StatsAs(stats={"reward/mean": torch.tensor(42.0)}),
     r"StatsAs.prepare: Targets.stats\['reward/mean'\]: the trainer logs train/reward/mean "
     r"itself, so the two would be mixed; give the value another name"),
    (StatsAs(sums={"loss/total": (torch.tensor(99.0), torch.tensor(1.0))}),
     r"StatsAs.loss: LossOutput.sums\['loss/total'\]: the trainer logs train/loss/total"),
    (StatsAs(stats=lambda inputs: {"vec": inputs.rewards.mean(1)}),
     r"StatsAs.prepare: Targets.stats\['vec'\] must be a 0-d tensor or a number; got \(4,\)"),
    (StatsAs(sums={"x": 1.0}), r"StatsAs.loss: LossOutput.sums\['x'\] must be a pair \(sum, "
                               r"count\) of 0-d tensors or numbers; got \['float'\]"),
    (StatsAs(stats={"x": "high"}), r"Targets.stats\['x'\] must be .*; got str"),
    # a name of the loss's own sums: averaged in as one more token (train/kl too)
    (StatsAs(stats={"clip/low": 1.0}), r"Targets.stats\['clip/low'\]: its loss logs "
                                       r"train/clip/low \(LossOutput.sums\) already"),
])
def test_an_objectives_statistics_of_a_trainers_name_or_another_kind_are_named(
        cache_dir, objective, message):
    """A statistic named as one the trainer logs (``reward/mean``) replaced the logged
    reward (42.0 at every step, the end summary too), a ``loss/total`` sum was averaged into
    the loss logged; a plain float or a non-pair crashed as "a bug" (a hunt of the extension
    points)."""
    from maxent_grpo.validation import UserCodeError

    with pytest.raises(UserCodeError, match=message):
        fit(make_module(cache_dir, objective=objective), make_data(cache_dir), steps=1)


def test_an_objectives_own_logged_state_and_other_kinds_are_refused_by_name():
    """The objective's ``state()`` (``train/alpha`` of EntropyMaxEnt, ``train/lam``) and the
    trainer's step counts are logged after its statistics and replaced them; a bool tensor
    failed as "total must be a real floating or integer tensor", naming nothing."""
    import numpy as np

    from maxent_grpo.training.step.step_log import objective_values
    from maxent_grpo.validation import UserCodeError

    owner = "Mine.prepare: Targets.stats"
    for name in ("alpha", "dropped_groups", "loss/weighted_kl"):
        with pytest.raises(UserCodeError, match=rf"Mine.prepare: Targets.stats\['{name}'\]: "
                                                rf"the trainer logs train/{name} itself"):
            objective_values(owner, {name: 1.0}, pairs=False, taken={"alpha": 0.1})
    with pytest.raises(UserCodeError, match=r"\['flag'\] must be a 0-d tensor or a number; "
                                            r"got \(\) torch.bool"):
        objective_values(owner, {"flag": torch.tensor(True)}, pairs=False)
    got = objective_values(owner, {"a": np.float32(0.25), "b": float("nan")}, pairs=False)
    assert got["a"].item() == 0.25 and got["a"].dtype == torch.float64
    assert math.isnan(got["b"].item())


def test_an_objectives_statistics_may_be_numbers(cache_dir):
    """The documented 0-d tensors, or plain numbers, under names of the objective's own."""
    module = make_module(cache_dir, objective=StatsAs(stats={"foo": 0.5},
                                                      sums={"bar": (0.3, 1.0)}))
    fit(module, make_data(cache_dir), steps=1)
    logged = module.step_metrics_dict
    assert logged["train/foo"] == pytest.approx(0.5)
    assert logged["train/bar"] == pytest.approx(0.3)


@pytest.mark.parametrize("objective, message", [
    (PerPromptAdvantages, r"PerPromptAdvantages.prepare: Targets.advantages must be a \(16,\) "
                          r"tensor \(4 groups x G=4\); got \(4,\)"),
    (VectorLoss, r"VectorLoss.loss: LossOutput.loss must be a scalar tensor with a gradient "
                 r".*; got shape \(3,\), requires_grad True"),
    (DetachedLoss, r"DetachedLoss.loss: .*; got shape \(\), requires_grad False"),
    (LeafLoss, r"LeafLoss.loss: .*; got shape \(\), requires_grad True, computed from the "
               r"policy False"),  # trained nothing (grad_norm 0) without a word
])
def test_an_objectives_targets_and_loss_of_the_wrong_shape_are_named(cache_dir, objective,
                                                                   message):
    """An index error deep in the step, a broadcast error, 'element 0 of tensors does not
    require grad': each "a bug in maxent_grpo" (a hunt of the extension points)."""
    from maxent_grpo.validation import UserCodeError

    with pytest.raises(UserCodeError, match=message):
        fit(make_module(cache_dir, objective=objective()), make_data(cache_dir), steps=1)


def test_a_beta_raised_from_zero_by_a_callback_is_named_not_trained_without_its_kl(
        cache_dir):
    """A user's callback setting ``objective.beta = 0.5`` from 0: ``train/beta`` logged 0.5,
    but the step had no reference model and no KL term (a hunt of the extension points).
    One that calls ``require_reference`` in its setup trains with the KL."""

    class Raise(L.Callback):
        def __init__(self, ask: bool):
            self.ask = ask

        def setup(self, trainer, module, stage):
            if self.ask:
                module.require_reference()

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if trainer.global_step == 1:
                module.objective.beta = 0.5

    with pytest.raises(ValueError, match=r"model.objective \(GRPO, now \{'beta': 0.5\}\) needs "
                                         r"the reference model at step 1, but this run loaded "
                                         r"none.*require_reference"):
        fit(make_module(cache_dir), make_data(cache_dir), steps=2, callbacks=[Raise(False)])
    module = make_module(cache_dir, rewards={"tests.conftest:alternating": 1.0})  # it moves
    fit(module, make_data(cache_dir), steps=2, callbacks=[Raise(True)])
    assert module.reference is not None and module.step_metrics_dict["train/kl"] > 0


class Counting(GRPO):
    """Mutable state of other kinds than float: an int used as an index, a bool, a tensor."""

    mutable = ("beta", "seen", "flag")

    def __init__(self, **options):
        super().__init__(**options)
        self.seen, self.flag = 0, False

    def observe(self, stats):
        self.seen, self.flag = self.seen + 1, not self.flag
        assert ["a", "b", "c", "d"][self.seen]  # an index: it was a float after a resume


def test_an_objectives_mutable_state_keeps_its_kind_and_a_tensor_is_named(cache_dir, tmp_path):
    """``float()`` of every mutable attribute: an int came back a float at a resume (a list
    index failed, "a bug"), a tensor failed the first save with torch's message (a hunt of
    the extension points)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from maxent_grpo.training.run.checkpoint import CHECKPOINT_KEY
    from maxent_grpo.validation import UserCodeError

    saver = ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True, every_n_train_steps=1)
    fit(make_module(cache_dir, objective=Counting()), make_data(cache_dir), steps=1,
        tmp_path=tmp_path, enable_checkpointing=True, callbacks=[saver])
    state = torch.load(tmp_path / "ck" / "last.ckpt", weights_only=False)[CHECKPOINT_KEY][
        "objective_state"]
    assert state == {"beta": 0.0, "seen": 1, "flag": True}
    resumed = make_module(cache_dir, objective=Counting())
    fit(resumed, make_data(cache_dir), steps=2, tmp_path=tmp_path,
        ckpt_path=str(tmp_path / "ck" / "last.ckpt"))
    assert (resumed.objective.seen, resumed.objective.flag) == (2, False)
    older = Counting()  # an older checkpoint's floats: back to ints and bools, without loss
    older.load_state_dict({"beta": 0.0, "seen": 3.0, "flag": 1.0})
    assert (type(older.seen), older.seen, older.flag) == (int, 3, True)
    older.load_state_dict({"seen": 0.25, "flag": 0.7})  # a value moved off the kind: kept
    assert (older.seen, older.flag) == (0.25, 0.7)
    held = Counting()
    held.seen = torch.zeros(2)
    with pytest.raises(UserCodeError, match=r"Counting.mutable: 'seen' must be a number \(a "
                                            r"bool, an int or a float.*; got Tensor"):
        make_module(cache_dir, objective=held)


@pytest.mark.parametrize("objective, method", [(BareLoss, "loss"), (BareTargets, "prepare")])
def test_an_objective_returning_the_wrong_type_is_named_as_the_users(cache_dir, objective,
                                                                    method):
    """It failed with "'Tensor' object has no attribute 'loss'" and "a bug in maxent_grpo"."""
    from maxent_grpo.cli.errors import find_user_error
    from maxent_grpo.validation import UserCodeError

    module = make_module(cache_dir, objective=objective())
    with pytest.raises(UserCodeError, match=rf"{objective.__name__}.{method} must return a "
                                            r"maxent_grpo.objectives.\w+; got Tensor") as raised:
        fit(module, make_data(cache_dir), steps=1)
    assert find_user_error(raised.value) is not None


def test_with_several_processes_a_save_on_an_error_of_one_is_skipped_and_set_back():
    """An error that may be one process's alone skips ``save_on_exception`` (the others
    cannot join the save's collectives); one raised on every rank at once
    (``NonFiniteLossError``), SIGTERM and Ctrl-C still save; the next run saves again."""

    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from maxent_grpo.training.callbacks.module_own import ModuleHooks
    from maxent_grpo.training.step.optimise import NonFiniteLossError

    saver = ModelCheckpoint(save_on_exception=True)
    trainer = SimpleNamespace(
        world_size=2, global_rank=1, checkpoint_callbacks=[saver], global_step=5,
        fast_dev_run=False, sanity_checking=False,
        _signal_connector=SimpleNamespace(register_signal_handlers=lambda: None),
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace()))
    hooks = ModuleHooks()
    for kept in (NonFiniteLossError("nan"), SIGTERMException(), KeyboardInterrupt()):
        hooks.on_exception(trainer, None, kept)
        assert saver.save_on_exception
    hooks.on_exception(trainer, None, ValueError("a reward server is down"))
    assert not saver.save_on_exception
    module = SimpleNamespace(loop=SimpleNamespace(generation=SimpleNamespace(
        sampling=SimpleNamespace(max_prompt_length=None))))
    hooks.setup(trainer, module, "validate")  # the next run on this Trainer
    assert saver.save_on_exception
    trainer.world_size = 1  # one process: every error saves
    hooks.on_exception(trainer, None, ValueError("a reward server is down"))
    assert saver.save_on_exception


def test_rewards_left_unset_are_the_accuracy_reward_and_said_so(cache_dir):
    """Nothing said so: a task with bare answers trained on reward 0 throughout (a hunt)."""
    with pytest.warns(UserWarning, match="model.rewards is not set: scoring with the "
                                         "accuracy reward alone"):
        module = make_module(cache_dir, rewards=None)
    assert module.rewards.names == ["accuracy"]


def test_an_optimizer_that_needs_a_closure_is_refused_by_name():
    """``torch.optim.LBFGS`` failed at its first step as "a bug in maxent_grpo" (a hunt of
    extensions)."""
    from maxent_grpo.training.settings import build_optimizer

    param = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="model.optimizer torch.optim.LBFGS needs a closure"):
        build_optimizer(lambda p: torch.optim.LBFGS(p), param)
    assert isinstance(build_optimizer(lambda p: torch.optim.SGD(p, lr=0.1), param),
                      torch.optim.SGD)


def test_a_learning_rate_past_float32_is_refused_naming_the_option():
    """AdamW's lr 1e39 crashed at the first update with torch's "cannot be converted to type
    float without overflow" as "a bug in maxent_grpo" (a numerical-extremes hunt)."""
    from maxent_grpo.training.settings import build_optimizer

    param = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match=r"lr 1e\+39 is beyond float32's range .*"
                       r"model.optimizer.init_args.lr"):
        build_optimizer(lambda p: torch.optim.AdamW(p, lr=1e39), param)
    assert build_optimizer(lambda p: torch.optim.AdamW(p, lr=1e30), param)
    assert build_optimizer(lambda p: torch.optim.AdamW(p, lr=torch.tensor(1e-3)), param)
    with pytest.raises(ValueError, match=r"lr 1e\+39 is beyond"):  # a tensor lr (readers)
        build_optimizer(lambda p: torch.optim.AdamW(p, lr=torch.tensor(1e39, dtype=torch.float64)),
                        param)


class OwnKL(GRPO):
    """An objective whose own default estimator is k1."""

    def __init__(self, kl_estimator: str = "k1", **options) -> None:
        super().__init__(kl_estimator=kl_estimator, **options)


def test_an_objectives_own_kl_default_is_not_called_unused(cache_dir):
    """Its default ``kl_estimator`` was compared with GRPO's and refused with beta 0 as an
    option set that "would do nothing" (a hunt of extensions)."""
    make_module(cache_dir, objective=OwnKL()).configure_model()
    with pytest.raises(ValueError, match="objective.kl_estimator='k2' would do nothing"):
        make_module(cache_dir, objective=OwnKL(kl_estimator="k2")).configure_model()


class EngineOf:
    """A custom engine over the Hugging Face one: ``mistake`` is what its generate does."""

    def __init__(self, model, tokenizer, sampling, mistake: str = "none") -> None:
        from maxent_grpo.rollout import HFGenerateEngine

        self.inner, self.mistake = HFGenerateEngine(model, tokenizer, sampling), mistake

    def sync(self, model) -> None:
        pass

    def generate(self, prompts, answers, num_generations, sampling=None):
        if self.mistake == "none":
            return None
        short = self.mistake == "short"
        out = self.inner.generate(prompts, answers, num_generations - short, sampling)
        if self.mistake == "ids":  # another model's ids: past the tiny model's vocabulary
            out.completion_ids[0, 0] = 10**6
        if self.mistake == "wide":  # 4 more columns than max_completion_length allows
            pad = torch.zeros(out.completion_ids.shape[0], 4, dtype=torch.long)
            out = dataclasses.replace(
                out, completion_ids=torch.cat([out.completion_ids, pad], 1),
                completion_mask=torch.cat([out.completion_mask, pad.bool()], 1),
                sampler_logps=None)
        return out


class NoSampling(EngineOf):
    def generate(self, prompts, answers, num_generations):
        return self.inner.generate(prompts, answers, num_generations)


@pytest.mark.parametrize(("engine", "message", "validated"), [
    (EngineOf, r"EngineOf.generate must return a maxent_grpo.rollout.RolloutOutput .*; got "
               "NoneType", False),
    (EngineOf, r"EngineOf.generate must return", True),  # the sanity check's validation
    (functools.partial(EngineOf, mistake="short"), r"EngineOf.generate returned 12 "
                                                   r"completions for 4 prompts x "
                                                   "num_generations 4", False),
    (NoSampling, r"NoSampling, which has no generate taking a sampling argument", False),
    # an IndexError in the log-probs (a device-side assert on a GPU)
    (functools.partial(EngineOf, mistake="ids"), r"EngineOf.generate returned token ids "
     r"\d+..1000000, outside the policy's vocabulary \[0, \d+\)", False),
    (functools.partial(EngineOf, mistake="wide"), r"EngineOf.generate returned completions "
     r"of \d+ tokens, more than model.max_completion_length 4", False),
])
def test_an_engine_of_ones_own_that_breaks_the_protocol_is_named(cache_dir, engine, message,
                                                                 validated):
    """An AttributeError, a reshape error deep in the step ("a bug in maxent_grpo"), or a
    TypeError at the first validation (a hunt of extensions)."""
    from maxent_grpo.validation import UserCodeError

    with pytest.raises((ValueError, UserCodeError), match=message):
        fit(make_module(cache_dir, engine=engine), make_data(cache_dir), steps=1,
            limit_val_batches=1 if validated else 0)


def test_a_module_pickles_after_a_fit_and_fits_again(cache_dir, tmp_path):
    """After a fit the module held Lightning's optimizer wrapper (a class made at run time),
    so ``pickle.dumps`` / ``torch.save(module)`` failed (a hunt of the Python API; Ray and
    multiprocessing pickle modules): a fit's handles end with it. The copy keeps the weights
    and trains again, and so does the module on a second fit."""
    import io
    import pickle

    module = make_module(cache_dir, optimizer=functools.partial(torch.optim.SGD, lr=0.5),
                         rewards={"tests.conftest:alternating": 1.0})
    fit(module, make_data(cache_dir), steps=1)
    copy_ = pickle.loads(pickle.dumps(module))
    assert all(torch.equal(a, b) for a, b in zip(params(module).values(),
                                                 params(copy_).values(), strict=True))
    torch.save(module, io.BytesIO())
    for again in (module, copy_):
        before = params(again)
        fit(again, make_data(cache_dir), steps=1)
        assert any(not torch.equal(before[k], v) for k, v in params(again).items())

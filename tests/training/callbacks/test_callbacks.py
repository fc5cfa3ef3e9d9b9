"""The tau / beta / meta controllers and the HF export, on fake step statistics.

Every expected value is computed by hand in the comments (or by a one-line float formula),
independently of ``maxent_grpo.core.control``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from maxent_grpo.objectives import GRPO, EntropyMaxEnt, GroupMaxEnt, ListwiseMaxEnt
from maxent_grpo.training import callbacks as cb
from maxent_grpo.training.callbacks import (
    BetaController,
    HFExport,
    MetaController,
    TauController,
    read_controller_state,
    write_controller_state,
)
from maxent_grpo.training.callbacks.state_file import build_snapshot
from maxent_grpo.training.run import checkpoint_io
from maxent_grpo.training.types import LogStepArtifacts


class FakeModule:
    """What the controllers use of MaxEntGRPOModule."""

    def __init__(self, objective, num_generations: int = 8) -> None:
        self.objective = objective
        self.loop = SimpleNamespace(generation=SimpleNamespace(num_generations=num_generations))
        self.step_metrics_dict: dict[str, float] = {}
        self.logged: list[dict[str, float]] = []
        self.reference_required = False

    def require_reference(self) -> None:
        self.reference_required = True

    def log_dict(self, values, **kw) -> None:
        self.logged.append(dict(values))


def fake_trainer(callbacks, log_dir: str = "logs", ckpt_path: str | None = None):
    return SimpleNamespace(
        callbacks=list(callbacks), log_dir=log_dir, default_root_dir=log_dir,
        ckpt_path=ckpt_path, is_global_zero=True,
        strategy=SimpleNamespace(reduce_boolean_decision=lambda ok, all=True: ok),
    )


def attach(objective, *controllers, **trainer_kw):
    """``setup('fit')`` every controller on one fake trainer; return (trainer, module)."""
    module = FakeModule(objective)
    trainer = fake_trainer(controllers, **trainer_kw)
    for c in controllers:
        c.setup(trainer, module, "fit")
    return trainer, module


def step(trainer, module, **stats: float) -> dict[str, float]:
    """One training step with the given ``train/<key>`` statistics."""
    module.step_metrics_dict = LogStepArtifacts(
        {}, stats, grad_norm_scalar=None, epoch_progress=0.0).as_dict()
    module.logged.clear()
    for c in trainer.callbacks:
        c.on_train_batch_end(trainer, module, None, None, 0)
    return {k: v for d in module.logged for k, v in d.items()}


# ---------------------------------------------------------------------- tau


def test_tau_controller_follows_the_entropy_ema_by_hand():
    obj = ListwiseMaxEnt(tau=0.5)
    tau = TauController(target_entropy=1.0, lr=0.5, tau_min=0.01, tau_max=10.0)
    trainer, module = attach(obj, tau)
    assert not module.reference_required  # tau alone never needs the reference

    logs = step(trainer, module, weight_entropy=2.0)
    # first observation initialises the EMA: 2.0; log tau = log .5 + .5 * (1 - 2)
    assert tau.tau_entropy_ema == 2.0
    assert obj.tau == pytest.approx(0.5 * math.exp(-0.5), rel=1e-12)  # 0.30327
    assert logs["train/delta_tau"] == pytest.approx(0.5 * math.exp(-0.5) - 0.5)
    assert logs["train/tau_target_entropy"] == 1.0

    step(trainer, module, weight_entropy=1.0)
    # EMA = .9 * 2 + .1 * 1 = 1.9; log tau += .5 * (1 - 1.9) = -.45
    assert tau.tau_entropy_ema == pytest.approx(1.9)
    assert obj.tau == pytest.approx(0.5 * math.exp(-0.95), rel=1e-12)  # 0.19338
    assert tau.steps == 2

    step(trainer, module, weight_entropy=0.1)
    # too little entropy raises tau: EMA = .9 * 1.9 + .01 = 1.72 -> log tau += -.36 (still
    # falls, the EMA lags); then a long run of low entropy turns it around
    assert obj.tau == pytest.approx(0.5 * math.exp(-0.95 - 0.36), rel=1e-12)
    for _ in range(30):
        step(trainer, module, weight_entropy=0.1)
    assert obj.tau > 0.5


def test_tau_controller_warmup_clip_and_anneal():
    obj = GroupMaxEnt(tau=1.0)
    tau = TauController(
        target_entropy=2.0, lr=10.0, tau_min=0.5, tau_max=2.0, warmup_steps=2,
        target_entropy_final=1.0, target_entropy_horizon=4,
    )
    trainer, module = attach(obj, tau)
    for _ in range(2):  # warmup: only the EMA moves
        logs = step(trainer, module, weight_entropy=0.0)
        assert obj.tau == pytest.approx(1.0) and logs["train/delta_tau"] == pytest.approx(0.0)
    assert tau.tau_entropy_ema == 0.0
    step(trainer, module, weight_entropy=0.0)  # target 2 - 1 * 2/4 = 1.5: +15 in log -> clip
    assert obj.tau == 2.0 and tau.state_dict() == {"steps": 3, "tau_entropy_ema": 0.0}
    assert [tau.target_at(s) for s in (0, 2, 4, 9)] == [2.0, 1.5, 1.0, 1.0]
    # the same controller given to a second fit (a notebook's list of callbacks) starts
    # again: it skipped the warm-up and kept the EMA (a hunt of the Python API)
    obj.tau = 1.0
    trainer, module = attach(obj, tau)
    assert tau.state_dict() == {"steps": 0, "tau_entropy_ema": None}
    logs = step(trainer, module, weight_entropy=0.0)
    assert obj.tau == pytest.approx(1.0) and logs["train/delta_tau"] == pytest.approx(0.0)
    trainer.global_step = 1  # a fit going on on the same Trainer (max_steps raised): kept
    tau.setup(trainer, module, "fit")
    assert tau.state_dict() == {"steps": 1, "tau_entropy_ema": 0.0}


def test_tau_controller_skips_a_step_without_weight_entropy():
    obj = ListwiseMaxEnt(tau=0.5)
    tau = TauController(target_entropy=1.0)
    trainer, module = attach(obj, tau)
    with pytest.warns(UserWarning, match="no finite train/weight_entropy"):
        logs = step(trainer, module, kl=0.1)
    assert logs == {} and obj.tau == 0.5 and tau.tau_entropy_ema is None


# ---------------------------------------------------------------------- beta


def test_beta_controller_by_hand():
    obj = GRPO(beta=0.1)
    beta = BetaController(kl_target=0.02, horizon=10.0, step_bound=0.2)
    trainer, module = attach(obj, beta)
    assert module.reference_required  # beta can rise: the reference loads from the start

    logs = step(trainer, module, kl=0.03)  # e = .03/.02 - 1 = .5 -> clipped to .2
    assert obj.beta == pytest.approx(0.1 * 1.02)
    assert logs["train/beta_kl_error"] == pytest.approx(0.2)
    assert logs["train/delta_beta"] == pytest.approx(0.002)
    step(trainer, module, kl=0.019)  # e = -.05 -> beta * (1 - .005)
    assert obj.beta == pytest.approx(0.1 * 1.02 * 0.995)
    step(trainer, module)  # no KL measured: counts as above the target, e = +.2
    assert obj.beta == pytest.approx(0.1 * 1.02 * 0.995 * 1.02)
    assert beta.steps == 3


def test_beta_controller_leaves_beta_until_the_objective_logs_a_kl():
    """An objective whose loss logs no ``kl`` sum had each step read as a KL above target:
    beta rose by x1.02 a step for the whole run (a hunt of extensions)."""
    obj = GRPO(beta=0.1)
    beta = BetaController(kl_target=10.0)
    trainer, module = attach(obj, beta)
    with pytest.warns(UserWarning, match="BetaController: no train/kl yet \\(GRPO's loss's"):
        assert step(trainer, module) == {} and step(trainer, module) == {}
    assert obj.beta == 0.1
    step(trainer, module, kl=0.0)  # measured: from here a missing KL counts as above
    step(trainer, module)
    assert obj.beta == pytest.approx(0.1 * 0.98 * 1.02)
    resumed = BetaController(kl_target=10.0)  # a resume: its kl_error is the checkpoint's
    resumed.load_state_dict(beta.state_dict())
    trainer, module = attach(obj, resumed)
    step(trainer, module)  # a missing KL after the resume counts as above, as before it
    assert obj.beta == pytest.approx(0.1 * 0.98 * 1.02 * 1.02)


def test_beta_controller_moves_entropy_and_listwise_objectives():
    for obj in (EntropyMaxEnt(beta=0.2), ListwiseMaxEnt(tau=0.0, beta=0.2)):
        trainer, module = attach(obj, BetaController(kl_target=0.1, horizon=4.0, step_bound=1.0))
        step(trainer, module, kl=0.0)  # e = -1 -> beta * (1 - 1/4)
        assert obj.beta == pytest.approx(0.15)


# ---------------------------------------------------------------------- meta


def test_meta_controller_by_hand_every_two_steps():
    obj = ListwiseMaxEnt(tau=0.5, beta=0.0)
    meta = MetaController(
        target_entropy=1.0, kl_target=0.02, lr_tau=0.1, lr_beta=0.5, kl_clip=1.0,
        every_n_steps=2,
    )
    trainer, module = attach(obj, meta)
    assert module.reference_required
    assert step(trainer, module, weight_entropy=1.2, kl=0.05) == {}  # step 1 of 2: nothing
    assert (obj.tau, obj.beta) == (0.5, 0.0)
    logs = step(trainer, module, weight_entropy=1.2, kl=0.05)
    # tau_grad = 1.2 - 1 = .2 -> tau = .5 - .02; beta_grad = .03 -> beta = 0 + .015 (additive:
    # beta rises from 0)
    assert obj.tau == pytest.approx(0.48) and obj.beta == pytest.approx(0.015)
    assert logs["train/meta/tau_grad"] == pytest.approx(0.2)
    assert logs["train/meta/beta_grad"] == pytest.approx(0.03)
    assert logs["train/delta_beta"] == pytest.approx(0.015)
    step(trainer, module, weight_entropy=0.0, kl=5.0)
    step(trainer, module, weight_entropy=0.0, kl=5.0)  # KL error clipped to c = 1
    assert obj.tau == pytest.approx(0.48 + 0.1) and obj.beta == pytest.approx(0.515)


def test_meta_controller_moves_tau_and_leaves_beta_until_the_objective_logs_a_kl():
    """A loss that logs no ``kl`` sum had each step read as a KL above target: beta rose by
    ``lr_beta * c`` a step for the whole run (BetaController's defect, found there first)."""
    obj = ListwiseMaxEnt(tau=0.5, beta=0.1)
    meta = MetaController(target_entropy=1.0, kl_target=0.02, lr_tau=0.1, lr_beta=0.5)
    trainer, module = attach(obj, meta)
    with pytest.warns(UserWarning, match="MetaController: no train/kl yet \\(ListwiseMaxEnt"):
        logs = step(trainer, module, weight_entropy=1.2)
    assert obj.tau == pytest.approx(0.48) and obj.beta == 0.1
    assert "train/meta/beta_grad" not in logs and meta.beta_grad is None
    step(trainer, module, weight_entropy=1.0, kl=0.02)  # measured: beta_grad 0
    step(trainer, module, weight_entropy=1.0)  # from here a missing KL counts as above: +c
    assert obj.beta == pytest.approx(0.1 + 0.5 * 1.0)
    resumed = MetaController(target_entropy=1.0, kl_target=0.02, lr_tau=0.1, lr_beta=0.5)
    resumed.load_state_dict(meta.state_dict())  # a resume: its beta_grad is the checkpoint's
    trainer, module = attach(obj, resumed)
    step(trainer, module, weight_entropy=1.0)
    assert obj.beta == pytest.approx(0.1 + 2 * 0.5 * 1.0)


# ---------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "objective, controllers, match",
    [
        (GRPO(), [TauController(1.0)], "TauController.*model.objective is GRPO"),
        (EntropyMaxEnt(beta=0.1), [TauController(1.0)], "TauController.*EntropyMaxEnt"),
        (GroupMaxEnt(), [BetaController(0.1)], "BetaController.*GroupMaxEnt"),
        (GroupMaxEnt(), [MetaController(1.0, 0.1)], "MetaController.*GroupMaxEnt"),
        (GRPO(beta=0.1), [MetaController(1.0, 0.1)], "MetaController.*GRPO"),
        (GRPO(beta=0.0), [BetaController(0.1)],  # MetaController needs a tau: not offered
         r"never raise beta from 0; set model.objective.beta > 0 \(e.g. 0.01\)$"),
        (ListwiseMaxEnt(tau=0.5, beta=0.0), [BetaController(0.1)],
         r"\(e.g. 0.01\), or use MetaController \(additive\)$"),
        (ListwiseMaxEnt(tau=0.0, beta=0.1), [TauController(1.0)], "tau > 0"),
        (ListwiseMaxEnt(tau=20.0), [TauController(1.0)], r"outside \[tau_min, tau_max\]"),
        (ListwiseMaxEnt(tau=0.5), [TauController(2.5)], r"log G\] = \[0, 2.0794\]"),
        (ListwiseMaxEnt(tau=0.5, beta=0.1), [TauController(1.0), MetaController(1.0, 0.1)],
         "TauController and MetaController both move objective.tau"),
        (ListwiseMaxEnt(tau=0.5, beta=0.1), [BetaController(0.1), BetaController(0.2)],
         "two BetaControllers"),
    ],
)
def test_setup_rejects_what_cannot_work(objective, controllers, match):
    with pytest.raises(ValueError, match=match):
        attach(objective, *controllers)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: BetaController(0.1, horizon=1.0, step_bound=1.0), "step_bound.*< horizon"),
        (lambda: BetaController(0.0), "kl_target must be a finite number > 0"),
        (lambda: TauController(1.0, tau_min=0.0), "tau_min must be a finite number > 0"),
        (lambda: TauController(1.0, ema_decay=1.0), r"ema_decay must be in \[0, 1\)"),
        (lambda: TauController(-1.0), "target_entropy must be a finite number >= 0"),
        (lambda: MetaController(1.0, 0.1, every_n_steps=0), "every_n_steps must be an int >= 1"),
        (lambda: TauController(1.0, state_path=""), "state_path must be None or a non-empty"),
        (lambda: HFExport(every_n_train_steps=0), "every_n_train_steps must be an int >= 1"),
        # half an anneal was accepted and kept the target constant
        (lambda: TauController(2.0, target_entropy_final=0.5), "needs both target_entropy_final"),
        (lambda: TauController(2.0, target_entropy_horizon=100), "needs both"),
    ],
)
def test_bad_arguments_fail_at_construction(build, match):
    with pytest.raises(ValueError, match=match):
        build()


# ---------------------------------------------------------------------- state


def test_controller_state_has_no_tau_or_beta_and_the_module_entry_restores_them():
    obj = ListwiseMaxEnt(tau=0.5, beta=0.1)
    tau, beta = TauController(1.0, lr=0.3), BetaController(0.02)
    trainer, module = attach(obj, tau, beta)
    for h, kl in ((1.5, 0.01), (1.2, 0.05), (0.9, 0.03)):
        step(trainer, module, weight_entropy=h, kl=kl)
    # the checkpoint: the module's entry holds tau / beta, the controllers only their own
    saved = {c.state_key: c.state_dict() for c in (tau, beta)}
    saved_objective = obj.state_dict()
    assert saved["TauController"] == {"steps": 3, "tau_entropy_ema": tau.tau_entropy_ema}
    assert saved["BetaController"] == {"steps": 3, "kl_error": beta.kl_error}
    assert saved_objective == {"tau": obj.tau, "beta": obj.beta}
    json.dumps(saved)  # plain values only

    # a fresh run: set-up from the config, then Lightning restores the checkpoint: the
    # module's entry first, then the callbacks, which leave the objective alone
    fresh_obj = ListwiseMaxEnt(tau=0.5, beta=0.1)
    tau2, beta2 = TauController(1.0, lr=0.3), BetaController(0.02)
    trainer2, module2 = attach(fresh_obj, tau2, beta2)
    fresh_obj.load_state_dict(saved_objective)
    tau2.load_state_dict(saved["TauController"])
    beta2.load_state_dict(saved["BetaController"])
    assert (fresh_obj.tau, fresh_obj.beta) == (obj.tau, obj.beta)
    assert tau2.state_dict() == saved["TauController"] and tau2.steps == 3
    assert beta2.state_dict() == saved["BetaController"]
    # ... and both runs continue identically
    assert step(trainer, module, weight_entropy=1.0, kl=0.02) == step(
        trainer2, module2, weight_entropy=1.0, kl=0.02)
    assert (fresh_obj.tau, fresh_obj.beta) == (obj.tau, obj.beta)


def test_controller_entries_restore_their_own_keys_and_refuse_others():
    obj = ListwiseMaxEnt(tau=0.5, beta=0.1)
    tau, beta = TauController(1.0), BetaController(0.02)
    attach(obj, tau, beta)
    tau.load_state_dict({"steps": 4, "tau_entropy_ema": 1.1})
    beta.load_state_dict({"steps": 4, "kl_error": 0.2})
    assert tau.state_dict() == {"steps": 4, "tau_entropy_ema": 1.1}
    assert beta.state_dict() == {"steps": 4, "kl_error": 0.2}
    with pytest.raises(ValueError, match=r"unknown keys \['tau', 'tau_log'\]"):
        tau.load_state_dict({"steps": 4, "tau": 9.0, "tau_log": 2.2, "tau_entropy_ema": 1.1})
    with pytest.raises(ValueError, match=r"missing keys \['tau_entropy_ema'\]"):
        tau.load_state_dict({"steps": 1, "tau": 0.5})
    with pytest.raises(ValueError, match=r"BetaController state .* unknown keys \['bogus'\]"):
        beta.load_state_dict({"steps": 1, "kl_error": None, "bogus": 1})


def test_controllers_are_chosen_by_what_the_objective_lets_them_move():
    class OnlyTau(GRPO):  # a GRPO whose beta is fixed and whose tau a controller may move
        tunable = ("tau",)
        mutable = ("beta", "tau")
        tau = 0.5

    obj = OnlyTau(beta=0.1)
    trainer, module = attach(obj, TauController(1.0, lr=0.5))
    step(trainer, module, weight_entropy=2.0)
    assert obj.tau == pytest.approx(0.5 * math.exp(-0.5), rel=1e-12) and obj.beta == 0.1
    with pytest.raises(ValueError, match=r"BetaController moves objective.beta, but "
                       r"model.objective is OnlyTau, whose tunable attributes \['tau'\]"):
        attach(OnlyTau(beta=0.1), BetaController(0.02))


def test_state_file_is_written_atomically_with_the_documented_schema(tmp_path):
    path = tmp_path / "run" / cb.STATE_FILENAME
    obj = ListwiseMaxEnt(tau=0.5, beta=0.1)
    tau = TauController(1.0, state_path="{log_dir}/" + cb.STATE_FILENAME)
    beta = BetaController(0.02, state_path=str(path))
    trainer, module = attach(obj, tau, beta, log_dir=str(tmp_path / "run"))
    step(trainer, module, weight_entropy=1.5, kl=0.03)
    for c in (tau, beta):  # both name the same file: written once, with every field
        c.on_save_checkpoint(trainer, module, {})
    state = json.loads(path.read_text())
    assert state.pop("tau_log") == pytest.approx(math.log(obj.tau), rel=1e-12)
    assert state == {
        "beta": obj.beta, "tau": obj.tau, "tau_entropy_ema": 1.5,
        "meta": {"tau_steps": 1, "beta_steps": 1, "kl_error": 0.2},
    }
    assert read_controller_state(path)["meta"] == state["meta"]
    assert os.listdir(path.parent) == [cb.STATE_FILENAME]  # no temporary file left


def test_the_state_file_has_no_beta_for_an_objective_without_one(tmp_path):
    path = tmp_path / "state.json"
    obj = GroupMaxEnt(tau=1.0)
    tau = TauController(1.0, state_path=str(path))
    trainer, module = attach(obj, tau)
    step(trainer, module, weight_entropy=0.5)
    tau.on_train_end(trainer, module)
    state = read_controller_state(path)
    assert state["beta"] is None and state["tau"] == obj.tau
    assert state["meta"] == {"tau_steps": 1}


def test_an_interrupted_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    write_controller_state(path, {"a": 1})

    def broken_fsync(fd):  # the new bytes are written, not yet on disk
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_io.os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        write_controller_state(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["state.json"]


GOOD = {"beta": 0.1, "tau": 0.4, "tau_log": math.log(0.4), "tau_entropy_ema": 1.3,
        "meta": {"tau_steps": 7, "beta_steps": 7, "kl_error": -0.1}}


def test_resume_from_a_state_file(tmp_path):
    path = tmp_path / "state.json"
    write_controller_state(path, GOOD)
    obj = ListwiseMaxEnt(tau=0.5, beta=0.05)  # the config's values...
    tau = TauController(1.0, resume_from=str(path))
    beta = BetaController(0.02, resume_from=str(path))
    attach(obj, tau, beta)
    assert (obj.tau, obj.beta) == (0.4, 0.1)  # ... are replaced by the file's
    assert tau.tau_entropy_ema == 1.3 and tau.steps == 7 and beta.steps == 7
    assert beta.kl_error == -0.1


def test_a_state_file_start_is_checked_like_the_config(tmp_path):
    path = tmp_path / "state.json"
    write_controller_state(path, {**GOOD, "beta": 0.0, "tau": 20.0, "tau_log": math.log(20.0)})
    with pytest.raises(ValueError, match=r"beta is 0 in controller state file .*never raise"):
        attach(ListwiseMaxEnt(tau=0.5, beta=0.05), BetaController(0.02, resume_from=str(path)))
    with pytest.raises(ValueError, match=r"tau = 20.0 in controller state file .* outside"):
        attach(ListwiseMaxEnt(tau=0.5), TauController(1.0, resume_from=str(path)))
    # a config beta of 0 is fine when the file starts it above 0
    obj = ListwiseMaxEnt(tau=0.5)
    write_controller_state(path, GOOD)
    attach(obj, BetaController(0.02, resume_from=str(path)))
    assert obj.beta == 0.1


@pytest.mark.parametrize(
    "text, match",
    [
        (json.dumps(GOOD)[:40], r"not valid JSON \(truncated or corrupt"),
        ("\x00\x01garbage", "not valid JSON"),
        ("[1, 2]", "must hold a JSON object"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "tau_log"}), "no key 'tau_log'"),
        (json.dumps({**GOOD, "tau": "0.4"}), "'tau' must be a finite number or null"),
        (json.dumps({**GOOD, "tau": None}), "'tau' must be a finite number; got None"),
        (json.dumps({**GOOD, "meta": {}}), "no key 'meta.tau_steps'"),
        # in range too: these were taken, and failed later without naming the file
        (json.dumps({**GOOD, "tau": -0.4}), "'tau' must be > 0; got -0.4"),
        (json.dumps({**GOOD, "meta": {**GOOD["meta"], "tau_steps": 2.9}}),
         r"'meta.tau_steps' must be a whole number from 0 to 2\*\*53; got 2.9"),
        (json.dumps({**GOOD, "meta": {**GOOD["meta"], "tau_steps": 1e30}}),
         r"'meta.tau_steps' must be a whole number from 0 to 2\*\*53; got 1e\+30"),
        (json.dumps({**GOOD, "meta": {**GOOD["meta"], "tau_steps": 10**400}}),
         "'meta.tau_steps' must be a finite number"),  # isfinite overflowed: OverflowError
    ],
)
def test_a_bad_state_file_names_the_file_and_key(tmp_path, text, match):
    path = tmp_path / "state.json"
    path.write_text(text)
    obj = ListwiseMaxEnt(tau=0.5, beta=0.05)
    with pytest.raises(ValueError, match=match) as err:
        attach(obj, TauController(1.0, resume_from=str(path)))
    assert str(path) in str(err.value)
    assert obj.tau == 0.5  # nothing applied
    with pytest.raises(FileNotFoundError, match="not found"):
        attach(obj, TauController(1.0, resume_from=str(tmp_path / "missing.json")))
    with pytest.raises(ValueError, match="is a folder; name the controller_state.json file"):
        attach(obj, TauController(1.0, resume_from=str(tmp_path)))


def test_a_negative_beta_in_a_state_file_names_the_file(tmp_path):
    path = tmp_path / "state.json"
    write_controller_state(path, {**GOOD, "beta": -0.45})
    with pytest.raises(ValueError, match=r"state.json': 'beta' must be >= 0; got -0.45"):
        attach(ListwiseMaxEnt(tau=0.5, beta=0.05), BetaController(0.02, resume_from=str(path)))


def test_a_state_path_that_cannot_be_written_fails_before_training(tmp_path):
    """It failed at the first checkpoint save, after training, and no checkpoint was kept."""
    (tmp_path / "afile").write_text("x")
    for where in (tmp_path / "afile" / "state.json", tmp_path):  # under a file; a folder
        c = TauController(1.0, state_path=str(where))
        trainer, module = attach(ListwiseMaxEnt(tau=0.5), c)
        with pytest.raises(ValueError, match="TauController.state_path .* cannot be written"):
            c.on_fit_start(trainer, module)


def test_overwrite_existing(tmp_path):
    path = tmp_path / "state.json"
    write_controller_state(path, GOOD)

    def start(**kw):
        c = TauController(1.0, state_path=str(path), **kw.pop("args", {}))
        trainer, module = attach(ListwiseMaxEnt(tau=0.5), c, **kw)
        c.on_fit_start(trainer, module)  # FSDP2, DeepSpeed: the checkpoint is not known yet
        c.on_train_start(trainer, module)  # after every strategy's restore

    with pytest.raises(ValueError, match="already exists.*overwrite_existing: true"):
        start()
    start(args={"overwrite_existing": True})
    start(ckpt_path="last.ckpt")  # a resumed run continues its own file
    start(args={"resume_from": str(path)})  # so does one resuming from this very file
    # FSDP2 and DeepSpeed restore after on_fit_start: their resumes were refused there
    c = TauController(1.0, state_path=str(path))
    trainer, module = attach(ListwiseMaxEnt(tau=0.5), c)
    c.on_fit_start(trainer, module)
    trainer.ckpt_path = "last.ckpt"  # the restore after the strategy's setup
    c.on_train_start(trainer, module)
    # a file only another rank's machine holds: every rank refuses (one alone would hang)
    elsewhere = TauController(1.0, state_path=str(tmp_path / "not_here.json"))
    trainer, module = attach(ListwiseMaxEnt(tau=0.5), elsewhere)
    trainer.strategy = SimpleNamespace(reduce_boolean_decision=lambda ok, all=True: not all)
    with pytest.raises(ValueError, match="already exists"):
        elsewhere.on_sanity_check_start(trainer, module)  # before the sanity check's batches


# ---------------------------------------------------------------------- export


ONE_RANK = SimpleNamespace(reduce_boolean_decision=lambda ok, all=True: ok)


class Saver:
    def __init__(self, name: str = "weights") -> None:
        self.saved: list[Path] = []
        self.name = name

    def state_dict(self, keep_vars: bool = False) -> dict:  # as a module's
        return {}  # no shards to gather

    def save_pretrained(self, path, state_dict=None) -> None:
        self.saved.append(Path(path))
        (Path(path) / self.name).write_text("x")


def test_hf_export_every_n_steps_and_at_the_end(tmp_path):
    export = HFExport(every_n_train_steps=4)
    trainer = SimpleNamespace(log_dir=str(tmp_path), default_root_dir=None, global_step=0,
                              is_global_zero=True, strategy=ONE_RANK)
    module = SimpleNamespace(runtime=SimpleNamespace(model=Saver(), tokenizer=Saver()))
    export.setup(trainer, module, "fit")
    assert export.dirpath == str(tmp_path / "hf")
    export.on_train_start(trainer, module)
    for global_step in (2, 4, 6, 9, 10, 12):  # e.g. two optimizer steps per rollout
        trainer.global_step = global_step
        export.on_train_batch_end(trainer, module, None, None, 0)
    export.on_train_end(trainer, module)
    assert len(module.runtime.model.saved) == 4
    assert module.runtime.tokenizer.saved == module.runtime.model.saved
    # written beside, then moved in whole: only the four exports are left
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "final", "step-12", "step-4", "step-9"]


def exported_into(log_dir: Path) -> tuple[Any, Any, HFExport]:
    """An HFExport of two Savers into ``<log_dir>/hf/final``, at the end of training."""
    trainer = SimpleNamespace(log_dir=str(log_dir), default_root_dir=None, global_step=0,
                              is_global_zero=True, strategy=ONE_RANK)
    module = SimpleNamespace(runtime=SimpleNamespace(model=Saver(), tokenizer=Saver("tok")))
    export = HFExport()
    export.setup(trainer, module, "fit")
    export.on_train_end(trainer, module)
    return trainer, module, export


def test_hf_export_replaces_an_earlier_export_whole(tmp_path):
    """A second run exporting into the same folder wrote over the first, whose files this
    export lacks (a LoRA run's adapter beside a full model) stayed, and the folder loaded
    as the first run's model."""
    final = tmp_path / "hf" / "final"
    final.mkdir(parents=True)
    (final / "adapter_config.json").write_text("{}")  # the earlier run's adapter
    trainer, module, export = exported_into(tmp_path)
    assert sorted(p.name for p in final.iterdir()) == ["tok", "weights"]
    assert sorted(p.name for p in final.parent.iterdir()) == ["final"]

    class Full(Saver):
        def save_pretrained(self, path, state_dict=None) -> None:
            raise OSError(28, "No space left on device")

    module.runtime.model = Full()  # a failed write keeps the earlier export, leaves nothing
    with pytest.raises(OSError, match="(?i)no space left"):
        export.on_train_end(trainer, module)
    assert sorted(p.name for p in final.iterdir()) == ["tok", "weights"]
    assert sorted(p.name for p in final.parent.iterdir()) == ["final"]


def killed_export(folder: Path) -> None:
    """``folder`` as an export killed midway leaves it: marked as ``_writing`` marks it (a
    process that locks the mark, then dies), its writer gone."""
    import subprocess
    import sys

    from maxent_grpo.training.callbacks.export import WRITING

    code = ("import fcntl, os, sys; p = sys.argv[1]; os.makedirs(p); "
            "fd = os.open(os.path.join(p, sys.argv[2] + '.new'), os.O_CREAT | os.O_RDWR); "
            "fcntl.flock(fd, fcntl.LOCK_EX); "
            "os.replace(os.path.join(p, sys.argv[2] + '.new'), os.path.join(p, sys.argv[2])); "
            "open(os.path.join(p, 'model.safetensors'), 'w').write('half'); os._exit(9)")
    subprocess.run([sys.executable, "-S", "-c", code, str(folder), WRITING], check=False)
    assert (folder / "model.safetensors").is_file() and (folder / WRITING).is_file()


def test_hf_export_removes_what_a_killed_export_left(tmp_path):
    """A ``kill -9`` in an export's write left its hidden folder, a model's size, that no
    later export removed (it cleared its own process's only; a long-runs hunt). Those
    whose writer is gone are removed (any export's in the folder); one still being
    written, and a folder of the user's that only looks like one, stay (a reader)."""
    from maxent_grpo.training.callbacks.export import _writing

    hf, here = tmp_path / "hf", socket.gethostname()
    for name in (f".final.partial-{here}-1", f".step-3.partial-{here}-2", ".step-2.partial-b-2"):
        killed_export(hf / name)
    for path in [hf / ".step-2.partial-b-2", *(hf / ".step-2.partial-b-2").iterdir()]:
        os.utime(path, (0, time.time() - 2 * 24 * 3600))  # another host's, two days old
    recent = hf / ".step-1.partial-b-1"  # another host's, recent: its lock may not show here
    killed_export(recent)
    live, mine = hf / f".step-4.partial-{here}-3", hf / f".config.partial-{here}-20240101"
    for folder in (live, mine):
        folder.mkdir(parents=True)
        (folder / "notes").write_text("x")
    with _writing(live):  # another process writes there now
        exported_into(tmp_path)
    assert sorted(p.name for p in hf.iterdir()) == sorted(
        ["final", live.name, mine.name, recent.name])


def test_hf_export_into_a_new_or_empty_folder_leaves_nothing_when_it_fails(tmp_path):
    """A first export was written in place: a failed or interrupted write left a folder that
    loaded as a broken model. An empty folder given for it is filled."""
    trainer, module, export = exported_into(tmp_path)  # an export that works, to reuse
    final = tmp_path / "hf" / "final"
    shutil.rmtree(final)

    class Interrupted(Saver):
        def save_pretrained(self, path, state_dict=None) -> None:
            raise KeyboardInterrupt

    module.runtime.tokenizer = Interrupted("tok")  # the weights are written first
    with pytest.raises(KeyboardInterrupt):
        export.on_train_end(trainer, module)
    assert list((tmp_path / "hf").iterdir()) == []
    final.mkdir()
    module.runtime.tokenizer = Saver("tok")
    export.on_train_end(trainer, module)
    assert sorted(p.name for p in final.iterdir()) == ["tok", "weights"]
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["final"]


@pytest.mark.parametrize("earlier", [False, True])
def test_hf_export_into_a_mount_point_is_written_inside_it(tmp_path, monkeypatch, earlier):
    """A mount point cannot be renamed onto nor away: written beside, the export failed
    after the whole write (a fresh volume holds lost+found, a second export an earlier one;
    two readers). It is written inside, then swapped with what the folder held (not
    lost+found); a failed write keeps the earlier export."""
    final = tmp_path / "hf" / "final"
    (final / "lost+found").mkdir(parents=True)
    if earlier:
        (final / "adapter_config.json").write_text("{}")  # an earlier run's adapter
    monkeypatch.setattr(os.path, "ismount", lambda path: Path(path) == final)
    trainer, module, export = exported_into(tmp_path)
    assert sorted(p.name for p in final.iterdir()) == ["lost+found", "tok", "weights"]
    assert [p.name for p in final.parent.iterdir()] == ["final"]

    class Full(Saver):
        def save_pretrained(self, path, state_dict=None) -> None:
            super().save_pretrained(path)
            raise OSError(28, "No space left on device")

    module.runtime.tokenizer = Full("tok2")
    killed_export(final / f".partial-{socket.gethostname()}-1")  # gone though this one fails
    with pytest.raises(OSError, match="(?i)no space left"):
        export.on_train_end(trainer, module)
    assert sorted(p.name for p in final.iterdir()) == ["lost+found", "tok", "weights"]


def test_hf_export_into_a_bind_mount_moves_its_files_in(tmp_path, monkeypatch):
    """A bind mount is no mount point to ``os.path.ismount`` but cannot be renamed (EBUSY):
    the files written beside are moved into it."""
    import errno

    from maxent_grpo.training.callbacks import export as export_module

    final = tmp_path / "hf" / "final"
    final.mkdir(parents=True)
    (final / "adapter_config.json").write_text("{}")
    rename = os.replace

    def busy(src, dst):
        if Path(src) == final or Path(dst) == final:
            raise OSError(errno.EBUSY, "Device or resource busy")
        rename(src, dst)

    monkeypatch.setattr(export_module.os, "replace", busy)
    exported_into(tmp_path)
    assert sorted(p.name for p in final.iterdir()) == ["tok", "weights"]
    assert [p.name for p in final.parent.iterdir()] == ["final"]


def test_hf_export_into_a_linked_folder_replaces_the_folder_not_the_link(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "adapter_config.json").write_text("{}")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "final").symlink_to(real)
    trainer, module, export = exported_into(tmp_path)
    assert (tmp_path / "hf" / "final").is_symlink()
    assert sorted(p.name for p in real.iterdir()) == ["tok", "weights"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "real"]


def test_hf_export_that_cannot_write_fails_before_training(tmp_path):
    """It failed at the end of training, which also lost the last checkpoint's save."""
    (tmp_path / "afile").write_text("x")
    trainer = SimpleNamespace(log_dir=None, default_root_dir=str(tmp_path), is_global_zero=True,
                              strategy=ONE_RANK)
    with pytest.raises(ValueError, match="HFExport.dirpath .*afile/hf' cannot be a folder to "
                                         "export into: .*afile' is not a folder"):
        HFExport(dirpath=str(tmp_path / "afile" / "hf")).setup(trainer, None, "fit")


def test_hf_export_writes_a_loadable_model(tmp_path, capfd):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from maxent_grpo.models import load_policy, load_tokenizer

    cache = str(tmp_path / "models")
    module = SimpleNamespace(runtime=SimpleNamespace(
        model=load_policy("builtin:tiny", cache_dir=cache),
        tokenizer=load_tokenizer("builtin:tiny", cache_dir=cache),
    ))
    trainer = SimpleNamespace(is_global_zero=True)
    capfd.readouterr()
    out = HFExport(dirpath=str(tmp_path / "export")).export(trainer, module, "final")
    assert "Writing model shards" not in capfd.readouterr().err  # broke the fit's bar
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("1+1")["input_ids"] == module.runtime.tokenizer("1+1")["input_ids"]
    for (name, p), (_, q) in zip(
        model.named_parameters(), module.runtime.model.named_parameters(), strict=True
    ):
        assert (p == q).all(), name


def test_a_controller_state_has_steps_first_whatever_its_file_fields_order():
    """``load_state_dict`` restores ``steps`` as an int and the rest after it: a controller
    that lists ``steps`` after its own field still round-trips."""

    class Smoothed(cb.Controller):
        file_fields = {"ema": "smoothed.ema", "steps": "smoothed.steps"}  # noqa: RUF012

        def __init__(self, *args) -> None:
            super().__init__(*args)
            self.ema = 0.0

    saved = Smoothed(None, None, False)
    saved.steps, saved.ema = 3, 0.5
    assert list(saved.state_dict()) == ["steps", "ema"]
    restored = Smoothed(None, None, False)
    restored.load_state_dict(saved.state_dict())
    assert (restored.steps, restored.ema) == (3, 0.5) and isinstance(restored.steps, int)


def test_a_controller_of_ones_own_resumes_what_it_moves_from_its_state_file(tmp_path):
    """The state file held tau and beta only, so a controller moving another ``tunable``
    attribute wrote a file it could not read back ("has no key 'alpha'"; a second reader of
    docs/ARCHITECTURE.md's recipe)."""

    class Weighted(GRPO):
        tunable = ("beta", "alpha")
        mutable = ("beta", "alpha")

        def __init__(self, alpha: float = 1.0, **grpo) -> None:
            super().__init__(**grpo)
            self.alpha = alpha

    class AlphaController(cb.Controller):
        moves = ("alpha",)
        file_fields = {"steps": "meta.alpha_steps"}  # noqa: RUF012

        def __init__(self, resume_from: str | None = None) -> None:
            super().__init__(None, resume_from, False)

        def _check_start(self, objective, origin, pl_module) -> None:
            pass

        def _update(self, objective, stats):
            objective.alpha = -0.5 * stats["train/reward"]  # may be negative: no beta
            return {}

    objective, controller = Weighted(beta=0.0), AlphaController()
    trainer, module = attach(objective, controller)
    step(trainer, module, reward=0.6)
    path = tmp_path / "state.json"
    write_controller_state(path, build_snapshot(objective, [controller]))
    resumed, again = Weighted(beta=0.0), AlphaController(resume_from=str(path))
    attach(resumed, again)
    assert (resumed.alpha, again.steps) == (objective.alpha, 1) and objective.alpha != 1.0

"""A checkpoint records the tau/beta controllers that moved its objective
(``LoopSettings.controller`` and ``controller_meta_manager``), and a fit resumed without
them is warned about; validating or testing the checkpoint is not. It records its adapters
too, and a run whose ``model.peft`` its weights do not fit is refused, naming it."""

from __future__ import annotations

import dataclasses
import math
import warnings

import lightning.pytorch as pl
import pytest
import torch

from maxent_grpo.objectives import ListwiseMaxEnt
from maxent_grpo.training.callbacks import MetaController
from maxent_grpo.training.run.checkpoint import load_state, save_state
from maxent_grpo.training.step.optimise import StepCounters
from maxent_grpo.training.types import (
    BatchingSettings,
    ControllerPaths,
    LoopSettings,
    OptimizationSettings,
)

BARE = LoopSettings(None, None, OptimizationSettings(None, None), BatchingSettings(None, None),
                    ControllerPaths(None, None))


def saved(loop: LoopSettings) -> dict:
    checkpoint: dict = {}
    save_state(checkpoint, "builtin:tiny", ListwiseMaxEnt(tau=0.5, beta=0.1), StepCounters(),
               loop)
    return checkpoint


def resumed(checkpoint: dict, loop: LoopSettings, fitting: bool) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_state(checkpoint, "builtin:tiny", ListwiseMaxEnt(tau=0.5, beta=0.1),
                   StepCounters(), loop, fitting=fitting)
    return [str(w.message) for w in caught if "controllers" in str(w.message)]


def test_a_fit_resumed_without_the_controllers_is_warned():
    objective = ListwiseMaxEnt(tau=0.5, beta=0.1)
    meta = MetaController(target_entropy=1.0, kl_target=0.05, state_path="c.json")
    loop = BARE.with_controller(meta.paths, objective, meta)
    checkpoint = saved(loop)
    assert checkpoint["maxent_grpo"]["controllers"] == {
        "state_path": "c.json", "attached": True, "meta_manager": "MetaController"}
    (message,) = resumed(checkpoint, BARE, fitting=True)
    assert "MetaController" in message and "'c.json'" in message
    assert resumed(checkpoint, loop, fitting=True) == []  # the same controllers: quiet
    assert resumed(checkpoint, BARE, fitting=False) == []  # validate / test: quiet


@pytest.mark.parametrize("loop", [BARE, None])
def test_a_checkpoint_without_controllers_resumes_quietly(loop):
    checkpoint = saved(BARE)
    assert checkpoint["maxent_grpo"]["controllers"]["attached"] is False
    assert resumed(checkpoint, loop, fitting=True) == []


def lora(**options):
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", **{"r": 4, "target_modules": ["q_proj"], **options})


def loaded(saved_peft, peft) -> None:
    checkpoint: dict = {}
    save_state(checkpoint, "builtin:tiny", ListwiseMaxEnt(tau=0.5), StepCounters(), BARE,
               peft=saved_peft)
    load_state(checkpoint, "builtin:tiny", ListwiseMaxEnt(tau=0.5), StepCounters(), BARE,
               peft=peft)


@pytest.mark.parametrize(("saved_peft", "now", "match"), [
    (lora(), None, "made with model.peft adapters and this run is without them, .* use the "
                   r"model.peft it was trained with: \{class_path: peft.LoraConfig, init_args: "
                   r'\{r: 4, target_modules: \["q_proj"\], lora_alpha: 8, bias: "none"\}\}'),
    (lora(layers_to_transform=0), None, "init_args: .*layers_to_transform: 0"),  # 0 is set
    (None, lora(), "made without model.peft adapters and this run is with them"),
    (lora(), lora(r=8), "r: 4 in the checkpoint, 8 now"),
    (lora(), lora(target_modules=["q_proj", "v_proj"]), "target_modules"),
    (lora(), lora(layers_to_transform=[0]), "layers_to_transform: None in the checkpoint"),
    (lora(), lora(exclude_modules=["k_proj"]), "exclude_modules"),
    # the same weights, scaled otherwise: a silently different model (a defect hunt)
    (lora(), lora(lora_alpha=32), "lora_alpha: 8 in the checkpoint, 32 now"),
    (lora(), lora(use_rslora=True), "use_rslora"),
], ids=["adapters-dropped", "layer-0-dropped", "adapters-added", "rank", "targets", "layers",
        "excluded", "alpha", "rslora"])
def test_a_checkpoint_whose_adapters_do_not_fit_the_run_is_refused(saved_peft, now, match):
    """Before, the weights' load failed with Lightning's missing and unexpected keys."""
    with pytest.raises(ValueError, match=match):
        loaded(saved_peft, now)


def test_adapter_options_that_keep_the_weights_resume():
    loaded(lora(), lora(lora_dropout=0.1, bias="all"))  # no error
    loaded(lora(target_modules=["q_proj", "v_proj"]), lora(target_modules=["v_proj", "q_proj"]))
    loaded(None, None)


def test_a_local_model_folder_is_the_same_model_however_it_is_written(tmp_path, monkeypatch):
    """``../m/``, ``../m`` and the absolute path name one folder; another folder is still
    refused, and so is a hub name that only shares the text."""
    (tmp_path / "m").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    checkpoint: dict = {}
    save_state(checkpoint, "../m/", ListwiseMaxEnt(tau=0.5), StepCounters(), BARE)
    for same in ("../m", str(tmp_path / "m")):
        load_state(checkpoint, same, ListwiseMaxEnt(tau=0.5), StepCounters(), BARE)
    monkeypatch.chdir(tmp_path)  # from another working folder, by its absolute path
    load_state(checkpoint, str(tmp_path / "m"), ListwiseMaxEnt(tau=0.5), StepCounters(), BARE)
    monkeypatch.setenv("HOME", str(tmp_path))  # ~ as the model loader expands it
    load_state(checkpoint, "~/m", ListwiseMaxEnt(tau=0.5), StepCounters(), BARE)
    for other in (str(tmp_path / "other"), "Qwen/Qwen2.5-0.5B"):
        with pytest.raises(ValueError, match="made with model.model_name_or_path='../m/'"):
            load_state(checkpoint, other, ListwiseMaxEnt(tau=0.5), StepCounters(), BARE)


def test_a_model_folder_that_moved_is_the_same_model_by_its_files(tmp_path, monkeypatch):
    """A run's model folder moved (or another machine's mount point) was refused as another
    model at every resume, validate and predict, with no way through; its files are
    recorded: the same config and weights pass (said), others do not."""
    import shutil

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "a" / "model.safetensors").write_bytes(bytes(range(256)) * 20_000)  # 5 MB
    checkpoint: dict = {}
    save_state(checkpoint, "a", ListwiseMaxEnt(tau=0.5), StepCounters(), BARE)
    shutil.move(tmp_path / "a", tmp_path / "b")
    with pytest.warns(UserWarning, match=r"model folder .*/a is b now \(the same config"):
        load_state(checkpoint, "b", ListwiseMaxEnt(tau=0.5), StepCounters(), BARE)
    weights = bytearray((tmp_path / "b" / "model.safetensors").read_bytes())
    weights[-10] ^= 1  # the weights' last MiB, other weights
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    (tmp_path / "c" / "model.safetensors").write_bytes(bytes(weights))
    shutil.copytree(tmp_path / "b", tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text('{"model_type": "qwen2"}')
    weights[-10] ^= 1
    weights[len(weights) // 2] ^= 1  # the middle (read in blocks spread over the file)
    shutil.copytree(tmp_path / "b", tmp_path / "e")
    (tmp_path / "e" / "model.safetensors").write_bytes(bytes(weights))
    for other in ("c", "d", "e"):
        with pytest.raises(ValueError, match="made with model.model_name_or_path='a', but"):
            load_state(checkpoint, other, ListwiseMaxEnt(tau=0.5), StepCounters(), BARE)
    del checkpoint["maxent_grpo"]["model_fingerprint"]  # a checkpoint from before the record
    with pytest.raises(ValueError, match="predates the record of a folder's files.*a link"):
        load_state(checkpoint, "b", ListwiseMaxEnt(tau=0.5), StepCounters(), BARE)


def test_a_step_cut_short_saves_its_starting_random_state_and_warns_after_an_update():
    """A checkpoint written while an exception stops a step: the random state of the
    step's start is saved (Lightning runs the step again); if the step had already updated
    the weights, the resume trains that batch twice, and the save says so."""
    import torch

    from maxent_grpo.training.run.checkpoint import step_start

    torch.manual_seed(3)
    start = step_start(None, type("Trainer", (), {"global_step": 7})())
    torch.rand(5)  # the step's sampling
    for global_step, warned in ((7, False), (8, True)):
        checkpoint: dict = {"global_step": global_step}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            save_state(checkpoint, "builtin:tiny", ListwiseMaxEnt(tau=0.5), StepCounters(),
                       BARE, cut_short=start)
        assert any("trains that batch again" in str(w.message) for w in caught) is warned
        (rng,) = checkpoint["maxent_grpo"]["rng"]
        assert torch.equal(rng["torch"], start["rng"]["torch"])


def warnings_of(call) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught]


def test_a_changed_objective_option_is_used_on_a_resume_without_controllers(caplog):
    """``--model.objective.init_args.beta 0.2`` on a resume kept the checkpoint's 0.04
    without a word (the run's config.yaml said 0.2); ``beta 0`` logged 0.04 while no
    reference model was loaded, so no KL was trained (a defect hunt)."""
    checkpoint = saved(BARE)  # tau 0.5, beta 0.1
    objective = ListwiseMaxEnt(tau=2.0, beta=0.1)
    (message,) = warnings_of(lambda: load_state(checkpoint, "builtin:tiny", objective,
                                                StepCounters(), BARE, fitting=True))
    assert "model.objective differs from the checkpoint's (tau 0.5 -> 2)" in message
    assert (objective.tau, objective.beta) == (2.0, 0.1)
    # with tau/beta controllers the values are theirs: the checkpoint's go on
    meta = MetaController(target_entropy=1.0, kl_target=0.05, state_path="c.json")
    objective = ListwiseMaxEnt(tau=2.0, beta=0.1)
    loop = BARE.with_controller(meta.paths, objective, meta)
    with caplog.at_level("INFO"):
        load_state(saved(loop), "builtin:tiny", objective, StepCounters(), loop, fitting=True)
    assert objective.tau == 0.5
    assert "model.objective's tau 2 (the config) not used: tau/beta controllers are attached, " \
        "so the checkpoint's values go on (tau 0.5)" in caplog.text  # it went without a word


def test_a_changed_optimizer_is_refused_and_changed_values_are_warned_of():
    """Another optimizer class crashed at the first step ("KeyError: 'momentum' ... a bug");
    a changed lr or weight decay was not used, without a word."""
    import torch

    param = torch.nn.Parameter(torch.zeros(2))
    adamw = torch.optim.AdamW([param], lr=1e-3)
    torch.optim.lr_scheduler.LinearLR(adamw, start_factor=0.5)  # lr != initial_lr now
    checkpoint = saved(BARE) | {"optimizer_states": [adamw.state_dict()]}

    def resume(factory):
        return warnings_of(lambda: load_state(
            checkpoint, "builtin:tiny", ListwiseMaxEnt(tau=0.5, beta=0.1), StepCounters(),
            BARE, fitting=True, optimizer=factory))

    assert not [m for m in resume(lambda p: torch.optim.AdamW(p, lr=1e-3)) if "optim" in m]
    (message,) = [m for m in resume(lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1))
                  if "optimizer" in m]
    assert "(lr 0.001 -> 0.01, weight_decay 0.01 -> 0.1)" in message
    assert "the config's values are not used" in message
    with pytest.raises(ValueError, match="model.optimizer takes other settings .* another "
                                         "optimizer cannot resume its state"):
        resume(lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))


def test_a_resume_with_a_schedule_of_other_schedulers_is_refused():
    """The checkpoint's learning-rate schedule is loaded into the one this run builds: with
    a warm-up added it crashed (``KeyError: '_schedulers'``, "a bug"); with the warm-up or
    a StepLR removed the rate stayed where it was for the rest of the run, without a word
    (a hunt of configurations)."""
    import torch

    from maxent_grpo.training.settings import ScheduleSettings, build_lr_scheduler
    from maxent_grpo.training.types import OptimizationSettings

    def loop(warmup):
        return dataclasses.replace(BARE, optimization=OptimizationSettings(
            ScheduleSettings(1, 1.0, warmup, 3), None))

    def step_lr(optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    def checkpoint(warmup, factory=None):
        adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
        scheduler = build_lr_scheduler(adamw, loop(warmup).optimization.schedule, factory)
        return saved(BARE) | {"lr_schedulers": [scheduler.state_dict()]}

    def resume(saved_state, warmup, factory=None):
        load_state(saved_state, "builtin:tiny", ListwiseMaxEnt(tau=0.5, beta=0.1),
                   StepCounters(), loop(warmup), fitting=True, scheduler=factory)

    resume(checkpoint(4), 4)
    resume(checkpoint(0, step_lr), 0, step_lr)
    older = checkpoint(4)  # as torch before 2.7 wrote it (a reader: a same-config resume
    state = older["lr_schedulers"][0]  # across a torch upgrade was refused)
    for part in (state, *state["_schedulers"]):
        part["verbose"] = False
        part.pop("_is_initial", None)
    resume(older, 4)
    refused = "the checkpoint's learning-rate schedule is built of other schedulers"
    for saved_state, warmup, factory in ((checkpoint(0), 4, None), (checkpoint(4), 0, None),
                                         (checkpoint(0, step_lr), 0, None)):
        with pytest.raises(ValueError, match=refused):
            resume(saved_state, warmup, factory)
    # the same schedulers, another warm-up: the checkpoint's 4 steps went on while the
    # config's 10 were logged as train/lr_warmup and saved in config.yaml (a DDP hunt)
    def chained(optimizer):  # a model.lr_scheduler that is itself a SequentialLR
        return torch.optim.lr_scheduler.SequentialLR(optimizer, [step_lr(optimizer)], [])

    resume(checkpoint(0, chained), 0, chained)  # its own milestones are not a warm-up
    with pytest.raises(ValueError, match=r"the checkpoint's learning-rate warm-up is 4 steps, "
                       r"this run's model.lr_warmup_steps 10: .* resume with "
                       r"model.lr_warmup_steps 4, or start afresh"):
        resume(checkpoint(4), 10)


def test_state_the_run_moved_itself_is_kept_on_a_resume():
    """A same-config resume reset EntropyMaxEnt's gate (``alpha_multiplier``, which it moves
    itself) and tau/beta that controllers had moved, when the config's values were taken
    for a change (a second reader: the resume was no longer bit-identical)."""
    from maxent_grpo.objectives import EntropyMaxEnt

    gated = EntropyMaxEnt(alpha=0.1, beta=0.05, kl_gate_threshold=1e-6)
    gated.alpha_multiplier = 0.25
    checkpoint: dict = {}
    save_state(checkpoint, "builtin:tiny", gated, StepCounters(), BARE)
    fresh = EntropyMaxEnt(alpha=0.1, beta=0.05, kl_gate_threshold=1e-6)
    assert warnings_of(lambda: load_state(checkpoint, "builtin:tiny", fresh, StepCounters(),
                                          BARE, fitting=True)) == []
    assert fresh.alpha_multiplier == 0.25
    meta = MetaController(target_entropy=1.0, kl_target=0.05, state_path="c.json")
    moved = ListwiseMaxEnt(tau=0.31, beta=0.07)  # where the controllers took tau and beta
    checkpoint = {}
    save_state(checkpoint, "builtin:tiny", moved, StepCounters(),
               BARE.with_controller(meta.paths, moved, meta))
    resumed_without = ListwiseMaxEnt(tau=0.5, beta=0.1)
    load_state(checkpoint, "builtin:tiny", resumed_without, StepCounters(), BARE,
               fitting=True)
    assert (resumed_without.tau, resumed_without.beta) == (0.31, 0.07)  # as warned


def test_a_kept_beta_that_needs_a_reference_this_run_lacks_is_refused():
    """With a TauController the checkpoint's beta 0.1 went on while the config's beta 0
    had loaded no reference model: beta logged, no KL trained. A MetaController, which
    raises beta from 0, has the reference loaded: its run resumes (a second reader)."""
    from maxent_grpo.training.callbacks import TauController

    objective = ListwiseMaxEnt(tau=0.5, beta=0.0)
    tau = TauController(target_entropy=1.0)
    loop = BARE.with_controller(tau.paths, objective, None)
    with pytest.raises(ValueError, match="beta 0.1 goes on .* loaded no reference model"):
        load_state(saved(loop), "builtin:tiny", objective, StepCounters(), loop, fitting=True,
                   reference=False)
    load_state(saved(loop), "builtin:tiny", objective, StepCounters(), loop, fitting=True,
               reference=True)
    assert objective.beta == 0.1


@pytest.mark.parametrize("schedule", ["one_cycle", "cyclic", "cyclic_no_momentum"])
def test_schedules_that_write_the_optimizer_give_no_warning_on_a_same_config_resume(schedule):
    import torch

    param = torch.nn.Parameter(torch.zeros(2))
    adamw = torch.optim.AdamW([param], lr=1e-3)
    sched = torch.optim.lr_scheduler
    cycle = {"one_cycle": lambda: sched.OneCycleLR(adamw, max_lr=1e-3, total_steps=10),
             "cyclic": lambda: sched.CyclicLR(adamw, base_lr=1e-4, max_lr=1e-3),
             "cyclic_no_momentum": lambda: sched.CyclicLR(adamw, base_lr=1e-4, max_lr=1e-3,
                                                         cycle_momentum=False)}[schedule]()
    for _ in range(3):
        adamw.step()
        cycle.step()
    checkpoint = saved(BARE) | {"optimizer_states": [adamw.state_dict()],
                                "lr_schedulers": [cycle.state_dict()]}
    assert not [m for m in warnings_of(lambda: load_state(
        checkpoint, "builtin:tiny", ListwiseMaxEnt(tau=0.5, beta=0.1), StepCounters(), BARE,
        fitting=True, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))) if "optim" in m]


def test_a_controller_added_at_a_resume_starts_from_the_config_and_checks_restored_values():
    """A run trained without controllers, resumed with a TauController or BetaController:
    the checkpoint's tau 0 or beta 0 went on (the config's start values were "not used"), so
    TauController stopped on ``math domain error`` after a step and BetaController never
    moved beta from 0 (a defect hunt). The config's values start them now; a restored value
    a controller cannot move (controllers moved it there) is refused after the restore."""
    from types import SimpleNamespace

    from maxent_grpo.objectives import GRPO
    from maxent_grpo.training.callbacks import BetaController

    checkpoint: dict = {}
    save_state(checkpoint, "builtin:tiny", GRPO(beta=0.0), StepCounters(), BARE)
    beta = BetaController(kl_target=0.001)
    objective = GRPO(beta=0.04)
    loop = BARE.with_controller(beta.paths, objective)
    (message,) = warnings_of(lambda: load_state(checkpoint, "builtin:tiny", objective,
                                                StepCounters(), loop, fitting=True))
    assert "model.objective differs from the checkpoint's (beta 0 -> 0.04)" in message
    assert objective.beta == 0.04
    trainer = SimpleNamespace(ckpt_path="run/last.ckpt")
    beta.on_train_start(trainer, SimpleNamespace(loop=loop))  # beta 0.04: goes on
    objective.beta = 0.0  # as a MetaController's run may leave it
    with pytest.raises(ValueError, match=r"BetaController: beta is 0 in the checkpoint "
                                         r"run/last.ckpt, whose values a resume with "
                                         r"controllers continues, and .* start afresh"):
        beta.on_train_start(trainer, SimpleNamespace(loop=loop))
    # a tau a warm-up left an ulp past its bound (exp(log 0.1)) resumes, as it did before
    from maxent_grpo.training.callbacks import TauController

    tau = TauController(target_entropy=0.5, tau_max=0.1, warmup_steps=5)
    listwise = ListwiseMaxEnt(tau=0.1, beta=0.1)
    loop = dataclasses.replace(BARE, generation=SimpleNamespace(num_generations=4))
    module = SimpleNamespace(loop=loop.with_controller(tau.paths, listwise))
    listwise.tau = math.exp(math.log(0.1))
    assert listwise.tau > 0.1
    tau.on_train_start(trainer, module)


def test_a_value_a_callback_moved_goes_on_and_one_the_config_changed_is_used():
    """A beta that a callback of one's own moved (no tau/beta controller) was put back to
    the config's at every resume, with a warning that the config differed: the checkpoint
    now records the config's start values, and only a change of the config is used."""
    checkpoint: dict = {}
    moved = ListwiseMaxEnt(tau=0.5, beta=0.1)
    moved.beta = 0.025  # a callback's schedule
    save_state(checkpoint, "builtin:tiny", moved, StepCounters(), BARE,
               start={"tau": 0.5, "beta": 0.1})
    same, other = ListwiseMaxEnt(tau=0.5, beta=0.1), ListwiseMaxEnt(tau=0.5, beta=0.2)
    assert not warnings_of(lambda: load_state(checkpoint, "builtin:tiny", same, StepCounters(),
                                              BARE, fitting=True))
    assert same.beta == 0.025
    (message,) = warnings_of(lambda: load_state(checkpoint, "builtin:tiny", other,
                                                StepCounters(), BARE, fitting=True))
    assert "model.objective differs from the checkpoint's (beta 0.025 -> 0.2)" in message
    assert other.beta == 0.2
    kept = ListwiseMaxEnt(tau=0.5, beta=0.025)  # the config set to the moved value: no word
    assert not warnings_of(lambda: load_state(checkpoint, "builtin:tiny", kept, StepCounters(),
                                              BARE, fitting=True))
    assert kept.beta == 0.025
    # moved above 0 from a config's 0, where this run loads no reference model: refused
    start_at_0: dict = {}
    save_state(start_at_0, "builtin:tiny", moved, StepCounters(), BARE,
               start={"tau": 0.5, "beta": 0.0})
    with pytest.raises(ValueError, match="beta 0.025 goes on .* loaded no reference model"):
        load_state(start_at_0, "builtin:tiny", ListwiseMaxEnt(tau=0.5, beta=0.0),
                   StepCounters(), BARE, fitting=True, reference=False)


class HalveBeta(pl.Callback):
    """A beta schedule of one's own: beta halves after every training step."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pl_module.objective.beta /= 2


def test_a_fit_resumed_with_its_config_goes_on_from_the_beta_a_callback_moved(cache_dir,
                                                                              tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from maxent_grpo.objectives import GRPO
    from tests.conftest import fit, make_data, make_module

    first = make_module(cache_dir, objective=GRPO(beta=0.08))
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    fit(first, make_data(cache_dir), steps=2, tmp_path=tmp_path, enable_checkpointing=True,
        callbacks=[saver, HalveBeta()])
    ckpt = torch.load(tmp_path / "epoch=0-step=2.ckpt", weights_only=True)["maxent_grpo"]
    assert ckpt["objective_state"]["beta"] == 0.02 and ckpt["objective_start"]["beta"] == 0.08
    resumed = make_module(cache_dir, objective=GRPO(beta=0.08))
    fit(resumed, make_data(cache_dir), steps=3, tmp_path=tmp_path, callbacks=[HalveBeta()],
        ckpt_path=str(tmp_path / "epoch=0-step=2.ckpt"))
    assert resumed.objective.beta == 0.01  # 0.02 halved once more, not 0.08 halved


def test_outside_a_fit_a_checkpoint_gives_its_weights_and_nothing_of_its_training_state():
    """validate, test, predict and load_from_checkpoint (no trainer) keep the objective's
    own options and the counters, and return no random state (a hunt of the Python API: a
    module from load_from_checkpoint trained on from the checkpoint's random state whatever
    seed was set, and with the checkpoint's beta over the objective it was given); without
    a trainer, an objective unlike the command-line run's record is warned of."""
    moved, counters = ListwiseMaxEnt(tau=0.5, beta=0.1), StepCounters(nonfinite_total=2)
    moved.beta = 0.3  # a controller's value at the save
    checkpoint: dict = {"maxent_grpo_objective": {
        "class_path": "maxent_grpo.objectives.ListwiseMaxEnt",
        "init_args": {"tau": 0.5, "beta": 0.1, "epsilon": 0.2, "epsilon_high": None}}}
    save_state(checkpoint, "builtin:tiny", moved, counters, BARE,
               start=ListwiseMaxEnt(tau=0.5, beta=0.1).state_dict())
    validating = type("T", (), {"state": type("S", (), {"fn": "validate"})()})()
    for trainer, warned in ((None, ["tau 0.7 (the run's 0.5)"]), (validating, [])):
        mine, fresh = ListwiseMaxEnt(tau=0.7, beta=0.1), StepCounters()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert load_state(checkpoint, "builtin:tiny", mine, fresh, BARE,
                              trainer=trainer) is None
        assert (mine.tau, mine.beta, fresh.nonfinite_total) == (0.7, 0.1, 0)
        messages = [str(w.message) for w in caught]
        assert [part for part in warned if any(part in m for m in messages)] == warned
        assert all("objective=ListwiseMaxEnt(...)" in m for m in messages) and (
            len(messages) == len(warned))
    with pytest.warns(UserWarning, match=r"\(epsilon_high 0.28 \(the run's 0.2\)\)"):
        load_state(checkpoint, "builtin:tiny", ListwiseMaxEnt(tau=0.5, beta=0.1, clip_coef=1.0,
                                                              epsilon_high=0.28),
                   StepCounters(), BARE)  # the run's null: its epsilon
    same, fresh = ListwiseMaxEnt(tau=0.5, beta=0.1), StepCounters()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the run's options: quiet
        assert load_state(checkpoint, "builtin:tiny", same, fresh, BARE) is None
    assert load_state(checkpoint, "builtin:tiny", same, fresh, BARE, fitting=True) is not None
    assert (same.beta, fresh.nonfinite_total) == (0.3, 2)  # a resume: the saved state

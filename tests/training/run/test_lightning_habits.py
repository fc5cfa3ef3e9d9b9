"""Lightning habits that meet this trainer's own optimisation loop.

Trainer flags that automatic optimisation honours and this trainer's optimizer step cannot
stop ``fit`` before any work with a message naming the option to use instead (Lightning's
own "switch to automatic optimization" names nothing a user here can do); the learning-rate
scheduler, stepped by our loop, is read by ``LearningRateMonitor`` at every step."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest

from tests.conftest import fit, make_data, make_module


@pytest.mark.parametrize("flags, expected", [
    ({"gradient_clip_val": 0.5}, r"--model.gradient_clip_val=0.5 \(now 1.0"),
    ({"accumulate_grad_batches": 2},
     r"--data.batch_size to 2x its value.*--model.micro_batch_groups"),
    # alone, Lightning let it pass, and the run clipped by norm at 1.0 without a word
    ({"gradient_clip_algorithm": "value"},
     r"gradient_clip_algorithm='value'\): this trainer clips the gradient by its norm"),
    # Lightning's modulo by zero at the first batch, "a bug in maxent_grpo" (a hunt)
    ({"val_check_interval": 0, "check_val_every_n_epoch": None, "limit_val_batches": 1},
     r"trainer.val_check_interval 0: validation every 0 batches"),
])
def test_trainer_flags_we_cannot_honour_name_our_option(cache_dir, tmp_path, flags, expected):
    module = make_module(cache_dir)
    with pytest.raises(ValueError, match=expected):
        fit(module, make_data(cache_dir), tmp_path=tmp_path, **flags)
    assert module.policy is None  # stopped before the model was even loaded


@pytest.mark.parametrize("kind, expected", [
    ("accumulation", r"GradientAccumulationScheduler: one training step here is one rollout.*"
                     r"--data.batch_size"),
    ("swa", r"StochasticWeightAveraging would do nothing here"),
])
def test_lightning_callbacks_we_cannot_honour_are_refused(cache_dir, tmp_path, kind, expected):
    """GradientAccumulationScheduler crashed as "a bug" (Lightning's message for manual
    optimisation); StochasticWeightAveraging ran and did nothing: its copy of the module,
    taken before ``configure_model``, had no weights, and its learning rate never reached
    the module's optimizer step (a hunt of Lightning's callbacks)."""
    from lightning.pytorch.callbacks import (
        GradientAccumulationScheduler,
        StochasticWeightAveraging,
    )

    callback = (GradientAccumulationScheduler({0: 2}) if kind == "accumulation"
                else StochasticWeightAveraging(swa_lrs=0.05))
    module = make_module(cache_dir)
    with pytest.raises(ValueError, match=expected):
        fit(module, make_data(cache_dir), tmp_path=tmp_path, callbacks=[callback])
    assert module.policy is None  # before the model loads


@pytest.mark.parametrize("steps, every, expected", [
    (3, None, r"max_steps 3 is not a multiple of model.num_iterations 2.*would run 4; "
              r"set --trainer.max_steps 4 or 2"),
    (4, 3, r"every_n_train_steps=3\).*moves by 2: it would save every 6 steps"),
])
def test_step_counts_that_num_iterations_skips_are_refused(cache_dir, tmp_path, steps, every,
                                                           expected):
    """With num_iterations 2 the optimizer-step count moves by 2: max_steps 3 ran 4 steps,
    and ModelCheckpoint(every_n_train_steps=3) saved at step 6 instead of 3."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    module = make_module(cache_dir, num_iterations=2)
    checkpoints = [ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=every,
                                   save_top_k=-1)] if every else []
    with pytest.raises(ValueError, match=expected):
        fit(module, make_data(cache_dir), steps=steps, tmp_path=tmp_path,
            callbacks=checkpoints, enable_checkpointing=bool(every))
    assert module.policy is None


def test_a_smoke_run_with_num_iterations_is_not_refused_over_checkpoints_it_never_writes(
        tmp_path):
    """``fast_dev_run`` writes no checkpoint, and a shipped config's saver every 25 steps
    refused ``--trainer.fast_dev_run 2 --model.num_iterations 2`` (a hunt)."""
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import ModelCheckpoint

    from maxent_grpo.training.step.strategy import check_step_multiples

    saver = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=25)
    check_step_multiples(SimpleNamespace(max_steps=2, fast_dev_run=2, callbacks=[saver]), 2)
    with pytest.raises(ValueError, match=r"every_n_train_steps=25\).*every 50 steps"):
        check_step_multiples(SimpleNamespace(max_steps=50, fast_dev_run=False,
                                             callbacks=[saver]), 2)


@pytest.mark.parametrize("where", ["saver", "root", "broken"])
def test_with_several_processes_rank_zero_checks_the_checkpoint_folders_for_every_rank(
        tmp_path, monkeypatch, where):
    """The checkpoint folder checks ran with one process only (before the process group, one
    rank refusing alone would leave the others waiting): on several, a folder that cannot be
    written failed at the first save, after its steps. At the setup, rank 0 (the writer)
    checks and every rank stops with its answer, marked as every rank's (nothing to save),
    also where the check itself fails (no rank left waiting in the broadcast)."""
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import ModelCheckpoint

    from maxent_grpo.training.step import strategy as strategy_module
    from maxent_grpo.training.step.strategy import check_on_rank_zero

    (tmp_path / "a_file").write_text("")
    bad = str(tmp_path / "a_file" / "x")
    shared = []

    def broadcast(value):  # rank 0's value, to every rank
        if not shared:
            shared.append(value)
        return shared[0]

    def trainer(rank: int, where: str):
        return SimpleNamespace(
            world_size=2, fast_dev_run=False, is_global_zero=rank == 0,
            strategy=SimpleNamespace(broadcast=broadcast), loggers=[],
            default_root_dir=bad if where == "root" else str(tmp_path),
            callbacks=[ModelCheckpoint(dirpath=bad if where == "saver" else (
                str(tmp_path / "ok") if where == "broken" else None))])

    def gone(*args, **kwargs):
        raise OSError("the mount is gone")

    if where == "broken":
        monkeypatch.setattr(strategy_module, "unwritable", gone)

    said = {"saver": "ModelCheckpoint\\(dirpath='.*a_file/x'\\) cannot be written",
            "root": "a ModelCheckpoint without a dirpath saves into trainer.default_root_dir",
            "broken": "rank 0's checks of the checkpoint folders failed"}[where]
    for rank in (0, 1):
        with pytest.raises(ValueError, match=said) as refused:
            check_on_rank_zero(trainer(rank, where), "fit")
        assert refused.value.every_rank
    shared.clear()
    check_on_rank_zero(trainer(0, where), "validate")  # writes no checkpoint: no collective
    assert not shared
    monkeypatch.undo()
    check_on_rank_zero(trainer(0, "none"), "fit")
    assert shared == [None]


def test_with_several_processes_rank_zero_checks_the_log_folders():
    """Lightning makes the loggers' folders on rank 0 before the processes can agree on
    anything: rank 0 checks them first, so its error names the logger (it was the file
    system's errno alone, and Lightning's own creation of them failed on rank 0 alone too)."""
    from types import SimpleNamespace

    from lightning.pytorch.loggers import CSVLogger

    from maxent_grpo.training.step.strategy import attach_for_fit

    logger = CSVLogger(save_dir=__file__ + "/logs")
    for rank in (0, 1):
        trainer = SimpleNamespace(world_size=2, fast_dev_run=False, is_global_zero=rank == 0,
                                  loggers=[logger], strategy=None, num_nodes=1, num_devices=2,
                                  state=SimpleNamespace(fn="validate"))
        if rank:
            attach_for_fit(trainer, None)  # rank 1 writes no log
        else:
            with pytest.raises(ValueError, match=r"trainer.logger CSVLogger\(save_dir="):
                attach_for_fit(trainer, None)


@pytest.mark.parametrize("options, expected", [
    ({"train_time_interval": timedelta(milliseconds=10)},
     r"train_time_interval=...\) never saves here"),
    ({"every_n_train_steps": 2, "monitor": "val/pass@1", "mode": "max"},
     r"monitor='val/pass@1', every_n_train_steps=2\) would score each checkpoint with the "
     r"validation before it"),
    ({"dirpath": "file:///tmp/maxent-grpo-never-written"},  # was written to ./file:/tmp/...
     r"dirpath='file://...'\) is written to .*file:/tmp/maxent-grpo-never-written"),
    # written to ./$MAXENT_ROOT/ck while the logger's save_dir expanded it (a hunt)
    ({"dirpath": "{tmp}/$MAXENT_ROOT/ck"}, r"Lightning does not expand \$MAXENT_ROOT in it"),
    # a folder that cannot be written failed at the first save, after its steps trained
    ({"dirpath": __file__ + "/ckpt"}, r"cannot be written \(.*test_lightning_habits.py' is "
                                      r"not a folder\)"),
])
def test_checkpoint_settings_lightning_ignores_here_are_refused(cache_dir, tmp_path, options,
                                                                expected):
    """Lightning's manual-optimisation path never checks ``train_time_interval`` (no
    checkpoint until the end), and saves a ``val/``-monitored checkpoint at the batch's end,
    scored by the validation before it: the kept "best" files followed stale scores."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    module = make_module(cache_dir)
    options = {k: v.format(tmp=tmp_path) if k == "dirpath" else v for k, v in options.items()}
    saver = ModelCheckpoint(**{"dirpath": str(tmp_path / "ckpt"), "save_top_k": -1, **options})
    with pytest.raises(ValueError, match=expected):
        fit(module, make_data(cache_dir), steps=2, tmp_path=tmp_path, callbacks=[saver],
            enable_checkpointing=True)
    assert module.policy is None
    saver = ModelCheckpoint(dirpath=str(tmp_path / "ok"), save_top_k=1, monitor="val/pass@1",
                            mode="max")  # saved at each validation's end: fresh scores
    fit(make_module(cache_dir), make_data(cache_dir), steps=1, tmp_path=tmp_path,
        callbacks=[saver], enable_checkpointing=True, limit_val_batches=1)


def test_a_smoke_run_with_several_iterations_is_not_refused(cache_dir, tmp_path):
    """``fast_dev_run`` sets max_steps 1 itself and runs one batch: k optimizer steps."""
    module = make_module(cache_dir, num_iterations=2)
    trainer = fit(module, make_data(cache_dir), tmp_path=tmp_path, fast_dev_run=True)
    assert trainer.global_step == 2


def test_validate_with_the_same_flags_is_not_refused(cache_dir, tmp_path):
    """The check is for ``fit``: a config shared with ``validate`` still evaluates."""
    import lightning as L

    module = make_module(cache_dir)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=1,
                        gradient_clip_val=0.5, default_root_dir=tmp_path)
    trainer.validate(module, make_data(cache_dir))
    assert "val/pass@1" in trainer.callback_metrics


def test_learning_rate_monitor_logs_every_optimizer_step(cache_dir, tmp_path):
    """The scheduler is stepped by this trainer's own loop; declared per step, Lightning's
    LearningRateMonitor reads it at every step (it logged step 0 only) and agrees with
    ``train/lr``."""
    import csv

    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(str(tmp_path), name="run")
    fit(make_module(cache_dir, lr_warmup_steps=3), make_data(cache_dir), steps=4,
        tmp_path=tmp_path, logger=logger, callbacks=[LearningRateMonitor()],
        log_every_n_steps=1)
    rows = list(csv.DictReader(open(f"{logger.log_dir}/metrics.csv")))
    monitor = {int(r["step"]): float(r["lr-SGD"]) for r in rows if r.get("lr-SGD")}
    ours = {int(r["step"]): float(r["train/lr"]) for r in rows if r.get("train/lr")}
    assert sorted(monitor) == [0, 1, 2, 3]
    assert len(set(monitor.values())) > 1  # the warm-up moved it
    assert all(abs(monitor[s] - ours[s]) < 1e-6 for s in monitor)


def test_no_logger_and_no_root_dir_write_nothing_in_the_working_folder(
        cache_dir, tmp_path, monkeypatch, caplog):
    """Lightning's default ModelCheckpoint would write ./checkpoints (nobody named it): it is
    removed with one line saying how to keep checkpoints; with default_root_dir it saves."""
    import logging
    import os

    import lightning as L

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)

    def run(**kwargs):
        trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                            enable_model_summary=False, max_steps=1, limit_val_batches=0,
                            **kwargs)
        trainer.fit(make_module(cache_dir), make_data(cache_dir))
        return trainer

    with caplog.at_level(logging.WARNING):
        trainer = run()
    assert os.listdir(work) == []
    assert trainer.checkpoint_callbacks == []
    assert "no checkpoints are saved" in caplog.text
    assert "--trainer.default_root_dir" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        run(default_root_dir=str(tmp_path / "root"))
    assert os.listdir(work) == []
    assert os.listdir(tmp_path / "root" / "checkpoints")  # asked for: saved
    assert "no checkpoints are saved" not in caplog.text
    # a ModelCheckpoint the user configured is kept, wherever Lightning puts it
    from lightning.pytorch.callbacks import ModelCheckpoint

    trainer = run(callbacks=[ModelCheckpoint(save_last=True)])
    assert len(trainer.checkpoint_callbacks) == 1 and os.listdir(work) == ["checkpoints"]


def test_a_spawning_strategy_is_refused_and_the_module_pickles(cache_dir):
    """``strategy="ddp_spawn"`` died in the launcher on a pickling error (the scorer's weak
    cache); each spawned process would train a copy whose counters, controllers and
    objective state are lost (only weights come back). The module pickles now (for
    ``torch.save(module)`` before a fit), and the strategy is refused by name."""
    import functools
    import pickle

    import lightning as L
    import torch

    from maxent_grpo.training.step.strategy import check_trainer_flags

    module = make_module(cache_dir, optimizer=functools.partial(torch.optim.SGD, lr=0.5))
    copy = pickle.loads(pickle.dumps(module))
    assert copy.scorer.temperature == module.scorer.temperature
    for strategy in ("ddp_spawn", "ddp_notebook"):
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
        with pytest.raises(ValueError, match="runs each process on a copy of the module.*use "
                                             "strategy ddp"):
            check_trainer_flags(trainer, 1.0)
    check_trainer_flags(L.Trainer(accelerator="cpu", devices=2, strategy="ddp"), 1.0)


def test_a_second_run_on_a_trainer_says_nothing_about_the_modules_callbacks(cache_dir, caplog):
    """Every second fit, validate, test or predict on one Trainer printed Lightning's
    "callbacks returned in `configure_callbacks` will override existing callbacks passed to
    Trainer: CleanUp", about the module's own callback of the run before (a hunt)."""
    import lightning as L

    module, data = make_module(cache_dir), make_data(cache_dir)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=1)
    with caplog.at_level("INFO"):
        trainer.validate(module, data, verbose=False)
        trainer.validate(module, data, verbose=False)
    assert "will override existing callbacks" not in caplog.text
    assert sum(type(c).__name__ == "CleanUp" for c in trainer.callbacks) == 1


def test_a_lone_process_that_the_environment_calls_rank_3_still_logs(cache_dir, tmp_path,
                                                                       monkeypatch, caplog):
    """A scheduler's ``RANK``/``LOCAL_RANK`` set for a one-process job: Lightning took it as
    a non-zero rank and every logger wrote nothing (a hunt: a whole run "succeeded" with no
    metrics). The run logs as rank 0, and says why."""
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.utilities import rank_zero_only

    monkeypatch.setattr(rank_zero_only, "rank", 3)  # what RANK=3 at import gives
    logger = CSVLogger(tmp_path, name="csv")
    with caplog.at_level("WARNING"):
        fit(make_module(cache_dir), make_data(cache_dir), steps=2, tmp_path=tmp_path,
            logger=logger, log_every_n_steps=1)
    assert "it logs as rank 0" in caplog.text
    assert "train/reward/mean" in (Path(logger.log_dir) / "metrics.csv").read_text()


def test_one_of_several_slurm_tasks_running_a_one_process_fit_is_refused(monkeypatch):
    """``srun -n 2`` with ``trainer.devices: 1``: each task trained the whole run alone into
    the same folders, saying only that it logs as rank 0 (a hunt of SLURM flows). An
    interactive allocation (``SLURM_JOB_NAME=bash``) and one task pass."""
    from types import SimpleNamespace

    from maxent_grpo.training.step.strategy import one_process_is_rank_zero

    trainer = SimpleNamespace(world_size=1)
    for name, value in (("SLURM_NTASKS", "2"), ("SLURM_JOB_NAME", "train"),
                        ("SLURM_PROCID", "0"), ("SLURM_NTASKS_PER_NODE", "2")):
        monkeypatch.setenv(name, value)
    one_process_is_rank_zero(trainer)  # the batch script itself: one process of the job
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")  # srun -n 2
    with pytest.raises(ValueError, match=r"srun started 2 tasks \(SLURM_STEP_NUM_TASKS\) for a "
                                         r"run of one process .* each would train the whole"):
        one_process_is_rank_zero(trainer)
    monkeypatch.setenv("SLURM_JOB_NAME", "bash")  # an interactive shell
    one_process_is_rank_zero(trainer)
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")
    one_process_is_rank_zero(trainer)
    one_process_is_rank_zero(SimpleNamespace(world_size=2))  # Lightning checks its own


def test_launches_that_do_not_match_the_run_are_refused_or_named(monkeypatch, caplog):
    """``torchrun --nproc-per-node 2`` on a one-process config trained two whole runs into
    one folder (exit 0): refused; a ``LOCAL_RANK`` left in the shell with ``devices: 2``
    waited 30 minutes for processes nothing started, without a word: named (a launcher of
    one's own sets it too, as the distributed tests' does; a hunt of DDP on the CPU)."""
    from types import SimpleNamespace

    from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment

    from maxent_grpo.training.step.strategy import one_process_is_rank_zero, warn_lone_local_rank

    for name in ("WORLD_SIZE", "TORCHELASTIC_RUN_ID", "LOCAL_RANK", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(name, raising=False)
    one = SimpleNamespace(world_size=1, strategy=None)
    two = SimpleNamespace(world_size=2, strategy=SimpleNamespace(
        cluster_environment=LightningEnvironment()))
    monkeypatch.setenv("WORLD_SIZE", "2")
    one_process_is_rank_zero(one)  # a stray WORLD_SIZE alone: one process, as rank 0
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's
    with pytest.raises(ValueError, match=r"torchrun started 2 processes \(WORLD_SIZE\) for a "
                                         r"run of one process .* each would train the whole"):
        one_process_is_rank_zero(one)
    one_process_is_rank_zero(two)  # Lightning checks its own
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with caplog.at_level("WARNING"):
        warn_lone_local_rank(one)  # one process: LOCAL_RANK is harmless
        assert caplog.text == ""
        warn_lone_local_rank(two)
        assert "LOCAL_RANK=0 is set and WORLD_SIZE is not" in caplog.text
        assert "waits (up to 30 minutes) for the run's other 1 process(es)" in caplog.text
        caplog.clear()
        monkeypatch.setenv("WORLD_SIZE", "2")
        warn_lone_local_rank(two)  # torchrun's pair
        monkeypatch.delenv("WORLD_SIZE")
        two.strategy.cluster_environment = SLURMEnvironment()  # its own ranks: not ours
        warn_lone_local_rank(two)
        assert caplog.text == ""


def test_an_fsdp2_mesh_of_another_size_than_the_processes_is_refused_by_name():
    """A scaling config run on fewer processes than its ``data_parallel_size`` (8 on 2)
    ended in Lightning's RuntimeError inside a traceback, reported as "a bug"."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import ModelParallelStrategy

    from maxent_grpo.training.step.strategy import check_mesh_size

    def trainer(nodes, devices, data, tensor=1):
        return SimpleNamespace(num_nodes=nodes, num_devices=devices, strategy=(
            ModelParallelStrategy(data_parallel_size=data, tensor_parallel_size=tensor)))

    with pytest.raises(ValueError, match=r"data_parallel_size 8 x tensor_parallel_size 1 must "
                                         r"be the number of processes, 2 \(trainer.num_nodes 1 "
                                         r"x trainer.devices 2\); set --trainer.strategy."
                                         r"data_parallel_size=2"):
        check_mesh_size(trainer(1, 2, 8))
    with pytest.raises(ValueError, match="data_parallel_size 2 x tensor_parallel_size 4"):
        check_mesh_size(trainer(2, 8, "auto", 4))  # auto: the nodes, 2; 2 x 4 is not 16
    for fits in (trainer(1, 2, 2), trainer(2, 4, 8), trainer(2, 4, "auto", "auto"),
                 trainer(1, 4, 2, 2)):
        check_mesh_size(fits)
    check_mesh_size(SimpleNamespace(num_nodes=1, num_devices=2, strategy=None))  # not FSDP2


def test_a_logger_folder_that_cannot_be_written_names_the_logger(tmp_path, monkeypatch):
    """``--trainer.logger.init_args.save_dir`` below a file (or read-only) was the file
    system's "[Errno 20] Not a directory" alone, after the model loaded."""
    from types import SimpleNamespace

    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from maxent_grpo.training.step.strategy import check_logger_folders

    (tmp_path / "a_file").write_text("")
    bad = CSVLogger(save_dir=str(tmp_path / "a_file" / "logs"))
    good = TensorBoardLogger(save_dir=str(tmp_path / "logs"))

    def trainer(*loggers, world=1):
        return SimpleNamespace(loggers=list(loggers), world_size=world, fast_dev_run=False)

    with pytest.raises(ValueError, match=r"trainer.logger CSVLogger\(save_dir='.*a_file/logs', "
                       r"name='lightning_logs'\) cannot be written \('.*a_file' is not a fol"):
        check_logger_folders(trainer(good, bad))
    check_logger_folders(trainer(good))
    # a save_dir that can be written, whose <name> cannot, and a default_root_dir without a
    # logger (config.yaml's folder): the file system's errno alone, after the model loaded
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "tiny").write_text("")
    with pytest.raises(ValueError, match=r"TensorBoardLogger\(save_dir='.*logs', name='tiny'\) "
                                         r"cannot be written \('.*tiny' is not a folder\)"):
        check_logger_folders(trainer(TensorBoardLogger(save_dir=str(tmp_path / "logs"),
                                                       name="tiny")))
    bare = SimpleNamespace(loggers=[], world_size=1, fast_dev_run=False,
                           default_root_dir=str(tmp_path / "a_file" / "runs"))
    with pytest.raises(ValueError, match=r"trainer.default_root_dir '.*a_file/runs' cannot be "
                                         r"written \('.*a_file' is not a folder\)"):
        check_logger_folders(bare)
    # not given: Lightning's default, the working folder, where nothing may be written
    # (readers: an unwritable working folder was refused, naming an option never set)
    with monkeypatch.context() as patched:
        patched.chdir(tmp_path)
        patched.setattr("os.access", lambda *a, **kw: False)
        check_logger_folders(SimpleNamespace(loggers=[], world_size=1, fast_dev_run=False,
                                             default_root_dir=os.getcwd()))
        # unless a fit's ModelCheckpoint without a dirpath saves there (readers: refused
        # before, it failed at the first save after the training steps)
        from lightning.pytorch.callbacks import ModelCheckpoint

        from maxent_grpo.training.step.strategy import check_checkpoint_root

        fitting = SimpleNamespace(loggers=[], world_size=1, default_root_dir=os.getcwd(),
                                  callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ck"))])
        check_checkpoint_root(fitting)
        fitting.callbacks.append(ModelCheckpoint(every_n_train_steps=2))
        with pytest.raises(ValueError, match=r"a ModelCheckpoint without a dirpath saves into "
                                             r"trainer.default_root_dir .*give the Model"):
            check_checkpoint_root(fitting)
        fitting.loggers = [SimpleNamespace(save_dir=None)]  # MLflow's server: there too
        with pytest.raises(ValueError, match=r"a ModelCheckpoint without a dirpath"):
            check_checkpoint_root(fitting)
        fitting.fast_dev_run = True  # saves nothing (readers: a smoke run was refused)
        check_checkpoint_root(fitting)
    check_logger_folders(trainer(bad, world=2))  # before the process group: one rank alone
    wandb = pytest.importorskip("lightning.pytorch.loggers").WandbLogger
    try:  # the run's config.yaml goes into W&B's save_dir: "[Errno 20] Not a directory" alone
        bad_wandb = wandb(save_dir=str(tmp_path / "a_file" / "w"), offline=True)
    except ModuleNotFoundError:  # (wandb not installed)
        return
    with pytest.raises(ValueError, match=r"trainer.logger WandbLogger\(save_dir='.*a_file/w'\)"):
        check_logger_folders(trainer(good, bad_wandb))


def test_a_logger_folder_with_a_variable_numbers_its_versions_where_it_writes(tmp_path,
                                                                               monkeypatch):
    """``save_dir: $LOGROOT/logs``: TensorBoard wrote into the expanded folder but numbered
    versions in the one written (none: every fresh run was version_0, two runs' events mixed
    and the first config.yaml replaced, a hunt); the CSVLogger wrote into a folder named
    ``$LOGROOT``."""
    from types import SimpleNamespace

    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from maxent_grpo.training.step.strategy import attach_for_fit

    monkeypatch.setenv("LOGROOT", str(tmp_path / "root"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "root" / "logs" / "tiny" / "version_0").mkdir(parents=True)
    loggers = [TensorBoardLogger("$LOGROOT/logs", name="tiny"),
               CSVLogger("$LOGROOT/logs", name="csv")]
    attach_for_fit(SimpleNamespace(loggers=loggers, world_size=1, fast_dev_run=False,
                                   state=SimpleNamespace(fn="validate")), None)
    assert loggers[0].log_dir == str(tmp_path / "root" / "logs" / "tiny" / "version_1")
    assert loggers[1].log_dir == str(tmp_path / "root" / "logs" / "csv" / "version_0")
    # the root, which Lightning takes as written: a run without a logger saved its
    # checkpoints, and a SLURM requeue its own, into a folder named $LOGROOT
    import lightning as L

    trainer = L.Trainer(default_root_dir="$LOGROOT/run", logger=False, barebones=True)
    with pytest.raises(ValueError, match=r"trainer.default_root_dir '\$LOGROOT/run': "
                                         r"Lightning does not expand \$LOGROOT in it"):
        attach_for_fit(trainer, None)
    # with a logger, whose folder is expanded, nothing saves into it (outside SLURM): taken
    with_logger = L.Trainer(default_root_dir="$LOGROOT/run", enable_progress_bar=False,
                            enable_model_summary=False)
    attach_for_fit(with_logger, None)
    assert with_logger.logger.log_dir.startswith(str(tmp_path / "root" / "run"))

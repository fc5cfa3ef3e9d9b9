"""Kill a run and resume it: the result equals a run that never stopped.

Three ``python -m maxent_grpo fit`` processes on the tiny offline model (listwise MaxEnt
with a TauController and a BetaController, a checkpoint every step, validation at every
epoch end): A trains N = 6 steps; B trains the same config and is killed with SIGKILL as
soon as the checkpoint of step N/2 = 3 is on disk; C continues B with ``--ckpt_path last``
to step N. A and B+C must show the same prompts in the same order, the same per-step
rewards, losses and KL (so the same sampled completions: the random state was restored),
and end with the same tau, beta, parameters and optimizer state.

An epoch is 3 batches (12 prompts, B = 4), so the kill falls at an epoch's end, the
hardest point for the random state: A validates and starts a new epoch between steps 3
and 4, and none of that may shift the training's random stream. Resuming mid-epoch (the
hardest point for the data order) is tested in-process in ``tests/training/data/test_data.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
STEPS, KILL_AFTER = 6, 3


class RecordSteps(pl.Callback):
    """Append one JSON line per training step: the prompt indices when the batch starts,
    the step's reward / loss / KL / tau / beta when it ends."""

    def __init__(self, path: str) -> None:
        self.path = path

    def _write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._write({"step": trainer.global_step, "indices": batch["indices"]})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        keys = ("reward/mean", "loss/total", "kl", "tau", "beta")
        stats = pl_module.step_metrics_dict
        self._write({"step": trainer.global_step, **{f"train/{k}": stats[f"train/{k}"]
                                                     for k in keys}})

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self._write({"validated": trainer.global_step, **{
                k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}})


class KillInValidation(pl.Callback):
    """SIGKILL this process during the validation after step ``step`` (its first batch)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, *_) -> None:
        if not trainer.sanity_checking and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class KillAt(pl.Callback):
    """SIGKILL this process when step ``step + 1`` is about to start: the checkpoint of step
    ``step`` was written at the end of that step, nothing of the next one has run."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class RequeueAt(pl.Callback):
    """SLURM's requeue signal (SIGUSR1) to this process as step ``step`` starts; writes the
    hpc checkpoints found just after it (none: the save waits for the batch's end)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGUSR1)
            folder = Path(trainer.default_root_dir)
            (folder / "at_signal.txt").write_text(str(sorted(folder.glob("hpc_ckpt_*"))))


def config(run: Path, kill: bool | str) -> dict[str, Any]:
    """The run's config; ``kill``: stopped by ``KillAt`` (True) or another such class."""
    callbacks = [
        {"class_path": f"test_resume.{'KillAt' if kill is True else kill}",
         "init_args": {"step": KILL_AFTER}},
        {"class_path": "test_resume.RecordSteps", "init_args": {"path": str(run / "steps.jsonl")}},
        {"class_path": "maxent_grpo.training.callbacks.TauController",
         "init_args": {"target_entropy": 1.0, "lr": 0.5, "warmup_steps": 1,
                       "state_path": str(run / "controller_state.json")}},
        {"class_path": "maxent_grpo.training.callbacks.BetaController",
         "init_args": {"kl_target": 0.001, "horizon": 5.0, "step_bound": 0.5}},
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"dirpath": str(run / "ckpt"), "save_last": True,
                       "every_n_train_steps": 1, "save_top_k": 1}},
    ]
    return {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu", "devices": 1, "max_steps": STEPS, "logger": False,
            "enable_progress_bar": False, "enable_model_summary": False,
            "num_sanity_val_steps": 1, "default_root_dir": str(run),
            "callbacks": callbacks if kill else callbacks[1:],
        },
        "model": {
            "model_name_or_path": "builtin:tiny",
            "model_cache_dir": str(run.parent / "models"),
            "objective": {"class_path": "maxent_grpo.objectives.ListwiseMaxEnt",
                          "init_args": {"tau": 0.5, "beta": 0.05}},
            "rewards": {"first_number": 1.0},
            "num_generations": 4,
            "max_completion_length": 4,
            "eval_num_generations": 2,
            "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01}},
            "lr_warmup_steps": 2,
            "lr_scheduler": {"class_path": "torch.optim.lr_scheduler.CosineAnnealingLR",
                             "init_args": {"T_max": 8, "eta_min": 0.001}},
        },
        "data": {
            "task": "arithmetic_easy", "task_options": {"bare": True},
            "train_size": 13, "val_size": 2, "batch_size": 4, "max_prompt_length": 32,
        },
    }


def fit(run: Path, kill: bool | str = False, *extra: str,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return launch(run, config(run, kill), kill, *extra, env=env)


def launch(run: Path, cfg: dict[str, Any], kill: bool | str, *extra: str,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m maxent_grpo fit`` on ``cfg`` (written into ``run``), offline, with the
    variables ``env`` added."""
    run.mkdir(parents=True, exist_ok=True)
    path = run / ("config_kill.yaml" if kill else "config.yaml")
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = {
        **os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]), **(env or {}),
    }
    cmd = [sys.executable, "-m", "maxent_grpo", "fit", "--config", str(path), *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory) -> Path:
    """Run A, which never stops (one for the module's tests that compare with it)."""
    run = tmp_path_factory.mktemp("resume") / "A"
    whole = fit(run)
    assert whole.returncode == 0, whole.stderr[-3000:]
    return run


def records(run: Path) -> tuple[list[tuple[int, list[int]]], list[dict[str, float]]]:
    lines = [json.loads(x) for x in (run / "steps.jsonl").read_text().splitlines()]
    prompts = [(r["step"], r["indices"]) for r in lines if "indices" in r]
    stats = [r for r in lines if "indices" not in r and "validated" not in r]
    return prompts, stats


def validations(run: Path) -> list[dict[str, float]]:
    """The validations that ended, with their values."""
    lines = [json.loads(x) for x in (run / "steps.jsonl").read_text().splitlines()]
    return [r for r in lines if "validated" in r]


@pytest.mark.slow  # fits in subprocesses (13 s each): .ci/run's slow set
@pytest.mark.parametrize("kill", [True, "KillInValidation"], ids=["after", "in_validation"])
def test_a_killed_and_resumed_run_equals_an_uninterrupted_one(tmp_path, kill, whole_run):
    """Killed after step 3's validation, or during it: its checkpoint was written before
    that validation, which Lightning's resume skipped (its values were lost when the kill
    came during it; a hunt of interrupts); it runs once, in either case."""
    shutil.copytree(whole_run, tmp_path / "A")
    killed = fit(tmp_path / "B", kill)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (tmp_path / "B" / "ckpt" / "last.ckpt").is_file()
    prompts_b, _ = records(tmp_path / "B")
    assert [s for s, _ in prompts_b] == list(range(KILL_AFTER))
    assert [v["validated"] for v in validations(tmp_path / "B")] == (
        [] if kill != True else [KILL_AFTER])  # noqa: E712

    resumed = fit(tmp_path / "B", False, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Restored all states" in resumed.stderr
    assert ("did not end before the run stopped" in resumed.stderr) == (kill != True)  # noqa: E712
    # every validation once, at its step, with the values of the run that never stopped
    val_a, val_bc = validations(tmp_path / "A"), validations(tmp_path / "B")
    assert [v["validated"] for v in val_a] == [KILL_AFTER, STEPS]
    assert [v.keys() for v in val_bc] == [v.keys() for v in val_a]
    for a, b in zip(val_a, val_bc, strict=True):
        assert b == pytest.approx(a, rel=1e-6)

    # the same prompts in the same order
    prompts_a, stats_a = records(tmp_path / "A")
    prompts_bc, stats_bc = records(tmp_path / "B")
    assert len(prompts_a) == STEPS
    assert prompts_bc == prompts_a
    # the same completions: every step's reward, loss, KL, tau and beta agree
    assert len(stats_bc) == len(stats_a) == STEPS
    for a, b in zip(stats_a, stats_bc, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(a[key])), (key, a, b)
    taus = [s["train/tau"] for s in stats_a]
    betas = [s["train/beta"] for s in stats_a]
    assert len(set(taus)) > 2 and len(set(betas)) > 2, "the controllers did not move"

    # the same final state: controllers, parameters, optimizer, global step
    end_a = json.loads((tmp_path / "A" / "controller_state.json").read_text())
    end_b = json.loads((tmp_path / "B" / "controller_state.json").read_text())
    assert end_a["tau"] == end_b["tau"] and end_a["beta"] == end_b["beta"]
    assert end_a["tau_entropy_ema"] == end_b["tau_entropy_ema"]
    assert end_a["meta"] == end_b["meta"] and end_a["meta"]["tau_steps"] == STEPS
    ckpt_a = torch.load(tmp_path / "A" / "ckpt" / "last.ckpt", weights_only=True)
    ckpt_b = torch.load(tmp_path / "B" / "ckpt" / "last.ckpt", weights_only=True)
    assert ckpt_a["global_step"] == ckpt_b["global_step"] == STEPS
    assert ckpt_a["state_dict"].keys() == ckpt_b["state_dict"].keys()
    for name, value in ckpt_a["state_dict"].items():
        torch.testing.assert_close(ckpt_b["state_dict"][name], value, rtol=1e-5, atol=1e-6)
    opt_a, opt_b = ckpt_a["optimizer_states"][0]["state"], ckpt_b["optimizer_states"][0]["state"]
    for i, state in opt_a.items():
        torch.testing.assert_close(opt_b[i]["exp_avg"], state["exp_avg"], rtol=1e-5, atol=1e-7)
    assert ckpt_a["PromptDataModule"] == ckpt_b["PromptDataModule"]
    for key in ("TauController", "BetaController"):
        assert ckpt_a["callbacks"][key] == ckpt_b["callbacks"][key]


@pytest.mark.slow
def test_a_slurm_requeue_saves_after_the_batch_and_the_requeued_job_resumes_exactly(
        tmp_path, whole_run, monkeypatch):
    """SLURM's requeue signal: Lightning's handler finalised the loggers and saved inside
    the signal handler, which deadlocked on a lock the interrupted logging held (the job
    hung, unsaved, not requeued), and a requeued job's resume from its ``hpc_ckpt`` skipped
    this trainer's resume (a new log version, the wrong message; a hunt of SLURM flows).
    The signal is noted; the batch's end saves ``hpc_ckpt_1.ckpt`` and runs ``scontrol
    requeue`` (here a stand-in that records it and kills the job, as SLURM does); the same
    command again resumes from it, through this trainer's resume, to an uninterrupted
    run's values."""
    shutil.copytree(whole_run, tmp_path / "A")
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "scontrol").write_text('#!/bin/sh\necho "$@" >> "$SCONTROL_LOG"\nkill -9 $PPID\n')
    (tools / "scontrol").chmod(0o755)
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "1", "SLURM_PROCID": "0",
             "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NAME": "train",
             "SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_NODELIST": "localhost",
             "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}",
             "SCONTROL_LOG": str(tmp_path / "scontrol.log")}
    run = tmp_path / "B"
    killed = fit(run, "RequeueAt", env=slurm)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    assert (run / "at_signal.txt").read_text() == "[]"  # nothing saved inside the handler
    assert torch.load(run / "hpc_ckpt_1.ckpt", weights_only=True)["global_step"] == (
        KILL_AFTER + 1)

    # --ckpt_path last takes it too, the newer: last.ckpt holds step 3 (the job ended before
    # the saver's turn at step 4's end)
    from maxent_grpo.training.run import checkpoint_io as ckpt_io
    from maxent_grpo.training.run.signals import slurm_requeue_checkpoint

    assert slurm_requeue_checkpoint(str(run)) is None  # not under SLURM
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    hpc = slurm_requeue_checkpoint(str(run))
    assert hpc == str(run / "hpc_ckpt_1.ckpt")
    assert ckpt_io.resolve_checkpoint("last", [str(run / "ckpt")]).global_step == KILL_AFTER
    assert ckpt_io.resolve_checkpoint("last", [str(run / "ckpt")], extra=(hpc,)).path == hpc

    # a new job (a sweep's next) would resume another run's: refused (a second reader)
    fresh = fit(run, False, env=slurm)
    assert fresh.returncode == 1 and (f"{hpc}, an earlier SLURM job's requeue checkpoint, would "
                                      "resume this new job") in fresh.stderr, fresh.stderr[-3000:]
    requeued = fit(run, False, env={**slurm, "SLURM_RESTART_COUNT": "1"})  # the same command
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    assert f"SLURM: a requeued job: the fit resumes from {hpc} or later" in requeued.stderr
    prompts_a, stats_a = records(tmp_path / "A")
    prompts_b, stats_b = records(run)
    assert prompts_b == prompts_a
    assert len(stats_b) == len(stats_a) == STEPS  # the save came after every callback's
    for a, b in zip(stats_a, stats_b, strict=True):
        for key in a:
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(a[key])), (key, a, b)
    assert [v["validated"] for v in validations(run)] == [KILL_AFTER, STEPS]
    ckpt_a = torch.load(tmp_path / "A" / "ckpt" / "last.ckpt", weights_only=True)
    ckpt_b = torch.load(run / "ckpt" / "last.ckpt", weights_only=True)
    assert ckpt_b["global_step"] == STEPS
    for name, value in ckpt_a["state_dict"].items():
        torch.testing.assert_close(ckpt_b["state_dict"][name], value, rtol=1e-5, atol=1e-6)


def test_ckpt_path_last_needs_a_checkpoint_folder(tmp_path, monkeypatch):
    """Without a ModelCheckpoint dirpath, `last` could never be found: refused, not ignored."""
    from maxent_grpo.cli import main

    monkeypatch.setattr(sys, "argv", ["maxent_grpo"])
    args = [
        "fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--ckpt_path", "last",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        f"--model.model_cache_dir={tmp_path / 'models'}",
        "--trainer.callbacks=[]",  # only Lightning's default ModelCheckpoint, no dirpath
    ]
    with pytest.raises(ValueError, match="--ckpt_path last needs a ModelCheckpoint with an"):
        main(args)


class RecordToolSteps(RecordSteps):
    """:class:`RecordSteps` with the multi-turn rollout's statistics."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        keys = ("reward/mean", "loss/total", "tools/calls_per_sample", "tools/turns_per_sample",
                "tools/message_tokens_per_sample")
        stats = pl_module.step_metrics_dict
        self._write({"step": trainer.global_step, **{f"train/{k}": stats[f"train/{k}"]
                                                     for k in keys}})


@pytest.mark.slow  # 26 s: run by .ci/run's slow set (this file), beside the main suite
def test_a_killed_and_resumed_tool_run_equals_an_uninterrupted_one(tmp_path):
    """The same with multi-turn rollouts (``model.tools``, sampled calls on
    ``builtin:tiny-tools-warm``): 4 steps, killed after 2."""

    def tool_config(run: Path, kill: bool) -> dict[str, Any]:
        cfg = config(run, kill)
        callbacks = [{"class_path": "test_resume.KillAt", "init_args": {"step": 2}},
                     {"class_path": "test_resume.RecordToolSteps",
                      "init_args": {"path": str(run / "steps.jsonl")}},
                     cfg["trainer"]["callbacks"][-1]]  # the ModelCheckpoint
        cfg["trainer"].update(max_steps=4, num_sanity_val_steps=0, limit_val_batches=0,
                              callbacks=callbacks if kill else callbacks[1:])
        cfg["model"].update(model_name_or_path="builtin:tiny-tools-warm", tools=["calculate"],
                            objective={"class_path": "maxent_grpo.objectives.GRPO"},
                            max_completion_length=160)
        cfg["data"] = {"task": "tool_arithmetic", "train_size": 16, "val_size": 2,
                       "batch_size": 4, "max_prompt_length": 256}
        return cfg

    whole = launch(tmp_path / "A", tool_config(tmp_path / "A", False), False)
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = launch(tmp_path / "B", tool_config(tmp_path / "B", True), True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = launch(tmp_path / "B", tool_config(tmp_path / "B", False), False,
                     "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    prompts_a, stats_a = records(tmp_path / "A")
    prompts_bc, stats_bc = records(tmp_path / "B")
    assert prompts_bc == prompts_a and len(stats_a) == 4
    assert any(s["train/tools/calls_per_sample"] > 0 for s in stats_a)  # the model called
    for a, b in zip(stats_a, stats_bc, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(a[key])), (key, a, b)


class SigtermAt(pl.Callback):
    """SIGTERM this process at the end of optimizer step ``step``: Lightning stops at the
    end of that loop iteration (after its validation) and ``save_on_exception`` writes
    ``last.ckpt``, as when a scheduler stops a job."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow  # fits in subprocesses (13 s each): .ci/run's slow set
def test_a_run_stopped_at_a_validation_step_logs_every_later_step_where_it_belongs(tmp_path):
    """Stopped by SIGTERM at a step that ran validation, the checkpoint Lightning saves on the
    exception counts that step once more for logging: the resumed run wrote every scalar a
    step late (step 6 missing in TensorBoard, validation at 9 instead of 8)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    cfg = config(run, False)
    cfg["trainer"].update(
        max_steps=9, val_check_interval=3, check_val_every_n_epoch=None, log_every_n_steps=1,
        num_sanity_val_steps=0,
        logger={"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": str(run / "tb"), "name": "t"}},
        callbacks=[{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"dirpath": str(run / "ckpt"), "save_last": True,
                                  "every_n_train_steps": 100, "save_on_exception": True}},
                   {"class_path": "lightning.pytorch.callbacks.LearningRateMonitor",
                    "init_args": {"logging_interval": "step"}}])
    cfg["data"]["train_size"] = 40  # one epoch
    stopped = dict(cfg, trainer=dict(cfg["trainer"], callbacks=[
        *cfg["trainer"]["callbacks"],
        {"class_path": "test_resume.SigtermAt", "init_args": {"step": 6}}]))
    first = launch(run, stopped, True)
    assert (run / "ckpt" / "last.ckpt").is_file(), first.stderr[-3000:]
    assert torch.load(run / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == 6
    resumed = launch(run, cfg, False, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    events = EventAccumulator(str(run / "tb" / "t" / "version_0"), size_guidance={"scalars": 0})
    events.Reload()
    steps = {tag: [e.step for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert steps["train/reward/mean"] == list(range(9))
    # a callback logging at a batch's start (before the module's hook) is on time too
    assert [s for tag, s in steps.items() if tag.startswith("lr-")] == [list(range(9))], steps
    assert [s for tag, s in steps.items() if tag.startswith("val/")][0] == [2, 5, 8]


def test_ckpt_path_last_with_no_checkpoint_yet_says_the_fit_starts_afresh(tmp_path, monkeypatch,
                                                                          caplog, recwarn):
    """A requeue script's first run (or a stop before the first save) passes ``--ckpt_path
    last`` to an empty folder: Lightning's warning told the user to set ``save_last``, which
    the shipped configs set (a hunt of interrupts); it is said in our words now."""
    from maxent_grpo.cli import main

    monkeypatch.setattr(sys, "argv", ["maxent_grpo"])
    monkeypatch.chdir(tmp_path)  # the config's checkpoint folder, lightning_logs/tiny/...
    args = [
        "fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--ckpt_path", "last",
        "--trainer.logger=false", "--trainer.max_steps=1", "--trainer.limit_val_batches=0",
        f"--model.model_cache_dir={tmp_path / 'm'}",
    ]
    with caplog.at_level("INFO"):
        main(args)
    assert ("--ckpt_path last: no checkpoint yet in lightning_logs/tiny/checkpoints: the fit "
            "starts from step 0") in caplog.text
    assert not [w for w in recwarn if "no last checkpoint" in str(w.message)]
    saved = tmp_path / "lightning_logs" / "tiny" / "checkpoints" / "last.ckpt"
    assert torch.load(saved, weights_only=True)["global_step"] == 1


def test_an_earlier_slurm_jobs_requeue_checkpoint_is_not_taken_by_a_new_job(tmp_path,
                                                                           monkeypatch):
    """Lightning resumes a fit (or loads for validate/predict) from any ``hpc_ckpt_N.ckpt``
    in ``default_root_dir`` under SLURM when no ``--ckpt_path`` is given: a sweep's next job
    continued another run's weights. A new job is refused, with ``--ckpt_path last`` too
    when the savers hold nothing; a requeued one resolves ``last`` with it (second readers)."""
    from maxent_grpo.cli import main
    from maxent_grpo.training.run.checkpoint_io import ResolvedCheckpoint
    from maxent_grpo.training.run.signals import resolve_with_requeue, slurm_resume

    for name, value in {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_PROCID": "0",
                        "SLURM_JOB_NAME": "train", "SLURM_NODELIST": "localhost"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.setattr(sys, "argv", ["maxent_grpo"])
    monkeypatch.chdir(tmp_path)
    hpc = tmp_path / "hpc_ckpt_3.ckpt"
    hpc.write_bytes(b"an earlier job's")
    (tmp_path / "hpc_ckpt_x.ckpt").write_bytes(b"not Lightning's pattern")  # ignored
    refused = rf"{hpc}, an earlier SLURM job's requeue checkpoint, would resume this new job"
    for extra in ([], ["--ckpt_path", "last"]):
        with pytest.raises(ValueError, match=refused):
            main(["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), *extra,
                  "--trainer.logger=false", f"--model.model_cache_dir={tmp_path / 'm'}"])
    with pytest.raises(ValueError, match=rf"{hpc}, a SLURM requeue checkpoint, would be loaded "
                                         r"by validate in place of the configured model"):
        slurm_resume("validate", None, str(tmp_path))
    assert slurm_resume("fit", str(hpc), str(tmp_path)) == (str(hpc), (), None)  # named
    # an explicit last of a new job weighs it with the savers' files (of the same run only):
    # it took the savers' newest, passing over a later requeue file of the run
    path, extra, refusal = slurm_resume("fit", "last", str(tmp_path))
    assert (path, extra) == ("last", (str(hpc),))
    requeued, saved = ResolvedCheckpoint(str(hpc), 3, run="r"), ResolvedCheckpoint("s", 2, run="r")

    def resolve(found, alone):  # "last" with the requeue file, and without it
        return lambda extra=(): found if extra else alone

    assert resolve_with_requeue(resolve(requeued, saved), extra, refusal) is requeued
    assert resolve_with_requeue(resolve(saved, saved), extra, refusal) is saved
    with pytest.raises(ValueError, match=refused):  # alone, it may be another run's
        resolve_with_requeue(resolve(requeued, None), extra, refusal)
    # beside a checkpoint recorded as of no run (a DeepSpeed folder) or of another run, it
    # may be a sweep's other job's (a second reader): the savers' is taken
    for other in (ResolvedCheckpoint("s", 2), ResolvedCheckpoint("s", 2, run="q")):
        assert resolve_with_requeue(resolve(requeued, other), extra, refusal) is other
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # this job, requeued
    assert slurm_resume("fit", None, str(tmp_path)) == ("last", (str(hpc),), None)
    monkeypatch.setenv("SLURM_JOB_NAME", "bash")  # an interactive shell: not Lightning's rule
    assert slurm_resume("fit", None, str(tmp_path)) == (None, (), None)

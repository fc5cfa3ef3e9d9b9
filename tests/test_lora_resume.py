"""Kill a LoRA run and resume it: the result equals a run that never stopped.

``tests/test_resume.py`` for ``model.peft``: three ``python -m maxent_grpo fit`` processes
on the tiny offline model with LoRA adapters (built by jsonargparse from the YAML's
``class_path: peft.LoraConfig``) and a KL term (beta > 0: the reference is the policy with
its adapters disabled), a checkpoint every step. A trains 4 steps; B the same and is killed
with SIGKILL once the checkpoint of step 2 is on disk; C continues B with ``--ckpt_path
last``. A and B+C must log the same per-step rewards, losses and KL and end with the same
weights and optimizer state, and only the adapters may differ from the base model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from tests.test_resume import launch

pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[1]
STEPS, KILL_AFTER = 4, 2


class StepStats(pl.Callback):
    """One JSON line per step: its reward, loss and KL."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        stats = pl_module.step_metrics_dict
        record = {"step": trainer.global_step, "indices": batch["indices"],
                  **{k: stats[f"train/{k}"] for k in ("reward/mean", "loss/total", "kl")}}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


class KillAt(pl.Callback):
    """SIGKILL this process when step ``step + 1`` is about to start."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def config(run: Path, kill: bool) -> dict[str, Any]:
    callbacks = [
        {"class_path": "test_lora_resume.KillAt", "init_args": {"step": KILL_AFTER}},
        {"class_path": "test_lora_resume.StepStats",
         "init_args": {"path": str(run / "steps.jsonl")}},
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"dirpath": str(run / "ckpt"), "save_last": True,
                       "every_n_train_steps": 1, "save_top_k": 1}},
    ]
    return {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu", "devices": 1, "max_steps": STEPS, "logger": False,
            "enable_progress_bar": False, "enable_model_summary": False,
            "limit_val_batches": 0, "default_root_dir": str(run),
            "callbacks": callbacks if kill else callbacks[1:],
        },
        "model": {
            "model_name_or_path": "builtin:tiny",
            "model_cache_dir": str(run.parent / "models"),
            "peft": {"class_path": "peft.LoraConfig",
                     "init_args": {"r": 4, "lora_alpha": 8, "target_modules": "all-linear",
                                   "loftq_config": None}},
            "objective": {"class_path": "maxent_grpo.objectives.ListwiseMaxEnt",
                          "init_args": {"tau": 0.5, "beta": 0.05}},
            "rewards": {"first_number": 1.0},
            "num_generations": 4,
            "max_completion_length": 4,
            "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01}},
            "lr_warmup_steps": 1,
        },
        "data": {
            "task": "arithmetic_easy", "task_options": {"bare": True},
            "train_size": 24, "val_size": 2, "batch_size": 4, "max_prompt_length": 32,
        },
    }


def fit(run: Path, kill: bool = False, *extra: str) -> subprocess.CompletedProcess:
    return launch(run, config(run, kill), kill, *extra)


def steps(run: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / "steps.jsonl").read_text().splitlines()]


@pytest.mark.slow  # three fits in subprocesses (20 s): .ci/run's slow set
def test_a_killed_and_resumed_lora_run_equals_an_uninterrupted_one(tmp_path):
    whole = fit(tmp_path / "A")
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = fit(tmp_path / "B", True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert [r["step"] for r in steps(tmp_path / "B")] == list(range(1, KILL_AFTER + 1))
    resumed = fit(tmp_path / "B", False, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Restored all states" in resumed.stderr

    a, bc = steps(tmp_path / "A"), steps(tmp_path / "B")
    assert len(a) == len(bc) == STEPS
    for x, y in zip(a, bc, strict=True):
        assert x["indices"] == y["indices"]
        for key in ("reward/mean", "loss/total", "kl"):
            assert abs(x[key] - y[key]) <= 1e-6 * max(1.0, abs(x[key])), (key, x, y)
    assert all(r["kl"] > 0 for r in a[1:])  # the reference (adapters off) was used

    ckpt_a = torch.load(tmp_path / "A" / "ckpt" / "last.ckpt", weights_only=True)
    ckpt_b = torch.load(tmp_path / "B" / "ckpt" / "last.ckpt", weights_only=True)
    assert ckpt_a["global_step"] == ckpt_b["global_step"] == STEPS
    state_a, state_b = ckpt_a["state_dict"], ckpt_b["state_dict"]
    assert state_a.keys() == state_b.keys()
    for name, value in state_a.items():
        torch.testing.assert_close(state_b[name], value, rtol=1e-5, atol=1e-6)
    opt_a, opt_b = ckpt_a["optimizer_states"][0]["state"], ckpt_b["optimizer_states"][0]["state"]
    assert opt_a.keys() == opt_b.keys()
    for i, state in opt_a.items():
        torch.testing.assert_close(opt_b[i]["exp_avg"], state["exp_avg"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(opt_b[i]["exp_avg_sq"], state["exp_avg_sq"], rtol=1e-5,
                                   atol=1e-9)
    # the frozen base weights in the checkpoint are the base model's; the adapters moved
    from maxent_grpo.models import load_reference

    base = load_reference("builtin:tiny", cache_dir=tmp_path / "models").state_dict()
    prefix = "policy.base_model.model."
    lora = {k for k in state_a if ".lora_" in k}
    assert lora and all(not torch.equal(state_a[k], torch.zeros_like(state_a[k]))
                        for k in lora if ".lora_B." in k)
    for name, value in state_a.items():
        if name in lora:
            continue
        plain = name.removeprefix(prefix).replace(".base_layer.", ".")
        torch.testing.assert_close(value, base[plain], rtol=0, atol=0)
    # AdamW holds state for the adapters only
    assert len(opt_a) == len(lora)

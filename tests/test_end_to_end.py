"""The README's training command, run as a user runs it: the tiny offline demo must finish,
write TensorBoard events with the training metrics and a checkpoint, and raise the reward.

This is the one long test of the fast suite (about 3 minutes on 2 CPU cores): it is the
product's promise, so it runs in CI.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]


def scalars(run_dir: Path) -> dict[str, list[float]]:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tiny_demo_trains_and_the_reward_rises(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [
        sys.executable, "-m", "maxent_grpo", "fit", "--config", "configs/tiny.yaml",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        f"--model.model_cache_dir={tmp_path / 'models'}",
        "--trainer.enable_progress_bar=false",
        f"--trainer.callbacks.dirpath={tmp_path / 'checkpoints'}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]

    run_dir = tmp_path / "tiny" / "version_0"
    values = scalars(run_dir)
    for tag in (
        "train/reward/mean", "train/reward/std", "train/reward/zero_std_frac",
        "train/reward/first_number/mean", "train/loss/total", "train/clip/total",
        "train/tokens/completion_length/mean", "train/tokens/truncated_frac",
        "train/grad_norm", "train/lr", "train/perf/generate_s", "val/reward/mean",
    ):
        assert tag in values, f"{tag} missing from the TensorBoard events"

    reward = values["train/reward/mean"]
    assert len(reward) >= 300
    first, last = sum(reward[:10]) / 10, sum(reward[-10:]) / 10
    # the demo reaches ~0.09 from ~0.02-0.03; a flat or falling reward fails both bounds
    assert last > max(2 * first, first + 0.03), (
        f"reward did not rise: first 10 {first:.3f}, last 10 {last:.3f}"
    )
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file(), "no last checkpoint written"

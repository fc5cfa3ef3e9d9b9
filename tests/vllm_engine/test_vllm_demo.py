"""The demo on vLLM, run as a user runs it: ``python -m maxent_grpo fit --config
configs/tiny_vllm.yaml`` (the default demo's task, objective and schedule on
``builtin:tiny-h64-warm``, rolled out by one in-process vLLM engine synced after every
optimizer step) must finish and raise the reward as the Hugging Face engine's demo does.

A long run (800 steps: five to fourteen minutes on 2 CPU cores), so it is marked slow:
``make test-vllm`` (and CI) leave it out, ``make test-vllm-all`` runs it. Its time limit (an
hour) only stops a hung run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.entrypoints.llm")

from maxent_grpo.analysis import load_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_the_demo_learns_on_the_vllm_engine(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [sys.executable, "-m", "maxent_grpo", "fit", "--config",
           str(ROOT / "configs/tiny_vllm.yaml"), f"--model.model_cache_dir={tmp_path / 'models'}",
           "--trainer.enable_progress_bar=false"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=3600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    scalars = load_run(tmp_path / "lightning_logs/tiny_vllm/version_0").scalars
    values = {tag: s.values for tag, s in scalars.items()}
    reward = values["train/reward/mean"]
    assert len(reward) == 800
    # synced before every rollout after the first; the sampler is the scored policy
    assert len(values["train/perf/sync_seconds"]) == 800
    assert max(values["train/rollout/logp_gap/max"]) < 1e-3
    first, last = sum(reward[:20]) / 20, sum(reward[-20:]) / 20
    # right by chance at first, several times more often at the end; the bounds are those
    # every measured run cleared with margin (benchmarks/RESULTS.md §7: seeds 0-2 with each
    # sample on its own random stream, first 20 0.063-0.070, last 20 0.431-0.804; seeds 0-2
    # before that fix, 0.402-0.487; the Hugging Face engine on the same model, 0.403), not
    # one run's figure
    assert first <= 0.15 and last >= 0.25 and last >= 3 * first, (
        f"reward did not rise: first 20 {first:.3f}, last 20 {last:.3f}")
    assert (tmp_path / "lightning_logs/tiny_vllm/checkpoints/last.ckpt").is_file()

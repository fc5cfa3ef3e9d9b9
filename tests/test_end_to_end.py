"""The README's training command, run as a user runs it: the tiny offline demo must finish,
write TensorBoard events with the training metrics and a checkpoint, and raise the reward;
its checkpoint evaluates with one command; the analysis notebook renders its curves beside a
second (listwise MaxEnt) run.

The demo is a long run (800 steps, three to five minutes on 2 CPU cores, shared by the
tests of this file), so the file is marked slow: ``make test`` leaves it out and ``.ci/run``
runs it after the main suite, since it is the product's promise. Its time limit is an hour,
only there to stop a hung run: a loaded machine may take several times the usual time.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from maxent_grpo.analysis import load_run

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    """Runs `python -m maxent_grpo fit --config configs/tiny.yaml` in a fresh folder (its
    lightning_logs/ lands there); returns that folder."""
    work = tmp_path_factory.mktemp("demo")
    cmd = [
        sys.executable, "-m", "maxent_grpo", "fit", "--config", str(ROOT / "configs/tiny.yaml"),
        f"--model.model_cache_dir={work / 'models'}", "--trainer.enable_progress_bar=false",
    ]
    proc = subprocess.run(cmd, cwd=work, env=ENV, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (work / "console.txt").write_text(proc.stdout + proc.stderr)
    return work


def cli_in(folder: Path, *args: str):
    """``python -m maxent_grpo <args>`` in this process, run from ``folder``."""
    from maxent_grpo.cli import main

    cwd = os.getcwd()
    os.chdir(folder)
    try:
        return main([
            *args, f"--model.model_cache_dir={folder / 'models'}",
            "--trainer.enable_progress_bar=false",
        ])
    finally:
        os.chdir(cwd)


def test_tiny_demo_trains_and_the_reward_rises(demo):
    values = {tag: s.values for tag, s in load_run(demo / "lightning_logs/tiny/version_0")
              .scalars.items()}
    for tag in (
        "train/reward/mean", "train/reward/std", "train/reward/zero_std_frac",
        "train/reward/first_number/mean", "train/loss/total", "train/clip/total",
        "train/tokens/completion_length/mean", "train/tokens/truncated_frac",
        "train/grad_norm", "train/lr", "train/perf/generate_s", "train/perf/tokens_per_s",
        "val/reward/mean", "val/pass@1", "val/pass@4", "val/distinct@4",
    ):
        assert tag in values, f"{tag} missing from the TensorBoard events"
    assert len(values["val/pass@4"]) >= 6  # every 50 training batches

    reward = values["train/reward/mean"]
    assert len(reward) == 800
    first, last = sum(reward[:20]) / 20, sum(reward[-20:]) / 20
    # The README's promise: right by chance at first, several times more often at the end;
    # the warm start never saw a sum, so the rise is the rewards' doing. The bounds come
    # from the recorded runs of this config (benchmarks/results/demo_seeds.jsonl, 19 runs,
    # 10 seeds, 1 and 2 threads): first 20 steps 0.054-0.069, last 20 0.662-0.943 (seed 0,
    # the config's: 0.901-0.942). The same demo without the KL anchor, the collapse the
    # anchor fixed, reached 0.598 and 0.390 (seeds 0 and 1): the last-20 bound fails it.
    assert first <= 0.15 and last >= 0.62 and last >= 4 * first, (
        f"reward did not rise as promised: first 20 {first:.3f}, last 20 {last:.3f}"
    )
    assert (demo / "lightning_logs/tiny/checkpoints/last.ckpt").is_file(), "no last checkpoint"

    acc = EventAccumulator(str(demo / "lightning_logs/tiny/version_0"))
    acc.Reload()
    assert "samples/completions/text_summary" in acc.Tags()["tensors"]  # the samples table
    assert "samples/reward" in acc.Tags()["histograms"]


def test_the_demo_prints_no_warning_a_user_cannot_act_on(demo):
    """Lightning's litlogger tip, its 14-line advice on ModelCheckpoint under manual
    optimisation (our loop steps the optimizer; the checkpoint after the step is the one to
    resume from), its use of torch's deprecated LeafSpec, transformers' bar for a model that
    loads in a second: none of them reaches the console of a command-line run."""
    console = (demo / "console.txt").read_text()
    for noise in ("Tip: For seamless cloud", "ModelCheckpoint with manual optimization",
                  "LeafSpec", "Loading weights"):
        assert noise not in console, noise
    assert "`Trainer.fit` stopped: `max_steps=800` reached." in console  # output is there


def test_the_demo_checkpoint_evaluates_with_one_command(demo):
    cli = cli_in(
        demo, "validate", "--config", str(ROOT / "configs/tiny.yaml"),
        "--ckpt_path", "lightning_logs/tiny/checkpoints/last.ckpt", "--trainer.logger=false",
        "--model.eval_num_generations=8", "--model.eval_k=[1,8]",
    )
    metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
    assert 0 <= metrics["val/pass@1"] <= metrics["val/pass@8"] <= 1
    assert metrics["val/pass@1"] == pytest.approx(metrics["val/mean@1"])
    assert 1 <= metrics["val/distinct@8"] <= 8
    # the checkpoint's policy, not the warm start: the warm start measured val/mean@8
    # 0.035-0.063 (seeds 0-2 of this command without --ckpt_path); every recorded demo run
    # ended at val/pass@1 0.227-0.797 (benchmarks/results/demo_seeds.jsonl)
    assert metrics["val/mean@8"] >= 0.15, metrics["val/mean@8"]


def test_a_checkpoint_of_another_objective_is_refused_naming_the_option(demo):
    with pytest.raises(ValueError, match="model.objective GRPO, but this run has Listwise"):
        cli_in(
            demo, "validate", "--config", str(ROOT / "configs/tiny_controllers.yaml"),
            "--ckpt_path", "lightning_logs/tiny/checkpoints/last.ckpt", "--trainer.logger=false",
        )


def test_the_notebook_plots_two_runs_side_by_side(demo):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    # a short listwise MaxEnt run with the tau/beta controllers to compare against
    cli_in(
        demo, "fit", "--config", str(ROOT / "configs/tiny_controllers.yaml"),
        "--trainer.max_steps=20", "--trainer.val_check_interval=10",
    )
    logs = demo / "lightning_logs"
    runs = [logs / "tiny/version_0", logs / "tiny_controllers/version_0"]
    nb = nbformat.read(ROOT / "notebooks/analyse_runs.ipynb", as_version=4)
    os.environ["MAXENT_GRPO_RUNS"] = os.pathsep.join(map(str, runs))
    try:
        nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                resources={"metadata": {"path": str(demo)}}).execute()
    finally:
        del os.environ["MAXENT_GRPO_RUNS"]
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [
        base64.b64decode(o.data["image/png"]) for o in outputs if "image/png" in o.get("data", {})
    ]
    assert len(images) == 2 and all(len(png) > 10_000 for png in images)
    printed = "".join(o.get("text", "") for o in outputs)
    assert "GRPO(dr_grpo) tiny/version_0" in printed
    assert "ListwiseMaxEnt tiny_controllers/version_0" in printed
    table = next(o.data["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {}))
    for tag in ("train/reward/mean", "val/pass@4", "train/kl", "train/tau", "train/beta"):
        assert tag in table

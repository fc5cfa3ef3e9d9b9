"""maxent_grpo.analysis reads back exactly what was logged, keeps the latest value of a step
written twice (a resumed run), and draws only the panels some run has."""

from __future__ import annotations

import pytest
from torch.utils.tensorboard import SummaryWriter

from maxent_grpo.analysis import PANELS, _smooth, find_runs, load_run, plot_runs, summary_rows


def write_run(folder, scalars: dict[str, list[tuple[int, float]]]) -> None:
    writer = SummaryWriter(str(folder))
    for tag, points in scalars.items():
        for step, value in points:
            writer.add_scalar(tag, value, step)
    writer.close()


def test_load_run_reads_steps_and_values_in_order(tmp_path):
    run_dir = tmp_path / "grpo" / "version_0"
    write_run(run_dir, {
        "train/reward/mean": [(0, 0.25), (1, 0.5), (2, 0.75)],
        "val/pass@1": [(1, 0.125)], "val/pass@4": [(1, 0.5)], "val/pass@4/countdown": [(1, 1.0)],
    })
    run = load_run(run_dir)
    assert run.label == "grpo/version_0"  # no config.yaml beside the events
    reward = run.scalars["train/reward/mean"]
    assert reward.steps == (0, 1, 2) and reward.values == (0.25, 0.5, 0.75)
    assert run.tags("val/") == ["val/pass@1", "val/pass@4", "val/pass@4/countdown"]
    rows = summary_rows([run])
    assert rows[0]["train/reward/mean"] == 0.75 and rows[0]["steps"] == 2
    assert "val/pass@4" in rows[0] and "val/pass@4/countdown" not in rows[0]  # per-task out


def test_a_resumed_run_keeps_the_latest_value_of_each_step(tmp_path):
    run_dir = tmp_path / "r" / "version_0"
    write_run(run_dir, {"train/reward/mean": [(0, 1.0), (1, 2.0), (2, 3.0)]})
    write_run(run_dir, {"train/reward/mean": [(2, 30.0), (3, 40.0)]})  # after a resume
    series = load_run(run_dir).scalars["train/reward/mean"]
    assert series.steps == (0, 1, 2, 3) and series.values == (1.0, 2.0, 30.0, 40.0)


def test_label_names_the_objective_from_the_saved_config(tmp_path):
    run_dir = tmp_path / "tiny" / "version_3"
    write_run(run_dir, {"train/kl": [(0, 0.1)]})
    (run_dir / "config.yaml").write_text(
        "model:\n  objective:\n    class_path: maxent_grpo.objectives.GRPO\n"
        "    init_args:\n      loss_type: dapo\n"
    )
    assert load_run(run_dir).label == "GRPO(dapo) tiny/version_3"


def test_find_runs_and_missing_folders(tmp_path):
    with pytest.raises(FileNotFoundError, match="train first"):
        find_runs(tmp_path / "nothing")
    write_run(tmp_path / "a" / "version_0", {"x": [(0, 1.0)]})
    write_run(tmp_path / "b" / "version_0", {"x": [(0, 1.0)]})
    assert [p.parent.name for p in find_runs(tmp_path)] == ["a", "b"]
    with pytest.raises(FileNotFoundError, match="no TensorBoard event files"):
        load_run(tmp_path)


def test_smoothing_is_a_trailing_mean():
    assert _smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert _smooth([1.0, 3.0], 1) == [1.0, 3.0]


def test_plot_draws_only_the_panels_some_run_logged(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    write_run(tmp_path / "a" / "version_0", {
        "train/reward/mean": [(s, s / 10) for s in range(5)], "train/tau": [(0, 0.5)],
    })
    write_run(tmp_path / "b" / "version_0", {"train/reward/mean": [(s, 0.1) for s in range(5)]})
    runs = [load_run(p) for p in find_runs(tmp_path)]
    fig = plot_runs(runs, smooth=2)
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert titles == ["reward (train)", "tau"]
    reward_ax = fig.axes[0]
    assert len(reward_ax.lines) == 2  # one line per run
    assert list(reward_ax.lines[0].get_ydata()) == pytest.approx([0, 0.05, 0.15, 0.25, 0.35])
    with pytest.raises(ValueError, match="none of the runs"):
        plot_runs(runs, panels=[p for p in PANELS if p[0] == "beta"])
    with pytest.raises(ValueError, match="at least one Run"):
        plot_runs([])

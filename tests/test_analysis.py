"""maxent_grpo.analysis reads back exactly what was logged, keeps the latest value of a step
written twice (a resumed run), draws only the panels some run has with one colour per run, and
summarises a study JSON (objectives x seeds x tasks) as mean ± sd tables and one figure."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from maxent_grpo.analysis import (
    PANELS,
    Run,
    Series,
    find_runs,
    format_study_table,
    load_run,
    load_study,
    plot_runs,
    plot_study,
    recent_runs,
    study_table,
    summary_rows,
)
from maxent_grpo.analysis.runs import smoothed


@pytest.fixture
def agg():
    """matplotlib with the non-interactive backend; figures closed afterwards."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    yield plt
    plt.close("all")


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
    assert rows[0]["train/reward/mean"] == 0.75 and rows[0]["last_step"] == 2
    assert "val/pass@4" in rows[0] and "val/pass@4/countdown" not in rows[0]  # per-task out


def test_a_resumed_run_keeps_the_latest_value_of_each_step(tmp_path):
    run_dir = tmp_path / "r" / "version_0"
    write_run(run_dir, {"train/reward/mean": [(0, 1.0), (1, 2.0), (2, 3.0)]})
    write_run(run_dir, {"train/reward/mean": [(2, 30.0), (3, 40.0)]})  # after a resume
    series = load_run(run_dir).scalars["train/reward/mean"]
    assert series.steps == (0, 1, 2, 3) and series.values == (1.0, 2.0, 30.0, 40.0)
    # written in the same second, the names order by a counter ("....9" after "....10"):
    # the order that counts is the write order
    first, second = sorted(run_dir.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    first.rename(run_dir / "events.out.tfevents.1.host.1.9")
    second.rename(run_dir / "events.out.tfevents.1.host.1.10")
    series = load_run(run_dir).scalars["train/reward/mean"]
    assert series.values == (1.0, 2.0, 30.0, 40.0)


def test_a_rollback_drops_what_the_resume_purged(tmp_path):
    """Resumed at step 3 of a run that reached step 6 and stopped at 4 (a rollback, or
    looked at before the resumed run got as far): TensorBoard purges steps 3 and later of
    the earlier file, and so does load_run (it showed steps 5 and 6 of the abandoned run)."""
    run_dir = tmp_path / "r" / "version_0"
    write_run(run_dir, {"train/reward/mean": [(s, float(s)) for s in range(7)],
                        "val/pass@1": [(1, 0.1), (3, 0.3), (5, 0.5)]})
    writer = SummaryWriter(str(run_dir), purge_step=3)  # as the CLI's resume sets it
    for step in (3, 4):
        writer.add_scalar("train/reward/mean", 10.0 * step, step)
    writer.close()
    run = load_run(run_dir)
    reward = run.scalars["train/reward/mean"]
    assert reward.steps == (0, 1, 2, 3, 4) and reward.values == (0.0, 1.0, 2.0, 30.0, 40.0)
    assert run.scalars["val/pass@1"].steps == (1,)
    assert summary_rows([run])[0]["last_step"] == 4


def test_a_tag_the_purge_removed_whole_is_not_there(tmp_path):
    """A rollback to before a run's only validation: its tags were empty series, and
    ``summary_rows`` (the notebook's last values) raised IndexError (a hunt)."""
    run_dir = tmp_path / "r" / "version_0"
    write_run(run_dir, {"train/reward/mean": [(s, float(s)) for s in range(10)],
                        "val/pass@1": [(9, 0.5)]})
    writer = SummaryWriter(str(run_dir), purge_step=5)
    writer.add_scalar("train/reward/mean", 50.0, 5)
    writer.close()
    run = load_run(run_dir)
    assert "val/pass@1" not in run.scalars
    assert summary_rows([run])[0]["last_step"] == 5


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


def test_recent_runs_are_the_last_written_training_runs(tmp_path):
    """A resumed run counts from its last write (it sorted by its first event file), and a
    ``validate`` folder (val/ scalars only) is passed over: the notebook's two newest runs
    were a fit and its own validation."""
    older, resumed, fresh = (tmp_path / "t" / f"version_{i}" for i in range(3))
    write_run(resumed, {"train/reward/mean": [(0, 1.0)]})
    write_run(older, {"train/reward/mean": [(0, 2.0)]})
    write_run(fresh, {"train/reward/mean": [(0, 3.0)]})
    write_run(resumed, {"train/reward/mean": [(1, 4.0)]})  # its resume, written last
    (validated := tmp_path / "t" / "version_3").mkdir()
    write_run(validated, {"val/reward/mean": [(1, 0.5)]})  # a validate run, newest of all
    events = sorted(tmp_path.rglob("events.*"), key=lambda p: p.stat().st_mtime)
    for i, path in enumerate(events):  # distinct times, in the order written
        os.utime(path, (1_000_000 + i, 1_000_000 + i))
    assert [p.name for p in find_runs(tmp_path)] == [
        "version_0", "version_2", "version_1", "version_3"]
    assert [r.path.name for r in recent_runs(2, tmp_path)] == ["version_2", "version_1"]
    assert [r.path.name for r in recent_runs(5, tmp_path)] == [
        "version_0", "version_2", "version_1"]
    # a fit that failed before its first step (a config text only) takes no place either
    writer = SummaryWriter(str(tmp_path / "t" / "version_4"))
    writer.add_text("config", "model: ...")
    writer.close()
    assert [r.path.name for r in recent_runs(2, tmp_path)] == ["version_2", "version_1"]


def test_relative_run_paths_mean_the_same_from_the_root_and_from_notebooks(
    tmp_path, monkeypatch,
):
    """The notebook runs from ``notebooks/``, the README's commands from the repository
    root: ``lightning_logs/...`` is found from both (looked up from the working folder
    upwards), and a folder that is nowhere says where it was looked for."""
    write_run(tmp_path / "lightning_logs" / "tiny" / "version_0", {"x": [(0, 1.0)]})
    (tmp_path / "notebooks").mkdir()
    for cwd in (tmp_path, tmp_path / "notebooks"):
        monkeypatch.chdir(cwd)
        assert load_run("lightning_logs/tiny/version_0").scalars["x"].values == (1.0,)
        assert [p.name for p in find_runs("lightning_logs")] == ["version_0"]
    with pytest.raises(FileNotFoundError, match=r"no file or folder lightning_logs/nope in the "
                       r"working folder .*notebooks or any folder above it"):
        load_run("lightning_logs/nope")


def test_smoothing_is_a_trailing_mean():
    assert smoothed([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert smoothed([1.0, 3.0], 1) == [1.0, 3.0]
    # a NaN (a step that did not log it) or inf counts in no window: a running sum kept it
    # in every later point, which blanked the rest of the curve (a hunt)
    nan, inf = float("nan"), float("inf")
    assert smoothed([1.0, nan, 5.0, 7.0, 9.0], 2) == [1.0, 1.0, 5.0, 6.0, 8.0]
    with_inf = smoothed([inf, 3.0, 5.0], 2)
    assert math.isnan(with_inf[0]) and with_inf[1:] == [3.0, 4.0]
    late = smoothed([nan, nan, 2.0], 2)
    assert math.isnan(late[0]) and math.isnan(late[1]) and late[2] == 2.0


def test_plot_draws_only_the_panels_some_run_logged(tmp_path, agg):
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


def test_plot_gives_each_run_one_colour_and_each_pass_at_k_tag_one_style(agg):
    from matplotlib.colors import to_hex

    def run(label: str, scale: float) -> Run:
        series = {"train/reward/mean": Series(tuple(range(30)), tuple([scale] * 30)),
                  "train/kl": Series((0, 10), (0.0, scale))}
        series |= {f"val/pass@{k}": Series((10, 20), (scale, scale * k)) for k in (1, 4, 8)}
        return Run(path=Path(label), label=label, scalars=series)

    runs = [run("grpo", 0.1), run("maxent", 0.2)]
    fig = plot_runs(runs)
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert titles == ["reward (train)", "pass@k (validation)", "KL to the reference"]
    colours: dict[str, set[str]] = {"grpo": set(), "maxent": set()}
    for ax in fig.axes:
        for line in ax.get_lines():
            colours[line.get_label().split()[0]].add(to_hex(line.get_color()))
    assert colours == {"grpo": {"#1f77b4"}, "maxent": {"#ff7f0e"}}  # C0, C1 everywhere
    pass_ax = fig.axes[1]
    assert len(pass_ax.get_lines()) == 6
    styles = {(ln.get_label(), ln.get_linestyle(), ln.get_marker()) for ln in pass_ax.get_lines()}
    by_tag = {label.split()[1]: (ls, m) for label, ls, m in styles}
    assert len(set(by_tag.values())) == 3  # pass@1, pass@4, pass@8 drawn differently ...
    assert len(styles) == 6  # ... and the same way in both runs
    legend = [t.get_text() for t in pass_ax.get_legend().get_texts()]
    assert legend == ["grpo", "maxent", "pass@1", "pass@4", "pass@8"]
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["grpo", "maxent"]


OBJECTIVES = ("GRPO", "Listwise", "GroupMaxEnt(tau=0.5)")


def synthetic_study() -> dict:
    """Task "a" (no coverage): GRPO and Listwise with seeds 0-2; task "b": all three
    objectives, GroupMaxEnt(tau=0.5) with seed 0 only. A metric is ``base + 0.1 (seed - 1)``,
    so its sd over seeds 0-2 is 0.1; the reward of step t is ``0.1 i + 0.01 seed + 0.001 t``
    over 30 steps for objective i."""
    runs = []
    for task, objectives in (("a", OBJECTIVES[:2]), ("b", OBJECTIVES)):
        for i, objective in enumerate(objectives):
            for seed in (0,) if i == 2 else (0, 1, 2):
                base = {"mean": 0.3, "pass": 0.5, "distinct_correct": 0.4, "coverage": 0.2}
                metrics = {f"{name}@{k}": value + 0.1 * (seed - 1) + 0.01 * k + 0.1 * i
                           for name, value in base.items() if task == "b" or name != "coverage"
                           for k in (1, 4)}
                reward = [0.1 * i + 0.01 * seed + 0.001 * t for t in range(30)]
                runs.append({"task": task, "task_label": f"task {task}", "objective": objective,
                             "seed": seed, "curve": {"steps": list(range(30)), "reward": reward},
                             "metrics": metrics, "seconds": 1.0})
    return {"meta": {"seeds": [0, 1, 2], "ks": [1, 4]}, "runs": runs}


def test_load_study_checks_the_shape_and_names_the_file(tmp_path):
    good = tmp_path / "study.json"
    good.write_text(json.dumps(synthetic_study()))
    assert load_study(good) == synthetic_study()
    bad = tmp_path / "no_runs.json"
    bad.write_text(json.dumps({"meta": {}}))
    with pytest.raises(ValueError, match=r"no_runs\.json has no 'runs'"):
        load_study(bad)
    study = synthetic_study()
    del study["runs"][3]["metrics"], study["runs"][3]["curve"]["reward"]
    good.write_text(json.dumps(study))
    with pytest.raises(ValueError, match=r"study\.json: runs\[3\] lacks metrics, curve\.reward"):
        load_study(good)
    for broken in ({"curve": [0.1, 0.2]}, "a run"):  # another JSON's runs (a list curve)
        study = synthetic_study()
        study["runs"][1] = broken if isinstance(broken, str) else {**study["runs"][1], **broken}
        good.write_text(json.dumps(study))
        with pytest.raises(ValueError, match=r"study\.json: runs\[1\] is not a study run"):
            load_study(good)
    bad.write_text("{")
    with pytest.raises(ValueError, match="no_runs.json is not JSON"):
        load_study(bad)
    # a strict JSON writer's NaN is null: missing (it was a bare TypeError in study_table,
    # naming no file); a value that is no number is named (a hunt)
    study = synthetic_study()
    study["runs"][0]["metrics"]["pass@1"] = None
    study["runs"][0]["curve"]["reward"][5] = None
    good.write_text(json.dumps(study))
    loaded = load_study(good)
    assert math.isnan(loaded["runs"][0]["metrics"]["pass@1"])
    assert math.isnan(loaded["runs"][0]["curve"]["reward"][5])
    assert study_table(loaded, "a")[0]["pass@1"] == pytest.approx(0.56)  # seeds 1, 2: 0.51, 0.61
    for value, said in (("n/a", r"runs\[2\]\.metrics\['pass@1'\] is 'n/a', not a number"),
                        (True, r"runs\[2\]\.metrics\['pass@1'\] is True")):
        study = synthetic_study()
        study["runs"][2]["metrics"]["pass@1"] = value
        good.write_text(json.dumps(study))
        with pytest.raises(ValueError, match=said):
            load_study(good)


def test_study_table_gives_mean_and_sample_sd_over_seeds():
    rows = study_table(synthetic_study(), "b")
    assert [(r["objective"], r["seeds"]) for r in rows] == [
        ("GRPO", 3), ("Listwise", 3), ("GroupMaxEnt(tau=0.5)", 1)]
    grpo, listwise, single = rows
    # pass@1 of GRPO: 0.41, 0.51, 0.61 -> mean 0.51, sd sqrt((0.01 + 0 + 0.01) / 2) = 0.1
    assert grpo["pass@1"] == pytest.approx(0.51) and grpo["pass@1_sd"] == pytest.approx(0.1)
    assert listwise["coverage@4"] == pytest.approx(0.2 + 0.04 + 0.1)
    assert single["pass@4"] == pytest.approx(0.4 + 0.04 + 0.2)
    assert math.isnan(single["pass@4_sd"])  # one seed: no spread (it read "± 0.000")
    # first 20 steps: 0.001 * mean(0..19) = 0.0095, last 20: 0.001 * mean(10..29) = 0.0195,
    # plus 0.01 * mean seed (= 0.01) and 0.1 per objective index
    assert grpo["reward_first20"] == pytest.approx(0.0195)
    assert listwise["reward_last20"] == pytest.approx(0.1295)
    assert grpo["reward_last20_sd"] == pytest.approx(0.01)
    assert "coverage@1" not in study_table(synthetic_study(), "a")[0]
    with pytest.raises(ValueError, match="no runs of task 'c'"):
        study_table(synthetic_study(), "c")


def test_format_study_table_writes_mean_plus_minus_sd():
    study = synthetic_study()
    for run in study["runs"]:
        run["metrics"]["pass@1"] = 0.4 + 0.1 * run["seed"]  # 0.4, 0.5, 0.6
    table = format_study_table(study_table(study, "a"), ["pass@1", "coverage@1"])
    lines = table.splitlines()
    assert lines[0] == "| objective | seeds | pass@1 | coverage@1 |"
    assert lines[1] == "|---|---|---|---|"
    assert lines[2] == "| GRPO | 3 | 0.500 ± 0.100 | - |"
    assert len(lines) == 4


def test_plot_study_keeps_one_colour_per_objective_in_every_panel(agg):
    from matplotlib.collections import PolyCollection
    from matplotlib.colors import to_hex

    fig = plot_study(synthetic_study(), smooth=5)
    axes = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in axes] == [
        "task a: reward (train)", "pass@k", "mean@k",
        "task b: reward (train)", "pass@k", "mean@k", "coverage@k", "distinct_correct@k",
    ]  # task a has no answer sets: its coverage and distinct-correct panels are blank
    colours: dict[str, set[str]] = {o: set() for o in OBJECTIVES}
    for ax in axes:
        for line in ax.get_lines():
            if line.get_label() in colours:
                colours[line.get_label()].add(to_hex(line.get_color()))
        for bars in ax.containers:  # errorbars: the points, the caps and the vertical bars
            data, caps, columns = bars.lines
            colours[bars.get_label()] |= {to_hex(x.get_color()) for x in (data, *caps)}
            colours[bars.get_label()] |= {to_hex(c) for col in columns for c in col.get_colors()}
    for ax, objectives in ((axes[0], OBJECTIVES[:2]), (axes[3], OBJECTIVES)):
        bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
        assert len(bands) == len(objectives)  # one band (seeds' min-max) per objective
        for band, objective in zip(bands, objectives, strict=True):
            colours[objective] |= {to_hex(c) for c in band.get_facecolor()}
    assert colours == {"GRPO": {"#1f77b4"}, "Listwise": {"#ff7f0e"},
                       "GroupMaxEnt(tau=0.5)": {"#2ca02c"}}
    grpo_mean = next(ln for ln in axes[0].get_lines() if ln.get_label() == "GRPO")
    # mean over seeds 0-2 of the 5-point trailing average at step 10: 0.01 + 0.001 * 8
    assert grpo_mean.get_ydata()[10] == pytest.approx(0.018)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == list(OBJECTIVES)


def test_the_starting_model_and_answer_entropy_curves_are_plotted(agg, tmp_path):
    """An untrained run (the starting model) has no curve: it gets no reward band and no
    reward columns, but its metrics are plotted; answer-entropy curves get a panel."""
    study = synthetic_study()
    for run in study["runs"]:
        run["curve"]["answer_entropy"] = [1.0 - 0.01 * t for t in range(30)]
    study["runs"].append({"task": "b", "task_label": "task b", "objective": "start", "seed": 0,
                          "trained": False, "curve": {"steps": [], "reward": []},
                          "metrics": {"pass@1": 0.1, "pass@4": 0.3}})
    path = tmp_path / "study.json"
    path.write_text(json.dumps(study))
    loaded = load_study(path)
    start = study_table(loaded, "b")[-1]
    assert start["objective"] == "start" and "reward_first20" not in start
    fig = plot_study(loaded, smooth=5)
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles[:3] == ["task a: reward (train)", "task a: answer entropy (nats) (train)",
                          "pass@k"]
    entropy_b = next(ax for ax in fig.axes
                     if ax.get_title() == "task b: answer entropy (nats) (train)")
    assert {ln.get_label() for ln in entropy_b.get_lines()} == set(OBJECTIVES)
    for run in study["runs"][:-1]:  # right answers per group over steps: one more panel
        run["curve"]["distinct_correct"] = [1.0 + 0.01 * t for t in range(30)]
    path.write_text(json.dumps(study))
    right_b = next(ax for ax in plot_study(load_study(path), smooth=5).axes
                   if ax.get_title() == "task b: right answers per group (train)")
    assert {ln.get_label() for ln in right_b.get_lines()} == set(OBJECTIVES)
    pass_b = [ax for ax in fig.axes if ax.get_title() == "pass@k"][1]
    assert "start" in {bars.get_label() for bars in pass_b.containers}
    study["runs"][-1]["trained"] = True
    path.write_text(json.dumps(study))
    with pytest.raises(ValueError, match="curve.reward"):
        load_study(path)


def test_a_nan_is_no_seeds_report_and_the_table_says_how_many_did():
    from maxent_grpo.analysis.studies import format_study_table, study_table

    def run(seed, value):
        return {"task": "b", "objective": "GRPO", "seed": seed, "trained": True,
                "curve": {"reward": [0.5, math.nan]}, "metrics": {"pass@1": value}}

    rows = study_table({"runs": [run(0, 0.4), run(1, math.nan), run(2, 0.6)]}, "b")
    assert rows[0]["pass@1"] == pytest.approx(0.5) and rows[0]["pass@1_n"] == 2
    assert rows[0]["reward_first20"] == 0.5  # the point that logged it
    assert "| GRPO | 3 | 0.500 ± 0.141 (n=2) |" in format_study_table(rows, ["pass@1"])

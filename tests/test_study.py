"""benchmarks/maxent_vs_grpo.py in miniature: every objective of the study runs a couple of
steps of the multi-answer task and reports every metric the study tabulates."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location(
        "maxent_vs_grpo", ROOT / "benchmarks/maxent_vs_grpo.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["maxent_vs_grpo"] = module
    spec.loader.exec_module(module)
    return module


def test_every_objective_runs_the_multi_answer_task_and_reports_the_metrics(
    study, monkeypatch, tmp_path
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(sys, "argv", sys.argv[:1])
    for objective in study.OBJECTIVES:
        record = study.run_one("b", objective, seed=0, steps=2)
        assert record["objective"] == objective and record["task"] == "b"
        assert len(record["curve"]["reward"]) == len(record["curve"]["steps"]) >= 2
        assert set(record["metrics"]) == {
            f"{name}@{k}" for name in ("mean", "pass", "distinct_correct", "coverage")
            for k in study.KS
        }
        m = record["metrics"]
        assert 0 <= m["coverage@1"] <= m["coverage@8"] <= m["coverage@32"] <= 1
        assert m["pass@1"] <= m["pass@8"] <= m["pass@32"]
        assert m["distinct_correct@1"] <= m["distinct_correct@8"]
        assert len(record["curve"]["answer_entropy"]) == len(record["curve"]["reward"])
        json.dumps(record)  # the study writes it as JSON


def test_the_default_study_runs_the_starting_model_and_the_answer_mechanisms(
    study, monkeypatch, tmp_path
):
    """The starting model is evaluated untrained (no curve); the answer-level listwise run
    on the ordered task keeps its solved groups and scores answers in order."""
    from maxent_grpo.analysis import load_study, study_table

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(sys, "argv", sys.argv[:1])
    assert set(study.DEFAULT) <= set(study.RUNS) and "start" in study.DEFAULT
    start = study.run_one("c", "start", seed=0, steps=2)
    assert start["trained"] is False and start["curve"]["reward"] == []
    answers = study.run_one("c", "Listwise(answers)", seed=0, steps=2)
    assert answers["trained"] and len(answers["curve"]["reward"]) == 2
    # a closed task of 9 targets x 6-10 ordered answers: one right answer covers 1/6 at most
    assert 0 <= start["metrics"]["coverage@32"] <= 1
    path = tmp_path / "study.json"
    path.write_text(json.dumps({"meta": {}, "runs": [start, answers]}))
    rows = study_table(load_study(path), "c")
    assert "reward_last20" not in rows[0] and "reward_last20" in rows[1]
    args = study.run_args("c", "Listwise(answers)", 0, 2, str(tmp_path))
    last = len(args) - 1 - args[::-1].index("--model.solved_reward")  # the run's own wins
    assert args[last + 1] == "1.0"


def test_the_study_arguments_differ_only_in_the_objective(study):
    args = {name: study.run_args("a", name, 1, 10, "/tmp/x") for name in study.OBJECTIVES}
    objective_at = args["GRPO"].index("--model.objective") + 1
    for name, argv in args.items():
        rest = argv[:objective_at] + argv[objective_at + 1:]
        base = args["GRPO"][:objective_at] + args["GRPO"][objective_at + 1:]
        callbacks = rest.index("--trainer.callbacks") + 1
        del rest[callbacks], base[callbacks]
        assert rest == base, name


def test_the_study_accepts_the_parts(study, monkeypatch, tmp_path):
    """Each run of ``PARTS`` and ``BASELINES`` (docs/ALGORITHM.md §4.5) builds through the
    CLI with its parts."""
    import maxent_grpo.cli.parser as cli_module

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(sys, "argv", sys.argv[:1])
    monkeypatch.chdir(tmp_path)
    for name in [*study.PARTS, *study.BASELINES, *study.ANSWERS]:
        cli = cli_module.main(study.run_args("a", name, 0, 2, str(tmp_path)),
                              run=False)
        objective = cli.model.objective
        spec = json.loads(study.RUNS[name]["objective"])["init_args"]
        for option in ("advantage", "ratio_level", "clip_rule", "pass_k",
                       "top_entropy_quantile", "answer_shaping", "answer_level"):
            if option in spec:
                assert getattr(objective, option) == spec[option], (name, option)
        expected_iterations = 2 if "--model.num_iterations" in study.RUNS[name].get("args",
                                                                                  []) else 1
        assert cli.model.loop.optimization.schedule.num_iterations == expected_iterations


def test_the_smollm2_task_keeps_its_config_and_each_runs_group_filter(study, monkeypatch,
                                                                    tmp_path):
    """Task ``s`` runs configs/smollm2_sets.yaml (no tiny-config schedule); GRPO drops every
    constant group there, the answer-level run keeps the solved ones."""
    import maxent_grpo.cli.parser as cli_module

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(sys, "argv", sys.argv[:1])
    monkeypatch.chdir(tmp_path)
    solved = {}
    for name in ("GRPO", "Listwise(answers)"):
        argv = study.run_args("s", name, 0, 2, str(tmp_path))
        assert "configs/smollm2_sets.yaml" in argv[1] and "--model.lr_scheduler" not in " ".join(
            argv)
        cli = cli_module.main(argv, run=False)
        assert cli.datamodule.hparams.task == "number_sets"
        assert cli.model.rewards.names == ["in_set"]
        solved[name] = cli.model.loop.generation.solved_reward
    assert solved == {"GRPO": None, "Listwise(answers)": 1.0}
    cli = cli_module.main(study.run_args("v", "GRPO", 0, 2, str(tmp_path)), run=False)
    data = cli.datamodule.hparams  # task v: the same config, another task
    assert (data.task, data.val_size, cli.model.rewards.names) == ("divisors", 20, ["in_set"])


def test_the_issue_38_runs_are_valid(study, monkeypatch):
    """The baselines and mechanisms added for the real-model study are well-formed runs (a
    schedule over the run gets the run's steps); the one with a callback trains two steps
    (the objectives' options are checked by their own tests)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(sys, "argv", sys.argv[:1])
    from maxent_grpo import objectives

    for objective in ("W-REINFORCE(0.1)", "GRPO+set_diversity",
                      "Listwise(answers,right,beta=0.04)", "Listwise(answers,G=16)"):
        args = study.run_args("b", objective, 0, 7, "/tmp/x")
        spec = json.loads(args[args.index("--model.objective") + 1])  # builds as given
        getattr(objectives, spec["class_path"].rsplit(".", 1)[1])(**spec["init_args"])
    args = study.run_args("b", "Listwise(answers)+TauAnneal", 0, 7, "/tmp/x")
    callbacks = json.loads(args[args.index("--trainer.callbacks") + 1])
    assert callbacks[0]["init_args"]["target_entropy_horizon"] == 7
    record = study.run_one("b", "Listwise(answers)+TauAnneal", seed=0, steps=2)
    assert record["trained"] and len(record["curve"]["reward"]) == 2


def test_the_dynamics_table_windows_each_run_by_its_own_steps(study):
    """An objective of two optimizer steps a rollout (GSPO) logs a point every second step:
    the table cut every run to the shortest curve's point count and labelled points as steps
    (GRPO shown to half the run, GSPO's late points under early steps), and said G = 8
    whatever G was (a hunt)."""
    def run(objective, steps, values, g):
        return {"task": "b", "objective": objective, "num_generations": g,
                "curve": {"steps": steps, "distinct_correct": values,
                          "answer_entropy": [0.0] * len(values)}}

    grpo = run("GRPO", list(range(1, 41)), [1.0] * 20 + [2.0] * 20, 8)
    gspo = run("GSPO", list(range(2, 41, 2)), [3.0] * 10 + [4.0] * 10, 8)
    lines = study._dynamics({"runs": [grpo, gspo]}, "b")
    assert "per group of G = 8 samples" in lines[0]
    head = lines[1]
    assert "steps 1-20" in head and "steps 21-40" in head
    last = [c.strip() for c in lines[3].split("|")[1:-1]], [
        c.strip() for c in lines[4].split("|")[1:-1]]
    assert last[0][0] == "GRPO" and last[0][1] == "1.00 / 0.00" and last[0][-1] == "2.00 / 0.00"
    assert last[1][0] == "GSPO" and last[1][1] == "3.00 / 0.00" and last[1][-1] == "4.00 / 0.00"
    gspo["num_generations"] = 16
    assert "G (GRPO: 8, GSPO: 16)" in study._dynamics({"runs": [grpo, gspo]}, "b")[0]
    # seeds of one objective merged from studies of different G: both named (the last was)
    again = run("GRPO", list(range(1, 41)), [1.0] * 40, 16)
    assert "G (GRPO: 8 and 16, GSPO: 16)" in study._dynamics(
        {"runs": [grpo, again, gspo]}, "b")[0]
    # a step that logged no reward (NaN) counts in no mean: the console line read nan
    assert study._mean([1.0, math.nan, 3.0]) == 2.0 and math.isnan(study._mean([math.nan]))


def test_merge_refuses_studies_of_other_steps(study, tmp_path):
    parts = []
    for steps in (2, 6):
        path = tmp_path / f"s{steps}.json"
        path.write_text(json.dumps({"meta": {"steps": steps, "ks": [1], "minutes": 1},
                                    "runs": []}))
        parts.append(str(path))
    with pytest.raises(SystemExit, match="has 6 steps and ks .* only studies of the same"):
        study.main(["--merge", *parts, "--out", str(tmp_path / "m.json")])


def test_merge_drops_a_failure_another_part_holds_and_keeps_one_none_holds(study, tmp_path):
    def part(name, runs, failed):
        path = tmp_path / name
        path.write_text(json.dumps({"meta": {"steps": 2, "ks": [1], "minutes": 1,
                                             "failed": failed}, "runs": runs}))
        return str(path)

    run = {"task": "b", "objective": "GRPO", "seed": 0}
    gone = {"task": "b", "objective": "GSPO", "seed": 0, "error": "boom"}
    first = part("a.json", [], [dict(run, error="boom"), gone])
    second = part("b.json", [run], [])
    study.report = lambda path: ""  # the tables and figure are not what is tested
    study.main(["--merge", first, second, "--out", str(tmp_path / "m.json")])
    merged = json.loads((tmp_path / "m.json").read_text())["meta"]
    assert merged["failed"] == [gone]

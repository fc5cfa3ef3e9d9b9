"""benchmarks/maxent_vs_grpo.py in miniature: every objective of the study runs a couple of
steps of the multi-answer task and reports every metric the study tabulates."""

from __future__ import annotations

import importlib.util
import json
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
            for k in (1, 4, 8)
        }
        m = record["metrics"]
        assert 0 <= m["coverage@1"] <= m["coverage@8"] <= 1
        assert m["pass@1"] <= m["pass@8"] and m["distinct_correct@1"] <= m["distinct_correct@8"]
        json.dumps(record)  # the study writes it as JSON


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
    import maxent_grpo.cli as cli_module

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(sys, "argv", sys.argv[:1])
    monkeypatch.chdir(tmp_path)
    for name in [*study.PARTS, *study.BASELINES]:
        cli = cli_module.main(study.run_args("a", name, 0, 2, str(tmp_path)),
                              run=False)
        objective = cli.model.objective
        spec = json.loads(study.RUNS[name]["objective"])["init_args"]
        for option in ("advantage", "ratio_level", "clip_rule", "pass_k",
                       "top_entropy_quantile"):
            if option in spec:
                assert getattr(objective, option) == spec[option], (name, option)
        expected_iterations = 2 if "--model.num_iterations" in study.RUNS[name].get("args",
                                                                                  []) else 1
        assert cli.model.loop.optimization.schedule.num_iterations == expected_iterations

"""Writes analyse_runs.ipynb from the cells below (edit here, then run this file), so the
notebook's source stays reviewable as plain Python. Outputs are not stored."""

from __future__ import annotations

from pathlib import Path

import nbformat

CELLS = [
    ("markdown", """# Reading maxent-grpo runs

Plots a run's TensorBoard scalars — reward, KL, entropy, τ, β, pass@k — and compares runs
side by side (for example GRPO against listwise MaxEnt on the same task).

Pick the runs with the environment variable `MAXENT_GRPO_RUNS` (run folders separated by
`:`, e.g. `lightning_logs/tiny/version_0:lightning_logs/tiny_controllers/version_0`); without
it the two training runs under `lightning_logs/` written last are shown (a `validate`,
`test` or `predict` folder is passed over). Two runs to compare, GRPO and
listwise MaxEnt with the τ/β controllers, on the same task:

```
python -m maxent_grpo fit --config configs/tiny.yaml
python -m maxent_grpo fit --config configs/tiny_controllers.yaml
```"""),
    ("code", """import os
from pathlib import Path

from IPython.display import Markdown, display

from maxent_grpo.analysis import find_runs, load_run, plot_runs, recent_runs, summary_rows

SMOOTH = 10  # moving-average window over training steps (1 = raw)
if os.environ.get("MAXENT_GRPO_RUNS"):
    runs = [load_run(Path(p)) for p in os.environ["MAXENT_GRPO_RUNS"].split(os.pathsep) if p]
else:
    try:
        runs = recent_runs(2, "lightning_logs")
        if not runs and find_runs("lightning_logs"):  # a fit before its first step
            print("no step logged yet in the runs under lightning_logs/")
    except FileNotFoundError as err:  # no lightning_logs/ here or above
        print(err)
        runs = []
for run in runs:
    print(f"{run.label}: {len(run.scalars)} scalar tags from {run.path}"
          + ("" if run.scalars else " (no step logged yet: left out)"))
runs = [run for run in runs if run.scalars]
if not runs:  # the cells on runs are skipped; the study's below still run
    print("no runs to show: train first (python -m maxent_grpo fit --config configs/tiny.yaml) "
          "or name run folders in MAXENT_GRPO_RUNS (this reads TensorBoard's event files: a "
          "run logged by a CSVLogger alone has none)")"""),
    ("markdown", """## Curves

One panel per quantity, one line per run. Panels that no run logged are left out (KL needs
a reference, i.e. `beta > 0` or a listwise objective; τ and β are the MaxEnt objectives'
temperatures; pass@k comes from validation, `model.eval_k`)."""),
    ("code", """import matplotlib.pyplot as plt

if runs:
    fig = plot_runs(runs, smooth=SMOOTH)
    display(fig)
    plt.close(fig)"""),
    ("markdown", "## Last values"),
    ("code", """def cell(v):
    return "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))
if runs:
    rows = summary_rows(runs)
    columns = list(rows[0])
    table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    table += ["| " + " | ".join(cell(row[c]) for c in columns) + " |" for row in rows]
    display(Markdown("\\n".join(table)))"""),
    ("markdown", """## Any other tag

Every scalar the trainer logs is in `run.scalars` (see docs/LOGGING.md, "TensorBoard" for
the list); for example the time each step spent generating versus scoring:"""),
    ("code", """if runs:
    fig, ax = plt.subplots(figsize=(6, 3))
    for run in runs:
        for tag in ("train/perf/generate_s", "train/perf/score_s", "train/perf/backward_s"):
            if tag in run.scalars:
                s = run.scalars[tag]
                ax.plot(s.steps, s.values, label=f"{run.label} {tag.rsplit('/', 1)[1]}")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=7)
    display(fig)
    plt.close(fig)"""),
    ("markdown", """## GRPO against MaxEnt: the study

`benchmarks/maxent_vs_grpo.py` trains GRPO, the MaxEnt objectives and the literature's
diversity methods with several seeds on each task, evaluates the starting model too, and
writes `benchmarks/results/maxent_vs_grpo.json` (the earlier study is
`maxent_vs_grpo_2026-12-01.json`); set `MAXENT_GRPO_STUDY` to read another file. Left: the
training reward and the answer entropy per method, the mean over seeds with the seeds'
range shaded; then pass@k, mean@k, coverage@k and distinct_correct@k against k, mean ± sd
over seeds. One colour per method throughout."""),
    ("code", """import os
from pathlib import Path

import matplotlib.pyplot as plt
from IPython.display import Markdown, display

from maxent_grpo.analysis import format_study_table, load_study, plot_study, study_table
from maxent_grpo.analysis.runs import locate

STUDY_FILE = "benchmarks/results/maxent_vs_grpo.json"  # relative to the repository root
if os.environ.get("MAXENT_GRPO_STUDY"):  # a relative path: from here or a folder above
    try:
        study_path = locate(os.environ["MAXENT_GRPO_STUDY"])
    except FileNotFoundError as err:
        raise FileNotFoundError(f"MAXENT_GRPO_STUDY: {err}") from None
    candidates = [study_path]
else:  # the notebook runs from the repository root or from notebooks/
    candidates = [Path(STUDY_FILE), Path("..") / STUDY_FILE]
    study_path = next((p for p in candidates if p.is_file()), None)
study = load_study(study_path) if study_path else None
if study is None:
    print(f"no study at {candidates[0]}: produce it with python benchmarks/maxent_vs_grpo.py")
else:
    meta = study.get("meta", {})
    print(f"{study_path}: {len(study['runs'])} runs, commit {meta.get('commit', '?')}, "
          f"{meta.get('date', '?')}, seeds {meta.get('seeds', '?')}")
    fig = plot_study(study, smooth=10)
    display(fig)
    plt.close(fig)"""),
    ("code", """if study is not None:
    ks = study.get("meta", {}).get("ks") or sorted(
        {int(m.split("@")[1]) for run in study["runs"] for m in run["metrics"]})
    metrics = [f"{family}@{k}" for family in ("pass", "mean", "distinct_correct", "coverage")
               for k in ks]
    labels = {run["task"]: run.get("task_label", run["task"]) for run in study["runs"]}
    for task, label in labels.items():
        rows = study_table(study, task)
        shown = [m for m in metrics if any(m in row for row in rows)]
        display(Markdown(f"### {label}\\n\\n" + format_study_table(rows, shown)))"""),
]


def build() -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3", "display_name": "Python 3", "language": "python"
    }
    make = {"markdown": nbformat.v4.new_markdown_cell, "code": nbformat.v4.new_code_cell}
    # fixed cell ids, so that regenerating an unchanged notebook leaves the file unchanged
    nb.cells = [make[kind](source, id=f"cell-{i:02d}") for i, (kind, source) in enumerate(CELLS)]
    return nb


if __name__ == "__main__":
    path = Path(__file__).with_name("analyse_runs.ipynb")
    nbformat.write(build(), path)
    print(f"wrote {path}")

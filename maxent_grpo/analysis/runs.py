"""Reading a run's TensorBoard events back for plots and comparisons.

A *run* is one ``lightning_logs/<name>/version_N`` folder of the trainer's TensorBoardLogger:
:func:`load_run` reads its scalars into :class:`Series` (in step order), :func:`plot_runs`
draws the standard panels (reward, KL, entropy, τ, β, pass@k, ...) one line per run, and
:func:`summary_rows` gives each panel's last value per run (``notebooks/analyse_runs.ipynb``).
A *study* is the JSON of ``benchmarks/maxent_vs_grpo.py`` (objectives x seeds x tasks):
:func:`load_study` reads it, :func:`study_table` / :func:`format_study_table` give mean ± sd
over seeds per objective, :func:`plot_study` draws it, one colour per objective. Reading
needs ``tensorboard``; plotting ``matplotlib`` (in the ``dev`` extra).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["PANELS", "Run", "Series", "STUDY_FAMILIES", "find_runs", "format_study_table",
           "load_run", "load_study", "plot_runs", "plot_study", "study_table", "summary_rows"]


@dataclass(frozen=True)
class Series:
    """One scalar tag: ``steps[i]`` is the global step of ``values[i]``."""

    steps: tuple[int, ...]
    values: tuple[float, ...]

    @property
    def last(self) -> float:
        return self.values[-1]


@dataclass(frozen=True)
class Run:
    """A run folder's scalars by tag, and a label (the objective and the folder)."""

    path: Path
    label: str
    scalars: Mapping[str, Series]

    def tags(self, prefix: str = "") -> list[str]:
        return sorted(t for t in self.scalars if t.startswith(prefix))


# (title, tags): a panel plots every listed tag the run has; a tag ending in "*" matches
# every tag with that prefix (e.g. each k of val/pass@k), per-task breakdowns excluded.
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward (train)", ("train/reward/mean",)),
    ("reward (validation)", ("val/reward/mean",)),
    ("pass@k (validation)", ("val/pass@*", "val/greedy_pass@1")),
    ("KL to the reference", ("train/kl",)),
    ("token entropy", ("train/entropy",)),
    ("MaxEnt weight entropy", ("train/weight_entropy",)),
    ("tau", ("train/tau",)),
    ("beta", ("train/beta",)),
    ("completion length", ("train/tokens/completion_length/mean",)),
    ("zero-std groups", ("train/reward/zero_std_frac",)),
)


def locate(path: str | os.PathLike) -> Path:
    """``path`` as given when it exists (or is absolute), else under the nearest parent of
    the working folder that holds it: a notebook runs from ``notebooks/``, the commands
    from the repository root, and relative run paths mean the same from both.

    Raises:
        FileNotFoundError: naming every folder that was looked in.
    """
    path = Path(path).expanduser()
    if path.is_absolute() or path.exists():
        if not path.exists():
            raise FileNotFoundError(f"no folder {path}")
        return path
    looked = [Path.cwd(), *Path.cwd().parents]
    for folder in looked:
        if (folder / path).exists():
            return folder / path
    raise FileNotFoundError(
        f"no folder {path} in the working folder {looked[0]} or any folder above it")


def find_runs(root: str | os.PathLike = "lightning_logs") -> list[Path]:
    """Every folder under ``root`` (found by :func:`locate`) holding TensorBoard event
    files, oldest first."""
    try:
        root = locate(root)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{err}: train first (python -m maxent_grpo fit)") from None
    runs = {p.parent for p in root.rglob("events.out.tfevents.*")}
    return sorted(runs, key=lambda p: min(f.stat().st_mtime for f in p.glob("events.*")))


def _label(path: Path) -> str:
    """``<objective class> <name>/<version>``; the objective is read from the config.yaml
    that the CLI saves beside the events (absent for runs made without the CLI)."""
    name = f"{path.parent.name}/{path.name}"
    config = path / "config.yaml"
    if config.is_file():
        import yaml

        data = yaml.safe_load(config.read_text()) or {}
        objective = (data.get("model") or {}).get("objective")
        if isinstance(objective, dict) and "class_path" in objective:
            cls = objective["class_path"].rsplit(".", 1)[-1]
            loss = (objective.get("init_args") or {}).get("loss_type")
            return f"{cls}{f'({loss})' if loss else ''} {name}"
    return name


def load_run(path: str | os.PathLike, label: str | None = None) -> Run:
    """Read all scalars of one run folder (every event file in it, e.g. after a resume).

    ``path`` may be relative to the working folder or to a folder above it (:func:`locate`).

    Raises:
        FileNotFoundError: no such folder, or it has no event files.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path = locate(path)
    if not any(path.glob("events.out.tfevents.*")):
        raise FileNotFoundError(f"{path} has no TensorBoard event files, which this reads" + (
            " (its metrics.csv is a CSVLogger's: add a TensorBoardLogger to trainer.logger)"
            if (path / "metrics.csv").is_file() else "; pass a lightning_logs/<name>/version_N"))
    # the folder's files read as TensorBoard reads them: a resume's purge_step removes the
    # points the earlier files hold from that step on (also those never written again, as
    # after a rollback to a shorter run); a step written twice without a purge keeps its
    # last value by wall time
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    events = {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}
    scalars: dict[str, Series] = {}
    for tag, written in events.items():
        by_step = {e.step: e.value for e in sorted(written, key=lambda e: e.wall_time)}
        steps = tuple(sorted(by_step))
        scalars[tag] = Series(steps, tuple(float(by_step[s]) for s in steps))
    return Run(path=path, label=label or _label(path), scalars=scalars)


def _panel_tags(run: Run, patterns: Iterable[str]) -> list[str]:
    tags: list[str] = []
    for pattern in patterns:
        if pattern.endswith("*"):
            prefix = pattern[:-1]
            # "val/pass@4" matches, its per-task "val/pass@4/countdown" does not
            tags += [t for t in run.tags(prefix) if "/" not in t[len(prefix):]]
        elif pattern in run.scalars:
            tags.append(pattern)
    return tags


def _smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` points (``window <= 1``: unchanged) of the
    finite ones (a NaN, a step that did not log it, counts in none); NaN where there are none."""
    if window <= 1:
        return list(values)
    out = []
    for i in range(len(values)):
        seen = [v for v in values[max(0, i + 1 - window):i + 1] if math.isfinite(v)]
        out.append(math.fsum(seen) / len(seen) if seen else math.nan)
    return out


def _colours(n: int) -> list[str]:
    """The first ``n`` colours of matplotlib's default cycle (``C0``, ``C1``, ..., wrapping)."""
    import matplotlib.pyplot as plt

    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return [cycle[i % len(cycle)] for i in range(n)]


# the k-th tag of a panel (e.g. val/pass@1, val/pass@4, ...) is drawn in style k, in every run
_STYLES: tuple[tuple[str, str], ...] = (
    ("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ("-", "v"), ("--", "P"), (":", "X"),
)


def _style(i: int) -> tuple[str, str]:
    """``(linestyle, marker)`` of a panel's ``i``-th tag."""
    return _STYLES[i % len(_STYLES)]


def _panel_legend(ax: Any, runs: Sequence[tuple[str, str]], tags: Sequence[str]) -> None:
    """A legend of one coloured entry per ``(label, colour)`` run plus, when the panel has
    several tags, one grey entry per tag showing its line style and marker."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=colour, label=label) for label, colour in runs]
    for i, tag in enumerate(tags if len(tags) > 1 else ()):
        linestyle, marker = _style(i)
        handles.append(Line2D([], [], color="0.4", linestyle=linestyle, marker=marker,
                              label=tag.split("/", 1)[-1]))
    ax.legend(handles=handles, fontsize=7)


def plot_runs(
    runs: Sequence[Run],
    panels: Sequence[tuple[str, Sequence[str]]] = PANELS,
    smooth: int = 1,
    columns: int = 3,
) -> Any:
    """One subplot per panel, one line per (run, tag); returns the matplotlib Figure.

    Run ``i`` has colour ``C{i}`` (matplotlib's default cycle) in every panel; a panel with
    several tags (pass@1, pass@4, ...) tells them apart by line style and marker, and its
    legend lists the runs (colours) and the tags (styles) once each. Panels no run has are
    left out; ``smooth`` is a trailing moving-average window over logged points (validation
    curves are never smoothed).
    """
    import matplotlib.pyplot as plt

    if not runs:
        raise ValueError("runs must hold at least one Run (see load_run)")
    used = [(title, pats) for title, pats in panels if any(_panel_tags(r, pats) for r in runs)]
    if not used:
        raise ValueError("none of the runs logged any of the panels' tags")
    colours = _colours(len(runs))
    rows = -(-len(used) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.2 * rows), squeeze=False)
    for ax, (title, patterns) in zip(axes.flat, used, strict=False):
        tags = list(dict.fromkeys(t for run in runs for t in _panel_tags(run, patterns)))
        shown = []
        for run, colour in zip(runs, colours, strict=True):
            run_tags = _panel_tags(run, patterns)
            for tag in run_tags:
                series = run.scalars[tag]
                window = 1 if tag.startswith(("val/", "test/")) else smooth
                linestyle, marker = _style(tags.index(tag))
                ax.plot(series.steps, _smooth(series.values, window), color=colour,
                        linestyle=linestyle, label=f"{run.label} {tag}",
                        marker=marker if len(tags) > 1 or len(series.steps) < 20 else None,
                        markevery=max(1, len(series.steps) // 10))
            if run_tags:
                shown.append((run.label, colour))
        _panel_legend(ax, shown, tags)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(used):]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig


def summary_rows(
    runs: Sequence[Run], panels: Sequence[tuple[str, Sequence[str]]] = PANELS
) -> list[dict[str, Any]]:
    """The last logged value of every panel tag, one row per run (``None`` = not logged), and
    ``last_step``, the run's last logged global step (steps count from 0)."""
    tags = sorted({t for run in runs for _, pats in panels for t in _panel_tags(run, pats)})
    return [
        {"run": run.label,
         "last_step": max((s.steps[-1] for s in run.scalars.values()), default=None)}
        | {tag: (run.scalars[tag].last if tag in run.scalars else None) for tag in tags}
        for run in runs
    ]


# ----------------------------------------------------------------------------------------------
# Study results (benchmarks/maxent_vs_grpo.py): several objectives x seeds x tasks in one JSON

STUDY_FAMILIES: tuple[str, ...] = ("pass", "mean", "coverage", "distinct_correct")
_RUN_KEYS: tuple[str, ...] = ("task", "objective", "seed", "curve", "metrics")


def load_study(path: str | os.PathLike) -> dict[str, Any]:
    """Read a study JSON (``{"meta": {...}, "runs": [{task, objective, seed, curve: {steps,
    reward[, answer_entropy, distinct_correct]}, metrics: {"pass@1": ...}}, ...]}``; a run
    with ``"trained": false``, the starting model, has an empty curve) and check its shape.

    Raises:
        ValueError: naming the file, when it is not JSON, has no ``runs`` list, or a run
            lacks ``task``, ``objective``, ``seed``, ``curve`` (a non-empty ``reward``
            unless not trained) or ``metrics``.
    """
    path = Path(path)
    try:
        study = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not JSON: {err}") from err
    if not isinstance(study, dict) or not isinstance(study.get("runs"), list):
        raise ValueError(f"{path} has no 'runs' list (see benchmarks/maxent_vs_grpo.py)")
    for i, run in enumerate(study["runs"]):
        if not isinstance(run, dict) or not isinstance(run.get("curve", {}), dict):
            raise ValueError(f"{path}: runs[{i}] is not a study run ({{task, objective, seed, "
                             "curve: {steps, reward, ...}, metrics}; see "
                             "benchmarks/maxent_vs_grpo.py)")
        missing = [k for k in _RUN_KEYS if k not in run]
        if "curve" in run and not run["curve"].get("reward") and run.get("trained", True):
            missing.append("curve.reward")  # absent or empty
        if missing:
            raise ValueError(f"{path}: runs[{i}] lacks {', '.join(missing)}")
    return study


def _in_order(runs: Iterable[Mapping[str, Any]], key: str) -> list[str]:
    """The distinct values of ``run[key]`` in the order they first appear in ``runs``."""
    return list(dict.fromkeys(run[key] for run in runs))


def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample sd ``sqrt(sum (x - mean)^2 / (n - 1))`` of the finite values (NaN:
    none; the sd NaN from one: no spread to show, where it read ``± 0.000``)."""
    finite = [v for v in values if math.isfinite(v)]
    return (statistics.fmean(finite) if finite else math.nan,
            statistics.stdev(finite) if len(finite) > 1 else math.nan)


def study_table(study: Mapping[str, Any], task: str) -> list[dict[str, Any]]:
    """One row per objective (display order) of ``task``, aggregated over its seeds.

    A row holds ``objective``, ``seeds`` (how many runs) and, for every metric key ``m``
    some seed reports (a NaN is none), ``row[m]``, ``row[m + "_sd"]`` and ``row[m + "_n"]``:
    mean, :func:`_mean_sd`'s sd and count; likewise ``reward_first20`` / ``reward_last20``,
    each seed's mean reward over the first / last 20 points (rollouts) of its curve.
    """
    runs = [run for run in study["runs"] if run["task"] == task]
    if not runs:
        raise ValueError(f"no runs of task {task!r}; tasks: {_in_order(study['runs'], 'task')}")
    rows = []
    for objective in _in_order(runs, "objective"):
        mine = [run for run in runs if run["objective"] == objective]
        samples: dict[str, list[float]] = {}
        for run in mine:
            reward = run["curve"]["reward"]
            values = dict(run["metrics"]) | ({  # the starting model has no training curve
                "reward_first20": _mean_sd(reward[:20])[0],  # of the points that logged it
                "reward_last20": _mean_sd(reward[-20:])[0]} if reward else {})
            for key, value in values.items():
                samples.setdefault(key, []).append(float(value))
        row: dict[str, Any] = {"objective": objective, "seeds": len(mine)}
        for key, values in samples.items():
            row[key], row[f"{key}_sd"] = _mean_sd(values)
            row[f"{key}_n"] = sum(math.isfinite(v) for v in values)
        rows.append(row)
    return rows


def format_study_table(rows: Sequence[Mapping[str, Any]], metrics: Sequence[str]) -> str:
    """A markdown table of :func:`study_table` rows: objective, seeds, then ``mean ± sd``
    (3 decimals; one seed: the mean; ``(n=2)``: fewer seeds than the row's), else ``-``."""

    def cell(row: Mapping[str, Any], metric: str) -> str:
        if not math.isfinite(mean := row.get(metric, math.nan)):
            return "-"
        sd, n = row[f"{metric}_sd"], row.get(f"{metric}_n", row["seeds"])
        return (f"{mean:.3f}" + (f" ± {sd:.3f}" if math.isfinite(sd) else "")
                + (f" (n={n})" if n < row["seeds"] else ""))

    lines = ["| objective | seeds | " + " | ".join(metrics) + " |",
             "|---|---|" + "---|" * len(metrics)]
    lines += [f"| {row['objective']} | {row['seeds']} | "
              + " | ".join(cell(row, m) for m in metrics) + " |" for row in rows]
    return "\n".join(lines)


def _reward_band(
    runs: Sequence[Mapping[str, Any]], smooth: int, key: str = "reward"
) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps, mean, min and max over seeds of the ``key`` curves' smoothed (cut to the shortest)."""
    n = min(len(run["curve"][key]) for run in runs)
    curves = [_smooth(run["curve"][key][:n], smooth) for run in runs]
    steps = list(runs[0]["curve"].get("steps", range(n)))[:n]
    by_step = [[v for v in at if math.isfinite(v)] or [math.nan]  # the seeds that logged it
               for at in zip(*curves, strict=True)]
    return (steps, [statistics.fmean(v) for v in by_step],
            [min(v) for v in by_step], [max(v) for v in by_step])


def _metric_ks(rows: Sequence[Mapping[str, Any]], family: str) -> list[int]:
    """The ks of the ``family@k`` metrics (e.g. ``pass@4``) in the rows, ascending."""
    prefix = f"{family}@"
    return sorted({int(k[len(prefix):]) for row in rows for k in row
                   if k.startswith(prefix) and k[len(prefix):].isdigit()})


def _plot_family(ax: Any, rows: Sequence[Mapping[str, Any]], family: str,
                 colour_of: Mapping[str, str]) -> None:
    """``family@k`` against k: per objective a point at the mean over seeds with a ±1 sd
    error bar, objectives shifted slightly apart along x so their bars do not overlap."""
    ks = _metric_ks(rows, family)
    if not ks:
        ax.text(0.5, 0.5, f"no {family}@k for this task", ha="center", va="center",
                transform=ax.transAxes, fontsize=8)
        ax.axis("off")
        return
    width = 0.6 / len(rows)
    for i, row in enumerate(rows):
        shown = [(j, k) for j, k in enumerate(ks) if f"{family}@{k}" in row]
        ax.errorbar([j + (i - (len(rows) - 1) / 2) * width for j, _ in shown],
                    [row[f"{family}@{k}"] for _, k in shown],
                    yerr=[row[f"{family}@{k}_sd"] if math.isfinite(row[f"{family}@{k}_sd"])
                          else 0.0 for _, k in shown],  # one seed: no bar
                    color=colour_of[row["objective"]], marker="o", markersize=4,
                    linewidth=1, capsize=3, label=row["objective"])
    ax.set_xticks(range(len(ks)), [str(k) for k in ks])
    ax.set_xlabel("k")
    ax.set_title(f"{family}@k")
    ax.grid(alpha=0.3)


def plot_study(study: Mapping[str, Any], smooth: int = 10) -> Any:
    """Per task, one row: the training reward, answer entropy and right answers per group
    (the last two when recorded; mean over seeds of a ``smooth``-point trailing average,
    shaded over the seeds' range), then mean ± sd over seeds against k per metric family
    (pass, mean, coverage, distinct_correct@k). Objective ``i`` has colour ``C{i}``."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    tasks, objectives = _in_order(study["runs"], "task"), _in_order(study["runs"], "objective")
    if not tasks:
        raise ValueError("the study has no runs")
    colour_of = dict(zip(objectives, _colours(len(objectives)), strict=True))
    families = [f for f in STUDY_FAMILIES
                if any(k.startswith(f"{f}@") for run in study["runs"] for k in run["metrics"])]
    curves = ["reward"] + [key for key in ("answer_entropy", "distinct_correct")
                           if any(run["curve"].get(key) for run in study["runs"])]
    ncols = len(curves) + len(families)
    fig, axes = plt.subplots(len(tasks), ncols, squeeze=False, layout="constrained",
                             figsize=(4.2 * ncols, 3.2 * len(tasks) + 0.6))
    for task, row_axes in zip(tasks, axes, strict=True):
        runs = [run for run in study["runs"] if run["task"] == task]
        for ax, key in zip(row_axes, curves, strict=False):
            for name in _in_order(runs, "objective"):  # the starting model has no curve
                if mine := [r for r in runs if r["objective"] == name and r["curve"].get(key)]:
                    steps, mean, lo, hi = _reward_band(mine, smooth, key)
                    ax.fill_between(steps, lo, hi, color=colour_of[name], alpha=0.2, lw=0)
                    ax.plot(steps, mean, color=colour_of[name], label=name)
            what = {"answer_entropy": "answer entropy (nats)",
                    "distinct_correct": "right answers per group"}.get(key, key)
            ax.set(title=f"{runs[0].get('task_label', task)}: {what} (train)", xlabel="step")
            ax.title.set_fontsize(9)
            ax.grid(alpha=0.3)
        rows = study_table(study, task)
        has_sets = bool(_metric_ks(rows, "coverage"))
        for ax, family in zip(row_axes[len(curves):], families, strict=True):
            # without answer sets, an answer with no canonical form is text ("8" vs "8 ok")
            shown = rows if has_sets or family != "distinct_correct" else []
            _plot_family(ax, shown, family, colour_of)
    handles = [Line2D([], [], color=colour_of[o], label=o) for o in objectives]
    fig.legend(handles=handles, loc="outside upper center", ncol=min(len(objectives), 6),
               fontsize=8)
    return fig

"""Reading a study back: the JSON of ``benchmarks/maxent_vs_grpo.py``, several objectives x
seeds x tasks. :func:`load_study` reads it, :func:`study_table` / :func:`format_study_table`
give mean ± sd over seeds per objective, :func:`plot_study` draws it, one colour per
objective (plotting needs ``matplotlib``, in the ``dev`` extra).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from maxent_grpo.analysis.runs import colour_cycle, smoothed

__all__ = ["STUDY_FAMILIES", "format_study_table", "load_study", "plot_study", "study_table"]

STUDY_FAMILIES: tuple[str, ...] = ("pass", "mean", "coverage", "distinct_correct")
_RUN_KEYS: tuple[str, ...] = ("task", "objective", "seed", "curve", "metrics")


def load_study(path: str | os.PathLike) -> dict[str, Any]:
    """Read a study JSON (``{"meta": {...}, "runs": [{task, objective, seed, curve: {steps,
    reward[, answer_entropy, distinct_correct]}, metrics: {"pass@1": ...}}, ...]}``; a run
    with ``"trained": false``, the starting model, has an empty curve) and check its shape.

    A ``null`` metric or curve point (a strict JSON writer's NaN) is read as NaN: missing.

    Raises:
        ValueError: naming the file, when it is not JSON, has no ``runs`` list, or a run
            lacks ``task``, ``objective``, ``seed``, ``curve`` (a non-empty ``reward``
            unless not trained) or ``metrics``, or holds a metric or point that is not a
            number.
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
        if not isinstance(run["metrics"], dict):
            raise ValueError(f"{path}: runs[{i}].metrics is not a mapping of names to numbers")
        for where, values in [("metrics", run["metrics"]), *(
                (f"curve.{k}", dict(enumerate(v))) for k, v in run["curve"].items()
                if isinstance(v, list))]:
            for key, value in values.items():  # null: a strict JSON writer's NaN, missing
                if value is None:
                    (run["metrics"] if where == "metrics" else run["curve"][where[6:]])[
                        key] = math.nan
                elif isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ValueError(f"{path}: runs[{i}].{where}[{key!r}] is {value!r}, not "
                                     "a number (or null for a missing value)")
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
    curves = [smoothed(run["curve"][key][:n], smooth) for run in runs]
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
    colour_of = dict(zip(objectives, colour_cycle(len(objectives)), strict=True))
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

"""Reading a run's TensorBoard events back for plots and comparisons.

A *run* is one ``lightning_logs/<name>/version_N`` folder written by the trainer's
TensorBoardLogger. :func:`load_run` reads every scalar in it into :class:`Series`
(steps and values, in step order), :func:`plot_runs` draws the standard panels (reward, KL,
entropy, τ, β, pass@k, ...) with one line per run, and :func:`summary_rows` gives the last
value of each panel per run, for a table. ``notebooks/analyse_runs.ipynb`` uses all three.

Only ``tensorboard`` is needed to read; plotting needs ``matplotlib`` (``pip install
matplotlib``, included in the ``dev`` extra).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "PANELS",
    "Run",
    "Series",
    "find_runs",
    "load_run",
    "plot_runs",
    "summary_rows",
]


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


def find_runs(root: str | os.PathLike = "lightning_logs") -> list[Path]:
    """Every folder under ``root`` holding TensorBoard event files, oldest first."""
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"no run folder {root}: train first (python -m maxent_grpo fit)")
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

    Raises:
        FileNotFoundError: the folder has no event files.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path = Path(path)
    if not any(path.glob("events.out.tfevents.*")):
        raise FileNotFoundError(
            f"{path} has no TensorBoard event files; pass a lightning_logs/<name>/version_N folder"
        )
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    scalars: dict[str, Series] = {}
    for tag in acc.Tags()["scalars"]:
        # a resumed run rewrites steps after the checkpoint: keep the latest value per step
        by_step = {e.step: e.value for e in acc.Scalars(tag)}
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
    """Trailing moving average over ``window`` points (``window <= 1``: unchanged)."""
    if window <= 1:
        return list(values)
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_runs(
    runs: Sequence[Run],
    panels: Sequence[tuple[str, Sequence[str]]] = PANELS,
    smooth: int = 1,
    columns: int = 3,
) -> Any:
    """One subplot per panel, one line per (run, tag); returns the matplotlib Figure.

    Panels no run has are left out; ``smooth`` is a trailing moving-average window over
    logged points (validation curves are never smoothed).
    """
    import matplotlib.pyplot as plt

    if not runs:
        raise ValueError("runs must hold at least one Run (see load_run)")
    used = [(title, pats) for title, pats in panels if any(_panel_tags(r, pats) for r in runs)]
    if not used:
        raise ValueError("none of the runs logged any of the panels' tags")
    rows = -(-len(used) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.2 * rows), squeeze=False)
    for ax, (title, patterns) in zip(axes.flat, used, strict=False):
        for run in runs:
            for tag in _panel_tags(run, patterns):
                series = run.scalars[tag]
                window = 1 if tag.startswith(("val/", "test/")) else smooth
                label = run.label if len(_panel_tags(run, patterns)) == 1 else \
                    f"{run.label} {tag.split('/', 1)[1]}"
                ax.plot(series.steps, _smooth(series.values, window), label=label,
                        marker="o" if len(series.steps) < 20 else None)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(used):]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig


def summary_rows(
    runs: Sequence[Run], panels: Sequence[tuple[str, Sequence[str]]] = PANELS
) -> list[dict[str, Any]]:
    """The last logged value of every panel tag, one row per run (``None`` = not logged)."""
    tags = sorted({t for run in runs for _, pats in panels for t in _panel_tags(run, pats)})
    return [
        {"run": run.label, "steps": max((s.steps[-1] for s in run.scalars.values()), default=0)}
        | {tag: (run.scalars[tag].last if tag in run.scalars else None) for tag in tags}
        for run in runs
    ]

"""Reading a run's TensorBoard events back for plots and comparisons.

A *run* is one ``lightning_logs/<name>/version_N`` folder of the trainer's TensorBoardLogger:
:func:`load_run` reads its scalars into :class:`Series` (in step order), :func:`plot_runs`
draws the standard panels (reward, KL, entropy, τ, β, pass@k, ...) one line per run, and
:func:`summary_rows` gives each panel's last value per run (``notebooks/analyse_runs.ipynb``);
:func:`recent_runs` picks the latest training runs. Studies: :mod:`~maxent_grpo.analysis.
studies`. Reading needs ``tensorboard``; plotting ``matplotlib`` (in the ``dev`` extra).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["PANELS", "Run", "Series", "find_runs", "load_run", "plot_runs", "recent_runs",
           "summary_rows"]


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
            raise FileNotFoundError(f"no file or folder {path}")
        return path
    looked = [Path.cwd(), *Path.cwd().parents]
    for folder in looked:
        if (folder / path).exists():
            return folder / path
    raise FileNotFoundError(
        f"no file or folder {path} in the working folder {looked[0]} or any folder above it")


def find_runs(root: str | os.PathLike = "lightning_logs") -> list[Path]:
    """Every folder under ``root`` (found by :func:`locate`) holding TensorBoard event
    files, by their last write, oldest first (a resumed run counts from its resume)."""
    try:
        root = locate(root)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{err}: train first (python -m maxent_grpo fit)") from None
    runs = {p.parent for p in root.rglob("events.out.tfevents.*")}
    return sorted(runs, key=lambda p: max(f.stat().st_mtime for f in p.glob("events.*")))


def recent_runs(n: int = 2, root: str | os.PathLike = "lightning_logs") -> list[Run]:
    """The ``n`` training runs under ``root`` last written, read, oldest first: a folder
    without a ``train/`` scalar (a ``validate`` or ``test`` run, a fit before its first
    step or one that failed before it) is passed over."""
    found: list[Run] = []
    for path in reversed(find_runs(root)):
        if len(found) == n:
            break
        if (run := load_run(path)).tags("train/"):
            found.append(run)
    return found[::-1]


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
    # last value by wall time; a tag whose every point a purge removed is not there
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    events = {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}
    scalars: dict[str, Series] = {}
    for tag, written in events.items():
        by_step = {e.step: e.value for e in sorted(written, key=lambda e: e.wall_time)}
        steps = tuple(sorted(by_step))
        if steps:
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


def smoothed(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` points (``window <= 1``: unchanged) of the
    finite ones (a NaN, a step that did not log it, counts in none); NaN where there are none."""
    if window <= 1:
        return list(values)
    out = []
    for i in range(len(values)):
        seen = [v for v in values[max(0, i + 1 - window):i + 1] if math.isfinite(v)]
        out.append(math.fsum(seen) / len(seen) if seen else math.nan)
    return out


def colour_cycle(n: int) -> list[str]:
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
    colours = colour_cycle(len(runs))
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
                ax.plot(series.steps, smoothed(series.values, window), color=colour,
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
    ``last_step``, the last step its scalars were logged at: TensorBoard's step, which counts
    rollouts from 0 (the optimizer step less one; with ``model.num_iterations`` k, a rollout
    is k optimizer steps)."""
    tags = sorted({t for run in runs for _, pats in panels for t in _panel_tags(run, pats)})
    return [
        {"run": run.label,
         "last_step": max((s.steps[-1] for s in run.scalars.values()), default=None)}
        | {tag: (run.scalars[tag].last if tag in run.scalars else None) for tag in tags}
        for run in runs
    ]

"""Reading runs and studies back, for notebooks and benchmarks; never imported by the
trainer (:mod:`~maxent_grpo.analysis.runs`: ``load_run``, ``plot_runs``, ``recent_runs``, ...;
:mod:`~maxent_grpo.analysis.studies`: ``load_study``, ``plot_study``, ...).
``from maxent_grpo.analysis import load_run``."""

from maxent_grpo.analysis.runs import (
    PANELS,
    Run,
    Series,
    find_runs,
    load_run,
    plot_runs,
    recent_runs,
    summary_rows,
)
from maxent_grpo.analysis.studies import (
    STUDY_FAMILIES,
    format_study_table,
    load_study,
    plot_study,
    study_table,
)

__all__ = ["PANELS", "STUDY_FAMILIES", "Run", "Series", "find_runs", "format_study_table",
           "load_run", "load_study", "plot_runs", "plot_study", "recent_runs", "study_table",
           "summary_rows"]

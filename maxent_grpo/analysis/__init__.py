"""Reading runs and studies back, for notebooks and benchmarks; never imported by the
trainer (:mod:`~maxent_grpo.analysis.runs`: ``load_run``, ``plot_runs``, ``load_study``,
...). ``from maxent_grpo.analysis import load_run``."""

from maxent_grpo.analysis.runs import (
    PANELS,
    STUDY_FAMILIES,
    Run,
    Series,
    find_runs,
    format_study_table,
    load_run,
    load_study,
    plot_runs,
    plot_study,
    study_table,
    summary_rows,
)

__all__ = ["PANELS", "STUDY_FAMILIES", "Run", "Series", "find_runs", "format_study_table",
           "load_run", "load_study", "plot_runs", "plot_study", "study_table", "summary_rows"]

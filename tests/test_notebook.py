"""The analysis notebook on a machine with no run yet: it says so and runs to the end (the
cells on runs are skipped; the study's cells still run) instead of failing its second cell
with an ``IndexError``. With runs it is exercised by the slow end-to-end test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("logs", [None, "empty", "no-step"],
                         ids=["no-lightning_logs", "empty-lightning_logs", "run-without-steps"])
def test_the_notebook_without_runs_says_so_and_runs_every_cell(tmp_path, monkeypatch, logs):
    """``no-step``: a run started whose first step is not written yet (minutes with a real
    model); the curves cell stopped the notebook with "none of the runs logged any"."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    if logs:
        (tmp_path / "lightning_logs" / "tiny").mkdir(parents=True)
    if logs == "no-step":
        from torch.utils.tensorboard import SummaryWriter

        SummaryWriter(str(tmp_path / "lightning_logs" / "tiny" / "version_0")).close()
    monkeypatch.delenv("MAXENT_GRPO_RUNS", raising=False)
    path = [str(ROOT), os.environ.get("PYTHONPATH")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in path if p))
    nb = nbformat.read(ROOT / "notebooks/analyse_runs.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    errors = [f"{o.ename}: {o.evalue}" for o in outputs if o.output_type == "error"]
    assert not errors
    printed = "".join(o.get("text", "") for o in outputs)
    assert "no runs to show: train first" in printed
    assert ("no step logged yet" in printed) == (logs == "no-step")
    assert "no study at" in printed  # the last section ran too


@pytest.mark.parametrize("given", ["relative", "missing"])
def test_a_study_named_in_the_environment_is_found_from_a_folder_below_or_named_missing(
        tmp_path, monkeypatch, given):
    """``MAXENT_GRPO_STUDY`` relative to the repository, read by a kernel in ``notebooks/``,
    or mistyped: both printed "no study at ...: produce it with ..." (a hunt)."""
    import shutil

    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    shutil.copy(ROOT / "benchmarks/results/maxent_vs_grpo_2026-12-01.json", tmp_path / "s.json")
    (tmp_path / "notebooks").mkdir()
    monkeypatch.delenv("MAXENT_GRPO_RUNS", raising=False)
    monkeypatch.setenv("MAXENT_GRPO_STUDY", "s.json" if given == "relative" else "nope.json")
    path = [str(ROOT), os.environ.get("PYTHONPATH")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in path if p))
    nb = nbformat.read(ROOT / "notebooks/analyse_runs.ipynb", as_version=4)
    nb.cells = [c for c in nb.cells if "STUDY_FILE =" in c.source]  # the study's cell
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(tmp_path / "notebooks")}}
                            ).execute()
    outputs = nb.cells[0].outputs
    errors = [f"{o.ename}: {o.evalue}" for o in outputs if o.output_type == "error"]
    printed = "".join(o.get("text", "") for o in outputs)
    if given == "relative":
        assert not errors and f"{tmp_path / 's.json'}: " in printed, (errors, printed)
    else:
        assert errors and errors[0].startswith(
            "FileNotFoundError: MAXENT_GRPO_STUDY: no file or folder nope.json"), errors

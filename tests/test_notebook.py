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

"""The benchmarks' peak memory is each process's own (``bench_common.peak_rss_mib``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import bench_common as bc  # benchmarks/ is on sys.path (tests/conftest.py)
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux's /proc")
def test_a_worker_reports_its_own_peak_not_its_launchers():
    """``ru_maxrss`` is carried over fork and exec: trl_vs_ours's workers, started by a
    driver that had loaded SmolLM2, both reported the driver's 907 MiB for the tiny model."""
    ballast = bytearray(400 * 2**20)  # touched: 400 MiB more in this process's peak
    ballast[:: 4096] = b"\1" * len(ballast[:: 4096])
    parent = bc.peak_rss_mib()
    code = "import bench_common as bc; print(bc.peak_rss_mib())"
    out = subprocess.run([sys.executable, "-c", code], cwd=BENCH, capture_output=True,
                         text=True, check=True)
    child = float(out.stdout)
    del ballast
    assert parent > 400 and child < 100  # a bare interpreter's own peak is ~10 MiB
    if bc.reset_peak_rss():  # where the kernel allows it
        assert bc.peak_rss_mib() < parent  # after the reset: today's resident set

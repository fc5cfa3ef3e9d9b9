"""Fixtures shared across test files: the benchmarks' tiny offline workload.

``benchmarks/`` goes on ``sys.path`` here, so the benchmark tests import ``bench_common``,
``gpu_step`` and ``gpu_generate`` like the scripts do.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))


@pytest.fixture(scope="session")
def bench_folder(tmp_path_factory) -> Path:
    """``qwen-tiny-cpu`` written once: the random Qwen2-shaped model, its byte-level
    tokenizer whose eos is never sampled, and the synthetic prompts."""
    import bench_common as bc

    workload = bc.WORKLOADS["qwen-tiny-cpu"]
    target = tmp_path_factory.mktemp("bench") / workload.name
    bc.prepare_random(workload, target)
    return target

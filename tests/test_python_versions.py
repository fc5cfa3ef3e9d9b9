"""The package runs on every Python that ``pyproject.toml`` admits: nothing in it, the
benchmarks or the tests uses a standard-library name, argument or syntax newer than the
oldest such Python (read by vermin, a static reader of Python's versions; ``typing.Self``
and ``shutil.rmtree(dir_fd=)`` once made the package fail on 3.10)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def oldest_python() -> str:
    # a regular expression, not tomllib: tomllib is Python 3.11's
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'^requires-python\s*=\s*">=\s*(3\.\d+)"', text, re.MULTILINE)
    assert match, "requires-python in pyproject.toml is not of the form \">=3.N\""
    return match.group(1)


def test_nothing_needs_a_newer_python_than_the_oldest_admitted():
    vermin = shutil.which("vermin", path=str(Path(sys.executable).parent)) or shutil.which("vermin")
    assert vermin, "vermin is missing: install the dev extra (pip install -e '.[dev]')"
    target = oldest_python()
    # --exclude long: vermin reads any name ``long`` as Python 2's type (a variable here)
    run = subprocess.run(
        [vermin, f"--target={target}-", "--violations", "--no-tips", "--eval-annotations",
         "--exclude", "long", "maxent_grpo", "benchmarks", "tests", "notebooks"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "requires" not in run.stdout, run.stdout + run.stderr

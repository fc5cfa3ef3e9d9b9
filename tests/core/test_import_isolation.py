"""maxent_grpo.core is pure tensor math: importing it must not pull in Lightning or transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HEAVY = ("lightning", "pytorch_lightning", "transformers")
REPO_ROOT = Path(__file__).resolve().parents[2]


def test_core_imports_torch_only() -> None:
    code = (
        "import sys\n"
        "import maxent_grpo.core\n"
        f"loaded = [name for name in {HEAVY!r} if name in sys.modules]\n"
        "assert not loaded, f'maxent_grpo.core imported {loaded}'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr

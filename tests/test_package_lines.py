"""``benchmarks/package_lines.py``, the line figure docs/ARCHITECTURE.md quotes: every line
of the runtime package counted once, by kind."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("package_lines",
                                              ROOT / "benchmarks" / "package_lines.py")
package_lines = importlib.util.module_from_spec(spec)
spec.loader.exec_module(package_lines)


def test_each_line_is_counted_once_as_its_kind():
    text = ('"""Module\n\ndocstring."""\n\nimport os  # a comment after code\n\n\n'
            'class A:\n    """One line."""\n\n    # a comment\n    def f(self):\n'
            '        """Two\n        lines."""\n        return """not a docstring\n"""\n')
    kinds = package_lines.count(text)
    assert dict(kinds) == {"docstring": 3 + 1 + 2, "blank": 4, "comment": 1,
                           "code": 1 + 1 + 1 + 2}
    assert sum(kinds.values()) == text.count("\n")


def test_the_total_is_what_wc_counts_without_analysis():
    files = package_lines.sources()
    assert files and not any(p.startswith("maxent_grpo/analysis/") for p in files)
    listed = subprocess.run(["git", "ls-files", "maxent_grpo"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.split()
    assert {p for p in listed if p.endswith(".py") and "/analysis/" not in p} <= set(files)
    assert sum(sum(package_lines.count(t).values()) for t in files.values()) == sum(
        (ROOT / p).read_bytes().count(b"\n") for p in files)

"""How many lines the runtime package has: the figure docs/ARCHITECTURE.md quotes.

The runtime package is every ``.py`` file under ``maxent_grpo/`` except ``analysis/``
(reading runs back, which nothing in the package imports). Each line is counted once, as
a docstring line (the first statement of a module, class or function, when it is a
string), a blank line, a comment line or a code line::

    .venv/bin/python benchmarks/package_lines.py               # the working tree
    .venv/bin/python benchmarks/package_lines.py --rev 29ec97b # a commit
    .venv/bin/python benchmarks/package_lines.py --json        # one JSON line

The total equals ``find maxent_grpo -name '*.py' -not -path '*/analysis/*' | xargs wc -l``.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("code", "docstring", "comment", "blank")


def _runtime(path: str) -> bool:
    return path.startswith("maxent_grpo/") and path.endswith(".py") and \
        not path.startswith("maxent_grpo/analysis/")


def sources(rev: str | None = None) -> dict[str, str]:
    """``{path: text}`` of the runtime package's files, in the working tree or at ``rev``."""
    if rev is None:
        return {str(p.relative_to(ROOT)): p.read_text()
                for p in sorted((ROOT / "maxent_grpo").rglob("*.py"))
                if _runtime(str(p.relative_to(ROOT)))}
    listed = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "maxent_grpo"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return {path: subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT,
                                 capture_output=True, text=True, check=True).stdout
            for path in listed.split() if _runtime(path)}


def count(text: str) -> Counter:
    """The lines of one file by kind (the values sum to its ``wc -l``)."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                             ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    kinds: Counter = Counter(dict.fromkeys(KINDS, 0))
    for number, line in enumerate(text.split("\n")[:text.count("\n")], start=1):
        stripped = line.strip()
        kinds["docstring" if number in docstrings else "blank" if not stripped
              else "comment" if stripped.startswith("#") else "code"] += 1
    return kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", help="a git commit (default: the working tree)")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args()
    files = sources(args.rev)
    total: Counter = Counter(dict.fromkeys(KINDS, 0))
    for text in files.values():
        total.update(count(text))
    lines = sum(total.values())
    if args.json:
        print(json.dumps({"rev": args.rev, "files": len(files), "lines": lines,
                          **{k: total[k] for k in KINDS}}))
        return
    print(f"runtime package{f' at {args.rev}' if args.rev else ''}: {len(files)} files, "
          f"{lines:,} lines")
    for kind in KINDS:
        print(f"  {kind:9s} {total[kind]:7,d}")


if __name__ == "__main__":
    main()

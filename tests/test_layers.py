"""The import picture: data flows one way, so no lower layer imports the training layer,
and every package module stays readable in one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "maxent_grpo"
#: the layers below ``training/`` (and the top-level modules they are made of)
LOWER = ["core", "rollout", "rewards", "tasks", "objectives", "models.py", "adapters.py",
         "validation.py", "warm_start.py"]


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports (``import x`` and ``from x import y``), at any depth."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def files_of(layer: str) -> list[Path]:
    target = PACKAGE / layer
    return [target] if target.is_file() else sorted(target.rglob("*.py"))


@pytest.mark.parametrize("layer", LOWER)
def test_lower_layers_never_import_training(layer: str) -> None:
    files = files_of(layer)
    assert files, layer
    upward = {
        str(f.relative_to(PACKAGE)): sorted(
            m for m in imported_modules(f)
            if m.startswith(("maxent_grpo.training", "maxent_grpo.cli"))
        )
        for f in files
    }
    assert not {f: m for f, m in upward.items() if m}


def test_the_import_check_sees_an_upward_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from maxent_grpo.training.module import MaxEntGRPOModule\n")
    assert "maxent_grpo.training.module" in imported_modules(bad)


def test_no_package_module_is_over_450_lines() -> None:
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text("utf-8").splitlines())) > 450}
    assert not long


def test_training_step_reads_in_one_sitting() -> None:
    """``training_step`` (with its docstring) is at most 45 lines."""
    tree = ast.parse((PACKAGE / "training" / "module.py").read_text("utf-8"))
    step = next(n for n in ast.walk(tree)
                if isinstance(n, ast.FunctionDef) and n.name == "training_step")
    assert step.end_lineno - step.lineno + 1 <= 45

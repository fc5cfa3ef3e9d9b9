"""The import picture: data flows one way, so no lower layer imports the training layer,
and every package module stays readable in one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "maxent_grpo"
#: the layers below ``training/`` (and the top-level modules they are made of)
LOWER = ["core", "rollout", "rewards", "tasks", "objectives", "builtin", "models.py", "adapters.py",
         "validation.py"]


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


def module_name(path: Path) -> str:
    parts = ("maxent_grpo",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Package module -> the package modules it imports (``TYPE_CHECKING`` and function
    level imports included; ``from pkg import sub`` counts as importing ``pkg.sub``)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name in files)
            elif isinstance(node, ast.ImportFrom) and node.module in files:
                subs = {f"{node.module}.{a.name}" for a in node.names}
                targets.update(subs & set(files) or {node.module})
        graph[name] = targets - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    """Not even through type-only or function-level imports."""
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


#: the training layer's rooms, lowest first: a module imports only from its own room or
#: a lower one
TRAINING_ROOMS = ["settings", "types", "option_groups", "data", "step", "run", "callbacks",
                  "module"]


def room(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["maxent_grpo", "training"] or len(parts) < 3:
        return None
    return TRAINING_ROOMS.index(parts[2])


def test_no_arrow_runs_back_up_the_training_layer() -> None:
    graph = import_graph()
    upward = {(a, b) for a, targets in graph.items() for b in targets
              if room(a) is not None and room(b) is not None and room(b) > room(a)}
    assert upward == set()


def test_the_runtime_package_never_imports_the_analysis() -> None:
    """``maxent_grpo/analysis/`` (reading runs back) sits outside the runtime package."""
    graph = import_graph()
    users = {a for a, targets in graph.items() if not a.startswith("maxent_grpo.analysis")
             for b in targets if b.startswith("maxent_grpo.analysis")}
    assert users == set()

"""The package's shape: no import cycle, imports that follow the layout in docs/contributing.md,
no function-local import of specbench modules outside cli.py, no module over 600 lines."""

import ast
import re
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "specbench"
MODULES = {path.stem: path for path in PACKAGE.glob("*.py") if path.stem not in ("__init__", "__main__")}


def imported(node: ast.AST) -> set[str]:
    """The specbench modules an import statement names."""
    if isinstance(node, ast.ImportFrom):
        if node.level == 1 and node.module is None:  # from . import a, b
            return {alias.name for alias in node.names if alias.name in MODULES}
        name = node.module or ""
        if node.level == 1 or name.startswith("specbench."):
            module = name.removeprefix("specbench.")
            return {module} if module in MODULES else set()
        if name == "specbench":
            return {alias.name for alias in node.names if alias.name in MODULES}
    if isinstance(node, ast.Import):
        return {a.name.split(".")[1] for a in node.names if a.name.startswith("specbench.")}
    return set()


def imports_of(path: Path) -> set[str]:
    return set().union(*(imported(node) for node in ast.walk(ast.parse(path.read_text()))))


def local_imports(path: Path) -> list[str]:
    """Imports of specbench modules inside a function body, as 'function: module'."""
    found = []
    for function in ast.walk(ast.parse(path.read_text())):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += [f"{function.name}: {m}" for node in ast.walk(function) for m in sorted(imported(node))]
    return found


GRAPH = {name: imports_of(path) for name, path in MODULES.items()}


def test_the_import_graph_has_no_cycle():
    try:
        tuple(TopologicalSorter(GRAPH).static_order())
    except CycleError as e:
        pytest.fail(f"import cycle: {' -> '.join(e.args[1])}")


def test_imports_run_down_the_layout_of_the_contributing_guide():
    guide = (PACKAGE.parent / "docs" / "contributing.md").read_text()
    table = guide.split("## Code layout", 1)[1].split("\n\n## ", 1)[0]
    order = [m for row in re.findall(r"^\| (`.*?) \|", table, re.M) for m in re.findall(r"`(\w+)\.py`", row)]
    assert sorted(order) == sorted(MODULES), "the guide's table lists every module once"
    place = {name: i for i, name in enumerate(order)}
    upward = [f"{m} -> {n}" for m, names in GRAPH.items() for n in names if place[n] > place[m]]
    assert upward == []


def test_no_function_local_import_of_specbench_outside_the_cli():
    found = {name: local_imports(path) for name, path in MODULES.items() if name != "cli"}
    assert {name: where for name, where in found.items() if where} == {}


def test_no_module_is_over_600_lines():
    assert {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > 600} == {}


def test_only_methods_names_a_method():
    from specbench.methods import METHODS

    def named(node: ast.Compare) -> list[str]:
        """Method names that a comparison spells out: x == "name", or x in ("name", ...) (a
        column named like a method, as row["tree"] or "tree" in frame, is not one)."""
        sides = [node.left, *node.comparators]
        if any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            sides = [side for side in node.comparators if isinstance(side, (ast.Tuple, ast.List, ast.Set))]
        parts = [
            p for side in sides for p in (side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side])
        ]
        texts = [part.value for part in parts if isinstance(part, ast.Constant)]
        return [text for text in texts if isinstance(text, str) and text in METHODS]

    found = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        hits = [m for node in ast.walk(tree) if isinstance(node, ast.Compare) for m in named(node)]
        if hits and name != "methods":
            found[name] = hits
    assert found == {}

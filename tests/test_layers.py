"""The package's shape: no import cycle, imports that follow the layout in docs/contributing.md,
no function-local import of specbench modules outside cli.py, no module over 600 lines, and the
run's configuration read only by the orchestrators."""

import ast
import re
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "specbench"
# Each module by name; the engines package (specbench/engines/) is one unit of the layout, its files
# named engines/NAME.
MODULES = {path.stem: path for path in PACKAGE.glob("*.py") if path.stem not in ("__init__", "__main__")}
FILES = {**MODULES, **{f"engines/{path.stem}": path for path in (PACKAGE / "engines").glob("*.py")}}
UNITS = {*MODULES, "engines"}


def unit(name: str) -> str:
    return name.split("/")[0].split(".")[0]


def imported(node: ast.AST, inside: str = "") -> set[str]:
    """The specbench units an import statement names (``inside``: the package of the importing file)."""
    if isinstance(node, ast.ImportFrom):
        name = node.module or ""
        if node.level == 1 and inside:  # within the engines package: itself
            return set()
        if node.level in (1, 2) and not name:  # from . import a, b
            return {alias.name for alias in node.names if alias.name in UNITS}
        if node.level in (1, 2) or name.startswith("specbench."):
            module = unit(name.removeprefix("specbench."))
            return {module} if module in UNITS else set()
        if name == "specbench":
            return {alias.name for alias in node.names if alias.name in UNITS}
    if isinstance(node, ast.Import):
        return {unit(a.name.split(".")[1]) for a in node.names if a.name.startswith("specbench.")}
    return set()


def imports_of(name: str) -> set[str]:
    inside = "engines" if name.startswith("engines/") else ""
    return set().union(*(imported(node, inside) for node in ast.walk(ast.parse(FILES[name].read_text()))))


def local_imports(path: Path) -> list[str]:
    """Imports of specbench modules inside a function body, as 'function: module'."""
    found = []
    inside = "engines" if path.parent.name == "engines" else ""
    for function in ast.walk(ast.parse(path.read_text())):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += [f"{function.name}: {m}" for node in ast.walk(function) for m in sorted(imported(node, inside))]
    return found


GRAPH: dict[str, set[str]] = {}
for _name in FILES:
    GRAPH.setdefault(unit(_name), set()).update(imports_of(_name) - {unit(_name)})


def test_the_import_graph_has_no_cycle():
    try:
        tuple(TopologicalSorter(GRAPH).static_order())
    except CycleError as e:
        pytest.fail(f"import cycle: {' -> '.join(e.args[1])}")


def test_imports_run_down_the_layout_of_the_contributing_guide():
    guide = (PACKAGE.parent / "docs" / "contributing.md").read_text()
    table = guide.split("## Code layout", 1)[1].split("\n\n## ", 1)[0]
    rows = re.findall(r"^\| (`.*?) \|", table, re.M)
    order = list(dict.fromkeys(unit(m) for row in rows for m in re.findall(r"`([\w/]+)\.py`", row)))
    assert sorted(order) == sorted(UNITS), "the guide's table lists every module once"
    place = {name: i for i, name in enumerate(order)}
    upward = [f"{m} -> {n}" for m, names in GRAPH.items() for n in names if place[n] > place[m]]
    assert upward == []


def test_no_function_local_import_of_specbench_outside_the_cli():
    found = {name: local_imports(path) for name, path in FILES.items() if name != "cli"}
    assert {name: where for name, where in found.items() if where} == {}


def test_no_module_is_over_600_lines():
    assert {name: n for name, path in FILES.items() if (n := len(path.read_text().splitlines())) > 600} == {}


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


# The modules that take the run's configuration (config.BenchConfig): the command line, the
# configuration itself, the two orchestrators, and the method classes (methods, served), which read their own options
# from it by name. Every other module is handed what it needs (its models, prompts, sampling, load).
READ_THE_RUN = {"cli", "config", "bench", "audit", "method", "methods", "served"}


def test_only_the_orchestrators_take_the_run_configuration():
    found = {}
    for name, path in FILES.items():
        if name in READ_THE_RUN:
            continue
        text = path.read_text()
        hits = ["BenchConfig"] if "BenchConfig" in text else []
        for function in ast.walk(ast.parse(text)):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = function.args.posonlyargs + function.args.args + function.args.kwonlyargs
                # An unannotated cfg is the run's by this package's naming; another config is annotated.
                hits += [function.name for a in arguments if a.arg == "cfg" and a.annotation is None]
        if hits:
            found[name] = hits
    assert found == {}

"""The package's shape: folders that name its parts, imports that run one way between them in the
order docs/contributing.md lists them, no import cycle between modules, the command line's
declarations importable without torch (function-local imports of specbench only where they keep it
so), no module over about 800 lines, and the run's configuration read only by the orchestrators."""

import ast
import re
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "specbench"
# Every module by its dotted name under specbench ("decoding.sampling", "engines", "engines.loop").
FILES = {
    ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__"): path
    for path in PACKAGE.rglob("*.py")
    if path.relative_to(PACKAGE).parts[0] not in ("__init__.py", "__main__.py")
}
PARTS = sorted({name.split(".")[0] for name in FILES})


def part(module: str) -> str:
    return module.split(".")[0]


def imported(node: ast.AST, package: str) -> set[str]:
    """The specbench modules an import statement names, dotted under specbench (``package``: the
    importing file's package, for relative imports)."""
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if package else []
            name = ".".join(base + ([node.module] if node.module else []))
        elif (node.module or "").startswith("specbench"):
            name = node.module.removeprefix("specbench").removeprefix(".")
        else:
            return set()
        if name in FILES:
            # from specbench.drafters import trees: the module trees, not the folder
            subs = {f"{name}.{a.name}" for a in node.names if f"{name}.{a.name}" in FILES}
            return subs or {name}
        return {f"{name}.{a.name}" for a in node.names if f"{name}.{a.name}" in FILES} or (
            {name.rsplit(".", 1)[0]} if name.rsplit(".", 1)[0] in FILES else set()
        )
    if isinstance(node, ast.Import):
        return {a.name.removeprefix("specbench.") for a in node.names if a.name.removeprefix("specbench.") in FILES}
    return set()


def package_of(name: str) -> str:
    path = FILES[name]
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def imports_of(name: str) -> set[str]:
    tree = ast.parse(FILES[name].read_text())
    return set().union(*(imported(node, package_of(name)) for node in ast.walk(tree))) - {name}


def local_imports(name: str) -> list[str]:
    """Imports of specbench modules inside a function body, as 'function: module'."""
    found = []
    for function in ast.walk(ast.parse(FILES[name].read_text())):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += [
                f"{function.name}: {m}" for node in ast.walk(function) for m in sorted(imported(node, package_of(name)))
            ]
    return found


GRAPH = {name: imports_of(name) for name in FILES}


def test_the_import_graph_has_no_cycle():
    try:
        tuple(TopologicalSorter(GRAPH).static_order())
    except CycleError as e:
        pytest.fail(f"import cycle: {' -> '.join(e.args[1])}")


def test_imports_run_one_way_between_the_folders_of_the_contributing_guide():
    guide = (PACKAGE.parent / "docs" / "contributing.md").read_text()
    table = guide.split("## Code layout", 1)[1].split("\n\n## ", 1)[0]
    order = re.findall(r"^\| `(\w+)/` \|", table, re.M)
    assert sorted(order) == PARTS, "the guide's table lists every folder once"
    place = {name: i for i, name in enumerate(order)}
    upward = sorted(f"{m} -> {n}" for m, names in GRAPH.items() for n in names if place[part(n)] > place[part(m)])
    assert upward == []


def test_a_part_holds_modules_not_loose_files():
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py", "__main__.py"]


def test_no_two_classes_share_a_name():
    classes = {}
    for name, path in FILES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(name)
    assert {c: where for c, where in classes.items() if len(where) > 1} == {}


def test_the_method_registry_imports_no_training_module():
    """What importing the registry pulls in, transitively: decoding methods, not training."""
    seen, todo = set(), ["methods.registry"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += GRAPH[name]
    assert sorted(n for n in seen if part(n) == "training") == []


# What the command line imports to parse and check a run's options and to list what specbench can
# run: the only modules that import what decodes inside their functions, so that `specbench --help`,
# `list`, `theory` and every refusal answer without torch (benchmarks/startup.py times them).
LIGHT = {
    "cli.app", "cli.flags", "bench.config", "methods.base", "methods.registry", "methods.served", "audit.broken",
    "engines.vllm",
}  # fmt: skip
HEAVY = ("torch", "transformers", "pandas", "scipy", "matplotlib", "vllm", "datasets")


def test_function_local_imports_of_specbench_only_where_they_keep_the_command_line_light():
    found = {name: local_imports(name) for name in FILES if name not in LIGHT}
    assert {name: where for name, where in found.items() if where} == {}


def test_the_command_line_parses_and_checks_options_without_torch():
    probe = (
        "import sys; import specbench.cli.app; from specbench.bench.config import BenchConfig; "
        "BenchConfig(methods=['speculative', 'eagle', 'triforce']).validate(); "
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_compare_reads_and_judges_runs_without_the_heavy_libraries():
    # numpy only (the bootstrap): pandas alone cost compare about a third of a second at every start.
    probe = f"import sys; import specbench.results.compare; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_no_module_is_over_about_800_lines():
    assert {name: n for name, path in FILES.items() if (n := len(path.read_text().splitlines())) > 800} == {}


def test_only_the_registry_names_a_method():
    from specbench.methods.registry import METHODS

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
    for name, path in FILES.items():
        tree = ast.parse(path.read_text())
        hits = [m for node in ast.walk(tree) if isinstance(node, ast.Compare) for m in named(node)]
        if hits and name != "methods.registry":
            found[name] = hits
    assert found == {}


# The modules that take the run's configuration (config.BenchConfig): the command line, the
# configuration itself, the two orchestrators, and the method classes (methods, served), which read their own options
# from it by name. Every other module is handed what it needs (its models, prompts, sampling, load).
READ_THE_RUN = {
    "cli.app", "cli.flags", "bench.config", "bench.run", "audit.run", "methods.base", "methods.registry", "methods.served"
}  # fmt: skip


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

"""Every tp_trainer module imports, and no tp_trainer modules import each other in a cycle.

A cycle among module-level imports makes the result depend on which module is imported first
(a partly initialised module hands out missing names) and ties layers together that should stand
apart: the planner must not need the value objects' module to import the planner back. The graph
is built from the source with ``ast``, so a cycle is found even where today's import order hides it.
Every import statement is an edge: at the top, inside ``if``/``try``, ``if __name__ ==
"__main__"`` blocks and inside functions alike (a lazy import inside a function still ties the two
modules together; it only hides the cycle from the import order).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = "tp_trainer"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package (``__init__`` = the package)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imports(tree: ast.Module):
    """Every import statement of the module, inside functions too."""
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def _targets(node, name: str, is_package: bool, modules) -> set[str]:
    """The package modules that one import statement of module ``name`` loads."""
    if isinstance(node, ast.Import):
        bases = [alias.name for alias in node.names]
        return {base for base in bases if base in modules}
    if node.level:
        anchor = name.split(".") if is_package else name.split(".")[:-1]
        anchor = anchor[:len(anchor) - node.level + 1]
        base = ".".join(anchor + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    found = set()
    for alias in node.names:
        child = f"{base}.{alias.name}"
        if child in modules:
            found.add(child)      # ``from pkg import submodule``
        elif base in modules:
            found.add(base)       # ``from module import name``
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere (itself excluded)."""
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        edges = set()
        for node in _imports(tree):
            edges |= _targets(node, name, is_package, modules)
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search with colours)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_no_import_cycle_among_package_modules():
    graph = import_graph(module_files())
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle among tp_trainer modules: " + " -> ".join(cycle)


@pytest.mark.parametrize("name", sorted(module_files()))
def test_every_module_imports(name):
    assert importlib.import_module(name).__name__ == name


def test_checker_finds_a_planted_cycle(tmp_path):
    """The checker is not blind: a package whose modules import each other, through a relative
    ``from .b import x``, an ``if __name__ == "__main__"`` block and an ``import pkg.c``, is reported,
    and so is one closed by an import inside a function."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import x\n")
    (pkg / "b.py").write_text("x = 1\nif __name__ == '__main__':\n    import pkg.c\n")
    (pkg / "c.py").write_text("from . import a\n")
    (pkg / "d.py").write_text("def f():\n    from . import a\n")
    graph = import_graph(module_files(pkg, "pkg"))
    assert graph["pkg.d"] == {"pkg.a"}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    (pkg / "b.py").write_text("x = 1\n")
    assert find_cycle(import_graph(module_files(pkg, "pkg"))) is None
    (pkg / "b.py").write_text("x = 1\ndef f():\n    from . import d\n")   # a -> b -> d -> a, lazily
    assert find_cycle(import_graph(module_files(pkg, "pkg"))) == ["pkg.a", "pkg.b", "pkg.d", "pkg.a"]


# The planner is a pipeline of values, each module using only those before it: measured or analytic
# costs (cost_model, analytic, profile) -> TeraPipe's DP (dp) -> the predicted step (predict) -> the report
# (report) -> slices refined under the simulated step (refine) ->
# memory (memory_model, its share per sequence rank sequence_memory, analytic_saved, analytic_memory,
# memory_plan) -> the split and slices together (layer_cost) -> a sequence rank's costs of the layers
# (sequence_cost) -> the analytic GPU model of a model's layers (gpu_model) -> the run's entry (auto) -> the
# command line (cli). Nothing in it reaches back up into the run (checks, initialize, engine, run).
PLANNER_LAYERS = ["cost_model", "analytic", "profile", "dp", "predict", "report", "refine", "memory_model",
                  "sequence_memory", "analytic_saved", "analytic_memory", "memory_plan", "layer_cost", "sequence_cost",
                  "gpu_model", "auto", "cli", "__main__"]
RUN_MODULES = {"tp_trainer.checks", "tp_trainer.initialize", "tp_trainer.engine", "tp_trainer.run"}


def layering_violations(graph: dict[str, set[str]], package: str, layers: list[str], above: set[str]) -> list[str]:
    """Imports from a module of ``package`` to one at its level or later in ``layers``, or into ``above``."""
    order = {f"{package}.{name}": k for k, name in enumerate(layers)}
    found = []
    for module, level in order.items():
        for target in sorted(graph.get(module, ())):
            if target in above or (target in order and order[target] >= level):
                found.append(f"{module} imports {target}")
    return found


def test_the_planner_flows_one_way():
    graph = import_graph(module_files())
    planner = {name.rpartition(".")[2] for name in graph if name.startswith("tp_trainer.planner.")}
    assert planner == set(PLANNER_LAYERS), "place every planner module in PLANNER_LAYERS"
    assert layering_violations(graph, "tp_trainer.planner", PLANNER_LAYERS, RUN_MODULES) == []


def test_layering_check_finds_an_upward_import():
    graph = {"p.dp": {"p.report"}, "p.report": {"p.dp"}, "p.cli": {"run"}}
    assert layering_violations(graph, "p", ["dp", "report", "cli"], {"run"}) == [
        "p.dp imports p.report", "p.cli imports run"]

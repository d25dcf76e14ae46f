"""The import graph: data flows one way (hardware -> layout -> costmodel -> planner -> formats ->
executor -> CLI), no module imports one on a floor above it, and no modules import each
other in a cycle, deferred imports inside functions included."""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
FLOORS = ("hardware", "layout", "costmodel", "planner", "formats", "executor", "parallax_cli")


def _module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    for guard in [n for n in ast.walk(tree) if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]:
        guard.body = []  # imports for annotations only: never run
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[:len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            found.add(name)
            found |= {f"{name}.{alias.name}" for alias in node.names}
    return found


def import_graph() -> nx.DiGraph:
    files = {_module_of(p): p for floor in FLOORS for p in (ROOT / floor).rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for module, path in files.items():
        for name in _imports(path, module):
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + "."):  # a package's own __init__
                graph.add_edge(module, name)
    return graph


def test_no_module_imports_a_floor_above_it():
    floor = {name: i for i, name in enumerate(FLOORS)}
    up = [(a, b) for a, b in import_graph().edges if floor[b.split(".")[0]] > floor[a.split(".")[0]]]
    assert not up, up


def test_there_is_no_import_cycle():
    graph = import_graph()
    # a package's __init__ re-exporting its modules is not a cycle of the code's flow
    code = graph.subgraph([n for n in graph if (ROOT / Path(*n.split("."))).with_suffix(".py").exists()])
    cycles = list(nx.simple_cycles(code))
    assert not cycles, cycles[:5]

"""The packages' import graphs have no circles: each module builds on the ones below it,
and each subpackage on the ones below it (the runtime's layers: transport, protocol,
client, worker).

Read from the source (ast), so a circle fails here even where Python would tolerate it
through a function-level import. Imports under `if TYPE_CHECKING:` are left out: they
never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.processes import ROOT

PACKAGES = {"effectmq": ROOT / "effectmq", "effectmq_operator": ROOT / "operator/effectmq_operator"}
# The runtime's layers, lowest first: each may import only those before it (errors.py is
# shared by all), and none imports the parts built on the runtime (scheduler, dashboard, cli).
RUNTIME_LAYERS = ("effectmq.errors", "effectmq.transport", "effectmq.eventloop", "effectmq.protocol",
                  "effectmq.client", "effectmq.worker")


def modules(package: str, folder: Path) -> dict[str, Path]:
    out = {}
    for path in folder.rglob("*.py"):
        parts = (package, *path.relative_to(folder).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _runtime_nodes(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            node.body = []
    return ast.walk(tree)


def import_graph(package: str, folder: Path) -> dict[str, set[str]]:
    known = modules(package, folder)
    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = here[:len(here) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                submodules = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
                targets = submodules or [target]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in known and t != name}
    return graph


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph seen one level down: a subpackage (all its modules) is one node,
    a module at the top of the package another."""
    def node(module: str) -> str:
        return ".".join(module.split(".")[:2])

    out: dict[str, set[str]] = {node(m): set() for m in graph}
    for module, targets in graph.items():
        out[node(module)] |= {node(t) for t in targets} - {node(module)}
    return out


def layer_order(graph: dict[str, set[str]]) -> list[list[str]]:
    """The nodes in layers: each layer imports only nodes of the layers before it."""
    placed: set[str] = set()
    layers = []
    while len(placed) < len(graph):
        layer = sorted(n for n in graph if n not in placed and graph[n] <= placed)
        assert layer, f"no order: a circle among {sorted(set(graph) - placed)}"
        layers.append(layer)
        placed |= set(layer)
    return layers


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
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


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_circles(package):
    assert circles(import_graph(package, PACKAGES[package])) == []


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_circles_between_subpackages(package):
    graph = package_graph(import_graph(package, PACKAGES[package]))
    assert circles(graph) == []
    print(f"\n{package}, lowest layer first:")
    for depth, layer in enumerate(layer_order(graph)):
        print(f"  {depth}: {', '.join(layer)}")


def test_runtime_layers_import_only_lower_layers():
    graph = package_graph(import_graph("effectmq", PACKAGES["effectmq"]))
    upward = {(layer, target) for layer in RUNTIME_LAYERS for target in graph[layer]
              if target not in RUNTIME_LAYERS[:RUNTIME_LAYERS.index(layer)]}
    assert upward == set(), "a runtime layer imports one above it, or a part built on the runtime"


def test_a_circle_between_subpackages_is_found():
    modules = {"p.a.x": {"p.b.y"}, "p.b.y": set(), "p.b.z": {"p.a.w"}, "p.a.w": set(), "p.top": {"p.a.x"}}
    graph = package_graph(modules)
    assert circles(modules) == [] and circles(graph) == [["p.a", "p.b"]]


def test_a_circle_is_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_operator_runtime_builds_on_nothing_of_the_domain():
    """effectmq_operator.runtime (API client, work queue, leader election) is the operator's
    machinery: it may use the API identity (api) and the metrics, never the Queue or
    Schedule code built on it."""
    allowed = {"effectmq_operator.api", "effectmq_operator.metrics"}
    graph = import_graph("effectmq_operator", PACKAGES["effectmq_operator"])
    upward = {(name, target) for name, targets in graph.items() if name.startswith("effectmq_operator.runtime")
              for target in targets if not target.startswith("effectmq_operator.runtime") and target not in allowed}
    assert upward == set()

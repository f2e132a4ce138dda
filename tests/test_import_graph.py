"""The packages' import graphs have no circles: each module builds on the ones below it.

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


def test_a_circle_is_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]

"""The layers of docs/architecture.md hold in the code: every import (module-level or inside a
function) is read from the source, so a lazy import cannot hide a layer break."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hipfire_serve", "scheduler", "executor", "kernels", "loadtests")

# package (or sub-package) -> project packages it must never import
FORBIDDEN = {
    "kernels": ("executor", "scheduler", "hipfire_serve", "loadtests"),
    "scheduler": ("executor", "kernels", "hipfire_serve", "loadtests"),
    "executor": ("hipfire_serve", "loadtests"),
    "hipfire_serve": ("loadtests", "kernels"),  # kernels only through executor
    # the HTTP load generator speaks to any server: no project internals
    "loadtests": ("hipfire_serve", "scheduler", "executor", "kernels", "loadtests.lab"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _runtime_nodes(tree: ast.AST):
    """Every node but those under `if TYPE_CHECKING:` (annotations only, never run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        todo.extend(c for c in ast.iter_child_nodes(node) if not _is_type_checking(c))


def _project_imports(path: Path, with_type_checking: bool = True) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree) if with_type_checking else _runtime_nodes(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found.update(n for n in names if n.split(".")[0] in PACKAGES)
    return found


def _files(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py"))


def _layer(module: str) -> str:
    return "loadtests.lab" if module.startswith("loadtests.lab") else module.split(".")[0]


def _breaks(imported: str, forbidden: tuple[str, ...]) -> bool:
    return any(imported == f or imported.startswith(f + ".") for f in forbidden)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_crosses_a_layer_upward(package):
    wrong = []
    for path in _files(package):
        module = _module_name(path)
        if _layer(module) == "loadtests.lab":
            continue  # the lab may import anything of the product
        for imported in sorted(_project_imports(path)):
            if _breaks(imported, FORBIDDEN[package]):
                wrong.append(f"{module} imports {imported}")
    assert not wrong, "\n".join(wrong)


def test_no_modules_import_each_other():
    """No two modules import each other, directly or round a loop, even through an import
    inside a function; imports for annotations alone (`if TYPE_CHECKING:`) do not count
    (Tarjan's strongly connected components over the module graph)."""
    graph: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in _files(package):
            graph[_module_name(path)] = set()
    for package in PACKAGES:
        for path in _files(package):
            module = _module_name(path)
            for imported in _project_imports(path, with_type_checking=False):
                target = imported
                while target and target not in graph:
                    target = target.rpartition(".")[0]
                if target and target != module:
                    graph[module].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert not cycles, cycles

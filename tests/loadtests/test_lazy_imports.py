"""Benchmarks import much of the project lazily, inside the GPU-only functions that CPU tests
never reach: every such import must still resolve, so a rename cannot break a GPU run."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted((ROOT / "loadtests").rglob("*.py")) + sorted((ROOT / "executor").rglob("*.py"))
FILES += sorted((ROOT / "hipfire_serve").rglob("*.py"))


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            top = node.module.split(".")[0]
            if top in ("loadtests", "executor", "scheduler", "hipfire_serve", "kernels"):
                for alias in node.names:
                    yield node.module, alias.name


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_project_import_resolves(path):
    for module, name in _imports(path):
        mod = importlib.import_module(module)
        assert hasattr(mod, name) or importlib.util.find_spec(f"{module}.{name}"), (
            f"{path.name}: from {module} import {name}"
        )

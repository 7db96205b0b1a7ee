"""DESIGN.md's layering: hf_distca.planning is pure Python/NumPy (no torch, so no torch.distributed and no
CUDA), checked on the imports of every planning module and of every hf_distca module they import, read
from the sources (importing hf_distca.planning would run hf_distca/__init__.py, which loads the engine)."""

from __future__ import annotations

import ast
import os

import hf_distca

PACKAGE = os.path.dirname(hf_distca.__file__)


def _module_file(name: str) -> str | None:
    parts = name.split(".")[1:]
    base = os.path.join(PACKAGE, *parts)
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def _imports(path: str) -> set[str]:
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_planning_imports_no_torch():
    planning = os.path.join(PACKAGE, "planning")
    todo = [f"hf_distca.planning.{f[:-3]}" for f in sorted(os.listdir(planning)) if f.endswith(".py")]
    todo = [name.removesuffix(".__init__") for name in todo]
    assert "hf_distca.planning.traffic" in todo and "hf_distca.planning.balancer" in todo
    visited: set[str] = set()
    outside = []
    while todo:
        name = todo.pop()
        path = _module_file(name)
        if name in visited or path is None:
            continue
        visited.add(name)
        for imported in _imports(path):
            if imported == "torch" or imported.startswith("torch."):
                outside.append(f"{name} imports {imported}")
            elif imported.startswith("hf_distca."):
                todo.append(imported)
    assert not outside, outside
    assert "hf_distca.config" in visited  # the closure follows the package's own imports

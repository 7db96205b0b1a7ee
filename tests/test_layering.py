"""Layers only look down (docs/architecture.md, "Layers"): every module of hf_distca imports only from its
own layer or the layers below it, no chain of imports comes back to where it started, and planning uses
the standard library and NumPy only. Read from the sources with ``ast`` (importing the package would run
hf_distca/__init__.py, which loads everything): every ``import`` anywhere in a file counts, inside
functions included."""

from __future__ import annotations

import ast
import os
import sys
from dataclasses import dataclass

import hf_distca

PACKAGE = os.path.dirname(hf_distca.__file__)
ROOT = os.path.dirname(PACKAGE)

LAYER_NAMES = (
    "planning",  # 0: pure NumPy
    "kernels",  # 1
    "comm / packing / metrics",  # 2
    "config",  # 3
    "cost tables",  # 4
    "engine",  # 5
    "data",  # 6
    "Transformers integration",  # 7: the package root
    "command lines",  # 8
)
LAYERS = {
    "hf_distca.version": 0,  # imports nothing: anything may read the version
    "hf_distca.planning": 0,
    "hf_distca.kernels": 1,
    "hf_distca.comm": 2,
    "hf_distca.packing": 2,
    "hf_distca.metrics": 2,
    "hf_distca.plotting": 2,
    "hf_distca.config": 3,
    "hf_distca.features": 3,  # what the kernels cannot compute, refused by model feature
    "hf_distca.cost_tables": 4,  # the shipped tables and the timing that measures new ones
    "hf_distca.engine": 5,
    "hf_distca.linear": 5,  # linear attention's operators (its own config, comm, packing below)
    "hf_distca.linear.layers": 7,  # ... and its Transformers layers
    "hf_distca.data": 6,
    "hf_distca": 7,  # the package root and every module there not named here: attention, checkpointing, ...
    "hf_distca.calibrate": 8,
    "hf_distca.cli": 8,
}
"""Module prefix -> rank in LAYER_NAMES; a module takes the rank of its longest listed prefix."""

MAX_FILE_LINES = 500
MAX_CLASS_LINES = 300
"""One idea per file (docs/architecture.md, "Layers"): no library file or class longer."""

PLANNING_MAY_IMPORT = ("numpy",)
"""Besides the standard library and hf_distca.planning itself."""


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    where: str  # path:line

    def __str__(self) -> str:
        return f"{self.where}: {self.importer} imports {self.imported}"


def _modules() -> dict[str, str]:
    """Every module of the package: dotted name -> file."""
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _own(name: str) -> str | None:
    """The package module ``name`` lives in (a name imported from a module is that module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: str) -> tuple[list[Import], set[str]]:
    """The imports of one file, anywhere in it: those of package modules (resolved to the module), and the
    top-level names of every other one."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    inside: dict[tuple[str, int], Import] = {}
    outside = set()
    where = os.path.relpath(path, ROOT)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            # `from a import b`: b is a module of a, or a name defined in a
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in targets:
            if target == "hf_distca" or target.startswith("hf_distca."):
                owner = _own(target)
                if owner != module:
                    inside[owner, node.lineno] = Import(module, owner, f"{where}:{node.lineno}")
            else:
                outside.add(target.split(".")[0])
    return list(inside.values()), outside


GRAPH = {name: _imports(name, path) for name, path in sorted(MODULES.items())}


def rank(module: str) -> int:
    prefixes = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    return LAYERS[max(prefixes, key=len)]


def _edges() -> list[Import]:
    return [i for inside, _ in GRAPH.values() for i in inside]


def test_every_import_looks_down():
    upward = []
    for i in _edges():
        low, high = rank(i.importer), rank(i.imported)
        if high > low:
            upward.append(
                f"{i}: {LAYER_NAMES[low]} (layer {low}) may not import from {LAYER_NAMES[high]} (layer "
                f"{high}) above it; move the code to the layer it belongs to"
            )
    assert not upward, "imports that run up:\n" + "\n".join(upward)


def test_no_circles():
    graph: dict[str, list[Import]] = {name: [] for name in MODULES}
    for i in _edges():
        graph[i.importer].append(i)
    circles = [c for c in _strongly_connected(graph) if len(c) > 1]
    report = []
    for circle in circles:
        ties = [str(i) for m in sorted(circle) for i in graph[m] if i.imported in circle]
        report.append(f"circle of {len(circle)} modules: {sorted(circle)}\n  " + "\n  ".join(ties))
    assert not circles, "import circles:\n" + "\n".join(report)


def test_planning_imports_numpy_and_the_standard_library_only():
    planning = [
        name for name in MODULES if name == "hf_distca.planning" or name.startswith("hf_distca.planning.")
    ]
    assert "hf_distca.planning.balancer" in planning and "hf_distca.planning.traffic" in planning
    wrong = []
    for name in planning:
        inside, outside = GRAPH[name]
        wrong += [str(i) for i in inside if rank(i.imported) > 0 or i.imported == "hf_distca"]
        allowed = set(sys.stdlib_module_names) | {"__future__", *PLANNING_MAY_IMPORT}
        wrong += [f"{name} imports {other}" for other in sorted(outside - allowed)]
    assert not wrong, wrong


def test_the_table_is_read_as_meant():
    """The rule itself: nothing imports the package root inside the package, the table's names exist, and
    the checks see the kinds of import they must (inside functions, relative, ``from pkg import module``)."""
    assert all(p in MODULES for p in LAYERS), [p for p in LAYERS if p not in MODULES]
    assert all(0 <= r < len(LAYER_NAMES) for r in LAYERS.values())
    root = [str(i) for i in _edges() if i.imported == "hf_distca"]
    assert not root, f"modules importing the package root (import hf_distca.version for __version__): {root}"
    assert {i.imported for i in GRAPH["hf_distca.engine.cost_probe"][0]} >= {"hf_distca.cost_tables.timing"}
    assert rank("hf_distca.attention") == 7 and rank("hf_distca.linear.layers.minimax") == 7
    assert rank("hf_distca.linear.ops.local") == 5 and rank("hf_distca.planning.cost") == 0


def test_imports_inside_functions_count(tmp_path):
    """An engine module importing up inside a function, relatively or as ``from pkg import module``, is
    seen as importing the modules it names (the package holds no such import today: this is the check's
    own test)."""
    path = tmp_path / "fake.py"
    path.write_text(
        "import os\n\n\ndef f():\n    from hf_distca import checkpointing\n"
        "    from ..data import loader\n    import hf_distca.callback\n    return os, checkpointing, loader\n"
    )
    inside, outside = _imports("hf_distca.engine.fake", str(path))
    assert {i.imported for i in inside} == {
        "hf_distca.checkpointing",
        "hf_distca.data.loader",
        "hf_distca.callback",
    }
    assert all(rank(i.imported) > rank(i.importer) for i in inside) and outside == {"os"}


def test_no_file_or_class_too_long():
    """No file of the package over MAX_FILE_LINES lines, no class over MAX_CLASS_LINES."""
    long = []
    for path in sorted(MODULES.values()):
        with open(path) as f:
            text = f.read()
        lines = len(text.splitlines())
        if lines > MAX_FILE_LINES:
            long.append(f"{os.path.relpath(path, ROOT)}: {lines} lines (at most {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(text, path)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                size = node.end_lineno - node.lineno + 1
                long.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: class {node.name}, {size} lines "
                            f"(at most {MAX_CLASS_LINES})")  # fmt: skip
    assert not long, "split by idea:\n" + "\n".join(long)


def _strongly_connected(graph: dict[str, list[Import]]) -> list[set[str]]:
    """Tarjan's strongly connected components of the import graph (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in graph:
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, child = work.pop()
            if child == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            targets = [i.imported for i in graph[node]]
            if child < len(targets):
                work.append((node, child + 1))
                nxt = targets[child]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                out.append(component)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return out

"""The package's import layers, read from the source (an AST walk, type-checking imports included):

    entrypoints, integrations  →  engine  →  core, worker, distributed, model_loader, lora, quantization  →  kernels

Top-level modules (``config``, ``sampling_params``, ``outputs``, ...) are leaves every layer may use. No two
subpackages import each other, directly or around a cycle; ``kernels`` imports nothing of ours above it; ``core``
(scheduling, blocks) imports neither the engine nor the worker.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "paged_backend"
TOP = ("entrypoints", "integrations")
MIDDLE = ("core", "worker", "distributed", "model_loader", "lora", "quantization")


def _unit(module: str) -> str:
    """The subpackage (or top-level module) a dotted ``paged_backend.*`` name belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path) -> set[str]:
    """Every ``paged_backend`` module this file imports, at any depth (function bodies and TYPE_CHECKING too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(("paged_backend", *path.relative_to(PACKAGE).with_suffix("").parts[:-1]))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("paged_backend"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            if name.startswith("paged_backend"):
                found.add(name)
                found.update(f"{name}.{alias.name}" for alias in node.names)
    return found


def _edges() -> dict[str, set[str]]:
    """Subpackage → the other subpackages (and top-level modules) it imports."""
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).parts
        source = rel[0] if rel[0] in packages else path.stem
        for module in _imports(path):
            target = _unit(module)
            if target and target != source and (target in packages or (PACKAGE / f"{target}.py").exists()):
                edges.setdefault(source, set()).add(target)
    return edges


EDGES = _edges()
PACKAGES = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
LEAVES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def test_the_walk_sees_the_engine_imports() -> None:
    """The checks below would pass vacuously if the walk found nothing."""
    assert {"core", "worker", "model_loader"} <= EDGES["engine"]
    assert "kernels" in EDGES["worker"]


def test_kernels_import_nothing_of_ours_above_them() -> None:
    assert not EDGES.get("kernels", set())


def test_core_imports_neither_engine_nor_worker() -> None:
    assert not EDGES.get("core", set()) & {"engine", "worker", *TOP}


@pytest.mark.parametrize("leaf", LEAVES)
def test_top_level_modules_are_leaves(leaf: str) -> None:
    assert not EDGES.get(leaf, set()) & set(PACKAGES), f"{leaf}.py imports a subpackage"


def test_layers_point_down() -> None:
    for unit in (*MIDDLE, "kernels"):
        assert not EDGES.get(unit, set()) & {"engine", *TOP}, f"{unit} imports a layer above it"
    assert not EDGES.get("engine", set()) & set(TOP)


def test_no_two_subpackages_import_each_other() -> None:
    """No cycle among subpackages, of any length: a depth-first search over the import graph."""
    graph = {unit: EDGES.get(unit, set()) & set(PACKAGES) for unit in PACKAGES}
    state: dict[str, str] = {}

    def visit(unit: str, path: list[str]) -> None:
        state[unit] = "open"
        for target in sorted(graph[unit]):
            assert state.get(target) != "open", "import cycle: " + " → ".join([*path, unit, target])
            if target not in state:
                visit(target, [*path, unit])
        state[unit] = "done"

    for unit in PACKAGES:
        if unit not in state:
            visit(unit, [])

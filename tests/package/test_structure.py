"""The package layout keeps its promises (issue: folders that show the pipeline).

import-linter's contracts (``pyproject.toml``, run by the lint step) keep the layers in order;
these tests check what a contract cannot state, on the static import graph that grimp builds
from every import statement (lazy imports inside functions and ``TYPE_CHECKING`` imports
included): no import cycle at all, no subpackage module importing the package root, and at
most five modules directly in ``tl_geometry/``; and, on the engine's source, that its backend
is chosen in one place.
"""

from __future__ import annotations

import ast
from pathlib import Path

import grimp
import pytest

import tl_geometry

PACKAGE = Path(tl_geometry.__file__).parent


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph("tl_geometry", include_external_packages=False,
                             exclude_type_checking_imports=False)


def _strongly_connected(graph) -> list[list[str]]:
    """Tarjan's components of the module import graph with more than one module (or a self-loop)."""
    modules = sorted(graph.modules)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(m: str) -> None:  # the graph has ~80 modules: recursion depth is no concern
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for n in edges[m]:
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on_stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while True:
                n = stack.pop()
                on_stack.discard(n)
                component.append(n)
                if n == m:
                    break
            if len(component) > 1 or m in edges[m]:
                out.append(sorted(component))

    for m in modules:
        if m not in index:
            visit(m)
    return out


def test_the_cycle_finder_finds_cycles():
    g = grimp.ImportGraph()
    for a, b in [("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d"), ("p.e", "p.e")]:
        g.add_import(importer=a, imported=b)
    assert sorted(_strongly_connected(g)) == [["p.a", "p.b", "p.c"], ["p.e"]]


def test_the_static_import_graph_has_no_cycle(graph):
    assert _strongly_connected(graph) == []


def test_no_subpackage_module_imports_the_package_root(graph):
    importers = set(graph.find_modules_that_directly_import("tl_geometry"))
    assert importers == set(), f"import from the subpackage that defines the name instead: {importers}"


def test_at_most_five_modules_lie_directly_in_the_package():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 5, top


def test_every_public_name_is_importable_from_the_root():
    for name in tl_geometry.__all__:
        assert getattr(tl_geometry, name) is not None, name


def _engine_trees() -> dict[str, ast.Module]:
    """The parsed source of every engine module, by its path inside ``engine/``."""
    engine = PACKAGE / "engine"
    return {path.relative_to(engine).as_posix(): ast.parse(path.read_text(encoding="utf-8"))
            for path in sorted(engine.rglob("*.py"))}


def test_the_engine_chooses_its_backend_in_one_place():
    """numba or torch is chosen once per layer (``engine.backend.choose_backend``, named by
    ``engine.layer`` alone) and the orchestration calls the chosen table's entries: only the
    compiled kernels import numba, so no other module can branch on it."""
    choosers, numba_importers = set(), set()
    for name, tree in _engine_trees().items():
        for node in ast.walk(tree):
            named = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                     else node.name if isinstance(node, ast.alias) else None)
            if named == "choose_backend":
                choosers.add(name)
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                modules = [node.module or ""]
            else:
                modules = []
            if any(m == "numba" or m.startswith("numba.") for m in modules):
                numba_importers.add(name)
    assert choosers == {"layer.py"}, choosers
    assert numba_importers and all(name.startswith("compiled/") for name in numba_importers), numba_importers


def _private_imports_across_folders() -> list[str]:
    """``from ..x import _name`` (or ``from ..x._module import``) where ``x`` is another folder
    of the package than the importer's: a private name is its own folder's business."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        folder = parts[0] if len(parts) > 1 else ""
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            base = list(parts[:-1])[: len(parts) - node.level]
            target = [*base, *(node.module or "").split(".")] if node.module else base
            if (target[0] if target else "") == folder:
                continue
            private = [p for p in (node.module or "").split(".") if p.startswith("_") and p != "_version"]
            private += [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            if private:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} imports {private}")
    return found


def test_no_private_name_is_imported_across_folders():
    assert _private_imports_across_folders() == []

"""No import circles among the project's modules, lazy and type-checking imports included.

A circle hidden behind an import inside a function still ties two modules into one: neither can be
read, tested or moved without the other, and the order the modules happen to be imported in decides
whether it works. Edges come from every `import` statement (clipms.utils.codehash reads them
without importing anything); an edge goes to the module itself, not to the packages above it or the
package a submodule is taken from (a package's `__init__` importing its own submodules is no
circle).
"""

from __future__ import annotations

from pathlib import Path

from clipms.utils.codehash import imported_modules
from harness.packages import PROJECT_PACKAGES, ROOT


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """{module file: project module files it imports}, paths relative to `root`."""
    files = {str(p.relative_to(root)) for pkg in packages for p in (root / pkg).rglob("*.py")}
    return {f: _edges(Path(f), root) & files - {f} for f in sorted(files)}


def _edges(path: Path, root: Path) -> set[str]:
    """Module files `path` imports. `from pkg import mod` is an edge to pkg/mod.py alone: the
    package is only the way there."""
    names = imported_modules(path, root)
    resolved = {name: _module_file(name, root) for name in names}
    return {file for name, file in resolved.items() if file is not None
            and not (file.endswith("__init__.py")
                     and any(other.startswith(name + ".") and resolved[other] for other in names))}


def _module_file(name: str, root: Path) -> str | None:
    base = Path(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if (root / candidate).is_file():
            return str(candidate)
    return None


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_project_has_no_import_circles():
    assert circles(import_graph(ROOT, PROJECT_PACKAGES)) == []


def test_a_circle_behind_a_lazy_import_is_found(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "__init__.py").write_text("from lib import launch  # a package may\n")
    (tmp_path / "lib" / "launch.py").write_text("from lib.job import run\n")
    (tmp_path / "lib" / "job.py").write_text("from lib import loop\n")
    (tmp_path / "lib" / "loop.py").write_text("import os\n")
    graph = import_graph(tmp_path, ("lib",))
    assert circles(graph) == []
    (tmp_path / "lib" / "loop.py").write_text(
        "import os\n\n\ndef init():\n    from lib.launch import check  # lazy\n    return check\n")
    assert circles(import_graph(tmp_path, ("lib",))) == [
        ["lib/job.py", "lib/launch.py", "lib/loop.py"]]


def test_a_type_checking_import_counts(tmp_path):
    (tmp_path / "reg").mkdir()
    (tmp_path / "reg" / "__init__.py").write_text("")
    (tmp_path / "reg" / "run.py").write_text("from reg.callback import Callback\n")
    (tmp_path / "reg" / "callback.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from reg.run import Run\n")
    assert circles(import_graph(tmp_path, ("reg",))) == [["reg/callback.py", "reg/run.py"]]

"""No test module imports another: a helper two test modules share lives in `harness/` (a fixture
local to a folder may live in its conftest.py), so each test module can be read, run, moved or
deleted on its own. The tests, the harness and the benchmarks are checked, lazy imports and
`importlib.import_module("tests....")` included; importing a conftest.py (to test its hooks) is
allowed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from harness.packages import ROOT

CHECKED = ("tests", "harness", "benchmarks")


def _package(path: Path) -> list[str]:
    parts = list(path.with_suffix("").parts)
    return parts[:-1]  # an __init__.py's package is its folder, as any module's


def _absolute(module: str | None, level: int, path: Path) -> str:
    if level == 0:
        return module or ""
    package = _package(path)
    anchor = package[: len(package) - (level - 1)]
    return ".".join([*anchor, *([module] if module else [])])


def _file(name: str, root: Path) -> Path | None:
    """The file of module `name` under `root`, if it is one of the project's."""
    if not name:
        return None
    base = Path(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if (root / candidate).is_file():
            return candidate
    return None


def _targets(node: ast.AST, path: Path) -> list[list[str]]:
    """The module names one statement may load, as groups: `from a import b, c` is [a, a.b, a.c]
    (a only the way to b and c when they are modules)."""
    if isinstance(node, ast.Import):
        return [[alias.name] for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = _absolute(node.module, node.level, path)
        return [[base, *(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")]]
    if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"):
        return [[node.args[0].value]]
    return []


def imported_test_modules(path: Path, root: Path) -> list[str]:
    """Files of test code under tests/ that the module at `path` (relative to `root`) imports,
    conftest.py files excepted."""
    found = set()
    for node in ast.walk(ast.parse((root / path).read_text(), str(path))):
        for group in _targets(node, path):
            files = {name: _file(name, root) for name in group}
            modules = {f for f in files.values() if f is not None and f.name != "__init__.py"}
            for file in files.values():
                if file is None or file.parts[0] != "tests" or file.name == "conftest.py":
                    continue
                if file.name == "__init__.py" and any(m.parent == file.parent for m in modules):
                    continue  # the package is only the way to the module taken from it
                found.add(file.as_posix())
    found.discard(path.as_posix())
    return sorted(found)


def test_the_rule_sees_every_form_of_import(tmp_path: Path) -> None:
    for name in ("tests/__init__.py", "tests/a/__init__.py", "tests/a/conftest.py",
                 "tests/a/test_one.py", "tests/b/__init__.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("HELPER = 1\n")
    other = tmp_path / "tests" / "b" / "test_two.py"
    imports = {
        "from tests.a.test_one import HELPER\n": ["tests/a/test_one.py"],
        "from tests.a import test_one\n": ["tests/a/test_one.py"],
        "import tests.a.test_one\n": ["tests/a/test_one.py"],
        "def f():\n    from ..a import test_one\n": ["tests/a/test_one.py"],
        "from ..a.test_one import HELPER\n": ["tests/a/test_one.py"],
        "import importlib\nimportlib.import_module('tests.a.test_one')\n": ["tests/a/test_one.py"],
        "from tests.a import HELPER\n": ["tests/a/__init__.py"],
        "from tests.a import conftest\n": [],
        "from tests.a.conftest import HELPER\n": [],
        "from harness import processes\nimport pytest\n": [],
    }
    for source, expected in imports.items():
        other.write_text(source)
        assert imported_test_modules(other.relative_to(tmp_path), tmp_path) == expected, source


@pytest.mark.parametrize("module", sorted(p.relative_to(ROOT) for folder in CHECKED
                                          for p in (ROOT / folder).rglob("*.py")),
                         ids=str)
def test_no_module_imports_a_test_module(module: Path) -> None:
    assert not imported_test_modules(module, ROOT), "move the shared helper to harness/"

"""No session fixture outside conftest.py. A test module that assigns a fixture from a helper module
to a name (`mlflow_server = server_fixtures.mlflow_server`) gets an instance of its own, whatever
the scope, and a session scope then keeps every module's instance - a server, a Prefect stack -
running until the whole run ends. A fixture shared by modules belongs in conftest.py; one that a
module assigns is module-scoped, stopped when its module ends."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HELPERS = (ROOT / "tests", ROOT / "harness")  # test modules and the fixtures they import


def session_fixtures(source: str) -> list[str]:
    """Names of the functions decorated `@pytest.fixture(scope="session")` in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for decorator in node.decorator_list:
            if isinstance(decorator, ast.Call) and ast.unparse(decorator.func) in (
                    "pytest.fixture", "fixture") and any(
                    k.arg == "scope" and isinstance(k.value, ast.Constant)
                    and k.value.value == "session" for k in decorator.keywords):
                found.append(node.name)
    return found


def test_the_check_finds_a_session_fixture():
    source = ('import pytest\n\n@pytest.fixture(scope="session")\ndef server():\n    yield 1\n\n'
              '@pytest.fixture(scope="module")\ndef stack():\n    yield 2\n')
    assert session_fixtures(source) == ["server"]


def test_no_session_fixture_outside_conftest():
    found = [f"{path.relative_to(ROOT)}::{name}" for folder in HELPERS
             for path in sorted(folder.rglob("*.py")) if path.name != "conftest.py"
             for name in session_fixtures(path.read_text())]
    assert found == [], "module-scope them, or share them from conftest.py (see the docstring)"

"""The project's own Python packages, as pyproject.toml names them for setuptools (their one
owner), and the top-level names a module imports (what the boundary and dependency tests check)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def project_packages(root: Path = ROOT) -> tuple[str, ...]:
    """Top-level names of `[tool.setuptools.packages.find] include` ("clipms*" -> clipms)."""
    config = tomllib.loads((root / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["packages"]["find"]["include"]
    return tuple(sorted({p.rstrip("*").rstrip(".") for p in patterns}))


PROJECT_PACKAGES = project_packages()


def imported_roots(source: str) -> set[str]:
    """Top-level names of every absolute import of a module, lazy ones included."""
    roots = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots

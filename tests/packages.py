"""The project's own Python packages, as pyproject.toml names them for setuptools (their one
owner)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def project_packages(root: Path = ROOT) -> tuple[str, ...]:
    """Top-level names of `[tool.setuptools.packages.find] include` ("clipms*" -> clipms)."""
    config = tomllib.loads((root / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["packages"]["find"]["include"]
    return tuple(sorted({p.rstrip("*").rstrip(".") for p in patterns}))


PROJECT_PACKAGES = project_packages()

"""A throw-away copy of the project in a git repo of its own, where real `dvc` commands run as in
a user's clone: the tests' workspaces (harness/dvc_workspace.py) and the MSCOCO rehearsal
(benchmarks/rehearsal.py).

`copy_project` copies the files git would see (tracked + untracked-not-ignored), `set_params`
applies dotted overrides to a params.yaml (the syntax of profiles/*.yaml and `dvc exp run -S`),
and `commit_all` makes the copy a git repo with one commit, as a clone would be.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

GIT = ["git", "-c", "user.email=workspace@clipms", "-c", "user.name=workspace"]


def project_files(root: Path) -> list[Path]:
    """Paths (relative to `root`) that a clean clone of the working tree would hold."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=root, check=True, capture_output=True, text=True,
    ).stdout
    return [Path(p) for p in out.split("\0") if p and (root / p).is_file()]


def copy_project(root: Path, dst: Path, skip: Iterable[str] = ("tests",)) -> None:
    """Copy the project's files into `dst`, leaving out the top-level folders in `skip`."""
    skipped = set(skip)
    for rel in project_files(root):
        if rel.parts[0] in skipped:
            continue
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, dst / rel)


def set_params(params_file: Path, overrides: dict[str, Any]) -> None:
    """Apply {"section.key.sub": value} overrides to a params.yaml in place."""
    params = yaml.safe_load(params_file.read_text()) or {}
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = params
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    params_file.write_text(yaml.safe_dump(params, sort_keys=False))


def commit_all(dst: Path, message: str = "workspace") -> None:
    """`dst` as a new git repo whose one commit holds every file in it."""
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=dst, check=True)
    subprocess.run([*GIT, "add", "-A"], cwd=dst, check=True)
    subprocess.run([*GIT, "commit", "-q", "-m", message], cwd=dst, check=True)

"""A private workspace for a run with param overrides, so a flow never edits the user's checkout.

`dvc exp run -S` writes the overrides into the workspace's params.yaml and leaves them there; a flow
that did the same in the user's checkout would leave params.yaml modified when its worker crashed,
and would overwrite an edit the user made meanwhile. Instead an override run happens in a
`git worktree` of the checkout (its HEAD plus its uncommitted and untracked-not-ignored files), in a
temporary folder: it shares the checkout's git objects (so `dvc exp save` there lists the
experiment in the checkout, on the same baseline) and its DVC cache (so `dvc checkout` restores
the outputs without copying the cache, and unchanged stages do not rerun); the outputs DVC does not
cache (metrics, plots, training checkpoints) are linked from the checkout. Nothing in the checkout
is written; the worktree is removed afterwards, and one left behind by a crashed run is removed by
the next override run on the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

PREFIX = "clipms-run-"
# Tracking state that belongs to the checkout's own runs, never to an experiment's copy.
NOT_COPIED = ("models/checkpoints/mlflow_run.json",)


class WorkspaceError(RuntimeError):
    """The checkout cannot be copied into a private workspace (no git commit, git failed)."""


def _git(args: list[str], cwd: Path) -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise WorkspaceError(f"`git {' '.join(args)}` in {cwd} failed: {proc.stderr.strip()}")
    return proc.stdout


@contextmanager
def experiment_workspace(checkout: Path, name: str,
                         dvc: Callable[[list[str], Path], str]) -> Iterator[Path]:
    """A worktree of `checkout` named after `name` (the flow run), ready for `dvc repro`; `dvc`
    runs a dvc command in a folder. Removed when the block ends, whatever happens in it."""
    checkout = checkout.resolve()
    remove_stale(checkout)
    _git(["rev-parse", "--verify", "HEAD"], checkout)  # an override run needs a commit to copy
    root = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{name}-"))
    worktree = root / "workspace"
    try:
        _git(["worktree", "add", "--detach", str(worktree), "HEAD"], checkout)
        _copy_uncommitted(checkout, worktree)
        _share_dvc_cache(checkout, worktree, dvc)
        # Cached outputs, from the shared cache; the ones never produced yet are simply missing.
        dvc(["checkout", "--quiet", "--allow-missing"], worktree)
        _link_uncached_outputs(checkout, worktree)
        yield worktree
    finally:
        _remove(checkout, worktree)
        shutil.rmtree(root, ignore_errors=True)


def remove_stale(checkout: Path) -> list[Path]:
    """Remove worktrees of this checkout left by override runs that did not end (a crash)."""
    removed = []
    for line in _git(["worktree", "list", "--porcelain"], checkout).splitlines():
        if not line.startswith("worktree "):
            continue
        path = Path(line.removeprefix("worktree "))
        if path.name == "workspace" and path.parent.name.startswith(PREFIX):
            _remove(checkout, path)
            shutil.rmtree(path.parent, ignore_errors=True)
            removed.append(path)
    _git(["worktree", "prune"], checkout)
    return removed


def _remove(checkout: Path, worktree: Path) -> None:
    subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=checkout,
                   capture_output=True, timeout=300)


def _copy_uncommitted(checkout: Path, worktree: Path) -> None:
    """The checkout's working state: every file that differs from HEAD, staged or not (DVC's
    `core.autostage` stages dvc.lock; `ls-files --modified` compares with the index and would miss
    it), deleted ones included, and the untracked (not ignored) files."""
    changed = _git(["diff", "--name-only", "--no-renames", "-z", "HEAD"], checkout)
    untracked = _git(["ls-files", "-z", "--others", "--exclude-standard"], checkout)
    for rel in dict.fromkeys(p for p in (changed + untracked).split("\0") if p):
        source, target = checkout / rel, worktree / rel
        if source.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
        elif not source.exists():
            target.unlink(missing_ok=True)


def _share_dvc_cache(checkout: Path, worktree: Path,
                     dvc: Callable[[list[str], Path], str]) -> None:
    """The worktree's DVC uses the checkout's local config and its cache."""
    local = checkout / ".dvc" / "config.local"
    if local.is_file():
        shutil.copy2(local, worktree / ".dvc" / "config.local")
    cache = dvc(["cache", "dir"], checkout).strip().splitlines()[-1]
    dvc(["cache", "dir", "--local", str((checkout / cache).resolve())], worktree)


def _link_uncached_outputs(checkout: Path, worktree: Path) -> None:
    """Hard-link (or copy) the checkout's outputs that DVC does not cache, so that DVC finds the
    stages that produced them up to date. Every project writer replaces files (temp + rename),
    so a link never lets the experiment change the checkout's file."""
    for rel in uncached_outputs(worktree / "dvc.yaml"):
        source = checkout / rel
        files = [source] if source.is_file() else sorted(
            p for p in source.rglob("*") if p.is_file())
        for path in files:
            inner = path.relative_to(checkout)
            if str(inner) in NOT_COPIED:
                continue
            target = worktree / inner
            target.parent.mkdir(parents=True, exist_ok=True)
            target.unlink(missing_ok=True)
            try:
                os.link(path, target)
            except OSError:  # another file system
                shutil.copy2(path, target)


def uncached_outputs(dvc_yaml: Path) -> list[str]:
    """The `cache: false` outs, metrics and plots of every stage in dvc.yaml."""
    stages = (yaml.safe_load(dvc_yaml.read_text()) or {}).get("stages") or {}
    found = []
    for stage in stages.values():
        for kind in ("outs", "metrics", "plots"):
            for entry in stage.get(kind) or []:
                if isinstance(entry, dict):
                    path, options = next(iter(entry.items()))
                    if (options or {}).get("cache") is False:
                        found.append(str(path))
    return list(dict.fromkeys(found))

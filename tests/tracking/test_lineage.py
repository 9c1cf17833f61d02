"""tracking.lineage's dirty check in a real git repository: every kind of `git status` entry
(unstaged, staged, renamed, untracked, deleted), each as the only change, so each is the first
line of the status - where an unstaged edit's leading space used to be stripped away, turning
` M params.yaml` into `arams.yaml` and a run from an edited checkout into a clean one."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tracking import lineage

GIT = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
TRACKED = {"params.yaml": "train:\n  lr: 0.001\n", "dvc.yaml": "stages: {}\n",
           "pyproject.toml": "[project]\n", "clipms/assets/a.json": "{}\n",
           "stages/train.py": "x = 1\n", "notes.txt": "a note\n",
           "dir with space/é.py": "y = 2\n", "data/out.bin": "output\n"}
LOCK = {"train": {"outs": [{"path": "data/out.bin"}]}}


def git(repo: Path, *args: str) -> str:
    return subprocess.run([*GIT, *args], cwd=repo, check=True, capture_output=True,
                          text=True).stdout


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name, text in TRACKED.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "base")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def dirty() -> str | None:
    return lineage.lineage(LOCK, Path("no-manifest.json")).get("lineage.git_dirty")


def edit(repo: Path, name: str) -> None:
    (repo / name).write_text((repo / name).read_text() + "# edited\n")


def test_a_clean_checkout_is_clean(repo: Path) -> None:
    assert dirty() == "false"


@pytest.mark.parametrize("name", ["params.yaml", "dvc.yaml", "pyproject.toml",
                                  "clipms/assets/a.json", "stages/train.py",
                                  "dir with space/é.py"])
def test_an_unstaged_edit_alone_is_dirty(repo: Path, name: str) -> None:
    edit(repo, name)
    assert git(repo, "status", "--porcelain").startswith(" M ")  # the case that was lost
    assert dirty() == "true"


def test_a_staged_edit_a_rename_a_deletion_and_an_untracked_file_are_dirty(repo: Path) -> None:
    edit(repo, "params.yaml")
    git(repo, "add", "params.yaml")
    assert git(repo, "status", "--porcelain").startswith("M  ")
    assert dirty() == "true"
    git(repo, "reset", "-q", "--hard")
    git(repo, "mv", "stages/train.py", "stages/fit.py")
    assert git(repo, "status", "--porcelain").startswith("R  ")
    assert dirty() == "true"
    git(repo, "reset", "-q", "--hard")
    (repo / "stages/fit.py").unlink(missing_ok=True)
    git(repo, "mv", "params.yaml", "old-params.txt")  # renamed away: its source path counts
    assert dirty() == "true"
    git(repo, "reset", "-q", "--hard")
    (repo / "old-params.txt").unlink(missing_ok=True)
    (repo / "dvc.yaml").unlink()
    assert dirty() == "true"
    git(repo, "reset", "-q", "--hard")
    (repo / "stages" / "new_stage.py").write_text("z = 3\n")
    assert git(repo, "status", "--porcelain", "--untracked-files=all").startswith("?? ")
    assert dirty() == "true"


def test_notes_outputs_and_dvc_lock_leave_the_commit_clean(repo: Path) -> None:
    edit(repo, "notes.txt")
    edit(repo, "data/out.bin")
    (repo / "dvc.lock").write_text("schema: '2.0'\n")
    git(repo, "mv", "notes.txt", "notes-renamed.txt")
    (repo / "todo.md").write_text("later\n")
    assert dirty() == "false"


def test_status_paths_reads_every_entry_of_the_nul_separated_format() -> None:
    status = " M params.yaml\0R  new.py\0old name.py\0?? a b.txt\0 D gone.py\0"
    assert lineage.status_paths(status) == ["params.yaml", "new.py", "old name.py", "a b.txt",
                                            "gone.py"]

"""The retain stage's own decision: in a temporary copy of the project (a `--temp` or queued DVC
experiment) it leaves the shared DVC cache alone. (The stage under `dvc repro`, against real
stores: tests/integration/test_retention_store.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from stages.retain import temporary_copy


def test_a_temporary_copy_is_told_by_dvc_root(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    project, copy = tmp_path / "project", tmp_path / "project" / ".dvc" / "tmp" / "exps" / "x"
    copy.mkdir(parents=True)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    assert not temporary_copy(project)  # run by hand: the cwd is the project
    monkeypatch.setenv("DVC_ROOT", str(project))
    assert not temporary_copy(project)  # `dvc repro`: DVC_ROOT is the cwd
    assert temporary_copy(copy)  # `dvc exp run --temp`: DVC_ROOT is the user's project

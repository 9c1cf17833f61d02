"""Pinned evaluation sets (clipms/data/evalset.py, `python -m ops.pin_evalset`): today's val
split frozen into a folder of its own, never overwritten, checked shard by shard, and versioned
with `dvc add` in a DVC project."""

from __future__ import annotations

import subprocess
from contextlib import chdir
from pathlib import Path

import pytest
import yaml

from clipms.data.evalset import freeze, verify
from clipms.data.webds import DataError
from harness.tiny_model import make_train_and_val_shards, make_val_shards
from tracking.lineage import val_digest


def test_a_frozen_split_is_the_same_samples_under_the_same_digest(tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    make_train_and_val_shards(shards, n_train=10, n_val=11, per_shard=4)
    manifest = freeze(shards, "val", tmp_path / "pinned")
    assert list(manifest["splits"]) == ["val"]
    assert sorted(p.name for p in (tmp_path / "pinned" / "val").iterdir()) == [
        "000000.tar", "000001.tar", "000002.tar"]
    for shard in manifest["splits"]["val"]["shards"]:
        assert (tmp_path / "pinned" / shard["name"]).read_bytes() == (
            shards / shard["name"]).read_bytes()
    # the same evaluation set: versions evaluated on today's split need no re-scoring on it
    assert val_digest(tmp_path / "pinned/manifest.json") == val_digest(shards / "manifest.json")
    assert verify(tmp_path / "pinned") == manifest
    frozen_train = freeze(shards, "train", tmp_path / "from-train")  # any split, held as val
    assert frozen_train["splits"]["val"]["samples"] == 10


def test_a_frozen_set_is_never_overwritten_and_a_changed_one_is_refused(tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    make_val_shards(shards, n_images=9, per_shard=4)
    freeze(shards, "val", tmp_path / "pinned")
    with pytest.raises(DataError, match="already exists; a frozen evaluation set is never"):
        freeze(shards, "val", tmp_path / "pinned")
    shard = tmp_path / "pinned" / "val" / "000001.tar"
    data = bytearray(shard.read_bytes())
    data[600] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"shard val/000001.tar is not the one recorded .* the "
                                        r"set was changed"):
        verify(tmp_path / "pinned")
    shard.unlink()
    with pytest.raises(DataError, match="shard val/000001.tar is missing"):
        verify(tmp_path / "pinned")
    with pytest.raises(DataError, match="no frozen evaluation set there"):
        verify(tmp_path / "elsewhere")
    (shards / "val" / "000000.tar").write_bytes(b"truncated")  # a source that is not as recorded
    with pytest.raises(DataError, match="is not the one recorded"):
        freeze(shards, "val", tmp_path / "again")
    assert not (tmp_path / "again").exists() and not (tmp_path / ".again.partial").exists()


def test_the_command_freezes_into_data_evalsets_and_names_the_param(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ops import pin_evalset

    make_val_shards(tmp_path / "data" / "shards", n_images=5)
    with chdir(tmp_path):
        assert pin_evalset.main(["freeze", "2026-12-05", "--no-dvc"]) == 0
        out = capsys.readouterr().out
        assert "data/evalsets/2026-12-05: 5 samples" in out
        assert "evaluate.pinned_set: 2026-12-05" in out
        assert pin_evalset.main(["verify", "2026-12-05"]) == 0
        with pytest.raises(SystemExit):  # a name, never a path
            pin_evalset.main(["freeze", "../outside"])
    assert not (tmp_path / "data" / "outside").exists()


@pytest.mark.slow
def test_in_a_dvc_project_the_set_is_versioned_by_a_committed_dvc_file(tmp_path: Path) -> None:
    from harness.dvc_workspace import PROJECT_ROOT, run, tool_env

    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / ".gitignore").write_text((PROJECT_ROOT / ".gitignore").read_text())
    run(["dvc", "init", "-q"], tmp_path)
    make_val_shards(tmp_path / "data" / "shards", n_images=5)
    env = {**tool_env(), "PYTHONPATH": str(PROJECT_ROOT)}
    out = run(["python", "-m", "ops.pin_evalset", "freeze", "v1"], tmp_path, env=env).stdout
    assert "versioned by data/evalsets/v1.dvc" in out
    subprocess.run([*git, "add", ".gitignore", "data/evalsets/v1.dvc",
                    "data/evalsets/.gitignore"], cwd=tmp_path, check=True)
    tracked = subprocess.run(["git", "ls-files", "--others", "--exclude-standard"], cwd=tmp_path,
                             capture_output=True, text=True, check=True).stdout
    assert "data/evalsets/v1/" not in tracked and "data/shards" not in tracked  # DVC's, not git's
    outs = yaml.safe_load((tmp_path / "data/evalsets/v1.dvc").read_text())["outs"]
    assert outs[0]["path"] == "v1" and outs[0]["md5"].endswith(".dir")
    import shutil

    shutil.rmtree(tmp_path / "data/evalsets/v1")  # what `dvc checkout` / `dvc pull` bring back
    run(["dvc", "checkout", "data/evalsets/v1.dvc"], tmp_path)
    verify(tmp_path / "data/evalsets/v1")

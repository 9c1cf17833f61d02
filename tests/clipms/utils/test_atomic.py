"""clipms.utils.atomic: the one writer every output goes through."""

from __future__ import annotations

import subprocess
import sys

import pytest

from clipms.utils.atomic import atomic_write, dead_writers_temps, write_text


def test_the_target_changes_only_when_the_block_succeeds(tmp_path):
    target = tmp_path / "sub" / "out.json"
    write_text(target, "old")
    with pytest.raises(RuntimeError, match="disk full"), atomic_write(target) as tmp:
        tmp.write_text("half of the new")
        assert target.read_text() == "old"  # the write goes elsewhere...
        raise RuntimeError("disk full")
    assert target.read_text() == "old"  # ...and is dropped on error
    assert [p.name for p in target.parent.iterdir()] == ["out.json"]
    with atomic_write(target, durable=True) as tmp:
        assert tmp.parent == target.parent and tmp.suffix == ".json"  # rename: atomic
        tmp.write_text("new")
    assert target.read_text() == "new"
    assert [p.name for p in target.parent.iterdir()] == ["out.json"]


def test_temp_files_of_dead_writers_are_found_and_live_ones_are_not(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".a.ckpt.tmp-{dead.pid}-00c0ffee.ckpt"
    stale.write_bytes(b"\0")
    with atomic_write(tmp_path / "b.ckpt") as mine:
        mine.write_bytes(b"\0")
        assert dead_writers_temps(tmp_path) == [stale]


def test_a_write_removes_the_temp_file_a_killed_writer_left_for_the_same_target(tmp_path):
    """SIGKILL runs no `finally`: a writer killed mid-write leaves its temp file beside the
    target; the next write of that target (the rerun) removes it, and only it."""
    writer = subprocess.Popen([sys.executable, "-c", (
        "import os, signal, sys; from clipms.utils.atomic import atomic_write\n"
        f"with atomic_write({str(tmp_path / 'eval.json')!r}) as tmp:\n"
        "    tmp.write_text('half'); os.kill(os.getpid(), signal.SIGKILL)")])
    writer.wait()
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].startswith(".eval.json.tmp-")
    other = tmp_path / f".other.json.tmp-{writer.pid}-00c0ffee.json"
    other.write_text("another target's")
    write_text(tmp_path / "eval.json", "whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == [other.name, "eval.json"]
    assert (tmp_path / "eval.json").read_text() == "whole"

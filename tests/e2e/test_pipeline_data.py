"""End to end with real DVC: `dvc repro shard` on the tiny synthetic config in a fresh git repo."""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from harness.dvc_workspace import make_workspace, run
from harness.image_site import part_folder


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_dvc_repro_shard_builds_manifest_and_is_then_a_no_op(tmp_path):
    ws = make_workspace(tmp_path)
    run(["dvc", "repro", "shard"], ws)

    manifest = json.loads((ws / "data/shards/manifest.json").read_text())
    shard_metrics = json.loads((ws / "metrics/shard.json").read_text())
    dedupe = json.loads((ws / "metrics/dedupe.json").read_text())
    download = json.loads((ws / "metrics/download.json").read_text())
    per_shard = manifest["samples_per_shard"]
    assert per_shard == 16
    # The synthetic source is file:// URLs: allowed for it, and every image arrives.
    assert download["disallowed_scheme"] == 0
    assert download["successes"] == download["attempted"] == dedupe["images_out"] == 48
    assert dedupe["removed"]["exact_duplicate"] + dedupe["removed"]["duplicate_caption"] > 0
    assert shard_metrics["samples_out"] == 48
    total = 0
    for split in ("train", "val"):
        entry = manifest["splits"][split]
        assert entry["samples"] == sum(s["samples"] for s in entry["shards"])
        assert entry["samples"] == dedupe[f"{split}_images"]
        assert all(s["samples"] == per_shard for s in entry["shards"][:-1])
        for shard in entry["shards"]:
            path = ws / "data/shards" / shard["name"]
            assert sha256(path) == shard["sha256"] and path.stat().st_size == shard["bytes"]
        total += entry["samples"]
    assert total == 48 and manifest["splits"]["val"]["samples"] > 0

    again = run(["dvc", "repro", "shard"], ws)
    assert "didn't change" in again.stdout or "up to date" in again.stdout
    assert "Running stage" not in again.stdout
    status = run(["dvc", "status", "shard"], ws)
    assert "up to date" in status.stdout

    # An interrupted download (shard 1 never finished): DVC keeps the persisted folder, the stage
    # resumes only the unfinished shard, and the rebuilt shards are byte-identical.
    out = part_folder(ws / "data/download")  # the download store's first part
    kept = (out / "00000.tar").stat().st_mtime_ns
    (out / "00001_stats.json").unlink()
    (out / "00001.tar").unlink()
    resumed = run(["dvc", "repro", "-f", "download"], ws)
    assert re.search(r"resuming part \d+ \(1 of \d+ img2dataset shard\(s\) finished are kept\)",
                     resumed.stdout), resumed.stdout
    assert (out / "00000.tar").stat().st_mtime_ns == kept and (out / "00001.tar").is_file()
    run(["dvc", "repro", "shard"], ws)
    assert json.loads((ws / "data/shards/manifest.json").read_text()) == manifest

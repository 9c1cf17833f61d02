"""The data-change report as DVC runs it, on a growing local source served over loopback HTTP: a
night whose new images mostly fail to arrive stops `dvc repro` at the `changes` stage, before
`train` starts, with the report written and a message naming the problem; the baseline stays the
last accepted night, so the next good night is still compared with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from harness.dvc_workspace import make_workspace, run
from harness.nightly_world import GrowingSource


def nightly(ws: Path, target: str, check: bool = True):
    """What the nightly deployment runs: the metadata stage forced (its source may have changed
    behind the same params), then the pipeline up to `target`."""
    run(["dvc", "repro", "--force", "--single-item", "metadata"], ws)
    return run(["dvc", "repro", target], ws, check=check)


def report(ws: Path) -> dict:
    return json.loads((ws / "metrics/changes.json").read_text())


def locked_baseline(ws: Path) -> str:
    """The DVC hash of data/changes (the snapshots) that dvc.lock records."""
    lock = yaml.safe_load((ws / "dvc.lock").read_text())["stages"]["changes"]
    return next(out["md5"] for out in lock["outs"] if out["path"] == "data/changes")


@pytest.mark.slow
def test_a_broken_night_stops_dvc_repro_before_training(tmp_path):
    source = GrowingSource(tmp_path / "source", capacity=60)
    overrides = {"metadata.source": "local", "metadata.path": str(source.path),
                 "download.allow_private_addresses": True, "download.samples_per_shard": 16,
                 "download.min_success_rate": 0.3, "dedupe.val_fraction": 0.25}
    ws = make_workspace(tmp_path / "ws", overrides)
    with source.site() as site:
        source.write(site, range(40))
        nightly(ws, "changes")
        first = report(ws)
        baseline = locked_baseline(ws)

        # Night 2: 20 new rows, 16 of them for pictures the site does not have.
        gone = [{"URL": f"{site.base}/gone/{i}.jpg", "TEXT": f"a picture that is gone {i}"}
                for i in range(16)]
        source.write(site, range(44), extra=gone)
        failed = nightly(ws, "train", check=False)
        second = report(ws)
        after_failure = locked_baseline(ws)
        snapshot = (ws / "data/changes/current/snapshot.json").read_text()

        # Night 3: the broken rows are gone again and ten good ones are new.
        source.write(site, range(50))
        nightly(ws, "changes")
        third = report(ws)

    assert first["ok"] and first["baseline"]["first_run"] and first["images"]["new"] == 40
    assert failed.returncode != 0
    output = failed.stdout + failed.stderr
    assert "16 of 20 new images did not arrive (failed or refused)" in output
    assert "changes.max_new_failure_rate 0.5" in output
    assert "Running stage 'train'" not in output and not (ws / "models/clip.ckpt").exists()
    assert second["ok"] is False and second["download"]["new_failed"] == 16
    assert after_failure == baseline  # nothing accepted: the snapshots are night 1's
    assert json.loads(snapshot)["images"] == 40
    assert third["ok"] and third["baseline"] == {"first_run": False, "images": 40, "rows": 80}
    assert third["images"]["new"] == 10  # against night 1: night 2 was never accepted

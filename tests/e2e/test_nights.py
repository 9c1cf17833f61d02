"""Five nights of the nightly flow on a growing world, two of them planted (benchmarks/nights.py,
the 30-night benchmark's code): a truncated export on night 3, a learning rate of 1e30 on night 4.

Real parts throughout: the tests' tiny model trained by the real trainer, images over loopback
HTTP, real dvc in a git checkout, a real Prefect server, MLflow in the checkout's mlflow.db, the
failure webhook on loopback. The failed nights must leave the champion and the checkout's outputs
(dvc.lock, hence what is served) as they were, and send one notice each naming the stage and the
kind of failure; the night after them trains on everything listed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.nights import STORES, main

pytestmark = pytest.mark.slow


# Three nights train, evaluate, export, index and register (as
# tests/flows/test_pipeline_nightly.py's);
# the planted nights stop early.
@pytest.mark.timeout(3600)
def test_five_nights_with_a_broken_source_and_a_diverging_training(tmp_path: Path) -> None:
    out = tmp_path / "nights.json"
    assert main(["--nights", "5", "--plant", "3:broken_source,4:diverging", "--steps", "4",
                 "--out", str(out), "--keep", str(tmp_path / "world")]) == 0
    nights = json.loads(out.read_text())["results"]["nights"]  # benchmarks/record.py's envelope
    assert [n["planted"] for n in nights] == [None, None, "broken_source", "diverging", None]

    first, grown, broken, diverging, after = nights
    assert first["decision"] == "v1 champion" and first["notices"] == []
    assert grown["state"] == "COMPLETED" and grown["decision"].startswith("v2 ")
    assert grown["compared"]["champion_value"] is not None  # compared with the champion

    for night, stage, kind in ((broken, "metadata", "broken source"),
                               (diverging, "train", "diverging training")):
        assert night["state"] == "FAILED", night
        assert [(n["stage"], n["kind"]) for n in night["notices"]] == [(stage, kind)], night
        assert night["champion_after"] == night["champion_before"] == grown["champion_after"]
        assert night["lock_after"] == night["lock_before"] == grown["lock_after"]
    assert "at step" in diverging["notices"][0]["reason"], diverging["notices"]

    assert after["state"] == "COMPLETED" and after["decision"].startswith("v3 "), after
    assert after["notices"] == []
    assert after["stage_seconds"]["train"] > 0 and after["stage_seconds"]["register"] > 0
    assert set(after["storage_bytes"]) == {*STORES, "dvc_remote"}
    assert after["storage_bytes"]["dvc_cache"] > first["storage_bytes"]["dvc_cache"] > 0

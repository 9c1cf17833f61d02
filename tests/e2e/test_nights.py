"""Six nights of the nightly flow on a growing world (benchmarks/nights.py, the month benchmark's
code), as the nightly deployment runs them (`refresh: [metadata]`), three of them planted.

Real parts throughout: the tests' tiny model trained by the real trainer, learnable pictures (a
coloured square, circle or stripe; the captions say which) over loopback HTTP to img2dataset,
real dvc in a git checkout with a DVC remote, a real Prefect server, MLflow in the checkout's
mlflow.db, the failure webhook on loopback. `tokenizer.pin` and `train.init_from` name
`@champion` from the first night on, and a challenger must beat the champion by 0.2 of i2t_R@5.

1. The first day: two cold steps (a barely trained champion on purpose); version 1 is champion.
2. Half as many pictures again, some in val: the site is asked for the new ones only, the
   champion is re-scored on tonight's evaluation set (both values, where each came from, the
   set's digest), and version 2, forty steps warm from it, beats it there and is promoted.
3. A truncated export, and 4. a learning rate of 1e30: each night fails, sends one notice naming
   the stage and the kind, and leaves the champion and the checkout's outputs (dvc.lock, hence
   what is served) as they were.
5. As many pictures again as were listed, their captions shuffled among them: every data check
   passes and the flow trains on everything listed; re-scored on tonight's set, the champion is
   not beaten by the margin, so version 3 is only challenger. (A tiny model trained for a few
   dozen steps on half-poisoned data is not reliably worse than the champion on a few dozen val
   pictures, so this rests on the margin, not on the poisoned model coming out worse.)
6. Nothing new: the forced metadata refresh reproduces the same output, the data stages are up
   to date, nothing is fetched, trained or registered, and one notice says so.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.nights import MODEL, STORES, main

pytestmark = pytest.mark.slow

MARGIN = 0.2


# Four nights train, evaluate, export, index and register (night 4 stops in train).
@pytest.mark.timeout(3600)
def test_six_nights_grown_broken_diverging_poisoned_and_unchanged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flows import pipeline

    # the broken export is retried as a flaky source would be (the count is the flow's own); a
    # 0.1 s backoff instead of 10 s spares the test over a minute of waiting
    monkeypatch.setattr(pipeline, "RETRY_BACKOFF_SECONDS", 0.1)
    out = tmp_path / "nights.json"
    assert main(["--nights", "6", "--growth", "0.5", "--first-steps", "2", "--steps", "40",
                 "--margin", str(MARGIN), "--plant",
                 "3:broken_source,4:diverging,5:poisoned,6:no_new_rows",
                 "--out", str(out), "--keep", str(tmp_path / "world")]) == 0
    nights = json.loads(out.read_text())["results"]["nights"]  # benchmarks/record.py's envelope
    first, grown, broken, diverging, poisoned, unchanged = nights

    assert first["decision"] == "v1 champion" and first["notices"] == []
    assert first["train_steps"] == 2 and first["asked"]["pictures"] == 48

    check_grown_night(grown)
    check_failed_nights(broken, diverging, grown)
    check_poisoned_night(poisoned)
    check_unchanged_night(unchanged, poisoned)
    assert set(poisoned["storage_bytes"]) == {*STORES, "dvc_remote"}
    assert poisoned["storage_bytes"]["dvc_cache"] > first["storage_bytes"]["dvc_cache"] > 0
    check_registry(tmp_path / "world" / "ws")


def check_grown_night(night: dict) -> None:
    assert night["state"] == "COMPLETED" and night["notices"] == [], night
    assert night["images_listed_new"] == 24
    # only the new pictures are asked of the site; the first day's are reused from the store
    assert night["asked"] == {"pictures": 24, "listed_before": 0}, night["asked"]
    assert night["download"] == {"new_images": 24, "reused_images": 48, "fetched": 24}
    compared = night["compared"]
    assert night["decision"] == "v2 champion" and compared["compared"] is True, compared
    assert compared["champion_version"] == "1"
    assert compared["champion_source"].startswith(f"re-scored from models:/{MODEL}/1 ")
    assert compared["eval_set"] in compared["champion_source"]  # the set's digest, named
    assert compared["champion_recorded_set"] != compared["eval_set"]  # v1 was scored on night 1's
    assert compared["new_source"] == "evaluate stage of this run"
    assert compared["new_value"] >= compared["champion_value"] + MARGIN, compared
    assert night["train_steps"] == 40 and night["champion_after"] == "2"


def check_failed_nights(broken: dict, diverging: dict, grown: dict) -> None:
    for night, stage, kind in ((broken, "metadata", "broken source"),
                               (diverging, "train", "diverging training")):
        assert night["state"] == "FAILED", night
        assert [(n["stage"], n["kind"]) for n in night["notices"]] == [(stage, kind)], night
        assert night["champion_after"] == night["champion_before"] == grown["champion_after"]
        assert night["lock_after"] == night["lock_before"] == grown["lock_after"]
        assert night["compared"] is None and night["headline"] is None
    assert "at step" in diverging["notices"][0]["reason"], diverging["notices"]


def check_poisoned_night(night: dict) -> None:
    assert night["state"] == "COMPLETED" and night["notices"] == [], night
    assert night["images_listed_new"] == 162
    assert night["asked"]["listed_before"] <= 162 - 72  # the failed nights' pictures, at most
    compared = night["compared"]
    assert night["decision"] == "v3 challenger" and compared["compared"] is True, compared
    assert compared["champion_version"] == "2"
    assert compared["champion_source"].startswith(f"re-scored from models:/{MODEL}/2 ")
    assert compared["new_value"] < compared["champion_value"] + MARGIN, compared
    assert night["champion_after"] == "2" and night["train_steps"] == 40
    assert night["stage_seconds"]["train"] > 0 and night["stage_seconds"]["register"] > 0


def check_unchanged_night(night: dict, before: dict) -> None:
    """The nightly deployment's `train_without_new_data: false`: nothing is trained, and the one
    notice says why."""
    assert night["state"] == "COMPLETED", night
    assert [(n["stage"], n["kind"]) for n in night["notices"]] == [("train", "no new data")]
    assert night["headline"].startswith("no new data") and night["asked"]["pictures"] == 0
    outcomes = dict(night["stage_outcomes"])
    assert outcomes.pop("metadata") == "ran (forced), outputs unchanged", night
    data_stages = ("dedupe", "download", "shard", "tokenizer", "changes")
    assert {outcomes.pop(stage) for stage in data_stages} == {"up to date"}, night
    assert "train" in outcomes and set(outcomes.values()) == {"skipped: no new data"}, night
    assert night["lock_after"] == night["lock_before"] == before["lock_after"]
    assert night["download"] == dict.fromkeys(("new_images", "reused_images", "fetched"))
    assert night["train_steps"] is None and night["champion_after"] == "2"


def check_registry(ws: Path) -> None:
    """Three versions; version 2 started from version 1 (a warm start)."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{ws}/mlflow.db")
    versions = {str(v.version): v for v in client.search_model_versions(f"name='{MODEL}'")}
    assert sorted(versions) == ["1", "2", "3"]
    run = client.get_run(versions["2"].run_id)
    assert run.data.tags["lineage.init_from"] == f"models:/{MODEL}/1"

"""The night's page and the one-line list, from the files the stages write (registry/nightlog.py).

The metrics files are written in the shape the stages write them (keys from stages/dedupe.py,
download, changes, train, register); a file older than the night is not tonight's."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from registry import nightlog

STAGES = [{"stage": "metadata", "outcome": "ran", "seconds": 2.0},
          {"stage": "download", "outcome": "ran", "seconds": 12.5},
          {"stage": "train", "outcome": "ran", "seconds": 61.0},
          {"stage": "register", "outcome": "ran", "seconds": 9.25}]
REGISTER = {"alias": "challenger", "version": 4, "primary_metric": "i2t_R@5", "compared": True,
            "new_value": 0.5125, "new_source": "evaluate stage of this run",
            "champion_value": 0.6, "champion_version": "3",
            "champion_source": "re-scored from models:/clip/3 on set 1a2b3c",
            "eval_set": "1a2b3c", "eval_set_name": "split val of data/shards", "margin": 0.02,
            "reason": "not better than the champion by the margin"}


def write(root: Path, name: str, data: dict[str, Any], age_s: float = 0.0) -> None:
    path = root / nightlog.FILES[name]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    if age_s:
        stamp = time.time() - age_s
        os.utime(path, (stamp, stamp))


@pytest.fixture
def night_files(tmp_path: Path) -> Path:
    write(tmp_path, "dedupe", {"rows_in": 520, "images_out": 100,
                               "removed": {"exact_duplicate": 7, "empty_caption": 0}})
    write(tmp_path, "download", {"fetched": 5, "reused_images": 95, "failed_to_download": 1,
                                 "failure_reasons": {"HTTP 404": 1}})
    write(tmp_path, "changes", {"images": {"new": 6, "removed": 0, "total": 100},
                                "rows": {"new": 30}, "failures": []})
    write(tmp_path, "shard", {"dropped": {"undecodable_image": 2, "too_small": 0}})
    write(tmp_path, "train", {"steps": 40.0, "wall_time_s": 58.2, "final_loss": 2.5,
                              "skipped_steps": 3, "loss_scale": 1024.0})
    write(tmp_path, "register", REGISTER)
    write(tmp_path, "retain", {"bytes_added": 2_500_000, "bytes_freed": 41_000_000,
                               "removed": {"versions": [1]}})
    return tmp_path


def read(root: Path, **kw: Any) -> nightlog.Night:
    return nightlog.read_night(root, "brave-owl", time.time() - 60, kw.pop("headline", "updated"),
                               kw.pop("outcome", "completed"), STAGES, **kw)


def test_the_page_holds_data_training_comparison_decision_storage_and_time(
        night_files: Path) -> None:
    page = nightlog.render(read(night_files))
    assert page.startswith("# Night `brave-owl`: updated")
    assert "rows in: 520" in page and "images new / removed / total: 6 / 0 / 100" in page
    assert "images fetched: 5 (reused from earlier nights: 95, failed: 1)" in page
    dropped = page.split("dropped, and why: ")[1].splitlines()[0]
    assert dropped == "7 exact_duplicate, 2 undecodable_image, 1 HTTP 404"
    assert "steps: 40, time: 58.2 s" in page
    assert "skipped steps: 3, final loss scale: 1024" in page
    assert "tonight's model: 0.5125 (evaluate stage of this run)" in page
    assert "champion v3: 0.6 (re-scored from models:/clip/3 on set 1a2b3c)" in page
    assert "split val of data/shards (digest `1a2b3c`)" in page
    assert "version 4 is **challenger** (margin 0.02): not better" in page
    assert "bytes_freed: 41.0 MB" in page and "bytes_added: 2.5 MB" in page
    assert "| train | ran | 61.0 |" in page and "85 s in stages" in page


def test_files_from_earlier_nights_and_absent_ones_are_named_not_shown(tmp_path: Path) -> None:
    write(tmp_path, "train", {"steps": 999.0, "wall_time_s": 1.0}, age_s=3600)  # last night's
    write(tmp_path, "register", REGISTER, age_s=3600)
    write(tmp_path, "changes", {"images": {"new": 0, "removed": 0, "total": 100}})
    page = nightlog.render(read(tmp_path, outcome="no new data"))
    assert "999" not in page and "challenger" not in page
    assert "Nothing trained tonight (`metrics/train.json`: not written tonight" in page
    assert "No retention report tonight (`metrics/retain.json`: not written)" in page
    assert "images new / removed / total: 0 / 0 / 100" in page


def test_a_trainer_without_skipped_steps_and_a_failed_night_still_read_well(
        night_files: Path) -> None:
    write(night_files, "train", {"steps": 40.0, "wall_time_s": 58.2})
    failure = {"stage": "register", "kind": "registry outage",
               "reason": "URLError: Connection refused", "advice": "check the tracking server"}
    record = read(night_files, headline="failed at stage 'register'", outcome="failed",
                  failure=failure)
    page = nightlog.render(record)
    assert "skipped steps: not reported by this trainer" in page
    assert "**Stopped at stage `register`: registry outage.** URLError" in page
    assert "What to do: check the tracking server" in page
    figures = nightlog.facts(record)
    assert (figures["failed_stage"], figures["failure_kind"]) == ("register", "registry outage")
    line = nightlog.line(0.0, "brave-owl", figures)
    assert line.startswith("1970-01-01 00:00  brave-owl  FAILED at register: registry outage")


def test_a_line_per_night_names_the_decision_and_both_values(night_files: Path) -> None:
    figures = nightlog.facts(read(night_files))
    assert figures["stage_seconds"] == {"metadata": 2.0, "download": 12.5, "train": 61.0,
                                        "register": 9.2}
    assert nightlog.line(0.0, "brave-owl", figures) == (
        "1970-01-01 00:00  brave-owl  v4 challenger (0.5125 vs 0.6)  new 6  steps 40  "
        "skipped 3  84.8 s")

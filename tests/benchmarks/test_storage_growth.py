"""The storage-per-night benchmark's own parts that need no pipeline: what a night wrote to and
freed from a store, the day it ages the index-store listing by, the retention it sets, and the
table it renders (the nights themselves run only in the benchmark)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.render_results import renderer
from benchmarks.render_results import storage_growth as render
from benchmarks.storage_growth import (
    STORE_FOLDERS,
    age_index_listing,
    breakdown,
    changes,
    files_of,
    name,
    params,
)
from registry.retention import LISTING_FILE, RetentionParams, earlier_listing


def test_a_night_is_what_it_wrote_less_what_retention_freed(tmp_path: Path) -> None:
    cache = tmp_path / STORE_FOLDERS["dvc_cache"]
    (cache / "ab").mkdir(parents=True)
    (cache / "ab" / "old").write_bytes(b"o" * 300)
    (cache / "ab" / "kept").write_bytes(b"k" * 50)
    (cache / "ab" / "grown").write_bytes(b"g" * 10)
    before = files_of(tmp_path)
    (cache / "ab" / "old").unlink()  # retention freed it
    (cache / "ab" / "grown").write_bytes(b"g" * 40)  # rewritten: written whole
    (cache / "cd").mkdir()
    (cache / "cd" / "new").write_bytes(b"n" * 200)
    after = files_of(tmp_path)
    written, gone = changes(before, after)
    assert {p.name: s for p, s in written["dvc_cache"].items()} == {"grown": 40, "new": 200}
    assert {p.name: s for p, s in gone["dvc_cache"].items()} == {"old": 300}
    net = sum(after["dvc_cache"].values()) - sum(before["dvc_cache"].values())
    assert net == 40 + 200 - 300 - 10  # the rewritten file's old bytes went too


def test_freed_files_are_named_by_the_output_an_earlier_night_held(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    (cache / "3f").mkdir(parents=True)
    (cache / "3f" / "0b2c").write_bytes(b"x" * 7)
    (cache / "3f" / "0b2d.dir").write_bytes(b"[]")
    ml = tmp_path / "ml" / "run" / "artifacts" / "plots"
    ml.mkdir(parents=True)
    (ml / "gallery.png").write_bytes(b"p" * 9)
    kinds = breakdown({"3f0b2c": "models/index"},
                      {"dvc_cache": {cache / "3f" / "0b2c": 7, cache / "3f" / "0b2d.dir": 2},
                       "mlflow_artifacts": {ml / "gallery.png": 9}})
    assert kinds == {"dvc_cache": {"models/index": 7, "directory listings": 2},
                     "mlflow_artifacts": {"plots": 9}}


def test_a_day_passes_for_the_index_store_marks_between_nights(tmp_path: Path) -> None:
    assert not age_index_listing(tmp_path)  # no retain ran yet
    path = tmp_path / LISTING_FILE
    path.parent.mkdir(parents=True)
    now = time.time()
    path.write_text(json.dumps({"run1": {"listed_at": now - 60, "unreferenced": ["c1"]}}))
    assert earlier_listing(json.loads(path.read_text()), "run1", now).chunks is None  # too young
    assert age_index_listing(tmp_path)
    listing = json.loads(path.read_text())
    assert listing["run1"]["unreferenced"] == ["c1"]
    assert earlier_listing(listing, "run1", now).chunks == {"c1"}  # old enough to use


def test_the_workspace_runs_retention_with_the_window_asked_for(tmp_path: Path) -> None:
    overrides = params(tmp_path / "source.parquet", keep_last=2)
    section = {key.split(".", 1)[1]: value for key, value in overrides.items()
               if key.startswith("retention.")}
    assert RetentionParams(**section) == RetentionParams(enabled=True, keep_last=2)
    assert section["prune_remote"] is False  # the remote keeps every version by default


def test_prune_remote_runs_retention_on_the_remote_and_records_apart(tmp_path: Path) -> None:
    overrides = params(tmp_path / "source.parquet", keep_last=1, prune_remote=True)
    assert overrides["retention.prune_remote"] is True
    assert name(True) == "storage_growth_prune_remote" and name(False) == "storage_growth"
    assert renderer(name(True)) is render


def night(number: int, added: int, freed: int, bound: int) -> dict:
    return {"night": number, "images": 200, "new_images": 10, "new_image_bytes": 10 * 1024,
            "model_files_bytes": bound - 20 * 1024, "bound_bytes": bound,
            "shards_kept": 3, "shards_new": 1, "index_added_bytes": 2048, "index_bytes": 4096,
            "repro_s": 9.5, "retain": {"kept": ["v1", "v3"]},
            "totals": {"dvc_cache": 5 * 2**20, "dvc_remote": 9 * 2**20,
                       "mlflow_artifacts": 3 * 2**20},
            **{f"{store}_added": added for store in STORE_FOLDERS},
            **{f"{store}_freed": freed for store in STORE_FOLDERS},
            **{f"{store}_within_bound": added <= bound for store in STORE_FOLDERS},
            "added_by_kind": {"dvc_cache": {"data/shards": 3072}},
            "freed_by_kind": {"mlflow_artifacts": {"plots": 5120}}}


def test_the_table_shows_net_growth_what_was_freed_and_what_stays_over() -> None:
    record = {"results": {"nights": [night(1, 3 * 2**20, 0, 2**20),
                                     night(2, -1024, 2**20, 2**20)]}}
    text = render(record)
    rows = [line for line in text.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert "| +3,072 (over) (0) |" in rows[0]
    assert "| -1 (1,024) |" in rows[1] and "(over)" not in rows[1]
    assert "| 5,120 | 9,216 | 3,072 | v1, v3 | 3 / 1 | 2 / 4 | 9.5 |" in text
    assert "What left each store on night 2 (retention)" in text
    assert "| plots | 0 | 0 | 5 |" in text

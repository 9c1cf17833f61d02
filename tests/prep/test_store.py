"""The download store's bookkeeping, without img2dataset: parts, what they hold, what a run asks
for, the catalog, the fingerprint of the settings that decide a sample's bytes, and pruning.
img2dataset's output is written here by hand in its format (NNNNN.tar, NNNNN.parquet,
NNNNN_stats.json); tests/stages/test_download_incremental.py runs the real thing."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pandas as pd
import pytest

from prep.fetch import (
    DownloadSettings,
    Fetch,
    build_catalog,
    content_settings,
    latest_outcomes,
    summarise,
    to_fetch,
)
from prep.store import (
    Store,
    StoreError,
    other_stores,
    prepare_root,
    prune,
    prune_plan,
    store_id,
)
from prep.urlguard import FetchPolicy


def quiet(_message: str) -> None:
    pass


def rows(keys: list[str]) -> pd.DataFrame:
    """img2dataset input rows for these keys."""
    return pd.DataFrame({"url": [f"http://h/{k}.jpg" for k in keys], "caption": "c",
                         "captions": [["c"]] * len(keys), "split": "train", "image_key": keys,
                         "labels": None})


def finish_shard(store: Store, part, shard: int, outcomes: dict[str, str]) -> None:
    """What img2dataset leaves for a finished shard: its tar, its parquet (one row per URL) and
    its stats. `outcomes`: key -> "success" or an error message."""
    folder = Path(store.path) / "parts" / part.name
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{shard:05d}"
    (folder / f"{name}.tar").write_bytes(b"\0" * 1024)
    pd.DataFrame({"image_key": list(outcomes),
                  "status": ["success" if v == "success" else "failed_to_download"
                             for v in outcomes.values()],
                  "error_message": [None if v == "success" else v for v in outcomes.values()],
                  "original_width": [100 if v == "success" else None for v in outcomes.values()],
                  "original_height": [80 if v == "success" else None for v in outcomes.values()],
                  }).to_parquet(folder / f"{name}.parquet", index=False)
    successes = sum(v == "success" for v in outcomes.values())
    (folder / f"{name}_stats.json").write_text(json.dumps(
        {"count": len(outcomes), "successes": successes,
         "failed_to_download": len(outcomes) - successes, "failed_to_resize": 0,
         "status_dict": {v: 1 for v in outcomes.values()}}))


def new_store(tmp_path: Path) -> Store:
    prepare_root(str(tmp_path / "root"), owned=True, print_fn=quiet)
    return Store(str(tmp_path / "root"), "s-000000000001")


def test_parts_are_numbered_complete_only_with_every_shard_and_keep_their_rows(tmp_path):
    store = new_store(tmp_path)
    first = store.new_part(rows(["a", "b", "c"]), samples_per_shard=2)
    second = store.new_part(rows(["d"]), samples_per_shard=2)
    assert [(p.number, p.rows, p.shards_expected) for p in store.parts()] == [(0, 3, 2), (1, 1, 1)]
    assert list(store.rows(first)["image_key"]) == ["a", "b", "c"]
    finish_shard(store, first, 0, {"a": "success", "b": "HTTP Error 404: Not Found"})
    assert not store.is_complete(first)  # shard 1 has no stats: an interrupted part
    # Only finished shards count: what an unfinished shard left is not read.
    assert list(store.outcomes()["image_key"]) == ["a", "b"]
    finish_shard(store, first, 1, {"c": "success"})
    finish_shard(store, second, 0, {"d": "success"})
    assert store.is_complete(first) and store.is_complete(second)
    outcomes = store.outcomes()
    assert list(outcomes["tar"]) == [f"{store.id}/parts/00000/00000.tar"] * 2 + [
        f"{store.id}/parts/00000/00001.tar", f"{store.id}/parts/00001/00000.tar"]
    assert sorted(store.tar_sizes()) == sorted(set(outcomes["tar"]))

    (Path(store.path) / "parts/00000.rows.parquet").write_bytes(
        (Path(store.path) / "parts/00001.rows.parquet").read_bytes())
    with pytest.raises(StoreError, match="not the ones its record names"):
        store.rows(first)  # a resume reruns exactly the part's rows, or refuses


def test_a_success_wins_over_failures_and_failures_are_retried_unless_asked_not_to():
    outcomes = pd.DataFrame({
        "image_key": ["a", "b", "b", "c", "c", "d"],
        "status": ["success", "failed_to_download", "success", "failed_to_download",
                   "failed_to_resize", "success"],
        "error_message": [None, "timed out", None, "HTTP Error 500", "Image decoding error", None],
        "part": [0, 0, 1, 0, 1, 2], "tar": ["t0", None, "t1", None, None, "t2"],
        "original_width": [1, None, 2, None, None, 3],
        "original_height": [1, None, 2, None, None, 3],
    })
    known = latest_outcomes(outcomes)
    assert known.loc["b", "status"] == "success" and known.loc["b", "part"] == 1
    assert known.loc["c", "error_message"] == "Image decoding error"  # the latest failure
    today = pd.DataFrame({"key": ["a", "b", "c", "e"], "url": "u"})
    wanted, new, retried = to_fetch(today, known, retry_failed=True)
    assert list(wanted["key"]) == ["c", "e"] and (new, retried) == (1, 1)
    wanted, new, retried = to_fetch(today, known, retry_failed=False)
    assert list(wanted["key"]) == ["e"] and (new, retried) == (1, 0)
    # c failed last in part 1: a run that has just resumed part 1 leaves it to the next run
    wanted, new, retried = to_fetch(today, known, retry_failed=True, resumed={1})
    assert list(wanted["key"]) == ["e"] and (new, retried) == (1, 0)
    wanted, new, retried = to_fetch(today, known, retry_failed=True, resumed={0})
    assert list(wanted["key"]) == ["c", "e"] and (new, retried) == (1, 1)
    wanted, new, retried = to_fetch(today, latest_outcomes(outcomes.iloc[:0]), True)
    assert list(wanted["key"]) == ["a", "b", "c", "e"] and (new, retried) == (4, 0)


def test_the_catalog_says_where_each_image_is_and_the_metrics_count_new_reused_dropped():
    known = latest_outcomes(pd.DataFrame({
        "image_key": ["a", "b", "c", "old"], "part": [0, 1, 1, 0],
        "status": ["success", "success", "failed_to_download", "success"],
        "error_message": [None, None, "HTTP Error 404: Not Found", None],
        "tar": ["s/parts/00000/00000.tar", "s/parts/00001/00000.tar", None,
                "s/parts/00000/00000.tar"],
        "original_width": [120, 90, None, 50], "original_height": [100, 60, None, 50]}))
    images = pd.DataFrame({"key": ["a", "b", "c", "old"], "url": ["u/a", "u/b", "u/c", "file:/x"]})
    refused = pd.DataFrame({"key": ["old"], "reason": ["disallowed_scheme"]})  # held, refused now
    frame = build_catalog(images, refused, known, fetched_parts={1})
    assert list(frame["status"]) == ["reused", "fetched", "failed", "refused"]
    assert list(frame["reason"].fillna("-")) == ["-", "-", "HTTP Error 404: Not Found",
                                                 "disallowed_scheme"]
    assert list(frame["tar"].fillna("-")) == ["s/parts/00000/00000.tar",
                                              "s/parts/00001/00000.tar", "-", "-"]
    assert list(frame["original_width"].astype("float").fillna(-1)) == [120, 90, -1, 50]
    stats = [{"count": 2, "successes": 1, "failed_to_download": 1,
              "status_dict": {"success": 1, "HTTP Error 404: Not Found": 1}}]
    metrics = summarise(frame, {"disallowed_scheme": 1}, Fetch(parts=[], new=1, retried=1),
                        stats, held_keys={"a", "b", "old", "gone"})
    assert (metrics["new_images"], metrics["retried_images"], metrics["reused_images"],
            metrics["dropped_images"]) == (1, 1, 1, 1)  # dropped: "gone", no longer listed
    assert metrics["successes"] == 2 and metrics["success_rate"] == 0.5
    assert metrics["failure_reasons"] == {"HTTP Error 404: Not Found": 1}


def test_failure_reasons_are_bounded_in_length_and_number():
    """Servers choose their reason phrases: 300 URLs answering unique 60 KB phrases made
    metrics/download.json (tracked by git) 18 MB, and the summary line as long. Each reason is
    cut to MAX_REASON_CHARS, one line, and past the MAX_REASONS most frequent the rest are
    counted as "other"; no count is lost."""
    from prep.fetch import MAX_REASON_CHARS, MAX_REASONS, summary

    hostile = {f"HTTP Error 500: {i:03d} " + "x" * 60_000 + "\nsecond line": 1 for i in range(300)}
    stats = [{"count": 310, "successes": 0, "failed_to_download": 310,
              "status_dict": {**hostile, "HTTP Error 404: Not Found": 10}}]
    keys = [f"k{i}" for i in range(310)]
    known = latest_outcomes(pd.DataFrame({
        "image_key": keys, "part": 0, "status": "failed_to_download",
        "error_message": [*hostile, *["HTTP Error 404: Not Found"] * 10], "tar": None,
        "original_width": None, "original_height": None}))
    frame = build_catalog(pd.DataFrame({"key": keys, "url": "u"}),
                          pd.DataFrame({"key": [], "reason": []}), known, fetched_parts={0})
    assert frame["reason"].str.len().max() <= MAX_REASON_CHARS
    assert not frame["reason"].str.contains("\n").any()
    metrics = summarise(frame, {}, Fetch(parts=[], new=310, retried=0), stats, held_keys=set())
    reasons = metrics["failure_reasons"]
    assert len(reasons) == MAX_REASONS + 1 and sum(reasons.values()) == 310
    assert reasons["HTTP Error 404: Not Found"] == 10  # the most frequent reason is kept whole
    assert reasons["other"] == 300 - (MAX_REASONS - 1)
    assert max(len(reason) for reason in reasons) <= MAX_REASON_CHARS
    assert len(json.dumps(metrics)) < 10_000 and len(summary(metrics)) < 10_000


def test_only_the_settings_that_change_a_samples_bytes_start_another_store():
    policy = FetchPolicy()
    base = store_id(content_settings(DownloadSettings(), policy))
    for change in ({"image_size": 128}, {"resize_mode": "border"}, {"encode_quality": 80},
                   {"max_image_area": 10}, {"max_aspect_ratio": 3.0}):
        other = store_id(content_settings(dataclasses.replace(DownloadSettings(), **change),
                                          policy))
        assert other != base, change
    assert store_id(content_settings(DownloadSettings(),
                                     dataclasses.replace(policy, max_bytes=1))) != base
    for same in ({"timeout": 99}, {"retries": 5}, {"samples_per_shard": 7},
                 {"retry_failed": False}):
        assert store_id(content_settings(dataclasses.replace(DownloadSettings(), **same),
                                         policy)) == base, same
    content = content_settings(DownloadSettings(), policy)
    assert content["img2dataset"] and content["opencv"]  # the codecs' versions are in it


def test_prune_lists_what_holds_none_of_todays_images_and_removes_only_that(tmp_path):
    store = new_store(tmp_path)
    old = Store(store.root, "s-00000000000f")
    old.write_settings({"image_size": 256})
    used = store.new_part(rows(["a", "b"]), samples_per_shard=2)
    unused = store.new_part(rows(["x"]), samples_per_shard=2)
    failed_only = store.new_part(rows(["a"]), samples_per_shard=2)
    interrupted = store.new_part(rows(["y", "z", "w"]), samples_per_shard=2)
    finish_shard(store, used, 0, {"a": "success", "b": "success"})
    finish_shard(store, unused, 0, {"x": "success"})
    finish_shard(store, failed_only, 0, {"a": "timed out"})
    finish_shard(store, interrupted, 0, {"y": "success", "z": "success"})
    assert other_stores(store.root, store.id) == [old.id]

    plan = prune_plan(store.root, store.id, wanted={"a", "b"})
    assert [(item.path, item.reason) for item in plan] == [
        (old.id, "made with other download settings"),
        (f"{store.id}/parts/00001", "none of its images is in images.parquet"),
        (f"{store.id}/parts/00002", "none of its images is in images.parquet")]
    assert Path(old.path).is_dir()  # a plan removes nothing
    prune(store.root, plan)
    assert not Path(old.path).exists()
    assert [p.number for p in store.parts()] == [0, 3]  # the interrupted part is kept (resumed)
    assert sorted(p.name for p in (Path(store.path) / "parts").iterdir()) == [
        "00000", "00000.json", "00000.rows.parquet", "00003", "00003.json", "00003.rows.parquet"]
    assert prune_plan(store.root, store.id, wanted={"a", "b"}) == []

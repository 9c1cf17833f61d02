"""The download catalog and the shard stage's catalog mode: which samples are read from which
tars, with whose metadata, and that images spread over several parts give the shards one tar of
the same images gives (the incremental download's promise, at the library's level)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pandas as pd
import pytest

from clipms.data import webds
from harness.input_tars import good, write_tar
from prep.catalog import (
    CatalogError,
    file_sha256,
    read_catalog,
    shard_inputs,
    write_catalog,
)
from prep.shards import ChecksCache, ShardSettings, build_shards

SETTINGS = ShardSettings(samples_per_shard=2, workers=1)


def quiet(_message: str) -> None:
    pass


def key(i: int) -> str:
    return f"{i:016x}"  # what tests.prep.test_shards.meta names image i


def images_file(folder: Path, indices: list[int], captions: dict[int, list[str]] | None = None
                ) -> Path:
    """images.parquet for these images (captions: today's caption lists where given)."""
    captions = captions or {}
    path = folder / "images.parquet"
    pd.DataFrame({"url": [f"http://x/{i}.jpg" for i in indices], "key": [key(i) for i in indices],
                  "caption": "c",
                  "captions": [captions.get(i, [f"caption {i}", f"second caption {i}"])
                               for i in indices],
                  "split": ["val" if i % 4 == 0 else "train" for i in indices],
                  "labels": json.dumps({"shape": "circle"})}).to_parquet(path, index=False)
    return path


def catalog_for(folder: Path, images: Path, where: dict[int, str]) -> None:
    frame = pd.DataFrame({"key": [key(i) for i in where], "url": "u", "status": "reused",
                          "reason": None, "part": 0, "tar": list(where.values()),
                          "original_width": 64, "original_height": 64})
    write_catalog(folder, frame, file_sha256(images), "s-test")


def two_parts(folder: Path) -> None:
    """Images 0-3 fetched by one run, 4-5 by the next (same bytes as one run would give)."""
    (folder / "s/parts/00000").mkdir(parents=True)
    (folder / "s/parts/00001").mkdir(parents=True)
    write_tar(folder / "s/parts/00000/00000.tar", [good(i) for i in range(4)])
    write_tar(folder / "s/parts/00001/00000.tar", [good(4), good(5)])


def test_today_s_metadata_wins_and_the_parts_give_the_one_run_shards(tmp_path):
    store = tmp_path / "store"
    two_parts(store)
    images = images_file(tmp_path, [1, 2, 3, 4, 5], captions={2: ["a caption written later"]})
    where = {i: "s/parts/00000/00000.tar" for i in (1, 2, 3)} | {
        i: "s/parts/00001/00000.tar" for i in (4, 5)}
    catalog_for(store, images, where)
    inputs = shard_inputs(images, read_catalog(store))
    assert [(entry.tar, sorted(entry.records)) for entry in inputs] == [
        ("s/parts/00000/00000.tar", [key(1), key(2), key(3)]),
        ("s/parts/00001/00000.tar", [key(4), key(5)])]
    metrics = build_shards(store, tmp_path / "shards", SETTINGS, quiet, inputs=inputs)
    assert metrics["samples_in"] == 5 and metrics["samples_out"] == 5
    assert metrics["samples_not_listed"] == 1  # image 0: no longer in images.parquet
    out = {s.key: s for tar in sorted((tmp_path / "shards").glob("*/*.tar"))
           for s in webds.read_tar(tar)}
    assert sorted(out) == [key(i) for i in (1, 2, 3, 4, 5)]
    assert out[key(2)].meta["captions"] == ["a caption written later"]
    assert out[key(2)].caption == "a caption written later"
    assert out[key(4)].meta["split"] == "val"  # today's split (the tar says train)

    # One run's tar of the same images (what a from-scratch download holds): the same shards.
    once = tmp_path / "once"
    (once / "s/parts/00000").mkdir(parents=True)
    write_tar(once / "s/parts/00000/00000.tar", [good(i) for i in (5, 3, 1, 4, 2)])
    catalog_for(once, images, dict.fromkeys((1, 2, 3, 4, 5), "s/parts/00000/00000.tar"))
    build_shards(once, tmp_path / "shards-once", SETTINGS, quiet,
                 inputs=shard_inputs(images, read_catalog(once)))
    assert (tmp_path / "shards-once/manifest.json").read_bytes() == \
        (tmp_path / "shards/manifest.json").read_bytes()


def test_a_listed_image_its_tar_lacks_is_counted_and_a_url_input_reads_the_parts(tmp_path):
    store = tmp_path / "store"
    two_parts(store)
    images = images_file(tmp_path, [1, 6])
    catalog_for(store, images, {1: "s/parts/00000/00000.tar", 6: "s/parts/00001/00000.tar"})
    inputs = shard_inputs(images, read_catalog(store))
    metrics = build_shards(store, tmp_path / "shards", SETTINGS, quiet, inputs=inputs)
    assert metrics["samples_out"] == 1 and metrics["dropped"]["not_in_tar"] == 1

    # The same from a URL: two tars of the same name in two parts are copied apart.
    recorded = [{"name": entry.tar, "bytes": (store / entry.tar).stat().st_size}
                for entry in inputs]
    from_url = build_shards(f"file://{store}", tmp_path / "shards-url", SETTINGS, quiet,
                            recorded=recorded, inputs=inputs)
    assert from_url == metrics


def test_a_catalog_of_other_images_is_refused(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    images = images_file(tmp_path, [1, 2])
    catalog_for(store, images, {1: "t.tar", 2: "t.tar"})
    images_file(tmp_path, [1, 2, 3])  # dedupe ran again; the download did not
    with pytest.raises(CatalogError, match="rerun the download stage"):
        shard_inputs(images, read_catalog(store))
    with pytest.raises(CatalogError, match="run the download stage first"):
        read_catalog(tmp_path / "nowhere")


def test_a_tar_read_before_is_not_decoded_again_and_unused_checks_are_removed(tmp_path):
    store, checks = tmp_path / "store", tmp_path / "checks"
    two_parts(store)
    images = images_file(tmp_path, [1, 2, 3, 4, 5], captions={2: ["a caption written later"]})
    catalog_for(store, images, {i: "s/parts/00000/00000.tar" for i in (1, 2, 3)} | {
        i: "s/parts/00001/00000.tar" for i in (4, 5)})
    inputs = shard_inputs(images, read_catalog(store))
    cold = build_shards(store, tmp_path / "cold", SETTINGS, quiet, inputs=inputs,
                        checks_dir=checks)
    assert cold["input_shards_checked_before"] == 0 and len(list(checks.iterdir())) == 2
    warm = build_shards(store, tmp_path / "warm", SETTINGS, quiet, inputs=inputs,
                        checks_dir=checks)
    assert warm["input_shards_checked_before"] == 2
    assert {k: v for k, v in warm.items() if k != "input_shards_checked_before"} == \
        {k: v for k, v in cold.items() if k != "input_shards_checked_before"}
    assert (tmp_path / "warm/manifest.json").read_bytes() == \
        (tmp_path / "cold/manifest.json").read_bytes()

    # What the checks say is used, not the tar decoded again: a check saying "too small" drops it.
    cache = ChecksCache(checks)
    digest = cache.digest(store / "s/parts/00001/00000.tar")
    cache.save(digest, [dataclasses.replace(c, width=8) for c in cache.load(digest)])
    shrunk = build_shards(store, tmp_path / "shrunk", SETTINGS, quiet, inputs=inputs,
                          checks_dir=checks)
    assert shrunk["dropped"]["too_small"] == 2 and shrunk["samples_out"] == 3

    # A tar whose bytes changed is decoded again (its checks are under another sha256) ...
    write_tar(store / "s/parts/00001/00000.tar", [good(4), good(5), good(6)])
    rewritten = build_shards(store, tmp_path / "rewritten", SETTINGS, quiet, inputs=inputs,
                             checks_dir=checks)
    assert rewritten["input_shards_checked_before"] == 1 and rewritten["samples_out"] == 5
    # ... and a tar no longer read leaves no checks behind.
    only_first = [entry for entry in inputs if entry.tar.startswith("s/parts/00000")]
    build_shards(store, tmp_path / "first", SETTINGS, quiet, inputs=only_first,
                 checks_dir=checks)
    assert [p.stem for p in checks.iterdir()] == [cache.digest(store / "s/parts/00000/00000.tar")]


def test_a_night_reads_each_input_tar_once_to_hash_it(tmp_path, monkeypatch):
    """Telling cached tars from new ones and scanning them hash each tar once, not twice: on a
    night that rewrites every shard, hashing all the store's tars is part of the fixed cost."""
    store, checks = tmp_path / "store", tmp_path / "checks"
    two_parts(store)
    images = images_file(tmp_path, [1, 2, 3, 4, 5])
    catalog_for(store, images, {i: "s/parts/00000/00000.tar" for i in (1, 2, 3)} | {
        i: "s/parts/00001/00000.tar" for i in (4, 5)})
    inputs = shard_inputs(images, read_catalog(store))
    build_shards(store, tmp_path / "first", SETTINGS, quiet, inputs=inputs, checks_dir=checks)
    hashed: list[str] = []
    digest = ChecksCache.digest

    def counting(path):
        hashed.append(Path(path).relative_to(store).as_posix())
        return digest(path)

    monkeypatch.setattr(ChecksCache, "digest", staticmethod(counting))
    warm = build_shards(store, tmp_path / "warm", SETTINGS, quiet, inputs=inputs,
                        checks_dir=checks)
    assert warm["input_shards_checked_before"] == 2
    assert sorted(hashed) == ["s/parts/00000/00000.tar", "s/parts/00001/00000.tar"]

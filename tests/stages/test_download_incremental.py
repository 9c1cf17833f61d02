"""Nights on a growing source (harness/nightly_world.py: a loopback image site and a local metadata
parquet that changes night to night), through the real stages - metadata, dedupe, download
(img2dataset), shard - as DVC runs them: a night fetches only the images no earlier night holds
(counted at the server), removed images leave the shards, a caption changed for an old image is
the new one, and the shards are byte for byte those a from-scratch run on the same final source
writes; an interrupted night resumes its part; other download settings start another store, which
`prune` removes when asked. The distributors and remote stores: tests/prep/test_engines.py,
tests/prep/test_remote.py, tests/prep/test_remote_s3.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clipms.data import webds
from harness.image_site import kill_download_in_shard_1, part_folder, run_stage, stage_env
from harness.nightly_world import GrowingSource, captions_for, night, write_params

SHARDING = ("metadata", "dedupe", "download", "shard")


def requested(site) -> list[str]:
    return sorted(set(site.requests))


def metrics(folder: Path, name: str) -> dict:
    return json.loads((folder / f"metrics/{name}.json").read_text())


def shard_samples(folder: Path) -> dict[str, dict]:
    return {s.key: s.meta for tar in sorted((folder / "data/shards").glob("*/*.tar"))
            for s in webds.read_tar(tar)}


def recaptioned(index: int) -> list[str]:
    return ["picture ten, captioned again"] if index == 10 else captions_for(index)


@pytest.mark.slow
def test_a_night_fetches_only_what_is_new_and_shards_what_a_from_scratch_run_does(tmp_path):
    source = GrowingSource(tmp_path / "source", capacity=50)
    nightly, scratch = tmp_path / "nightly", tmp_path / "scratch"
    missing = {"URL": None, "TEXT": "a picture the site does not have"}
    two_workers = {"download": {"processes": 2}}
    with source.site() as site:
        missing["URL"] = f"{site.base}/missing.jpg"
        write_params(nightly, source.path, **two_workers)
        source.write(site, range(40), extra=[missing])
        night(nightly, SHARDING)
        first_requests = requested(site)

        site.requests.clear()  # night 2: images 0-3 removed, 40-49 new, image 10 recaptioned
        source.write(site, range(4, 50), captions=recaptioned, extra=[missing])
        out = night(nightly, SHARDING)
        second_requests = requested(site)
        download = metrics(nightly, "download")

        write_params(scratch, source.path, **two_workers)  # the same final source, from scratch
        night(scratch, SHARDING)

        site.requests.clear()  # night 3: nothing new, and the 404 is not tried again
        write_params(nightly, source.path, download={"retry_failed": False, "processes": 2})
        third = run_stage("download", nightly)
        third_requests = requested(site)

    assert len(first_requests) == 41
    assert second_requests == sorted([f"/img/{i}.jpg" for i in range(40, 50)] + ["/missing.jpg"])
    assert "fetching 11 image(s) into part 00001 (10 new, 1 failed before)" in \
        out["download"].stdout
    # cut in two img2dataset shards of 6, one per worker (8 a shard would leave one idle)
    part = part_folder(nightly / "data/download", 1)
    assert sorted(p.name for p in part.glob("*_stats.json")) == ["00000_stats.json",
                                                                  "00001_stats.json"]
    assert (download["new_images"], download["retried_images"], download["reused_images"],
            download["dropped_images"], download["successes"]) == (10, 1, 36, 4, 46)

    # The same samples, the same bytes: every shard's sha256 in the manifest.
    assert (nightly / "data/shards/manifest.json").read_bytes() == \
        (scratch / "data/shards/manifest.json").read_bytes()
    assert metrics(nightly, "shard")["samples_not_listed"] == 4  # images 0-3, still in the store
    samples = shard_samples(nightly)
    assert len(samples) == 46
    ten = next(meta for meta in samples.values() if meta["url"].endswith("/img/10.jpg"))
    assert ten["captions"] == ["picture ten, captioned again"]

    assert third_requests == [] and "fetching" not in third.stdout
    assert metrics(nightly, "download")["failed_earlier"] == 1


@pytest.mark.slow
def test_an_interrupted_night_resumes_its_part_and_ends_as_a_from_scratch_run(tmp_path):
    source = GrowingSource(tmp_path / "source", capacity=12)
    nightly, scratch = tmp_path / "nightly", tmp_path / "scratch"
    params = {"download": {"samples_per_shard": 4, "timeout": 10}}
    with source.site() as site:
        stalled = [{"URL": f"{site.base}/stall/{i}.jpg", "TEXT": f"a stalled picture {i}"}
                   for i in range(4)]
        write_params(nightly, source.path, **params)
        source.write(site, range(8))
        night(nightly, SHARDING)
        # Night 2: images 8-11 (img2dataset's shard 0 of the new part), then four that stall
        # (its shard 1) until the stage is killed.
        source.write(site, range(12), extra=stalled)
        night(nightly, ("metadata", "dedupe"))
        root = nightly / "data/download"
        kill_download_in_shard_1(nightly, site, stage_env(),
                                 lambda: (part_folder(root, 1) / "00000_stats.json").is_file())
        site.stall.set()  # from now on the stalled URLs answer at once
        finished = (part_folder(root, 1) / "00000.tar").stat().st_mtime_ns
        site.requests.clear()
        resumed = run_stage("download", nightly)
        resumed_requests = requested(site)
        run_stage("shard", nightly)

        write_params(scratch, source.path, **params)
        night(scratch, SHARDING)

    assert "resuming part 00001 (1 of 2 img2dataset shard(s) finished are kept)" in resumed.stdout
    assert resumed_requests == [f"/stall/{i}.jpg" for i in range(4)]
    assert (part_folder(root, 1) / "00000.tar").stat().st_mtime_ns == finished
    assert sorted(p.name for p in part_folder(root, 0).parent.glob("*.json")) == [
        "00000.json", "00001.json"]  # the part was resumed, not started again
    assert (nightly / "data/shards/manifest.json").read_bytes() == \
        (scratch / "data/shards/manifest.json").read_bytes()


@pytest.mark.slow
def test_other_download_settings_start_another_store_that_prune_removes_when_asked(tmp_path):
    source = GrowingSource(tmp_path / "source", capacity=8)
    folder = tmp_path / "nightly"
    with source.site() as site:
        write_params(folder, source.path)
        source.write(site, range(8))
        night(folder, SHARDING)
        first_store = sorted((folder / "data/download").glob("s-*"))
        site.requests.clear()
        write_params(folder, source.path, download={"image_size": 48})
        changed = run_stage("download", folder)
        refetched = requested(site)
        run_stage("shard", folder)
        manifest = (folder / "data/shards/manifest.json").read_bytes()

        listed = run_stage("download", folder, extra_args=["prune"])
        assert len(list((folder / "data/download").glob("s-*"))) == 2  # a listing removes nothing
        applied = run_stage("download", folder, extra_args=["prune", "--apply"])
        site.requests.clear()
        run_stage("download", folder)
        after_prune = requested(site)
        run_stage("shard", folder)

    assert refetched == [f"/img/{i}.jpg" for i in range(8)]
    assert "1 store(s) of other download settings kept beside" in changed.stdout
    old = first_store[0].name
    assert f"download prune: would remove {old} (made with other download settings)" in \
        listed.stdout and "rerun with --apply" in listed.stdout
    assert f"download prune: removed {old}" in applied.stdout and "dvc gc" in applied.stdout
    assert [p.name for p in (folder / "data/download").glob("s-*")] != [old]
    assert not (folder / "data/download" / old).exists()
    assert after_prune == []  # what today's images need was kept
    assert (folder / "data/shards/manifest.json").read_bytes() == manifest

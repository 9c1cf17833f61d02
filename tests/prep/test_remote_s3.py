"""`download.output: s3://bucket/prefix` against a real S3 API: moto's server, started by the test
on 127.0.0.1 (the `dev` extra), reached by img2dataset and the shard stage through s3fs (the
`distributed` extra) with the standard AWS variables (AWS_ENDPOINT_URL, keys). The same shards as
the default local run, a stage killed mid-download resumes on the bucket, the next night fetches
only what is new into the bucket's store, and Spark's executors write there too, a lost shard then
refetched by a local Ray."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from clipms.data import webds
from harness.distributor_runs import (
    SECOND_NIGHT_REQUESTS,
    SHARD_1_REQUESTS,
    samples_of,
    second_night,
    site_urls,
)
from harness.image_site import (
    Site,
    images_parquet,
    kill_download_in_shard_1,
    run_stage,
    stage_env,
    write_params,
)
from prep.remote import POINTER_FILE
from prep.store import MARKER, StoreError, prepare_root

pytest.importorskip("s3fs", reason="the `distributed` extra is not installed")
moto_server = pytest.importorskip("moto.server", reason="the `dev` extra is not installed")

BUCKET = "clip-data"


@pytest.fixture(scope="module")
def s3() -> Iterator[tuple[dict[str, str], object]]:
    """A moto S3 server on a free loopback port with one bucket: the stages' environment for it
    and an s3fs filesystem on it (listings never cached: the stages change the bucket)."""
    import s3fs

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "test-key",
           "AWS_SECRET_ACCESS_KEY": "test-secret", "AWS_DEFAULT_REGION": "us-east-1"}
    try:
        fs = s3fs.S3FileSystem(key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"],
                               endpoint_url=env["AWS_ENDPOINT_URL"], use_listings_cache=False,
                               skip_instance_cache=True)
        fs.mkdir(BUCKET)
        yield {**stage_env(), **env}, fs
    finally:
        server.stop()


def tars_in(fs, prefix: str, folder: Path) -> set[tuple[str, str, str]]:
    """samples_of() for the tars of the store under `prefix` of the bucket (copied into
    `folder`)."""
    folder.mkdir()
    for path in fs.glob(f"{prefix}/s-*/parts/*/*.tar"):
        local = folder / path.removeprefix(f"{prefix}/")
        local.parent.mkdir(parents=True, exist_ok=True)
        fs.get(path, str(local))
    return samples_of(folder)


def part_of(fs, prefix: str, part: int = 0) -> str:
    """The bucket path of a part of the one store under `prefix`."""
    stores = fs.glob(f"{prefix}/s-*")
    assert len(stores) == 1, stores
    return f"{stores[0]}/parts/{part:05d}"


@pytest.mark.slow
def test_download_to_s3_then_shard_gives_the_default_runs_shards(tmp_path, s3):
    env, fs = s3
    prefix = f"{BUCKET}/runs/same-samples"
    with Site() as site:
        for name, extra in (("local", {}), ("s3", {"output": f"s3://{prefix}"})):
            folder = tmp_path / name
            folder.mkdir()
            images_parquet(folder, site_urls(site))
            write_params(folder, samples_per_shard=3, **extra)
            run_stage("download", folder, env=env)
            run_stage("shard", folder, env=env)
    reference = samples_of(tmp_path / "local/data/download")
    assert len(reference) == 6 and tars_in(fs, prefix, tmp_path / "copy") == reference
    pointer = json.loads((tmp_path / "s3/data/download" / POINTER_FILE).read_text())
    assert pointer["url"] == f"s3://{prefix}" and pointer["samples"] == 6
    assert [s["name"] for s in pointer["shards"]] == [
        f"{pointer['store']}/parts/00000/0000{i}.tar" for i in (0, 1)]
    for name in ("data/shards/manifest.json", "metrics/shard.json"):  # byte-identical shards
        assert (tmp_path / "s3" / name).read_text() == (tmp_path / "local" / name).read_text()


@pytest.mark.slow
def test_a_download_killed_mid_shard_resumes_on_the_bucket(tmp_path, s3):
    """SIGKILL the stage (and img2dataset's workers) while shard 1 is fetching: the rerun keeps
    shard 0's objects in the bucket and fetches only shards 1 and 2."""
    env, fs = s3
    prefix = f"{BUCKET}/runs/killed"
    write_params(tmp_path, samples_per_shard=2, timeout=10, output=f"s3://{prefix}")
    with Site() as site:
        urls = [f"{site.base}/good/{i}.jpg" for i in range(6)]
        urls[2:4] = [f"{site.base}/stall/{i}.jpg" for i in (2, 3)]  # shard 1 stalls
        images_parquet(tmp_path, urls)
        first_stats = f"{prefix}/s-*/parts/00000/00000_stats.json"
        kill_download_in_shard_1(tmp_path, site, env, lambda: bool(fs.glob(first_stats)))
        site.stall.set()  # from now on the stalled URLs answer at once
        part = part_of(fs, prefix)
        assert not fs.exists(f"{part}/00001_stats.json")
        assert not (tmp_path / "data/download" / POINTER_FILE).exists()  # no shards claimed
        finished = object_version(fs, f"{part}/00000.tar")
        site.requests.clear()
        proc = run_stage("download", tmp_path, env=env)
        assert "resuming part 00000 (1 of 3 img2dataset shard(s) finished are kept)" in \
            proc.stdout
        assert sorted(site.requests) == ["/good/4.jpg", "/good/5.jpg", "/stall/2.jpg",
                                         "/stall/3.jpg"]
        metrics = json.loads((tmp_path / "metrics/download.json").read_text())
        assert metrics["successes"] == 6 and metrics["shards_done"] == 3
        # The next night on the bucket: only its new image is fetched, into a new part.
        new_night = second_night(tmp_path, site, env=env)
    assert object_version(fs, f"{part}/00000.tar") == finished  # shard 0 was not rewritten
    assert new_night == ["/good/6.jpg"]
    assert fs.glob(f"{part_of(fs, prefix, 1)}/*.tar")
    run_stage("shard", tmp_path, env=env)
    manifest = webds.read_manifest(tmp_path / "data/shards")
    assert manifest["splits"]["train"]["samples"] == 6



def object_version(fs, path: str) -> tuple[str, object]:
    info = fs.info(path)
    return info["ETag"], info["LastModified"]


@pytest.mark.slow
def test_spark_writes_to_the_bucket_and_a_local_ray_resumes_there(tmp_path, s3):
    """pyspark `local[2]`: its Python workers write the shards to the bucket themselves; shard 1's
    objects removed (an interruption), the rerun on a local Ray fetches only shard 1 there (the
    engine is not part of the resume fingerprint)."""
    pytest.importorskip("pyspark", reason="the `distributed` extra is not installed")
    pytest.importorskip("ray", reason="the `distributed` extra is not installed")
    env, fs = s3
    prefix = f"{BUCKET}/runs/engines"
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's socket paths
    local_ray = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}
    local_ray["RAY_TMPDIR"] = str(temp)
    engine = {"samples_per_shard": 3, "processes": 2, "output": f"s3://{prefix}"}
    try:
        with Site() as site:
            images_parquet(tmp_path, site_urls(site))
            write_params(tmp_path, distributor="pyspark", spark_master="local[2]", **engine)
            run_stage("download", tmp_path, env=env)
            first = tars_in(fs, prefix, tmp_path / "spark")
            part = part_of(fs, prefix)
            kept = object_version(fs, f"{part}/00000.tar")
            for path in fs.glob(f"{part}/00001*"):
                fs.rm(path)
            write_params(tmp_path, distributor="ray", **engine)
            site.requests.clear()
            proc = run_stage("download", tmp_path, env=local_ray)
            requests = sorted(site.requests)
            resumed = tars_in(fs, prefix, tmp_path / "ray")
            write_params(tmp_path, distributor="pyspark", spark_master="local[2]", **engine)
            new_night = second_night(tmp_path, site, env=env)  # Spark's executors again
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert "resuming part 00000 (2 of 3 img2dataset shard(s) finished are kept)" in proc.stdout
    assert requests == SHARD_1_REQUESTS
    assert new_night == SECOND_NIGHT_REQUESTS
    assert object_version(fs, f"{part}/00000.tar") == kept
    assert len(first) == 6 and resumed == first
    assert len(tars_in(fs, prefix, tmp_path / "night-2")) == 7
    run_stage("shard", tmp_path, env=env)
    assert webds.read_manifest(tmp_path / "data/shards")["splits"]["train"]["samples"] == 6


def test_a_bucket_is_made_a_store_only_when_empty_or_ours(s3, monkeypatch):
    """prepare_root on S3 itself, with a bucket root as the target: the earlier layout's objects
    (ours) are removed, saying so, img2dataset's `_tmp` scratch too; a prefix holding an object
    the stage did not write is refused and the object kept."""
    env, fs = s3
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                 "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(name, env[name])
    fs.mkdir("whole-bucket")
    fs.pipe("whole-bucket/clipms_input.sha256", b"one\n")
    fs.pipe("whole-bucket/00000.tar", b"a shard")
    fs.pipe("whole-bucket/_tmp/00001.feather", b"img2dataset's scratch")
    said: list[str] = []
    prepare_root("s3://whole-bucket", owned=False, print_fn=said.append)
    assert fs.ls("whole-bucket", detail=False) == [f"whole-bucket/{MARKER}"]
    assert "earlier one-folder layout" in said[0]
    prepare_root("s3://whole-bucket", owned=False, print_fn=said.append)  # ours now: kept
    assert len(said) == 1

    fs.pipe(f"{BUCKET}/theirs/report.csv", b"not ours")
    with pytest.raises(StoreError, match="did not write"):
        prepare_root(f"s3://{BUCKET}/theirs", owned=False, print_fn=print)
    assert fs.cat(f"{BUCKET}/theirs/report.csv") == b"not ours"

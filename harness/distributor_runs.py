"""The download stage on one distributor, as tests/prep/test_engines.py runs it on every one: the
same loopback URLs, the sample set it wrote, a resume after a lost shard, a second night that
fetches only its new image, a Ray head to run on."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pandas as pd

from clipms.data import webds
from harness import processes
from harness.image_site import Site, images_parquet, part_folder, run_stage, write_params
from harness.processes import free_port
from prep.fetch import read_parquet

# Shard 1 (samples_per_shard 3) holds these; the other URLs are answered by shards 0 and 2.
SHARD_1_REQUESTS = ["/good/3.jpg", "/good/4.jpg", "/good/5.jpg"]
# The second night: its new image, and the two that failed the first night (retried by default).
SECOND_NIGHT_REQUESTS = ["/good/6.jpg", "/missing.jpg", "/text.jpg"]


def site_urls(site: Site) -> list[str]:
    """Six good images, a 404 and a text body that is not an image."""
    return [f"{site.base}/good/{i}.jpg" for i in range(6)] + [f"{site.base}/missing.jpg",
                                                               f"{site.base}/text.jpg"]


def samples_of(download: Path) -> set[tuple[str, str, str]]:
    """(our key, caption, sha256 of the image) of every downloaded sample below `download` (a
    store root, or one part's folder)."""
    return {(s.meta["image_key"], s.caption, hashlib.sha256(s.image).hexdigest())
            for tar in sorted(download.rglob("*.tar")) for s in webds.read_tar(tar)}


def download_with(folder: Path, site: Site, env: dict[str, str] | None = None,
                  **engine: object) -> tuple[set, float]:
    """Run the stage in a new `folder` on the engine settings; its samples and seconds."""
    folder.mkdir()
    images_parquet(folder, site_urls(site))
    write_params(folder, samples_per_shard=3, processes=2, **engine)
    started = time.perf_counter()
    run_stage("download", folder, env=env)
    return samples_of(folder / "data/download"), time.perf_counter() - started


def resume_after_losing_shard_1(folder: Path, site: Site, env: dict[str, str] | None = None,
                                out: Path | None = None,
                                **engine: object) -> tuple[list[str], float]:
    """Remove shard 1's outputs (an interruption while it was fetching) from the first part of the
    store at `out` (default: the stage's data/download) and rerun, on new engine settings when
    given (they are not part of the store's fingerprint); the requests, seconds."""
    out = part_folder(out or folder / "data/download")
    kept = (out / "00000.tar").stat().st_mtime_ns
    for path in out.glob("00001*"):
        path.unlink()
    if engine:
        write_params(folder, samples_per_shard=3, processes=2, **engine)
    site.requests.clear()
    started = time.perf_counter()
    proc = run_stage("download", folder, env=env)
    seconds = time.perf_counter() - started
    assert "resuming part 00000 (2 of 3 img2dataset shard(s) finished are kept)" in proc.stdout
    assert (out / "00000.tar").stat().st_mtime_ns == kept  # finished shards untouched
    return sorted(site.requests), seconds


def second_night(folder: Path, site: Site, env: dict[str, str] | None = None) -> list[str]:
    """The next night's images.parquet - the first image gone, `/good/6.jpg` new - downloaded on
    the engine of the folder's params; the URLs requested."""
    images = read_parquet(folder / "data/images.parquet")
    new = images.iloc[[0]].assign(url=f"{site.base}/good/6.jpg", key=f"{len(images):016x}")
    pd.concat([images.iloc[1:], new]).to_parquet(folder / "data/images.parquet", index=False)
    site.requests.clear()
    run_stage("download", folder, env=env)
    return sorted(site.requests)


# Ray's single-machine mode: `ray start` and ray.init(address=...) otherwise replace 127.0.0.1
# with the machine's address, and the servers then bind every interface (docs/data-pipeline.md,
# "Who can reach the engines"); with it the node IP stays 127.0.0.1 and they bind that alone.
LOOPBACK_RAY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@contextmanager
def ray_head(temp: Path, env: dict[str, str], timeout: float = 180) -> Iterator[str]:
    """`ray start --head --block` in its own process group (stopped by signalling that group,
    never by `ray stop`, which would stop every Ray of the machine); its address. Run it, and the
    drivers that join it, with LOOPBACK_RAY in `env`. `temp` must be short: Ray's socket paths
    must stay under the 107-character limit."""
    port = free_port()
    ray = Path(sys.executable).with_name("ray")
    head = processes.spawn(
        [str(ray), "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
         "--node-ip-address=127.0.0.1", "--include-dashboard=false", "--disable-usage-stats",
         f"--temp-dir={temp}"], None, env=env)
    try:  # ready when the GCS port answers
        processes.wait_until(processes.port_open(port), head, "ray start", None, timeout)
        yield f"127.0.0.1:{port}"
    finally:
        _stop_group(head)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group, SIGKILL to what is left of it after 60 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:  # the whole group has exited already
        proc.wait(timeout=30)
        return
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        proc.poll()
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)

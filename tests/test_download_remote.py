"""`download.output`: img2dataset writes to an fsspec URL (here a `file://` folder outside the
workspace), data/download keeps only the pointer, and `shard` reads the tars from the URL; the
same samples and the same shards as the default local run, resume there, and the checks of the
URL and of the tars found there."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from clipms.prep.download import FINGERPRINT_FILE, DownloadError, prepare_output
from clipms.prep.remote import POINTER_FILE, check_output_url
from pipeline.params import ParamsError, validate_section
from stages.download import DownloadParams
from tests.distributor_runs import (
    SHARD_1_REQUESTS,
    resume_after_losing_shard_1,
    samples_of,
    site_urls,
)
from tests.image_site import Site, images_parquet, run_stage, write_params
from tests.workspace import make_workspace, run


def quiet(_message: str) -> None:
    pass


def stage_run(folder: Path, site: Site, **download: object) -> None:
    """download then shard in a new `folder` (three shards of the site's URLs)."""
    folder.mkdir()
    images_parquet(folder, site_urls(site))
    write_params(folder, samples_per_shard=3, **download)
    run_stage("download", folder)
    run_stage("shard", folder)


def shard_outputs(folder: Path) -> tuple[dict, dict]:
    """The shard stage's manifest (every shard's sha256) and metrics."""
    return (json.loads((folder / "data/shards/manifest.json").read_text()),
            json.loads((folder / "metrics/shard.json").read_text()))


@pytest.mark.slow
def test_download_to_a_file_url_shards_the_same_samples_and_resumes_there(tmp_path):
    store = tmp_path / "shared store"  # outside both workspaces
    url = f"file://{store}/clip/run-1"  # as fsspec reads it: no %20
    target = store / "clip/run-1"
    with Site() as site:
        stage_run(tmp_path / "local", site)
        stage_run(tmp_path / "remote", site, output=url)
        remote = tmp_path / "remote"
        # data/download holds the pointer alone; the tars are at the URL
        assert [p.name for p in (remote / "data/download").iterdir()] == [POINTER_FILE]
        pointer = json.loads((remote / "data/download" / POINTER_FILE).read_text())
        assert pointer["url"] == url and pointer["samples"] == 6
        assert [(s["name"], s["bytes"], s["successes"]) for s in pointer["shards"]] == [
            (f"0000{i}.tar", (target / f"0000{i}.tar").stat().st_size, n)
            for i, n in enumerate((3, 3, 0))]
        assert pointer["fingerprint"] == (target / FINGERPRINT_FILE).read_text().strip()
        reference = samples_of(tmp_path / "local/data/download")
        assert len(reference) == 6 and samples_of(target) == reference
        assert shard_outputs(remote) == shard_outputs(tmp_path / "local")  # byte-identical shards
        download = json.loads((remote / "metrics/download.json").read_text())
        assert download["successes"] == 6 and download["shards_done"] == 3

        # An interruption while shard 1 was fetching, on the fsspec target: only it is fetched.
        requests, _seconds = resume_after_losing_shard_1(remote, site, out=target)
    assert requests == SHARD_1_REQUESTS
    assert samples_of(target) == reference
    run_stage("shard", remote)
    assert shard_outputs(remote) == shard_outputs(tmp_path / "local")

    # The tars at the URL are checked against the pointer: a lost one stops the shard stage.
    (target / "00002.tar").unlink()
    proc = run_stage("shard", remote, check=False)
    assert proc.returncode == 1
    assert "missing: 00002.tar" in proc.stderr and "rerun the download stage" in proc.stderr
    # ... and so does a download.output that is not where the pointer says the tars are.
    write_params(remote, samples_per_shard=3, output=f"file://{store}/elsewhere")
    proc = run_stage("shard", remote, check=False)
    assert proc.returncode == 1 and f"points at {url}" in proc.stderr


def test_output_url_errors_name_what_is_allowed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    inside = f"file://{tmp_path}/data/download"
    cases = {
        "/mnt/shared": "not a URL",
        "bucket/prefix": "not a URL",
        "nosuch://bucket/prefix": "not a protocol fsspec knows",
        "memory://shards": "cannot hold shards",
        "https://host/shards": "cannot hold shards",
        "simplecache::s3://bucket/p": "chained fsspec URLs",
        "s3://bucket/prefix?X-Amz-Signature=topsecret": "a query or fragment",
        "file://relative/folder": "must be absolute",
        "s3://": "no bucket or folder",
        inside: "overlaps",
        f"file://{tmp_path.parent}": "overlaps",  # clearing it would clear the project
    }
    for value, message in cases.items():
        with pytest.raises(ParamsError) as err:
            validate_section("download", DownloadParams, {"output": value})
        assert "download.output" in str(err.value) and message in str(err.value), value
        assert "e.g. s3://bucket/prefix" in str(err.value)
        assert "topsecret" not in str(err.value)
    outside = f"file://{tmp_path.parent}/elsewhere"
    assert validate_section("download", DownloadParams, {"output": outside}).output == outside
    assert validate_section("download", DownloadParams, {}).output is None


def test_a_scheme_whose_package_is_missing_says_which():
    """A store whose fsspec implementation is not installed here (gcsfs, adlfs, ...): fsspec's
    own import message, before any work starts."""
    import fsspec

    for scheme in ("gs", "abfs", "oss", "oci", "webdav"):
        try:
            fsspec.get_filesystem_class(scheme)
        except ImportError as err:
            with pytest.raises(ValueError, match="needs a package that is not installed") as info:
                check_output_url(f"{scheme}://bucket/prefix")
            assert str(err) in str(info.value)
            return
    pytest.skip("every candidate store's package is installed")


def test_the_stage_prints_no_credentials_of_the_output_url(tmp_path):
    images_parquet(tmp_path, ["http://127.0.0.1:9/never.jpg"])
    for url in ("ftp://user:hunter2@127.0.0.1:9/shards?token=abc",  # refused by the params check
                "ftp://user:hunter2@127.0.0.1:9/shards"):  # nothing listens there
        write_params(tmp_path, output=url)
        proc = run_stage("download", tmp_path, check=False)
        assert proc.returncode == 1 and "download: error:" in proc.stderr, proc.stderr
        assert "hunter2" not in proc.stderr + proc.stdout and "abc" not in proc.stderr


def test_a_url_folder_is_cleared_only_when_this_stage_wrote_it(tmp_path):
    """At a URL the user named: resume on the same fingerprint, clear our own folder (its
    contents: it may be a bucket) on another, and never delete files we did not write."""
    folder = tmp_path / "store"
    url = f"file://{folder}"
    prepare_output(url, quiet, expected="one", owned=False)  # absent: made, marked
    (folder / "00000.tar").write_bytes(b"a finished shard")
    (folder / "00000_stats.json").write_text("{}")
    said: list[str] = []
    prepare_output(url, said.append, expected="one", owned=False)
    assert (folder / "00000.tar").is_file() and "1 finished shard(s) are kept" in said[0]
    prepare_output(url, said.append, expected="two", owned=False)  # the input changed
    assert sorted(p.name for p in folder.iterdir()) == [FINGERPRINT_FILE]
    assert (folder / FINGERPRINT_FILE).read_text() == "two\n" and "clearing it" in said[-1]

    foreign = tmp_path / "someone else's"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(DownloadError, match="did not write"):
        prepare_output(f"file://{foreign}", quiet, expected="one", owned=False)
    assert (foreign / "notes.txt").read_text() == "keep me"
    prepare_output(str(foreign), quiet, expected="one")  # the project's own out: cleared
    assert sorted(p.name for p in foreign.iterdir()) == [FINGERPRINT_FILE]


def test_a_remote_download_leaves_only_its_pointer_in_data_download(tmp_path):
    """What data/download held (a local run's tars, an old pointer) goes before img2dataset
    runs; the pointer of the shards that finished replaces it, even when too few images arrived
    (the stage fails then, as it does for a local run)."""
    old = tmp_path / "data/download"
    old.mkdir(parents=True)
    (old / POINTER_FILE).write_text(json.dumps({"url": "file:///x", "shards": []}))
    (old / "00000.tar").write_bytes(b"left from a local run")
    images_parquet(tmp_path, ["http://127.0.0.1:9/never.jpg"])
    store = tmp_path.parent / f"{tmp_path.name}-store"
    write_params(tmp_path, output=f"file://{store}", samples_per_shard=1, min_success_rate=0.5)
    started = time.perf_counter()
    proc = run_stage("download", tmp_path, check=False)
    assert proc.returncode == 1 and "only 0 of 1 images arrived" in proc.stderr
    assert time.perf_counter() - started < 120
    # The shards all finished (with a failure): the pointer records them; the local tar is gone.
    assert [p.name for p in old.iterdir()] == [POINTER_FILE]
    pointer = json.loads((old / POINTER_FILE).read_text())
    assert pointer["samples"] == 0 and pointer["url"] == f"file://{store}"


@pytest.mark.slow
def test_dvc_versions_a_download_to_a_url_by_its_pointer(tmp_path):
    """Real `dvc repro` (tiny synthetic config): data/download is the pointer, DVC caches it and
    calls the pipeline up to date; `dvc repro -f download` resumes on the target."""
    store = tmp_path / "store"
    ws = make_workspace(tmp_path / "ws", {"download.output": f"file://{store}/tiny"})
    run(["dvc", "repro", "shard"], ws)
    pointer = json.loads((ws / "data/download" / POINTER_FILE).read_text())
    assert pointer["samples"] == 48 and [p.name for p in (ws / "data/download").iterdir()] == [
        POINTER_FILE]
    assert json.loads((ws / "metrics/shard.json").read_text())["samples_out"] == 48
    lock = yaml.safe_load((ws / "dvc.lock").read_text())["stages"]
    assert lock["shard"]["params"]["params.yaml"]["download.output"] == f"file://{store}/tiny"
    again = run(["dvc", "repro", "shard"], ws)
    assert "Running stage" not in again.stdout
    assert "up to date" in run(["dvc", "status", "shard"], ws).stdout

    kept = (store / "tiny/00000.tar").stat().st_mtime_ns
    for path in (store / "tiny").glob("00001*"):
        path.unlink()
    resumed = run(["dvc", "repro", "-f", "download"], ws)
    assert "resuming" in resumed.stdout and "1 finished shard(s) are kept" in resumed.stdout
    assert (store / "tiny/00000.tar").stat().st_mtime_ns == kept
    assert (store / "tiny/00001.tar").is_file()

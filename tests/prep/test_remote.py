"""`download.output`: img2dataset writes the download store at an fsspec URL (here a `file://`
folder outside the workspace), data/download keeps only the catalog and the pointer, and `shard`
reads the tars from the URL; the same samples and the same shards as the default local run,
resume there, a second night that fetches only what is new there, and the checks of the URL and
of the tars found there."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from harness.distributor_runs import (
    SECOND_NIGHT_REQUESTS,
    SHARD_1_REQUESTS,
    resume_after_losing_shard_1,
    samples_of,
    second_night,
    site_urls,
)
from harness.dvc_workspace import make_workspace, run
from harness.image_site import Site, images_parquet, part_folder, run_stage, write_params
from pipeline.params import ParamsError, validate_section
from prep.catalog import CATALOG_FILE
from prep.remote import POINTER_FILE, check_output_url
from prep.store import MARKER, StoreError, prepare_root
from stages.download import DownloadParams


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
    """The shard stage's manifest (every shard's sha256) and metrics, but for how many input tars
    had their checks cached by an earlier shard run (that depends on the workspace's history)."""
    metrics = json.loads((folder / "metrics/shard.json").read_text())
    metrics.pop("input_shards_checked_before")
    return json.loads((folder / "data/shards/manifest.json").read_text()), metrics


@pytest.mark.slow
def test_download_to_a_file_url_shards_the_same_samples_and_resumes_there(tmp_path):
    store = tmp_path / "shared store"  # outside both workspaces
    url = f"file://{store}/clip/run-1"  # as fsspec reads it: no %20
    target = store / "clip/run-1"
    with Site() as site:
        stage_run(tmp_path / "local", site)
        stage_run(tmp_path / "remote", site, output=url)
        remote = tmp_path / "remote"
        # data/download holds the catalog and the pointer; the tars are at the URL
        assert sorted(p.name for p in (remote / "data/download").iterdir()) == [
            CATALOG_FILE, POINTER_FILE]
        pointer = json.loads((remote / "data/download" / POINTER_FILE).read_text())
        part = part_folder(target)
        assert pointer["url"] == url and pointer["samples"] == 6
        # the tars that hold today's images (shard 2 holds none: a 404 and a text body)
        assert [(s["name"], s["bytes"]) for s in pointer["shards"]] == [
            (f"{pointer['store']}/parts/00000/0000{i}.tar", (part / f"0000{i}.tar").stat().st_size)
            for i in (0, 1)]
        assert (target / MARKER).is_file()
        reference = samples_of(tmp_path / "local/data/download")
        assert len(reference) == 6 and samples_of(target) == reference
        assert shard_outputs(remote) == shard_outputs(tmp_path / "local")  # byte-identical shards
        download = json.loads((remote / "metrics/download.json").read_text())
        assert download["successes"] == 6 and download["shards_done"] == 3

        # An interruption while shard 1 was fetching, on the fsspec target: only it is fetched.
        requests, _seconds = resume_after_losing_shard_1(remote, site, out=target)
        assert samples_of(target) == reference
        run_stage("shard", remote)
        # the same shards, byte for byte; this rerun kept them all and wrote none (it appends)
        assert shard_outputs(remote)[0] == shard_outputs(tmp_path / "local")[0]
        rerun = shard_outputs(remote)[1]["train"]
        assert rerun["shards_kept"] == rerun["shards"] and rerun["shards_new"] == 0
        # the tar the interruption did not touch is not decoded again
        assert json.loads((remote / "metrics/shard.json").read_text())[
            "input_shards_checked_before"] == 1
        # The next night fetches its new image (and the earlier failures) into the store there.
        assert second_night(remote, site) == SECOND_NIGHT_REQUESTS
    assert requests == SHARD_1_REQUESTS
    assert len(samples_of(target)) == 7 and len(samples_of(part)) == 6
    run_stage("shard", remote)
    assert json.loads((remote / "metrics/shard.json").read_text())["samples_out"] == 6

    # The tars at the URL are checked against the pointer: a lost one stops the shard stage.
    (part / "00001.tar").unlink()
    proc = run_stage("shard", remote, check=False)
    assert proc.returncode == 1
    assert f"missing: {pointer['store']}/parts/00000/00001.tar" in proc.stderr
    assert "rerun the download stage" in proc.stderr
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


def test_a_store_root_is_emptied_only_when_this_stage_wrote_it(tmp_path):
    """At a URL the user named: an absent or empty folder becomes a store; a store is kept as it
    is; files of the earlier one-folder layout (ours) are removed, saying so; files we did not
    write are never deleted. The project's own folder (owned) is cleared of anything else."""
    folder = tmp_path / "store"
    url = f"file://{folder}"
    prepare_root(url, owned=False, print_fn=quiet)  # absent: made, marked
    assert sorted(p.name for p in folder.iterdir()) == [MARKER]
    (folder / "s-0123456789ab").mkdir()
    said: list[str] = []
    prepare_root(url, owned=False, print_fn=said.append)
    assert (folder / "s-0123456789ab").is_dir() and said == []  # a store: kept

    old = tmp_path / "old layout"
    old.mkdir()
    (old / "clipms_input.sha256").write_text("abc\n")
    (old / "00000.tar").write_bytes(b"a shard of the earlier layout")
    prepare_root(f"file://{old}", owned=False, print_fn=said.append)
    assert sorted(p.name for p in old.iterdir()) == [MARKER]
    assert "earlier one-folder layout" in said[-1] and "removing 2 entries" in said[-1]

    foreign = tmp_path / "someone else's"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(StoreError, match="did not write"):
        prepare_root(f"file://{foreign}", owned=False, print_fn=quiet)
    assert (foreign / "notes.txt").read_text() == "keep me"
    prepare_root(str(foreign), owned=True, print_fn=said.append)  # the project's own out
    assert sorted(p.name for p in foreign.iterdir()) == [MARKER]
    assert "files this stage did not write" in said[-1]


@pytest.mark.slow  # downloads and shards to a URL through the stages
def test_a_remote_download_leaves_only_its_catalog_and_pointer_in_data_download(tmp_path):
    """What data/download held (a local run's tars, an old pointer) goes before img2dataset
    runs; the catalog and the pointer of the tars replace it, even when too few images arrived
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
    # The shards all finished (with a failure): the pointer records no tar (none holds an image of
    # today's); the local tar is gone.
    assert sorted(p.name for p in old.iterdir()) == [CATALOG_FILE, POINTER_FILE]
    pointer = json.loads((old / POINTER_FILE).read_text())
    assert pointer["samples"] == 0 and pointer["shards"] == []
    assert pointer["url"] == f"file://{store}"


@pytest.mark.slow
def test_dvc_versions_a_download_to_a_url_by_its_pointer(tmp_path):
    """Real `dvc repro` (tiny synthetic config): data/download is the pointer, DVC caches it and
    calls the pipeline up to date; `dvc repro -f download` resumes on the target."""
    store = tmp_path / "store"
    ws = make_workspace(tmp_path / "ws", {"download.output": f"file://{store}/tiny"})
    run(["dvc", "repro", "shard"], ws)
    pointer = json.loads((ws / "data/download" / POINTER_FILE).read_text())
    assert pointer["samples"] == 48
    assert sorted(p.name for p in (ws / "data/download").iterdir()) == [CATALOG_FILE, POINTER_FILE]
    assert json.loads((ws / "metrics/shard.json").read_text())["samples_out"] == 48
    lock = yaml.safe_load((ws / "dvc.lock").read_text())["stages"]
    assert lock["shard"]["params"]["params.yaml"]["download.output"] == f"file://{store}/tiny"
    again = run(["dvc", "repro", "shard"], ws)
    assert "Running stage" not in again.stdout
    assert "up to date" in run(["dvc", "status", "shard"], ws).stdout

    part = part_folder(store / "tiny")
    kept = (part / "00000.tar").stat().st_mtime_ns
    for path in part.glob("00001*"):
        path.unlink()
    resumed = run(["dvc", "repro", "-f", "download"], ws)
    assert "resuming part 00000 (1 of 2 img2dataset shard(s) finished are kept)" in resumed.stdout
    assert (part / "00000.tar").stat().st_mtime_ns == kept
    assert (part / "00001.tar").is_file()


def test_a_local_store_is_not_removed_when_download_output_is_set(tmp_path):
    """Runs without download.output kept their store in data/download; setting the option must
    not delete it to make room for the pointer: the stage says how to move it."""
    local = tmp_path / "data/download"
    prepare_root(str(local), owned=True, print_fn=quiet)
    (local / "s-0123456789ab/parts").mkdir(parents=True)
    images_parquet(tmp_path, ["http://127.0.0.1:9/never.jpg"])
    store = tmp_path.parent / f"{tmp_path.name}-store"
    write_params(tmp_path, output=f"file://{store}")
    proc = run_stage("download", tmp_path, check=False)
    assert proc.returncode == 1
    assert "holds the download store of earlier runs without download.output" in proc.stderr
    assert f"Copy its contents to file://{store}" in proc.stderr
    assert (local / "s-0123456789ab/parts").is_dir() and (local / MARKER).is_file()

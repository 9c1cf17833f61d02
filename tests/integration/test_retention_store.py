"""Retention against the real stores: six nights of a small DVC project (real `dvc repro`, a local
DVC remote, a git repo) each registering a version through the real register stage into a real
`mlflow server` (proxied artifacts), then the policy applied by the `retain` stage under `dvc
repro` and by `python -m registry retain`.

The nights: v1 champion; v2 challenger, then tagged to keep; v3 and v4 challengers in turn, v3
then tagged keep=false (which keeps nothing); v5 registered by a night whose gate failed closed
(the champion lookup answered 503: the version exists, no alias moved); v6 challenger. With
keep_last 1, v1 (champion), v2 (tag) and v6 (challenger, newest) stay whole; v3, v4 and v5 lose
their heavy files.

Each night's `data/shards` holds a file all nights share and a part two nights share (1 and 2, 3
and 4, 5 and 6): an object a removed version shares with a kept one (v5 with v6) stays, one only
removed versions share (v3 and v4) goes. Each night's search index is alike (stored by the real
register stage as chunks in the experiment's index store): a file of its own, one all nights
share and one two nights share.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import chdir
from pathlib import Path

import pytest
import yaml

from harness import mlflow_server as server_fixtures
from harness import register_workspace
from harness.dvc_workspace import run, tool_env
from harness.fault_proxy import FaultProxy, Rule
from harness.mlflow_server import MlflowServer
from registry.retention import REMOVED_TAG
from tracking import settings
from tracking.files import FILES

pytestmark = pytest.mark.slow
mlflow_server = server_fixtures.mlflow_server  # session fixtures, found by name
bundle = register_workspace.bundle
PROJECT_ROOT = Path(__file__).resolve().parents[2]
MODEL = "retention-test"
ALIAS = "/api/2.0/mlflow/registered-models/alias"
SCORES = {1: 0.5, 2: 0.4, 3: 0.3, 4: 0.35, 5: 0.2, 6: 0.1, 7: 0.05}
NIGHTS = (1, 2, 3, 4, 5, 6)  # the module's nights; the last test adds night 7
GATE_FAILS = (5,)
KEPT, REMOVED = (1, 2, 6), (3, 4, 5)

MAKE = """
import pathlib, sys, yaml
night = yaml.safe_load(open("params.yaml"))["night"]
shards = pathlib.Path("data/shards")
shards.mkdir(parents=True, exist_ok=True)
(shards / "common.tar").write_bytes(b"every night" * 1000)
(shards / "part.tar").write_bytes(b"part %d" % ((night + 1) // 2) * 1000)
pathlib.Path("models").mkdir(exist_ok=True)
pathlib.Path("models/clip.ckpt").write_bytes(b"weights of night %d" % night * 1000)
"""

PIPELINE = {"stages": {
    "make": {"cmd": "python make.py", "deps": ["make.py"], "params": ["night"],
             "outs": ["data/shards", "models/clip.ckpt"]},
    # the project's stage, as dvc.yaml declares it (its code deps are the project's)
    "retain": {"cmd": "python -m stages.retain", "deps": ["metrics/register.json"],
               "params": ["retention", "register.model_name"],
               "metrics": [{"metrics/retain.json": {"cache": False}}]}}}


def env(tracking_uri: str) -> dict[str, str]:
    return {**tool_env(), "PYTHONPATH": str(PROJECT_ROOT), "MLFLOW_TRACKING_URI": tracking_uri,
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}


def set_night(root: Path, night: int, keep_last: int = 1) -> None:
    (root / "params.yaml").write_text(yaml.safe_dump({
        "night": night,
        "register": {"model_name": MODEL, "experiment": "retention-exp",
                     "primary_metric": "i2t_R@5", "margin": 0.0},
        "retention": {"keep_last": keep_last, "keep_tag": "keep"}}))


def make_project(root: Path, remote: Path) -> None:
    root.mkdir()
    (root / "make.py").write_text(MAKE)
    (root / "dvc.yaml").write_text(yaml.safe_dump(PIPELINE, sort_keys=False))
    (root / ".gitignore").write_text("/models/\n/metrics/\n/data/\n")
    set_night(root, 0)
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=root, check=True)
    run([sys.executable, "-m", "dvc", "init", "-q"], root)
    run([sys.executable, "-m", "dvc", "remote", "add", "-d", "store", str(remote)], root)


def night(root: Path, number: int, bundle_dir: Path, proxy: FaultProxy) -> None:
    """`dvc repro` of the night's data, then the real register stage (its gate through the
    proxy: on a gate-failing night the champion lookup answers 503)."""
    from clipms.utils.jsonio import write_json
    from tracking import run as tracking_run

    set_night(root, number)
    run([sys.executable, "-m", "dvc", "repro", "make"], root, env=env(proxy.url))
    shutil.rmtree(root / "models" / "export", ignore_errors=True)
    shutil.copytree(bundle_dir, root / "models" / "export")
    for name in ("clip.json", "tokenizer.json"):
        shutil.copy2(bundle_dir.parent / "trained" / name, root / "models" / name)
    index = root / "models" / "index"  # logged into the version's model as its search index
    index.mkdir(exist_ok=True)
    for name, data in index_files(number).items():
        (index / name).write_bytes(data)
    scores = {"i2t_R@5": SCORES[number], "i2t_R@1": SCORES[number] / 2, "images": 10}
    write_json(root / "metrics" / "eval.json", scores)
    (root / "metrics" / "register.json").unlink(missing_ok=True)
    with chdir(root):
        tracking_run.PipelineRun.open("train", {"night": number}, FILES).close()
        tracking_run.log_stage("evaluate", {"batch_size": 16}, FILES, scores)
    if number in GATE_FAILS:
        proxy.add(Rule("GET", ALIAS, "fail", status=503))
    code, record = register_workspace.register_in(root)
    proxy.clear()
    assert (code, record is None) == ((1, True) if number in GATE_FAILS else (0, False))


def index_files(number: int) -> dict[str, bytes]:
    """The night's index files, each under a chunk (so each file one chunk)."""
    return {"embeddings.bin": b"night %d" % number * 1000,
            "thumbnails.bin": b"thumbnails of every night" * 1000,
            "items.bin": b"items %d" % ((number + 1) // 2) * 1000}


def chunk_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def nights(mlflow_server: MlflowServer, bundle: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, FaultProxy]]:
    if mlflow_server.proc is None:
        mlflow_server.start()
    base = tmp_path_factory.mktemp("retention")
    root, remote = base / "project", base / "remote"
    make_project(root, remote)
    proxy = FaultProxy(mlflow_server.uri)
    saved = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = proxy.url
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    try:
        for number in NIGHTS:
            night(root, number, bundle, proxy)
        client = settings.client()
        client.set_model_version_tag(MODEL, "2", "keep", "true")
        client.set_model_version_tag(MODEL, "3", "keep", "false")  # a tag that keeps nothing
        yield root, proxy
    finally:
        proxy.stop()
        if saved is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = saved


# ---------------------------------------------------------------- what the stores hold


def version_files(number: int) -> dict[str, list[str]]:
    """The version's checkpoint files in its run, its logged model's top-level entries, and its
    lineage lock."""
    client = settings.client()
    version = client.get_model_version(MODEL, str(number))
    model_id = version.source.removeprefix("models:/")
    return {"checkpoint": [a.path for a in client.list_artifacts(version.run_id,
                                                                 f"checkpoint/{model_id}")],
            "model": sorted(a.path for a in client.list_logged_model_artifacts(model_id)),
            "lineage": [a.path for a in client.list_artifacts(version.run_id,
                                                              f"lineage/{model_id}")]}


def lineage_objects(number: int, root: Path) -> dict[str, str]:
    """{path: md5} of the files of the version's logged dvc.lock (folders expanded from the
    cache, read before retention)."""
    client = settings.client()
    version = client.get_model_version(MODEL, str(number))
    model_id = version.source.removeprefix("models:/")
    lock = client.download_artifacts(version.run_id, f"lineage/{model_id}/dvc.lock",
                                     str(root.parent / f"lock-v{number}"))
    out = {}
    for item in yaml.safe_load(Path(lock).read_text())["stages"]["make"]["outs"]:
        out[item["path"]] = item["md5"]
        if item["md5"].endswith(".dir"):
            listing = json.loads(object_path(root / ".dvc" / "cache", item["md5"]).read_text())
            out.update({f"{item['path']}/{e['relpath']}": e["md5"] for e in listing})
    return out


def object_path(store: Path, md5: str) -> Path:
    return store / "files" / "md5" / md5[:2] / md5[2:]


def cache_has(root: Path, md5: str) -> bool:
    return object_path(root / ".dvc" / "cache", md5).is_file()


def snapshot(root: Path) -> tuple[dict, list[str]]:
    cache = sorted(str(p.relative_to(root)) for p in (root / ".dvc" / "cache").rglob("*")
                   if p.is_file())
    return {n: version_files(n) for n in NIGHTS}, cache


# ---------------------------------------------------------------- the tests


def test_the_nights_left_the_expected_aliases_and_lineage(nights: tuple[Path, FaultProxy]) -> None:
    aliases = settings.client().get_registered_model(MODEL).aliases
    assert aliases == {"champion": "1", "challenger": "6"}
    assert all(version_files(n)["lineage"] for n in NIGHTS)  # every version's dvc.lock logged


def test_a_dry_run_lists_what_would_go_and_why_and_removes_nothing(
        nights: tuple[Path, FaultProxy]) -> None:
    root, proxy = nights
    before = snapshot(root)
    out = run([sys.executable, "-m", "registry", "retain", "--dry-run"], root,
              env=env(proxy.url)).stdout
    assert "v1: keep (alias champion)" in out and "v2: keep (tagged keep)" in out
    assert "v6: keep (alias challenger, one of the newest 1)" in out
    for number in REMOVED:
        assert (f"v{number}: remove heavy files (older than the newest 1, neither champion nor "
                "challenger, not tagged keep)") in out
    assert "MLflow checkpoint/" in out and "DVC cache " in out
    assert out.rstrip().endswith("dry run: nothing was removed")
    assert "no earlier retention run marked the search-index store" in out
    assert snapshot(root) == before
    assert not (root / "models" / "retention-plan.json").exists()
    assert not (root / "models" / "index-store-listing.json").exists()  # a dry run records none


def test_a_run_killed_midway_is_finished_by_the_next_retain_stage(
        nights: tuple[Path, FaultProxy]) -> None:
    root, proxy = nights
    objects = {n: lineage_objects(n, root) for n in NIGHTS}
    # Killed while removing the heavy files of v3's logged model, after its checkpoint.
    proxy.add(Rule("DELETE", "/models/", "hang"))
    proc = subprocess.Popen([sys.executable, "-m", "registry", "retain"], cwd=root,
                            env=env(proxy.url), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not any(m == "DELETE" and "/models/" in p for m, p in proxy.seen):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        proxy.clear()
    assert (root / "models" / "retention-plan.json").exists()  # the plan, written first
    assert version_files(3)["checkpoint"] == []  # the first removal happened...
    assert REMOVED_TAG not in settings.client().get_model_version(MODEL, "3").tags  # not tagged

    run([sys.executable, "-m", "dvc", "repro", "retain"], root, env=env(proxy.url))
    report = json.loads((root / "metrics" / "retain.json").read_text())
    assert report["resumed"] is True and report["remote"] == "store"
    assert sorted(report["kept"]) == [f"v{n}" for n in KEPT]
    assert sorted(report["removed"]) == [f"v{n}" for n in REMOVED]
    assert not (root / "models" / "retention-plan.json").exists()

    client = settings.client()
    assert client.get_registered_model(MODEL).aliases == {"champion": "1", "challenger": "6"}
    for number in NIGHTS:
        files = version_files(number)
        assert files["lineage"], number  # lineage is never removed
        tags = client.get_model_version(MODEL, str(number)).tags
        if number in KEPT:
            assert len(files["checkpoint"]) == 3, (number, files)
            assert {"MLmodel", "artifacts", "index"} - set(files["model"]) == set(), files
            assert REMOVED_TAG not in tags
        else:
            assert files["checkpoint"] == [], (number, files)
            assert "MLmodel" in files["model"] and "artifacts" not in files["model"], files
            assert "older than the newest 1" in tags[REMOVED_TAG]

    used_by_kept = {md5 for n in KEPT for md5 in objects[n].values()}
    for number in REMOVED:
        for path, md5 in objects[number].items():
            # an object only removed versions use leaves the cache, not the remote
            assert cache_has(root, md5) == (md5 in used_by_kept), (number, path)
            assert object_path(root.parent / "remote", md5).is_file(), (number, path)
    assert all(cache_has(root, md5) for md5 in used_by_kept)
    shared = objects[5]["data/shards/part.tar"]  # v5 (removed) shares it with v6 (challenger)
    assert shared == objects[6]["data/shards/part.tar"] and cache_has(root, shared)
    gone = objects[3]["data/shards/part.tar"]  # shared by v3 and v4 only, both removed
    assert gone == objects[4]["data/shards/part.tar"] and not cache_has(root, gone)
    assert not cache_has(root, objects[3]["models/clip.ckpt"])
    assert report["dvc_cache_objects"] >= 4 and report["mlflow_artifacts"] >= 1

    # A second run finds nothing left to remove.
    again = run([sys.executable, "-m", "registry", "retain"], root, env=env(proxy.url)).stdout
    assert "removes 0 item(s)" in again


def test_removed_versions_still_compare_with_their_metrics(
        nights: tuple[Path, FaultProxy]) -> None:
    root, proxy = nights
    out = run([sys.executable, "-m", "registry", "compare", "--name", MODEL,
               "--metrics", "i2t_R@5"], root, env=env(proxy.url)).stdout
    assert "6 version(s)" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.startswith("v") and line[1].isdigit()}
    for number in NIGHTS:
        assert f"{SCORES[number]:.4f}" in rows[f"v{number}"], rows


def store_chunks() -> set[str]:
    from registry import index_store

    client = settings.client()
    experiment = client.get_experiment_by_name("retention-exp").experiment_id
    return set(index_store.held_chunks(client, index_store.find_store_run(client, experiment)))


def age_listing(root: Path) -> dict:
    """The index store's marks recorded by the last applied run, made a day older (as if the
    next run were the next night's)."""
    path = root / "models" / "index-store-listing.json"
    listings = json.loads(path.read_text())
    for entry in listings.values():
        entry["listed_at"] -= 24 * 3600
    path.write_text(json.dumps(listings))
    return listings


def test_index_chunks_only_removed_versions_used_leave_the_store(
        nights: tuple[Path, FaultProxy], tmp_path: Path) -> None:
    """The run above removed v3-v5's index references and marked the store's chunks no
    remaining reference names. A register then uploads a chunk and has not logged its reference
    yet; the next night's retention removes the chunks only v3-v5 named, keeps the kept
    versions' (the champion's index still materializes) and the late upload (not marked); a
    night later, still named by no reference (marked by the night between), it goes."""
    import mlflow

    from registry import index_store

    root, proxy = nights
    client = settings.client()
    files = {n: index_files(n) for n in NIGHTS}
    by_kept = {chunk_of(data) for n in KEPT for data in files[n].values()}
    only_removed = {chunk_of(data) for n in REMOVED for data in files[n].values()} - by_kept
    assert {chunk_of(files[3]["items.bin"]), chunk_of(files[5]["embeddings.bin"])} <= only_removed
    assert chunk_of(files[5]["items.bin"]) in by_kept  # v5 shares it with v6
    assert only_removed | by_kept <= store_chunks()  # the run above removed no chunk yet

    late_index = tmp_path / "late"
    late_index.mkdir()
    (late_index / "embeddings.bin").write_bytes(b"a register still running" * 100)
    experiment = client.get_experiment_by_name("retention-exp").experiment_id
    late = index_store.store_index(client, experiment, late_index)["files"]["embeddings.bin"]
    late_chunk = late["chunks"][0]
    listings = age_listing(root)
    marked = {c for entry in listings.values() for c in entry["unreferenced"]}
    assert only_removed <= marked and not marked & by_kept and late_chunk not in marked

    dry = run([sys.executable, "-m", "registry", "retain", "--dry-run"], root,
              env=env(proxy.url)).stdout
    for digest in only_removed:
        assert (f"index store chunks/{digest}, 0.01 MB, of no remaining version: named by no "
                "remaining index reference, unreferenced at the retention run of") in dry, dry
    assert late_chunk not in dry and not any(d in dry for d in by_kept)
    assert only_removed | by_kept | {late_chunk} <= store_chunks()

    run([sys.executable, "-m", "registry", "retain"], root, env=env(proxy.url))
    held = store_chunks()
    assert not held & only_removed and by_kept <= held and late_chunk in held
    for number in KEPT:
        model_id = client.get_model_version(MODEL, str(number)).source.removeprefix("models:/")
        location = client.get_logged_model(model_id).artifact_location
        served = Path(mlflow.artifacts.download_artifacts(
            artifact_uri=f"{location}/index", dst_path=str(tmp_path / f"v{number}"),
            tracking_uri=proxy.url))
        assert index_store.materialize(served, proxy.url)
        assert {p.name: p.read_bytes() for p in served.iterdir()} == files[number]

    age_listing(root)  # a night later, the late upload still has no reference: it goes
    out = run([sys.executable, "-m", "registry", "retain"], root, env=env(proxy.url)).stdout
    assert f"index store chunks/{late_chunk}" in out and late_chunk not in store_chunks()
    assert by_kept <= store_chunks()


def test_a_failed_push_removes_nothing_from_the_cache(nights: tuple[Path, FaultProxy],
                                                      bundle: Path) -> None:
    """Night 7's challenger retires v6 (no alias, not the newest). The artifact store refusing
    deletions stops retention with the plan kept; with the DVC remote unwritable its MLflow
    artifacts go, its cache objects stay; with the remote back, they go too."""
    root, proxy = nights
    night(root, 7, bundle, proxy)
    only_v6 = lineage_objects(6, root)["models/clip.ckpt"]
    proxy.add(Rule("DELETE", "/mlflow-artifacts/", "fail", status=503))
    refused = run([sys.executable, "-m", "registry", "retain"], root, env=env(proxy.url),
                  check=False)
    proxy.clear()
    assert refused.returncode == 1 and "retention stopped midway" in refused.stderr, refused
    assert "the next run finishes it" in refused.stderr
    assert (root / "models" / "retention-plan.json").exists() and version_files(6)["checkpoint"]
    blocker = root.parent / "not-a-folder"
    blocker.write_text("a file where the remote's folder would be")
    dvc = [sys.executable, "-m", "dvc", "remote", "modify", "store", "url"]
    run([*dvc, str(blocker / "remote")], root)
    proc = run([sys.executable, "-m", "registry", "retain"], root, env=env(proxy.url))
    assert "`dvc push` to 'store' failed" in proc.stdout and "nothing was removed from the DVC " \
        "cache" in proc.stdout, proc.stdout
    assert cache_has(root, only_v6)
    assert version_files(6)["checkpoint"] == []  # MLflow's side does not depend on the remote

    run([*dvc, str(root.parent / "remote")], root)
    run([sys.executable, "-m", "registry", "retain"], root, env=env(proxy.url))
    assert not cache_has(root, only_v6)
    assert object_path(root.parent / "remote", only_v6).is_file()

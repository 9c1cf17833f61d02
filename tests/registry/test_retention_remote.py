"""Retention and the DVC remote (`retention.prune_remote`), against a real DVC project: a git repo,
`dvc repro` and `dvc push` to a folder remote each night, the team committing dvc.lock nightly;
the registry a local MLflow file store (as tests/registry/test_retention_plots.py), each version
with its logged dvc.lock, and the policy applied by `registry.retention.retain` (whose cache side
runs the real `dvc push`).

Six nights, keep_last 1: v1 champion, v2 tagged keep, v6 challenger and newest stay whole; v3, v4
and v5 are removed. Each night's `data/shards` holds a file all nights share, a part two nights
share (1 and 2, 3 and 4, 5 and 6) and an old part of its own except on night 4, whose old part is
night 1's; `models/clip.ckpt` is the night's own. Night 5's commit carries the git tag `pinned`.
So on the remote: v3's and v4's checkpoints and shards listings, their shared part and v3's old
part are used only by removed versions and named by no git branch or tag (night 3's and 4's
commits are history, not refs): exactly those six go. v4's old part stays (the champion, v1, uses
it, and neither the workspace nor a ref names it), v5's objects stay (the tag names them), as
do the part v5 shares with v6 and what every night shares.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from harness.dvc_workspace import run
from registry.retention import REMOTE_REASON, DvcCache, RetentionError, RetentionParams, retain
from tracking.journal import mlflow_key

pytestmark = pytest.mark.slow  # runs `dvc`
MODEL = "clip-remote"
NIGHTS = (1, 2, 3, 4, 5, 6)
KEPT, REMOVED = (1, 2, 6), (3, 4, 5)
GIT = ["git", "-c", "user.email=t@clipms", "-c", "user.name=t"]

MAKE = """
import pathlib, yaml
night = yaml.safe_load(open("params.yaml"))["night"]
shards = pathlib.Path("data/shards")
shards.mkdir(parents=True, exist_ok=True)
(shards / "common.tar").write_bytes(b"every night" * 1000)
(shards / "part.tar").write_bytes(b"part %d" % ((night + 1) // 2) * 1000)
(shards / "old.tar").write_bytes(b"old %d" % (1 if night == 4 else night) * 1000)
pathlib.Path("models").mkdir(exist_ok=True)
pathlib.Path("models/clip.ckpt").write_bytes(b"weights of night %d" % night * 1000)
"""
PIPELINE = {"stages": {"make": {"cmd": "python make.py", "deps": ["make.py"], "params": ["night"],
                                "outs": ["data/shards", "models/clip.ckpt"]}}}


def dvc(*args: str, cwd: Path) -> str:
    return run([sys.executable, "-m", "dvc", *args], cwd).stdout


def object_files(store: Path) -> dict[str, int]:
    """{md5: bytes} of the objects a DVC cache or remote folder holds."""
    folder = store / "files" / "md5"
    return {p.parent.name + p.name: p.stat().st_size for p in folder.rglob("*") if p.is_file()}


def outs(lock_text: str, cache: Path) -> dict[str, str]:
    """{path: md5} of a dvc.lock's outs and of the files of its folders (listed from `cache`)."""
    found = {}
    for out in yaml.safe_load(lock_text)["stages"]["make"]["outs"]:
        found[out["path"]] = out["md5"]
        if out["md5"].endswith(".dir"):
            md5 = out["md5"]
            listing = json.loads((cache / "files" / "md5" / md5[:2] / md5[2:]).read_text())
            found.update({f"{out['path']}/{e['relpath']}": e["md5"] for e in listing})
    return found


class World:
    """The project (root), its remote, the registry and each night's {path: md5}."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.root, self.remote = base / "project", base / "remote"
        self.uri = (base / "mlruns").as_uri()
        self.objects: dict[int, dict[str, str]] = {}

    def client(self):
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)

    def retain(self, lines: list[str] | None = None, **params) -> dict:
        params = {"keep_last": 1, **params}
        return retain(self.client(), MODEL, RetentionParams(**params), self.root,
                      on_line=(lines.append if lines is not None else lambda _: None))

    def remote_objects(self) -> dict[str, int]:
        return object_files(self.remote)

    def cache_objects(self) -> dict[str, int]:
        return object_files(self.root / ".dvc" / "cache")

    def used(self, numbers) -> set[str]:
        return {md5 for n in numbers for md5 in self.objects[n].values()}


def build(world: World) -> None:
    root, client = world.root, None
    root.mkdir()
    (root / "make.py").write_text(MAKE)
    (root / "dvc.yaml").write_text(yaml.safe_dump(PIPELINE, sort_keys=False))
    (root / ".gitignore").write_text("/models/\n/data/\n/scratch/\n")
    (root / "params.yaml").write_text("night: 0\n")
    run(["git", "init", "-q", "-b", "main"], root)
    dvc("init", "-q", cwd=root)
    dvc("remote", "add", "-d", "store", str(world.remote), cwd=root)
    client = world.client()
    experiment = client.create_experiment("remote", artifact_location=(world.base / "art").as_uri())
    client.create_registered_model(MODEL)
    for number in NIGHTS:
        (root / "params.yaml").write_text(f"night: {number}\n")
        dvc("repro", cwd=root)
        dvc("push", cwd=root)
        run([*GIT, "add", "-A"], root)
        run([*GIT, "commit", "-qm", f"night {number}"], root)  # the team commits dvc.lock
        if number == 5:
            run([*GIT, "tag", "pinned"], root)
        lock = (root / "dvc.lock").read_text()
        world.objects[number] = outs(lock, root / ".dvc" / "cache")
        run_id = client.create_run(experiment).info.run_id
        model = client.create_logged_model(experiment, source_run_id=run_id, name=f"m{number}")
        lineage = world.base / "lineage" / str(number)
        lineage.mkdir(parents=True)
        (lineage / "dvc.lock").write_text(lock)
        client.log_artifact(run_id, str(lineage / "dvc.lock"), f"lineage/{model.model_id}")
        client.log_metric(run_id, mlflow_key("i2t_R@5"), number / 10, model_id=model.model_id)
        client.create_model_version(MODEL, f"models:/{model.model_id}", run_id,
                                    model_id=model.model_id)
    client.set_registered_model_alias(MODEL, "champion", "1")
    client.set_registered_model_alias(MODEL, "challenger", "6")
    client.set_model_version_tag(MODEL, "2", "keep", "true")


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, World]]:
    """The six nights, built once and saved beside; each test gets them afresh (`world`)."""
    base = tmp_path_factory.mktemp("retention-remote")
    world = World(base / "w")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        patch.setenv("MLFLOW_TRACKING_URI", world.uri)
        world.base.mkdir()
        build(world)
        shutil.copytree(world.base, base / "saved", symlinks=True)
        yield base / "saved", world


@pytest.fixture
def world(template: tuple[Path, World], monkeypatch: pytest.MonkeyPatch) -> World:
    saved, world = template
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", world.uri)  # what the registry's own lookups use
    shutil.rmtree(world.base)
    shutil.copytree(saved, world.base, symlinks=True)  # the same paths: the store's stay valid
    return world


def exclusive(world: World) -> set[str]:
    """What only v3 and v4 use: the objects prune_remote takes from the remote."""
    return world.used((3, 4)) - world.used((*KEPT, 5))


def test_the_nights_share_objects_as_the_module_says(world: World) -> None:
    objects = world.objects
    assert objects[3]["data/shards/part.tar"] == objects[4]["data/shards/part.tar"]
    assert objects[5]["data/shards/part.tar"] == objects[6]["data/shards/part.tar"]
    assert objects[4]["data/shards/old.tar"] == objects[1]["data/shards/old.tar"]
    assert len({objects[n]["models/clip.ckpt"] for n in NIGHTS}) == 6
    assert len({objects[n]["data/shards"] for n in NIGHTS}) == 6
    assert len(exclusive(world)) == 6
    assert world.used(NIGHTS) <= set(world.remote_objects())  # pushed every night


def test_without_prune_remote_the_remote_keeps_every_object(world: World) -> None:
    """Today's behaviour, and the default: the cache loses what only v3-v5 use, the remote
    nothing."""
    before = world.remote_objects()
    lines: list[str] = []
    report = world.retain(lines)
    assert report["prune_remote"] is False
    assert sorted(report["removed"]) == ["v3", "v4", "v5"]
    assert world.remote_objects() == before
    only_removed = world.used(REMOVED) - world.used(KEPT)
    assert not only_removed & set(world.cache_objects())
    assert report["dvc_cache_objects"] == len(only_removed) == 9
    assert report["dvc_remote_objects"] == 0 and report["dvc_remote_bytes"] == 0
    assert "DVC remote '" not in lines[0]


def test_prune_remote_takes_exactly_the_removed_versions_exclusive_objects(world: World) -> None:
    before = world.remote_objects()
    gone = exclusive(world)
    lines: list[str] = []
    report = world.retain(lines, prune_remote=True)
    after = world.remote_objects()
    assert set(before) - set(after) == gone
    assert set(after) == set(before) - gone  # nothing else left the remote
    assert world.used(KEPT) <= set(after)  # the champion's, the tagged one's, the newest's
    assert world.objects[5]["models/clip.ckpt"] in after  # named by the git tag `pinned`
    assert world.objects[5]["data/shards/part.tar"] in after  # shared with v6
    assert world.objects[4]["data/shards/old.tar"] in after  # shared with v1, the champion
    assert report["dvc_remote_objects"] == 6
    assert report["dvc_remote_bytes"] == sum(before[md5] for md5 in gone)
    assert not (world.used(REMOVED) - world.used(KEPT)) & set(world.cache_objects())
    for md5 in gone:
        assert f"DVC remote 'store' {md5}" in lines[0] and REMOTE_REASON in lines[0]
    # Idempotent: a second run removes nothing more.
    again = world.retain(prune_remote=True)
    assert again["dvc_remote_objects"] == 0 and set(world.remote_objects()) == set(after)


def test_a_pruned_version_still_compares_and_keeps_its_lineage(
        world: World, capsys: pytest.CaptureFixture[str]) -> None:
    from registry.__main__ import main

    world.retain(prune_remote=True)
    capsys.readouterr()
    assert main(["compare", "--name", MODEL, "--metrics", "i2t_R@5"]) == 0
    out = capsys.readouterr().out
    assert "6 version(s)" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line[:2] in
            {f"v{n}" for n in NIGHTS}}
    for number in NIGHTS:
        assert f"{number / 10:.4f}" in rows[f"v{number}"], rows
    client = world.client()
    for number in REMOVED:
        version = client.get_model_version(MODEL, str(number))
        model_id = version.source.removeprefix("models:/")
        assert [a.path for a in client.list_artifacts(version.run_id, f"lineage/{model_id}")]


def test_a_dry_run_lists_the_remote_removals_and_removes_nothing(world: World) -> None:
    remote, cache = world.remote_objects(), world.cache_objects()
    lines: list[str] = []
    report = world.retain(lines, prune_remote=True, dry_run=True)
    assert world.remote_objects() == remote and world.cache_objects() == cache
    text = lines[0]
    listed = {line.split()[3] for line in text.splitlines()
              if line.startswith("  DVC remote 'store' ")}
    assert listed == exclusive(world), text
    assert REMOTE_REASON in text and text.rstrip().endswith("dry run: nothing was removed")
    assert "dvc_remote_objects" not in report
    assert not (world.root / "models" / "retention-plan.json").exists()


def test_a_failed_push_removes_nothing_from_the_cache_nor_the_remote(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    remote = world.remote_objects()
    monkeypatch.setattr(DvcCache, "push", lambda self: "the remote refused")
    lines: list[str] = []
    report = world.retain(lines, prune_remote=True)
    assert world.remote_objects() == remote
    assert report["dvc_cache_objects"] == 0 and report["dvc_remote_objects"] == 0
    assert any("stay on remote 'store' too" in line for line in lines), lines


def test_a_run_killed_while_pruning_is_finished_by_the_next(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopped after the cache and one remote object: the plan stays; the next run (planned
    afresh) finds the rest gone from the cache and takes them from the remote."""
    before = world.remote_objects()
    remove = DvcCache.remove_from_remote
    calls: list[str] = []

    def dies_second_time(self: DvcCache, md5: str, legacy: bool) -> None:
        calls.append(md5)
        if len(calls) == 2:
            raise OSError("killed")
        remove(self, md5, legacy)

    monkeypatch.setattr(DvcCache, "remove_from_remote", dies_second_time)
    with pytest.raises(RetentionError, match="the next run finishes it"):
        world.retain(prune_remote=True)
    assert (world.root / "models" / "retention-plan.json").exists()
    assert len(set(before) - set(world.remote_objects())) == 1
    assert not calls[0].endswith(".dir")  # a folder's listing goes after its files
    monkeypatch.setattr(DvcCache, "remove_from_remote", remove)
    report = world.retain(prune_remote=True)
    assert report["resumed"] is True and report["dvc_remote_objects"] == 5
    assert set(before) - set(world.remote_objects()) == exclusive(world)
    assert not (world.root / "models" / "retention-plan.json").exists()


def test_a_kept_version_without_a_logged_lock_stops_all_pruning(world: World) -> None:
    """Which objects v2 (kept) uses is unknown: the remote keeps everything, the cache side
    (which the remote backs) still runs."""
    client = world.client()
    version = client.get_model_version(MODEL, "2")
    model_id = version.source.removeprefix("models:/")
    from urllib.parse import urlparse

    run_root = Path(urlparse(client.get_run(version.run_id).info.artifact_uri).path)
    shutil.rmtree(run_root / "lineage" / model_id)
    before = world.remote_objects()
    report = world.retain(prune_remote=True)
    assert world.remote_objects() == before
    assert any("v2, kept, has no dvc.lock logged with it" in n for n in report["notes"])


def test_prune_remote_without_a_remote_says_so(world: World) -> None:
    dvc("remote", "remove", "store", cwd=world.root)
    report = world.retain(prune_remote=True)
    assert any("no default DVC remote is configured" in n for n in report["notes"])


def test_a_branch_whose_folder_is_listed_nowhere_spares_only_that_listing(world: World) -> None:
    """A teammate's branch names a shards folder that was never pushed: it cannot be pulled from
    the remote whatever goes, so it does not stop pruning; what it names that the remote holds
    (v4's checkpoint) stays."""
    root = world.root
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    for out in lock["stages"]["make"]["outs"]:
        out["md5"] = {"data/shards": "f" * 32 + ".dir",
                      "models/clip.ckpt": world.objects[4]["models/clip.ckpt"]}[out["path"]]
    run([*GIT, "checkout", "-q", "-b", "teammate"], root)
    (root / "dvc.lock").write_text(yaml.safe_dump(lock, sort_keys=False))
    run([*GIT, "commit", "-qam", "a teammate's night"], root)
    run([*GIT, "checkout", "-q", "main"], root)
    before = world.remote_objects()
    report = world.retain(prune_remote=True)
    gone = set(before) - set(world.remote_objects())
    assert gone == exclusive(world) - {world.objects[4]["models/clip.ckpt"]}
    assert any("1 folder(s) git refs name (data/shards, ...)" in n
               for n in report["notes"]), report["notes"]


def test_a_saved_experiment_spares_what_it_names(world: World) -> None:
    """An overrides run is saved by `dvc exp save` as a git ref under refs/exps (here one made
    by git, at night 3's commit): `dvc exp apply` + `dvc pull` of it needs v3's objects."""
    root = world.root
    night3 = run(["git", "log", "--format=%H", "--grep", "^night 3$"], root).stdout.split()[0]
    run(["git", "update-ref", "refs/exps/ab/cdef/clip-overrides", night3], root)
    before = world.remote_objects()
    world.retain(prune_remote=True)
    gone = set(before) - set(world.remote_objects())
    assert gone == exclusive(world) - world.used((3,))
    assert gone == {world.objects[4]["models/clip.ckpt"], world.objects[4]["data/shards"]}

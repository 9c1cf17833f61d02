"""Retention: what a machine keeps of the registered versions, and the removal of the rest's heavy
files, so storage grows with the data and not with the nights.

The policy (`retention` in params.yaml): the versions behind the `champion` and `challenger`
aliases, the newest `keep_last` versions and every version tagged `keep_tag` are kept whole. Of
every other version, what is heavy leaves:

- the MLflow artifact store: its training checkpoint (`checkpoint/<logged model id>/` in its
  run), its run's plot pictures (the PNGs under `plots/`, redrawn by each run; the CSVs beside
  them, the data they draw, stay; not when a kept version shares the run), and its logged
  model's folders: the bundle (`artifacts/`), the search index (`index/`) and the code copy
  (`code/`); the model's top-level files (MLmodel, its environment, input example) stay.
  Through the artifact repository's `delete_artifacts` (a local store, an `mlflow server`
  proxying its artifacts, S3, ...);
- the local DVC cache: the objects that only removed versions use, read from the `dvc.lock`
  logged with each version (`lineage/<logged model id>/dvc.lock`, `registry.registration`). An
  object that the current `dvc.lock`, a `.dvc` file of the workspace or a kept version names
  is never removed, nor is one whose users are unknown. DVC has no command that removes chosen
  objects (`dvc gc` keeps only what git revisions use), so the files are deleted from the cache
  folder DVC names. When a DVC remote is configured, `dvc push` runs first (and the removed
  versions' objects are pushed too, when no earlier night did), and only objects the remote then
  holds are removed: a failed push removes nothing from the cache;
- the default DVC remote, only with `retention.prune_remote` (off by default: the remote keeps
  every version, the copy `dvc pull` rebuilds a removed version from): after the cache actions,
  the same objects, those only removed versions use, once the local cache no longer holds them
  (removed from it by this run or an earlier one; one the cache still holds, its push having
  failed, stays on the remote too). Beyond the cache's rules, an object that the `dvc.lock` or a
  `.dvc` file of a git branch head, tag or saved DVC experiment names stays (a teammate's branch,
  a tagged release, an overrides run saved by `dvc exp save` until `dvc exp remove`: what
  `git checkout` (`dvc exp apply`) + `dvc pull` of a ref needs; a ref's folder whose file list
  is neither in the cache nor on the remote cannot be pulled from it anyway: only its listing is
  spared), and nothing goes when a kept version has no logged `dvc.lock` (what it uses is
  unknown) or git cannot be read. Folder listings are read from the cache, else the remote.
  Older commits of the history are not spared: a team that commits `dvc.lock` nightly names
  every version there, and sparing them would keep the remote growing with the nights; a git tag
  on a commit keeps it pullable. A pruned version is rebuilt by `git checkout` + `dvc repro`,
  no longer by `dvc pull`. Through the remote's object database (`repo.cloud`): DVC has no
  command that removes chosen objects (`dvc gc --cloud` keeps only what git revisions use). The
  remote is taken to be this project's: what another project or another registered model
  pushes to it is not seen;
- the search-index store (`registry.index_store`), by mark and sweep across runs: a chunk goes
  only when no remaining index reference names it now (the references of every logged model of
  the experiment whose `index/` folder stays: kept versions, versions not yet removed, models of
  other registered names or not registered yet; read again just before the chunks go) AND an
  earlier applied retention run, at least LISTING_MIN_AGE_S before, already found it named by
  none (its mark). Each applied run records its marks, the store's unreferenced chunks, for the
  next one (LISTING_FILE). Being merely old is not enough: a `register` may be re-using an old
  chunk right now (it is in the store, so it is not uploaded again) whose reference is not
  logged yet, while the version that named it is removed. The one assumption: a `register`
  finishes (logs its reference) within LISTING_MIN_AGE_S of reading the store. Then a chunk it
  re-uses or uploads is either named at the mark (not marked), or named by the time the sweep,
  hours later, reads the references. `index_store.collectable` states the rule and its limit.

Never removed: a version's registry entry, its run, params, metrics, tags and lineage (the
logged model's MLmodel, the logged `dvc.lock`), so `python -m registry compare` and the MLflow
UI still compare it and `git checkout` + `dvc pull` (or `dvc repro`; only `dvc repro` once
`prune_remote` took its objects from the remote) rebuilds it. A removed
version is tagged `retention.removed` (what went and why).

Killed midway is safe: the plan is written first, each action is recorded once done, and every
action is idempotent. The next run plans afresh (an alias may have moved meanwhile: the fresh
plan decides), which finishes whatever of the old plan the policy still removes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field

from clipms.schema import Section
from pipeline.params import load_section
from registry.gate import CHALLENGER, CHAMPION
from registry.versions import checkpoint_path

REMOVED_TAG = "retention.removed"  # on a version whose heavy artifacts are gone
# The dvc.lock a version was made with, logged by `register` in its run under
# lineage/<logged model id>/: which DVC cache objects it uses. Lineage: never removed.
LINEAGE_ARTIFACT = "lineage"
LOCK_NAME = "dvc.lock"
# A plan written and not yet applied to the end (a killed run), relative to the project root: the
# retain stage and `python -m registry retain` share it, so either finishes the other's. Not a DVC
# out (DVC would delete it before the stage runs).
PLAN_FILE = Path("models/retention-plan.json")
# The search-index store's marks, {store run id: {"listed_at", "unreferenced"}}: the chunks the
# store held and no remaining reference named when an applied run (never a dry run) listed it,
# written beside the plan. The next run removes only marked chunks still named by no reference.
# A record without "unreferenced" (written before marks, {"listed_at", "chunks"}) has no marks:
# that run removes no chunk and records its own.
LISTING_FILE = Path("models/index-store-listing.json")
# How old the marks must be before marked chunks go: longer than any `register` takes from
# reading the store to logging its reference (minutes; an hour or two for the largest index over
# a slow link), shorter than a night, so each night removes what the one before marked. A run
# sooner (a second `retain` by hand) removes no chunk and keeps the older marks.
LISTING_MIN_AGE_S = 6 * 3600
# A run's plots (stages train and evaluate log them there): its pictures are heavy and redrawn by
# every run, the CSVs beside them are the data they draw and stay.
PLOTS_ARTIFACT = "plots"
PICTURE_SUFFIXES = (".png", ".svg", ".jpg", ".jpeg", ".html")
_NOT_KEPT = ("0", "false", "no")  # keep_tag values that do not keep a version


class RetentionParams(Section):
    """The `retention` section of params.yaml."""

    enabled: bool = True  # false: the stage and the command remove nothing (and say so)
    keep_last: int = Field(3, ge=0)  # the newest N versions are kept whole
    keep_tag: str = Field("keep", pattern=r"^[A-Za-z0-9_.-]+$")  # a version tag that keeps it
    dry_run: bool = False  # true: plan and report, remove nothing
    # true: the removed versions' DVC objects leave the default DVC remote too (after the cache);
    # such a version is then rebuilt only by `dvc repro`. Strict: an exact true or false.
    prune_remote: bool = Field(False, strict=True)


def retention_params(params_file: Path | str) -> RetentionParams:
    """The validated `retention` section of params.yaml (ParamsError if invalid)."""
    return load_section("retention", RetentionParams, params_file)


class RetentionError(RuntimeError):
    """Retention could not read what it needs to decide (the registry, a lock): nothing of the
    decision's removals was made."""


# ---------------------------------------------------------------- the policy (pure)


@dataclass(frozen=True)
class VersionState:
    """A registered version as the policy sees it."""

    number: int
    aliases: tuple[str, ...] = ()
    tags: Mapping[str, str] = field(default_factory=dict)
    run_id: str | None = None
    model_id: str | None = None


@dataclass(frozen=True)
class Selection:
    keep: dict[int, str]  # version -> why it is kept
    remove: dict[int, str]  # version -> why its heavy files go


def tagged_to_keep(version: VersionState, keep_tag: str) -> bool:
    value = version.tags.get(keep_tag)
    return value is not None and value.strip().lower() not in _NOT_KEPT


def choose(versions: Sequence[VersionState], params: RetentionParams) -> Selection:
    """Which versions are kept whole and which lose their heavy files, each with its reason."""
    newest = sorted((v.number for v in versions), reverse=True)[:params.keep_last]
    keep: dict[int, str] = {}
    remove: dict[int, str] = {}
    for version in sorted(versions, key=lambda v: v.number):
        reasons = [f"alias {a}" for a in (CHAMPION, CHALLENGER) if a in version.aliases]
        if version.number in newest:
            reasons.append(f"one of the newest {params.keep_last}")
        if tagged_to_keep(version, params.keep_tag):
            reasons.append(f"tagged {params.keep_tag}")
        if reasons:
            keep[version.number] = ", ".join(reasons)
        else:
            remove[version.number] = (f"older than the newest {params.keep_last}, neither "
                                      f"champion nor challenger, not tagged {params.keep_tag}")
    return Selection(keep, remove)


# ---------------------------------------------------------------- DVC objects (pure)


def uncached_outs(pipeline_text: str) -> set[str]:
    """The out paths a dvc.yaml declares `cache: false` (dvc.lock records their hashes but does
    not say so; DVC keeps no object of theirs)."""
    data = yaml.safe_load(pipeline_text) or {}
    found = set()
    for stage in (data.get("stages") or {}).values():
        for kind in ("outs", "metrics", "plots"):
            for entry in stage.get(kind) or []:
                if isinstance(entry, dict):
                    found |= {str(path) for path, flags in entry.items()
                              if isinstance(flags, dict) and flags.get("cache") is False}
    return found


def lock_outs(lock_text: str, uncached: Iterable[str] = ()) -> list[tuple[str, str, bool]]:
    """(path, md5, legacy) of every cached out in a dvc.lock or .dvc file's text (`uncached`:
    the paths that are not). `legacy`: a DVC 2 hash (no `hash: md5` field), kept in DVC's other
    cache folder."""
    data = yaml.safe_load(lock_text) or {}
    outs = [out for stage in (data.get("stages") or {}).values() for out in stage.get("outs", [])]
    outs += data.get("outs") or []  # a .dvc file
    skip = set(uncached)
    return [(str(out["path"]), str(out["md5"]), out.get("hash") != "md5") for out in outs
            if out.get("md5") and out.get("cache", True) and str(out["path"]) not in skip]


Listing = Callable[[str, bool], "list[tuple[str, str]] | None"]


def objects(lock_text: str, listing: Listing, uncached: Iterable[str] = (),
            ) -> tuple[dict[tuple[str, bool], str], list[str]]:
    """The cache objects a lock names, {(md5, legacy): a path that uses it}, with each folder's
    files (its `.dir` object listed by `listing`, None when not in the cache); and the paths of
    folders whose listing could not be read. `uncached`: out paths DVC does not cache."""
    found: dict[tuple[str, bool], str] = {}
    unreadable = []
    for path, md5, legacy in lock_outs(lock_text, uncached):
        found.setdefault((md5, legacy), path)
        if md5.endswith(".dir"):
            entries = listing(md5, legacy)
            if entries is None:
                unreadable.append(path)
                continue
            for relpath, child in entries:
                found.setdefault((child, legacy), f"{path}/{relpath}")
    return found, unreadable


# ---------------------------------------------------------------- the plan


@dataclass
class Action:
    kind: str  # "mlflow" | "index-chunk" | "dvc-cache" | "dvc-remote"
    # mlflow, index-chunk: the artifact repository URI; dvc-cache, dvc-remote: "md5" or
    # "md5 (legacy)"
    target: str
    # mlflow, index-chunk: the artifact path removed; dvc-cache, dvc-remote: a path of a removed
    # version
    path: str
    versions: list[int]
    bytes: int
    reason: str

    @property
    def key(self) -> str:
        dvc = self.kind in ("dvc-cache", "dvc-remote")
        return f"{self.kind} {self.target} {'' if dvc else self.path}".strip()


@dataclass
class Plan:
    model_name: str
    params: dict[str, Any]
    keep: dict[int, str]
    remove: dict[int, str]
    actions: list[Action] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    remote: str | None = None  # the DVC remote pushed to before the cache actions
    untagged: list[int] = field(default_factory=list)  # removed versions not tagged so yet
    # the index store's marks this run records once applied (LISTING_FILE)
    listings: dict[str, dict[str, Any]] = field(default_factory=dict)
    store_experiments: list[str] = field(default_factory=list)  # whose store runs were read
    created: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def render(plan: Plan, dry_run: bool) -> str:
    """The plan for a person: each version kept or not and why, then every removal and why."""
    lines = [f"retention of '{plan.model_name}' (keep_last {plan.params['keep_last']}, "
             f"keep_tag {plan.params['keep_tag']!r}): {len(plan.keep)} kept, "
             f"{len(plan.remove)} older"]
    versions = sorted({*plan.keep, *plan.remove})
    for number in versions:
        kept = number in plan.keep
        lines.append(f"  v{number}: {'keep' if kept else 'remove heavy files'} "
                     f"({plan.keep[number] if kept else plan.remove[number]})")
    verb = "would remove" if dry_run else "removes"
    total = sum(a.bytes for a in plan.actions)
    lines.append(f"{verb} {len(plan.actions)} item(s), {total / 1e6:.1f} MB:")
    for action in plan.actions:
        where = {"mlflow": f"MLflow {action.path}",
                 "index-chunk": f"index store {action.path}",
                 "dvc-remote": f"DVC remote '{plan.remote}' {action.target} ({action.path})"}.get(
                     action.kind, f"DVC cache {action.target} ({action.path})")
        users = ", ".join(f"v{v}" for v in action.versions) or "no remaining version"
        lines.append(f"  {where}, {action.bytes / 1e6:.2f} MB, of {users}: {action.reason}")
    lines += [f"note: {note}" for note in plan.notes]
    if dry_run:
        lines.append("dry run: nothing was removed")
    return "\n".join(lines)


# ---------------------------------------------------------------- MLflow


def registered_versions(mlflow_client: Any, name: str) -> list[VersionState]:
    """Every version of `name` with its aliases and tags ([] when it is not registered)."""
    from mlflow.exceptions import MlflowException

    from registry.versions import logged_model_id

    try:
        aliases = mlflow_client.get_registered_model(name).aliases or {}
    except MlflowException as err:
        if err.error_code == "RESOURCE_DOES_NOT_EXIST":
            return []
        raise
    by_version: dict[str, list[str]] = {}
    for alias, number in aliases.items():
        by_version.setdefault(str(number), []).append(alias)
    return [VersionState(int(v.version), tuple(sorted(by_version.get(str(v.version), []))),
                         dict(v.tags or {}), v.run_id or None, logged_model_id(v))
            for v in mlflow_client.search_model_versions(f"name = '{name}'")]


def _repo(uri: str, tracking_uri: str) -> Any:
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    return get_artifact_repository(uri, tracking_uri=tracking_uri)


def _size(repo: Any, path: str) -> int | None:
    """The bytes under `path` of an artifact repository, None when nothing is there."""
    items = repo.list_artifacts(path)
    if not items:
        return None
    total = 0
    for item in items:
        total += (_size(repo, item.path) or 0) if item.is_dir else (item.file_size or 0)
    return total


def plot_pictures(repo: Any, folder: str = PLOTS_ARTIFACT) -> list[tuple[str, int]]:
    """(path, bytes) of the pictures a run logged under `folder` (its sub-folders too)."""
    found = []
    for item in repo.list_artifacts(folder):
        if item.is_dir:
            found += plot_pictures(repo, item.path)
        elif Path(item.path).suffix.lower() in PICTURE_SUFFIXES:
            found.append((item.path, item.file_size or 0))
    return found


def heavy_artifacts(mlflow_client: Any, version: VersionState,
                    pictures: bool = True) -> list[tuple[str, str, int]]:
    """(repository URI, path, bytes) of the version's heavy artifacts still in the store;
    `pictures` False: not its run's plot pictures (a kept version shares the run)."""
    uri = mlflow_client.tracking_uri
    found = []
    if version.run_id and version.model_id:
        run_root = mlflow_client.get_run(version.run_id).info.artifact_uri
        repo = _repo(run_root, uri)
        where = checkpoint_path(version.model_id)
        size = _size(repo, where)
        if size is not None:
            found.append((run_root, where, size))
        if pictures:
            found += [(run_root, path, size) for path, size in plot_pictures(repo)]
    if version.model_id:  # its folders: the bundle (`artifacts/`), the index, the code copy
        model_root = mlflow_client.get_logged_model(version.model_id).artifact_location
        repo = _repo(model_root, uri)
        for item in repo.list_artifacts():
            size = _size(repo, item.path) if item.is_dir else None
            if size is not None:
                found.append((model_root, item.path, size))
    return found


def version_lock(mlflow_client: Any, version: VersionState, scratch: Path) -> str | None:
    """The dvc.lock logged with the version, None when none was (registered before)."""
    if not (version.run_id and version.model_id):
        return None
    where = f"{LINEAGE_ARTIFACT}/{version.model_id}"
    run_root = mlflow_client.get_run(version.run_id).info.artifact_uri
    repo = _repo(run_root, mlflow_client.tracking_uri)
    if not any(Path(i.path).name == LOCK_NAME for i in repo.list_artifacts(where)):
        return None
    dst = scratch / f"v{version.number}"
    dst.mkdir(parents=True, exist_ok=True)
    return Path(repo.download_artifacts(f"{where}/{LOCK_NAME}", str(dst))).read_text()


# ---------------------------------------------------------------- the search-index store


def read_listings(path: Path) -> dict[str, Any]:
    """The marks an earlier run recorded ({} when none, or unreadable: then no chunk goes this
    time, and this run's marks replace them)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@dataclass(frozen=True)
class EarlierListing:
    chunks: set[str] | None  # the chunks marked unreferenced; None: no chunk goes this time
    about: str  # which run marked them, or why no chunk goes
    young: bool = False  # too young to use: they stay the marks the next run reads


def earlier_listing(listings: Mapping[str, Any], run_id: str, now: float) -> EarlierListing:
    """The chunks an earlier run marked unreferenced in the store run, when that run is old
    enough (LISTING_MIN_AGE_S). A record of the store's listing without marks (written before
    them) marks nothing."""
    entry = listings.get(run_id)
    try:
        listed_at = float(entry["listed_at"])
        marked = {str(c) for c in entry["unreferenced"]}
    except (TypeError, KeyError, ValueError):
        old = isinstance(entry, dict) and "chunks" in entry and "unreferenced" not in entry
        return EarlierListing(None, "no search-index chunk removed: "
                              + ("the earlier retention run recorded the store's listing "
                                 "without marks (unreferenced chunks)" if old else
                                 "no earlier retention run marked the search-index store's "
                                 "unreferenced chunks")
                              + ": this run marks them, they go from the next run on")
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(listed_at))
    if now - listed_at < LISTING_MIN_AGE_S:
        return EarlierListing(None, f"no search-index chunk removed: the store's marks by the "
                              f"retention run of {stamp} are under "
                              f"{LISTING_MIN_AGE_S / 3600:.0f} h old (a `register` may still "
                              "be logging a reference to a chunk they mark); a later run "
                              "removes them", True)
    return EarlierListing(marked, f"unreferenced at the retention run of {stamp} too")


@dataclass(frozen=True)
class ChunkSweep:
    removable: dict[str, int]  # {sha256: bytes} this run removes
    record: dict[str, Any] | None  # the marks this run leaves; None: the earlier ones stay
    about: str  # why they go, or why none does
    swept: bool = True  # False: no usable earlier marks, no chunk goes (`about` says why)


def sweep_chunks(held: Mapping[str, int], referenced: Iterable[str],
                 listings: Mapping[str, Any], run_id: str, now: float) -> ChunkSweep:
    """One store run's mark and sweep: of the chunks `held`, those to remove now (named by no
    remaining reference, `referenced`, and marked by an earlier run old enough) and this run's
    marks (stamped `now`: take it once the references are read)."""
    from registry import index_store

    named = set(referenced)
    earlier = earlier_listing(listings, run_id, now)
    record = None if earlier.young else {
        "listed_at": now, "unreferenced": sorted(d for d in held if d not in named)}
    if earlier.chunks is None:
        return ChunkSweep({}, record, earlier.about, swept=False)
    return ChunkSweep(index_store.collectable(held, named, earlier.chunks), record,
                      earlier.about)


def _read_ref(path: Path) -> set[str] | None:
    """The chunks a downloaded reference names, None when it is not a readable reference."""
    from registry import index_store

    try:
        ref = json.loads(path.read_text())
        if ref.get("format") != index_store.REF_FORMAT:
            return None
        return index_store.referenced_chunks(ref)
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return None


def index_references(mlflow_client: Any, experiment_id: str,
                     scratch: Path) -> dict[str, set[str] | None]:
    """{logged model id: the chunks its index reference names (None: unreadable)} of every logged
    model of the experiment whose index folder holds a reference: registered or not (a
    `register` between logging its model and registering the version), of any registered
    model."""
    from registry.index_store import INDEX_ARTIFACT, REF_FILE

    found: dict[str, set[str] | None] = {}
    token = None
    while True:
        page = mlflow_client.search_logged_models([experiment_id], max_results=100,
                                                  page_token=token)
        for model in page:
            repo = _repo(model.artifact_location, mlflow_client.tracking_uri)
            if not any(Path(i.path).name == REF_FILE
                       for i in repo.list_artifacts(INDEX_ARTIFACT)):
                continue
            dst = scratch / "refs" / model.model_id
            dst.mkdir(parents=True, exist_ok=True)
            local = repo.download_artifacts(f"{INDEX_ARTIFACT}/{REF_FILE}", str(dst))
            found[model.model_id] = _read_ref(Path(local))
        token = page.token
        if not token:
            return found


def index_chunk_actions(mlflow_client: Any, versions: Sequence[VersionState], plan: Plan,
                        scratch: Path, listings: Mapping[str, Any]) -> list[Action]:
    """The search-index chunks to remove (`sweep_chunks`, `index_store.collectable`): in the store
    run of each experiment the versions were logged in, those no logged model's reference names
    once the plan's index folders are gone, and that the earlier run's marks hold. Records in
    `plan.listings` this run's marks (unless the earlier ones are too young to use, or a
    reference cannot be read)."""
    from registry import index_store
    from registry.index_store import INDEX_ARTIFACT

    by_number = {v.number: v for v in versions}
    going = {by_number[a.versions[0]].model_id: a.versions[0] for a in plan.actions
             if a.kind == "mlflow" and a.path == INDEX_ARTIFACT}
    experiments = sorted({mlflow_client.get_run(v.run_id).info.experiment_id
                          for v in versions if v.run_id})
    actions = []
    for experiment_id in experiments:
        run_id = index_store.find_store_run(mlflow_client, experiment_id)
        if run_id is None:
            continue
        held = index_store.held_chunks(mlflow_client, run_id)
        plan.store_experiments.append(experiment_id)
        refs = index_references(mlflow_client, experiment_id, scratch)
        unreadable = sorted(m for m, chunks in refs.items() if chunks is None)
        if unreadable:  # which chunks it names is unknown: no marks, nothing removed
            plan.notes.append(f"no search-index chunk removed: the index reference of logged "
                              f"model {unreadable[0]} cannot be read, so which chunks it needs "
                              "is unknown")
            continue
        referenced = {d for m, chunks in refs.items() if m not in going for d in chunks or ()}
        # stamped once the references are read: a reference logged later marks its chunks
        sweep = sweep_chunks(held, referenced, listings, run_id, time.time())
        if sweep.record is not None:
            plan.listings[run_id] = sweep.record
        if not sweep.swept:
            plan.notes.append(sweep.about)
        users: dict[str, list[int]] = {}
        for model_id, number in going.items():
            for digest in refs.get(model_id) or ():
                users.setdefault(digest, []).append(number)
        root = mlflow_client.get_run(run_id).info.artifact_uri
        for digest, size in sweep.removable.items():
            actions.append(Action("index-chunk", root, f"{index_store.CHUNKS}/{digest}",
                                  sorted(users.get(digest, [])), size,
                                  f"named by no remaining index reference, {sweep.about}"))
    return actions


def _named_now(mlflow_client: Any, plan: Plan) -> set[str] | None:
    """The chunks the logged models' references name now (None: one cannot be read)."""
    import tempfile

    if not any(a.kind == "index-chunk" for a in plan.actions):
        return set()
    named: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="retain-refs-") as scratch:
        for experiment_id in plan.store_experiments:
            for chunks in index_references(mlflow_client, experiment_id, Path(scratch)).values():
                if chunks is None:
                    return None
                named |= chunks
    return named


def _save_listings(path: Path, listings: Mapping[str, Any]) -> None:
    """This run's marks of the index store over the earlier ones (for the next run)."""
    from clipms.utils.atomic import write_text

    if listings:
        merged = {**read_listings(path), **listings}
        write_text(path, json.dumps(merged, indent=1, sort_keys=True), durable=True)


# ---------------------------------------------------------------- DVC


class DvcCache:
    """The project's DVC caches (DVC 3's and DVC 2's), its default remote, `dvc push`."""

    def __init__(self, root: Path) -> None:
        from dvc.repo import Repo

        self.root = root
        self.repo = Repo(str(root))
        self.remote: str | None = self.repo.config["core"].get("remote") or None
        pipeline = root / "dvc.yaml"  # today's declaration of which outs are not cached
        self.uncached = uncached_outs(pipeline.read_text()) if pipeline.is_file() else set()
        self._remote_listings: dict[tuple[str, bool], list[tuple[str, str]] | None] = {}

    def odb(self, legacy: bool) -> Any:
        return self.repo.cache.legacy if legacy else self.repo.cache.local

    def path(self, md5: str, legacy: bool) -> Path:
        return Path(self.odb(legacy).oid_to_path(md5))

    def listing(self, md5: str, legacy: bool) -> list[tuple[str, str]] | None:
        path = self.path(md5, legacy)
        try:
            return [(e["relpath"], e["md5"]) for e in json.loads(path.read_text())]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def workspace_files(self) -> list[str]:
        """The texts of dvc.lock and every .dvc file git sees in the workspace."""
        proc = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                               "--exclude-standard", "--", "*.dvc"], cwd=self.root,
                              capture_output=True, text=True, timeout=60)
        names = [n for n in proc.stdout.split("\0") if n] if proc.returncode == 0 else []
        texts = [(self.root / n).read_text() for n in names if (self.root / n).is_file()]
        lock = self.root / LOCK_NAME
        return [lock.read_text(), *texts] if lock.is_file() else texts

    def push(self) -> str | None:
        """`dvc push` to the default remote; the error's text, None on success."""
        proc = subprocess.run([sys.executable, "-m", "dvc", "push"], cwd=self.root,
                              capture_output=True, text=True, timeout=6 * 3600)
        if proc.returncode == 0:
            return None
        return (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1][:300]

    def push_objects(self, oids: Iterable[tuple[str, bool]]) -> None:
        """Push these objects of the cache to the default remote (`dvc push` sends only what the
        workspace uses: an older version's objects reach the remote here, when no earlier night
        pushed them). A failure shows in `on_remote` afterwards."""
        from dvc_data.hashfile.hash_info import HashInfo

        infos = [HashInfo("md5-dos2unix" if legacy else "md5", md5) for md5, legacy in oids]
        if infos:
            self.repo.cloud.push(infos, remote=self.remote)

    def remote_odb(self, legacy: bool) -> Any:
        """The default remote's object database (DVC 3's or DVC 2's layout)."""
        return self.repo.cloud.get_remote_odb(self.remote, "push",
                                              hash_name="md5-dos2unix" if legacy else "md5")

    def on_remote(self, oids: Iterable[tuple[str, bool]]) -> set[tuple[str, bool]]:
        present: set[tuple[str, bool]] = set()
        for legacy in (False, True):
            chosen = [md5 for md5, leg in oids if leg == legacy]
            if chosen:
                odb = self.remote_odb(legacy)
                present |= {(md5, legacy) for md5 in odb.oids_exist(chosen)}
        return present

    def remote_sizes(self, oids: Iterable[tuple[str, bool]]) -> dict[tuple[str, bool], int]:
        """The bytes of each of these objects the default remote holds."""
        sizes = {}
        for md5, legacy in sorted(self.on_remote(list(oids))):
            odb = self.remote_odb(legacy)
            sizes[(md5, legacy)] = int(odb.fs.size(odb.oid_to_path(md5)))
        return sizes

    def remove_from_remote(self, md5: str, legacy: bool) -> None:
        """Delete one object from the default remote (nothing when it is gone already)."""
        odb = self.remote_odb(legacy)
        if odb.exists(md5):
            odb.delete(md5)

    def any_listing(self, md5: str, legacy: bool) -> list[tuple[str, str]] | None:
        """A folder's file list from the local cache, else from the default remote (a folder
        whose `.dir` object left the cache: a removed version's, a teammate's branch's)."""
        found = self.listing(md5, legacy)
        if found is not None or not self.remote:
            return found
        if (md5, legacy) not in self._remote_listings:  # refs and versions share folders
            odb = self.remote_odb(legacy)
            try:
                entries = json.loads(odb.fs.cat_file(odb.oid_to_path(md5)))
                found = [(e["relpath"], e["md5"]) for e in entries]
            except (OSError, ValueError, KeyError, TypeError):
                found = None
            self._remote_listings[(md5, legacy)] = found
        return self._remote_listings[(md5, legacy)]

    def ref_files(self) -> list[str] | None:
        """The texts of the `dvc.lock` and `.dvc` files at every git branch head (local and
        remote-tracking), tag and saved DVC experiment (`refs/exps`, `dvc exp save`: what a flow
        run with overrides records); [] outside a git repository, None when git fails."""
        def git(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(["git", *args], cwd=self.root, capture_output=True,
                                  text=True, timeout=300)

        if git("rev-parse", "--git-dir").returncode != 0:
            return []
        refs = git("for-each-ref", "--format=%(*objectname) %(objectname)", "refs/heads",
                   "refs/remotes", "refs/tags", "refs/exps")
        if refs.returncode != 0:
            return None
        commits = sorted({line.split()[0] for line in refs.stdout.splitlines() if line.strip()})
        texts = []
        for commit in commits:
            tree = git("ls-tree", "-r", "-z", "--name-only", commit)
            if tree.returncode != 0:
                return None
            for name in tree.stdout.split("\0"):
                if Path(name).name == LOCK_NAME or name.endswith(".dvc"):
                    shown = git("show", f"{commit}:{name}")
                    if shown.returncode != 0:
                        return None
                    texts.append(shown.stdout)
        return texts


def exclusive_objects(locks: Mapping[int, str | None], selection: Selection,
                      protecting: Iterable[str], listing: Listing, uncached: Iterable[str],
                      ) -> tuple[dict[tuple[str, bool], tuple[list[int], str]], str | None]:
    """The objects the removed versions' locks name and no protecting text (a lock, a .dvc
    file) does: {(md5, legacy): (the removed versions using it, a path of one)}; or ({}, the
    path of a protecting folder whose file list `listing` cannot read: which objects it uses is
    unknown, so none is exclusive)."""
    protected: set[tuple[str, bool]] = set()
    for text in protecting:
        found, unreadable = objects(text, listing, uncached)
        if unreadable:
            return {}, unreadable[0]
        protected |= set(found)
    exclusive: dict[tuple[str, bool], tuple[list[int], str]] = {}
    for number in sorted(selection.remove):
        text = locks.get(number)
        if not text:
            continue
        found, _ = objects(text, listing, uncached)
        for oid, path in found.items():
            if oid not in protected:
                exclusive.setdefault(oid, ([], path))[0].append(number)
    return exclusive, None


def cache_actions(locks: Mapping[int, str | None], selection: Selection, cache: DvcCache,
                  notes: list[str]) -> list[Action]:
    """The DVC cache objects only removed versions use and the local cache holds. Nothing when a
    folder a kept version or the workspace uses cannot be listed (its files are unknown)."""
    protecting = [*cache.workspace_files(),
                  *(t for v, t in locks.items() if v in selection.keep and t)]
    exclusive, unreadable = exclusive_objects(locks, selection, protecting, cache.listing,
                                              cache.uncached)
    if unreadable:
        notes.append(f"nothing removed from the DVC cache: the file list of {unreadable} "
                     "(a folder the workspace or a kept version uses) is not in the cache, "
                     "so which objects it uses is unknown (`dvc fetch` restores it)")
        return []
    actions = []
    for (md5, legacy), (numbers, where) in sorted(exclusive.items()):
        path = cache.path(md5, legacy)
        if path.is_file():
            actions.append(Action("dvc-cache", md5 + (" (legacy)" if legacy else ""),
                                  where, numbers, path.stat().st_size,
                                  "used by no kept version and not by the workspace"))
    return actions


REMOTE_REASON = ("used only by removed versions: by no kept version, not by the workspace nor a "
                 "git branch, tag or saved experiment (retention.prune_remote)")


def remote_actions(locks: Mapping[int, str | None], selection: Selection, cache: DvcCache,
                   notes: list[str]) -> list[Action]:
    """With `prune_remote`: the objects of the default DVC remote only removed versions use
    (the cache's rule, and no git branch head or tag names them), folders' `.dir` objects last
    (a run killed midway still finds a removed folder's file list). Nothing when what a kept
    version, the workspace or a ref uses is unknown."""
    def nothing(why: str) -> list[Action]:
        notes.append(f"nothing removed from DVC remote '{cache.remote}': {why}")
        return []

    unknown = sorted(n for n in selection.keep if not locks.get(n))
    if unknown:
        return nothing(f"v{unknown[0]}, kept, has no dvc.lock logged with it (registered before "
                       "retention), so which objects it uses is unknown")
    refs = cache.ref_files()
    if refs is None:
        return nothing("the dvc.lock and .dvc files of the git branches and tags cannot be read")
    try:
        protecting = [*cache.workspace_files(),
                      *(t for v, t in locks.items() if v in selection.keep and t)]
        exclusive, unreadable = exclusive_objects(locks, selection, protecting,
                                                  cache.any_listing, cache.uncached)
        if unreadable:
            return nothing(f"the file list of {unreadable} (a folder the workspace or a kept "
                           "version uses) is neither in the cache nor on the remote, so which "
                           "objects it uses is unknown")
        # What a ref's `git checkout` + `dvc pull` needs. A folder whose file list is on neither
        # cannot be pulled from the remote whatever goes: only its listing object is spared.
        unlisted: list[str] = []
        for text in refs:
            found, missing = objects(text, cache.any_listing, cache.uncached)
            unlisted += missing
            for oid in found:
                exclusive.pop(oid, None)
        if unlisted:
            notes.append(f"{len(unlisted)} folder(s) git refs name ({unlisted[0]}, "
                         "...) have their file list neither in the DVC cache nor on remote "
                         f"'{cache.remote}': they cannot be pulled from it, only their listing "
                         "objects are spared")
        sizes = cache.remote_sizes(exclusive)
    except Exception as err:  # unreachable, version-aware (no objects by hash): prune nothing
        return nothing(f"it cannot be read ({type(err).__name__}: {str(err).strip()[:200]})")
    order = sorted(sizes, key=lambda oid: (oid[0].endswith(".dir"), oid))
    return [Action("dvc-remote", md5 + (" (legacy)" if legacy else ""),
                   exclusive[(md5, legacy)][1], exclusive[(md5, legacy)][0],
                   sizes[(md5, legacy)], REMOTE_REASON) for md5, legacy in order]


# ---------------------------------------------------------------- planning and applying


def make_plan(mlflow_client: Any, model_name: str, params: RetentionParams, root: Path,
              scratch: Path, dvc_cache: bool = True) -> tuple[Plan, DvcCache | None]:
    """What the policy removes now (nothing is removed here); `dvc_cache` False: nothing of the
    DVC cache."""
    versions = registered_versions(mlflow_client, model_name)
    selection = choose(versions, params)
    plan = Plan(model_name, params.model_dump(), selection.keep, selection.remove)
    by_number = {v.number: v for v in versions}
    kept_runs = {by_number[n].run_id for n in selection.keep if by_number[n].run_id}
    for number, reason in selection.remove.items():
        version = by_number[number]
        if version.tags.get(REMOVED_TAG):
            continue  # done on an earlier run (the tag is set last)
        plan.untagged.append(number)
        for repo_uri, path, size in heavy_artifacts(mlflow_client, version,
                                                    version.run_id not in kept_runs):
            plan.actions.append(Action("mlflow", repo_uri, path, [number], size, reason))
    plan.actions += index_chunk_actions(mlflow_client, versions, plan, scratch,
                                        read_listings(root / LISTING_FILE))
    locks = {v.number: version_lock(mlflow_client, v, scratch) for v in versions}
    unknown = sorted(n for n in selection.remove if not locks[n])
    if unknown:
        plan.notes.append(f"{', '.join(f'v{n}' for n in unknown)}: no dvc.lock logged with "
                          "it (registered before retention), its DVC cache objects stay")
    if not (root / ".dvc").is_dir() or not dvc_cache:
        plan.notes.append(f"the DVC cache is left alone ({root.resolve()} is "
                          f"{'not a DVC project' if dvc_cache else 'a temporary copy'})")
        return plan, None
    cache = DvcCache(root)
    plan.remote = cache.remote
    plan.actions += cache_actions(locks, selection, cache, plan.notes)
    if plan.remote:
        plan.notes.append(f"DVC cache objects are removed only after `dvc push` to remote "
                          f"'{plan.remote}' succeeds, and only those the remote holds")
    if params.prune_remote and not plan.remote:
        plan.notes.append("retention.prune_remote is true but no default DVC remote is "
                          "configured: no remote to prune")
    elif params.prune_remote:
        plan.actions += remote_actions(locks, selection, cache, plan.notes)
        plan.notes.append(f"DVC remote objects are removed only once the local cache no longer "
                          f"holds them (retention.prune_remote): a version they leave "
                          f"'{plan.remote}' with is rebuilt by `dvc repro`, not `dvc pull`")
    return plan, cache


def _record_done(progress: Path, key: str) -> None:
    with progress.open("a") as out:
        out.write(key + "\n")
        out.flush()
        os.fsync(out.fileno())


def apply_plan(mlflow_client: Any, plan: Plan, cache: DvcCache | None, plan_file: Path,
               on_line: Callable[[str], None] = print,
               listing_file: Path | None = None) -> dict[str, Any]:
    """Remove what the plan says (each action recorded as done), tag the versions done, record
    the index store's marks (in `listing_file`, default LISTING_FILE beside the plan file); the
    plan file is removed at the end. Returns the counts of what went."""
    from clipms.utils.atomic import write_text

    progress = plan_file.with_name(plan_file.name + ".done")
    write_text(plan_file, json.dumps(plan.to_json(), indent=1), durable=True)
    done = set(progress.read_text().split("\n")) if progress.exists() else set()
    freed = {"mlflow": [0, 0], "index-chunk": [0, 0], "dvc-cache": [0, 0]}  # [items, bytes]
    for action in (a for a in plan.actions if a.kind == "mlflow"):
        if action.key not in done:
            _repo(action.target, mlflow_client.tracking_uri).delete_artifacts(action.path)
            _record_done(progress, action.key)
        freed["mlflow"][0] += 1
        freed["mlflow"][1] += action.bytes
    for number in plan.untagged:  # last: a tagged version's artifacts are all gone
        mlflow_client.set_model_version_tag(plan.model_name, str(number), REMOVED_TAG,
                                            f"checkpoint, bundle, index and plot pictures "
                                            f"removed by retention ({plan.remove[number]})")
    # After the index folders (a chunk goes only once no reference of the plan can need it), and
    # only chunks still named by no reference now: a `register` since the plan may have logged
    # one naming a chunk it found in the store (it uploads only what the store lacks).
    named_now = _named_now(mlflow_client, plan)
    if named_now is None:
        plan.notes.append("no search-index chunk removed: an index reference logged since the "
                          "plan cannot be read")
        on_line(f"retain: {plan.notes[-1]}")
    for action in (a for a in plan.actions if a.kind == "index-chunk"):
        if named_now is None or Path(action.path).name in named_now:
            continue
        if action.key not in done:
            _repo(action.target, mlflow_client.tracking_uri).delete_artifacts(action.path)
            _record_done(progress, action.key)
        freed["index-chunk"][0] += 1
        freed["index-chunk"][1] += action.bytes
    _save_listings(listing_file or plan_file.with_name(LISTING_FILE.name), plan.listings)
    cache_done = _apply_cache(plan, cache, progress, done, on_line)
    freed["dvc-cache"] = cache_done
    freed["dvc-remote"] = _apply_remote(plan, cache, progress, done, on_line)
    plan_file.unlink(missing_ok=True)
    progress.unlink(missing_ok=True)
    return {"mlflow_artifacts": freed["mlflow"][0], "mlflow_bytes": freed["mlflow"][1],
            "index_chunks": freed["index-chunk"][0], "index_chunk_bytes": freed["index-chunk"][1],
            "dvc_cache_objects": freed["dvc-cache"][0], "dvc_cache_bytes": freed["dvc-cache"][1],
            "dvc_remote_objects": freed["dvc-remote"][0],
            "dvc_remote_bytes": freed["dvc-remote"][1]}


def _apply_cache(plan: Plan, cache: DvcCache | None, progress: Path, done: set[str],
                 on_line: Callable[[str], None]) -> list[int]:
    actions = [a for a in plan.actions if a.kind == "dvc-cache"]
    if not actions or cache is None:
        return [0, 0]
    oids = [(a.target.split()[0], a.target.endswith("(legacy)")) for a in actions]
    if cache.remote:
        error = cache.push()
        if error is not None:  # fail closed: an object not pushed may exist nowhere else
            plan.notes.append(f"`dvc push` to '{cache.remote}' failed ({error}): nothing was "
                              "removed from the DVC cache")
            on_line(f"retain: {plan.notes[-1]}")
            return [0, 0]
        held = cache.on_remote(oids)
        try:
            cache.push_objects([oid for oid in oids if oid not in held])
        except Exception as err:  # what the remote holds decides, just below
            on_line(f"retain: pushing older versions' objects failed ({err})")
        held = cache.on_remote(oids)
        missing = [oid for oid in oids if oid not in held]
        if missing:
            plan.notes.append(f"{len(missing)} DVC cache object(s) of removed versions are not "
                              f"on remote '{cache.remote}' and stay in the cache")
    else:
        held = set(oids)
    count, size = 0, 0
    for action, oid in zip(actions, oids, strict=True):
        if oid not in held:
            continue
        if action.key not in done:
            cache.path(*oid).unlink(missing_ok=True)
            _record_done(progress, action.key)
        count, size = count + 1, size + action.bytes
    return [count, size]


def _apply_remote(plan: Plan, cache: DvcCache | None, progress: Path, done: set[str],
                  on_line: Callable[[str], None]) -> list[int]:
    """After the cache actions: delete from the remote the planned objects the local cache no
    longer holds (one still there, its push failed or the remote lacked it, stays on both)."""
    actions = [a for a in plan.actions if a.kind == "dvc-remote"]
    if not actions or cache is None:
        return [0, 0]
    count, size, kept = 0, 0, 0
    for action in actions:
        oid = (action.target.split()[0], action.target.endswith("(legacy)"))
        if action.key not in done:
            if cache.path(*oid).is_file():
                kept += 1
                continue
            cache.remove_from_remote(*oid)
            _record_done(progress, action.key)
        count, size = count + 1, size + action.bytes
    if kept:
        plan.notes.append(f"{kept} object(s) of removed versions are still in the local DVC "
                          f"cache and stay on remote '{cache.remote}' too")
        on_line(f"retain: {plan.notes[-1]}")
    return [count, size]


def retain(mlflow_client: Any, model_name: str, params: RetentionParams, root: Path,
           dry_run: bool | None = None, dvc_cache: bool = True,
           on_line: Callable[[str], None] = print) -> dict[str, Any]:
    """Plan and (unless a dry run: `dry_run`, else the params') apply the policy in the project
    at `root` (its dvc.lock, DVC cache and plan file; `dvc_cache` False: not its cache); the
    report."""
    import tempfile

    plan_file = root / PLAN_FILE

    dry = params.dry_run if dry_run is None else dry_run
    report: dict[str, Any] = {"model_name": model_name, "enabled": params.enabled,
                              "dry_run": dry, "prune_remote": params.prune_remote}
    if not params.enabled:
        on_line("retain: retention.enabled is false: nothing removed")
        return report
    resumed = plan_file.exists()
    try:
        with tempfile.TemporaryDirectory(prefix="retain-") as scratch:
            plan, cache = make_plan(mlflow_client, model_name, params, root, Path(scratch),
                                    dvc_cache)
    except Exception as err:  # the registry or the lock could not be read: remove nothing
        raise RetentionError(f"retention could not plan ({type(err).__name__}: "
                             f"{str(err).strip()[:300]}); nothing was removed") from err
    if resumed and not dry:
        plan.notes.append("an earlier retention run stopped midway: its plan is finished "
                          "by this one (planned afresh)")
    on_line(render(plan, dry))
    report.update(kept={f"v{n}": r for n, r in plan.keep.items()},
                  removed={f"v{n}": r for n, r in plan.remove.items()},
                  planned_items=len(plan.actions),
                  planned_bytes=sum(a.bytes for a in plan.actions), remote=plan.remote,
                  resumed=resumed and not dry)
    try:
        if not dry:
            report.update(apply_plan(mlflow_client, plan, cache, plan_file, on_line,
                                     root / LISTING_FILE))
    except Exception as err:  # the plan file stays: the next run finishes it
        raise RetentionError(f"retention stopped midway ({type(err).__name__}: "
                             f"{str(err).strip()[:300]}); its plan is in {plan_file}, "
                             "the next run finishes it") from err
    finally:
        if cache is not None:
            cache.repo.close()
    report["notes"] = plan.notes
    return report

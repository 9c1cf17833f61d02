"""A month of nights, unattended: the nightly flow on a world that grows every night, with planted
failures, and what each night decided, took and cost in storage.

    python benchmarks/nights.py --nights 30 --out benchmarks/results/nights.json

The world is the tests' (harness/nightly_world.py): learnable pictures served over loopback HTTP
(harness/image_site.py) and a local parquet export listing more of them every night (`--growth`,
default 5 %, at least one picture). A fresh checkout of the project (harness/dvc_workspace.py: the
tiny model) runs the `clip-pipeline` flow as the nightly deployment does (`refresh: [metadata]`,
`train_without_new_data: false`), in this process, against a Prefect server of its own; MLflow is
the checkout's `mlflow.db`; a failure webhook on loopback counts the notices.

Planted nights (`--plant NIGHT:KIND,...`; the default plants each failure once, from night 4):
  broken_source    the export is truncated: not a parquet file any more
  no_new_rows      the export is not grown
  diverging        train.lr and train.warm_start.lr set to 1e30 for the night (normalised
                   features and a clamped logit scale keep the loss finite at merely huge rates)
  sigkill          the `python -m stages.train` process is killed (SIGKILL) 10 s into the stage
  registry_outage  MLFLOW_TRACKING_URI points at a closed loopback port for the night
  disk_full        the DVC cache moves to a tmpfs with 256 KB to spare (root: a real small file
                   system); without root, the night runs with RLIMIT_FSIZE of 256 KB instead (a
                   write past it fails with EFBIG: the closest real thing, and the record says so)
  poisoned         the export lists as many new pictures as it held, their captions shuffled
                   among them: every check of the data passes, and only the gate (on one
                   evaluation set, by `--margin`) can keep the model trained on it out

Nights here are minutes apart, so before each night the search-index store's marks that the
last `retain` recorded are made a day older, as a real night's gap does (retention removes a
chunk only when a run at least 6 hours earlier found it unreferenced too).

Per night it records: the outcome and decision (metrics/register.json written tonight, with the
two values compared and where each came from), the flow's headline, the champion before and
after, the pictures the site was asked for (and how many of them an earlier night had listed),
what `download` counted new and reused, the training steps, the notices sent, wall time by stage
(Prefect's task runs), storage by store (DVC cache, DVC remote, MLflow artifacts, download store,
mlflow.db, in bytes) and what retention removed (metrics/retain.json written tonight, when the
project has retention).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))

import record  # noqa: E402 - benchmarks/record.py
from storage_growth import age_index_listing  # noqa: E402 - benchmarks/storage_growth.py

FAILURES = ("broken_source", "no_new_rows", "diverging", "sigkill", "registry_outage", "disk_full")
KINDS = (*FAILURES, "poisoned")  # a poisoned night does not fail: the gate must hold
DEFAULT_PLAN = {4: "broken_source", 7: "no_new_rows", 10: "diverging", 13: "sigkill",
                16: "registry_outage", 19: "disk_full"}
MODEL = "clip-nights"
KILL_AFTER_S = 10.0
DIVERGING_LR = 1.0e30
DISK_SPARE_BYTES = 256 * 1024
STORES = {"dvc_cache": ".dvc/cache", "mlflow_artifacts": "mlartifacts",
          "download_store": "data/download", "mlflow_db": "mlflow.db"}


def grown(listed: int, start: int, growth: float, poisoned: bool = False) -> int:
    """How many pictures a night adds to the `listed` ones."""
    if not listed:
        return start
    return listed if poisoned else max(1, math.ceil(listed * growth))


def parse_plan(text: str) -> dict[int, str]:
    """"4:broken_source,7:no_new_rows" -> {4: ..., 7: ...}; unknown kinds are errors."""
    plan: dict[int, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        night, _, kind = item.partition(":")
        if kind not in KINDS or not night.isdigit():
            raise ValueError(f"bad plant '{item}': NIGHT:KIND with KIND one of {', '.join(KINDS)}")
        plan[int(night)] = kind
    return plan


def world_params(source: Path, steps: int, first_steps: int, margin: float) -> dict[str, Any]:
    """The checkout's params: the local growing export, a cold first night of `first_steps`,
    then warm starts of `steps` from the champion, which a challenger must beat by `margin`."""
    champion = f"models:/{MODEL}@champion"
    return {
        "metadata.source": "local", "metadata.path": str(source),
        "download.allow_private_addresses": True, "download.samples_per_shard": 16,
        "evaluate.zeroshot.source": "none", "changes.min_new": 4,
        "tokenizer.pin": champion, "train.init_from": champion,
        "train.max_steps": first_steps, "train.checkpoint_every": 100,
        "train.warm_start": {"max_steps": steps, "lr": 1.0e-3, "warmup_steps": 1},
        "export.batch_sizes": [1, 8], "register.model_name": MODEL,
        "register.primary_metric": "i2t_R@5", "register.margin": margin,
    }


def size_of(path: Path) -> int:
    """Bytes under `path` (a file or a folder), 0 when absent; hard links counted once."""
    if path.is_file():
        return path.stat().st_size
    seen: set[tuple[int, int]] = set()
    total = 0
    for item in path.rglob("*") if path.is_dir() else []:
        if item.is_file() and not item.is_symlink():
            stat = item.stat()
            if (stat.st_dev, stat.st_ino) not in seen:
                seen.add((stat.st_dev, stat.st_ino))
                total += stat.st_size
    return total


def tmpfs_bytes(path: Path) -> int:
    """What the files under `path` take on a tmpfs: each file whole pages (4 KiB), so a cache of
    many small files needs more than their byte count."""
    page = 4096
    return sum(math.ceil(f.stat().st_size / page) * page
               for f in path.rglob("*") if f.is_file() and not f.is_symlink())


@dataclass
class World:
    """The growing source, its site, the checkout, the Prefect server and the notice receiver."""

    root: Path
    steps: int
    first_steps: int
    margin: float
    start: int
    growth: float
    capacity: int
    listed: int = 0
    captions: Callable[[int], list[str]] | None = None  # None: each picture's own
    notes: list[str] = field(default_factory=list)
    stack: Any = None
    site: Any = None
    source: Any = None
    ws: Path = Path()
    remote: Path = Path()
    hook: Any = None
    exits: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def open(self) -> World:
        from harness.dvc_workspace import make_workspace, run
        from harness.nightly_world import GrowingSource, shape_picture
        from harness.prefect_server import WebhookReceiver
        from harness.prefect_workers import start_server

        self.source = GrowingSource(self.root / "source", self.capacity, draw=shape_picture)
        self.site = self.exits.enter_context(self.source.site())
        self.ws = make_workspace(self.root / "ws", world_params(
            self.source.path, self.steps, self.first_steps, self.margin))
        self.remote = self.root / "dvc-remote"
        run([sys.executable, "-m", "dvc", "remote", "add", "-d", "nightly", str(self.remote)],
            self.ws)
        run(["git", "add", "-A"], self.ws)
        run(["git", "-c", "user.email=b@clipms", "-c", "user.name=b", "commit", "-qm", "remote"],
            self.ws)
        (self.root / "prefect").mkdir()
        self.stack = start_server(self.root / "prefect")
        self.exits.callback(self.stack.stop)
        self.hook = WebhookReceiver()
        self.exits.callback(self.hook.stop)
        return self

    def close(self) -> None:
        self.exits.close()

    def grow(self, poisoned: bool = False) -> int:
        """List a few percent more pictures (the first night: `start`; poisoned: as many as were
        listed, their captions shuffled among them); the number new."""
        from harness.nightly_world import poisoned_captions

        new = min(grown(self.listed, self.start, self.growth, poisoned),
                  self.capacity - self.listed)
        self.listed += new
        if poisoned:  # the export keeps listing them so from now on
            self.captions = poisoned_captions(range(self.listed - new, self.listed))
        self.write()
        return new

    def write(self) -> None:
        from harness.nightly_world import shape_captions

        self.source.write(self.site, range(self.listed), captions=self.captions or shape_captions)

    def storage(self) -> dict[str, int]:
        sizes = {name: size_of(self.ws / rel) for name, rel in STORES.items()}
        sizes["dvc_remote"] = size_of(self.remote)
        return sizes

    def champion(self) -> str | None:
        """The champion's version (None: none yet, or the registry cannot say)."""
        try:
            from mlflow import MlflowClient

            uri = f"sqlite:///{self.ws}/mlflow.db"
            version = MlflowClient(uri, uri).get_model_version_by_alias(MODEL, "champion")
            return str(version.version)
        except Exception:  # noqa: BLE001 - no champion yet
            return None


def tonight(path: Path, started: float) -> dict[str, Any] | None:
    """The JSON file if it was written since `started`, else None."""
    if not path.is_file() or path.stat().st_mtime < started:
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


@contextlib.contextmanager
def planted(kind: str | None, world: World, record: dict[str, Any]) -> Iterator[None]:
    """The night's planted failure, in force for the block; undone afterwards."""
    if kind == "broken_source":
        path = world.source.path
        path.write_bytes(path.read_bytes()[:200])
        yield
    elif kind == "diverging":
        with _params(world.ws, {"train.lr": DIVERGING_LR, "train.warm_start.lr": DIVERGING_LR}):
            yield
    elif kind == "sigkill":
        stop = threading.Event()
        killer = threading.Thread(target=_kill_stage, args=(world.ws, "stages.train", stop,
                                                            record), daemon=True)
        killer.start()
        try:
            yield
        finally:
            stop.set()
            killer.join(timeout=5)
    elif kind == "registry_outage":
        from harness.processes import free_port

        with _env("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}"):
            yield
    elif kind == "disk_full":
        with _full_disk(world, record):
            yield
    else:
        yield


@contextlib.contextmanager
def _params(ws: Path, values: dict[str, Any]) -> Iterator[None]:
    from harness.project_copy import set_params

    params = ws / "params.yaml"
    original = params.read_bytes()
    set_params(params, values)
    try:
        yield
    finally:
        params.write_bytes(original)


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _kill_stage(ws: Path, module: str, stop: threading.Event, record: dict[str, Any]) -> None:
    """SIGKILL the process running `python -m <module>` in `ws`, KILL_AFTER_S after it starts."""
    seen: dict[int, float] = {}
    while not stop.wait(0.5):
        for pid in _pids_running(module, ws):
            first = seen.setdefault(pid, time.monotonic())
            if time.monotonic() - first >= KILL_AFTER_S:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    record["killed_pid"] = pid
                    return


def _pids_running(module: str, ws: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        if b"-m" in cmd and module.encode() in cmd and Path(cwd) == ws:
            pids.append(int(proc.name))
    return pids


@contextlib.contextmanager
def _full_disk(world: World, record: dict[str, Any]) -> Iterator[None]:
    """The DVC cache on a file system with DISK_SPARE_BYTES to spare; RLIMIT_FSIZE without root."""
    cache = world.ws / ".dvc" / "cache"
    real = cache.with_name("cache.real")
    need = tmpfs_bytes(cache) + DISK_SPARE_BYTES
    cache.rename(real)
    cache.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={need}", "tmpfs", str(cache)],
                             capture_output=True, text=True).returncode == 0
    if mounted:
        record["disk_full_method"] = f"DVC cache on a {need}-byte tmpfs"
        try:
            shutil.copytree(real, cache, dirs_exist_ok=True)
            yield
        finally:  # what the night cached goes back with the rest (cache files are read-only)
            shutil.copytree(cache, real, dirs_exist_ok=True, copy_function=_copy_new)
            subprocess.run(["umount", str(cache)], check=True)
            cache.rmdir()
            real.rename(cache)
        return
    cache.rmdir()
    real.rename(cache)
    record["disk_full_method"] = f"RLIMIT_FSIZE {DISK_SPARE_BYTES} bytes (no tmpfs: not root)"
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not a signal death
    resource.setrlimit(resource.RLIMIT_FSIZE, (DISK_SPARE_BYTES, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, previous)


def _copy_new(source: str, target: str) -> None:
    if not os.path.exists(target):
        shutil.copy2(source, target)


def lock_digest(ws: Path) -> str | None:
    lock = ws / "dvc.lock"
    return hashlib.sha256(lock.read_bytes()).hexdigest()[:12] if lock.is_file() else None


def run_night(world: World, number: int, kind: str | None) -> dict[str, Any]:
    """One night: grow (unless planted otherwise), plant, run the flow, record."""
    from harness.prefect_server import run_flow

    record: dict[str, Any] = {"night": number, "planted": kind}
    listed_before = world.listed
    record["images_listed_new"] = (0 if kind == "no_new_rows"
                                   else world.grow(poisoned=kind == "poisoned"))
    if kind == "no_new_rows":
        world.write()
    world.site.requests.clear()
    record["champion_before"], record["lock_before"] = world.champion(), lock_digest(world.ws)
    age_index_listing(world.ws)  # a day passes between two nights (retention's 6 h rule)
    notices = len(world.hook.received)
    started = time.time() - 1.0
    began = time.monotonic()
    cwd = Path.cwd()
    os.chdir(world.ws)
    try:
        with planted(kind, world, record), _env("CLIPMS_FAILURE_WEBHOOK", world.hook.url):
            state, run_id = run_flow(world.stack, refresh=["metadata"],
                                     train_without_new_data=False)
    finally:
        os.chdir(cwd)
    record["wall_s"] = round(time.monotonic() - began, 1)
    if kind == "broken_source":
        world.write()  # the next night's export is whole again
    record["state"] = state.type.value
    record["headline"], record["stage_outcomes"] = _summary(state)
    record["asked"] = asked_pictures(world.site.requests, listed_before)
    record["notices"] = [{k: n.get(k) for k in ("stage", "kind", "reason")}
                         for n in world.hook.received[notices:]]
    record["stage_seconds"] = {t["name"]: round(float(t.get("total_run_time") or 0.0), 1)
                               for t in world.stack.task_runs(run_id)
                               if t["name"] in STAGE_NAMES}
    register = tonight(world.ws / "metrics/register.json", started)
    record["decision"] = (f"v{register.get('version')} {register.get('alias')}" if register
                          else _outcome(record))
    record["compared"] = ({k: register.get(k) for k in COMPARED} if register else None)
    download = tonight(world.ws / "metrics/download.json", started) or {}
    record["download"] = {k: download.get(k) for k in ("new_images", "reused_images", "fetched")}
    record["train_steps"] = (tonight(world.ws / "metrics/train.json", started) or {}).get("steps")
    record["champion_after"], record["lock_after"] = world.champion(), lock_digest(world.ws)
    record["storage_bytes"] = world.storage()
    record["retention"] = tonight(world.ws / "metrics/retain.json", started)
    return record


# what metrics/register.json says of the comparison: both values, where each came from, the set
COMPARED = ("compared", "new_value", "new_source", "champion_value", "champion_version",
            "champion_source", "champion_recorded_set", "eval_set")
STAGE_NAMES = ("metadata", "dedupe", "download", "shard", "tokenizer", "changes", "train",
               "evaluate", "export", "index", "register")


def _summary(state: Any) -> tuple[str | None, dict[str, str]]:
    """The flow's one-line summary and each stage's outcome (its result); none when it failed."""
    try:
        result = state.result()
    except Exception:  # noqa: BLE001 - a failed flow's result raises its error
        return None, {}
    return result.get("headline"), {s["stage"]: s["outcome"] for s in result.get("stages", [])}


def asked_pictures(requests: list[str], listed_before: int) -> dict[str, int]:
    """The pictures the site was asked for tonight, and how many of them were listed on an
    earlier night (a download that fetches only what is new asks for none of those)."""
    indices = {int(Path(path).stem) for path in requests if path.startswith("/img/")}
    return {"pictures": len(indices), "listed_before": sum(i < listed_before for i in indices)}


def _outcome(record: dict[str, Any]) -> str:
    notices = record["notices"]
    if record["state"] == "COMPLETED" and not notices:
        return "up to date"
    if notices:
        return f"{notices[0]['kind']} at {notices[0]['stage']}"
    return record["state"].lower()


@dataclass(frozen=True)
class Schedule:
    """The month to run: how many nights, which are planted, how the world grows, how long each
    night trains (the first one cold, the rest warm from the champion) and the gate's margin."""

    nights: int
    plan: dict[int, str]
    growth: float = 0.05
    start: int = 48
    steps: int = 4
    first_steps: int = 4
    margin: float = 0.0

    def capacity(self) -> int:
        """The pictures listed by the last night."""
        listed = 0
        for number in range(1, self.nights + 1):
            if self.plan.get(number) != "no_new_rows":
                listed += grown(listed, self.start, self.growth,
                                self.plan.get(number) == "poisoned")
        return listed


def run_nights(root: Path, schedule: Schedule,
               on_night: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the nights in `root`; the whole record (also passed night by night to `on_night`)."""
    world = World(root, steps=schedule.steps, first_steps=schedule.first_steps,
                  margin=schedule.margin, start=schedule.start, growth=schedule.growth,
                  capacity=schedule.capacity()).open()
    records = []
    try:
        for number in range(1, schedule.nights + 1):
            records.append(run_night(world, number, schedule.plan.get(number)))
            if on_night:
                on_night(records[-1])
    finally:
        world.close()
    return {"nights": records, "growth": schedule.growth, "start_images": schedule.start,
            "steps": schedule.steps, "first_steps": schedule.first_steps,
            "margin": schedule.margin,
            "plan": {str(k): v for k, v in sorted(schedule.plan.items())}, "notes": world.notes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/nights.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nights", type=int, default=30)
    parser.add_argument("--growth", type=float, default=0.05, help="new pictures a night, share")
    parser.add_argument("--start", type=int, default=48, help="pictures on the first night")
    parser.add_argument("--steps", type=int, default=4, help="training steps a night")
    parser.add_argument("--first-steps", type=int, default=None,
                        help="training steps of the first night, cold (default: --steps)")
    parser.add_argument("--margin", type=float, default=0.0,
                        help="register.margin: how much better a challenger must be")
    parser.add_argument("--plant", default=",".join(f"{n}:{k}" for n, k in DEFAULT_PLAN.items()),
                        help="NIGHT:KIND,... with KIND one of " + ", ".join(KINDS))
    parser.add_argument("--out", type=Path, default=record.default_path("nights"))
    parser.add_argument("--keep", type=Path, default=None,
                        help="run in this folder and keep it (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.nights < 1 or not 0 < args.growth < 1:
        parser.error("--nights must be >= 1 and --growth in (0, 1)")
    plan = parse_plan(args.plant)
    recording = record.Recording("nights", record.shown_command(record.with_placeholders(
        [sys.executable, *(sys.argv if argv is None else ["benchmarks/nights.py", *argv])],
        {"--keep": "WORKDIR"})))
    root = args.keep or Path(tempfile.mkdtemp(prefix="clipms-nights-"))
    root.mkdir(parents=True, exist_ok=True)

    done: list[dict[str, Any]] = []

    def show(night: dict[str, Any]) -> None:
        print(f"night {night['night']:>3} {night['planted'] or '':<16} {night['decision']:<32}"
              f" {night['wall_s']:>7.1f} s  cache {night['storage_bytes']['dvc_cache']:>12,} B",
              flush=True)
        done.append(night)  # written night by night: a month is not lost to its last night
        recording.write({"nights": done, "unfinished": True}, args.out)

    try:
        schedule = Schedule(args.nights, plan, args.growth, args.start, args.steps,
                            args.first_steps or args.steps, args.margin)
        result = run_nights(root, schedule, show)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"wrote {record.shown_path(str(recording.write(result, args.out)))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

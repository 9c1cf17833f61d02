"""Failed nights harm nothing and say so once: the `clip-pipeline` flow on a real Prefect server,
with real `dvc` in a git repository, over a toy pipeline whose stages fail the way the real ones
do (a truncated export, a SIGKILL, a write the kernel refuses with ENOSPC on /dev/full, a
registry whose port is closed), and a night with nothing new.

The toy has the real pipeline's stage names where the flow cares (metadata, train, register): its
`register` promotes a champion on a loopback registry that stands in for MLflow (the toy trains
nothing worth registering in MLflow; the real registry is in tests/e2e/test_nights.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread
from typing import Any

import pytest
import yaml

from harness.dvc_workspace import PROJECT_ROOT, run, tool_env
from harness.prefect_server import PrefectStack, WebhookReceiver, run_flow
from harness.prefect_workers import start_server
from harness.processes import free_port

pytestmark = pytest.mark.slow  # a Prefect server and a dozen dvc commands a night

PY = sys.executable
# `python -m registry nights`: one line a night, when, the run, what happened, the figures
NIGHT_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d  \S+  ")
TOY = '''
import json, os, signal, sys, time, urllib.request
import yaml
params = yaml.safe_load(open("params.yaml"))
stage = sys.argv[1]
os.makedirs("metrics", exist_ok=True)
os.makedirs("data", exist_ok=True)
if stage == "metadata":
    rows = [json.loads(line) for line in open(params["metadata"]["path"])]
    json.dump(rows, open("data/metadata.json", "w"))
    json.dump({"rows": len(rows)}, open("metrics/metadata.json", "w"))
elif stage == "train":
    rows = len(json.load(open("data/metadata.json")))
    os.makedirs("models", exist_ok=True)
    if params["train"]["kill"]:
        os.kill(os.getpid(), signal.SIGKILL)
    if params["train"]["sleep"]:  # a long training: the test kills the whole night in it
        open("models/started", "w").close()
        time.sleep(params["train"]["sleep"])
    with open(params["train"]["scratch"], "w") as scratch:  # /dev/full: ENOSPC
        scratch.write("x" * 65536)
    json.dump({"rows": rows, "lr": params["train"]["lr"]}, open("models/model.json", "w"))
    json.dump({"steps": rows}, open("metrics/train.json", "w"))
elif stage == "register":
    model = json.load(open("models/model.json"))
    body = json.dumps(model).encode()
    request = urllib.request.Request(params["register"]["uri"], data=body, method="POST")
    urllib.request.urlopen(request, timeout=10).read()
    json.dump({"alias": "champion", **model}, open("metrics/register.json", "w"))
'''
STAGES = {
    "metadata": {"cmd": f"{PY} toy.py metadata", "deps": ["toy.py"], "params": ["metadata"],
                 "outs": ["data/metadata.json"],
                 "metrics": [{"metrics/metadata.json": {"cache": False}}]},
    "train": {"cmd": f"{PY} toy.py train", "deps": ["toy.py", "data/metadata.json"],
              "params": ["train"], "outs": ["models/model.json"],
              "metrics": [{"metrics/train.json": {"cache": False}}]},
    "register": {"cmd": f"{PY} toy.py register", "deps": ["models/model.json"],
                 "params": ["register"],
                 "metrics": [{"metrics/register.json": {"cache": False}}]},
}


class Registry:
    """A loopback registry: POST sets the champion. Closing its port is an outage."""

    def __init__(self) -> None:
        self.champion: dict[str, Any] | None = None
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server API
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                registry.champion = json.loads(body)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.url = f"http://127.0.0.1:{self.port}/champion"
        Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectStack]:
    root = tmp_path_factory.mktemp("nights-prefect")
    (root / "home").mkdir()
    stack = start_server(root / "home")
    try:
        yield stack
    finally:
        stack.stop()


class Toy:
    """The toy project, its growing source and its registry; `night()` runs the flow once."""

    def __init__(self, root: Path, stack: PrefectStack, hook: WebhookReceiver) -> None:
        self.repo, self.stack, self.hook = root / "toy", stack, hook
        self.source = root / "export.jsonl"
        self.registry = Registry()
        self.rows = 0
        self.repo.mkdir()
        (self.repo / "toy.py").write_text(TOY)
        (self.repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": STAGES}, sort_keys=False))
        self.set_params(lr=0.1)
        run(["git", "init", "-q", "-b", "main"], self.repo)
        run([PY, "-m", "dvc", "init", "-q"], self.repo)
        run(["git", "add", "-A"], self.repo)
        run(["git", "-c", "user.email=t@clipms", "-c", "user.name=t", "commit", "-qm", "toy"],
            self.repo)

    def set_params(self, lr: float = 0.1, kill: bool = False, scratch: str = "scratch.txt",
                   uri: str | None = None, sleep: float = 0) -> None:
        params = {"metadata": {"path": str(self.source)},
                  "train": {"lr": lr, "kill": kill, "scratch": scratch, "sleep": sleep},
                  "register": {"uri": uri or self.registry.url}}
        (self.repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))

    def grow(self, rows: int = 4) -> None:
        self.rows += rows
        self.source.write_text("".join(json.dumps({"caption": f"a picture {i}"}) + "\n"
                                       for i in range(self.rows)))

    def night(self, **parameters: Any) -> tuple[Any, list[dict[str, Any]]]:
        """(final state, the notices it sent)."""
        before = len(self.hook.received)
        state, self.last_run = run_flow(self.stack, **{"refresh": ["metadata"],
                                           "train_without_new_data": False, **parameters})
        return state, self.hook.received[before:]

    def outputs(self) -> dict[str, bytes]:
        """What a night leaves: the lock, the outputs, the metrics."""
        files = ["dvc.lock", "data/metadata.json", "models/model.json"]
        files += [str(p.relative_to(self.repo)) for p in (self.repo / "metrics").glob("*")]
        return {f: (self.repo / f).read_bytes() for f in sorted(files)
                if (self.repo / f).is_file()}


@pytest.fixture
def toy(tmp_path: Path, server: PrefectStack,
        monkeypatch: pytest.MonkeyPatch) -> Iterator[Toy]:
    hook = WebhookReceiver()
    monkeypatch.setenv("CLIPMS_FAILURE_WEBHOOK", hook.url)
    monkeypatch.setenv("CLIPMS_RETRY_BACKOFF_SECONDS", "0.1")
    project = Toy(tmp_path, server, hook)
    monkeypatch.chdir(project.repo)
    try:
        yield project
    finally:
        project.registry.stop()
        hook.stop()


def test_failed_nights_leave_the_last_good_night_and_send_one_notice_each(toy: Toy) -> None:
    toy.grow()
    state, notices = toy.night()
    assert state.is_completed() and notices == []
    assert toy.registry.champion == {"rows": 4, "lr": 0.1}
    good, champion = toy.outputs(), toy.registry.champion

    planted: list[tuple[str, str, str, dict[str, Any]]] = [
        # (stage, kind, a pattern in the reason, the night's params)
        # DVC's shell may run the stage as its child (exit 137) or exec it (signal -9).
        ("train", "killed", r"exited with (-9|137)\b", {"kill": True}),
        ("train", "disk full", "No space left on device", {"scratch": "/dev/full"}),
        ("register", "registry outage", "Connection refused",
         {"uri": f"http://127.0.0.1:{free_port()}/champion"}),
    ]
    for stage, kind, word, night_params in planted:
        toy.grow()  # new data every night: the failure is the night's, not the data's absence
        toy.set_params(**night_params)
        state, notices = toy.night()
        assert state.is_failed(), kind
        assert len(notices) == 1, (kind, notices)
        [notice] = notices
        assert (notice["stage"], notice["kind"]) == (stage, kind), notice
        assert re.search(word, notice["reason"]) and notice["advice"], notice
        assert toy.outputs() == good, kind  # the last good night's outputs, byte for byte
        assert toy.registry.champion == champion, kind

    # A broken source: the export is truncated (the metadata stage is retried, one notice).
    toy.set_params()
    toy.source.write_bytes(toy.source.read_bytes()[:100])
    state, notices = toy.night()
    assert state.is_failed() and len(notices) == 1, notices
    assert (notices[0]["stage"], notices[0]["kind"]) == ("metadata", "broken source"), notices
    assert toy.outputs() == good and toy.registry.champion == champion

    # A healthy night after all that trains on everything the source holds.
    toy.grow()
    state, notices = toy.night()
    assert state.is_completed() and notices == []
    assert toy.registry.champion == {"rows": toy.rows, "lr": 0.1}

    # Each night left its page: in Prefect, and one line each in `python -m registry nights`.
    page = toy.stack.artifact(toy.last_run, "clip-night")["data"]
    assert page.startswith("# Night ") and "| train | ran |" in page
    listing = run([PY, "-m", "registry", "nights"], toy.repo)
    listed = [ln.split("  ") for ln in listing.stdout.splitlines() if NIGHT_LINE.match(ln)]
    assert [fields[2] for fields in listed] == [
        "champion", "FAILED at metadata: broken source", "FAILED at register: registry outage",
        "FAILED at train: disk full", "FAILED at train: killed", "champion"], (
        listing.stdout, listing.stderr[-3000:])


def test_a_night_without_new_data_trains_nothing_unless_asked(toy: Toy) -> None:
    toy.grow()
    assert toy.night()[0].is_completed()
    champion = dict(toy.registry.champion or {})
    toy.set_params(lr=0.2)  # only a param changed: DVC alone would retrain tonight

    state, notices = toy.night()
    assert state.is_completed()
    assert len(notices) == 1 and notices[0]["kind"] == "no new data", notices
    assert "train_without_new_data" in notices[0]["advice"]
    outcomes = {s["stage"]: s["outcome"] for s in state.result()["stages"]}
    assert outcomes["train"] == outcomes["register"] == "skipped: no new data"
    assert toy.registry.champion == champion

    state, notices = toy.night(train_without_new_data=True)
    assert state.is_completed() and notices == []
    assert toy.registry.champion == {**champion, "lr": 0.2}



def test_a_night_whose_process_was_killed_is_named_by_the_next_which_puts_it_back(
        toy: Toy) -> None:
    """The whole night is killed (the flow's process and its children, as a lost worker): no one
    is left to send its notice or put the workspace back, so the next night does both, first."""
    toy.grow()
    assert toy.night()[0].is_completed()
    good = toy.outputs()
    toy.grow()
    toy.set_params(sleep=600)
    env = {**tool_env(), "PREFECT_API_URL": toy.stack.api_url,
           "PREFECT_HOME": str(toy.stack.home), "CLIPMS_FAILURE_WEBHOOK": toy.hook.url,
           "PYTHONPATH": str(PROJECT_ROOT)}
    code = ("from flows.pipeline import clip_pipeline; "
            "clip_pipeline(refresh=['metadata'], train_without_new_data=False)")
    log = toy.repo.parent / "killed-night.log"
    with log.open("wb") as out:
        night = subprocess.Popen([PY, "-c", code], cwd=toy.repo, env=env, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    try:
        started = toy.repo / "models" / "started"
        deadline = time.monotonic() + 600
        while not started.exists() and night.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert started.exists(), f"the night never reached train:\n{log.read_text()[-3000:]}"
    finally:
        if night.poll() is None:
            os.killpg(night.pid, signal.SIGKILL)
        night.wait()
    assert toy.outputs() != good  # tonight's metadata had run: the workspace is not as it was
    assert toy.hook.received == []  # no one was left to say so

    toy.set_params()
    state, notices = toy.night(stages=["metadata"])  # only the put-back and the first stage
    assert state.is_completed()
    assert [(n["stage"], n["kind"]) for n in notices] == [("train", "killed")], notices
    assert "put the workspace back" in notices[0]["reason"]
    # the model, its metrics and the decision are the last good night's again; metadata and the
    # lock hold tonight's first stage
    kept = ("models/model.json", "metrics/train.json", "metrics/register.json")
    assert {k: toy.outputs().get(k) for k in kept} == {k: good[k] for k in kept}
    assert not (toy.repo / ".dvc/tmp/clipms-night").exists()

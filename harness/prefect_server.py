"""A real Prefect stack for tests: server (SQLite, temporary PREFECT_HOME), process pool, worker.

`PrefectStack.start(workspace, home)` starts `prefect server start` on a free loopback port, waits
for /api/health, deploys the workspace's prefect.yaml with flows/deploy.sh (which creates the
process work pool) from inside the workspace (so the deployments' working directory is the
workspace), and starts `prefect worker start --pool clipms`. `stop()` ends every process it started
(worker first with SIGINT: a worker ignores the first SIGTERM), killing their process groups if
they do not exit in time. A loopback webhook receiver records failure notices.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self, TypeVar

import pytest

from harness import processes
from harness.dvc_workspace import make_workspace, tool_env
from harness.processes import free_port

POOL = "clipms"
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
Stack = TypeVar("Stack", bound="PrefectStack")


class WebhookReceiver:
    """A loopback HTTP server that records the JSON bodies POSTed to it."""

    def __init__(self) -> None:
        received: list[dict[str, Any]] = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server API
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                received.append(json.loads(body or b"{}"))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:  # keep test output quiet
                pass

        self.received = received
        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class PrefectProcess(processes.ServerProcess):
    """One `prefect` process of a stack (`name`: server, worker, ...): run in the workspace with
    the stack's environment, logging to <home>/<name>.log; ready when `ready_url` answers (a
    worker has nothing to ask: it is ready once started)."""

    log_mode = "wb"
    # SIGINT: a worker ignores its first SIGTERM. The sweep: children left behind (uvicorn, a flow
    # run subprocess).
    stop_signal = signal.SIGINT
    stop_timeout_s = 20.0
    kill_timeout_s = 10.0
    sweep = True

    def __init__(self, name: str, cmd: list[str], workspace: Path, home: Path,
                 env: dict[str, str], ready_url: str | None = None) -> None:
        super().__init__(home / f"{name}.log")
        self.what = f"prefect {name}"
        self.cmd, self.workspace, self.env, self.ready_url = cmd, workspace, env, ready_url

    def command(self) -> list[str]:
        return self.cmd

    def popen_options(self) -> dict[str, Any]:
        return {"cwd": self.workspace, "env": self.env}

    def ready(self) -> bool:
        return self.ready_url is None or processes.http_ok(self.ready_url)()


@dataclass
class PrefectStack:
    """Handles to the running stack and helpers to drive it through the CLI and the API."""

    workspace: Path
    home: Path
    api_url: str
    env: dict[str, str]
    webhook: WebhookReceiver
    procs: dict[str, PrefectProcess] = field(default_factory=dict)

    @classmethod
    def start(cls, workspace: Path, home: Path) -> Self:
        port = free_port()
        api_url = f"http://127.0.0.1:{port}/api"
        webhook = WebhookReceiver()
        env = tool_env()
        env.update(
            PREFECT_HOME=str(home), PREFECT_API_URL=api_url,
            PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{home}/prefect.db",
            PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_UI_ENABLED="false",
            PREFECT_WORKER_QUERY_SECONDS="2", PREFECT_WORKER_HEARTBEAT_SECONDS="10",
            PREFECT_CLI_COLORS="false", PREFECT_CLI_WRAP_LINES="false", COLUMNS="200",
            CLIPMS_FAILURE_WEBHOOK=webhook.url, CLIPMS_RETRY_BACKOFF_SECONDS="1",
            MLFLOW_TRACKING_URI=f"sqlite:///{workspace}/mlflow.db",
        )
        stack = cls(workspace=workspace, home=home, api_url=api_url, env=env, webhook=webhook)
        try:
            stack.start_server(timeout=90)
            stack.cli(["bash", "flows/deploy.sh"], timeout=180)
            stack._start("worker", ["prefect", "worker", "start", "--pool", POOL,
                                    "--type", "process"])
        except BaseException:
            stack.stop()
            raise
        return stack

    def start_server(self, timeout: float) -> None:
        """`prefect server start` on the port of `api_url`; returns once /api/health answers."""
        port = str(urllib.parse.urlsplit(self.api_url).port)
        self._start("server", ["prefect", "server", "start", "--host", "127.0.0.1", "--port", port],
                    ready_url=f"{self.api_url}/health", timeout=timeout)

    def _start(self, name: str, cmd: list[str], ready_url: str | None = None,
               timeout: float = 60) -> None:
        # Own process group: stop() can end the process and its children (uvicorn, flow runs).
        self.procs[name] = PrefectProcess(name, cmd, self.workspace, self.home, self.env,
                                          ready_url).start(timeout)

    def log(self, name: str) -> str:
        path = self.home / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def cli(self, cmd: list[str], timeout: float = 120,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(cmd, cwd=self.workspace, env=self.env, capture_output=True,
                              text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout}\n"
                                 f"{proc.stderr}")
        return proc

    def run_deployment(self, name: str, params: dict[str, Any] | None = None) -> str:
        """`prefect deployment run NAME --param k=v ...`; returns the new flow run's id."""
        cmd = ["prefect", "deployment", "run", name]
        for key, value in (params or {}).items():
            cmd += ["--param", f"{key}={json.dumps(value)}"]
        out = self.cli(cmd).stdout
        for line in out.splitlines():
            if "UUID:" in line:
                return line.split("UUID:")[1].strip()
        raise AssertionError(f"no flow run id in:\n{out}")

    def api(self, method: str, path: str, body: Any = None) -> Any:
        """A call to the Prefect REST API."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.api_url}{path}", data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            raw = response.read()
        return json.loads(raw) if raw else None

    def flow_run(self, run_id: str) -> dict[str, Any]:
        return self.api("GET", f"/flow_runs/{run_id}")

    def wait(self, run_id: str, timeout: float = 600) -> dict[str, Any]:
        """Poll until the flow run reaches a terminal state (bounded by `timeout`)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            run = self.flow_run(run_id)
            if run["state_type"] in TERMINAL:
                return run
            if not self.procs["worker"].running():
                raise RuntimeError(f"worker exited:\n{self.log('worker')[-3000:]}")
            time.sleep(1)
        raise TimeoutError(f"flow run {run_id} not finished in {timeout} s:\n"
                           f"{self.log('worker')[-3000:]}")

    def logs(self, run_id: str) -> str:
        """Every log line of a flow run (its tasks included), oldest first."""
        rows = self.api("POST", "/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}},
                                                 "sort": "TIMESTAMP_ASC", "limit": 200})
        lines = [row["message"] for row in rows]
        offset = len(rows)
        while len(rows) == 200:
            rows = self.api("POST", "/logs/filter", {
                "logs": {"flow_run_id": {"any_": [run_id]}}, "sort": "TIMESTAMP_ASC",
                "limit": 200, "offset": offset})
            lines += [row["message"] for row in rows]
            offset += len(rows)
        return "\n".join(lines)

    def logs_containing(self, run_id: str, *needles: str, timeout: float = 30.0) -> str:
        """The flow run's logs once every needle is in them (or at the timeout, as they are): a
        run's last lines reach the API after its final state, since Prefect's API log handler
        sends them in batches (PREFECT_LOGGING_TO_API_BATCH_INTERVAL)."""
        deadline = time.monotonic() + timeout
        while True:
            logs = self.logs(run_id)
            if all(n in logs for n in needles) or time.monotonic() > deadline:
                return logs
            time.sleep(0.5)

    def task_runs(self, run_id: str) -> list[dict[str, Any]]:
        return self.api("POST", "/task_runs/filter", {
            "flow_runs": {"id": {"any_": [run_id]}}, "sort": "EXPECTED_START_TIME_ASC",
            "limit": 200})

    def artifact(self, run_id: str, key: str) -> dict[str, Any]:
        rows = self.api("POST", "/artifacts/filter", {
            "artifacts": {"key": {"any_": [key]}, "flow_run_id": {"any_": [run_id]}},
            "limit": 5})
        assert rows, f"no artifact '{key}' for flow run {run_id}"
        return rows[0]

    def stop(self) -> None:
        """Stop the workers, then the server; kill their process groups if they linger."""
        for name in sorted(self.procs, key=lambda n: n == "server"):
            self.procs[name].stop()
        self.webhook.stop()


@contextmanager
def deployed(root: Path, stack_type: type[Stack], **start: Any) -> Iterator[Stack]:
    """`stack_type.start(workspace, home, **start)` on a new tiny synthetic workspace and an empty
    PREFECT_HOME under `root`; stopped on exit."""
    workspace = make_workspace(root / "workspace")
    home = root / "prefect-home"
    home.mkdir()
    stack = stack_type.start(workspace, home, **start)
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def prefect_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectStack]:
    """One tiny synthetic workspace deployed to one real server with one worker, for the tests of
    a module, stopped when it ends. (A fixture a test module assigns gets one instance per module
    whatever its scope: a session scope only kept every module's stack running, polling, to the
    end of `make test`.)"""
    with deployed(tmp_path_factory.mktemp("prefect-stack"), PrefectStack) as stack:
        yield stack


def run_flow(stack: PrefectStack, **parameters: Any) -> tuple[Any, str]:
    """The clip-pipeline flow in this process (cwd = the workspace), against the stack's server;
    returns its final state and its flow-run id."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    from flows.pipeline import clip_pipeline

    with temporary_settings({PREFECT_API_URL: stack.api_url, PREFECT_HOME: stack.home}):
        state = clip_pipeline(**parameters, return_state=True)
        APILogWorker.drain_all(timeout=30)
        EventsWorker.drain_all(timeout=30)
    return state, str(state.state_details.flow_run_id)

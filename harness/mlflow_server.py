"""A real MLflow tracking server for tests: SQLite backend, proxied artifacts, loopback, one worker.

`MlflowServer(root).start()` launches `mlflow server` on a free 127.0.0.1 port, waits (bounded) for
`/health`, and `.stop()` always ends it (SIGTERM, then SIGKILL of its process group). `restart()`
lets a test take the server away and back (the shape of every test server:
harness.processes.ServerProcess). `mlflow_server` is a module fixture: assign it to a name in a
test module, and the module's tests share one server, stopped when the module ends. (A fixture a
test module assigns gets one instance per module whatever its scope; a session scope only kept
every module's server running until the end of `make test`.)
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness import processes
from harness.processes import free_port

STARTUP_TIMEOUT_S = 120.0  # ~12 s on an idle 2-core machine; much longer while 8 jobs share it


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, body) of a GET; connection errors raise OSError."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


class MlflowServer(processes.ServerProcess):
    """One `mlflow server` process with its database and artifact store under `root`."""

    what = "mlflow server"
    startup_timeout_s = STARTUP_TIMEOUT_S
    # Graceful shutdown often takes >10 s here (open keep-alive connections); the test data is
    # disposable, so do not wait long for it.
    stop_timeout_s = 5.0

    def __init__(self, root: Path, port: int | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        super().__init__(self.root / "server.log")
        self.db = self.root / "mlflow.db"
        self.artifacts = self.root / "mlartifacts"
        self.port = port or free_port()

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        mlflow = str(Path(sys.executable).parent / "mlflow")
        return [
            mlflow, "server",
            "--backend-store-uri", f"sqlite:///{self.db}",
            "--artifacts-destination", str(self.artifacts),
            "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
        ]

    def environment(self) -> dict[str, str]:
        """Variables the server needs besides this process' own (a subclass's database login)."""
        return {}

    def popen_options(self) -> dict[str, Any]:
        bin_dir = str(Path(sys.executable).parent)
        env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ["PATH"])
        env.pop("MLFLOW_TRACKING_URI", None)
        # MLflow's server job execution (a job runner and ~8 Huey consumer processes, for GenAI
        # scorer jobs and trace roll-ups, none of which this project uses) doubled a server's
        # start-up CPU and kept polling at ~17% of a core while idle. Tracking, the registry and
        # artifacts do not use it.
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
        env.update(self.environment())
        return {"env": env}

    def ready(self) -> bool:
        return processes.http_ok(f"{self.uri}/health")()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """One SQLite-backed server for the tests of a module (start-up costs ~12-30 s)."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def server(mlflow_server: MlflowServer) -> MlflowServer:
    """The module's `mlflow_server`, started again if a test that took it away failed before
    bringing it back. Assign both to names in a test module."""
    if mlflow_server.proc is None:  # a test that took it away failed before bringing it back
        mlflow_server.start()
    return mlflow_server

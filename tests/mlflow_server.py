"""A real MLflow tracking server for tests: SQLite backend, proxied artifacts, loopback, one worker.

`MlflowServer(root).start()` launches `mlflow server` on a free 127.0.0.1 port, waits (bounded) for
`/health`, and `.stop()` always ends it (SIGTERM, then SIGKILL of its process group). `restart()`
lets a test take the server away and back. `mlflow_server` is a session fixture (assign it to a
name in a test module) so that every module that needs a server shares one.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

STARTUP_TIMEOUT_S = 120.0  # ~12 s on an idle 2-core machine; much longer while 8 jobs share it


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, body) of a GET; connection errors raise OSError."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


class MlflowServer:
    """One `mlflow server` process with its database and artifact store under `root`."""

    def __init__(self, root: Path, port: int | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.db = self.root / "mlflow.db"
        self.artifacts = self.root / "mlartifacts"
        self.port = port or free_port()
        self.log = self.root / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None

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

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> MlflowServer:
        bin_dir = str(Path(sys.executable).parent)
        env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ["PATH"])
        env.pop("MLFLOW_TRACKING_URI", None)
        env.update(self.environment())
        with open(self.log, "ab") as log:
            # A new session so that stop() can end uvicorn and any worker it forks.
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited {self.proc.returncode}:\n{self.tail()}")
            try:
                if http_get(f"{self.uri}/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"mlflow server not healthy after {timeout:.0f} s:\n{self.tail()}")

    def stop(self) -> None:
        """End the server and everything it started; safe to call twice."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = None
            return
        pgid = os.getpgid(self.proc.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            # Graceful shutdown often takes >10 s here (open keep-alive connections); the test
            # data is disposable, so do not wait long for it.
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(timeout=15)
        self.proc = None

    def restart(self) -> None:
        """Start again on the same port, database and artifact store (after a stop)."""
        self.stop()
        self.start()

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def __enter__(self) -> MlflowServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """One SQLite-backed server for every test module that needs one (start-up costs ~12-30 s)."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    try:
        yield server
    finally:
        server.stop()

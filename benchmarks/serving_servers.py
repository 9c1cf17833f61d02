"""The servers of benchmarks/bench_serving.py: each in its own process session on a free
127.0.0.1 port, waited for until ready, its CPU time readable, and stopped with its children."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """One server process in its own session; `stop()` ends it and its children."""

    def __init__(self, name: str, cmd: list[str], ready_path: str, env: dict[str, str],
                 log_dir: Path, processes: int = 1) -> None:
        self.name, self.port = name, free_port()
        self.processes = processes  # uvicorn workers: each logs its start-up when its app loaded
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready = self.url + ready_path
        self.log = log_dir / f"{name}.log"
        cmd = [c.replace("{port}", str(self.port)) for c in cmd]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

    def wait(self, timeout: float) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.ready, timeout=2) as response:
                    started = self.log.read_text(errors="replace").count(
                        "Application startup complete")
                    if response.status == 200 and started >= self.processes:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.name} not ready after {timeout} s")

    def cpu_seconds(self) -> float:
        """CPU time (user + system) used so far by the server and every process under it."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0
        total = 0.0
        for proc in procs:
            try:
                times = proc.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += times.user + times.system
        return total

    def exit_code(self) -> int | None:
        """None while it runs; else its exit code (negative: killed by that signal)."""
        return self.proc.poll()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(os.getpgid(self.proc.pid), signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(os.getpgid(self.proc.pid), signal.SIGKILL)
                self.proc.wait(timeout=20)


def log_pyfunc(bundle: Path, folder: Path) -> tuple[str, str]:
    """(tracking URI, model URI) of the bundle's pyfunc in a new SQLite registry in `folder`."""
    import mlflow

    from registry import pyfunc

    uri = f"sqlite:///{folder / 'mlflow.db'}"
    os.environ["MLFLOW_TRACKING_URI"] = uri
    cwd = Path.cwd()
    os.chdir(folder)  # the SQLite store's default artifact root is ./mlruns
    try:
        mlflow.set_tracking_uri(uri)
        with mlflow.start_run():
            info = pyfunc.log_model(bundle.resolve(), name="clip")
        version = mlflow.register_model(info.model_uri, "bench-clip").version
    finally:
        os.chdir(cwd)
    return uri, f"models:/bench-clip/{version}"


def start_servers(args: argparse.Namespace, work: Path, servers: dict[str, Server]) -> None:
    """Start the chosen targets into `servers` (filled as they start, so the caller stops every
    one that started even when a later one fails) and wait until all are ready."""
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    serve = [str(BIN / "python"), "-m", "serving", "--model", str(args.bundle), "--index",
             str(args.index), "--port", "{port}", "--max-wait-ms", str(args.max_wait_ms),
             "--max-queue", "4096", "--log-level", "info"]
    if "service" in args.targets:
        servers["service"] = Server("service", [*serve, "--max-batch", str(args.max_batch)],
                                    "/readyz", env, work)
    if "service_b1" in args.targets:
        servers["service_b1"] = Server("service_b1", [*serve, "--max-batch", "1"], "/readyz", env,
                                       work)
    if "mlflow" in args.targets:
        if args.mlflow_model:
            tracking = args.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
            model = args.mlflow_model
        else:
            tracking, model = log_pyfunc(args.bundle, work)
        servers["mlflow"] = Server("mlflow", [
            str(BIN / "mlflow"), "models", "serve", "-m", model, "--env-manager", "local",
            "--host", "127.0.0.1", "--port", "{port}", "--workers", str(args.mlflow_workers),
            "--timeout", str(args.mlflow_timeout)],
            "/ping", {**env, "MLFLOW_TRACKING_URI": tracking}, work,
            processes=args.mlflow_workers)
    for server in servers.values():
        server.wait(args.startup_timeout)

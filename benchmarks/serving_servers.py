"""The servers of benchmarks/bench_serving.py: each in its own process session on a free
127.0.0.1 port (harness.processes, as the tests start theirs), waited for until ready, its CPU
time readable, and stopped with its children."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from harness import processes

BIN = Path(sys.executable).parent


class Server:
    """One server process in its own session; `stop()` ends it and its children."""

    def __init__(self, name: str, cmd: list[str], ready_path: str, env: dict[str, str],
                 log_dir: Path, workers: int = 1) -> None:
        self.name, self.port = name, processes.free_port()
        self.workers = workers  # uvicorn workers: each logs its start-up when its app loaded
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready = self.url + ready_path
        self.log = log_dir / f"{name}.log"
        cmd = [c.replace("{port}", str(self.port)) for c in cmd]
        self.proc = processes.spawn(cmd, self.log, mode="wb", env=env)

    def _started(self) -> bool:
        """/ready answers 200 and every worker has logged its start-up."""
        started = self.log.read_text(errors="replace").count("Application startup complete")
        return processes.http_ok(self.ready)() and started >= self.workers

    def wait(self, timeout: float) -> None:
        processes.wait_until(self._started, self.proc, self.name, self.log, timeout, interval=1)

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
        processes.stop(self.proc, timeout=20, kill_timeout=20)


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
            workers=args.mlflow_workers)
    for server in servers.values():
        server.wait(args.startup_timeout)

"""The servers of benchmarks/bench_serving.py: each in its own process session on a free
127.0.0.1 port (harness.processes, as the tests start theirs), waited for until ready, its CPU
time readable, and stopped with its children.

The pinned mode's servers are processes of their own, started on the server CPU (`cpus`), not the
shared mode's servers pinned later: a process sizes its thread pools by the CPUs it may use when
it starts (MindSpore's among them), and the model-alone limit it is compared with starts on that
CPU too. A service started on both cores and pinned later keeps a second MindSpore kernel thread
busy, taking turns with the first on one CPU (docs/serving.md, "Load benchmark")."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

from harness import processes

BIN = Path(sys.executable).parent


class Server:
    """One server process in its own session; `stop()` ends it and its children."""

    def __init__(self, name: str, cmd: list[str], ready_path: str, env: dict[str, str],
                 log_dir: Path, workers: int = 1, cpus: set[int] | None = None) -> None:
        self.name, self.port = name, processes.free_port()
        self.cpus = cpus  # None: every CPU
        self.workers = workers  # uvicorn workers: each logs its start-up when its app loaded
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready = self.url + ready_path
        self.log = log_dir / f"{name}.log"
        cmd = [c.replace("{port}", str(self.port)) for c in cmd]
        start_on = {"preexec_fn": functools.partial(os.sched_setaffinity, 0, cpus)} if cpus else {}
        self.proc = processes.spawn(cmd, self.log, mode="wb", env=env, **start_on)

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


PINNED = "@pinned"


def server_name(mode: str, target: str) -> str:
    """The name of `target`'s server in `mode`: "service", or "service@pinned" when pinned."""
    return target + PINNED if mode == "pinned" else target


def start_servers(args: argparse.Namespace, work: Path, servers: dict[str, Server]) -> None:
    """Start the chosen targets into `servers` (filled as they start, so the caller stops every
    one that started even when a later one fails) and wait until all are ready: the shared
    mode's on every CPU, the pinned mode's (`<target>@pinned`) on `--server-cpu`."""
    specs = server_specs(args, work)
    if "shared" in args.modes:
        for target in args.targets:
            name = server_name("shared", target)
            servers[name] = Server(name, *specs[target], work, workers=workers(args, target))
    if "pinned" in args.modes:
        for target in (t for t in args.pinned_targets if t in args.targets):
            name = server_name("pinned", target)
            servers[name] = Server(name, *specs[target], work, workers=workers(args, target),
                                   cpus={args.server_cpu})
    for server in servers.values():
        server.wait(args.startup_timeout)


def workers(args: argparse.Namespace, target: str) -> int:
    return args.mlflow_workers if target == "mlflow" else 1


def server_specs(args: argparse.Namespace, work: Path) -> dict[str, tuple[list[str], str,
                                                                         dict[str, str]]]:
    """(command, ready path, environment) of every target either mode uses."""
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    serve = [str(BIN / "python"), "-m", "serving", "--model", str(args.bundle), "--index",
             str(args.index), "--port", "{port}", "--max-wait-ms", str(args.max_wait_ms),
             "--max-queue", "4096", "--log-level", "info"]
    specs = {"service": ([*serve, "--max-batch", str(args.max_batch)], "/readyz", env),
             "service_b1": ([*serve, "--max-batch", "1"], "/readyz", env)}
    if "mlflow" in args.targets:
        if args.mlflow_model:
            tracking = args.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
            model = args.mlflow_model
        else:
            tracking, model = log_pyfunc(args.bundle, work)
        specs["mlflow"] = ([
            str(BIN / "mlflow"), "models", "serve", "-m", model, "--env-manager", "local",
            "--host", "127.0.0.1", "--port", "{port}", "--workers", str(args.mlflow_workers),
            "--timeout", str(args.mlflow_timeout)], "/ping",
            {**env, "MLFLOW_TRACKING_URI": tracking})
    return specs

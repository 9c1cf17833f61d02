"""Load benchmark of the search service (issue 16 item 6): bounded loopback load, closed loop.

    python benchmarks/bench_serving.py --bundle models/export --index models/index \
        --concurrency 1 8 32 64 --seconds 10 --out benchmarks/serving.json

Starts, on free 127.0.0.1 ports, three servers of the same bundle: the service with dynamic
batching (`--max-batch 32`), the same service with batching off (`--max-batch 1`) and `mlflow
models serve` of the bundle's pyfunc (logged into a temporary SQLite registry unless
`--mlflow-model` names one) with `--workers` = the machine's cores (`--mlflow-workers`: MLflow's
own knob for serving requests in parallel; one worker runs one predict at a time) and its
request `--timeout` (`--mlflow-timeout`, MLflow's default 60 s). For each
workload (text embeddings, image embeddings, text search; the pyfunc has no search) and each
concurrency, every server gets the same load in turn, in an order that rotates per round: C clients
each sending one request after the other for `--seconds` (and at most `--max-requests`). Every
target gets the same client: one aiohttp session per cell with a pool of at most C keep-alive
connections (one per client). Before its first cell each server gets `--warmup-s` of untimed load
per workload (graph compiles, worker start-up); the warm-up's errors are reported too. Reported per
cell: QPS, p50/p95/p99 latency, errors and the first error, the server's exit code if it died
during the cell, the server's CPU time per answered request (all its processes; the figure a shared
machine distorts least), and for the service the mean batch size (from its /metrics). Then
`clipms-bench encode --bundle` measures what the model itself does at the batched service's mean
text batch size at concurrency 32: the limit, so the service's own overhead shows. The client runs
in this process (asyncio + aiohttp) and its CPU time is reported, since it shares the machine with
the servers. Every server is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

BIN = Path(sys.executable).parent
WORKLOADS = ("text_embed", "image_embed", "text_search")
TARGETS = ("service", "service_b1", "mlflow")


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


def sample_image() -> str:
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (128, 128, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return base64.b64encode(out.getvalue()).decode()


def request_for(target: str, workload: str, i: int, image: str) -> tuple[str, dict] | None:
    text = f"a photo of thing number {i}"
    if target == "mlflow":
        if workload == "text_search":
            return None  # the pyfunc has no search
        column, value = ("text", text) if workload == "text_embed" else ("image", image)
        return "/invocations", {"dataframe_split": {"columns": [column], "data": [[value]]}}
    if workload == "text_embed":
        return "/v1/embeddings", {"texts": [text]}
    if workload == "image_embed":
        return "/v1/embeddings", {"images": [image]}
    return "/v1/search", {"text": text, "k": 10}


async def load(url: str, target: str, workload: str, concurrency: int, seconds: float,
               max_requests: int, image: str) -> dict[str, Any]:
    """C closed-loop clients for `seconds` (at most `max_requests` in all)."""
    import aiohttp

    latencies: list[float] = []
    errors: dict[str, Any] = {"count": 0, "first": None}
    sent = {"n": 0}
    deadline = time.monotonic() + seconds

    async def client(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < deadline and sent["n"] < max_requests:
            sent["n"] += 1
            path, body = request_for(target, workload, sent["n"], image)
            started = time.perf_counter()
            try:
                async with session.post(url + path, json=body) as response:
                    payload = await response.read()
                    ok = response.status == 200
                    detail = f"HTTP {response.status}: {payload[:200]!r}"
            except (TimeoutError, aiohttp.ClientError) as err:
                ok, detail = False, f"{type(err).__name__}: {err}"
            if ok:
                latencies.append(time.perf_counter() - started)
            else:
                errors["count"] += 1
                errors["first"] = errors["first"] or detail

    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=60)
    started = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    ms = np.asarray(latencies) * 1000 if latencies else np.zeros(1)
    return {"requests": len(latencies), "errors": errors["count"],
            "first_error": errors["first"], "seconds": round(elapsed, 2),
            "qps": round(len(latencies) / elapsed, 1),
            "p50_ms": round(float(np.percentile(ms, 50)), 1),
            "p95_ms": round(float(np.percentile(ms, 95)), 1),
            "p99_ms": round(float(np.percentile(ms, 99)), 1)}


def batch_totals(url: str, tower: str) -> tuple[float, float]:
    """(model calls, items) of a tower so far, from the service's /metrics."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        for name in ("clipms_batch_size_count", "clipms_batch_size_sum"):
            if line.startswith(f'{name}{{tower="{tower}"}}'):
                values[name] = float(line.split()[-1])
    return values.get("clipms_batch_size_count", 0.0), values.get("clipms_batch_size_sum", 0.0)


def measure(servers: dict[str, Server], target: str, workload: str, concurrency: int,
            seconds: float, max_requests: int, image: str) -> dict[str, Any]:
    """One cell: the load, the server's mean batch size over it, and whether the server died."""
    server = servers[target]
    tower = "image" if workload == "image_embed" else "text"
    alive = server.exit_code() is None
    before = batch_totals(server.url, tower) if target != "mlflow" and alive else None
    cpu_before = server.cpu_seconds()
    cell = asyncio.run(load(server.url, target, workload, concurrency, seconds, max_requests,
                            image))
    if cell["requests"]:  # CPU per answer: what a shared machine distorts least
        cell["server_cpu_ms_per_request"] = round(
            (server.cpu_seconds() - cpu_before) * 1000 / cell["requests"], 2)
    if server.exit_code() is not None:  # counted and named, never hidden
        cell["server_exit"] = server.exit_code()
        print(f"{target} exited with {server.exit_code()}; its log ends:\n"
              f"{server.log.read_text(errors='replace')[-2000:]}", file=sys.stderr)
    elif before is not None:
        calls, items = (a - b for a, b in zip(batch_totals(server.url, tower), before,
                                               strict=True))
        cell["mean_batch"] = round(items / calls, 2) if calls else None
    cell.update(target=target, workload=workload, concurrency=concurrency,
                load_avg_1min=round(os.getloadavg()[0], 2))
    return cell


def warm_up(args: argparse.Namespace, servers: dict[str, Server],
            image: str) -> list[dict[str, Any]]:
    """Untimed load on every server and workload (compiles, lazy start-up); errors kept."""
    cells = []
    for workload in args.workloads:
        for target in servers:
            if args.warmup_s > 0 and request_for(target, workload, 0, image) is not None:
                cell = measure(servers, target, workload, max(args.concurrency), args.warmup_s,
                               args.max_requests, image)
                cells.append(cell)
                print(json.dumps({"warmup": True, **cell}), flush=True)
    return cells


def run_cells(args: argparse.Namespace, servers: dict[str, Server],
              image: str) -> list[dict[str, Any]]:
    cells = []
    targets = [t for t in TARGETS if t in servers]
    for workload in args.workloads:
        for concurrency in args.concurrency:
            for rnd in range(args.rounds):
                shift = rnd % len(targets)
                for target in targets[shift:] + targets[:shift]:  # alternate who goes first
                    if request_for(target, workload, 0, image) is None:
                        continue
                    cell = measure(servers, target, workload, concurrency, args.seconds,
                                   args.max_requests, image)
                    cell["round"] = rnd
                    cells.append(cell)
                    print(json.dumps(cell), flush=True)
    return cells


def model_limit(args: argparse.Namespace, batch: int) -> dict[str, Any]:
    out = subprocess.run([str(BIN / "clipms-bench"), "encode", "--bundle", str(args.bundle),
                          "--batch-size", str(batch), "--steps", "20"], capture_output=True,
                         text=True, check=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(cells: list[dict[str, Any]], warmup: list[dict[str, Any]],
              limit: dict[str, Any] | None) -> dict[str, Any]:
    def median(target: str, workload: str, concurrency: int, key: str) -> float | None:
        values = [c[key] for c in cells if (c["target"], c["workload"], c["concurrency"]) ==
                  (target, workload, concurrency) and c.get(key) is not None]
        return statistics.median(values) if values else None

    qps = {t: median(t, "text_embed", 32, "qps") for t in TARGETS}
    summary = {
        "text_qps_c32": qps,
        "vs_mlflow": round(qps["service"] / qps["mlflow"], 2)
        if qps["service"] and qps["mlflow"] else None,
        "vs_batching_off": round(qps["service"] / qps["service_b1"], 2)
        if qps["service"] and qps["service_b1"] else None,
        "p99_ms_c8_text": median("service", "text_embed", 8, "p99_ms"),
        "errors": sum(c["errors"] for c in cells),
        "servers_died": sorted({c["target"] for c in cells if "server_exit" in c}),
        "warmup_errors": sum(c["errors"] for c in warmup),
    }
    if limit is not None and qps["service"]:
        summary.update(model_texts_per_s=limit["texts_per_s"], limit_batch=limit["batch_size"],
                       vs_model_limit=round(qps["service"] / limit["texts_per_s"], 2))
    return summary


def markdown(cells: list[dict[str, Any]]) -> str:
    rows = ["| workload | concurrency | server | QPS | p50 ms | p95 ms | p99 ms | mean batch "
            "| server CPU ms/request | errors | load |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in cells:
        died = f" (server died: {c['server_exit']})" if "server_exit" in c else ""
        rows.append(f"| {c['workload']} | {c['concurrency']} | {c['target']} | {c['qps']} | "
                    f"{c['p50_ms']} | {c['p95_ms']} | {c['p99_ms']} | "
                    f"{c.get('mean_batch', '-')} | {c.get('server_cpu_ms_per_request', '-')} | "
                    f"{c['errors']}{died} | "
                    f"{c['load_avg_1min']} |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, default=Path("models/export"))
    p.add_argument("--index", type=Path, default=Path("models/index"))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--seconds", type=float, default=10.0, help="per cell (bounded load)")
    p.add_argument("--max-requests", type=int, default=20000, help="per cell, at most")
    p.add_argument("--rounds", type=int, default=1, help="repeats of every cell; medians kept")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    p.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS))
    p.add_argument("--warmup-s", type=float, default=3.0,
                   help="untimed load per server and workload before the cells")
    p.add_argument("--mlflow-workers", type=int, default=os.cpu_count() or 1,
                   help="uvicorn workers of mlflow models serve (default: the cores)")
    p.add_argument("--mlflow-timeout", type=int, default=60,
                   help="mlflow models serve --timeout: seconds a request may take before its "
                   "worker is restarted (MLflow's default 60, above any latency seen here)")
    p.add_argument("--mlflow-model", help="model URI for `mlflow models serve` (default: the "
                   "bundle's pyfunc in a temporary registry)")
    p.add_argument("--mlflow-tracking-uri")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--no-limit", action="store_true", help="skip the clipms-bench model limit")
    p.add_argument("--out", type=Path, help="write all cells and the summary as JSON here")
    args = p.parse_args()

    load_before = os.getloadavg()
    cpu_started = time.process_time()
    with tempfile.TemporaryDirectory(prefix="clipms-bench-serving-") as tmp:
        servers: dict[str, Server] = {}
        try:
            start_servers(args, Path(tmp), servers)
            image = sample_image()
            warmup = warm_up(args, servers, image)
            cells = run_cells(args, servers, image)
        finally:
            for server in servers.values():
                server.stop()
    client_cpu_s = time.process_time() - cpu_started
    batches = [c["mean_batch"] for c in cells if c["target"] == "service" and
               c["workload"] == "text_embed" and c["concurrency"] == 32 and c.get("mean_batch")]
    limit = None
    if batches and not args.no_limit:
        limit = model_limit(args, max(1, round(statistics.median(batches))))
    result = {"cells": cells, "warmup": warmup, "summary": summarize(cells, warmup, limit),
              "limit": limit, "mlflow_workers": args.mlflow_workers,
              "mlflow_timeout_s": args.mlflow_timeout,
              "client_cpu_s": round(client_cpu_s, 1), "cpus": os.cpu_count(),
              "load_avg_before": [round(x, 2) for x in load_before],
              "load_avg_after": [round(x, 2) for x in os.getloadavg()]}
    print(markdown(cells))
    print(json.dumps(result["summary"], indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Load benchmark of the search service: bounded loopback load, closed loop.

    python benchmarks/bench_serving.py --bundle models/export --index models/index \
        --concurrency 1 8 32 64 --seconds 10

Starts, on free 127.0.0.1 ports, three servers of the same bundle: the service with dynamic
batching (`--max-batch 32`), the same service with batching off (`--max-batch 1`) and `mlflow
models serve` of the bundle's pyfunc (logged into a temporary SQLite registry unless
`--mlflow-model` names one) with `--workers` = the machine's cores (`--mlflow-workers`: MLflow's
own knob for serving requests in parallel; one worker runs one predict at a time) and its
request `--timeout` (`--mlflow-timeout`, MLflow's default 60 s). For each
workload (text embeddings, image embeddings, text search; the pyfunc has no search) and each
concurrency, every server gets the same load in turn, in an order that rotates per round: C clients
each sending one request after the other for `--seconds` (and at most `--max-requests`), each on
its own keep-alive connection (benchmarks/serving_load.py: bodies encoded up front, answers framed
by status and length, one in `--check-every` decoded and checked). Before its first cell each
server gets `--warmup-s` of untimed load per workload (graph compiles, worker start-up); the
warm-up's errors are reported too. Reported per cell: QPS, p50/p95/p99 latency, errors and the
first error, the server's exit code if it died during the cell, the server's CPU time per
answered request (all its processes), the client's, the 1-minute load, and for the service the
mean batch size (from its /metrics).

Two modes, alternated in one run (`--modes`): `shared`, every process on every core (the client
takes its share of them), and `pinned` (text embeddings, `--pinned-targets`): servers of their own
started on `--server-cpu` (benchmarks/serving_servers.py says why), the client on `--client-cpu`.
Right after each cell of the batched service's text embeddings at concurrency 32,
`python -m benchmarks.throughput encode --bundle` measures what the model itself does at that
cell's mean batch size, on the CPUs the service had (both cores; the server CPU) with as many
MindSpore threads: the limit, so the service's own overhead shows. Each cell and its limit are a
pair measured in the same minute, so the machine's drift (its speed moves by 10-20 % over minutes
here) falls on both sides of the ratio; the summary gives the median of the pairs' ratios. The
limit's rate is the mean over its `--limit-steps` timed steps (texts / time), not its median step:
the service's QPS is a mean over seconds with every interruption in it, so the limit is measured
the same way (the median step's rate is reported beside it). Every server is stopped at the end.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import record  # benchmarks/record.py, beside this script
from serving_load import pin, run_load, workload
from serving_servers import Server, server_name, start_servers

BIN = Path(sys.executable).parent
WORKLOADS = ("text_embed", "image_embed", "text_search")
TARGETS = ("service", "service_b1", "mlflow")
MODES = ("shared", "pinned")
GOAL_CONCURRENCY = 32  # the service's goals (QPS and the model-alone ratio) are stated here
LIMIT_RATE = ("texts/s of the model alone: the mean over its timed steps (texts / time, every "
              "interruption counted, as in the service's QPS), warm-up left out; "
              "model_texts_per_s_median_step: at its median step")


def sample_image() -> str:
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (128, 128, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return base64.b64encode(out.getvalue()).decode()


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


class Bench:
    """The servers, what each workload sends, and the CPU sets of the two modes."""

    def __init__(self, args: argparse.Namespace, servers: dict[str, Server], image: str,
                 dim: int) -> None:
        self.args, self.servers = args, servers
        self.work = {(t, k): workload(t, k, image, dim) for t in TARGETS for k in WORKLOADS}
        everything = set(range(os.cpu_count() or 1))
        self.cpus = {"shared": (everything, everything),  # (servers, client)
                     "pinned": ({args.server_cpu}, {args.client_cpu})}

    def server(self, mode: str, target: str) -> Server | None:
        return self.servers.get(server_name(mode, target))

    def enter(self, mode: str) -> None:
        """The client on the mode's CPUs (each server stays on the CPUs it started on)."""
        pin([os.getpid()], self.cpus[mode][1])

    def measure(self, mode: str, target: str, kind: str, concurrency: int,
                seconds: float) -> dict[str, Any]:
        """One cell: the load, the server's mean batch size over it, and whether it died."""
        self.enter(mode)
        server = self.servers[server_name(mode, target)]
        tower = "image" if kind == "image_embed" else "text"
        alive = server.exit_code() is None
        before = batch_totals(server.url, tower) if target != "mlflow" and alive else None
        cpu_before = server.cpu_seconds()
        cell = run_load(("127.0.0.1", server.port), self.work[target, kind], concurrency,
                        seconds, self.args.max_requests, self.args.check_every)
        if cell["requests"]:  # CPU per answer: what a shared machine distorts least
            cell["server_cpu_ms_per_request"] = round(
                (server.cpu_seconds() - cpu_before) * 1000 / cell["requests"], 3)
        if server.exit_code() is not None:  # counted and named, never hidden
            cell["server_exit"] = server.exit_code()
            print(f"{target} exited with {server.exit_code()}; its log ends:\n"
                  f"{server.log.read_text(errors='replace')[-2000:]}", file=sys.stderr)
        elif before is not None:
            calls, items = (a - b for a, b in zip(batch_totals(server.url, tower), before,
                                                   strict=True))
            cell["mean_batch"] = round(items / calls, 2) if calls else None
        cell.update(mode=mode, target=target, workload=kind, concurrency=concurrency,
                    load_avg_1min=round(os.getloadavg()[0], 2))
        return cell

    def cells(self, mode: str) -> list[tuple[str, str]]:
        """(target, workload) pairs this mode measures."""
        kinds = self.args.workloads if mode == "shared" else ["text_embed"]
        targets = TARGETS if mode == "shared" else self.args.pinned_targets
        return [(t, k) for k in kinds for t in targets
                if self.server(mode, t) is not None and self.work[t, k] is not None]


def warm_up(bench: Bench) -> list[dict[str, Any]]:
    """Untimed load on every server and workload (compiles, lazy start-up); errors kept."""
    cells = []
    if bench.args.warmup_s > 0:
        for mode in bench.args.modes:
            for target, kind in bench.cells(mode):
                cell = bench.measure(mode, target, kind, max(bench.args.concurrency),
                                     bench.args.warmup_s)
                cells.append(cell)
                print(json.dumps({"warmup": True, **cell}), flush=True)
    return cells


def run_cells(bench: Bench) -> list[dict[str, Any]]:
    """Every cell, `--rounds` times; per round the order of the modes and of the servers
    rotates, so neither a mode nor a server always goes first."""
    args, cells = bench.args, []
    for kind in args.workloads:
        for concurrency in args.concurrency:
            for rnd in range(args.rounds):
                modes = [m for m in args.modes if (m == "shared" or kind == "text_embed")]
                modes = modes[rnd % len(modes):] + modes[:rnd % len(modes)]
                for mode in modes:
                    targets = [t for t, k in bench.cells(mode) if k == kind]
                    shift = rnd % len(targets)
                    for target in targets[shift:] + targets[:shift]:
                        cell = bench.measure(mode, target, kind, concurrency, args.seconds)
                        cell["round"] = rnd
                        pair_with_limit(bench, cell)
                        cells.append(cell)
                        print(json.dumps(cell), flush=True)
    bench.enter("shared")
    return cells


def pair_with_limit(bench: Bench, cell: dict[str, Any]) -> None:
    """After a cell of the batched service's text embeddings at GOAL_CONCURRENCY: the model
    alone at the cell's mean batch, on the CPUs the service had (`limit`), and the pair's ratio
    (`vs_model_limit`)."""
    if bench.args.no_limit or not cell.get("mean_batch") or (
            cell["target"], cell["workload"], cell["concurrency"]) != (
            "service", "text_embed", GOAL_CONCURRENCY):
        return
    run = model_limit(bench.args, max(1, round(cell["mean_batch"])), bench.cpus[cell["mode"]][0])
    cell["limit"] = run
    cell["vs_model_limit"] = ratio(cell["qps"], run["texts_per_s_mean"])


def model_limit(args: argparse.Namespace, batch: int, cpus: set[int]) -> dict[str, Any]:
    """`python -m benchmarks.throughput encode --bundle` at `batch`, started on `cpus` only and
    with as many MindSpore threads, as the service was."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.throughput", "encode",
                          "--bundle", str(args.bundle),
                          "--towers", "text", "--batch-size", str(batch),
                          "--steps", str(args.limit_steps), "--threads", str(len(cpus))],
                         capture_output=True, text=True, check=True, timeout=1800,
                         preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "cpus": sorted(cpus)}


def median_of(cells: list[dict[str, Any]], mode: str, target: str, kind: str,
              concurrency: int, key: str) -> float | None:
    values = [c[key] for c in cells if (c["mode"], c["target"], c["workload"], c["concurrency"])
              == (mode, target, kind, concurrency) and c.get(key) is not None]
    return median(values) if values else None


def median(values: Any) -> float:
    return round(statistics.median(values), 3)  # no 365.95000000000005 in the JSON


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def summarize(cells: list[dict[str, Any]], warmup: list[dict[str, Any]],
              mode: str) -> dict[str, Any]:
    qps = {t: median_of(cells, mode, t, "text_embed", GOAL_CONCURRENCY, "qps") for t in TARGETS}
    loads = [c["load_avg_1min"] for c in cells if c["mode"] == mode]
    summary: dict[str, Any] = {
        "text_qps_c32": qps,
        "vs_mlflow": ratio(qps["service"], qps["mlflow"]),
        "vs_batching_off": ratio(qps["service"], qps["service_b1"]),
        "p99_ms_c8_text": median_of(cells, mode, "service", "text_embed", 8, "p99_ms"),
        "server_cpu_ms_per_request_c32": median_of(cells, mode, "service", "text_embed",
                                                   GOAL_CONCURRENCY, "server_cpu_ms_per_request"),
        "client_cpu_ms_per_request_c32": median_of(cells, mode, "service", "text_embed",
                                                   GOAL_CONCURRENCY, "client_cpu_ms_per_request"),
        "errors": sum(c["errors"] for c in cells if c["mode"] == mode),
        "servers_died": sorted({c["target"] for c in cells if "server_exit" in c
                                and c["mode"] == mode}),
        "load_avg_1min_range": [min(loads), max(loads)] if loads else None,
    }
    if mode == "shared":
        summary["warmup_errors"] = sum(c["errors"] for c in warmup)
    pairs = [c for c in cells if c["mode"] == mode and c.get("vs_model_limit") is not None]
    if pairs:
        runs = [c["limit"] for c in pairs]
        summary.update(
            vs_model_limit=median(c["vs_model_limit"] for c in pairs),
            vs_model_limit_pairs=[c["vs_model_limit"] for c in pairs],
            service_qps_of_pairs=[c["qps"] for c in pairs],
            model_runs=[r["texts_per_s_mean"] for r in runs], model_rate=LIMIT_RATE,
            model_texts_per_s=median(r["texts_per_s_mean"] for r in runs),
            model_texts_per_s_median_step=median(r["texts_per_s"] for r in runs),
            model_cpu_ms_per_text=median(r["cpu_ms_per_text"] for r in runs),
            limit_batch=[r["batch_size"] for r in runs], limit_cpus=runs[0]["cpus"],
            limit_threads=runs[0]["threads"])
    return summary


def markdown(cells: list[dict[str, Any]]) -> str:
    rows = ["| mode | workload | concurrency | server | QPS | p50 ms | p95 ms | p99 ms "
            "| mean batch | server CPU ms/request | client CPU ms/request | errors | load "
            "| model alone, texts/s (QPS / it) |",
            "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in cells:
        died = f" (server died: {c['server_exit']})" if "server_exit" in c else ""
        rows.append(f"| {c['mode']} | {c['workload']} | {c['concurrency']} | {c['target']} | "
                    f"{c['qps']} | {c['p50_ms']} | {c['p95_ms']} | {c['p99_ms']} | "
                    f"{c.get('mean_batch', '-')} | {c.get('server_cpu_ms_per_request', '-')} | "
                    f"{c['client_cpu_ms_per_request']} | {c['errors']}{died} | "
                    f"{c['load_avg_1min']} | {paired(c)} |")
    return "\n".join(rows)


def paired(cell: dict[str, Any]) -> str:
    if "limit" not in cell:
        return "-"
    return f"{cell['limit']['texts_per_s_mean']} ({cell['vs_model_limit']})"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, default=Path("models/export"))
    p.add_argument("--index", type=Path, default=Path("models/index"))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--seconds", type=float, default=10.0, help="per cell (bounded load)")
    p.add_argument("--max-requests", type=int, default=50000, help="per cell, at most")
    p.add_argument("--rounds", type=int, default=1, help="repeats of every cell; medians kept")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    p.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS))
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--pinned-targets", nargs="+", choices=TARGETS, default=["service"],
                   help="servers measured in the pinned mode (text embeddings)")
    p.add_argument("--server-cpu", type=int, default=1, help="pinned mode: the servers' CPU")
    p.add_argument("--client-cpu", type=int, default=0, help="pinned mode: the client's CPU")
    p.add_argument("--check-every", type=int, default=50,
                   help="decode and check one answer in this many (the rest: status and size)")
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
    p.add_argument("--no-limit", action="store_true",
                   help="skip the model-alone limit (benchmarks.throughput)")
    p.add_argument("--limit-steps", type=int, default=300,
                   help="timed steps per model-alone run (its rate: the mean over them)")
    p.add_argument("--results", "--out", type=Path, dest="results",
                   help="where all cells and the summary are recorded, with the commit, the "
                   "machine and its load (default: benchmarks/results/serving.json)")
    args = p.parse_args()
    if "pinned" in args.modes and len({args.server_cpu, args.client_cpu} &
                                      os.sched_getaffinity(0)) < 2:
        p.error(f"the pinned mode needs two CPUs (--server-cpu {args.server_cpu}, --client-cpu "
                f"{args.client_cpu}) that this process may use: {sorted(os.sched_getaffinity(0))}")
    return args


def main() -> int:
    args = parse_args()
    from clipms.deploy.searchindex import bundle_digest

    dim = json.loads((args.bundle / "bundle.json").read_text())["embed_dim"]
    recording, load_before = record.start("serving"), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="clipms-bench-serving-") as tmp:
        servers: dict[str, Server] = {}
        try:
            start_servers(args, Path(tmp), servers)
            started_on = {name: sorted(os.sched_getaffinity(server.proc.pid))
                          for name, server in servers.items()}
            bench = Bench(args, servers, sample_image(), dim)
            warmup = warm_up(bench)
            cells = run_cells(bench)
        finally:
            for server in servers.values():
                server.stop()
    summary = {mode: summarize(cells, warmup, mode) for mode in args.modes}
    result = {"summary": summary, "cells": cells, "warmup": warmup, "server_cpus": started_on,
              "bundle": record.shown_path(str(args.bundle)),
              "bundle_digest": bundle_digest(args.bundle),
              "mlflow_workers": args.mlflow_workers, "mlflow_timeout_s": args.mlflow_timeout,
              "cpus": os.cpu_count(), "server_cpu": args.server_cpu,
              "client_cpu": args.client_cpu,
              "load_avg_before": [round(x, 2) for x in load_before],
              "load_avg_after": [round(x, 2) for x in os.getloadavg()]}
    print(markdown(cells))
    print(json.dumps(summary, indent=2))
    recording.write(result, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

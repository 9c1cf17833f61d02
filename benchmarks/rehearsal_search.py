"""Search at MSCOCO size: the rehearsal's index of every image, with exact, HNSW and IVF search.

    python benchmarks/rehearsal.py --images 123287 --keep --workdir W     # the index to search
    nice -n 5 python benchmarks/rehearsal_search.py --clone W/clone \
        --out benchmarks/results/search_at_size.json

For each search kind at the `index` section's default settings (`index.search`, `hnsw_m`,
`hnsw_ef_search`, `ivf_nlist`, `ivf_nprobe`): the FAISS index built from the stored embeddings
(`clipms.deploy.searchindex.with_search`: no image embedded again), measured as a child process
(wall, CPU, peak RSS, file size); recall@10 against exact search for text queries (val captions
embedded by the bundle: what /v1/search answers) and image queries (indexed images: "more like
this"), also with a sweep of `hnsw_ef_search` and `ivf_nprobe`; the search alone, one query at a
time, in this process (p50/p99); and each kind served by the search service (`python -m serving`,
one server per kind, all started before the first cell) under the serving benchmark's closed-loop
load (benchmarks/serving_load.py; concurrency 1, 8, 32, 64), two workloads: `text` (a caption:
the text tower, then the search) and `key` (an indexed image's key: the search alone). Per round
the order of the kinds rotates. Reported per cell: QPS, p50/p95/p99 latency, errors, the
server's CPU per request and its RSS.

Recall counts the ids the exact search returns (the usual recall@10). On this synthetic world
thousands of images look alike, so many scores tie to the last digit; `tie_aware_recall@10` also
counts a result whose exact score reaches the exact 10th score (it is as good an answer).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from serving_load import Workload, run_load, workload  # noqa: E402
from serving_servers import Server  # noqa: E402

from benchmarks import record  # noqa: E402
from benchmarks.stage_clock import measure  # noqa: E402

KINDS = ("exact", "hnsw", "ivf")
K = 10
EF_SWEEP = (16, 32, 64, 128, 256)
NPROBE_SWEEP = (1, 4, 8, 16, 32, 64)
# Scratch folders in the recorded command: where the reader's are, not this machine's.
PLACEHOLDERS = {"--clone": "CLONE", "--workdir": "WORKDIR", "--bundle": "BUNDLE",
                "--index": "INDEX"}


def default_options(kind: str) -> Any:
    """The `index` section's defaults (stages/index.py owns them) as SearchOptions of `kind`."""
    from clipms.deploy.search import SearchOptions
    from stages.index import IndexParams

    params = IndexParams()
    return SearchOptions(kind=kind, hnsw_m=params.hnsw_m, hnsw_ef_search=params.hnsw_ef_search,
                         ivf_nlist=params.ivf_nlist, ivf_nprobe=params.ivf_nprobe)


# ------------------------------------------------------------------------------ build + recall
def build_variants(index_dir: Path, workdir: Path) -> tuple[dict[str, Path], dict[str, Any]]:
    """Each kind's index folder and what building it cost. Exact is the rehearsal's own index if
    it searches exactly; an index `index.search: auto` made HNSW (a large collection) gets an
    exact copy, the baseline every recall is measured against. Called before this process loads
    the index: a child's peak RSS (ru_maxrss) starts at its parent's."""
    from clipms.deploy.searchindex import INDEX_JSON

    own_kind = json.loads((index_dir / INDEX_JSON).read_text())["search"]["kind"]
    folders, builds = {"exact": index_dir}, {}
    for kind in [k for k in KINDS if k != "exact" or own_kind != "exact"]:
        folders[kind] = workdir / f"index-{kind}"
        cost = measure([sys.executable, __file__, "build", "--src", str(index_dir), "--dst",
                        str(folders[kind]), "--kind", kind], env={**os.environ})
        if cost.exit_code != 0:
            raise RuntimeError(f"building the {kind} index failed ({cost.exit_code})")
        faiss = folders[kind] / "faiss.index"
        builds[kind] = {**cost.as_dict(), "faiss_index_mb": round(
            faiss.stat().st_size / 2**20, 1) if faiss.is_file() else 0.0}
        print(json.dumps({"build": kind, **builds[kind]}), flush=True)
    return folders, builds


def queries(index: Any, bundle: Path, count: int) -> dict[str, tuple[np.ndarray, list[str]]]:
    """Text queries (val captions through the bundle's text tower) and image queries (indexed
    images' own embeddings), `count` of each, seeded."""
    from clipms.deploy.infer import Encoder

    rng = np.random.default_rng(0)
    rows = rng.choice(len(index), size=min(count, len(index)), replace=False)
    captions = [index.captions[r] for r in rows]
    texts = Encoder(bundle).encode_texts(captions)
    return {"text": (np.asarray(texts, np.float32), captions),
            "image": (np.asarray(index.embeddings[rows], np.float32),
                      [index.keys[r] for r in rows])}


def timed_search(searcher: Any, vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Top-K ids of each query, searched one at a time as the service does, and the ms each
    took."""
    ids, ms = [], []
    for vector in vectors:
        started = time.perf_counter()
        ids.append(searcher.search(vector[None], K)[1][0])
        ms.append((time.perf_counter() - started) * 1000)
    return np.stack(ids), np.asarray(ms)


def recall(found: np.ndarray, exact: np.ndarray, vectors: np.ndarray,
           embeddings: np.ndarray) -> dict[str, float]:
    """recall@K by id, and tie-aware (a result scoring at least the exact K-th score counts)."""
    by_id = np.mean([len(set(f) & set(e)) / K for f, e in zip(found, exact, strict=True)])
    kth = np.einsum("qd,qd->q", vectors, embeddings[exact[:, -1]])
    safe = np.where(found >= 0, found, 0)
    scores = np.einsum("qd,qkd->qk", vectors, embeddings[safe])
    good = (scores >= kth[:, None] - 1e-6) & (found >= 0)
    return {f"recall@{K}": round(float(by_id), 4),
            f"tie_aware_recall@{K}": round(float(np.mean(np.minimum(good.sum(1), K) / K)), 4)}


def search_alone(folders: dict[str, Path], asked: dict[str, tuple[np.ndarray, list[str]]]
                 ) -> list[dict[str, Any]]:
    """Recall and one-query latency of every kind at its default and at each swept setting."""
    from dataclasses import replace

    from clipms.deploy.search import FaissSearch
    from clipms.deploy.searchindex import ImageIndex

    exact_index = ImageIndex.load(folders["exact"])
    embeddings = exact_index.embeddings
    exact_ids = {name: timed_search(exact_index.searcher, v) for name, (v, _) in asked.items()}
    rows = [row_of("exact", {}, exact_ids, exact_ids, asked, embeddings)]
    for kind in KINDS[1:]:
        built = ImageIndex.load(folders[kind]).searcher
        base = default_options(kind)
        sweep = ([replace(base, hnsw_ef_search=ef) for ef in EF_SWEEP] if kind == "hnsw" else
                 [replace(base, ivf_nprobe=n) for n in NPROBE_SWEEP])
        for options in sweep:
            searcher = FaissSearch(built.index, options)
            knob = ({"hnsw_ef_search": options.hnsw_ef_search} if kind == "hnsw" else
                    {"ivf_nlist": int(built.index.nlist), "ivf_nprobe": options.ivf_nprobe})
            found = {name: timed_search(searcher, v) for name, (v, _) in asked.items()}
            row = row_of(kind, knob, found, exact_ids, asked, embeddings)
            row["default"] = options == base
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def row_of(kind: str, knob: dict[str, Any], found: dict[str, tuple[np.ndarray, np.ndarray]],
           exact: dict[str, tuple[np.ndarray, np.ndarray]],
           asked: dict[str, tuple[np.ndarray, list[str]]], embeddings: np.ndarray
           ) -> dict[str, Any]:
    row: dict[str, Any] = {"kind": kind, **knob}
    for name, (ids, ms) in found.items():
        row[name] = {**recall(ids, exact[name][0], asked[name][0], embeddings),
                     "p50_ms": round(float(np.percentile(ms, 50)), 3),
                     "p99_ms": round(float(np.percentile(ms, 99)), 3)}
    return row


# ------------------------------------------------------------------------------ the service
def key_workload(keys: list[str]) -> Workload:
    """/v1/search by an indexed image's key: no model call, the search alone."""
    bodies = [json.dumps({"key": key, "k": K}).encode() for key in keys]
    return Workload("/v1/search", lambda i: bodies[i % len(bodies)],
                    lambda answer: None if len(answer["results"]) == K else
                    f"{len(answer['results'])} results")


def start_servers(bundle: Path, folders: dict[str, Path], workdir: Path) -> dict[str, Server]:
    """One service per kind, all started at once (the caller waits for them)."""
    servers: dict[str, Server] = {}
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for kind, folder in folders.items():
        cmd = [sys.executable, "-m", "serving", "--model", str(bundle), "--index", str(folder),
               "--port", "{port}", "--max-batch", "32", "--max-wait-ms", "5", "--max-queue",
               "4096", "--log-level", "info"]
        servers[kind] = Server(f"search-{kind}", cmd, "/readyz", env, workdir)
    return servers


def tree_rss_mb(server: Server) -> float:
    import psutil

    root = psutil.Process(server.proc.pid)
    return round(sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
                 / 2**20, 1)


def service_cells(args: argparse.Namespace, servers: dict[str, Server],
                  works: dict[str, Workload]) -> list[dict[str, Any]]:
    """Every (workload, concurrency) cell for every kind, `--rounds` times, kinds rotating."""
    kinds, cells = list(servers), []
    for name in args.workloads:  # untimed warm-up: compiles, first touches of the index
        for kind in kinds:
            run_load(("127.0.0.1", servers[kind].port), works[name], 8, args.warmup_s, 10**9, 50)
    for name in args.workloads:
        for concurrency in args.concurrency:
            for rnd in range(args.rounds):
                for kind in kinds[rnd % len(kinds):] + kinds[:rnd % len(kinds)]:
                    server = servers[kind]
                    cpu = server.cpu_seconds()
                    cell = run_load(("127.0.0.1", server.port), works[name], concurrency,
                                    args.seconds, 10**9, 50)
                    if cell["requests"]:
                        cell["server_cpu_ms_per_request"] = round(
                            (server.cpu_seconds() - cpu) * 1000 / cell["requests"], 3)
                    cell.update(kind=kind, workload=name, concurrency=concurrency, round=rnd,
                                server_rss_mb=tree_rss_mb(server),
                                server_exit=server.exit_code(),
                                load_avg_1min=round(os.getloadavg()[0], 2))
                    cells.append(cell)
                    print(json.dumps(cell), flush=True)
    return cells


def summarize(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over rounds of QPS, p50 and p99 per kind, workload and concurrency."""
    out: dict[str, Any] = {}
    for cell in cells:
        key = f"{cell['kind']}/{cell['workload']}/c{cell['concurrency']}"
        out.setdefault(key, []).append(cell)
    return {key: {m: float(np.median([c[m] for c in group]))
                  for m in ("qps", "p50_ms", "p99_ms")} | {
                      "errors": sum(c["errors"] for c in group)}
            for key, group in out.items()}


# ------------------------------------------------------------------------------ main
def build_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rehearsal_search.py build")
    p.add_argument("--src", type=Path, required=True)
    p.add_argument("--dst", type=Path, required=True)
    p.add_argument("--kind", choices=KINDS, required=True)
    args = p.parse_args(argv)
    from clipms.deploy.searchindex import with_search

    with_search(args.src, args.dst, default_options(args.kind))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clone", type=Path, help="a rehearsal clone kept with --keep "
                   "(its models/export and models/index)")
    p.add_argument("--bundle", type=Path, help="an export bundle (default: CLONE/models/export)")
    p.add_argument("--index", type=Path, help="an exact index (default: CLONE/models/index)")
    p.add_argument("--workdir", type=Path, help="where the hnsw/ivf copies and server logs go "
                   "(default: a new temporary folder)")
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--workloads", nargs="+", choices=("text", "key"), default=["text", "key"])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=record.default_path("search_at_size"))
    args = p.parse_args(argv)
    if args.clone:
        args.bundle = args.bundle or args.clone / "models" / "export"
        args.index = args.index or args.clone / "models" / "index"
    if not (args.bundle and args.index):
        p.error("give --clone, or --bundle and --index")
    args.workdir = args.workdir or Path(tempfile.mkdtemp(prefix="clipms-search-"))
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["build"]:
        return build_main(argv[1:])
    args = parse_args(argv)
    from clipms.deploy.searchindex import ImageIndex

    recording = record.start(args.out.stem, [str(Path(__file__).relative_to(ROOT)),
                                             *record.with_placeholders(argv, PLACEHOLDERS)])
    result: dict[str, Any] = {}
    folders, builds = build_variants(args.index, args.workdir)
    index = ImageIndex.load(args.index)
    result.update(rows=len(index), dim=int(index.meta["dim"]), k=K,
                  defaults={kind: vars(default_options(kind)) for kind in KINDS}, build=builds)
    asked = queries(index, args.bundle, args.queries)
    del index
    result["search_alone"] = search_alone(folders, asked)
    started = time.perf_counter()
    servers = start_servers(args.bundle, folders, args.workdir)
    try:
        result["servers_ready_s"], result["server_rss_mb_idle"] = {}, {}
        for kind, server in servers.items():  # started together: they share the cores
            server.wait(args.startup_timeout)
            result["servers_ready_s"][kind] = round(time.perf_counter() - started, 1)
            result["server_rss_mb_idle"][kind] = tree_rss_mb(server)
        works = {"text": workload("service", "text_search", "", result["dim"]),
                 "key": key_workload(asked["image"][1])}
        result["cells"] = service_cells(args, servers, works)
    finally:
        for server in servers.values():
            server.stop()
    result["summary"] = summarize(result["cells"])
    recording.write(result, args.out)
    print(f"search benchmark: figures in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

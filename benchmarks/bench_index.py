"""Approximate search (FAISS HNSW, IVF) against exact search on random unit vectors.

    python benchmarks/bench_index.py --rows 100000 --dim 256 --queries 1000

Random vectors have no cluster structure, so they are the hard case for approximate indexes: the
recall@10 here is a floor, real CLIP embeddings cluster. Prints one JSON line per index: build
seconds, mean query milliseconds (one query at a time, as the service searches), and recall@10
against `clipms.deploy.search.ExactSearch` on the same vectors, and records them all, with the
commit, the machine and its load, in benchmarks/results/index.json (`--results` for another path).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import record  # benchmarks/record.py, beside this script

from clipms.deploy.search import ExactSearch, FaissSearch, SearchOptions


def unit(rows: int, dim: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((rows, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def timed_queries(searcher, queries: np.ndarray, k: int) -> tuple[np.ndarray, float]:
    ids, started = [], time.perf_counter()
    for query in queries:
        ids.append(searcher.search(query[None], k)[1][0])
    return np.stack(ids), (time.perf_counter() - started) / len(queries) * 1000


def recall(found: np.ndarray, exact: np.ndarray) -> float:
    return float(np.mean([len(set(f) & set(e)) / exact.shape[1]
                          for f, e in zip(found, exact, strict=True)]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=256, help="embedding size (the tiny preset's)")
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--results", type=Path,
                   help="result file (default: benchmarks/results/index.json)")
    args = p.parse_args()
    recording, rows = record.start("index"), []
    vectors, queries = unit(args.rows, args.dim, 0), unit(args.queries, args.dim, 1)
    exact = ExactSearch(vectors)
    exact_ids, exact_ms = timed_queries(exact, queries, args.k)
    common = {"rows": args.rows, "dim": args.dim, "queries": args.queries, "k": args.k}
    rows.append({"index": "exact", **common, "query_ms": round(exact_ms, 3),
                 f"recall@{args.k}": 1.0, "load_avg_1min": round(os.getloadavg()[0], 2)})
    print(json.dumps(rows[-1]), flush=True)
    configs = [SearchOptions("hnsw", hnsw_ef_search=ef) for ef in (64, 128, 256)]
    configs += [SearchOptions("ivf", ivf_nprobe=n) for n in (8, 16, 64)]
    built: dict[str, tuple[FaissSearch, float]] = {}
    for options in configs:
        key = options.kind  # one build per kind; the search-time knob varies
        if key not in built:
            started = time.perf_counter()
            built[key] = (FaissSearch.build(vectors, options), time.perf_counter() - started)
        searcher = FaissSearch(built[key][0].index, options)
        ids, ms = timed_queries(searcher, queries, args.k)
        knob = ({"ef_search": options.hnsw_ef_search} if options.kind == "hnsw" else
                {"nlist": searcher.index.nlist, "nprobe": options.ivf_nprobe})
        rows.append({"index": options.kind, **knob, **common,
                     "build_s": round(built[key][1], 1), "query_ms": round(ms, 3),
                     "speedup_vs_exact": round(exact_ms / ms, 1),
                     f"recall@{args.k}": round(recall(ids, exact_ids), 4),
                     "load_avg_1min": round(os.getloadavg()[0], 2)})
        print(json.dumps(rows[-1]), flush=True)
    recording.write(rows, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

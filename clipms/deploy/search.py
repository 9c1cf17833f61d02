"""Nearest neighbours of unit-length embeddings by inner product (= cosine similarity).

`ExactSearch` is the default: a chunked matrix product with a running top-k, exact, memory bounded
by `chunk_rows` x queries scores at a time, no extra files. `FaissSearch` wraps an approximate FAISS
index (`faiss-cpu`, the optional `serve` extra) for collections where a full scan per query is too
slow: `hnsw` (a graph, no training) or `ivf` (k-means cells, `nprobe` of them scanned per query).
How close the approximation comes is measured by `benchmarks/bench_index.py` (recall@10 against
`ExactSearch`) and, on a 123k-image collection, by `benchmarks/rehearsal_search.py`. The kind
`auto` picks by size (`SearchOptions.resolved`): exact while a full scan is cheap, HNSW beyond.

Every searcher answers `search(queries (Q, E) float32, k) -> (scores (Q, k), ids (Q, k))`, best
first, ids into the collection's rows; k is cut to the collection's size.
"""

# tested by: tests/clipms/deploy/test_searchindex.py

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

SEARCH_KINDS = ("exact", "hnsw", "ivf")
AUTO = "auto"  # a setting, not a kind: resolved to one of SEARCH_KINDS by the collection's size
# `auto` scans exactly up to this many cells (rows x dim) and uses HNSW beyond. A scan reads every
# cell once per query, memory-bound: ~8 CPU-ms a query at 123,287 x 128 on the machine of
# docs/scaling.md ("Search at MSCOCO size", with HNSW's recall and speed on a rehearsal's index);
# the line is where a scan costs about 1 CPU-ms.
AUTO_EXACT_MAX_CELLS = 2_000_000


class Searcher(Protocol):
    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]: ...


@dataclass(frozen=True)
class SearchOptions:
    """How the approximate indexes are built and searched (ignored by `exact`)."""

    kind: str = "exact"
    hnsw_m: int = 32  # graph degree
    hnsw_ef_construction: int = 200
    hnsw_ef_search: int = 128  # candidates kept per query: recall vs speed
    ivf_nlist: int = 0  # k-means cells; 0: 4 sqrt(N), at most N / 39 (FAISS's minimum per cell)
    ivf_nprobe: int = 16  # cells scanned per query

    def __post_init__(self) -> None:
        if self.kind not in (*SEARCH_KINDS, AUTO):
            raise ValueError(f"search kind {self.kind!r} is not one of {(*SEARCH_KINDS, AUTO)}")

    def resolved(self, rows: int, dim: int) -> SearchOptions:
        """These options for a collection of `rows` x `dim`: `auto` becomes `exact` up to
        AUTO_EXACT_MAX_CELLS cells and `hnsw` beyond; any other kind stays as it is."""
        if self.kind != AUTO:
            return self
        return replace(self, kind="exact" if rows * dim <= AUTO_EXACT_MAX_CELLS else "hnsw")


class ExactSearch:
    """Exact top-k by a chunked matrix product over the (N, E) float32 rows."""

    def __init__(self, vectors: np.ndarray, chunk_rows: int = 65536) -> None:
        self.vectors = vectors
        self.chunk_rows = chunk_rows

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        queries = np.atleast_2d(np.asarray(queries, np.float32))
        k = min(k, self.vectors.shape[0])
        best_scores = np.full((queries.shape[0], 0), -np.inf, np.float32)
        best_ids = np.zeros((queries.shape[0], 0), np.int64)
        for start in range(0, self.vectors.shape[0], self.chunk_rows):
            scores = queries @ np.asarray(self.vectors[start:start + self.chunk_rows]).T
            take = min(k, scores.shape[1])
            local = np.argpartition(-scores, take - 1, axis=1)[:, :take]
            best_scores = np.concatenate(
                [best_scores, np.take_along_axis(scores, local, axis=1)], axis=1)
            best_ids = np.concatenate([best_ids, local + start], axis=1)
            best_scores, best_ids = _top(best_scores, best_ids, k)
        return best_scores, best_ids


def _top(scores: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best per row, best first; equal scores in id order (a stable, reproducible order)."""
    order = np.lexsort((ids, -scores), axis=1)[:, :k]
    return np.take_along_axis(scores, order, axis=1), np.take_along_axis(ids, order, axis=1)


class FaissSearch:
    """An approximate FAISS index (inner product) over the same rows."""

    def __init__(self, index: Any, options: SearchOptions) -> None:
        self.index = index
        self.options = options
        self._configure()

    @classmethod
    def build(cls, vectors: np.ndarray, options: SearchOptions) -> FaissSearch:
        faiss = _faiss()
        vectors = np.ascontiguousarray(vectors, np.float32)
        dim = vectors.shape[1]
        if options.kind == "hnsw":
            index = faiss.IndexHNSWFlat(dim, options.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            index.hnsw.efConstruction = options.hnsw_ef_construction
        elif options.kind == "ivf":
            nlist = options.ivf_nlist or ivf_cells(vectors.shape[0])
            index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist,
                                       faiss.METRIC_INNER_PRODUCT)
            index.train(vectors)
        else:
            raise ValueError(f"FaissSearch builds hnsw or ivf, not {options.kind!r}")
        index.add(vectors)
        return cls(index, options)

    @classmethod
    def load(cls, path: Path | str, options: SearchOptions) -> FaissSearch:
        return cls(_faiss().read_index(str(path)), options)

    def save(self, path: Path | str) -> None:
        _faiss().write_index(self.index, str(path))

    def _configure(self) -> None:
        if self.options.kind == "hnsw":
            self.index.hnsw.efSearch = self.options.hnsw_ef_search
        elif self.options.kind == "ivf":
            self.index.nprobe = self.options.ivf_nprobe

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        queries = np.ascontiguousarray(np.atleast_2d(queries), np.float32)
        k = min(k, self.index.ntotal)
        scores, ids = self.index.search(queries, k)
        return scores, ids.astype(np.int64)  # -1 marks "fewer than k found" (sparse IVF cells)


def ivf_cells(rows: int) -> int:
    return max(1, min(int(4 * np.sqrt(rows)), rows // 39))


def _faiss() -> Any:
    try:
        import faiss
    except ImportError as err:
        raise ImportError("approximate search needs faiss-cpu: pip install -e '.[serve]'") from err
    return faiss

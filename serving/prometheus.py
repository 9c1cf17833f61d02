"""Prometheus metrics of the service (`GET /metrics`), in a registry of its own per app."""

# tested by: tests/serving/test_guard.py

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

ENDPOINTS = ("/", "/v1/embeddings", "/v1/search", "/v1/rank", "/v1/thumbnails", "/v1/model",
             "/healthz", "/readyz", "/metrics", "/static")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
REASON_CHARS = 300


def endpoint_label(path: str) -> str:
    """A bounded label: the endpoint a path belongs to, or `other` (unknown paths, probes)."""
    for endpoint in ENDPOINTS[1:]:
        if path == endpoint or path.startswith(endpoint + "/"):
            return endpoint
    return "/" if path == "/" else "other"


class ServiceMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("clipms_requests", "HTTP requests answered",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("clipms_request_seconds", "Time to answer a request",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("clipms_batch_size", "Items per model call", ["tower"],
                                    buckets=BATCH_BUCKETS, registry=r)
        self.batch_seconds = Histogram("clipms_batch_seconds", "Time of one model call",
                                       ["tower"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("clipms_queue_depth", "Items waiting for a batch", ["tower"],
                                 registry=r)
        self.model = Gauge("clipms_model_info", "The model version being served (value 1)",
                           ["name", "version", "alias"], registry=r)
        self.index_rows = Gauge("clipms_index_rows", "Images in the served index", registry=r)
        self.swaps = Counter("clipms_model_swaps", "Model versions swapped in", registry=r)
        self.swap_failures = Counter("clipms_model_swap_failures",
                                     "Model versions that could not be loaded", registry=r)
        self.last_swap_failure = Gauge(
            "clipms_model_swap_failure_info",
            "The last version that could not be swapped in, and why (value: unix time)",
            ["version", "reason"], registry=r)
        self._towers: dict[str, tuple[Any, Any]] = {}

    def observe_batch(self, tower: str, size: int, seconds: float) -> None:
        children = self._towers.get(tower)
        if children is None:  # labels() locks and looks up; once per tower, not per batch
            children = self._towers[tower] = (self.batch_size.labels(tower),
                                              self.batch_seconds.labels(tower))
        children[0].observe(size)
        children[1].observe(seconds)

    def serving(self, name: str, version: str, alias: str | None, rows: int) -> None:
        self.model.clear()
        self.model.labels(name, version, alias or "").set(1)
        self.index_rows.set(rows)

    def swap_failed(self, version: str, reason: str, when: float) -> None:
        self.swap_failures.inc()
        self.last_swap_failure.clear()
        self.last_swap_failure.labels(version, " ".join(reason.split())[:REASON_CHARS]).set(when)

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""The load client of benchmarks/bench_serving.py, and CPU pinning of it and of the servers.

The client is as cheap per request as a load generator can be in Python: C closed-loop clients,
each on its own keep-alive HTTP/1.1 connection (asyncio streams, on uvloop when installed), every
request body encoded once up front (the text of a text request varies per request), and of an
answer only the status line and the Content-Length (or chunked) framing are read - except one
answer in `check_every`, which is decoded and checked (`check(answer)`: None when right, else what
is wrong; a wrong answer counts as an error). The client's own CPU time is measured per cell.

`pin(pids, cpus)` restricts every thread of the given processes (and so the threads they start
later) to `cpus`: the benchmark's `pinned` mode puts the client on one CPU, its servers having
started on the other, so a QPS figure shows the server's own work, not the client's share of the
same cores.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REQUEST_TIMEOUT_S = 60.0


class Framing(RuntimeError):
    """An HTTP answer the client cannot frame."""


def pin(pids: Iterable[int], cpus: set[int]) -> None:
    """Every thread of every process in `pids` may run only on `cpus`."""
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                os.sched_setaffinity(int(task.name), cpus)
            except (ProcessLookupError, FileNotFoundError):
                continue  # the thread ended meanwhile


@dataclass
class Workload:
    """What a cell sends: `body(i)` the JSON bytes of request i, to `path`; `check(answer)`
    None when a decoded answer is right, else what is wrong."""

    path: str
    body: Callable[[int], bytes]
    check: Callable[[Any], str | None]


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    first_error: str | None = None
    checked: int = 0

    def error(self, detail: str) -> None:
        self.errors += 1
        self.first_error = self.first_error or detail


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """(status, body, the server keeps the connection) of one HTTP/1.1 answer."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length, chunked, close = None, False, False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
        elif name == b"connection" and b"close" in value.lower():
            close = True
    if length is not None:
        return status, await reader.readexactly(length), not close
    if not chunked:
        raise Framing(f"HTTP {status} without Content-Length or chunked encoding")
    parts = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        parts.append(await reader.readexactly(size + 2))
        if size == 0:
            return status, b"".join(parts)[:-2], not close


class Client:
    """One keep-alive connection; reconnects after an answer that closes it or an error."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (path.encode(), self.host.encode(),
                                                             self.port, len(body), body))
        status, payload, keep = await read_answer(self.reader)
        if not keep:
            self.close()
        return status, payload

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def _client(url: tuple[str, int], work: Workload, tally: Tally, sent: list[int],
                  deadline: float, max_requests: int, check_every: int) -> None:
    import json

    client = Client(*url)
    try:
        while time.monotonic() < deadline and sent[0] < max_requests:
            sent[0] += 1
            i = sent[0]
            started = time.perf_counter()
            try:
                async with asyncio.timeout(REQUEST_TIMEOUT_S):
                    status, payload = await client.post(work.path, work.body(i))
                latency = time.perf_counter() - started
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, Framing,
                    ValueError, TimeoutError) as err:
                client.close()
                tally.error(f"{type(err).__name__}: {err}")
                continue
            if status != 200:
                tally.error(f"HTTP {status}: {payload[:200]!r}")
                continue
            if i % check_every == 0:  # a sample is decoded and checked
                tally.checked += 1
                try:
                    wrong = work.check(json.loads(payload))
                except ValueError as err:
                    wrong = f"not JSON: {err}"
                if wrong:
                    tally.error(f"wrong answer: {wrong}")
                    continue
            tally.latencies.append(latency)
    finally:
        client.close()


def new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run_load(url: tuple[str, int], work: Workload, concurrency: int, seconds: float,
             max_requests: int, check_every: int) -> dict[str, Any]:
    """C closed-loop clients for `seconds` (at most `max_requests` in all): QPS, latency
    percentiles, errors, and the client's CPU time per answered request."""
    tally, sent = Tally(), [0]

    async def main() -> None:
        deadline = time.monotonic() + seconds
        await asyncio.gather(*(_client(url, work, tally, sent, deadline, max_requests,
                                       check_every) for _ in range(concurrency)))

    cpu, started = time.process_time(), time.perf_counter()
    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(main())
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    ms = np.asarray(tally.latencies) * 1000 if tally.latencies else np.zeros(1)
    answered = len(tally.latencies)
    return {"requests": answered, "errors": tally.errors, "first_error": tally.first_error,
            "checked": tally.checked, "seconds": round(elapsed, 2),
            "qps": round(answered / elapsed, 1),
            "p50_ms": round(float(np.percentile(ms, 50)), 1),
            "p95_ms": round(float(np.percentile(ms, 95)), 1),
            "p99_ms": round(float(np.percentile(ms, 99)), 1),
            "client_cpu_ms_per_request": round(cpu * 1000 / answered, 3) if answered else None}


def workload(target: str, kind: str, image: str, dim: int) -> Workload | None:
    """What `target` gets for `kind`; None when it has no such endpoint (the pyfunc: search)."""
    text = b'"a photo of thing number %d"'
    image_json = f'"{image}"'.encode()

    def rows(answer: Any, key: str) -> str | None:
        got = answer[key]
        if len(got) != 1 or len(got[0]) != dim:
            return f"{key}: expected 1 row of {dim}, got {len(got)}"
        norm = float(np.linalg.norm(got[0]))
        return None if abs(norm - 1) < 1e-3 else f"{key}: row norm {norm}"

    if target == "mlflow":
        if kind == "text_search":
            return None
        column, value = ("text", text) if kind == "text_embed" else ("image", image_json)
        body = b'{"dataframe_split": {"columns": ["%s"], "data": [[%s]]}}' % (column.encode(),
                                                                              value)
        return Workload("/invocations", lambda i: body.replace(b"%d", b"%d" % i),
                        lambda answer: None if len(answer["predictions"]) == 1 else
                        f"{len(answer['predictions'])} predictions")
    if kind == "text_embed":
        body = b'{"texts": [%s]}' % text
        return Workload("/v1/embeddings", lambda i: body.replace(b"%d", b"%d" % i),
                        lambda answer: rows(answer, "text_embeddings"))
    if kind == "image_embed":
        body = b'{"images": [%s]}' % image_json
        return Workload("/v1/embeddings", lambda i: body,
                        lambda answer: rows(answer, "image_embeddings"))
    body = b'{"text": %s, "k": 10}' % text
    return Workload("/v1/search", lambda i: body.replace(b"%d", b"%d" % i),
                    lambda answer: None if len(answer["results"]) == 10 else
                    f"{len(answer['results'])} results")

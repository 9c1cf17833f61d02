"""The ASGI app in front of every request (and of the Starlette app): who may ask, how the body
arrives, the metrics, and the header that names the model version which answered.

Before a byte of the body is read, in this order:
- `Host` and `Origin` must name the service (serving.hosts: no page of another site, no DNS
  rebinding; 400 and 403);
- with a token, every request to a PROTECTED endpoint needs `Authorization: Bearer <token>` (401);
  the page, its static files, /v1/model and the probes stay open;
- a POST must declare its body JSON (`Content-Type: application/json`; 415): a browser sends a
  cross-origin `text/plain` POST without asking the service first (no CORS preflight), a JSON one
  only after a preflight this service never approves.

The body is read here, at most `max_body` bytes (a larger Content-Length is refused before a byte
of the body is read; a chunked body is cut off as soon as it passes the limit: 413), and handed
to the app from memory, so no handler ever sees an unbounded body (how long it may take to arrive
is the connection's limit: serving.protocol). A client that disconnects before its answer is
complete has its request cancelled: the rows it queued leave the batches, the images it sent are
not decoded (the metrics count it as status 499, as nginx names a request its client closed). A
request is watched for that only once it has taken WATCH_AFTER_S: one sweep of the requests in
flight every WATCH_AFTER_S gives a watcher task to those that old, so the common request, answered
sooner, costs only its entry in the set of requests in flight.

`direct` handlers answer a POST to their path here (any other method: 405), from the body read,
without the Starlette app (its middleware, router, Request and Response objects cost more per
request than the rest of the answer): `await handler(scope, body) -> (status, JSON bytes, extra
headers)`. They get the same checks, body limit, metrics and X-Model-Version as every other
request.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from serving.hosts import HostPolicy, shown
from serving.prometheus import ENDPOINTS, endpoint_label

MODEL_SCOPE_KEY = "clipms.model.clip"  # set by the handler to the ModelInfo of the engine it used
BODY_SCOPE_KEY = "clipms.body"  # the body as read here (within the limit), for the handlers
LABELS = {endpoint: endpoint for endpoint in ENDPOINTS if endpoint != "/static"}  # exact paths
MODEL_ENDPOINTS = frozenset({"/v1/embeddings", "/v1/search", "/v1/rank"})
PROTECTED = frozenset({"/v1/embeddings", "/v1/search", "/v1/rank", "/v1/thumbnails", "/metrics"})
CLIENT_GONE = 499  # the metrics' status of a request whose client left before its answer
WATCH_AFTER_S = 0.25  # a request still unanswered after this is cancelled if its client leaves
CLOSE = (b"connection", b"close")
Scope = dict[str, Any]
Headers = list[tuple[bytes, bytes]]
Direct = Callable[[Scope, bytes], Awaitable[tuple[int, bytes, Headers]]]


class Refused(Exception):
    """A request answered with an error before its handler runs."""

    def __init__(self, status: int, message: str, headers: Headers | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or []


class ClientGone(Exception):
    """The client disconnected before its request was read or answered."""


class InFlight:
    """A request being answered: its task, its channel, when it started, whether its answer is
    complete, whether its client left, and its watcher (once it has one)."""

    __slots__ = ("task", "receive", "started", "answered", "gone", "watcher")

    def __init__(self, task: asyncio.Task | None, receive: Any, started: float) -> None:
        self.task, self.receive, self.started = task, receive, started
        self.answered = self.gone = False
        self.watcher: asyncio.Task | None = None

    async def watch(self) -> None:
        """Cancel the request when its client disconnects before the answer is complete. Once
        the body is read, receive() returns only when the connection closes or the answer is
        complete (uvicorn)."""
        message = await self.receive()
        if message["type"] == "http.disconnect" and not self.answered and self.task is not None:
            self.gone = True
            self.task.cancel()


CHECKED = frozenset({b"host", b"origin", b"content-type", b"content-length"})
DECISIONS_KEPT = 1024  # Host/Origin decisions remembered (a client sends the same ones again)


def checked_headers(scope: Scope) -> dict[bytes, bytes]:
    """The headers the guard checks, in one pass over the request's."""
    return {key: value for key, value in scope.get("headers", ()) if key in CHECKED}


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("latin-1")


class Guard:
    def __init__(self, app: Any, state: Any, max_body: int, token: str | None = None,
                 direct: dict[str, Direct] | None = None, hosts: HostPolicy | None = None,
                 watch_after_s: float = WATCH_AFTER_S) -> None:
        self.app = app
        self.state = state
        self.direct = direct or {}
        self.max_body = max_body
        self.hosts = hosts or HostPolicy.for_bind("127.0.0.1")
        self.watch_after_s = watch_after_s
        self._inflight: set[InFlight] = set()
        self._swept: asyncio.AbstractEventLoop | None = None  # the loop the sweep runs on
        self._decided: dict[tuple[bytes | None, bytes | None], bool] = {}  # (Host, Origin)
        self._expected = f"Bearer {token}".encode() if token else None
        self._counters: dict[tuple[str, int], Any] = {}  # the metrics' children, looked up once
        self._latencies: dict[str, Any] = {}

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = LABELS.get(path) or endpoint_label(path)
        started = time.perf_counter()
        status = 500
        flight = InFlight(asyncio.current_task(), receive, started)

        async def send_named(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"x-model-version", self._version(scope))]}
            elif not message.get("more_body", False):
                flight.answered = True
            await send(message)

        connection = self._returning(scope, endpoint)
        if connection is not None:
            self.state.returning.arrived(connection)
        try:
            headers = checked_headers(scope)
            self._check(scope, endpoint, headers)
            body = await self._read_body(headers, receive)
            if await self._answered_unless_gone(
                    flight, self._handle(scope, path, body, receive, send_named)):
                status = CLIENT_GONE
        except Refused as refusal:
            await _refuse(send_named, refusal.status, refusal.message, refusal.headers)
        except ClientGone:
            status = CLIENT_GONE
        finally:
            self._observe(endpoint, status, time.perf_counter() - started)
            if connection is not None and status == 200:
                self.state.returning.answered(connection)

    async def _answered_unless_gone(self, flight: InFlight, work: Awaitable[None]) -> bool:
        """Run `work` (the request's handling, in this task) while it is in flight; True when
        its client left and it was cancelled (the sweep's watcher did it)."""
        self._ensure_sweeper()
        self._inflight.add(flight)
        try:
            await work
        except asyncio.CancelledError:
            if not flight.gone or flight.task is None:
                raise
            flight.task.uncancel()
        finally:
            self._inflight.discard(flight)
            if flight.watcher is not None:
                flight.watcher.cancel()
        return flight.gone

    def _ensure_sweeper(self) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self._swept:  # the first request on this loop
            self._swept = loop
            loop.create_task(self._sweep(), name="guard-sweep")

    async def _sweep(self) -> None:
        """Every watch_after_s: a watcher for each request in flight at least that long."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.watch_after_s)
            old = time.perf_counter() - self.watch_after_s
            for flight in list(self._inflight):
                if flight.watcher is None and not flight.answered and flight.started <= old:
                    flight.watcher = loop.create_task(flight.watch())

    async def _handle(self, scope: Scope, path: str, body: bytes, receive: Any,
                      send: Any) -> None:
        handler = self.direct.get(path)
        if handler is None:
            scope[BODY_SCOPE_KEY] = body
            await self.app(scope, _replay(body, receive), send)
        elif scope["method"] != "POST":
            await _refuse(send, 405, "Method Not Allowed", [(b"allow", b"POST")])
        else:
            status, payload, headers = await handler(scope, body)
            await _answer(send, status, payload, headers)

    def _check(self, scope: Scope, endpoint: str, headers: dict[bytes, bytes]) -> None:
        """Refused unless the request may be read: Host, Origin, token, content type."""
        host, origin = headers.get(b"host"), headers.get(b"origin")
        if not self._decided.get((host, origin), False):
            self._check_names(host, origin)
        if endpoint in PROTECTED and not self._authorized(scope):
            raise Refused(401, "missing or wrong bearer token (Authorization: Bearer <token>)",
                          [(b"www-authenticate", b"Bearer"), CLOSE])
        if scope["method"] == "POST" and not _json(headers.get(b"content-type")):
            raise Refused(415, "the request body must be JSON, sent with Content-Type: "
                          "application/json", [CLOSE])

    def _check_names(self, host_header: bytes | None, origin_header: bytes | None) -> None:
        """Refused unless Host and Origin name the service; a pair that does is remembered."""
        host, origin = _text(host_header), _text(origin_header)
        if host is not None and not self.hosts.allows_host(host):
            raise Refused(400, f"Host {shown(host)} is not a name of this service (its bind "
                          "address, or a name given with --allowed-host)", [CLOSE])
        if origin is not None and not self.hosts.allows_origin(origin, host):
            raise Refused(403, f"requests from the page at {shown(origin)} are refused: only "
                          "the service's own page (or an --allowed-host name) may call it",
                          [CLOSE])
        if len(self._decided) >= DECISIONS_KEPT:
            self._decided.clear()
        self._decided[host_header, origin_header] = True

    @staticmethod
    def _returning(scope: Scope, endpoint: str) -> Any:
        """The connection of a model request that may come back on it (keep-alive), else None."""
        if endpoint not in MODEL_ENDPOINTS or scope.get("client") is None:
            return None
        for name, value in scope.get("headers", ()):
            if name == b"connection" and b"close" in value.lower():
                return None
        return tuple(scope["client"])

    def _authorized(self, scope: Scope) -> bool:
        if self._expected is None:
            return True
        given = next((v for k, v in scope.get("headers", []) if k == b"authorization"), b"")
        return hmac.compare_digest(given, self._expected)

    def _observe(self, endpoint: str, status: int, seconds: float) -> None:
        counter = self._counters.get((endpoint, status))
        if counter is None:
            counter = self._counters[endpoint, status] = self.state.metrics.requests.labels(
                endpoint, str(status))
        latency = self._latencies.get(endpoint)
        if latency is None:
            latency = self._latencies[endpoint] = self.state.metrics.latency.labels(endpoint)
        counter.inc()
        latency.observe(seconds)

    def _version(self, scope: Scope) -> bytes:
        info = scope.get(MODEL_SCOPE_KEY) or getattr(self.state.engine, "info", None)
        return info.header if info else b"none"

    async def _read_body(self, headers: dict[bytes, bytes], receive: Any) -> bytes:
        """The whole body; Refused when it is over the limit, ClientGone when the client left
        before sending it all."""
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            raise self._too_large()
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self) -> Refused:
        return Refused(413, f"request body over the limit of {self.max_body} bytes", [CLOSE])


def _json(content_type: bytes | None) -> bool:
    """Whether a Content-Type header declares JSON (`application/json`, any parameters)."""
    if content_type == b"application/json":
        return True
    return content_type is not None and content_type.split(b";", 1)[0].strip().lower() == \
        b"application/json"


async def _refuse(send: Any, status: int, message: str, headers: Headers) -> None:
    await _answer(send, status, json.dumps({"error": message}).encode(), headers)


async def _answer(send: Any, status: int, body: bytes, headers: Headers) -> None:
    """A JSON answer of `body` with `headers`."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", b"%d" % len(body)), *headers]})
    await send({"type": "http.response.body", "body": body})


def _replay(body: bytes, receive: Any) -> Any:
    """The body once, then the real channel (which reports the client's disconnect)."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay

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
of the body is read; a chunked body is cut off as soon as it passes the limit: 413), within
`body_timeout_s` (408), and handed to the app from memory, so no handler ever sees an unbounded
body. A client that disconnects before its answer is complete has its request cancelled: the
rows it queued leave the batches, the images it sent are not decoded (the metrics count it as
status 499, as nginx names a request its client closed).

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
from serving.metrics import ENDPOINTS, endpoint_label

MODEL_SCOPE_KEY = "clipms.model.clip"  # set by the handler to the ModelInfo of the engine it used
BODY_SCOPE_KEY = "clipms.body"  # the body as read here (within the limit), for the handlers
LABELS = {endpoint: endpoint for endpoint in ENDPOINTS if endpoint != "/static"}  # exact paths
MODEL_ENDPOINTS = frozenset({"/v1/embeddings", "/v1/search", "/v1/rank"})
PROTECTED = frozenset({"/v1/embeddings", "/v1/search", "/v1/rank", "/v1/thumbnails", "/metrics"})
CLIENT_GONE = 499  # the metrics' status of a request whose client left before its answer
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


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


class Guard:
    def __init__(self, app: Any, state: Any, max_body: int, token: str | None = None,
                 direct: dict[str, Direct] | None = None, hosts: HostPolicy | None = None,
                 body_timeout_s: float = 30.0) -> None:
        self.app = app
        self.state = state
        self.direct = direct or {}
        self.max_body = max_body
        self.hosts = hosts or HostPolicy.for_bind("127.0.0.1")
        self.body_timeout_s = body_timeout_s
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
        status, answered = 500, False

        async def send_named(message: dict[str, Any]) -> None:
            nonlocal status, answered
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"x-model-version", self._version(scope))]}
            elif not message.get("more_body", False):
                answered = True
            await send(message)

        connection = self._returning(scope, endpoint)
        if connection is not None:
            self.state.returning.arrived(connection)
        try:
            self._check(scope, endpoint)
            body = await self._read_body(scope, receive)
            if await _cancelled_when_gone(self._handle(scope, path, body, receive, send_named),
                                          receive, lambda: answered):
                status = CLIENT_GONE
        except Refused as refusal:
            await _refuse(send_named, refusal.status, refusal.message, refusal.headers)
        except ClientGone:
            status = CLIENT_GONE
        finally:
            self._observe(endpoint, status, time.perf_counter() - started)
            if connection is not None and status == 200:
                self.state.returning.answered(connection)

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

    def _check(self, scope: Scope, endpoint: str) -> None:
        """Refused unless the request may be read: Host, Origin, token, content type."""
        host = header(scope, b"host")
        if host is not None and not self.hosts.allows_host(host):
            raise Refused(400, f"Host {shown(host)} is not a name of this service (its bind "
                          "address, or a name given with --allowed-host)", [CLOSE])
        origin = header(scope, b"origin")
        if origin is not None and not self.hosts.allows_origin(origin, host):
            raise Refused(403, f"requests from the page at {shown(origin)} are refused: only "
                          "the service's own page (or an --allowed-host name) may call it",
                          [CLOSE])
        if endpoint in PROTECTED and not self._authorized(scope):
            raise Refused(401, "missing or wrong bearer token (Authorization: Bearer <token>)",
                          [(b"www-authenticate", b"Bearer"), CLOSE])
        if scope["method"] == "POST" and not _json(header(scope, b"content-type")):
            raise Refused(415, "the request body must be JSON, sent with Content-Type: "
                          "application/json", [CLOSE])

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

    async def _read_body(self, scope: Scope, receive: Any) -> bytes:
        """The whole body; Refused when it is over the limit or late, ClientGone when the client
        left before sending it all."""
        too_large = Refused(413, f"request body over the limit of {self.max_body} bytes",
                            [CLOSE])
        length = header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            raise too_large
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise ClientGone
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.max_body:
                        raise too_large
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            raise Refused(408, f"the request body did not arrive within {self.body_timeout_s:g} "
                          "s", [CLOSE]) from None


def _json(content_type: str | None) -> bool:
    """Whether a Content-Type header declares JSON (`application/json`, any parameters)."""
    if content_type is None:
        return False
    return content_type.split(";", 1)[0].strip().lower() == "application/json"


async def _cancelled_when_gone(work: Awaitable[None], receive: Any,
                               answered: Callable[[], bool]) -> bool:
    """Run `work` (the request's handling, in this task); cancel it when the client disconnects
    before `answered()`. True when it was cancelled so. Once the body is read, the next
    receive() returns only when the connection closes or the answer is complete (uvicorn)."""
    task = asyncio.current_task()
    gone = False

    async def watch() -> None:
        nonlocal gone
        message = await receive()
        if message["type"] == "http.disconnect" and not answered() and task is not None:
            gone = True
            task.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        await work
    except asyncio.CancelledError:
        if not gone or task is None:
            raise
        task.uncancel()
    finally:
        watcher.cancel()
    return gone


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

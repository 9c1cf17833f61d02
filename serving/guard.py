"""The ASGI app in front of every request (and of the FastAPI app): the bearer token, a body size
limit, the metrics, and the header that names the model version which answered.

With a token, every request to a PROTECTED endpoint needs `Authorization: Bearer <token>` (401
otherwise, before its body is read); the page, its static files, /v1/model and the probes stay
open.

The body is read here, at most `max_body` bytes (a larger Content-Length is refused before a byte
of the body is read; a chunked body is cut off as soon as it passes the limit), and handed to the
app from memory, so no handler ever sees an unbounded body.

`direct` handlers answer a POST to their path here (any other method: 405), from the body read,
without the FastAPI app (its middleware, router, Request and Response objects cost more per
request than the rest of the answer): `await handler(scope, body) -> (status, JSON bytes, extra
headers)`. They get the same token check, body limit, metrics and X-Model-Version as every other
request.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from serving.metrics import ENDPOINTS, endpoint_label

MODEL_SCOPE_KEY = "clipms.model.clip"  # set by the handler to the ModelInfo of the engine it used
BODY_SCOPE_KEY = "clipms.body"  # the body as read here (within the limit), for the handlers
LABELS = {endpoint: endpoint for endpoint in ENDPOINTS if endpoint != "/static"}  # exact paths
MODEL_ENDPOINTS = frozenset({"/v1/embeddings", "/v1/search", "/v1/rank"})
PROTECTED = frozenset({"/v1/embeddings", "/v1/search", "/v1/rank", "/v1/thumbnails", "/metrics"})
Scope = dict[str, Any]
Headers = list[tuple[bytes, bytes]]
Direct = Callable[[Scope, bytes], Awaitable[tuple[int, bytes, Headers]]]


class Guard:
    def __init__(self, app: Any, state: Any, max_body: int, token: str | None = None,
                 direct: dict[str, Direct] | None = None) -> None:
        self.app = app
        self.state = state
        self.direct = direct or {}
        self.max_body = max_body
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

        async def send_named(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"x-model-version", self._version(scope))]}
            await send(message)

        connection = self._returning(scope, endpoint)
        if connection is not None:
            self.state.returning.arrived(connection)
        try:
            if endpoint in PROTECTED and not self._authorized(scope):
                await _refuse(send_named, 401, "missing or wrong bearer token (Authorization: "
                              "Bearer <token>)", [(b"www-authenticate", b"Bearer"),
                                                     (b"connection", b"close")])
                return
            body = await self._read_body(scope, receive)
            if body is None:
                await _refuse(send_named, 413, f"request body over the limit of {self.max_body} "
                              "bytes", [(b"connection", b"close")])
                return
            handler = self.direct.get(path)
            if handler is not None and scope["method"] != "POST":
                await _refuse(send_named, 405, "Method Not Allowed", [(b"allow", b"POST")])
                return
            if handler is not None:
                status, payload, headers = await handler(scope, body)
                await _answer(send, status, payload, [*headers, (b"x-model-version",
                                                                 self._version(scope))])
                return
            scope[BODY_SCOPE_KEY] = body
            await self.app(scope, _replay(body, receive), send_named)
        finally:
            self._observe(endpoint, status, time.perf_counter() - started)
            if connection is not None and status == 200:
                self.state.returning.answered(connection)

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

    async def _read_body(self, scope: Scope, receive: Any) -> bytes | None:
        """The whole body, or None when it is over the limit."""
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    if int(value) > self.max_body:
                        return None
                except ValueError:
                    return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


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

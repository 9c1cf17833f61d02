"""The ASGI middleware in front of every request: a body size limit, the metrics, and the header
that names the model version which answered.

The body is read here, at most `max_body` bytes (a larger Content-Length is refused before a byte
of the body is read; a chunked body is cut off as soon as it passes the limit), and handed to the
app from memory, so no handler ever sees an unbounded body.
"""

from __future__ import annotations

import json
import time
from typing import Any

from serving.metrics import endpoint_label

MODEL_SCOPE_KEY = "clipms.model"  # set by the handler to the ModelInfo of the engine it used
Scope = dict[str, Any]


class Guard:
    def __init__(self, app: Any, state: Any, max_body: int) -> None:
        self.app = app
        self.state = state
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = endpoint_label(scope["path"])
        started = time.perf_counter()
        status = {"code": 500}

        async def send_named(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-model-version", self._version(scope))]}
            await send(message)

        try:
            body = await self._read_body(scope, receive)
            if body is None:
                await self._refuse(send_named)
                return
            await self.app(scope, _replay(body, receive), send_named)
        finally:
            metrics = self.state.metrics
            metrics.requests.labels(endpoint, str(status["code"])).inc()
            metrics.latency.labels(endpoint).observe(time.perf_counter() - started)

    def _version(self, scope: Scope) -> bytes:
        info = scope.get(MODEL_SCOPE_KEY) or getattr(self.state.engine, "info", None)
        return f"{info.name}/{info.version}".encode() if info else b"none"

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

    async def _refuse(self, send: Any) -> None:
        body = json.dumps({"error": f"request body over the limit of {self.max_body} bytes"})
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body.encode()})


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

"""A small fault-injecting HTTP proxy on 127.0.0.1 in front of a real server (the MLflow server).

Requests pass through unchanged unless a rule matches their method and path: `fail` answers with
an HTTP status instead of forwarding, `hang` accepts the request and never answers (until the proxy
stops), `hold` forwards the request but keeps the answer until an event is set (or a timeout
passes). Every request is recorded as (method, path) so tests can see what a client did.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


@dataclass
class Rule:
    method: str
    path: str  # a substring of the request path
    action: str  # "fail" | "hang" | "hold"
    status: int = 503
    release: threading.Event | None = None
    hold_s: float = 0.0
    times: int | None = None  # apply this many times (None: always)


@dataclass
class FaultProxy:
    upstream: str  # http://127.0.0.1:PORT of the real server
    rules: list[Rule] = field(default_factory=list)
    seen: list[tuple[str, str]] = field(default_factory=list)
    on_forwarded: list[Callable[[str, str], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 - http.server API
                proxy._handle(self)

            do_POST = do_PATCH = do_DELETE = do_PUT = do_GET  # noqa: N815

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def add(self, rule: Rule) -> Rule:
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()

    def _match(self, method: str, path: str) -> Rule | None:
        with self._lock:
            for rule in self.rules:
                if rule.method == method and rule.path in path and rule.times != 0:
                    if rule.times is not None:
                        rule.times -= 1
                    return rule
        return None

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        method, path = handler.command, handler.path
        with self._lock:
            self.seen.append((method, path))
        rule = self._match(method, path)
        if rule is not None and rule.action == "fail":
            self._reply(handler, rule.status, b'{"error_code": "TEMPORARILY_UNAVAILABLE"}',
                        {"Content-Type": "application/json"})
            return
        if rule is not None and rule.action == "hang":
            self._stopping.wait()  # accepted, never answered
            handler.close_connection = True
            return
        status, payload, headers = self._forward(method, path, body, handler.headers)
        for callback in list(self.on_forwarded):
            callback(method, path)
        if rule is not None and rule.action == "hold" and rule.release is not None:
            rule.release.wait(rule.hold_s)
        self._reply(handler, status, payload, headers)

    def _forward(self, method: str, path: str, body: bytes,
                 headers: object) -> tuple[int, bytes, dict[str, str]]:
        target = urlsplit(self.upstream)
        conn = http.client.HTTPConnection(target.hostname, target.port, timeout=120)
        try:
            send = {k: v for k, v in headers.items()  # type: ignore[attr-defined]
                    if k.lower() not in ("host", "connection", "content-length")}
            conn.request(method, path, body=body or None, headers=send)
            response = conn.getresponse()
            payload = response.read()
            keep = {k: v for k, v in response.getheaders()
                    if k.lower() not in ("transfer-encoding", "connection", "content-length")}
            return response.status, payload, keep
        finally:
            conn.close()

    @staticmethod
    def _reply(handler: BaseHTTPRequestHandler, status: int, payload: bytes,
               headers: dict[str, str]) -> None:
        try:
            handler.send_response(status)
            for key, value in headers.items():
                handler.send_header(key, value)
            handler.send_header("Content-Length", str(len(payload)))
            handler.end_headers()
            handler.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout)
            handler.close_connection = True

    def stop(self) -> None:
        self._stopping.set()
        self.server.shutdown()
        self.server.server_close()

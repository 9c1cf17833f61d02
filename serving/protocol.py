"""The connection limits uvicorn's HTTP protocol does not have, on its httptools protocol.

uvicorn 0.54 with httptools accepts every connection, buffers a request head of any size (a
256 MiB header is read whole, and httptools keeps it in memory), and times out only a keep-alive
connection that sends nothing after its last answer: a connection that never sends a byte, or
sends its head a byte at a time, stays open for as long as the client likes, until the process
runs out of file descriptors. `bounded_protocol(limits)` is the httptools protocol with
- at most `max_header_bytes` of request line and headers (431 and the connection closed beyond,
  counted as the bytes arrive, so a huge header is never held), for every request head of the
  connection, a pipelined one (sent before the answer to the one before it) too;
- `head_timeout_s` for a request line and headers to arrive, from the moment the connection is
  opened or its last answer went, or a pipelined head began (the connection is closed when it
  passes, however slowly bytes trickle in), and `body_timeout_s` for a request's body, from the
  end of its headers (408, and the connection closed; the app's request sees the client gone);
- `send_timeout_s` for a client to take some of its answers: once more than the transport's
  high-water mark of answers waits to be sent, the client must read some of it within that time,
  and again, or the connection is dropped (uvicorn waits forever: pipelined requests whose
  answers were never read held every connection slot). A connection closed with answers unsent
  is dropped after that time too (a close waits for its buffer to be sent);
- at most `max_connections` open: a new connection beyond it closes the connection that has been
  waiting longest for a request head (idle keep-alive connections and slow heads first; never
  one whose request is being answered), or, when every connection is busy, is answered 503 and
  closed. A flood of idle connections therefore cannot keep a new client out.
uvicorn's own `timeout_keep_alive` still closes a quiet keep-alive connection sooner
(`keep_alive_s`). Timers here are loop timers armed and cancelled per request, not tasks: the
checks cost the hot path a few microseconds.
"""

# not unit-tested: uvicorn runs it; tests/serving/test_app.py drives it over raw sockets.

from __future__ import annotations

import asyncio
import resource
from dataclasses import dataclass, replace
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

BUSY_MESSAGE = b'{"error": "too many connections; retry later"}'
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\nretry-after: 1\r\n\r\n%s"
        % (len(BUSY_MESSAGE), BUSY_MESSAGE))
TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
             b"content-length: %d\r\nconnection: close\r\n\r\n%s")
LATE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n%s")
FILES_KEPT = 64  # descriptors left for the model, the index, logs and the registry client


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 512
    max_header_bytes: int = 32 * 1024
    head_timeout_s: float = 10.0
    keep_alive_s: int = 5
    body_timeout_s: float = 30.0
    send_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_header_bytes", "head_timeout_s", "keep_alive_s",
                     "body_timeout_s", "send_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")

    def within_open_files(self) -> ConnectionLimits:
        """These limits with max_connections lowered to what the process may open (its soft
        RLIMIT_NOFILE, less FILES_KEPT): past that, accept() itself would fail."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY or soft - FILES_KEPT >= self.max_connections:
            return self
        return replace(self, max_connections=max(1, soft - FILES_KEPT))


def bounded_protocol(limits: ConnectionLimits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol under `limits` (module docstring); one class per server, so
    its connections share one queue of idle ones."""
    waiting: dict[BoundedHttpTools, None] = {}  # connections awaiting a request head, oldest first

    class BoundedHttpTools(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_bytes = 0
            self._head_timer: asyncio.TimerHandle | None = None
            self._body_timer: asyncio.TimerHandle | None = None
            self._send_timer: asyncio.TimerHandle | None = None
            self._in_head = False  # between the first byte of a request and its headers' end
            self._refused = False

        # -- connections
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= limits.max_connections and not self._evict_one():
                self._refused, self.transport = True, transport
                transport.write(BUSY)
                transport.close()
                return
            super().connection_made(transport)
            self._await_head()

        @staticmethod
        def _evict_one() -> bool:
            """Close the connection waiting longest for a request head; False when none is."""
            oldest = next(iter(waiting), None)
            if oldest is not None:
                # It stops counting now, not when its transport reports the close (a loop
                # iteration later): uvicorn's limit_concurrency counts the same set.
                oldest.connections.discard(oldest)
                oldest._close()
            return oldest is not None

        def connection_lost(self, exc: Exception | None) -> None:
            self._head_done()
            self._body_done()
            self._send_done()
            if not self._refused:  # refused in connection_made: nothing of uvicorn's to undo
                super().connection_lost(exc)

        def _close(self) -> None:
            self._head_done()
            if not self.transport.is_closing():
                self.transport.close()
            # A close (this one, or uvicorn's keep-alive timeout's) waits for the client to take
            # what is unsent, below the high-water mark too.
            if self.transport.get_write_buffer_size() and self._send_timer is None:
                self._watch_send()

        # -- answers the client does not take
        def pause_writing(self) -> None:
            super().pause_writing()
            if self._send_timer is None:
                self._watch_send()

        def resume_writing(self) -> None:
            super().resume_writing()
            if not self.transport.is_closing():  # closing: watched until all is sent
                self._send_done()

        def _watch_send(self) -> None:
            self._send_timer = self.loop.call_later(
                limits.send_timeout_s, self._send_due, self.transport.get_write_buffer_size())

        def _send_due(self, unsent_before: int) -> None:
            """The client took some of its answers since the timer was armed (watch again), or
            none (drop the connection: a close would wait for the same client)."""
            if self.transport.get_write_buffer_size() < unsent_before:
                self._watch_send()
            else:
                self._send_timer = None
                self.transport.abort()  # connection_lost() releases the answer waiting to send

        def _send_done(self) -> None:
            if self._send_timer is not None:
                self._send_timer.cancel()
                self._send_timer = None

        # -- the request head: its time and its size
        def _await_head(self) -> None:
            self._head_bytes = 0
            waiting[self] = None
            self._head_timer = self.loop.call_later(limits.head_timeout_s, self._head_late)

        def _head_late(self) -> None:
            """The head did not arrive in time: the connection closes (dropped when a request
            before this head is still being answered: nothing can be written after it)."""
            if self._answering():
                self._drop()
            else:
                self._close()

        def _answering(self) -> bool:
            """Whether the request before the head being read is still being answered (the head
            is pipelined)."""
            return self.cycle is not None and not self.cycle.response_complete

        def _drop(self) -> None:
            self._head_done()
            self.transport.abort()  # connection_lost() tells the request being answered

        def _head_done(self) -> None:
            self._in_head = False
            waiting.pop(self, None)
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def data_received(self, data: bytes) -> None:
            awaiting = self in waiting
            super().data_received(data)
            # A head still incomplete after this chunk: the first one of the connection or of
            # its idle time, or one pipelined behind a request being answered.
            if (awaiting and self in waiting) or self._in_head:
                self._head_bytes += len(data)
                if self._head_bytes > limits.max_header_bytes:
                    self._refuse_head()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head = True
            if self._head_timer is None:  # pipelined: the connection was not idle
                self._head_bytes = 0
                self._head_timer = self.loop.call_later(limits.head_timeout_s, self._head_late)

        def _refuse_head(self) -> None:
            """431 and close; dropped when a request before it is still being answered (the 431
            would be taken for its answer)."""
            if self._answering():
                self._drop()
                return
            message = (b'{"error": "request line and headers over the limit of %d bytes"}'
                       % limits.max_header_bytes)
            self.transport.write(TOO_LARGE % (len(message), message))
            self._close()

        def on_headers_complete(self) -> None:
            self._head_done()
            super().on_headers_complete()
            if _has_body(self.headers):
                self._body_timer = self.loop.call_later(limits.body_timeout_s, self._late_body)

        def on_message_complete(self) -> None:
            self._body_done()
            super().on_message_complete()

        def _body_done(self) -> None:
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None

        def _late_body(self) -> None:
            """The body did not arrive in time: 408 (unless an answer has started), then the
            connection closes; the app's request sees its client gone."""
            self._body_timer = None
            cycle = self.cycle
            if cycle is not None and not cycle.response_started:
                message = (b'{"error": "the request body did not arrive within %g s"}'
                           % limits.body_timeout_s)
                self.transport.write(LATE % (len(message), message))
            if cycle is not None:
                cycle.disconnected = True  # the app's send() writes nothing from now on
                cycle.message_event.set()
            self._close()

        def on_response_complete(self) -> None:
            pipelined = bool(self.pipeline)
            super().on_response_complete()
            if not pipelined and not self.transport.is_closing():
                self._await_head()  # idle again, until its next request head is complete

    return BoundedHttpTools


def _has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if (name == b"content-length" and value.strip() not in (b"", b"0")) or (
                name == b"transfer-encoding"):
            return True
    return False

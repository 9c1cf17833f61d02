"""serving.guard on a real event loop, driven through the ASGI interface itself: what it reads of a
request's body (each `receive()` counted), what it refuses before reading, and what happens to a
request whose client goes away. The app behind it records what reaches it.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from serving.batcher import Returning
from serving.guard import CLIENT_GONE, Guard
from serving.hosts import HostPolicy
from serving.prometheus import ServiceMetrics

LIMIT = 1000
JSON = [(b"content-type", b"application/json"), (b"host", b"127.0.0.1:8000")]


class Client:
    """The server side of one request: its body in `chunks` (then, optionally, a disconnect),
    every receive() counted, every message sent recorded."""

    def __init__(self, chunks: list[bytes], disconnect: bool = False) -> None:
        self.chunks, self.disconnect = list(chunks), disconnect
        self.receives = 0
        self.bytes_read = 0
        self.sent: list[dict[str, Any]] = []
        self.gone = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        self.receives += 1
        if self.chunks:
            chunk = self.chunks.pop(0)
            self.bytes_read += len(chunk)
            return {"type": "http.request", "body": chunk, "more_body": bool(self.chunks)
                    or self.disconnect}
        if self.disconnect:
            return {"type": "http.disconnect"}
        await self.gone.wait()  # after the body: the client leaving, or the answer complete
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            self.gone.set()  # as uvicorn: once the answer is complete, receive() says so

    @property
    def status(self) -> int | None:
        starts = [m["status"] for m in self.sent if m["type"] == "http.response.start"]
        return starts[0] if starts else None

    @property
    def error(self) -> str:
        body = b"".join(m.get("body", b"") for m in self.sent if m["type"] ==
                        "http.response.body")
        return json.loads(body)["error"]


class App:
    """The app behind the guard: answers 200 with the body's length, after `delay` seconds."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.calls = 0
        self.cancelled = False

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        self.calls += 1
        body = (await receive())["body"]
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": json.dumps(len(body)).encode()})


def guard(app: App, **kwargs: Any) -> Guard:
    state = SimpleNamespace(metrics=ServiceMetrics(), engine=None, returning=Returning(0.005))
    return Guard(app, state=state, max_body=LIMIT, **kwargs)


def scope(path: str = "/v1/search", method: str = "POST",
          headers: list[tuple[bytes, bytes]] | None = None) -> dict[str, Any]:
    return {"type": "http", "path": path, "method": method, "client": ("127.0.0.1", 5000),
            "headers": JSON if headers is None else headers}


def served(gate: Guard, request: dict[str, Any], client: Client) -> Client:
    asyncio.run(asyncio.wait_for(gate(request, client.receive, client.send), 10))
    return client


def counted(gate: Guard, status: int) -> float:
    return gate.state.metrics.requests.labels("/v1/search", str(status))._value.get()


def test_a_declared_body_over_the_limit_is_refused_before_a_byte_is_read() -> None:
    app = App()
    gate = guard(app)
    client = Client([b"x" * (LIMIT + 1)])
    request = scope(headers=[*JSON, (b"content-length", b"%d" % (LIMIT + 1))])
    served(gate, request, client)
    assert (client.status, client.receives, client.bytes_read, app.calls) == (413, 0, 0, 0)
    assert client.error == f"request body over the limit of {LIMIT} bytes"
    for bad in (b"-1", b"12x", b"1e9"):  # a length that is no number is no length
        client = served(gate, scope(headers=[*JSON, (b"content-length", bad)]), Client([b"{}"]))
        assert (client.status, client.receives) == (413, 0), bad


def test_a_chunked_body_is_read_no_further_than_the_chunk_that_passes_the_limit() -> None:
    app = App()
    gate = guard(app)
    client = served(gate, scope(), Client([b"x" * 300] * 100))  # 30,000 bytes, no length given
    assert (client.status, app.calls) == (413, 0)
    assert client.receives == 4 and client.bytes_read == 1200  # 300 x 4 is the first > 1000
    within = served(gate, scope(), Client([b"x" * 250] * 4))  # exactly the limit: accepted
    assert (within.status, app.calls) == (200, 1) and within.receives >= 4


@pytest.mark.parametrize(("headers", "status", "said"), [
    ([(b"content-type", b"text/plain"), (b"host", b"127.0.0.1:8000")], 415,
     "must be JSON, sent with Content-Type: application/json"),
    ([(b"host", b"127.0.0.1:8000")], 415, "must be JSON"),
    ([*JSON[:1], (b"host", b"evil.example")], 400, "Host 'evil.example' is not a name"),
    ([*JSON, (b"origin", b"http://evil.example")], 403, "requests from the page at"),
    ([*JSON, (b"origin", b"null")], 403, "requests from the page at 'null'"),
], ids=["text/plain", "no content type", "foreign Host", "foreign Origin", "null Origin"])
def test_a_request_from_elsewhere_is_refused_before_its_body_is_read(headers, status,
                                                                    said) -> None:
    app = App()
    client = served(guard(app), scope(headers=headers), Client([b'{"text": "a"}']))
    assert (client.status, client.receives, app.calls) == (status, 0, 0)
    assert said in client.error


def test_json_with_parameters_same_origin_and_allowed_names_pass() -> None:
    app = App()
    gate = guard(app, hosts=HostPolicy.for_bind("127.0.0.1", ("search.example",)))
    for headers in ([(b"content-type", b"Application/JSON; charset=utf-8"),
                     (b"host", b"localhost:8000"), (b"origin", b"http://localhost:8000")],
                    [*JSON[:1], (b"host", b"search.example"),
                     (b"origin", b"https://search.example")],
                    [*JSON[:1]]):  # no Host at all (HTTP/1.0 tools)
        client = served(gate, scope(headers=headers), Client([b"{}"]))
        assert client.status == 200, headers
    assert served(gate, scope(method="GET", headers=[(b"host", b"[::1]:8000")]),
                  Client([b""])).status == 200


def test_a_client_that_leaves_mid_body_is_not_answered_and_counted_499() -> None:
    app = App()
    gate = guard(app)
    client = served(gate, scope(), Client([b"x" * 100, b"x" * 100], disconnect=True))
    assert (client.sent, app.calls) == ([], 0)
    assert counted(gate, CLIENT_GONE) == 1


def test_a_client_that_leaves_while_answered_has_its_request_cancelled() -> None:
    app = App(delay=30.0)
    gate = guard(app, watch_after_s=0.05)
    client = Client([b'{"text": "a"}'])

    async def leave_soon() -> None:
        await asyncio.sleep(0.2)
        client.gone.set()

    async def run() -> None:
        await asyncio.gather(gate(scope(), client.receive, client.send), leave_soon())

    asyncio.run(asyncio.wait_for(run(), 10))
    assert (app.calls, app.cancelled, client.sent) == (1, True, [])
    assert counted(gate, CLIENT_GONE) == 1


def test_an_answer_that_completes_is_not_cancelled_by_the_end_of_its_connection() -> None:
    app = App(delay=0.01)
    gate = guard(app)
    client = served(gate, scope(), Client([b"{}"]))
    assert (client.status, app.cancelled) == (200, False)
    assert counted(gate, 200) == 1 and counted(gate, CLIENT_GONE) == 0

"""The load client of benchmarks/bench_serving.py (benchmarks/serving_load.py) against a real
HTTP/1.1 server on 127.0.0.1: it frames Content-Length and chunked answers, reconnects after
`Connection: close`, counts every non-200 answer and every wrong sampled answer as an error."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import threading
from pathlib import Path

import pytest

MODULE = Path(__file__).resolve().parents[2] / "benchmarks" / "serving_load.py"


def load_module():
    spec = importlib.util.spec_from_file_location("serving_load", MODULE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def answer(path: str, body: bytes) -> bytes:
    value = json.loads(body)["i"]
    payload = json.dumps({"i": value + (1 if path == "/wrong" else 0)}).encode()
    if path == "/chunked":
        half = len(payload) // 2
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (payload[:half], payload[half:]))
        return (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n")
    status = b"503 Service Unavailable" if path == "/busy" else b"200 OK"
    close = b"Connection: close\r\n" if path == "/close" else b""
    return (b"HTTP/1.1 %s\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s"
            % (status, close, len(payload), payload))


async def serve_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ")[1].decode()
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            writer.write(answer(path, await reader.readexactly(length)))
            await writer.drain()
            if path == "/close":
                break
    except asyncio.IncompleteReadError:
        pass
    writer.close()


@pytest.fixture(scope="module")
def server():
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box = {}

    async def main() -> None:
        box["stop"] = asyncio.get_running_loop().create_future()
        async with await asyncio.start_server(serve_one, "127.0.0.1", 0) as tcp:
            box["port"] = tcp.sockets[0].getsockname()[1]
            started.set()
            await box["stop"]

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True)
    thread.start()
    assert started.wait(30)
    yield ("127.0.0.1", box["port"])
    loop.call_soon_threadsafe(box["stop"].set_result, None)
    thread.join(30)


def run(server, path: str, **kwargs):
    load = load_module()
    work = load.Workload(path, lambda i: b'{"i": %d}' % i,
                         lambda got: None if isinstance(got["i"], int) and got["i"] % 7 != 6
                         or path != "/wrong" else f"i = {got['i']}")
    return load.run_load(server, work, concurrency=3, seconds=30.0, max_requests=60,
                         check_every=kwargs.get("check_every", 1))


@pytest.mark.parametrize("path", ["/ok", "/chunked", "/close"])
def test_answers_are_framed_and_checked(server, path) -> None:
    cell = run(server, path)
    assert cell["errors"] == 0, cell["first_error"]
    assert cell["requests"] == 60 and cell["checked"] == 60


def test_an_error_status_and_a_wrong_answer_are_errors(server) -> None:
    busy = run(server, "/busy")
    assert busy["errors"] == 60 and busy["requests"] == 0
    assert busy["first_error"].startswith("HTTP 503")
    wrong = run(server, "/wrong")  # the server adds 1: i % 7 == 6 answers are flagged
    assert wrong["errors"] == len([i for i in range(1, 61) if (i + 1) % 7 == 6]) > 0
    assert wrong["first_error"].startswith("wrong answer: i = ")
    assert wrong["requests"] + wrong["errors"] == 60

"""Ten hostile inputs, each refused fast and in bounded memory, with a clear 4xx or a counted
failure, while the service goes on answering others (docs/security.md lists each with its
outcome and names its test here).

The service runs in this process (harness/inprocess_service.py: `serving.cli`'s own app and uvicorn
configuration, real sockets on 127.0.0.1, a tiny exported bundle); the data-side inputs go through
the library where the stages do (urlguard's opener against a loopback server, the metadata
reader, the params loader). What needs a stage process, nginx or a few seconds of waiting is
marked slow.
"""

from __future__ import annotations

import base64
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from harness.hostile_bodies import unclosed_quotes
from harness.hostile_images import encoded, jpeg_many_scans, png_sliver
from harness.image_site import Site, images_parquet, run_stage, write_params
from harness.inprocess_service import InProcessService, tiny_world
from harness.serving_server import post_json, request

MAX_ROWS, MAX_CONNECTIONS, MAX_HEADER, HEAD_TIMEOUT, BODY_TIMEOUT = 16, 12, 8192, 1.0, 1.0
SEND_TIMEOUT = 1.0
ALLOWED_HOST = "search.example"
ARGS = ["--max-batch", "2", "--max-queue", "64", "--max-rows", str(MAX_ROWS),
        "--max-connections", str(MAX_CONNECTIONS), "--max-header-bytes", str(MAX_HEADER),
        "--header-timeout-s", str(HEAD_TIMEOUT), "--body-timeout-s", str(BODY_TIMEOUT),
        "--send-timeout-s", str(SEND_TIMEOUT),
        "--allowed-host", ALLOWED_HOST]
# How long a refusal, or a /healthz asked meanwhile, may take on a loaded 2-core machine: the
# inputs below took 8-38 s before they were refused early.
FAST_S = 2.0
PASSWORD = "S3cretPass"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessService]:
    root = tmp_path_factory.mktemp("hostile")
    bundle, index = tiny_world(root)
    with InProcessService(root, ["--model", str(bundle), "--index", str(index), *ARGS]) as running:
        yield running


@contextmanager
def healthz_meanwhile(url: str) -> Iterator[list[tuple[int, float]]]:
    """(status, seconds) of /healthz asked every 50 ms while the block runs."""
    seen: list[tuple[int, float]] = []
    done = threading.Event()

    def ask() -> None:
        while not done.is_set():
            started = time.monotonic()
            seen.append((request(f"{url}/healthz", timeout=60)[0], time.monotonic() - started))
            time.sleep(0.05)

    asker = threading.Thread(target=ask)
    asker.start()
    try:
        yield seen
    finally:
        done.set()
        asker.join()


def answered_meanwhile(seen: list[tuple[int, float]]) -> bool:
    return bool(seen) and all(status == 200 and seconds < FAST_S for status, seconds in seen)


def timed_post(url: str, body: bytes, headers: dict[str, str] | None = None
               ) -> tuple[int, dict, float]:
    started = time.monotonic()
    status, payload, _ = request(url, raw=body, headers=headers, timeout=120)
    return status, json.loads(payload), time.monotonic() - started


# ------------------------------------------------------------------ 1. a 274-byte PNG sliver


def test_a_274_byte_png_of_1x100000_pixels_is_refused_before_its_resize(service) -> None:
    """Within any pixel limit, but its resize would ask for 32 x 3,200,000 pixels here (5 x 10^9
    for a 224 model): refused from the header by the bundle's aspect-ratio limit."""
    sliver = png_sliver()
    assert len(sliver) < 300
    six = json.dumps({"images": [b64(sliver)] * 6}).encode()
    with healthz_meanwhile(service.url) as seen:
        status, body, seconds = timed_post(f"{service.url}/v1/embeddings", six)
        search = post_json(f"{service.url}/v1/search", {"image": b64(sliver)})
        rank = post_json(f"{service.url}/v1/rank", {"image": b64(sliver), "texts": ["a"]})
    assert (status, body) == (400, {"error": "images[0]: 1x100000 has an aspect ratio over the "
                                             "limit of 10 (long side / short side)"})
    assert seconds < FAST_S and answered_meanwhile(seen), (seconds, seen)
    bundle_spec = json.loads((service.root / "bundle" / "preprocess.json").read_text())
    assert bundle_spec["max_aspect_ratio"] == 10.0  # the limit travels with the bundle
    for answer in (search, rank):
        assert answer[0] == 400 and "1x100000 has an aspect ratio over the limit" in \
            answer[1]["error"]


# ------------------------------------------------------------------ 2. two million list items

HUGE = 2_000_000


@pytest.mark.parametrize(("path", "body", "said"), [
    ("/v1/embeddings", {"texts": [1] * HUGE}, "JSON values than a request of at most 16 rows"),
    ("/v1/embeddings", {"images": [None] * HUGE}, "JSON values than a request of at most 16"),
    ("/v1/embeddings", {"images": [[]] * HUGE}, "JSON values than a request of at most 16 rows"),
    ("/v1/rank", {"image": "aGk=", "texts": [1] * HUGE}, "JSON values than a request of at"),
    ("/v1/search", {"text": "a", **{f"x{i}": 0 for i in range(HUGE // 4)}}, "JSON values"),
    ("/v1/embeddings", {"texts": ["t"] * (MAX_ROWS + 1)}, "17 rows in one request, over the "
                                                          "limit of 16"),
], ids=["ints as texts", "nulls as images", "empty lists as images", "ints as rank texts",
        "500,000 unknown fields", "one row too many"])
def test_huge_lists_are_refused_before_any_validation(service, path, body, said) -> None:
    """pydantic builds one error per bad item: 2 million of them held the event loop for 8.5 s
    (and 38 s at 10 MB of nulls). The body's shape is bounded on its bytes first."""
    raw = json.dumps(body, separators=(",", ":")).encode()
    with healthz_meanwhile(service.url) as seen:
        status, answer, seconds = timed_post(f"{service.url}{path}", raw)
    assert seconds < FAST_S and answered_meanwhile(seen), (seconds, seen)
    assert status == 400 and said in answer["error"], (status, answer)


# ------------------------------------------------------------------ 3. headers, idle connections


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """Whether the server closed `sock` (EOF or reset) within `within` seconds."""
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_a_1_mib_header_is_refused_as_it_arrives(service) -> None:
    """uvicorn read a header of any size (256 MiB took 38 s and stalled /healthz ~10 s)."""
    sock = connect(service.port)
    head = (b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Filler: " + b"a" * 2**20
            + b"\r\n\r\n")
    sender = threading.Thread(target=_send_quietly, args=(sock, head))
    sender.start()
    answer = _read_quietly(sock)
    sender.join()
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b"over the limit of 8192 bytes" in answer
    assert request(f"{service.url}/healthz")[0] == 200


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):  # the server closed it mid-way: what is being tested
        sock.sendall(data)


def _read_quietly(sock: socket.socket) -> bytes:
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except OSError:
        pass
    return b"".join(chunks)


def test_idle_connections_are_closed_and_never_keep_a_client_out(service) -> None:
    """~20,000 idle connections exhausted the process's files until /healthz reset. Beyond
    max_connections the longest-idle one is closed; every idle one is closed once its request
    head is late."""
    idle = [connect(service.port) for _ in range(3 * MAX_CONNECTIONS)]
    try:
        started = time.monotonic()
        assert request(f"{service.url}/healthz", timeout=10)[0] == 200
        assert time.monotonic() - started < FAST_S
        evicted = sum(closed_by_server(sock, 0.2) for sock in idle[:2 * MAX_CONNECTIONS])
        assert evicted >= 2 * MAX_CONNECTIONS - 1, evicted
        assert all(closed_by_server(sock, HEAD_TIMEOUT + 1.5) for sock in idle), \
            "an idle connection outlived the header timeout"
    finally:
        for sock in idle:
            sock.close()


def test_a_new_connection_when_every_one_is_busy_is_answered_503_at_once(service) -> None:
    """With no idle connection to close for it, a connection past --max-connections is told so
    and closed (uvicorn's limit_concurrency would let it in and queue it); the busy ones are
    answered."""
    state = service.state
    body = json.dumps({"texts": ["x"]}).encode()
    head = (b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
    release = threading.Event()
    state.model_thread.submit(release.wait, 60)  # the model is busy: every request waits
    busy = [connect(service.port) for _ in range(MAX_CONNECTIONS)]
    try:
        for sock in busy:
            sock.sendall(head + body)
        _wait(lambda: state.engine.text.depth >= MAX_CONNECTIONS - 2, "every request queued")
        newcomer = connect(service.port)
        newcomer.settimeout(5)
        answer = _read_quietly(newcomer)
        newcomer.close()
        assert answer.startswith(b"HTTP/1.1 503 ") and b"too many connections" in answer
        head, payload = answer.split(b"\r\n\r\n", 1)
        assert b"content-length: %d\r\n" % len(payload) in head  # it said one byte more
    finally:
        release.set()
    for sock in busy:
        sock.settimeout(30)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        sock.close()


def test_a_request_head_sent_a_byte_at_a_time_is_cut_off(service) -> None:
    """uvicorn's keep-alive timer stops at the first byte: a head trickling in stayed open."""
    sock = connect(service.port)
    sock.sendall(b"GET /healthz HTTP/1.1\r\n")
    started, closed = time.monotonic(), False
    while not closed and time.monotonic() - started < HEAD_TIMEOUT + 3:
        try:
            sock.sendall(b"X")
        except OSError:
            closed = True
        closed = closed or closed_by_server(sock, 0.1)
    seconds = time.monotonic() - started
    sock.close()
    assert closed and seconds < HEAD_TIMEOUT + 1, seconds


def test_a_keep_alive_connection_left_quiet_after_its_answer_is_closed(service) -> None:
    """The head timeout starts again when an answer has gone: a client that keeps its
    connection and sends nothing more holds it no longer than a new one may idle."""
    sock = connect(service.port)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    sock.settimeout(10)
    assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
    started = time.monotonic()
    closed = closed_by_server(sock, HEAD_TIMEOUT + 1.5)
    sock.close()
    assert closed, "a quiet keep-alive connection outlived the header timeout"
    assert time.monotonic() - started > HEAD_TIMEOUT - 0.3  # closed by the timer, not at once


def test_a_body_that_does_not_arrive_is_answered_408(service) -> None:
    sock = connect(service.port)
    sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                 b"application/json\r\nContent-Length: 100\r\n\r\n{\"texts\":")
    sock.settimeout(BODY_TIMEOUT + 5)
    answer = _read_quietly(sock)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b"did not arrive within 1 s" in answer


def never_reading(port: int, requests: int = 4000) -> socket.socket:
    """A connection that sends `requests` pipelined GET / and reads none of their answers (a
    small receive buffer, so the answers back up into the service soon)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.settimeout(30)
    threading.Thread(target=_send_quietly, args=(
        sock, b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * requests), daemon=True).start()
    return sock


def test_clients_that_never_read_their_answers_do_not_keep_others_out(service) -> None:
    """Pipelined requests whose answers were never read held every slot of --max-connections
    for as long as the client liked, and new clients were turned away: a connection whose
    client takes none of its answers for --send-timeout-s is dropped."""
    stuck = [never_reading(service.port) for _ in range(MAX_CONNECTIONS)]
    try:
        statuses = []
        for _ in range(int((SEND_TIMEOUT + 10) / 0.25)):  # a liveness bound, not a speed measure
            with contextlib.suppress(OSError):
                statuses.append(request(f"{service.url}/healthz", timeout=5)[0])
            if statuses[-1:] == [200]:
                break
            time.sleep(0.25)
        assert statuses[-1:] == [200], statuses
        assert all(closed_by_server(sock, 5) for sock in stuck)
    finally:
        for sock in stuck:
            sock.close()


def test_a_pipelined_request_head_has_the_size_limit_of_the_first(service) -> None:
    """Behind a request still being answered, 151 MiB of header was read and kept (the limit
    counted bytes only while the connection was idle): cut off at the limit."""
    release = threading.Event()
    service.state.model_thread.submit(release.wait, 60)  # the first request waits
    try:
        sock = connect(service.port)
        body = b'{"texts": ["x"]}'
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        huge = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Filler: " + b"a" * 2**22
        sender = threading.Thread(target=_send_quietly, args=(sock, huge), daemon=True)
        sender.start()
        assert closed_by_server(sock, 10), "a pipelined head over the limit was read on"
        sender.join(10)
        assert not sender.is_alive()
    finally:
        release.set()
        sock.close()
    assert request(f"{service.url}/healthz")[0] == 200


def test_a_pipelined_request_head_has_the_time_limit_of_the_first(service) -> None:
    """A pipelined head trickling in behind a request being answered had no timer at all."""
    release = threading.Event()
    service.state.model_thread.submit(release.wait, 60)
    sock = connect(service.port)
    try:
        body = b'{"texts": ["x"]}'
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%sGET /healthz HTTP/1.1"
                     b"\r\n" % (len(body), body))
        assert closed_by_server(sock, HEAD_TIMEOUT + 5), "a late pipelined head was waited for"
    finally:
        release.set()
        sock.close()


# ------------------------------------------------------------------ 3b. bodies that hold the loop

# How long /healthz may wait while hostile bodies are read: a liveness bound, not a speed
# measure (the bodies below held the event loop past it before the scan was linear).
ALIVE_S = 10.0


def _post_raw(port: int, path: str, body: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=ALIVE_S)
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (path.encode(),
                                                                         len(body), body))
    return sock


def _answer(sock: socket.socket) -> bytes:
    chunks = []
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    sock.close()
    return b"".join(chunks)


def test_healthz_answers_while_hostile_bodies_are_read(service) -> None:
    """Three 96 KB bodies of unclosed escaped quotes, one per endpoint, sent in full before
    /healthz is asked: each is refused as not JSON, and /healthz is answered meanwhile (it waited
    as long as the bodies held the event loop: minutes)."""
    posts = [_post_raw(service.port, path, unclosed_quotes(96 * 1024, head)) for path, head in (
        ("/v1/embeddings", b'{"texts": ["a", "'), ("/v1/search", b'{"text": "'),
        ("/v1/rank", b'{"image": "x", "texts": ["'))]
    healthz: list[int | str] = []

    def ask() -> None:
        try:
            healthz.append(request(f"{service.url}/healthz", timeout=ALIVE_S)[0])
        except OSError as err:  # timed out: the event loop was held
            healthz.append(repr(err))

    asker = threading.Thread(target=ask)
    asker.start()
    answers = [_answer(sock) for sock in posts]
    asker.join()
    assert healthz == [200]
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1]) == {
            "error": "the request body is not valid JSON"}


def test_a_jpeg_of_10000_empty_scans_is_refused_by_every_image_endpoint(service) -> None:
    """Each scan is a pass over the whole image in a decode thread that no request can stop:
    refused before the decode."""
    hostile = b64(jpeg_many_scans(10_000))
    answers = [post_json(f"{service.url}/v1/embeddings", {"images": [b64(encoded("PNG")),
                                                                      hostile]}),
               post_json(f"{service.url}/v1/search", {"image": hostile}),
               post_json(f"{service.url}/v1/rank", {"image": hostile, "texts": ["a"]})]
    said = ["images[1]: a JPEG of", "image: a JPEG of", "image: a JPEG of"]
    for (status, answer), start in zip(answers, said, strict=True):
        assert status == 400 and answer["error"].startswith(start), answer
        assert "scans, over the limit of 100" in answer["error"]


# ------------------------------------------------------------------ 4. other sites' pages


def test_pages_of_other_sites_can_neither_post_nor_read(service) -> None:
    """A cross-origin `text/plain` POST needs no preflight, so it ran; any Host was accepted, so
    DNS rebinding could read the answers."""
    url, port = service.url, service.port
    query = json.dumps({"texts": ["a"]}).encode()
    plain = {"Content-Type": "text/plain"}
    assert request(f"{url}/v1/embeddings", raw=query, headers=plain)[0] == 415
    assert request(f"{url}/v1/search", raw=b'{"text": "a"}', headers=plain)[0] == 415
    for origin in ("http://evil.example", "null", f"http://127.0.0.1:{port + 1}"):
        status, body, _ = request(f"{url}/v1/embeddings", raw=query, headers={"Origin": origin})
        assert status == 403 and "refused" in json.loads(body)["error"], origin
    for host in (f"evil.example:{port}", f"10.1.2.3:{port}", "rebind.attacker.test"):
        for path in ("/v1/model", "/metrics", "/healthz"):
            status, body, _ = request(f"{url}{path}", headers={"Host": host})
            assert status == 400 and "is not a name of this service" in json.loads(body)[
                "error"], (host, path)
    # the page's own requests, and a name given with --allowed-host (a reverse proxy's)
    own = {"Origin": url, "Host": f"127.0.0.1:{port}"}
    assert request(f"{url}/v1/embeddings", raw=query, headers=own)[0] == 200
    assert request(f"{url}/v1/model", headers={"Host": f"localhost:{port}"})[0] == 200
    proxied = {"Origin": f"https://{ALLOWED_HOST}", "Host": ALLOWED_HOST}
    assert request(f"{url}/v1/embeddings", raw=query, headers=proxied)[0] == 200


# ------------------------------------------------------------------ 5. a password in a URL


def test_a_password_in_an_image_url_is_never_printed_or_counted(tmp_path) -> None:
    """urllib quotes a request's host as `user:PASS@mirror` in its errors, and img2dataset's
    error texts became the keys of metrics/download.json (tracked by git)."""
    import pandas as pd

    from clipms.utils.redact import redact_text
    from prep.fetch import Fetch, summarise
    from prep.urlguard import FetchPolicy, RefusedURL, build_opener, precheck
    from tracking.lineage import safe_params

    with Site() as site:
        port = site.base.rsplit(":", 1)[1]
        site.redirects["/to-secret.jpg"] = f"http://user:{PASSWORD}@127.0.0.1:{port}/good/0.jpg"
        opener = build_opener(FetchPolicy(allow_private_addresses=True))
        for url in (f"http://user:{PASSWORD}@127.0.0.1:{port}/good/0.jpg",
                    f"{site.base}/to-secret.jpg"):
            with pytest.raises(RefusedURL) as refused:
                opener.open(url, timeout=5)
            assert refused.value.reason == "bad_url" and PASSWORD not in str(refused.value)
    assert precheck([f"http://user:{PASSWORD}@mirror.example/a.jpg"], FetchPolicy()) == [
        "bad_url"]
    host_string = f"<urlopen error [Errno -2] user:{PASSWORD}@mirror.example: not known>"
    assert PASSWORD not in redact_text(host_string)
    stats = {"count": 2, "successes": 0, "failed_to_download": 2,
             "status_dict": {host_string: 1, f"nonsense user:{PASSWORD}@m.example": 1}}
    frame = pd.DataFrame({"key": ["a", "b"], "status": ["failed", "failed"],
                          "part": pd.array([0, 0], dtype="Int64")})
    metrics = summarise(frame, {}, Fetch(parts=[], new=2, retried=0), [stats], held_keys=set())
    assert metrics["failure_reasons"] and PASSWORD not in json.dumps(metrics)
    assert PASSWORD not in json.dumps(safe_params({"metadata.path": f"user:{PASSWORD}@m:/x"}))


def test_a_password_in_metadata_path_is_not_printed(tmp_path, monkeypatch, capsys) -> None:
    import stages.metadata

    (tmp_path / "params.yaml").write_text(yaml.safe_dump(
        {"metadata": {"source": "local", "path": f"user:{PASSWORD}@mirror:/data/x.parquet"}}))
    monkeypatch.chdir(tmp_path)
    assert stages.metadata.main() == 1
    out = capsys.readouterr()
    assert "no such file" in out.err and PASSWORD not in out.err + out.out


@pytest.mark.slow
def test_the_download_stage_counts_secret_urls_without_their_secrets(tmp_path) -> None:
    """The real stage (img2dataset in its worker processes) on URLs with user-info, direct and
    behind a redirect: refused and counted, the password in no metrics file and no output."""
    with Site() as site:
        port = site.base.rsplit(":", 1)[1]
        site.redirects["/to-secret.jpg"] = f"http://user:{PASSWORD}@127.0.0.1:{port}/good/1.jpg"
        images_parquet(tmp_path, [f"{site.base}/good/0.jpg",
                                  f"http://user:{PASSWORD}@127.0.0.1:{port}/good/2.jpg",
                                  f"{site.base}/to-secret.jpg"])
        write_params(tmp_path)
        proc = run_stage("download", tmp_path)
    metrics = (tmp_path / "metrics" / "download.json").read_text()
    assert PASSWORD not in metrics + proc.stdout + proc.stderr
    counted = json.loads(metrics)
    assert counted["successes"] == 1 and counted["refused"]["bad_url"] == 1
    assert sum(counted["failure_reasons"].values()) == 1  # the redirect, counted by reason
    for parquet in (tmp_path / "data" / "download").glob("*.parquet"):
        assert PASSWORD not in pq.read_table(parquet).to_pandas().to_json()


# ------------------------------------------------------------------ 6. a server that drips


def test_a_server_dripping_one_byte_at_a_time_is_cut_at_the_deadline() -> None:
    """The timeout bounded each read, not the download: 161 s for one image with a 5 s timeout.
    With `deadline_s` the whole fetch ends by then (the stage gives img2dataset's timeout:
    GuardedDownloader.opener, run by the slow test below)."""
    from prep.urlguard import DeadlinePassed, FetchPolicy, build_opener

    opener = build_opener(FetchPolicy(allow_private_addresses=True, deadline_s=1.0))
    with Site() as site:
        started = time.monotonic()
        with pytest.raises(DeadlinePassed, match="download deadline of 1 s passed"), \
                opener.open(f"{site.base}/drip.jpg", timeout=5) as response:
            response.read()
        seconds = time.monotonic() - started
        with opener.open(f"{site.base}/good/0.jpg", timeout=5) as response:
            assert response.read()[:2] == b"\xff\xd8"  # a quick image is untouched
        # redirects are part of the fetch they redirect: one deadline for the whole chain
        site.redirects.update({"/hop0.jpg": f"{site.base}/hop1.jpg",
                               "/hop1.jpg": f"{site.base}/drip.jpg"})
        started = time.monotonic()
        with pytest.raises(DeadlinePassed), opener.open(f"{site.base}/hop0.jpg",
                                                        timeout=5) as response:
            response.read()
        assert time.monotonic() - started < 1.0 + FAST_S
    assert 0.9 < seconds < 1.0 + FAST_S, seconds


@pytest.mark.slow
def test_the_download_stage_counts_a_dripping_image_and_finishes(tmp_path) -> None:
    """The real stage: img2dataset's timeout (download.timeout) is each attempt's deadline."""
    with Site() as site:
        images_parquet(tmp_path, [f"{site.base}/good/0.jpg", f"{site.base}/drip.jpg"])
        write_params(tmp_path, timeout=2)
        started = time.monotonic()
        run_stage("download", tmp_path)
        seconds = time.monotonic() - started
    metrics = json.loads((tmp_path / "metrics" / "download.json").read_text())
    assert metrics["successes"] == 1
    assert metrics["failure_reasons"] == {"download deadline of 2 s passed": 1}
    assert seconds < 60, seconds


# ------------------------------------------------------------------ 7. 20 million rows in 4 KB


def dictionary_parquet(path: Path, rows: int, per_group: int = 1_000_000) -> None:
    """A parquet of `rows` identical dictionary-encoded URL/TEXT rows: a few KB on disk."""
    indices = pa.array(np.zeros(per_group, np.int32))
    url = pa.DictionaryArray.from_arrays(indices, pa.array(["http://images.example/a.jpg"]))
    text = pa.DictionaryArray.from_arrays(indices, pa.array(["a caption"]))
    table = pa.table({"URL": url, "TEXT": text})
    with pq.ParquetWriter(path, table.schema, compression="zstd") as writer:
        for _ in range(rows // per_group):
            writer.write_table(table)


def test_a_few_kb_parquet_of_20_million_rows_is_refused_from_its_footer(tmp_path) -> None:
    """It was read whole: 6.5 GB at peak, 123 s."""
    from prep.sources import MetadataError, MetadataSpec, build_metadata
    from prep.urlguard import FetchPolicy

    path = tmp_path / "twenty-million.parquet"
    dictionary_parquet(path, 20_000_000)
    assert path.stat().st_size < 64 * 1024
    pool = pa.default_memory_pool()
    before = pool.bytes_allocated()
    started = time.monotonic()
    spec = MetadataSpec(source="local", path=str(path))
    with pytest.raises(MetadataError, match=r"20,000,000 rows, over metadata.max_rows "
                                            r"\(5,000,000\)"):
        build_metadata(spec, tmp_path / "metadata.parquet", tmp_path / "synthetic", FetchPolicy())
    assert time.monotonic() - started < FAST_S
    assert pool.bytes_allocated() - before < 2**20
    assert not (tmp_path / "metadata.parquet").exists()


# ------------------------------------------------------------------ 8. a YAML alias bomb


def alias_bomb(levels: int = 8, width: int = 9) -> str:
    """A few hundred bytes of YAML whose aliases stand for width^levels strings (9^8 = 43
    million): yaml.safe_load shares the references, a repr writes every one out."""
    lines = ["l0: &l0 [" + ", ".join(['"xxxxxxxxxx"'] * width) + "]"]
    for level in range(1, levels):
        lines.append(f"l{level}: &l{level} [" + ", ".join([f"*l{level - 1}"] * width) + "]")
    return "\n".join(lines)


def test_a_params_error_quotes_only_a_short_prefix_of_the_value(tmp_path) -> None:
    """An 8-level alias bomb as metadata.url_col gave a 312 MB message (1.3 GB RSS)."""
    from pipeline.params import ParamsError, load_section
    from stages.metadata import MetadataParams

    text = alias_bomb() + "\nmetadata:\n  source: local\n  path: x.parquet\n  url_col: *l7\n"
    (tmp_path / "params.yaml").write_text(text)
    assert len(text) < 1000
    started = time.monotonic()
    with pytest.raises(ParamsError) as err:
        load_section("metadata", MetadataParams, tmp_path / "params.yaml")
    message = str(err.value)
    assert time.monotonic() - started < FAST_S
    assert "metadata.url_col = [[[[" in message and "Input should be a valid string" in message
    assert len(message) < 400, len(message)


# ------------------------------------------------------------------ 9. the model servers' proxy

NGINX_HINT = "apt-get install -y nginx-light (.ci/run does it in CI)"


@pytest.mark.slow
def test_the_shipped_proxy_limits_refuse_what_mlflow_models_serve_would_parse(tmp_path) -> None:
    """`mlflow models serve` parses any body whole (400 MiB: 13.8 s, +1.6 GB) and has no header
    or connection limits of its own: serving/nginx.conf, in front of it, answers 413 and 400
    from the request's head, and the server behind sees nothing of either."""
    from harness.proxy import Nginx, RecordingUpstream

    with RecordingUpstream() as upstream, Nginx(tmp_path, upstream.port) as proxy:
        big = (b"POST /invocations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
               b"application/json\r\nContent-Length: %d\r\n\r\n" % (400 * 2**20))
        sock = connect(proxy.pyfunc_port)
        sock.sendall(big + b"{" * 4096)
        assert _read_quietly(sock).startswith(b"HTTP/1.1 413 ")
        sock = connect(proxy.pyfunc_port)
        _send_quietly(sock, b"GET /ping HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Filler: "
                      + b"a" * 2**20 + b"\r\n\r\n")
        assert _read_quietly(sock).startswith(b"HTTP/1.1 400 ")
        assert upstream.requests == []
        status, _, _ = request(f"http://127.0.0.1:{proxy.pyfunc_port}/invocations",
                               raw=b'{"inputs": [1]}')
        assert status == 200 and upstream.requests == [("POST", "/invocations", 15)]


# ------------------------------------------------------------------ 10. a client that hangs up


def test_a_client_that_hangs_up_has_its_request_cancelled(service) -> None:
    """The resize went on after the client hung up. Now its request is cancelled: its rows
    still queued are never computed, and the metrics count it as 499."""
    state = service.state
    text = state.engine.text
    gone = 'clipms_requests_total{endpoint="/v1/embeddings",status="499"}'
    before_gone = metric(request(f"{service.url}/metrics")[1].decode(), gone)
    release = threading.Event()
    state.model_thread.submit(release.wait, 60)  # the model is busy: rows queue
    try:
        calls, items = batch_counts(service.url)
        sock = connect(service.port)
        body = json.dumps({"texts": [f"row {i}" for i in range(10)]}).encode()
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        _wait(lambda: text.depth >= 8, "the rows to queue")
        sock.close()
        _wait(lambda: metric(request(f"{service.url}/metrics")[1].decode(), gone)
              == before_gone + 1, "the request to be cancelled")
    finally:
        release.set()
    assert post_json(f"{service.url}/v1/embeddings", {"texts": ["after"]})[0] == 200
    _, items_after = batch_counts(service.url)
    # the batch already handed to the model thread (max_batch 2) and "after": not the other 8
    assert items_after - items <= 3, items_after - items


def metric(text: str, sample: str) -> float:
    """The value of one sample line (name and labels) of a /metrics text; 0 when absent."""
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


def batch_counts(url: str) -> tuple[float, float]:
    """(model calls, items) of the text tower so far, from /metrics."""
    text = request(f"{url}/metrics")[1].decode()
    return (metric(text, 'clipms_batch_size_count{tower="text"}'),
            metric(text, 'clipms_batch_size_sum{tower="text"}'))


def _wait(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_the_service_refuses_a_bad_limit_at_start() -> None:
    from serving.cli import connection_limits, parse_args

    with pytest.raises(SystemExit, match="max_connections must be > 0, got 0"):
        connection_limits(parse_args(["--max-connections", "0"]))
    with pytest.raises(SystemExit, match="send_timeout_s must be > 0, got 0.0"):
        connection_limits(parse_args(["--send-timeout-s", "0"]))

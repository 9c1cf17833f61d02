"""prep/urlguard.py's download deadline on a real socket pair: every read of a fetch ends by the
fetch's deadline, each read waits at most the socket's own timeout, the response reader keeps
the socket open until it is closed, and a connection whose deadline passed before it was wrapped
is closed and refused. (The whole fetch through img2dataset is in test_urlguard_download.py.)"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from prep.urlguard import DeadlinePassed, _DeadlineSocket, _with_deadline


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, peer = socket.socketpair()
    yield ours, peer
    ours.close()
    peer.close()


def wrapped(sock: socket.socket, seconds: float) -> _DeadlineSocket:
    return _DeadlineSocket(sock, time.monotonic() + seconds, seconds)


def test_reads_before_the_deadline_get_the_peers_bytes(pair) -> None:
    ours, peer = pair
    peer.sendall(b"hello")
    buffer = bytearray(16)
    assert wrapped(ours, 5.0).recv_into(buffer) == 5 and bytes(buffer[:5]) == b"hello"


def test_a_read_takes_no_more_than_it_was_asked_for(pair) -> None:
    """recv_into(buffer, nbytes) as a socket's: nbytes of the peer's bytes, the rest left for the
    next read (xǁ_DeadlineSocketǁrecv_into__mutmut_18: nbytes dropped)."""
    ours, peer = pair
    peer.sendall(b"hello")
    sock, buffer = wrapped(ours, 5.0), bytearray(16)
    assert sock.recv_into(buffer, 2) == 2 and bytes(buffer[:2]) == b"he"
    assert sock.recv_into(buffer) == 3 and bytes(buffer[:3]) == b"llo"


def test_a_peer_that_stalls_ends_at_the_deadline_not_later(pair) -> None:
    ours, _ = pair
    sock = wrapped(ours, 0.3)
    started = time.monotonic()
    with pytest.raises(DeadlinePassed, match="deadline of 0.3 s passed"):
        sock.recv_into(bytearray(16))
    assert 0.25 <= time.monotonic() - started < 2.0


def test_a_trickling_peer_cannot_stretch_the_deadline(pair) -> None:
    """One byte every 0.1 s: each read succeeds, the fetch still ends at its deadline."""
    ours, peer = pair
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.1):
            try:
                peer.sendall(b"x")
            except OSError:
                return

    threading.Thread(target=trickle, daemon=True).start()
    reader = wrapped(ours, 0.6).makefile("rb")
    started, got = time.monotonic(), 0
    try:
        with pytest.raises(DeadlinePassed):
            while reader.read1(16):
                got += 1
    finally:
        stop.set()
    assert got >= 2 and time.monotonic() - started < 2.0


def test_the_sockets_own_timeout_still_bounds_each_read(pair) -> None:
    ours, _ = pair
    ours.settimeout(0.1)
    sock = wrapped(ours, 30.0)  # far: the read's own timeout comes first, as a plain timeout
    with pytest.raises(TimeoutError) as caught:
        sock.recv_into(bytearray(16))
    assert not isinstance(caught.value, DeadlinePassed)
    assert ours.gettimeout() == pytest.approx(0.1)


def test_a_read_after_the_deadline_is_refused_at_once(pair) -> None:
    ours, peer = pair
    peer.sendall(b"late")
    sock = _DeadlineSocket(ours, time.monotonic() - 1.0, 2.0)
    with pytest.raises(DeadlinePassed, match="deadline of 2 s passed"):
        sock.recv_into(bytearray(16))


def test_the_socket_closes_only_when_its_readers_are_closed(pair) -> None:
    """urllib closes the connection's socket before the body is read: the body must still come."""
    ours, peer = pair
    sock = wrapped(ours, 5.0)
    body = sock.makefile("rb")
    sock.close()
    assert ours.fileno() != -1  # still open: a reader needs it
    peer.sendall(b"body")
    assert body.read1(16) == b"body"
    body.close()
    assert ours.fileno() == -1


def test_closing_a_reader_leaves_the_socket_to_its_owner(pair) -> None:
    """A reader closed while the connection still holds its socket leaves it open, as a
    socket.makefile() file does; with two readers, the socket closes after the last one
    (xǁ_DeadlineSocketǁ__init____mutmut_6, ǁreader_closed__mutmut_4, ǁmakefile__mutmut_10)."""
    ours, peer = pair
    sock = wrapped(ours, 5.0)
    sock.makefile("rb").close()
    assert ours.fileno() != -1  # not closed by its owner: open
    first, second = sock.makefile("rb"), sock.makefile("rb")
    sock.close()
    first.close()
    assert ours.fileno() != -1  # the second reader still needs it
    peer.sendall(b"x")
    assert second.read1(4) == b"x"
    second.close()
    assert ours.fileno() == -1


def test_other_modes_are_the_sockets_own_files_with_their_arguments(pair) -> None:
    """Files other than the response reader are socket.makefile()'s, mode, buffering and
    encoding passed on (xǁ_DeadlineSocketǁmakefile__mutmut_7/8/9)."""
    ours, peer = pair
    sock = wrapped(ours, 5.0)
    raw = sock.makefile("wb", 0)  # unbuffered: each write is sent at once
    raw.write(b"ping")
    peer.settimeout(2.0)
    assert peer.recv(16) == b"ping"
    raw.close()
    peer.sendall("café\n".encode("latin-1"))
    with sock.makefile("r", encoding="latin-1") as text:
        assert text.readline() == "café\n"


def test_a_socket_without_readers_closes_at_once_and_text_files_are_plain(pair) -> None:
    ours, _ = pair
    sock = wrapped(ours, 5.0)
    text = sock.makefile("r")
    assert not isinstance(text, type(sock.makefile("rb")))
    text.close()
    sock.close()
    assert ours.fileno() == -1


def test_attributes_pass_through_to_the_socket(pair) -> None:
    ours, _ = pair
    assert wrapped(ours, 5.0).fileno() == ours.fileno()


def test_a_connection_past_its_deadline_is_closed_and_refused(pair, monkeypatch) -> None:
    import prep.urlguard as urlguard

    ours, _ = pair
    connection = http.client.HTTPConnection("127.0.0.1")
    connection.sock = ours
    monkeypatch.setattr(urlguard._FETCH, "deadline", time.monotonic() - 1.0, raising=False)
    with pytest.raises(DeadlinePassed):
        _with_deadline(connection, 3.0)
    assert ours.fileno() == -1


def test_a_connection_gets_the_fetchs_deadline_or_none(pair, monkeypatch) -> None:
    import prep.urlguard as urlguard

    ours, _ = pair
    ours.settimeout(5.0)  # a deadline not taken from the fetch ends as a plain timeout, in 5 s
    connection = http.client.HTTPConnection("127.0.0.1")
    connection.sock = ours
    _with_deadline(connection, None)
    assert connection.sock is ours  # no deadline: the socket as it was
    monkeypatch.setattr(urlguard._FETCH, "deadline", time.monotonic() + 0.2, raising=False)
    _with_deadline(connection, 60.0)
    assert isinstance(connection.sock, _DeadlineSocket)
    with pytest.raises(DeadlinePassed, match="deadline of 60 s"):
        connection.sock.recv_into(bytearray(4))  # the fetch's deadline, not 60 s from now


def test_a_connection_outside_a_fetch_gets_a_deadline_of_its_own(pair) -> None:
    """A connection made with no fetch in progress (no opener set one) still ends its reads
    `seconds` after it was wrapped: not at once, not never (x__with_deadline__mutmut_3/_11)."""
    ours, _ = pair
    connection = http.client.HTTPConnection("127.0.0.1")
    connection.sock = ours
    started = time.monotonic()
    failed: list[BaseException] = []

    def connect() -> None:  # a thread that never made a fetch (x__with_deadline__mutmut_8)
        try:
            _with_deadline(connection, 0.3)
        except BaseException as err:  # noqa: BLE001 - handed to the test's thread
            failed.append(err)

    worker = threading.Thread(target=connect)
    worker.start()
    worker.join()
    assert not failed, failed
    assert isinstance(connection.sock, _DeadlineSocket) and ours.fileno() != -1
    with pytest.raises(DeadlinePassed, match="deadline of 0.3 s passed"):
        connection.sock.recv_into(bytearray(4))
    assert 0.25 <= time.monotonic() - started < 2.0


def test_a_wrapped_socket_makes_text_files_by_default_as_a_socket_does(pair) -> None:
    """makefile() without a mode is a text file, as socket.makefile() is
    (xǁ_DeadlineSocketǁmakefile__mutmut_1/2: a wrong default mode)."""
    ours, peer = pair
    peer.sendall(b"a line\n")
    with wrapped(ours, 5.0).makefile() as text:
        assert text.readline() == "a line\n"

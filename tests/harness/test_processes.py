"""harness/processes.py on real processes: a server that answers, one that dies with its reason in
its log, one that never becomes ready, and process groups that must end whole (a leader and a child
that both ignore SIGTERM; a child left behind by a leader that exited by itself)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from harness import processes

PY = sys.executable
IGNORE_TERM = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)"


def group_gone(pgid: int, within: float = 10.0) -> bool:
    """True once no process of the group `pgid` is left (within `within` s)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def kill_group(pgid: int) -> None:
    """What a failed test leaves of the group it started: killed, so the run leaks nothing."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def test_free_port_can_be_bound_on_loopback() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", processes.free_port()))


def test_waits_for_a_real_http_server_then_stops_it(tmp_path: Path) -> None:
    port, log = processes.free_port(), tmp_path / "http.log"
    proc = processes.spawn([PY, "-m", "http.server", "--bind", "127.0.0.1", str(port)], log,
                           cwd=tmp_path)
    try:
        processes.wait_until(processes.port_open(port), proc, "http.server", log, timeout=60)
        processes.wait_until(processes.http_ok(f"http://127.0.0.1:{port}/"), proc, "http.server",
                             log, timeout=60)
        assert os.getpgid(proc.pid) == proc.pid  # a session (and group) of its own
    finally:
        processes.stop(proc, timeout=10)
    assert proc.returncode is not None and group_gone(proc.pid)
    assert not processes.port_open(port)()


def test_a_process_that_dies_fails_the_wait_at_once_with_its_log(tmp_path: Path) -> None:
    log = tmp_path / "dies.log"
    proc = processes.spawn([PY, "-c", "import sys; print('no such database'); sys.exit(3)"], log)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)dying exited 3:\n.*no such database"):
        processes.wait_until(lambda: False, proc, "dying", log, timeout=60, interval=0.05)
    assert time.monotonic() - started < 30


def test_a_server_that_never_answers_times_out_with_its_log(tmp_path: Path) -> None:
    log = tmp_path / "slow.log"
    proc = processes.spawn([PY, "-c", "print('still compiling', flush=True)\n"
                            "import time; time.sleep(60)"], log)
    try:
        with pytest.raises(TimeoutError, match=r"(?s)slow not ready after 2 s:\n.*compiling"):
            processes.wait_until(lambda: False, proc, "slow", log, timeout=2, interval=0.1)
    finally:
        processes.stop(proc, timeout=5)
    assert proc.returncode == -signal.SIGTERM


def test_stop_kills_a_group_that_ignores_its_signal(tmp_path: Path) -> None:
    child = f"{IGNORE_TERM}; import time; print('child up', flush=True); time.sleep(120)"
    leader = (f"{IGNORE_TERM}; import subprocess, sys, time; "
              f"subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(120)")
    log = tmp_path / "stubborn.log"
    proc = processes.spawn([PY, "-c", leader], log)
    # Both ignore SIGTERM from here on (the leader set it before it started the child).
    processes.wait_until(lambda: "child up" in processes.tail(log), proc, "stubborn", log,
                         timeout=60, interval=0.05)
    started = time.monotonic()
    try:
        processes.stop(proc, timeout=1, kill_timeout=10)
        assert proc.returncode == -signal.SIGKILL and time.monotonic() - started < 10
        assert group_gone(proc.pid), "the child of the group survived"
        processes.stop(proc)  # a second stop of an ended process is harmless
    finally:
        kill_group(proc.pid)


def test_sweep_ends_a_child_its_exited_leader_left_behind(tmp_path: Path) -> None:
    log = tmp_path / "orphan.log"
    proc = processes.spawn([PY, "-c", "import subprocess, sys; subprocess.Popen([sys.executable,"
                            " '-c', 'import time; time.sleep(120)'])"], log)
    try:
        assert proc.wait(timeout=60) == 0
        assert not group_gone(proc.pid, within=0.5), "the orphan should still be running"
        processes.stop(proc, signal.SIGINT, sweep=True)
        assert group_gone(proc.pid), "the sweep left the orphan"
    finally:
        kill_group(proc.pid)


class HttpServer(processes.ServerProcess):
    """`python -m http.server` in the shape of the test servers; `fail_on_ready` plants a failure
    after the process answers (as a database that cannot be created)."""

    what = "http.server"
    startup_timeout_s = 60.0
    poll_interval_s = 0.1

    def __init__(self, root: Path, fail_on_ready: bool = False) -> None:
        super().__init__(root / "http.log")
        self.port, self.fail_on_ready = processes.free_port(), fail_on_ready

    def command(self) -> list[str]:
        return [PY, "-u", "-m", "http.server", "--bind", "127.0.0.1", str(self.port)]

    def ready(self) -> bool:
        return processes.http_ok(f"http://127.0.0.1:{self.port}/")()

    def on_ready(self) -> None:
        if self.fail_on_ready:
            raise RuntimeError("planted")


def test_a_server_process_starts_restarts_on_its_port_and_stops(tmp_path: Path) -> None:
    with HttpServer(tmp_path) as server:
        assert server.running() and processes.port_open(server.port)()
        first = server.proc
        assert first is not None
        server.restart()
        assert server.proc is not first and server.running()
        assert processes.http_ok(f"http://127.0.0.1:{server.port}/")()
        assert server.tail().count("GET / HTTP") >= 2  # one log across the restart ("ab")
    assert server.proc is None and not server.running()
    assert not processes.port_open(server.port)() and group_gone(first.pid)
    server.stop()  # a second stop is harmless


def test_a_failed_start_leaves_nothing_running(tmp_path: Path) -> None:
    server = HttpServer(tmp_path, fail_on_ready=True)
    with pytest.raises(RuntimeError, match="planted"):
        server.start()
    assert server.proc is None and not processes.port_open(server.port)()

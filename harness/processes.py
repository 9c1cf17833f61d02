"""Start, wait for and stop the servers the tests run on 127.0.0.1 (MLflow, PostgreSQL, Prefect,
the search service, `mlflow models serve`, chromedriver, a Ray head).

`spawn()` starts a command in a session of its own, so that its process group is the command and
everything it forks, with its output in a log file; `wait_until()` polls a check until it passes,
failing at once (with the log's tail) when the process exits first and with a `TimeoutError` (with
the log's tail) at the deadline; `stop()` signals the whole group, waits, then SIGKILLs the group.

`ServerProcess` is the one shape of a server the tests hold (harness/mlflow_server.py,
postgres_server.py, prefect_server.py, serving_server.py): a subclass says what to run and when it
is ready; `start()`, `stop()`, `restart()`, `tail()` and `with` are the same for all of them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn(cmd: Sequence[str], log: Path | None, mode: str = "ab",
          **popen: Any) -> subprocess.Popen[bytes]:
    """`cmd` in a new session (its own process group), stdout and stderr to `log` (opened with
    `mode`; None: discarded); `popen` goes to Popen as it is (env, cwd, user, ...)."""
    if log is None:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, **popen)
    with open(log, mode) as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, **popen)


def tail(log: Path | None, chars: int = 3000) -> str:
    """The last `chars` characters of `log` ("" when there is none)."""
    if log is None or not log.exists():
        return ""
    return log.read_text(errors="replace")[-chars:]


def http_ok(url: str, timeout: float = 2.0) -> Callable[[], bool]:
    """A check for `wait_until()`: a GET of `url` answers 200 (refused, an HTTP error: not yet)."""
    def check() -> bool:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return bool(response.status == 200)
    return check


def port_open(port: int) -> Callable[[], bool]:
    """A check for `wait_until()`: something accepts TCP connections on 127.0.0.1:`port`."""
    def check() -> bool:
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", port)) == 0
    return check


def wait_until(ready: Callable[[], object], proc: subprocess.Popen[Any], what: str,
               log: Path | None, timeout: float, interval: float = 0.5,
               chars: int = 3000) -> None:
    """Poll `ready()` (an OSError counts as "not yet") until it is true; RuntimeError as soon as
    `proc` exits, TimeoutError after `timeout` s, each with the tail of `log`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}:\n{tail(log, chars)}")
        try:
            if ready():
                return
        except OSError:
            pass
        time.sleep(interval)
    raise TimeoutError(f"{what} not ready after {timeout:.0f} s:\n{tail(log, chars)}")


def finished_ok(proc: subprocess.Popen[str], timeout: float,
                diagnosis: Callable[[], str] = str) -> None:
    """Wait up to `timeout` s for `proc` (its output piped) and assert it exited 0, showing the
    end of its output and `diagnosis()` (say, its workers' logs) when not; killed if still
    running."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"{out[-3000:]}\n{diagnosis()}"


def stop(proc: subprocess.Popen[Any] | None, signum: int = signal.SIGTERM,
         timeout: float = 15.0, kill_timeout: float = 15.0, sweep: bool = False) -> None:
    """End `proc` (started by `spawn()`, so its pid is its process group's id) and its group:
    `signum` to the group, up to `timeout` s for `proc` to exit, then SIGKILL to the group and up
    to `kill_timeout` s. With `sweep`, SIGKILL to whatever is left of the group afterwards, even
    when `proc` had exited by itself (children it left behind). Safe on None or an ended process."""
    if proc is None:
        return
    if proc.poll() is None:
        _signal_group(proc.pid, signum)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait(timeout=kill_timeout)
    if sweep:
        _signal_group(proc.pid, signal.SIGKILL)


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the whole group has exited already
        os.killpg(pgid, signum)


class ServerProcess:
    """One server process with its log file. A subclass gives `command()` and `ready()` and, where
    it needs them, `popen_options()` (env, cwd, user), `prepare()` (before each spawn) and
    `on_ready()` (once it answers), and the class settings below.

    `start()` spawns it in its own process group, waits (bounded) until `ready()` and `on_ready()`
    pass, and stops it again if they fail, so a failed start leaves nothing running; `stop()` ends
    it and its group and is safe to call twice; `proc` is None while it is stopped.
    """

    what = "server"  # its name in error messages
    startup_timeout_s = 120.0
    poll_interval_s = 0.5
    log_mode = "ab"  # "ab": a restart appends to the same log
    tail_chars = 3000
    stop_signal: int = signal.SIGTERM
    stop_timeout_s = 15.0
    kill_timeout_s = 15.0
    sweep = False  # also SIGKILL what its group left behind (see `stop()`)

    def __init__(self, log: Path) -> None:
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        """True once it serves (an OSError counts as "not yet")."""
        raise NotImplementedError

    def popen_options(self) -> dict[str, Any]:
        return {}

    def prepare(self) -> None:
        """Runs before each spawn (an initdb, say)."""

    def on_ready(self) -> None:
        """Runs once it is ready, before `start()` returns (create a database, say)."""

    def start(self, timeout: float | None = None) -> Self:
        self.prepare()
        self.proc = spawn(self.command(), self.log, self.log_mode, **self.popen_options())
        try:
            wait_until(self.ready, self.proc, self.what, self.log,
                       self.startup_timeout_s if timeout is None else timeout,
                       self.poll_interval_s, self.tail_chars)
            self.on_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        stop(self.proc, self.stop_signal, self.stop_timeout_s, self.kill_timeout_s, self.sweep)
        self.proc = None

    def running(self) -> bool:
        """Started and not exited."""
        return self.proc is not None and self.proc.poll() is None

    def restart(self) -> None:
        """Stop, then start the same command again (same port, same data)."""
        self.stop()
        self.start()

    def tail(self, chars: int | None = None) -> str:
        return tail(self.log, self.tail_chars if chars is None else chars)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

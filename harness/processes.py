"""Start, wait for and stop the servers the tests run on 127.0.0.1 (MLflow, PostgreSQL, Prefect,
the search service, `mlflow models serve`, chromedriver, a Ray head).

`spawn()` starts a command in a session of its own, so that its process group is the command and
everything it forks, with its output in a log file; `wait_until()` polls a check until it passes,
failing at once (with the log's tail) when the process exits first and with a `TimeoutError` (with
the log's tail) at the deadline; `stop()` signals the whole group, waits, then SIGKILLs the group.
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
from typing import Any


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

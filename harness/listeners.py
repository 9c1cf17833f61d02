"""The sockets a process tree listens on, seen with `ss` while it runs.

The engines' servers (Spark's JVM, Ray's gcs_server, raylet and workers) are started by processes
the test does not control and live only while they work, so a `ListenerWatch` samples every
SAMPLE_SECONDS, in a thread, for as long as its `with` block runs. `ss` sees the network namespace
of the process that calls it.
"""

from __future__ import annotations

import ipaddress
import re
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

SAMPLE_SECONDS = 0.2


@dataclass(frozen=True)
class Listener:
    """A listening TCP socket or a bound UDP one; `auth_mode` is RAY_AUTH_MODE in the initial
    environment of the process (None when unset), what a Ray server was started with."""

    proto: str
    host: str  # "*" for every address
    port: int
    process: str
    pid: int
    auth_mode: str | None

    @property
    def loopback(self) -> bool:
        if self.host == "*":
            return False
        address = ipaddress.ip_address(self.host)
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
            address = address.ipv4_mapped
        return address.is_loopback

    def __str__(self) -> str:
        return f"{self.proto} {self.host}:{self.port} {self.process}"


def _parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])


def _in_tree(pid: int, root: int) -> bool:
    while pid > 1:
        if pid == root:
            return True
        pid = _parent(pid)
    return pid == root


def environ_of(pid: int) -> list[bytes] | None:
    """The initial environment of a live process; None once it has exited (gone, or a zombie,
    whose environ reads empty: its socket went with it, between `ss` and this read), and for the
    instant a new process's exec is still under way (it reads empty too, and has no socket yet)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    return raw.split(b"\0") if raw else None


def _auth_mode(environ: list[bytes]) -> str | None:
    values = [item.split(b"=", 1)[1].decode() for item in environ
              if item.startswith(b"RAY_AUTH_MODE=")]
    return values[0] if values else None


def _split(local: str) -> tuple[str, int]:
    host, port = local.rsplit(":", 1)
    return host.strip("[]").split("%", 1)[0], int(port)


def listening(root: int | None = None) -> set[Listener]:
    """The listening sockets of `root` and its descendants (every process when None), now."""
    if shutil.which("ss") is None:
        raise RuntimeError("`ss` (iproute2) is needed to see which sockets listen")
    lines = subprocess.run(["ss", "-ltunpH"], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    found = set()
    for line in lines:
        fields = line.split()
        host, port = _split(fields[4])
        for process, pid in re.findall(r'\("([^"]*)",pid=(\d+)', line):
            if root is None or _in_tree(int(pid), root):
                environ = environ_of(int(pid))
                if environ is not None:  # else it exited after `ss` listed it
                    found.add(Listener(fields[0], host, port, process, int(pid),
                                       _auth_mode(environ)))
    return found


class ListenerWatch:
    """`with ListenerWatch(root) as watch:` ... `watch.seen`: every listener sampled meanwhile."""

    def __init__(self, root: int | None = None) -> None:
        self.root, self.seen = root, set()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        try:
            while True:
                self.seen |= listening(self.root)
                if self._stop.wait(SAMPLE_SECONDS):
                    return
        except BaseException as err:  # noqa: BLE001 (raised again by __exit__)
            self.error = err

    def __enter__(self) -> ListenerWatch:
        listening(self.root)  # fails here, not silently in the thread, when `ss` is missing
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        if self.error is not None:
            raise RuntimeError("the listener watch stopped sampling") from self.error

    def not_loopback(self) -> list[Listener]:
        return sorted((item for item in self.seen if not item.loopback), key=str)

"""The project's search service for tests: `python -m serving` on a free 127.0.0.1 port.

`ServingServer(root, args).start()` launches it, waits (bounded) for `/readyz`, and `.stop()` always
ends it and everything it started (the shape of every test server:
harness.processes.ServerProcess). The service runs with CPU kernel fusion off: a fused graph
compiles for ~10 s per batch shape on a loaded 2-core machine, and the warm-up compiles every
shape; fusion changes the speed of the same graphs, not what the service does.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from harness import processes
from harness.dvc_workspace import tool_env
from harness.processes import free_port

STARTUP_TIMEOUT_S = 300.0


class ServingServer(processes.ServerProcess):
    what = "service"
    startup_timeout_s = STARTUP_TIMEOUT_S
    tail_chars = 4000

    def __init__(self, root: Path, args: list[str], env: dict[str, str] | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        super().__init__(self.root / f"serve-{self.port}.log")
        self.args = args
        self.env = {**tool_env(), "CLIPMS_KERNEL_FUSION": "0", **(env or {})}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "serving", "--host", "127.0.0.1", "--port", str(self.port),
                *self.args]

    def popen_options(self) -> dict[str, Any]:
        return {"env": self.env, "cwd": self.root}

    def ready(self) -> bool:
        return processes.http_ok(f"{self.url}/readyz")()


def request(url: str, body: Any = None, timeout: float = 30.0, raw: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
    """(status, body, headers) of a GET, or a POST of `body` as JSON (or `raw` bytes)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json",
                                                          **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read(), dict(err.headers)


def post_json(url: str, body: Any, **kwargs: Any) -> tuple[int, dict[str, Any]]:
    status, payload, _ = request(url, body, **kwargs)
    return status, json.loads(payload)

"""The search service in this test process: `serving.cli`'s own app and uvicorn configuration
(the bounded httptools protocol included) on a free 127.0.0.1 port, served from a thread, with a
tiny exported bundle and a small index.

A real server with real sockets, like harness/serving_server.py's subprocess, but ready in seconds
and with the ServiceState at hand, so a test can hold the model thread busy or read the batchers'
queues. MindSpore runs unfused here, as in every pytest process (tests/conftest.py).
"""

from __future__ import annotations

import os
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from harness.processes import free_port

RUNTIME_SECTION = "runtime:\n  device_target: CPU\n  jit_level: O0\n  kernel_fusion: false\n"
START_TIMEOUT_S = 120.0


def tiny_world(root: Path, images: int = 6) -> tuple[Path, Path]:
    """(bundle, index) of a random-init tiny model and `images` indexed random images."""
    from clipms.deploy.infer import Encoder
    from clipms.deploy.search import SearchOptions
    from clipms.deploy.searchindex import Item, build_index, bundle_digest
    from harness.tiny_model import export_tiny_bundle, jpeg_bytes, random_images

    bundle = export_tiny_bundle(root)
    encoder = Encoder(bundle, kernel_fusion=False)
    items = [Item(f"img{i:03d}", jpeg_bytes(image), f"caption {i}", "val")
             for i, image in enumerate(random_images(images, seed=3))]
    build_index(encoder, items, root / "index", bundle_digest(bundle), SearchOptions(),
                thumbnail_size=16)
    return bundle, root / "index"


class InProcessService:
    """`with InProcessService(root, args) as service:` the service started with `clipms-serve`
    arguments `args` (--host/--port are set here), stopped at the end of the block."""

    def __init__(self, root: Path, args: list[str]) -> None:
        self.root = Path(root)
        self.port = free_port()
        self.args = ["--host", "127.0.0.1", "--port", str(self.port), *args]
        self.server: Any = None
        self.guard: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def state(self) -> Any:
        return self.guard.state

    def __enter__(self) -> InProcessService:
        import uvicorn

        from serving.cli import build, connection_limits, parse_args, server_config

        (self.root / "params.yaml").write_text(RUNTIME_SECTION)
        with _cwd(self.root):  # the `runtime` section is read from ./params.yaml
            args = parse_args(self.args)
            limits = connection_limits(args)
            self.guard = build(args)
        self.server = uvicorn.Server(server_config(self.guard, args, limits))
        self._thread = threading.Thread(target=self.server.run, name="service", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _ready(f"{self.url}/readyz"):
            if time.monotonic() > deadline or not self._thread.is_alive():
                self.__exit__()
                raise RuntimeError("the in-process service did not become ready")
            time.sleep(0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@contextmanager
def _cwd(path: Path) -> Iterator[None]:
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)

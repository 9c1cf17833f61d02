"""A loopback image site and the helpers that run the data stages against it (the download,
guard and distributor tests share them)."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pandas as pd
import yaml
from PIL import Image

from harness import processes

PROJECT_ROOT = Path(__file__).resolve().parents[1]
SLOW_SECONDS = 2.5       # the slow URL answers after this; the download timeout is 1 s
DRIP_SECONDS = 0.2       # /drip.jpg sends one byte of its body per this, for at most DRIP_MAX_S
DRIP_MAX_S = 120.0
COLOURS = [(200, 30, 30), (30, 160, 60), (40, 60, 220), (230, 200, 40), (140, 50, 180),
           (240, 130, 20), (20, 20, 20)]


def jpeg(colour: tuple[int, int, int], size: tuple[int, int] = (96, 80)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="JPEG", quality=90)
    return out.getvalue()


class Site:
    """A loopback HTTP server: `/good/<i>.jpg`, `/missing.jpg` (404), `/truncated.jpg`,
    `/text.jpg` (plain text), `/slow.jpg` (answers after SLOW_SECONDS), `/redirect.jpg` (302 to
    `redirect_to`), `/stall/<i>.jpg` (waits until `stall` is set, at most 60 s), `/drip.jpg` (a
    JPEG's headers at once, then its body a byte every DRIP_SECONDS: each read of the client is
    quick, the whole never ends), plus any path of
    `files` (its bytes), of `unsized` (its bytes, no Content-Length) and of `redirects` (302 to
    its value)."""

    def __init__(self, redirect_to: str = "http://127.0.0.1:9/",
                 files: dict[str, bytes] | None = None,
                 redirects: dict[str, str] | None = None,
                 unsized: dict[str, bytes] | None = None) -> None:
        self.requests: list[str] = []
        self.unsized = unsized or {}  # served without Content-Length (the body ends at close)
        self.redirects = {"/redirect.jpg": redirect_to, **(redirects or {})}
        self.files = files or {}
        self.stall = threading.Event()
        site = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                site.requests.append(self.path)
                if self.path in site.redirects:
                    self.send_response(302)
                    self.send_header("Location", site.redirects[self.path])
                    self.end_headers()
                    return
                if self.path == "/drip.jpg":
                    site.drip(self)
                    return
                if self.path in site.unsized:
                    self.send_response(200)
                    self.end_headers()
                    self.wfile.write(site.unsized[self.path])
                    return
                body = site.body(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "image/jpeg")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                # The client may have given up (the slow URL): that is the point.
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.wfile.write(body)

            def log_message(self, *_args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def drip(self, handler: BaseHTTPRequestHandler) -> None:
        body = jpeg((90, 90, 90))
        handler.send_response(200)
        handler.send_header("Content-Type", "image/jpeg")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        started = time.monotonic()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for i in range(len(body)):
                if time.monotonic() - started > DRIP_MAX_S:
                    return
                handler.wfile.write(body[i:i + 1])
                handler.wfile.flush()
                time.sleep(DRIP_SECONDS)

    def body(self, path: str) -> bytes | None:
        if path in self.files:
            return self.files[path]
        if path.startswith("/good/"):
            return jpeg(COLOURS[int(path.split("/")[-1].split(".")[0])])
        if path == "/truncated.jpg":
            data = jpeg((10, 120, 120))
            return data[: len(data) // 2]
        if path == "/text.jpg":
            return b"this is not an image, whatever its name says\n"
        if path == "/slow.jpg":
            time.sleep(SLOW_SECONDS)
            return jpeg((120, 120, 120))
        if path.startswith("/stall/"):  # hangs (bounded) until `stall` is set
            self.stall.wait(timeout=60)
            return jpeg((60, 60, 60))
        return None

    def __enter__(self) -> Site:
        self.thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self.stall.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def stage_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(PROJECT_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


def run_stage(name: str, cwd: Path, check: bool = True, env: dict[str, str] | None = None,
              extra_args: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m stages.<name> [extra_args]` in `cwd`, with `env` (default: `stage_env()`)."""
    proc = subprocess.run([sys.executable, "-m", f"stages.{name}", *(extra_args or [])], cwd=cwd,
                          env=env or stage_env(), capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"stage {name} exited {proc.returncode}\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-4000:]}")
    return proc


def kill_download_in_shard_1(folder: Path, site: Site, env: dict[str, str],
                             shard_0_done: Callable[[], bool], interval: float = 0.2) -> None:
    """Run the download stage in `folder` until shard 0 is done (`shard_0_done()`) and shard 1 is
    fetching (`site` was asked for a /stall/ URL), then SIGKILL the stage and every worker it
    spawned (its process group)."""
    stage = processes.spawn([sys.executable, "-m", "stages.download"], None, cwd=folder, env=env)
    try:
        processes.wait_until(
            lambda: shard_0_done() and any(r.startswith("/stall/") for r in site.requests),
            stage, "the download stage (before shard 1)", None, timeout=180, interval=interval)
    finally:
        processes.stop(stage, signal.SIGKILL, timeout=30, sweep=True)


def write_params(folder: Path, **download: object) -> None:
    params = {
        "metadata": {"source": "local", "path": "unused.parquet"},
        "dedupe": {"keep": "all", "min_caption_chars": 5, "val_fraction": 0.3},
        "download": {"image_size": 64, "resize_mode": "center_crop", "encode_quality": 90,
                     "processes": 1, "threads": 8, "timeout": 1, "retries": 0,
                     "samples_per_shard": 4, "allowed_schemes": ["http", "https"],
                     # The test server is on 127.0.0.1: allowed explicitly (the default refuses).
                     "allow_private_addresses": True, "min_success_rate": 0.0, **download},
        "shard": {"samples_per_shard": 2, "min_image_size": 32, "seed": 0, "workers": 1},
    }
    (folder / "params.yaml").write_text(yaml.safe_dump(params))


def part_folder(root: Path, part: int = 0) -> Path:
    """Where img2dataset writes a part of the download store at `root` (one store: one set of
    download settings): `root/s-<fingerprint>/parts/<part>`."""
    stores = sorted(root.glob("s-*"))
    assert len(stores) == 1, f"expected one store in {root}, found {stores}"
    return stores[0] / "parts" / f"{part:05d}"


def images_parquet(folder: Path, urls: list[str]) -> pd.DataFrame:
    """data/images.parquet as dedupe writes it, one row per URL (keys 0..n-1 in hex)."""
    images = pd.DataFrame({"url": urls, "key": [f"{i:016x}" for i in range(len(urls))],
                           "caption": "a caption", "captions": [["a caption"]] * len(urls),
                           "split": "train", "labels": None})
    (folder / "data").mkdir(exist_ok=True)
    images.to_parquet(folder / "data/images.parquet", index=False)
    return images

"""No secret reaches a log, a param, a tag, an artifact or a notice.

The whole pipeline runs as the `clip-pipeline` flow on a real Prefect server, from a metadata URL
that carries a presigned-style signature and a token, over image URLs with a token of their own,
with a failure webhook whose path is its secret; then a run fails and notifies the webhook (which
refuses the notice, so the warning path is taken too), and the metadata stage is run by hand against
a 404. None of the secrets appears in `mlflow.db`, `mlartifacts/`, the stages' output or the Prefect
logs; the redacted URL does (so the search looks in the right places).
"""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from PIL import Image

from harness import prefect_server
from harness.dvc_workspace import make_workspace, run, tool_env
from harness.prefect_server import PrefectStack, run_flow

pytestmark = pytest.mark.slow
prefect_stack = prefect_server.prefect_stack  # the module fixture (pytest finds it by name)

SIGNATURE, CREDENTIAL, TOKEN = "SIGsecret0a1b2c3d4e5f", "AKIAsecretCREDENTIAL", "TOKsecret9z8y7x6w"
IMAGE_TOKEN, HOOK_SECRET = "IMGsecret5v4u3t2s1r", "HOOKsecretT000B000XXXX"
SECRETS = (SIGNATURE, CREDENTIAL, TOKEN, IMAGE_TOKEN, HOOK_SECRET)
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220),
           "yellow": (230, 220, 20)}
SHAPES = ("square", "circle", "stripe")


def image(colour: tuple[int, int, int], shape: str) -> bytes:
    from PIL import ImageDraw

    picture = Image.new("RGB", (64, 64), (128, 128, 128))
    draw = ImageDraw.Draw(picture)
    box = (16, 16, 48, 48)
    {"square": draw.rectangle, "circle": draw.ellipse}.get(
        shape, lambda b, fill: draw.rectangle((0, 28, 64, 36), fill=fill))(box, fill=colour)
    buffer = io.BytesIO()
    picture.save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


class SecretSite:
    """Loopback HTTP: the metadata parquet and images (any query string), a webhook that refuses."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.hooks: list[dict[str, Any]] = []
        self.metadata_gone = False
        site = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server API
                path = self.path.split("?", 1)[0]
                body = site.files.get(path)
                if body is None or (path == "/meta.parquet" and site.metadata_gone):
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length", 0))
                site.hooks.append(json.loads(self.rfile.read(length) or b"{}"))
                self.send_error(403)  # a webhook that refuses: the warning path is logged

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def metadata_url(self) -> str:
        return (f"{self.base}/meta.parquet?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential="
                f"{CREDENTIAL}%2F20261201%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Expires=3600&"
                f"X-Amz-Signature={SIGNATURE}&token={TOKEN}")

    @property
    def hook_url(self) -> str:
        return f"{self.base}/hooks/services/{HOOK_SECRET}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def site() -> Iterator[SecretSite]:
    served = SecretSite()
    rows = []
    for i in range(48):
        name = list(COLOURS)[i % 4]
        shape = SHAPES[(i // 4) % 3]
        served.files[f"/img/{i}.jpg"] = image(COLOURS[name], shape)
        rows.append({"URL": f"{served.base}/img/{i}.jpg?token={IMAGE_TOKEN}",
                     "TEXT": f"a {name} {shape} number {i}"})
    buffer = io.BytesIO()
    pd.DataFrame(rows).to_parquet(buffer)
    served.files["/meta.parquet"] = buffer.getvalue()
    try:
        yield served
    finally:
        served.stop()


def everything_in(folder: Path) -> bytes:
    return b"\n".join(p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file())


def test_no_secret_reaches_mlflow_stage_output_or_prefect_logs(
        prefect_stack: PrefectStack, site: SecretSite, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    ws = make_workspace(tmp_path / "ws", {
        "metadata.source": "local", "metadata.path": site.metadata_url,
        "download.allow_private_addresses": True, "evaluate.zeroshot.source": "none",
        "register.model_name": "clip-secrets"})
    monkeypatch.chdir(ws)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{ws}/mlflow.db")
    monkeypatch.setenv("CLIPMS_FAILURE_WEBHOOK", site.hook_url)

    done, done_id = run_flow(prefect_stack)
    assert done.is_completed(), prefect_stack.logs(done_id)[-4000:]
    failed, failed_id = run_flow(prefect_stack, overrides={"train.batch_size": "many"})
    assert failed.is_failed()
    assert site.hooks and site.hooks[-1]["flow_run_id"] == failed_id  # the notice was sent

    site.metadata_gone = True  # the metadata stage by hand, ending in a 404 that quotes the URL
    stage = run(["python", "-m", "stages.metadata"], ws, check=False, env=tool_env())
    assert stage.returncode != 0 and "404" in stage.stdout + stage.stderr
    places = {
        "mlflow.db": b"".join(p.read_bytes() for p in ws.glob("mlflow.db*")),
        "mlartifacts/": everything_in(ws / "mlartifacts"),
        "stage output": (stage.stdout + stage.stderr).encode(),
        "Prefect logs": (prefect_stack.logs(done_id) + prefect_stack.logs(failed_id)).encode(),
    }
    assert places["mlartifacts/"], "no artifacts were logged"
    leaks = {where: [s for s in SECRETS if s.encode() in blob] for where, blob in places.items()}
    assert leaks == {where: [] for where in places}, leaks
    shown = f"{site.base}/meta.parquet?<redacted>".encode()
    assert shown in places["mlflow.db"] and shown in places["Prefect logs"]
    assert shown in places["stage output"]
    assert f"webhook at {site.base}".encode() in places["Prefect logs"]

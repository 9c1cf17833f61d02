"""Against a real `mlflow models serve` of a registered model: hostile inputs are 400s.

The model is registered in a SQLite registry in a temporary folder (no tracking server needed) and
served by MLflow's own scoring server on a free loopback port, with small row and byte limits set
in its environment. Every hostile input must be an INVALID_PARAMETER_VALUE 400 with the same shape
of message, no traceback and no host path, answered within seconds, and the next valid request
must still be answered.
"""

from __future__ import annotations

import base64
import io
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from harness import processes
from harness.hostile_images import (
    EPS,
    encoded,
    jpeg_many_scans,
    png_bomb,
    png_header_bomb,
    png_sliver,
)
from harness.mlflow_server import http_get
from harness.processes import free_port

pytestmark = pytest.mark.slow
MODEL = "clip-hostile"
MAX_ROWS, MAX_BYTES = 8, 200_000
ANSWER_WITHIN_S = 10.0


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """(url, root, bundle) of `mlflow models serve` running models:/MODEL/1."""
    import mlflow

    from harness.tiny_model import export_tiny_bundle
    from registry import pyfunc

    root = tmp_path_factory.mktemp("pyfunc-serve")
    bundle = export_tiny_bundle(root / "export")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    cwd, old_uri = Path.cwd(), os.environ.get("MLFLOW_TRACKING_URI")
    os.chdir(root)  # the SQLite store's default artifact root is ./mlruns
    os.environ["MLFLOW_TRACKING_URI"] = uri
    try:
        mlflow.set_tracking_uri(uri)
        with mlflow.start_run():
            info = pyfunc.log_model(bundle, name="clip")
        mlflow.register_model(info.model_uri, MODEL)
    finally:
        # Undo the process-global URI too: left set, it outranks MLFLOW_TRACKING_URI in every
        # later test of this process (a run of test_serving_swap went to this store).
        mlflow.set_tracking_uri(None)
        os.chdir(cwd)
        if old_uri is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = old_uri
    port = free_port()
    bin_dir = str(Path(sys.executable).parent)
    env = dict(os.environ, MLFLOW_TRACKING_URI=uri, PATH=bin_dir + os.pathsep + os.environ["PATH"],
               CLIPMS_SERVE_MAX_ROWS=str(MAX_ROWS), CLIPMS_SERVE_MAX_BYTES=str(MAX_BYTES))
    log_path = root / "serve.log"
    proc = processes.spawn(
        [f"{bin_dir}/mlflow", "models", "serve", "-m", f"models:/{MODEL}/1", "--env-manager",
         "local", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        log_path, mode="wb", env=env, cwd=root)
    try:
        processes.wait_until(processes.http_ok(f"http://127.0.0.1:{port}/ping"), proc,
                             "mlflow models serve", log_path, timeout=300, interval=1)
        yield f"http://127.0.0.1:{port}", root, bundle
    finally:
        processes.stop(proc, timeout=20, kill_timeout=20)


def invoke(url: str, columns: list[str], rows: list[list]) -> tuple[int, dict, float]:
    body = json.dumps({"dataframe_split": {"columns": columns, "data": rows}}).encode()
    request = urllib.request.Request(f"{url}/invocations", data=body,
                                     headers={"Content-Type": "application/json"})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, payload = response.status, response.read()
    except urllib.error.HTTPError as err:
        status, payload = err.code, err.read()
    return status, json.loads(payload), time.monotonic() - started


def noise_png(side: int) -> bytes:
    pixels = np.random.default_rng(side).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def hostile_requests(root: Path) -> dict[str, tuple[list[str], list[list], str]]:
    """name -> (columns, rows, what the message must say)."""
    real_image = root / "real.png"
    real_image.write_bytes(encoded("PNG"))
    not_image = root / "notes.txt"
    not_image.write_text("a file of the host that is no image\n")
    not_base64 = "not valid base64; images are accepted only as base64-encoded JPEG, PNG or WEBP"
    big = b64(noise_png(260))  # ~270 KB of base64: over the 200 KB byte limit
    assert len(big) > MAX_BYTES
    return {
        "path to a real image": (["image"], [[str(real_image)]], not_base64),
        "path to an existing non-image": (["image"], [[str(not_image)]], not_base64),
        "path to a missing file": (["image"], [[str(root / "missing.png")]], not_base64),
        "/etc/passwd": (["image"], [["/etc/passwd"]], not_base64),
        "file: URL": (["image"], [["file:///etc/hostname"]], not_base64),
        "decompression bomb PNG (64 MP)": (["image"], [[b64(png_bomb())]],
                                           "over the pixel limit of 50000000"),
        "PNG header claiming 10^10 pixels": (["image"], [[b64(png_header_bomb())]],
                                             "over the pixel limit of 50000000"),
        "PNG of 1 x 100000 pixels (274 bytes)": (["image"], [[b64(png_sliver())]],
                                                 "1x100000 has an aspect ratio over the limit"),
        "EPS": (["image"], [[b64(EPS)]], "not a JPEG, PNG or WEBP image"),
        "GIF": (["image"], [[b64(encoded("GIF"))]], "not a JPEG, PNG or WEBP image"),
        "truncated PNG": (["image"], [[b64(noise_png(64)[:2000])]], "cannot decode image"),
        "JPEG of 10,000 empty scans": (["image"], [[b64(jpeg_many_scans())]],
                                       "scans, over the limit of 100"),
        "too many rows": (["text"], [[f"caption {i}"] for i in range(MAX_ROWS + 1)],
                          f"{MAX_ROWS + 1} rows in one request, over the limit of {MAX_ROWS}"),
        "too many bytes": (["image"], [[big]], f"over the limit of {MAX_BYTES}"),
    }


def test_hostile_inputs_are_400s_and_the_server_keeps_answering(served) -> None:
    url, root, bundle = served
    from clipms.deploy.infer import Encoder

    valid_image = encoded("PNG", size=(40, 32))
    want = Encoder(bundle, kernel_fusion=False).encode_images([valid_image])[0]
    messages = {}
    for name, (columns, rows, expected) in hostile_requests(root).items():
        status, body, seconds = invoke(url, columns, rows)
        assert status == 400, (name, status, body)
        assert body["error_code"] == "INVALID_PARAMETER_VALUE", (name, body)
        assert "stack_trace" not in body, (name, body)
        text = json.dumps(body)
        assert "Traceback" not in text and "site-packages" not in text, (name, text[:500])
        assert str(bundle) not in text and ".py" not in text, (name, text[:500])
        assert expected in body["message"], (name, body["message"][-400:])
        for cell in {str(value)[:40] for row in rows for value in row}:  # never the input
            assert cell not in body["message"], (name, body["message"][:400])
        assert seconds < ANSWER_WITHIN_S, (name, seconds)
        messages[name] = body["message"].split("\nError: ", 1)[-1]
        print(f"{name}: {status} in {seconds:.2f} s: {messages[name]}")
        # ... and the next valid request is answered, with the right embedding.
        status, ok, _ = invoke(url, ["image"], [[b64(valid_image)]])
        assert status == 200, (name, ok)
        np.testing.assert_allclose(ok["predictions"][0]["image_embedding"], want, atol=1e-5)
    # No existence oracle: an existing image, an existing other file and a missing one alike.
    paths = ("path to a real image", "path to an existing non-image", "path to a missing file")
    assert len({messages[name] for name in paths}) == 1, {name: messages[name] for name in paths}
    assert messages["too many rows"].startswith(f"{MAX_ROWS + 1} rows")


def test_concurrent_requests_are_all_answered(served) -> None:
    """MLflow's scoring server runs each request's predict in a thread of its own; MindSpore
    graphs run from two threads at once killed the server (SIGSEGV), so every client but the
    first lost its connection. clipms.deploy.infer.Encoder serialises its graph calls."""
    from concurrent.futures import ThreadPoolExecutor

    from clipms.deploy.infer import Encoder

    url, _, bundle = served
    image = encoded("PNG", size=(40, 32))
    encoder = Encoder(bundle, kernel_fusion=False)
    want_text, want_image = encoder.encode_texts(["a red circle"])[0], \
        encoder.encode_images([image])[0]

    def call(i: int) -> tuple[int, list[float]]:
        column, value = ("text", "a red circle") if i % 2 else ("image", b64(image))
        status, body, _ = invoke(url, [column], [[value]])
        return status, body["predictions"][0][f"{column}_embedding"] if status == 200 else body

    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(call, range(32)))
    for i, (status, embedding) in enumerate(answers):
        assert status == 200, (i, embedding)
        np.testing.assert_allclose(embedding, want_text if i % 2 else want_image, atol=1e-5)
    assert http_get(f"{url}/ping", timeout=5)[0] == 200


def test_logging_into_a_run_of_another_store_names_both_stores(tmp_path, monkeypatch) -> None:
    """The cause of a CI failure of test_serving_swap: a URI left set by mlflow.set_tracking_uri
    outranks MLFLOW_TRACKING_URI, so the caller's run lived in one store while log_model wrote to
    the other ("Run with id=... not found"). log_model now refuses, naming both, before logging."""
    import mlflow

    from registry import pyfunc

    bundle = tmp_path / "export"
    bundle.mkdir()
    for name in pyfunc.BUNDLE_FILES:  # only checked by name: nothing is logged or loaded
        (bundle / name).write_text("{}")
    # File stores: which kind of store does not matter here, and they open in no time.
    other, project = (tmp_path / "other").as_uri(), (tmp_path / "project").as_uri()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.chdir(tmp_path)
    # set_tracking_uri sets the variable too: record its value from before, so that teardown puts
    # that back (a later test's subprocesses inherit the variable: a leaked `other` sent test_amp's
    # `dvc repro` register stage to this file store)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", project)  # (delenv of an unset one records nothing)
    mlflow.set_tracking_uri(other)  # (it sets the variable too, as test_pyfunc_serve undid)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", project)
    try:
        with mlflow.start_run(), pytest.raises(RuntimeError) as refused:
            pyfunc.log_model(bundle)
        assert other in str(refused.value) and project in str(refused.value)
        with pytest.raises(RuntimeError, match="inside an active run"):
            pyfunc.log_model(bundle)
    finally:
        mlflow.set_tracking_uri(None)

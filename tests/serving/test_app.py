"""The search service over HTTP: a real `python -m serving` (uvicorn) on a free loopback port, with
a tiny exported bundle and an index of 30 images. Every endpoint, the planted nearest neighbour,
real batching, a full queue, the safety limits, the bind/token rule."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from harness.hostile_images import EPS, encoded, png_bomb, png_header_bomb
from harness.serving_server import ServingServer, post_json, request
from harness.tiny_model import jpeg_bytes, random_images

pytestmark = pytest.mark.slow
MAX_BATCH, MAX_QUEUE, MAX_ROWS, MAX_BYTES = 4, 8, 16, 200_000
SERVICE_ARGS = ["--max-batch", str(MAX_BATCH), "--max-wait-ms", "100", "--max-queue",
                str(MAX_QUEUE), "--max-rows", str(MAX_ROWS), "--max-bytes", str(MAX_BYTES)]
RUNTIME_SECTION = "runtime:\n  device_target: CPU\n  jit_level: O0\n  kernel_fusion: false\n"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    """A bundle, its index, an Encoder for expected values, and the running service."""
    from clipms.deploy.infer import Encoder
    from clipms.deploy.search import SearchOptions
    from clipms.deploy.searchindex import Item, build_index, bundle_digest
    from harness.tiny_model import export_tiny_bundle

    root = tmp_path_factory.mktemp("serving")
    bundle = export_tiny_bundle(root)
    encoder = Encoder(bundle, kernel_fusion=False)
    images = [jpeg_bytes(im) for im in random_images(30, seed=11, size=(44, 36))]
    items = [Item(f"img{i:03d}", data, f"caption of image {i}", "val")
             for i, data in enumerate(images)]
    build_index(encoder, items, root / "index", bundle_digest(bundle), SearchOptions(),
                thumbnail_size=24)
    # The service runs in `root`, so it reads this `runtime` section as the stages would; O0 is
    # not the CPU default (None), so /v1/model shows whether the section reached MindSpore.
    (root / "params.yaml").write_text(RUNTIME_SECTION)
    server = ServingServer(root, ["--model", str(bundle), "--index", str(root / "index"),
                                  *SERVICE_ARGS]).start()
    try:
        yield {"url": server.url, "encoder": encoder, "images": images, "root": root,
               "digest": bundle_digest(bundle), "server": server}
    finally:
        server.stop()


def test_health_model_page_and_headers(world) -> None:
    url = world["url"]
    assert json.loads(request(f"{url}/healthz")[1]) == {"status": "ok"}
    status, body, headers = request(f"{url}/readyz")
    version = world["digest"][:12]
    assert status == 200 and json.loads(body)["model"] == {"name": "local:bundle",
                                                            "version": version}
    assert headers["x-model-version"] == f"local:bundle/{version}"
    model = json.loads(request(f"{url}/v1/model")[1])
    assert model["index_rows"] == 30 and model["search"] == "exact" and not model["auth_required"]
    # MindSpore's own context in the serving process, as the `runtime` section names it.
    # and the tokenizer without its thread pool (serving.cli.sequential_tokenizer).
    assert model["runtime"] == {"device_target": "CPU", "mode": "graph", "jit_level": "O0",
                                "kernel_fusion": False, "tokenizers_parallelism": "false"}
    status, page, headers = request(f"{url}/")
    assert status == 200 and b'id="query"' in page and b"/static/app.js" in page
    assert b"http" not in page.replace(b"http-equiv", b"")  # nothing from a CDN
    assert request(f"{url}/static/app.js")[0] == 200
    assert headers["x-model-version"] == f"local:bundle/{version}"


def test_embeddings_are_the_models_own(world) -> None:
    encoder, images = world["encoder"], world["images"]
    texts = ["a red circle", "two blue squares"]
    status, body = post_json(f"{world['url']}/v1/embeddings",
                             {"texts": texts, "images": [b64(images[0]), b64(images[5])]})
    assert status == 200 and body["model"]["version"] == world["digest"][:12]
    np.testing.assert_allclose(body["text_embeddings"], encoder.encode_texts(texts), atol=1e-5)
    np.testing.assert_allclose(body["image_embeddings"],
                               encoder.encode_images([images[0], images[5]]), atol=1e-5)
    status, only = post_json(f"{world['url']}/v1/embeddings", {"texts": ["x"]})
    assert status == 200 and only["image_embeddings"] == [] and len(only["text_embeddings"]) == 1


def test_embeddings_as_base64_are_the_float_answer_bit_for_bit(world) -> None:
    """`"encoding_format": "base64"` (OpenAI's option): each row the base64 of its little-endian
    float32 bytes; the default JSON floats read back as exactly those float32 values."""
    url, images = world["url"], world["images"]
    ask = {"texts": ["a red circle", "two blue squares"], "images": [b64(images[2])]}
    status, as_float = post_json(f"{url}/v1/embeddings", ask)
    status64, as_b64 = post_json(f"{url}/v1/embeddings", {**ask, "encoding_format": "base64"})
    assert status == status64 == 200 and as_b64["model"] == as_float["model"]
    for key in ("text_embeddings", "image_embeddings"):
        decoded = np.stack([np.frombuffer(base64.b64decode(row), "<f4")
                            for row in as_b64[key]])
        assert decoded.shape == (len(as_float[key]), world["encoder"].embed_dim)
        assert np.array_equal(decoded, np.asarray(as_float[key], np.float32)), key
    status, body = post_json(f"{url}/v1/embeddings", {"texts": ["x"], "encoding_format": "hex"})
    assert status == 400 and "encoding_format: Input should be 'float' or 'base64'" in \
        body["error"]


def metric(text: str, sample: str) -> float:
    """The value of one sample line (name and labels) of a /metrics text; 0 when absent."""
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


def test_embeddings_answered_in_front_of_the_app_keep_the_contract(world) -> None:
    """POST /v1/embeddings is answered by serving.guard itself (serving.routes.direct_embeddings),
    not by the Starlette app: over one keep-alive connection its answers, its errors (pydantic's
    words, no trace), its headers and its metrics are those of every other endpoint."""
    import http.client

    url, encoder, images = world["url"], world["encoder"], world["images"]
    version = f"local:bundle/{world['digest'][:12]}"
    before = request(f"{url}/metrics")[1].decode()
    bodies = [{"texts": ["a red circle"]}, {"texts": [1]},
              {"texts": ["x"], "encoding_format": None},
              {"images": [b64(images[3])], "texts": ["y"]}, {"texts": ["z"]}]
    connection = http.client.HTTPConnection("127.0.0.1", world["server"].port, timeout=30)
    answers = []
    for body in bodies:
        connection.request("POST", "/v1/embeddings", json.dumps(body),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        answers.append((response.status, json.loads(response.read()), response))
    connection.close()
    assert [status for status, _, _ in answers] == [200, 400, 400, 200, 200]
    for _, _, response in answers:
        assert response.getheader("x-model-version") == version
        assert response.getheader("content-type") == "application/json"
    np.testing.assert_allclose(answers[0][1]["text_embeddings"], encoder.encode_texts(
        ["a red circle"]), atol=1e-5)
    assert answers[1][1] == {"error": "texts/0: Input should be a valid string"}
    assert answers[2][1] == {"error": "encoding_format: Input should be 'float' or 'base64'"}
    np.testing.assert_allclose(answers[3][1]["image_embeddings"], encoder.encode_images(
        [images[3]]), atol=1e-5)
    assert answers[3][1]["model"] == answers[4][1]["model"] == {"name": "local:bundle",
                                                                 "version": version[13:]}
    status, payload, headers = request(f"{url}/v1/embeddings")  # a GET
    assert status == 405 and json.loads(payload) == {"error": "Method Not Allowed"}
    assert headers["allow"] == "POST" and headers["x-model-version"] == version
    after = request(f"{url}/metrics")[1].decode()
    counted = 'clipms_requests_total{endpoint="/v1/embeddings",status="%d"}'
    assert metric(after, counted % 200) - metric(before, counted % 200) == 3
    assert metric(after, counted % 400) - metric(before, counted % 400) == 2
    timed = 'clipms_request_seconds_count{endpoint="/v1/embeddings"}'
    assert metric(after, timed) - metric(before, timed) == 6


def test_search_finds_the_planted_neighbour_first(world) -> None:
    url, encoder, images = world["url"], world["encoder"], world["images"]
    status, body = post_json(f"{url}/v1/search", {"image": b64(images[17]), "k": 5})
    assert status == 200 and len(body["results"]) == 5
    first = body["results"][0]
    assert first["key"] == "img017" and first["score"] == pytest.approx(1.0, abs=1e-4)
    assert first["caption"] == "caption of image 17"
    assert first["thumbnail_url"] == "/v1/thumbnails/img017"
    scores = [r["score"] for r in body["results"]]
    assert scores == sorted(scores, reverse=True)
    # A text query: exactly the brute-force best rows of the collection.
    query = encoder.encode_texts(["a small green triangle"])[0]
    want = np.argsort(-(encoder.encode_images(images) @ query), kind="stable")[:3]
    _, by_text = post_json(f"{url}/v1/search", {"text": "a small green triangle", "k": 3})
    assert [r["key"] for r in by_text["results"]] == [f"img{i:03d}" for i in want]
    # "More like this": by key, without the item itself.
    _, similar = post_json(f"{url}/v1/search", {"key": "img017", "k": 4})
    keys = [r["key"] for r in similar["results"]]
    assert len(keys) == 4 and "img017" not in keys
    assert keys == [r["key"] for r in body["results"][1:5]]


def test_rank_and_thumbnails(world) -> None:
    url, encoder, images = world["url"], world["encoder"], world["images"]
    texts = ["a red circle", "a blue square", "a green star"]
    status, body = post_json(f"{url}/v1/rank", {"image": b64(images[3]), "texts": texts})
    scores = encoder.encode_texts(texts) @ encoder.encode_images([images[3]])[0]
    logits = encoder.logit_scale * scores
    want = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    assert status == 200
    np.testing.assert_allclose(body["probabilities"], want, atol=1e-4)
    assert sum(body["probabilities"]) == pytest.approx(1.0, abs=1e-4)
    status, jpeg, headers = request(f"{url}/v1/thumbnails/img003")
    assert status == 200 and headers["content-type"] == "image/jpeg" and jpeg[:2] == b"\xff\xd8"
    status, missing, _ = request(f"{url}/v1/thumbnails/nope")
    assert status == 404 and json.loads(missing) == {"error": "no such key in the index"}


def hostile_bodies(root: Path) -> dict[str, tuple[str, dict, int, str]]:
    real = root / "real.png"
    real.write_bytes(encoded("PNG"))
    not_b64 = "not valid base64; images are accepted only as base64-encoded JPEG, PNG or WEBP"
    noise = np.random.default_rng(0).integers(0, 256, (170, 170, 3), dtype=np.uint8)
    from io import BytesIO

    from PIL import Image

    buffer = BytesIO()
    Image.fromarray(noise).save(buffer, format="PNG")
    big = b64(buffer.getvalue())  # two of them pass the body limit, not the byte limit
    assert MAX_BYTES < 2 * len(big) < MAX_BYTES + 65536 < 3 * len(big)
    return {
        "path to a real image": ("/v1/embeddings", {"images": [str(real)]}, 400, not_b64),
        "path to a missing file": ("/v1/embeddings", {"images": [str(root / "no.png")]}, 400,
                                   not_b64),
        "/etc/passwd as search image": ("/v1/search", {"image": "/etc/passwd"}, 400, not_b64),
        "decompression bomb": ("/v1/embeddings", {"images": [b64(png_bomb())]}, 400,
                               "images[0]: 8000x8000 = 64000000 pixels, over the pixel limit"),
        "header bomb": ("/v1/search", {"image": b64(png_header_bomb())}, 400,
                        "over the pixel limit"),
        "EPS": ("/v1/rank", {"image": b64(EPS), "texts": ["a"]}, 400, "not a JPEG, PNG or WEBP"),
        "GIF": ("/v1/embeddings", {"images": [b64(encoded("GIF"))]}, 400, "not a JPEG, PNG"),
        "too many rows": ("/v1/embeddings", {"texts": ["t"] * (MAX_ROWS + 1)}, 400,
                          f"{MAX_ROWS + 1} rows in one request, over the limit of {MAX_ROWS}"),
        "too many bytes": ("/v1/embeddings", {"images": [big, big]}, 400,
                           f"over the limit of {MAX_BYTES}"),
        "body over the limit": ("/v1/embeddings", {"images": [big] * 3}, 413,
                                "request body over the limit of"),
        "unknown field": ("/v1/embeddings", {"textz": ["a"]}, 400,
                          "textz: Extra inputs are not permitted"),
        "k too large": ("/v1/search", {"text": "a", "k": 1000}, 400, "k: Input should be"),
        "two queries": ("/v1/search", {"text": "a", "key": "img001"}, 400, "exactly one of"),
        "nothing to embed": ("/v1/embeddings", {}, 400, "give 'texts' and/or 'images'"),
        "unknown key": ("/v1/search", {"key": "../../etc/passwd"}, 404, "no such key"),
        "not JSON": ("/v1/search", None, 400, "not valid JSON"),
    }


def test_a_siglip_models_rank_gives_each_texts_own_sigmoid(tmp_path) -> None:
    """A model trained with the sigmoid loss scores each (image, text) pair on its own: /v1/rank
    answers sigmoid(scale * cosine + bias) per text (open_clip's SigLIP zero-shot), not a
    softmax over the texts."""
    from clipms.deploy.infer import Encoder
    from clipms.deploy.search import SearchOptions
    from clipms.deploy.searchindex import Item, build_index, bundle_digest
    from harness.tiny_model import export_tiny_bundle

    bundle = export_tiny_bundle(tmp_path, logit_bias=-1.5)
    encoder = Encoder(bundle, kernel_fusion=False)
    assert json.loads((bundle / "bundle.json").read_text())["logit_bias"] == -1.5
    images = [jpeg_bytes(im) for im in random_images(3, seed=5)]
    build_index(encoder, [Item(f"k{i}", data, "c", "val") for i, data in enumerate(images)],
                tmp_path / "index", bundle_digest(bundle), SearchOptions(), thumbnail_size=24)
    (tmp_path / "params.yaml").write_text(RUNTIME_SECTION)
    server = ServingServer(tmp_path, ["--model", str(bundle), "--index",
                                      str(tmp_path / "index")]).start()
    try:
        texts = ["a red circle", "a blue square", "a green star"]
        status, body = post_json(f"{server.url}/v1/rank", {"image": b64(images[1]),
                                                          "texts": texts})
    finally:
        server.stop()
    scores = encoder.encode_texts(texts) @ encoder.encode_images([images[1]])[0]
    want = 1 / (1 + np.exp(-(encoder.logit_scale * scores - 1.5)))
    assert status == 200
    np.testing.assert_allclose(body["scores"], scores, atol=1e-5)
    np.testing.assert_allclose(body["probabilities"], want, atol=1e-5)
    assert abs(sum(body["probabilities"]) - 1.0) > 0.1  # independent decisions, no softmax


def test_hostile_inputs_are_client_errors_and_the_service_goes_on(world) -> None:
    url = world["url"]
    for name, (path, body, want_status, want) in hostile_bodies(world["root"]).items():
        started = time.monotonic()
        raw = b"{not json" if body is None else None
        status, payload, headers = request(f"{url}{path}", body, raw=raw)
        seconds = time.monotonic() - started
        assert status == want_status, (name, status, payload[:300])
        error = json.loads(payload)
        assert list(error) == ["error"] and want in error["error"], (name, error)
        assert b"Traceback" not in payload and b".py" not in payload, name
        assert str(world["root"]) not in error["error"] or name.startswith("path"), name
        assert seconds < 10 and "x-model-version" in headers, (name, seconds)
        assert post_json(f"{url}/v1/search", {"text": "still there", "k": 1})[0] == 200, name


def test_concurrent_requests_batch_and_each_gets_its_own_result(world) -> None:
    url, encoder = world["url"], world["encoder"]
    # 6 <= MAX_QUEUE: none refused. Texts on both paths of the tokenizer's cleaning (plain
    # ASCII skips ftfy, clipms.text.clip_tokenizer.fix_text), tokenized together in one batch.
    texts = ["query number 0", "tom &amp; jerry 1", "naïve café 2", "QUERY   number 3",
             "\x1b[1mbold\x1b[0m 4", "query number 5"]
    want = encoder.encode_texts(texts)
    bursts = []  # (model calls, items) per burst; up to 5 bursts, since on a loaded machine the
    for _ in range(5):  # threads' requests can trickle in one by one (a lone request never waits)
        before = batch_counts(url)
        with ThreadPoolExecutor(len(texts)) as pool:
            answers = list(pool.map(
                lambda t: post_json(f"{url}/v1/embeddings", {"texts": [t]}), texts))
        for (status, body), expected in zip(answers, want, strict=True):
            assert status == 200  # every caller gets its own embedding, batched or not
            np.testing.assert_allclose(body["text_embeddings"][0], expected, atol=1e-5)
        after = batch_counts(url)
        bursts.append((after[0] - before[0], after[1] - before[1]))
        if bursts[-1][0] < len(texts):
            break
    assert all(items == len(texts) for _, items in bursts), bursts
    assert bursts[-1][0] < len(texts), bursts  # some batch held > 1


def batch_counts(url: str) -> tuple[float, float]:
    """(model calls, items) of the text tower so far, from /metrics."""
    text = request(f"{url}/metrics")[1].decode()
    values = {}
    for line in text.splitlines():
        for name in ("clipms_batch_size_count", "clipms_batch_size_sum"):
            if line.startswith(name + '{tower="text"}'):
                values[name] = float(line.split()[-1])
    return values.get("clipms_batch_size_count", 0.0), values.get("clipms_batch_size_sum", 0.0)


def test_a_full_queue_answers_503_and_nothing_else_fails(world) -> None:
    url = world["url"]
    status, body = post_json(f"{url}/v1/embeddings", {"texts": ["t"] * (MAX_QUEUE + 1)})
    assert status == 503 and "queue full" in body["error"]
    # Each request fills the queue alone (MAX_QUEUE rows, two batches of MAX_BATCH): while its
    # second half waits for the model, any other arrival is refused. One-text requests filled it
    # only while the service was slower than 24 clients (a faster service answered all 48).
    with ThreadPoolExecutor(24) as pool:
        statuses = list(pool.map(
            lambda i: post_json(f"{url}/v1/embeddings",
                                {"texts": [f"burst {i} {j}" for j in range(MAX_QUEUE)]})[0],
            range(48)))
    assert set(statuses) <= {200, 503} and 503 in statuses and 200 in statuses, statuses
    assert post_json(f"{url}/v1/search", {"text": "after the burst"})[0] == 200
    metrics = request(f"{url}/metrics")[1].decode()
    assert 'clipms_requests_total{endpoint="/v1/embeddings",status="503"}' in metrics
    for name in ("clipms_queue_depth", "clipms_request_seconds_bucket", "clipms_model_info",
                 "clipms_index_rows 30.0"):
        assert name in metrics, name


def test_token_protects_the_api_and_a_public_bind_needs_one(world, tmp_path) -> None:
    refused = subprocess.run([sys.executable, "-m", "serving", "--host", "0.0.0.0",
                              "--model", "unused"], capture_output=True, text=True, timeout=120,
                             env=world["server"].env)
    assert refused.returncode != 0 and "refusing to bind '0.0.0.0' without a bearer token" in \
        refused.stderr
    (tmp_path / "token").write_text("s3cret-token\n")
    with ServingServer(tmp_path, ["--model", str(world["root"] / "bundle"), "--index",
                                  str(world["root"] / "index"), "--token-file",
                                  str(tmp_path / "token")]) as server:
        status, body = post_json(f"{server.url}/v1/search", {"text": "a"})
        assert status == 401 and "bearer token" in body["error"]
        for token, want in ((None, 401), ("s3cret-tokeN", 401), ("s3cret-token", 200)):
            auth = {"Authorization": f"Bearer {token}"} if token else {}
            assert post_json(f"{server.url}/v1/embeddings", {"texts": ["a"]},
                             headers=auth)[0] == want, token
        assert request(f"{server.url}/metrics")[0] == 401
        ok = post_json(f"{server.url}/v1/search", {"text": "a"},
                       headers={"Authorization": "Bearer s3cret-token"})
        assert ok[0] == 200
        wrong = post_json(f"{server.url}/v1/search", {"text": "a"},
                          headers={"Authorization": "Bearer s3cret-tokeN"})
        assert wrong[0] == 401
        assert request(f"{server.url}/healthz")[0] == 200  # probes stay open


SHOWN = """return [...document.querySelectorAll('.result')].filter(card => {
  const img = card.querySelector('img');
  return img.complete && img.naturalWidth > 0 && card.querySelector('.caption').textContent;
}).map(card => card.dataset.key)"""


def test_search_page_in_headless_chromium(world, tmp_path) -> None:
    """Type a query, see result images with captions, click one, see the images like it."""
    from harness.webdriver import Browser

    url = world["url"]
    by_text = [r["key"] for r in post_json(f"{url}/v1/search", {"text": "caption", "k": 24})[1][
        "results"]]
    with Browser() as browser:
        browser.get(f"{url}/")
        line = browser.wait(lambda: "indexed" in browser.text(browser.find("#model"))
                            and browser.text(browser.find("#model")), what="the model line")
        assert f"local:bundle v{world['digest'][:12]}" in line and "30 images indexed" in line
        browser.type(browser.find("#query"), "caption\n")  # Enter submits the form
        # 24 cards, each image loaded and captioned, in the service's order
        assert browser.wait(lambda: browser.script(SHOWN) == by_text, what="result images")
        captions = [browser.text(c) for c in browser.find_all(".result .caption")]
        assert captions[0] == f"caption of image {int(by_text[0][3:])}"
        assert all(browser.text(s).startswith("score ") for s in browser.find_all(".score"))

        browser.click(browser.find_all(".result")[0])
        similar = [r["key"] for r in post_json(f"{url}/v1/search", {"key": by_text[0],
                                                                   "k": 24})[1]["results"]]
        assert browser.wait(lambda: browser.script(SHOWN) == similar, what="similar images")
        assert "images like" in browser.text(browser.find("#status"))
        browser.screenshot(tmp_path / "page.png")
        assert (tmp_path / "page.png").read_bytes()[:4] == b"\x89PNG"


def test_the_service_runs_mindspore_as_the_runtime_section_says(tmp_path, monkeypatch) -> None:
    """The `runtime` section of ./params.yaml (as the stages read it), --device over its device;
    a bad section stops the start with the stages' message, before any model is loaded."""
    from clipms.runtime import RuntimeConfig
    from serving.cli import parse_args, runtime_config

    monkeypatch.chdir(tmp_path)
    assert runtime_config(parse_args([])) == RuntimeConfig()  # no project: MindSpore on CPU
    (tmp_path / "params.yaml").write_text("runtime:\n  mode: pynative\n  kernel_fusion: false\n")
    config = runtime_config(parse_args(["--device", "Ascend"]))
    assert (config.device_target, config.mode, config.kernel_fusion) == ("Ascend", "pynative",
                                                                         False)
    (tmp_path / "params.yaml").write_text("runtime:\n  device_target: TPU\n")
    refused = subprocess.run([sys.executable, "-m", "serving", "--model", "unused"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "runtime.device_target = 'TPU'" in refused.stderr


def test_the_tokenizer_runs_without_its_thread_pool_unless_the_environment_says(
        monkeypatch) -> None:
    """serving.cli.sequential_tokenizer: TOKENIZERS_PARALLELISM false by default; an operator's
    own setting stays."""
    from serving.cli import sequential_tokenizer

    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    sequential_tokenizer()
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    sequential_tokenizer()
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"


def test_the_default_model_is_the_registered_name_of_the_projects_params(tmp_path, monkeypatch):
    """`make serve` passes no --model: the service follows register.model_name's champion."""
    from serving.cli import default_model_name

    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("register:\n  model_name: clip-nightly\n")
    assert default_model_name() == "clip-nightly"

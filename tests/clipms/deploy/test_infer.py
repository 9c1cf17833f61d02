"""clipms.deploy.infer on a real exported bundle: Encoder outputs equal the checkpoint's normalised
features for every input kind, and the `search` CLI finds images in a real tar shard."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from clipms.data import webds
from clipms.data.preprocess import PreprocessError, preprocess_image
from clipms.text.clip_tokenizer import Tokenizer
from clipms.train.trained import RunConfig, load_clip
from harness.dvc_workspace import PROJECT_ROOT, tool_env
from harness.hostile_images import EPS, png_bomb
from harness.tiny_model import CAPTIONS, jpeg_bytes, random_images, write_trained

pytestmark = pytest.mark.slow  # every test here runs an exported bundle (the module fixture)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from clipms.deploy.mindir import export_bundle

    paths = write_trained(tmp_path_factory.mktemp("trained"), seed=0)
    run = RunConfig.read(paths["config"])
    net = load_clip(paths["checkpoint"], run.model)
    out = tmp_path_factory.mktemp("export") / "bundle"
    export_bundle(net, run.preprocess, paths["tokenizer"], out)
    return {"dir": out, "net": net, "run": run, "tokenizer": Tokenizer.load(paths["tokenizer"])}


def reference(net, x, tower):
    import mindspore as ms

    features = getattr(net, tower)(ms.Tensor(x)).asnumpy()
    return features / np.linalg.norm(features, axis=1, keepdims=True)


def test_encoder_matches_the_checkpoint_for_paths_pil_and_bytes(bundle, tmp_path):
    from clipms.deploy.infer import Encoder

    images = random_images(5, seed=3)
    path = tmp_path / "image.jpg"
    path.write_bytes(jpeg_bytes(images[2]))
    encoder = Encoder(bundle["dir"], batch_size=2)  # 5 images -> batches of 2, 2, 1
    got = encoder.encode_images([images[0], jpeg_bytes(images[1]), path, str(path), images[4]])
    decoded = [images[0], jpeg_bytes(images[1]), jpeg_bytes(images[2]), jpeg_bytes(images[2]),
               images[4]]
    x = np.stack([preprocess_image(im, bundle["run"].preprocess) for im in decoded])
    assert got.shape == (5, 32) and got.dtype == np.float32
    np.testing.assert_allclose(got, reference(bundle["net"], x, "encode_image"), atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_encoder_texts_match_the_checkpoint(bundle):
    from clipms.deploy.infer import Encoder

    encoder = Encoder(bundle["dir"])
    got = encoder.encode_texts(CAPTIONS[:7])
    want = reference(bundle["net"], bundle["tokenizer"].encode(CAPTIONS[:7]), "encode_text")
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert encoder.encode_texts([]).shape == (0, 32)
    assert encoder.logit_scale == pytest.approx(1 / 0.07, rel=1e-5)


def test_match_probabilities_are_clips_softmax_or_siglips_sigmoid():
    from clipms.deploy.infer import match_probabilities

    cosines = np.array([0.3, 0.1, -0.2])
    softmax = np.exp(14.0 * cosines) / np.exp(14.0 * cosines).sum()
    np.testing.assert_allclose(match_probabilities(cosines, 14.0), softmax, rtol=1e-12)
    np.testing.assert_allclose(match_probabilities(cosines, 14.0, -3.0),
                               1 / (1 + np.exp(-(14.0 * cosines - 3.0))), rtol=1e-12)
    assert match_probabilities(np.array([1.0, 1.0]), 100.0, 0.0).tolist() == pytest.approx(
        [1.0, 1.0], abs=1e-40)  # each pair alone: both can be certain matches


def test_a_siglip_bundle_carries_its_bias_and_the_pyfunc_embeds_it_as_any(tmp_path):
    """A SigLIP model's bundle: version 2 with `logit_bias` (a version-1 reader would silently
    drop the bias); the Encoder reads it; the MLflow pyfunc's embeddings are the Encoder's."""
    from types import SimpleNamespace

    import pandas as pd

    from clipms.deploy.infer import Encoder
    from clipms.deploy.mindir import export_bundle
    from registry.pyfunc_model import ClipEmbeddingModel

    paths = write_trained(tmp_path / "trained", logit_bias=-4.0)
    run = RunConfig.read(paths["config"])
    out = tmp_path / "bundle"
    bundle = export_bundle(load_clip(paths["checkpoint"], run.model), run.preprocess,
                           paths["tokenizer"], out)
    assert bundle["version"] == 2 and bundle["logit_bias"] == -4.0
    encoder = Encoder(out)
    assert encoder.logit_bias == -4.0
    cosines = np.array([0.5, -0.5])
    np.testing.assert_allclose(encoder.match_probabilities(cosines),
                               1 / (1 + np.exp(-(encoder.logit_scale * cosines - 4.0))))
    model = ClipEmbeddingModel()
    model.load_context(SimpleNamespace(artifacts={"bundle": str(out)}))
    answer = model.predict(None, pd.DataFrame({"text": CAPTIONS[:3]}))
    np.testing.assert_allclose(np.stack(answer["text_embedding"]),
                               encoder.encode_texts(CAPTIONS[:3]), atol=1e-6)


def test_encoder_errors_name_the_problem(bundle, tmp_path):
    from clipms.deploy.infer import BundleError, Encoder

    encoder = Encoder(bundle["dir"])
    with pytest.raises(PreprocessError, match=r"images\[1\].*not found"):
        encoder.encode_images([random_images(1)[0], tmp_path / "missing.jpg"])
    with pytest.raises(PreprocessError, match=r"images\[0\]: not a JPEG, PNG or WEBP"):
        encoder.encode_images([b"not an image"])
    # The bundle's own limits (preprocess.json: max_pixels) apply to every image it encodes.
    with pytest.raises(PreprocessError, match=r"images\[0\]: 8000x8000 = 64000000 pixels, over "
                                              r"the pixel limit of 50000000"):
        encoder.encode_images([png_bomb()])
    with pytest.raises(PreprocessError, match=r"images\[0\]: not a JPEG, PNG or WEBP"):
        encoder.encode_images([EPS])
    with pytest.raises(BundleError, match="no bundle.json"):
        Encoder(tmp_path)
    meta = json.loads((bundle["dir"] / "bundle.json").read_text())
    future = tmp_path / "future"
    future.mkdir()
    for path in bundle["dir"].iterdir():
        (future / path.name).write_bytes(path.read_bytes())
    (future / "bundle.json").write_text(json.dumps({**meta, "version": 3}))
    with pytest.raises(BundleError, match=r"version 3 is not a supported .* \(1, 2\)"):
        Encoder(future)


def write_shard(path, images, captions, first_key=0):
    webds.write_tar(path, [
        (f"{first_key + i:06d}",
         {"jpg": b"truncated" if image is None else jpeg_bytes(image),
          "json": json.dumps({"captions": [caption], "key": f"{first_key + i:06d}"}).encode()})
        for i, (image, caption) in enumerate(zip(images, captions, strict=True))])


def test_search_cli_ranks_shard_images_and_counts_bad_ones(bundle, tmp_path):
    from clipms.deploy.infer import Encoder, search

    images = random_images(6, seed=5)
    (tmp_path / "val").mkdir()
    write_shard(tmp_path / "val" / "000000.tar", [*images[:4], None], CAPTIONS[:5])
    write_shard(tmp_path / "val" / "000001.tar", images[4:], CAPTIONS[5:7], first_key=5)
    query = "a small red circle on the left"
    hits = search(Encoder(bundle["dir"]), tmp_path, query, top=3)
    encoder = Encoder(bundle["dir"])
    as_stored = [jpeg_bytes(im) for im in images]  # the shard holds JPEG bytes, not the originals
    scores = encoder.encode_images(as_stored) @ encoder.encode_texts([query])[0]
    keys = ["000000", "000001", "000002", "000003", "000005", "000006"]  # 000004: broken
    expected = [keys[i] for i in np.argsort(-scores, kind="stable")[:3]]
    assert [h["key"] for h in hits] == expected
    assert hits[0]["searched"] == 6 and hits[0]["skipped"] == 1

    proc = subprocess.run(
        [sys.executable, "-m", "clipms.deploy.infer", "search", "--bundle", str(bundle["dir"]),
         "--shards", str(tmp_path), "--top", "2", query],
        cwd=PROJECT_ROOT, env=tool_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert "best 2 of 6 images (1 undecodable, skipped)" in lines[0]
    assert [line.split()[2] for line in lines[1:]] == expected[:2]

    missing = subprocess.run(
        [sys.executable, "-m", "clipms.deploy.infer", "search", "--bundle", str(tmp_path),
         "--shards", str(tmp_path), "x"],
        cwd=PROJECT_ROOT, env=tool_env(), capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "no bundle.json" in missing.stderr

"""Patch dropout (clipms.model.patch_dropout): open_clip's PatchDropout on the same draw, the
image tower's features with open_clip's under dropout, seeded draws (the hash against its numpy
twin, fresh per forward, per rank as one process of the global batch), training only: evaluation
and the exported graph equal the model without dropout."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

import clipms  # noqa: F401  (sets MindSpore's environment before mindspore is imported)

# isort: split
import mindspore as ms
from mindspore import Tensor, nn

from clipms.model.architecture import CLIPConfig, TextConfig, VisionConfig
from clipms.model.clip import CLIP
from clipms.model.convert import load_openclip
from clipms.model.patch_dropout import (
    PatchDropout,
    drop_patches,
    kept_count,
    reference_scores,
    start_patch_dropout,
)

GOLDEN = Path(__file__).parents[2] / "data" / "openclip"
MICRO = CLIPConfig(
    embed_dim=16,
    vision=VisionConfig(image_size=16, patch_size=4, width=32, layers=1, head_width=16,
                        patch_dropout=0.5),
    text=TextConfig(context_length=8, vocab_size=40, width=32, heads=2, layers=1),
)


@pytest.fixture
def pynative():
    previous = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    yield
    ms.set_context(mode=previous)


class _Tokens(nn.Cell):
    """A PatchDropout as a graph of its own (GRAPH_MODE compiles Cells called as such)."""

    def __init__(self, dropout: PatchDropout) -> None:
        super().__init__()
        self.dropout = dropout

    def construct(self, x):
        return self.dropout(x)


@pytest.mark.parametrize("case", [0, 1, 2])
def test_the_same_draw_keeps_the_tokens_open_clips_patch_dropout_keeps(mode, case):
    """open_clip's PatchDropout in training mode, its torch.randn draw recorded
    (tests/data/openclip/patch_dropout.npz): fed that draw, drop_patches gives its output."""
    golden = np.load(GOLDEN / "patch_dropout.npz")
    x, rand = golden[f"case{case}_x"], golden[f"case{case}_rand"]
    keep = kept_count(rand.shape[1], float(golden[f"case{case}_prob"]))
    out = drop_patches(Tensor(x), Tensor(rand), keep).asnumpy()
    np.testing.assert_array_equal(out, golden[f"case{case}_out"])


def test_the_image_tower_under_dropout_gives_open_clips_features(pynative):
    """micro_gelu's image tower with patch_dropout 0.5 in training mode, open_clip's draw fed to
    ours: same features (the dropout sits where open_clip's does: after the positional
    embedding, before ln_pre, the class token kept)."""
    golden = np.load(GOLDEN / "patch_dropout.npz")
    reference = np.load(GOLDEN / "micro_gelu.npz")
    config = GOLDEN / "micro_gelu.json"
    net = load_openclip(config, GOLDEN / "micro_gelu.safetensors")
    cfg = dataclasses.replace(net.config, vision=dataclasses.replace(
        net.config.vision, patch_dropout=float(golden["tower_patch_dropout"])))
    dropped = CLIP(cfg)
    for name, param in dropped.parameters_and_names():
        param.set_data(dict(net.parameters_and_names())[name].data)
    dropout = dropped.visual.patch_dropout
    start_patch_dropout(dropped, seed=0)
    dropout._scores = lambda n: Tensor(golden["tower_rand"])  # open_clip's draw, not ours
    dropped.set_train(True)
    features = dropped.encode_image(Tensor(reference["images"])).asnumpy()
    np.testing.assert_allclose(features, golden["tower_image_features"], atol=2e-5)
    dropped.set_train(False)  # and without dropout, the converted model's own features
    np.testing.assert_allclose(dropped.encode_image(Tensor(reference["images"])).asnumpy(),
                               reference["image_features"], atol=2e-5)


def test_the_draws_are_the_numpy_twins_fresh_per_forward_and_counted(mode):
    dropout = PatchDropout(0.5, 16)
    start_patch_dropout(_Tokens(dropout), seed=7, first_sample=3)
    tokens = _Tokens(dropout).set_train(True)
    x = np.random.default_rng(0).normal(size=(4, 17, 6)).astype(np.float32)
    outs = []
    for draw in range(3):
        out = tokens(Tensor(x)).asnumpy()
        scores = reference_scores(7, draw, 3, 4, 16)
        order = np.argsort(-scores, axis=1, kind="stable")[:, :8]
        want = np.concatenate([x[:, :1], np.take_along_axis(x[:, 1:], order[..., None], 1)], 1)
        np.testing.assert_array_equal(out, want)
        outs.append(out)
    assert int(dropout.draws.asnumpy()) == 3
    assert not np.array_equal(outs[0], outs[1]) and not np.array_equal(outs[1], outs[2])
    # a uniformly random subset: over many draws every patch is kept about half the time
    kept = np.zeros(16)
    for draw in range(400):
        kept[np.argsort(-reference_scores(1, draw, 0, 1, 16)[0])[:8]] += 1
    assert np.all(np.abs(kept / 400 - 0.5) < 0.1), kept


def test_two_ranks_draw_what_one_process_draws_for_the_global_batch():
    whole = reference_scores(3, 5, 0, 8, 16)
    np.testing.assert_array_equal(reference_scores(3, 5, 0, 4, 16), whole[:4])
    np.testing.assert_array_equal(reference_scores(3, 5, 4, 4, 16), whole[4:])
    assert not np.array_equal(reference_scores(4, 5, 0, 8, 16), whole)  # the seed matters


def test_an_unseeded_or_evaluating_dropout_keeps_every_token(mode):
    x = Tensor(np.random.default_rng(1).normal(size=(2, 17, 4)).astype(np.float32))
    training_unseeded = _Tokens(PatchDropout(0.5, 16)).set_train(True)
    np.testing.assert_array_equal(training_unseeded(x).asnumpy(), x.asnumpy())
    dropout = PatchDropout(0.5, 16)
    evaluating = _Tokens(dropout)
    start_patch_dropout(evaluating, seed=0)
    np.testing.assert_array_equal(evaluating.set_train(False)(x).asnumpy(), x.asnumpy())
    assert int(dropout.draws.asnumpy()) == 0
    assert kept_count(16, 0.5) == 8 and kept_count(49, 0.25) == 36 and kept_count(4, 0.9) == 1
    with pytest.raises(ValueError, match="vision.patch_dropout=1.0 must be a share in"):
        VisionConfig(patch_dropout=1.0).validate()


def _trained_with_dropout(vocab_size: int = 40) -> tuple[CLIP, CLIP]:
    """A MICRO model after 3 training steps with patch dropout, and the same weights in a model
    without patch dropout."""
    from clipms.train.loop import RandomBatches, TrainConfig, train

    cfg = dataclasses.replace(MICRO, text=dataclasses.replace(MICRO.text, vocab_size=vocab_size))
    result = train(TrainConfig(model=cfg, batch_size=4, max_steps=3, lr=1e-3, warmup_steps=1),
                   RandomBatches(cfg, 4, 3), None)
    trained = result.model
    assert int(trained.visual.patch_dropout.draws.asnumpy()) == 3 and not trained.training
    plain = CLIP(dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision,
                                                                     patch_dropout=0.0)))
    weights = dict(trained.parameters_and_names())
    for name, param in plain.parameters_and_names():
        param.set_data(ms.Tensor(weights[name].asnumpy()))
    return trained, plain


@pytest.mark.slow  # trains a model and compiles its eval graph: ~10 CPU-s
def test_after_training_the_model_evaluates_without_dropout():
    trained, plain = _trained_with_dropout()
    images = Tensor(np.random.default_rng(2).normal(size=(5, 3, 16, 16)).astype(np.float32))
    np.testing.assert_array_equal(trained.encode_image(images).asnumpy(),
                                  plain.encode_image(images).asnumpy())
    previous = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)  # a graph compiled for evaluation stays compiled
    try:
        trained.set_train(True)  # what a training forward does instead
        assert not np.array_equal(trained.encode_image(images).asnumpy(),
                                  plain.encode_image(images).asnumpy())
    finally:
        ms.set_context(mode=previous)


@pytest.mark.slow
def test_the_exported_graph_never_drops(tmp_path):
    """The MindIR image encoder of a model that trained with patch dropout equals the same
    weights without it (export compiles its own graphs: slow)."""
    from clipms.data.preprocess import PreprocessConfig
    from clipms.deploy.infer import Encoder
    from clipms.deploy.mindir import export_bundle
    from clipms.text.clip_tokenizer import Tokenizer
    from harness.tiny_model import CAPTIONS

    tokenizer = Tokenizer.train(CAPTIONS * 4, vocab_size=600, context_length=8)
    trained, plain = _trained_with_dropout(tokenizer.vocab_size)
    images = np.random.default_rng(2).normal(size=(5, 3, 16, 16)).astype(np.float32)
    want = plain.encode_image(Tensor(images)).asnumpy()
    tokenizer.save(tmp_path / "tokenizer.json")
    export_bundle(trained, PreprocessConfig(image_size=16), tmp_path / "tokenizer.json",
                  tmp_path / "bundle")
    exported = Encoder(tmp_path / "bundle", kernel_fusion=False).encode_preprocessed(images)
    np.testing.assert_allclose(exported, want / np.linalg.norm(want, axis=1, keepdims=True),
                               atol=1e-6)


def test_the_draw_counter_is_named_by_its_path_in_the_model():
    """Parameter names are what checkpoints and the converter see: the counter's is its path."""
    net = CLIP(MICRO)
    assert "visual.patch_dropout.draws" not in {p.name for p in net.get_parameters()}
    assert start_patch_dropout(net, seed=1)
    assert {p.name for p in net.get_parameters()} == {n for n, _ in net.parameters_and_names()}
    assert "visual.patch_dropout.draws" in {p.name for p in net.get_parameters()}
    assert not start_patch_dropout(CLIP(dataclasses.replace(
        MICRO, vision=dataclasses.replace(MICRO.vision, patch_dropout=0.0))), seed=1)

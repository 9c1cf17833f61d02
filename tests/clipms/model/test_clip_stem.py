"""vision.stem 'conv' (clipms.model.clip.ConvStem): the function of nn.Conv2d + LayerNorm + ReLU
written out in numpy, the config's rules, the parameter count, the MindIR bundle's parity, and the
refusal to convert to open_clip (it has no such tower)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import clipms  # noqa: F401  (sets MindSpore's environment before mindspore is imported)

# isort: split
import mindspore as ms

from clipms.model.architecture import CLIPConfig, VisionConfig, get_preset, resolve_model
from clipms.model.clip import CLIP, ConvStem, count_parameters
from clipms.model.convert import ConversionError, clip_params, clipms_to_openclip, save_clipms
from harness.tiny_model import CAPTIONS, random_images, tiny_config

REPO = Path(__file__).resolve().parents[3]


def conv2d_reference(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """torch.nn.functional.conv2d(x, weight, stride=2, padding=1) for NCHW x, (O, C, 3, 3)."""
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    side = x.shape[2] // 2
    out = np.zeros((x.shape[0], weight.shape[0], side, side), np.float64)
    for i in range(side):
        for j in range(side):
            window = padded[:, :, 2 * i:2 * i + 3, 2 * j:2 * j + 3]
            out[:, :, i, j] = np.einsum("ncyx,ocyx->no", window, weight)
    return out


def stem_reference(stem: ConvStem, image: np.ndarray) -> np.ndarray:
    x = image.astype(np.float64)
    for conv, norm in zip(stem.convs, stem.norms, strict=True):
        weight = conv.weight.asnumpy()
        x = conv2d_reference(x, weight.reshape(weight.shape[0], -1, 3, 3))
        mean, var = x.mean(axis=1, keepdims=True), x.var(axis=1, keepdims=True)
        x = (x - mean) / np.sqrt(var + 1e-5)  # LayerNorm over the channels of each position
        x = x * norm.gamma.asnumpy()[None, :, None, None] + norm.beta.asnumpy()[None, :, None, None]
        x = np.maximum(x, 0)
    n, c, g, _ = x.shape
    tokens = x.reshape(n, c, g * g).transpose(0, 2, 1)  # row-major over the grid
    return tokens @ stem.proj.weight.asnumpy().T.astype(np.float64) + stem.proj.bias.asnumpy()


@pytest.mark.parametrize("mode", [ms.GRAPH_MODE, ms.PYNATIVE_MODE])
def test_conv_stem_is_stride_2_convolutions_then_a_1x1(mode):
    previous = ms.get_context("mode")
    ms.set_context(mode=mode)
    try:
        cfg = VisionConfig(image_size=32, patch_size=8, width=32, head_width=16, stem="conv")
        assert cfg.stem_channels == (3, 8, 16, 32)
        ms.set_seed(1)
        stem = ConvStem(cfg)
        rng = np.random.default_rng(0)
        for norm in stem.norms:  # non-trivial gains and shifts, so the reference checks them too
            norm.gamma.set_data(ms.Tensor(rng.uniform(0.5, 1.5, norm.gamma.shape), ms.float32))
            norm.beta.set_data(ms.Tensor(rng.normal(0, 0.3, norm.beta.shape), ms.float32))
        image = rng.normal(size=(3, 3, 32, 32)).astype(np.float32)
        got = stem(ms.Tensor(image)).asnumpy()
    finally:
        ms.set_context(mode=previous)
    assert got.shape == (3, 16, 32)  # a 4x4 grid of width-32 tokens
    np.testing.assert_allclose(got, stem_reference(stem, image), rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # builds, converts or exports the conv-stem model in graph mode
def test_conv_stem_model_has_the_patch_models_token_grid_and_counted_parameters():
    from ops.preflight import parameter_count

    for preset in ("mini", "tiny"):
        cfg = resolve_model(preset, {"vision": {"stem": "conv"}, "text": {"vocab_size": 600}})
        net = CLIP(cfg)
        names = {p.name for p in net.get_parameters()}
        assert "visual.patch_embed.weight" not in names and "visual.stem.proj.weight" in names
        assert net.visual.positional_embedding.shape == (cfg.vision.num_tokens, cfg.vision.width)
        assert count_parameters(net) == parameter_count(cfg)
        image = ms.Tensor(np.zeros((2, 3, 64, 64), np.float32))
        assert net.encode_image(image).shape == (2, cfg.embed_dim)
    assert get_preset("mini").vision.stem == "patch"  # the presets keep open_clip's tower


def test_conv_stem_config_rules():
    with pytest.raises(ValueError, match=r"vision.stem='resnet' is not one of \['patch', 'conv'\]"):
        CLIPConfig.from_dict({"vision": {"stem": "resnet"}})
    with pytest.raises(ValueError, match="power-of-two vision.patch_size"):
        CLIPConfig.from_dict({"vision": {"image_size": 48, "patch_size": 12, "stem": "conv"}})
    conv = resolve_model("mini", {"vision": {"stem": "conv"}})
    assert CLIPConfig.from_dict(conv.to_dict()) == conv
    with pytest.raises(ValueError, match="no open_clip equivalent"):
        conv.to_openclip()
    openclip = get_preset("mini").to_openclip()
    openclip["vision_cfg"]["stem"] = "conv"  # not an open_clip key: not read from its configs
    with pytest.raises(ValueError, match=r"unsupported open_clip vision_cfg key\(s\) \['stem'\]"):
        CLIPConfig.from_openclip(openclip)


def _conv_tiny(vocab_size: int) -> CLIPConfig:
    cfg = tiny_config(vocab_size)
    return dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, stem="conv"))


@pytest.mark.slow  # builds, converts or exports the conv-stem model in graph mode
def test_to_openclip_refuses_a_conv_stem_model(tmp_path):
    cfg = _conv_tiny(600)
    net = CLIP(cfg)
    with pytest.raises(ConversionError, match="open_clip has no such image tower"):
        clipms_to_openclip(clip_params(net), cfg)
    save_clipms(net, tmp_path / "m.ckpt")
    done = subprocess.run([sys.executable, "-m", "clipms.model.convert", "to-openclip",
    "--checkpoint",
                           str(tmp_path / "m.ckpt"), "--out", str(tmp_path / "w.safetensors")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "vision.stem='conv': open_clip has no such image tower" in done.stderr
    assert not (tmp_path / "w.safetensors").exists() and not (tmp_path / "w.json").exists()


@pytest.mark.slow  # builds, converts or exports the conv-stem model in graph mode
def test_conv_stem_bundle_exports_and_passes_parity(tmp_path):
    from clipms.data.preprocess import PreprocessConfig, preprocess_image
    from clipms.deploy.mindir import assert_parity, export_bundle, parity_report
    from clipms.text.clip_tokenizer import Tokenizer

    tokenizer = Tokenizer.train(CAPTIONS * 4, vocab_size=600, context_length=16)
    tokenizer.save(tmp_path / "tokenizer.json")
    ms.set_seed(3)
    net = CLIP(_conv_tiny(tokenizer.vocab_size))
    preprocess = PreprocessConfig(image_size=32)
    bundle = export_bundle(net, preprocess, tmp_path / "tokenizer.json", tmp_path / "bundle")
    assert bundle["model"]["vision"]["stem"] == "conv"
    assert json.loads((tmp_path / "bundle" / "bundle.json").read_text()) == bundle
    images = np.stack([preprocess_image(im, preprocess) for im in random_images(5)])
    tokens = tokenizer.encode(CAPTIONS[:5])
    report = parity_report(net, tmp_path / "bundle", images, tokens, (1, 3, 8), tolerance=1e-5)
    assert report["passed"], report
    assert_parity(report)
    other = CLIP(_conv_tiny(tokenizer.vocab_size))  # other weights: the check can fail
    assert not parity_report(other, tmp_path / "bundle", images, tokens, (1,), tolerance=1e-5)[
        "passed"]

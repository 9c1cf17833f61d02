"""clipms.model.architecture + clipms.model.clip: presets, shapes/dtypes, causal masking, EOT
pooling, both modes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import clipms  # noqa: F401  (sets MindSpore's environment before mindspore is imported)

# isort: split
import mindspore as ms

from clipms.model.architecture import PRESETS, CLIPConfig, TextConfig, get_preset
from clipms.model.clip import CLIP, GELU, count_parameters, l2_normalize, to_mixed_precision
from clipms.model.convert import openclip_shapes

MODES = {"graph": ms.GRAPH_MODE, "pynative": ms.PYNATIVE_MODE}

# Measured with open_clip 3.3.0: sum(p.numel() for p in open_clip.create_model(name).parameters()).
OPENCLIP_PARAM_COUNTS = {"ViT-B-32": 151_277_313, "ViT-B-16": 149_620_737}


@pytest.fixture
def pynative():
    previous = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    yield
    ms.set_context(mode=previous)


def _tokens(cfg: TextConfig, lengths: list[int], seed: int = 0) -> np.ndarray:
    """SOT, random words, EOT (= the highest id), zero padding: as the tokenizer makes them."""
    rng = np.random.default_rng(seed)
    eot, sot = cfg.vocab_size - 1, cfg.vocab_size - 2
    tokens = np.zeros((len(lengths), cfg.context_length), np.int32)
    for row, n in enumerate(lengths):
        tokens[row, 0] = sot
        tokens[row, 1 : n + 1] = rng.integers(1, sot, n)
        tokens[row, n + 1] = eot
    return tokens


def _images(cfg: CLIPConfig, n: int, seed: int = 0) -> np.ndarray:
    side = cfg.vision.image_size
    return np.random.default_rng(seed).normal(size=(n, 3, side, side)).astype(np.float32)


def _micro() -> CLIPConfig:
    return CLIPConfig.from_openclip("tests/data/openclip/micro_gelu.json")


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_preset_shapes_and_dtypes(name, pynative):
    cfg = get_preset(name)
    ms.set_seed(0)
    net = CLIP(cfg)
    images = ms.Tensor(_images(cfg, 2))
    tokens = ms.Tensor(_tokens(cfg.text, [3, 5]))
    image_features, text_features, scale = net(images, tokens)
    assert image_features.shape == (2, cfg.embed_dim) and image_features.dtype == ms.float32
    assert text_features.shape == (2, cfg.embed_dim) and text_features.dtype == ms.float32
    norms = np.linalg.norm(image_features.asnumpy(), axis=1)
    np.testing.assert_allclose(norms, 1.0, rtol=1e-5)
    np.testing.assert_allclose(scale.asnumpy(), 1 / 0.07, rtol=1e-5)  # exp(ln(1/0.07))
    raw = net.encode_image(images)
    assert raw.shape == (2, cfg.embed_dim)
    assert not np.allclose(np.linalg.norm(raw.asnumpy(), axis=1), 1.0)  # unnormalised by default
    # The Cell's parameters are exactly open_clip's tensors, re-laid-out.
    expected = sum(int(np.prod(s)) for s in openclip_shapes(cfg).values())
    assert count_parameters(net) == expected


def test_tiny_has_the_documented_size():
    cfg = get_preset("tiny")
    assert (cfg.vision.image_size, cfg.vision.patch_size, cfg.vision.width) == (64, 8, 256)
    assert (cfg.vision.layers, cfg.vision.heads) == (4, 4)
    assert (cfg.text.context_length, cfg.text.width, cfg.text.heads, cfg.text.layers) == (
        32, 256, 4, 4)
    assert cfg.embed_dim == 256
    assert sum(int(np.prod(s)) for s in openclip_shapes(cfg).values()) == 19_173_377


@pytest.mark.parametrize("name", sorted(OPENCLIP_PARAM_COUNTS))
def test_vit_b_presets_match_openclip_parameter_counts(name):
    cfg = get_preset(name)
    assert sum(int(np.prod(s)) for s in openclip_shapes(cfg).values()) == (
        OPENCLIP_PARAM_COUNTS[name])
    assert cfg.to_openclip()["vision_cfg"]["patch_size"] == int(name.split("-")[-1])


@pytest.mark.parametrize("mode", ["graph", "pynative"], indirect=True)
def test_text_is_causal_and_pooled_at_eot(mode):
    cfg = _micro()
    ms.set_seed(1)
    net = CLIP(cfg)
    tokens = np.repeat(_tokens(cfg.text, [4]), 3, axis=0)  # three copies of one caption
    tokens[1, 9] = 7  # after the EOT (position 5): invisible to the EOT token under a causal mask
    tokens[2, 2] = (tokens[2, 2] % 500) + 1  # before the EOT: must change the features
    features = net.encode_text(ms.Tensor(tokens)).asnumpy()
    np.testing.assert_array_equal(features[0], features[1])
    assert np.abs(features[0] - features[2]).max() > 1e-4


@pytest.mark.slow  # compiles and runs the model in both modes
def test_graph_and_pynative_agree():
    cfg = _micro()
    ms.set_seed(2)
    net = CLIP(cfg)
    images, tokens = ms.Tensor(_images(cfg, 2)), ms.Tensor(_tokens(cfg.text, [2, 6]))
    previous = ms.get_context("mode")
    try:
        outputs = {}
        for name, value in MODES.items():
            ms.set_context(mode=value)
            outputs[name] = [t.asnumpy() for t in net(images, tokens)]
    finally:
        ms.set_context(mode=previous)
    for graph_out, pynative_out in zip(outputs["graph"], outputs["pynative"], strict=True):
        np.testing.assert_allclose(graph_out, pynative_out, atol=1e-6)


def test_quick_gelu_changes_the_function(pynative):
    cfg = _micro()
    ms.set_seed(3)
    exact = CLIP(cfg)
    ms.set_seed(3)
    quick = CLIP(dataclasses.replace(cfg, quick_gelu=True))
    images = ms.Tensor(_images(cfg, 1))
    assert np.abs(exact.encode_image(images).asnumpy()
                  - quick.encode_image(images).asnumpy()).max() > 1e-6


def test_mixed_precision_keeps_the_parameter_names_and_fp32_master_weights(pynative):
    cfg = _micro()
    ms.set_seed(4)
    net = CLIP(cfg)
    names = [name for name, _ in net.parameters_and_names()]
    images, tokens = ms.Tensor(_images(cfg, 2)), ms.Tensor(_tokens(cfg.text, [3, 3]))
    reference = net.encode_image(images).asnumpy()
    to_mixed_precision(net)
    assert [name for name, _ in net.parameters_and_names()] == names  # no O2 wrapper cells
    assert all(p.dtype == ms.float32 for p in net.get_parameters())
    lowered = net.encode_image(images)
    assert lowered.dtype == ms.float16  # the towers compute in fp16
    assert np.abs(lowered.asnumpy().astype(np.float32) - reference).max() < 0.05
    assert net.encode_text(tokens).shape == (2, cfg.embed_dim)


@pytest.mark.parametrize("mode", ["graph", "pynative"], indirect=True)
def test_gelu_is_the_exact_erf_gelu(mode):
    x = ms.Tensor(np.linspace(-6, 6, 2001, dtype=np.float32))
    reference = ms.nn.GELU(approximate=False)(x).asnumpy()  # MindSpore's own erf GELU
    np.testing.assert_allclose(GELU()(x).asnumpy(), reference, atol=1e-6)
    tanh_approx = ms.nn.GELU()(x).asnumpy()
    assert np.abs(tanh_approx - reference).max() > 1e-4  # the default nn.GELU() is not it


def test_l2_normalize_matches_numpy(pynative):
    x = np.random.default_rng(5).normal(size=(3, 7)).astype(np.float32)
    expected = x / np.linalg.norm(x, axis=1, keepdims=True)
    np.testing.assert_allclose(l2_normalize(ms.Tensor(x)).asnumpy(), expected, rtol=1e-6)


def test_config_round_trips_and_replaces():
    for cfg in PRESETS.values():
        assert CLIPConfig.from_dict(cfg.to_dict()) == cfg
        assert CLIPConfig.from_openclip(cfg.to_openclip()) == cfg
    hub_style = {"model_cfg": PRESETS["ViT-B-16"].to_openclip(), "preprocess_cfg": {}}
    assert CLIPConfig.from_openclip(hub_style) == PRESETS["ViT-B-16"]
    tiny = get_preset("tiny")
    swapped = dataclasses.replace(tiny, text=dataclasses.replace(tiny.text, vocab_size=1000))
    assert swapped.text.vocab_size == 1000 and tiny.text.vocab_size == 49408


def test_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        get_preset("huge")
    with pytest.raises(ValueError, match=r"unknown text config key\(s\) \['depth'\]"):
        CLIPConfig.from_dict({"text": {"depth": 3}})
    with pytest.raises(ValueError, match="not a multiple of vision.patch_size"):
        CLIPConfig.from_dict({"vision": {"image_size": 30, "patch_size": 8}})
    openclip = get_preset("tiny").to_openclip()
    openclip["vision_cfg"]["attentional_pool"] = True
    with pytest.raises(ValueError, match="vision_cfg.attentional_pool=True is not supported"):
        CLIPConfig.from_openclip(openclip)
    openclip = get_preset("tiny").to_openclip()
    openclip["text_cfg"]["hf_model_name"] = "roberta-base"
    with pytest.raises(ValueError, match="text_cfg.hf_model_name"):
        CLIPConfig.from_openclip(openclip)
    openclip["vision_cfg"]["layers"] = [3, 4, 6, 3]
    with pytest.raises(ValueError, match="ResNet"):
        CLIPConfig.from_openclip(openclip)

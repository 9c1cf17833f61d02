"""clipms.model.convert: open_clip golden vectors reproduced, exact round trips, errors naming
tensors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import clipms  # noqa: F401  (sets MindSpore's environment before mindspore is imported)

# isort: split
import mindspore as ms

from clipms.model.architecture import CLIPConfig
from clipms.model.convert import (
    ConversionError,
    clip_params,
    load_clipms,
    load_openclip,
    openclip_shapes,
    openclip_to_clipms,
    save_clipms,
    save_openclip,
)

GOLDEN = Path(__file__).parents[2] / "data" / "openclip"
VARIANTS = ["micro_gelu", "micro_quickgelu"]
REPO = Path(__file__).resolve().parents[3]



def _paths(variant: str) -> tuple[Path, Path]:
    return GOLDEN / f"{variant}.json", GOLDEN / f"{variant}.safetensors"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("mode", [pytest.param("graph", marks=pytest.mark.slow), "pynative"],
                         indirect=True)  # graph mode compiles each model: slow
def test_converted_model_reproduces_openclip_features(variant, mode):
    net = load_openclip(*_paths(variant))
    golden = np.load(GOLDEN / f"{variant}.npz")
    image_features = net.encode_image(ms.Tensor(golden["images"])).asnumpy()
    text_features = net.encode_text(ms.Tensor(golden["tokens"].astype(np.int32))).asnumpy()
    assert np.abs(image_features - golden["image_features"]).max() <= 1e-5
    assert np.abs(text_features - golden["text_features"]).max() <= 1e-5
    assert float(net.logit_scale.asnumpy()) == float(golden["logit_scale"])
    # construct: normalised features and the exp'd scale, as open_clip's forward
    image_n, text_n, scale = net(ms.Tensor(golden["images"]),
                                 ms.Tensor(golden["tokens"][:3].astype(np.int32)))
    expected = golden["image_features"] / np.linalg.norm(golden["image_features"], axis=1,
                                                         keepdims=True)
    assert np.abs(image_n.asnumpy() - expected).max() <= 1e-5
    assert text_n.shape == (3, golden["text_features"].shape[1])
    np.testing.assert_allclose(scale.asnumpy(), np.exp(golden["logit_scale"]), rtol=1e-6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_round_trip_is_exact(variant, tmp_path):
    """open_clip -> MindSpore ckpt -> open_clip safetensors -> MindSpore: bit-identical."""
    config, weights = _paths(variant)
    original = load_file(str(weights))
    net = load_openclip(config, weights)
    save_clipms(net, tmp_path / "m.ckpt")
    reloaded = load_clipms(tmp_path / "m.ckpt")
    assert reloaded.config == CLIPConfig.from_openclip(config)
    save_openclip(reloaded, tmp_path / "w.safetensors")
    exported = load_file(str(tmp_path / "w.safetensors"))
    assert sorted(exported) == sorted(original)
    for name, value in original.items():
        assert exported[name].shape == value.shape, name
        np.testing.assert_array_equal(exported[name], value, err_msg=name)
    assert json.loads((tmp_path / "w.json").read_text()) == json.loads(config.read_text())
    again = load_openclip(tmp_path / "w.json", tmp_path / "w.safetensors")
    first, second = clip_params(net), clip_params(again)
    assert sorted(first) == sorted(second)
    for name, value in first.items():
        np.testing.assert_array_equal(second[name], value, err_msg=name)


def test_training_checkpoint_with_optimizer_state_converts(tmp_path):
    """A trainer's checkpoint also holds optimizer moments and counters: to-openclip skips them."""
    config, weights = _paths("micro_gelu")
    net = load_openclip(config, weights)
    save_clipms(net, tmp_path / "m.ckpt")
    extras = [{"name": "adam_m.logit_scale", "data": ms.Tensor(np.zeros((), np.float32))},
              {"name": "global_step", "data": ms.Tensor(np.array([7], np.int32))}]
    params = [{"name": p.name, "data": p} for p in net.get_parameters()]
    ms.save_checkpoint(params + extras, str(tmp_path / "m.ckpt"))
    save_openclip(load_clipms(tmp_path / "m.ckpt"), tmp_path / "w.safetensors")
    exported = load_file(str(tmp_path / "w.safetensors"))
    assert sorted(exported) == sorted(load_file(str(weights)))


def test_missing_checkpoint_or_sidecar_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="m.ckpt: checkpoint not found"):
        load_clipms(tmp_path / "m.ckpt")
    net = load_openclip(*_paths("micro_gelu"))
    save_clipms(net, tmp_path / "m.ckpt")
    (tmp_path / "m.json").unlink()
    with pytest.raises(FileNotFoundError, match="m.json not found"):
        load_clipms(tmp_path / "m.ckpt")


def _broken_state(kind: str) -> dict[str, np.ndarray]:
    state = load_file(str(_paths("micro_gelu")[1]))
    if kind == "missing":
        del state["transformer.resblocks.1.attn.in_proj_weight"]
    elif kind == "unexpected":
        state["visual.transformer.resblocks.2.ln_1.weight"] = np.ones(64, np.float32)
    else:
        state["visual.proj"] = np.zeros((64, 31), np.float32)
    return state


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("missing", r"missing tensor transformer\.resblocks\.1\.attn\.in_proj_weight "
                    r"\(expected shape \(192, 64\)\)"),
        ("unexpected", r"unexpected tensor visual\.transformer\.resblocks\.2\.ln_1\.weight"),
        ("misshaped", r"tensor visual\.proj has shape \(64, 31\), expected \(64, 32\)"),
    ],
)
def test_mismatched_state_dict_names_the_tensor(kind, message):
    cfg = CLIPConfig.from_openclip(_paths("micro_gelu")[0])
    with pytest.raises(ConversionError, match=message):
        openclip_to_clipms(_broken_state(kind), cfg)


def test_every_problem_is_listed_at_once():
    cfg = CLIPConfig.from_openclip(_paths("micro_gelu")[0])
    state = _broken_state("missing")
    state["logit_bias"] = np.zeros((), np.float32)
    with pytest.raises(ConversionError) as err:
        openclip_to_clipms(state, cfg)
    assert "missing tensor transformer.resblocks.1.attn.in_proj_weight" in str(err.value)
    assert "unexpected tensor logit_bias" in str(err.value)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clipms.model.convert", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # runs the console script twice
def test_cli_converts_both_ways_and_reports_bad_weights(tmp_path):
    config, weights = _paths("micro_quickgelu")
    done = _cli("from-openclip", "--config", str(config), "--weights", str(weights),
                "--out", str(tmp_path / "m.ckpt"))
    assert done.returncode == 0, done.stderr
    sidecar = json.loads((tmp_path / "m.json").read_text())
    assert sidecar["model"]["quick_gelu"] is True
    assert sidecar["preprocess"]["image_size"] == 32
    done = _cli("to-openclip", "--checkpoint", str(tmp_path / "m.ckpt"),
                "--out", str(tmp_path / "w.safetensors"))
    assert done.returncode == 0, done.stderr
    original, exported = load_file(str(weights)), load_file(str(tmp_path / "w.safetensors"))
    for name, value in original.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)

    broken = tmp_path / "broken.safetensors"
    save_file(_broken_state("misshaped"), str(broken))
    done = _cli("from-openclip", "--config", str(_paths("micro_gelu")[0]), "--weights",
                str(broken), "--out", str(tmp_path / "x.ckpt"))
    assert done.returncode == 2
    assert "tensor visual.proj has shape (64, 31), expected (64, 32)" in done.stderr
    assert not (tmp_path / "x.ckpt").exists()


def _siglip_openclip(tmp_path: Path) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """micro_gelu as a SigLIP model: its config with open_clip's --siglip initialisation, its
    weights with a learned-looking logit_bias (not the init, so a dropped bias shows)."""
    config = json.loads(_paths("micro_gelu")[0].read_text())
    config.update(init_logit_scale=float(np.log(10)), init_logit_bias=-10.0)
    state = load_file(str(_paths("micro_gelu")[1]))
    state["logit_bias"] = np.asarray(-7.25, np.float32)
    (tmp_path / "siglip.json").write_text(json.dumps(config))
    save_file(state, str(tmp_path / "siglip.safetensors"))
    return tmp_path / "siglip.json", tmp_path / "siglip.safetensors", state


def test_a_siglip_models_logit_bias_converts_both_ways_exactly(tmp_path):
    """open_clip's SigLIP CLIP holds `logit_bias` beside `logit_scale` (the names of
    tests/data/openclip/siglip.npz's state_keys); from and to open_clip, bit-exact."""
    golden = np.load(GOLDEN / "siglip.npz")
    config, weights, state = _siglip_openclip(tmp_path)
    cfg = CLIPConfig.from_openclip(config)
    assert (cfg.init_logit_bias, cfg.init_logit_scale) == (-10.0, float(np.log(10)))
    assert sorted(openclip_shapes(cfg)) == sorted(golden["state_keys"].tolist())
    net = load_openclip(config, weights)
    assert float(net.logit_bias.asnumpy()) == -7.25
    save_clipms(net, tmp_path / "m.ckpt")
    save_openclip(load_clipms(tmp_path / "m.ckpt"), tmp_path / "w.safetensors")
    exported = load_file(str(tmp_path / "w.safetensors"))
    assert sorted(exported) == sorted(state)
    for name, value in state.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)
    assert json.loads((tmp_path / "w.json").read_text()) == json.loads(config.read_text())
    del state["logit_bias"]  # a SigLIP config without its bias tensor is named, not guessed
    with pytest.raises(ConversionError, match="missing tensor logit_bias"):
        openclip_to_clipms(state, cfg)


def test_a_model_trained_with_patch_dropout_converts_without_its_draw_counter(tmp_path):
    """The draw counter is training state: to-openclip leaves it out; the config keeps the
    patch_dropout share (open_clip's vision_cfg.patch_dropout)."""
    import dataclasses

    from clipms.model.convert import build_clip
    from clipms.model.patch_dropout import start_patch_dropout

    config, weights = _paths("micro_gelu")
    plain = load_openclip(config, weights)
    cfg = dataclasses.replace(plain.config, vision=dataclasses.replace(plain.config.vision,
                                                                       patch_dropout=0.5))
    net = build_clip(cfg, clip_params(plain))
    start_patch_dropout(net, seed=0)
    assert "visual.patch_dropout.draws" in dict(net.parameters_and_names())
    save_openclip(net, tmp_path / "w.safetensors")
    assert sorted(load_file(str(tmp_path / "w.safetensors"))) == sorted(load_file(str(weights)))
    written = json.loads((tmp_path / "w.json").read_text())
    assert written["vision_cfg"]["patch_dropout"] == 0.5
    assert CLIPConfig.from_openclip(written) == cfg

"""Mixed precision end to end: `precision: amp` with every other default (CPU kernel fusion on)
trains in a process of its own (MindSpore reads the fusion flags process-wide, and the pytest
process runs unfused), runs its training step unfused on purpose (clipms.runtime.for_precision
says why), saves the model under CLIP's own parameter names, and that checkpoint loads with
`load_clip` and converts to open_clip. Under amp the towers compute in fp16 but the L2
normalisation and exp(logit_scale) stay fp32, as under open_clip's autocast: amp and fp32
embeddings agree to `AMP_EMBEDDING_BAR`, and features of norm 0 or past 256 (NaN and overflow in
fp16) normalise as in fp32. In GRAPH_MODE MindSpore already computed these two in fp32 before (a
LayerNorm Cell flagged fp32 returns fp32, so ln_post and the projections came out fp32, and graph
mode does not cast parameters), in PYNATIVE_MODE they were fp16 (NaN for a zero feature): the
explicit fp32 island makes both modes agree, and the pynative cases are the ones that failed
before. The whole pipeline with amp (train -> evaluate -> export -> register,
fusion on as users run it) is the slow test at the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from clipms.model.architecture import CLIPConfig, TextConfig, VisionConfig
from clipms.model.convert import openclip_shapes
from clipms.runtime import SWITCH
from harness.dvc_workspace import PROJECT_ROOT, checkpoint_arrays, run

# Trains a micro CLIP for 3 amp steps on random batches; writes the model as the train stage does
# (clip.ckpt + the clip.json sidecar) and the losses.
TRAIN = """
import json, logging, sys
from pathlib import Path
import clipms
logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True)
from clipms.model.architecture import CLIPConfig, TextConfig, VisionConfig
from clipms.runtime import RuntimeConfig
from clipms.train.loop import RandomBatches, TrainConfig, save_model, train
out = Path(sys.argv[1])
micro = CLIPConfig(
    embed_dim=16,
    vision=VisionConfig(image_size=16, patch_size=8, width=32, layers=1, head_width=16),
    text=TextConfig(context_length=8, vocab_size=40, width=32, heads=2, layers=1))
cfg = TrainConfig(model=micro, batch_size=4, epochs=1, lr=1e-3, warmup_steps=1, precision="amp",
                  runtime=RuntimeConfig(kernel_fusion=sys.argv[2] == "on"))
result = train(cfg, RandomBatches(micro, 4, 3, seed=1), None)
save_model(result.model, out / "clip.ckpt")
(out / "clip.json").write_text(json.dumps({"model": micro.to_dict()}))
(out / "losses.json").write_text(json.dumps([row["loss"] for row in result.history]))
"""


MICRO = CLIPConfig(
    embed_dim=16,
    vision=VisionConfig(image_size=16, patch_size=8, width=32, layers=1, head_width=16),
    text=TextConfig(context_length=8, vocab_size=40, width=32, heads=2, layers=1))
# Max abs difference of the L2-normalised amp and fp32 embeddings of the same weights: fp16 keeps
# 11 significant bits (unit roundoff 4.9e-4) and every layer rounds again; the export's fp16 bar
# (clipms.deploy.mindir.PARITY) for the same reason. Measured here: see the test's assertion
# message (pytest -s prints it).
AMP_EMBEDDING_BAR = 2e-3


def fp32_and_amp_twins(seed: int = 0):
    """Two CLIPs with the same weights, the second under amp (to_mixed_precision)."""
    import mindspore as ms

    from clipms.model.clip import CLIP, to_mixed_precision

    ms.set_seed(seed)
    fp32 = CLIP(MICRO)
    amp = CLIP(MICRO)
    for (_, theirs), (_, ours) in zip(fp32.parameters_and_names(), amp.parameters_and_names(),
                                      strict=True):
        ours.set_data(theirs.data.copy())
    return fp32, to_mixed_precision(amp)


def micro_inputs(n: int = 6):
    import mindspore as ms

    from clipms.train.feed import RandomBatches

    images, tokens = RandomBatches(MICRO, n, 1, seed=2).global_batch(0, 0)
    pixels = (images.astype(np.float32) / 255.0 - 0.45) / 0.27
    return ms.Tensor(pixels), ms.Tensor(tokens)


# Compiling the amp graph takes several CPU-seconds; PyNative checks the same arithmetic fast.
MODES = [pytest.param("graph", marks=pytest.mark.slow), "pynative"]


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_amp_normalises_and_scales_in_fp32_and_its_embeddings_agree_with_fp32(mode):
    fp32, amp = fp32_and_amp_twins()
    images, tokens = micro_inputs()
    want = [out.asnumpy() for out in fp32(images, tokens)]
    got = [out.asnumpy() for out in amp(images, tokens)]
    assert [g.dtype for g in got] == [np.float32] * 3  # fp32 features and scale out of CLIP
    assert got[2] == want[2]  # exp() of the fp32 parameter itself, not of an fp16 copy
    errors = [float(np.abs(g - w).max()) for g, w in zip(got[:2], want[:2], strict=True)]
    print(f"amp vs fp32, normalised embeddings ({mode}): image {errors[0]:.2e}, "
          f"text {errors[1]:.2e}")
    assert max(errors) <= AMP_EMBEDDING_BAR, errors
    assert max(errors) > 0  # the towers did compute in fp16
    np.testing.assert_allclose(np.linalg.norm(got[0], axis=1), 1.0, atol=1e-6)


@pytest.mark.parametrize("mode", MODES, indirect=True)
@pytest.mark.parametrize("scale", [0.0, 1e3])
def test_amp_normalises_a_zero_or_huge_feature_as_fp32_does(mode, scale):
    # 0: fp16's epsilon 1e-12 underflows to 0, so 0 / 0 = NaN; 1e3: the features' norm passes 256,
    # its square passes fp16's largest value (65504) and the feature normalised to 0 or NaN.
    import mindspore as ms

    fp32, amp = fp32_and_amp_twins(seed=1)
    for net in (fp32, amp):
        net.visual.proj.set_data(net.visual.proj.data * ms.Tensor(np.float32(scale)))
    images, tokens = micro_inputs()
    want = fp32(images, tokens)[0].asnumpy()
    got = amp(images, tokens)[0].asnumpy()
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=AMP_EMBEDDING_BAR)


def train_amp(folder, fusion: str) -> tuple[list[float], str]:
    """(losses, the process's output) of the amp training script."""
    cache = folder / "kernels"
    cache.mkdir(parents=True)
    env = {**os.environ, "CLIPMS_KERNEL_CACHE": str(cache), SWITCH: "1",
           "PYTHONPATH": str(PROJECT_ROOT)}
    env.pop("MS_DEV_GRAPH_KERNEL_FLAGS", None)
    out = subprocess.run([sys.executable, "-c", TRAIN, str(folder), fusion], cwd=folder, env=env,
                         check=True, timeout=900, capture_output=True, text=True).stdout
    return json.loads((folder / "losses.json").read_text()), out


@pytest.mark.slow  # trains in processes of its own, fused
def test_amp_with_fusion_on_trains_unfused_and_saves_a_loadable_convertible_checkpoint(tmp_path):
    from clipms.train.trained import load_clip

    folder = tmp_path / "on"
    losses, out = train_amp(folder, "on")  # kernel_fusion: true, the default
    assert "kernel fusion off for its graphs" in out
    assert not (folder / "kernels" / "akg_kernel_meta").exists()  # no AKG build to time out
    assert len(losses) == 3 and all(np.isfinite(losses))

    config = CLIPConfig.from_dict(json.loads((folder / "clip.json").read_text())["model"])
    saved = checkpoint_arrays(folder / "clip.ckpt")
    assert not [name for name in saved if "_backbone" in name]
    net = load_clip(folder / "clip.ckpt", config)  # every CLIP parameter, by name
    assert {p.name for p in net.get_parameters()} == set(saved)
    assert all(value.dtype == np.float32 for value in saved.values())  # fp32 master weights
    converted = folder / "open_clip.safetensors"
    run([sys.executable, "-m", "clipms.model.convert", "to-openclip", "--checkpoint",
         str(folder / "clip.ckpt"), "--out", str(converted)], cwd=PROJECT_ROOT)
    state = load_file(str(converted))
    assert {k: tuple(v.shape) for k, v in state.items()} == openclip_shapes(config)
    np.testing.assert_array_equal(state["logit_scale"], saved["logit_scale"])


# `dvc repro` of every stage with amp and kernel fusion on is
# tests/integration/test_registry_server.py::test_dvc_repro_logs_one_run_through_all_stages.

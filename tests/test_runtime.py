"""clipms.runtime: CPU graph-kernel fusion is really applied (AKG compiles fused kernels into the
cache), changes no result beyond fp32 rounding, and its switches do what they say. The fused and
unfused runs are separate processes: MindSpore reads the fusion flags process-wide."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from clipms.runtime import FUSION_FLAGS, SWITCH, enable_kernel_fusion, kernel_cache_dir
from tests.workspace import PROJECT_ROOT

FUSION_ENV = ("MS_DEV_GRAPH_KERNEL_FLAGS", "MS_COMPILER_CACHE_PATH", "CLIPMS_KERNEL_CACHE", SWITCH)

ENCODE = """
import sys
import numpy as np
from clipms.infer import Encoder
from tests.tiny_model import CAPTIONS, random_images
encoder = Encoder(sys.argv[1], batch_size=4)  # 6 inputs: batches of 4 and 2
np.savez(sys.argv[2], images=encoder.encode_images(random_images(6, seed=5)),
         texts=encoder.encode_texts(CAPTIONS[:6]))
"""

TRAIN = """
import sys
import numpy as np
import mindspore as ms
from clipms.bench import random_images, random_tokens
from clipms.optim import folded_hyper
from clipms.trainer import TrainConfig, build_training, setup_runtime
from tests.tiny_model import tiny_config
cfg = TrainConfig(model=tiny_config(vocab_size=100), batch_size=8, lr=1e-3,
                  kernel_fusion=sys.argv[2] == "on")
setup_runtime(cfg, distributed=False)  # mode, device, fusion (if cfg asks), seed
_, step, _ = build_training(cfg)
images = ms.Tensor(random_images(8, 32))
tokens = ms.Tensor(random_tokens(8, 16, 100))
losses = [float(step(images, tokens, *[ms.Tensor(x) for x in folded_hyper(1e-3, t).tensors()],
                     True)[0].asnumpy()) for t in (1, 2, 3)]
np.save(sys.argv[1], np.array(losses))
"""


def fused_kernels(cache) -> list[str]:
    meta = cache / "akg_kernel_meta"
    return sorted(p.name for p in meta.glob("*.so")) if meta.is_dir() else []


def run_python(code: str, args: list[str], cache, fusion: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k not in FUSION_ENV}
    env.update({"CLIPMS_KERNEL_CACHE": str(cache), SWITCH: "1" if fusion else "0",
                "PYTHONPATH": str(PROJECT_ROOT)})
    subprocess.run([sys.executable, "-c", code, *args], cwd=cache.parent, env=env, check=True,
                   timeout=600)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from tests.tiny_model import export_tiny_bundle

    return export_tiny_bundle(tmp_path_factory.mktemp("export"), seed=2)


def test_fused_encoder_compiles_fused_kernels_and_matches_the_unfused_one(bundle, tmp_path):
    results = {}
    for fusion in (True, False):
        cache = tmp_path / f"fusion-{fusion}" / "cache"
        cache.mkdir(parents=True)
        run_python(ENCODE, [str(bundle), str(cache.parent / "out.npz")], cache, fusion)
        results[fusion] = (np.load(cache.parent / "out.npz"), fused_kernels(cache))
    (fused, kernels), (plain, none) = results[True], results[False]
    # The Erf of the exact GELU and the LayerNorms were expanded and fused; nothing when off.
    assert any("Erf" in name for name in kernels), kernels
    assert none == []
    for key in ("images", "texts"):
        np.testing.assert_allclose(fused[key], plain[key], atol=1e-5)


def test_fused_training_steps_follow_the_unfused_losses(tmp_path):
    losses = {}
    for fusion in ("on", "off"):
        cache = tmp_path / f"fusion-{fusion}" / "cache"
        cache.mkdir(parents=True)
        out = cache.parent / "losses.npy"
        run_python(TRAIN, [str(out), fusion], cache, fusion=True)  # TrainConfig decides
        losses[fusion] = (np.load(out), fused_kernels(cache))
    assert any("LayerNorm" in name or "Erf" in name for name in losses["on"][1])
    assert losses["off"][1] == []
    assert losses["on"][0][2] < losses["on"][0][0]  # it trains
    np.testing.assert_allclose(losses["on"][0], losses["off"][0], rtol=1e-4)


def test_the_switch_and_a_users_own_flags_win(monkeypatch, tmp_path):
    monkeypatch.setenv("CLIPMS_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("MS_COMPILER_CACHE_PATH", raising=False)  # restored after the test
    monkeypatch.delenv("MS_DEV_GRAPH_KERNEL_FLAGS", raising=False)
    monkeypatch.setenv(SWITCH, "0")
    assert enable_kernel_fusion() is False
    assert "MS_DEV_GRAPH_KERNEL_FLAGS" not in os.environ

    monkeypatch.setenv(SWITCH, "1")
    monkeypatch.setenv("MS_DEV_GRAPH_KERNEL_FLAGS", "--opt_level=1")
    assert enable_kernel_fusion() is True
    assert os.environ["MS_DEV_GRAPH_KERNEL_FLAGS"] == "--opt_level=1"

    monkeypatch.delenv("MS_DEV_GRAPH_KERNEL_FLAGS")
    assert enable_kernel_fusion() is True
    assert os.environ["MS_DEV_GRAPH_KERNEL_FLAGS"] == FUSION_FLAGS


def test_the_kernel_cache_is_never_the_working_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("CLIPMS_KERNEL_CACHE", str(tmp_path / "explicit"))
    assert kernel_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("CLIPMS_KERNEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernel_cache_dir() == tmp_path / "xdg" / "clipms" / "mindspore-kernels"

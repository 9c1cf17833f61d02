"""The host parity child (`python -m clipms.deploy.hostparity`) on this CPU: it runs unfused, so
nothing is handed to AKG's CPU code generator on the host, which may be aarch64 on an Atlas
server (it has only run on x86 here)."""

from __future__ import annotations

import numpy as np
import pytest

from harness.tiny_model import write_trained


@pytest.mark.slow  # exports MindIR, loads it in a second process
def test_the_host_parity_child_compiles_no_fused_kernel_even_where_fusion_is_on(
        tmp_path, monkeypatch):
    from clipms.data.preprocess import PreprocessConfig
    from clipms.deploy.hostparity import host_parity
    from clipms.deploy.mindir import export_bundle
    from clipms.model.architecture import CLIPConfig
    from clipms.train.trained import load_clip
    from clipms.utils.jsonio import read_json

    paths = write_trained(tmp_path / "trained")
    model = CLIPConfig.from_dict(read_json(paths["config"])["model"])
    bundle = tmp_path / "bundle"
    export_bundle(load_clip(paths["checkpoint"], model),
                  PreprocessConfig(image_size=model.vision.image_size), paths["tokenizer"], bundle)
    rng = np.random.default_rng(0)
    images = rng.standard_normal((2, 3, 32, 32)).astype(np.float32)
    tokens = rng.integers(0, model.text.vocab_size, (2, model.text.context_length)).astype(np.int32)

    # The environment of a process that runs fused, as stages on CPU do (tests run unfused):
    # fusion switched on and its kernel cache in a folder of this test's.
    kernels = tmp_path / "kernels"
    monkeypatch.setenv("CLIPMS_KERNEL_FUSION", "1")
    monkeypatch.setenv("CLIPMS_KERNEL_CACHE", str(kernels))
    report = host_parity(bundle, paths["checkpoint"], model, images, tokens, (1, 2))
    assert report["passed"] and report["parity_device"] == "CPU (host)"
    # a fused child would have created the kernel cache and compiled AKG kernels into it
    assert not kernels.exists() or not any(kernels.rglob("*")), sorted(kernels.rglob("*"))

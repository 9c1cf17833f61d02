"""Mixed precision end to end: `precision: amp` with every other default (CPU kernel fusion on)
trains in a process of its own (MindSpore reads the fusion flags process-wide, and the pytest
process runs unfused), runs its training step unfused on purpose (clipms.runtime.for_precision
says why), saves the model under CLIP's own parameter names, and that checkpoint loads with
`load_clip` and converts to open_clip. The whole pipeline with amp (train -> evaluate -> export
-> register, fusion on as users run it) is the slow test at the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from clipms.model.config import CLIPConfig
from clipms.model.convert import openclip_shapes
from clipms.runtime import SWITCH
from tests.workspace import PROJECT_ROOT, checkpoint_arrays, make_workspace, run

# Trains a micro CLIP for 3 amp steps on random batches; writes the model as the train stage does
# (clip.ckpt + the clip.json sidecar) and the losses.
TRAIN = """
import json, logging, sys
from pathlib import Path
import clipms
logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True)
from clipms.model.config import CLIPConfig, TextConfig, VisionConfig
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


@pytest.mark.slow
def test_dvc_repro_with_amp_runs_train_evaluate_export_register_with_fusion_on(tmp_path):
    # kernel fusion on, as users run it (the tiny test pipelines default to off): the fp32 graphs
    # of evaluate and export compile fused kernels; amp's training step runs unfused on purpose
    ws = make_workspace(tmp_path, {"train.precision": "amp", "train.max_steps": 2,
                                   "train.checkpoint_every": 100, "runtime.kernel_fusion": True})
    out = run(["dvc", "repro", "register"], cwd=ws, timeout=1500).stdout
    assert "kernel fusion off for its graphs" in out
    train = json.loads((ws / "models/clip.json").read_text())["train"]
    assert train["precision"] == "amp" and train["runtime"]["kernel_fusion"] is True
    metrics = json.loads((ws / "metrics/train.json").read_text())
    assert metrics["steps"] == 2 and np.isfinite(metrics["final_loss"])
    assert "i2t_R@5" in json.loads((ws / "metrics/eval.json").read_text())
    export = json.loads((ws / "metrics/export.json").read_text())
    # amp keeps fp32 master weights and the checkpoint holds them, so the exported fp32
    # graphs meet the fp32 parity bar against it
    assert export["passed"] and export["tolerance"] <= 1e-5
    assert "version" in json.loads((ws / "metrics/register.json").read_text())

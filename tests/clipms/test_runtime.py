"""clipms.runtime: the settings computed for each device, as data (CPU tuning only on CPU; O0,
no sinking and MindSpore's compile cache off on every device unless asked; the user's own values
win, except an unkeyed compile cache); and real CPU runs: fusion is applied (AKG
compiles fused kernels into the cache), changes no result beyond fp32 rounding, and the import-time
settings are in place. Fused and unfused runs are separate processes: MindSpore reads the fusion
flags process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from clipms.runtime import (
    CACHE_SWITCH,
    FORCE_CACHE,
    FUSION_FLAGS,
    SWITCH,
    RuntimeConfig,
    configure,
    for_data_parallel,
    for_precision,
    kernel_cache_dir,
    settings_for,
)
from harness.dvc_workspace import PROJECT_ROOT
from pipeline.params import ParamsError, validate_section

MS_DIR = Path("/opt/ms")  # settings_for takes the installed package as an argument
HOME = {"HOME": "/home/u"}
CPU_TUNING = ("OMP_WAIT_POLICY", "MS_DEV_HOST_BLOCKING_RUN", "MS_DEV_GRAPH_KERNEL_FLAGS",
              "AKG_WHITE_LIST_PATH")
RUNTIME_ENV = (*CPU_TUNING, "MS_COMPILER_CACHE_PATH", "MS_COMPILER_CACHE_ENABLE",
               "CLIPMS_KERNEL_CACHE", SWITCH)


def test_cpu_settings_tune_the_host_and_fuse_kernels():
    s = settings_for(RuntimeConfig(), HOME, MS_DIR)
    assert (s.device_target, s.device_id, s.mode, s.jit_level, s.kernel_fusion) == (
        "CPU", None, "graph", "O0", True)
    assert s.import_env == {"OMP_WAIT_POLICY": "PASSIVE"}  # libgomp reads it when loaded
    assert s.env == {"MS_DEV_HOST_BLOCKING_RUN": "1", "MS_DEV_GRAPH_KERNEL_FLAGS": FUSION_FLAGS,
                     "AKG_WHITE_LIST_PATH": "/opt/ms/_akg", CACHE_SWITCH: "0",
                     "MS_COMPILER_CACHE_PATH": "/home/u/.cache/clipms/mindspore-kernels"}
    unfused = settings_for(RuntimeConfig(kernel_fusion=False), HOME, MS_DIR)
    assert not unfused.kernel_fusion
    assert unfused.env == {"MS_DEV_HOST_BLOCKING_RUN": "1", CACHE_SWITCH: "0"}


def test_every_device_defaults_to_o0_no_compile_cache_and_no_sinking():
    for device in ("CPU", "GPU", "Ascend"):
        s = settings_for(RuntimeConfig(device_target=device), HOME, MS_DIR)
        assert (s.jit_level, s.data_sink, s.compile_cache) == ("O0", False, False), device
        assert s.env[CACHE_SWITCH] == "0", device  # MindSpore's own cache: off, always
    ascend = settings_for(RuntimeConfig(device_target="Ascend", device_id=3), HOME, MS_DIR)
    assert (ascend.device_id, ascend.kernel_fusion, ascend.import_env) == (3, False, {})
    assert ascend.env == {CACHE_SWITCH: "0"}  # no CPU tuning, no cache folder
    assert settings_for(RuntimeConfig(device_target="Ascend", jit_level="O1"), HOME,
                        MS_DIR).jit_level == "O1"  # the documented option


def test_data_sinking_is_a_param_and_only_where_mindspore_sinks():
    for device in ("GPU", "Ascend"):
        config = RuntimeConfig(device_target=device, data_sink=True)
        assert settings_for(config, HOME, MS_DIR).data_sink
    with pytest.raises(ParamsError, match=r"runtime.data_sink = True: .*needs device_target "
                                          r"Ascend or GPU .*not CPU"):
        validate_section("runtime", RuntimeConfig, {"data_sink": True})


def test_the_compile_cache_is_never_left_on_unkeyed(monkeypatch, caplog):
    # A cache switched on in the environment is not the user's tuning to keep: unkeyed, it hands a
    # changed run an old graph (tests/clipms/train/test_graphcache.py shows it), so it is turned
    # off.
    environ = {**HOME, CACHE_SWITCH: "1", "MS_COMPILER_CACHE_PATH": "/shared"}
    config = RuntimeConfig(device_target="Ascend", compile_cache=True)
    s = settings_for(config, environ, MS_DIR)
    assert s.compile_cache and s.env[CACHE_SWITCH] == "0"  # on only in a keyed training folder
    monkeypatch.setenv(CACHE_SWITCH, "1")
    monkeypatch.setenv(FORCE_CACHE, "1")
    configure(RuntimeConfig(kernel_fusion=False))
    assert os.environ[CACHE_SWITCH] == "0" and FORCE_CACHE not in os.environ
    assert "an unkeyed compile cache" in caplog.text


def test_the_switch_the_cache_variable_and_the_users_own_values_win():
    environ = {**HOME, SWITCH: "0"}
    assert not settings_for(RuntimeConfig(), environ, MS_DIR).kernel_fusion
    environ = {"CLIPMS_KERNEL_CACHE": "/scratch/k", "MS_DEV_GRAPH_KERNEL_FLAGS": "--opt_level=1",
               "OMP_WAIT_POLICY": "ACTIVE"}
    s = settings_for(RuntimeConfig(), environ, MS_DIR)
    assert s.env["MS_DEV_GRAPH_KERNEL_FLAGS"] == "--opt_level=1"
    assert s.env["MS_COMPILER_CACHE_PATH"] == "/scratch/k"
    assert s.import_env["OMP_WAIT_POLICY"] == "ACTIVE"


def test_amp_training_on_cpu_runs_unfused_and_nothing_else_changes():
    cpu = RuntimeConfig()
    assert for_precision(cpu, "amp") == RuntimeConfig(kernel_fusion=False)
    assert for_precision(cpu, "fp32") is cpu
    assert for_precision(cpu, "fp16") == RuntimeConfig(kernel_fusion=False)  # an fp16 export
    ascend = RuntimeConfig(device_target="Ascend")
    assert for_precision(ascend, "amp") is ascend  # fusion there is jit_level's, untouched


def test_data_parallel_ranks_on_cpu_run_unfused_and_nothing_else_changes():
    assert for_data_parallel(RuntimeConfig()) == RuntimeConfig(kernel_fusion=False)
    unfused = RuntimeConfig(kernel_fusion=False)
    assert for_data_parallel(unfused) is unfused
    ascend = RuntimeConfig(device_target="Ascend")
    assert for_data_parallel(ascend) is ascend


def test_the_kernel_cache_is_never_the_working_directory():
    assert kernel_cache_dir({"CLIPMS_KERNEL_CACHE": "/k"}) == Path("/k")
    assert kernel_cache_dir({"XDG_CACHE_HOME": "/x", "HOME": "/h"}) == Path(
        "/x/clipms/mindspore-kernels")
    assert kernel_cache_dir({"HOME": "/h"}) == Path("/h/.cache/clipms/mindspore-kernels")


def test_the_runtime_section_rejects_unknown_devices_and_keys():
    with pytest.raises(ParamsError, match=r"runtime.device_target = 'TPU'"):
        validate_section("runtime", RuntimeConfig, {"device_target": "TPU"})
    with pytest.raises(ParamsError, match=r"runtime.jit_level = 'O2'"):
        validate_section("runtime", RuntimeConfig, {"jit_level": "O2"})
    with pytest.raises(ParamsError, match=r"runtime.fusion: unknown key"):
        validate_section("runtime", RuntimeConfig, {"fusion": True})


def test_the_command_line_prints_the_settings_of_a_device():
    out = subprocess.run([sys.executable, "-m", "clipms.runtime", "--device", "Ascend",
                          "--data-sink", "on"],
                         capture_output=True, text=True, check=True, cwd=PROJECT_ROOT).stdout
    printed = json.loads(out)
    assert printed["jit_level"] == "O0" and printed["env"]["MS_COMPILER_CACHE_ENABLE"] == "0"
    assert printed["data_sink"] is True and printed["compile_cache"] is False


def test_a_process_cannot_switch_devices():
    configure(RuntimeConfig(kernel_fusion=False))  # this process: CPU
    with pytest.raises(RuntimeError, match="needs a process of its own"):
        configure(RuntimeConfig(device_target="Ascend"))


# ---- real CPU runs, each in a process of its own -------------------------------------------

PROBE = """
import json, os, sys
from clipms.runtime import RuntimeConfig, configure
settings = configure(RuntimeConfig(kernel_fusion=sys.argv[1] == "on"))
import mindspore as ms
print(json.dumps({"env": {k: os.environ.get(k) for k in json.loads(sys.argv[2])},
                  "fusion": settings.kernel_fusion, "mode": ms.get_context("mode"),
                  "device": ms.get_context("device_target")}))
"""

ENCODE = """
import sys
import numpy as np
from clipms.deploy.infer import Encoder
from harness.tiny_model import CAPTIONS, random_images
encoder = Encoder(sys.argv[1], batch_size=4, kernel_fusion=sys.argv[3] == "on")
np.savez(sys.argv[2], images=encoder.encode_images(random_images(6, seed=5)),
         texts=encoder.encode_texts(CAPTIONS[:6]))
"""

TRAIN = """
import sys
import numpy as np
from clipms.train.feed import RandomBatches
from clipms.runtime import RuntimeConfig
from clipms.train.loop import TrainConfig, train
from harness.tiny_model import tiny_config
cfg = TrainConfig(model=tiny_config(vocab_size=100), batch_size=8, lr=1e-3, warmup_steps=1,
                  max_steps=3, runtime=RuntimeConfig(kernel_fusion=sys.argv[2] == "on"))
class OneBatch(RandomBatches):  # the same batch every step, so that the loss must fall
    def global_batch(self, epoch, index):
        return super().global_batch(0, 0)
result = train(cfg, OneBatch(cfg.model, 8, 3, seed=1))  # configures the runtime itself
np.save(sys.argv[1], np.array([row["loss"] for row in result.history]))
"""


def run_python(code: str, args: list[str], cache: Path) -> str:
    """Run `code` in a fresh interpreter with none of the runtime's variables inherited."""
    env = {k: v for k, v in os.environ.items() if k not in RUNTIME_ENV}
    env.update({"CLIPMS_KERNEL_CACHE": str(cache), "PYTHONPATH": str(PROJECT_ROOT)})
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cache.parent, env=env,
                          check=True, timeout=600, capture_output=True, text=True).stdout


def fused_kernels(cache: Path) -> list[str]:
    meta = cache / "akg_kernel_meta"
    return sorted(p.name for p in meta.glob("*.so")) if meta.is_dir() else []


@pytest.mark.slow  # compiles fused kernels, or starts Python processes that import MindSpore
def test_configure_sets_the_cpu_environment_before_mindspore_is_imported(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    out = run_python(PROBE, ["on", json.dumps(RUNTIME_ENV[:4])], cache)
    probe = json.loads(out.strip().splitlines()[-1])
    assert probe["fusion"] and probe["device"] == "CPU" and probe["mode"] == 0  # GRAPH_MODE
    assert probe["env"] == {"OMP_WAIT_POLICY": "PASSIVE", "MS_DEV_HOST_BLOCKING_RUN": "1",
                            "MS_DEV_GRAPH_KERNEL_FLAGS": FUSION_FLAGS,
                            "AKG_WHITE_LIST_PATH": probe["env"]["AKG_WHITE_LIST_PATH"]}
    assert Path(probe["env"]["AKG_WHITE_LIST_PATH"]).is_dir()


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from harness.tiny_model import export_tiny_bundle

    return export_tiny_bundle(tmp_path_factory.mktemp("export"), seed=2)


@pytest.mark.slow  # compiles fused kernels, or starts Python processes that import MindSpore
def test_fused_encoder_compiles_fused_kernels_and_matches_the_unfused_one(bundle, tmp_path):
    results = {}
    for fusion in ("on", "off"):
        cache = tmp_path / f"fusion-{fusion}" / "cache"
        cache.mkdir(parents=True)
        run_python(ENCODE, [str(bundle), str(cache.parent / "out.npz"), fusion], cache)
        results[fusion] = (np.load(cache.parent / "out.npz"), fused_kernels(cache))
    (fused, kernels), (plain, none) = results["on"], results["off"]
    # The Erf of the exact GELU and the LayerNorms were expanded and fused; nothing when off.
    assert any("Erf" in name for name in kernels), kernels
    assert none == []
    for key in ("images", "texts"):
        np.testing.assert_allclose(fused[key], plain[key], atol=1e-5)


@pytest.mark.slow  # compiles fused kernels, or starts Python processes that import MindSpore
def test_fused_training_steps_follow_the_unfused_losses(tmp_path):
    losses = {}
    for fusion in ("on", "off"):
        cache = tmp_path / f"fusion-{fusion}" / "cache"
        cache.mkdir(parents=True)
        out = cache.parent / "losses.npy"
        run_python(TRAIN, [str(out), fusion], cache)  # the TrainConfig's runtime decides
        losses[fusion] = (np.load(out), fused_kernels(cache))
    assert any("LayerNorm" in name or "Erf" in name for name in losses["on"][1])
    assert losses["off"][1] == []
    assert losses["on"][0][2] < losses["on"][0][0]  # it trains
    np.testing.assert_allclose(losses["on"][0], losses["off"][0], rtol=1e-4)

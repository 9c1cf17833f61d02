"""One owner of how a process runs MindSpore: device, mode, jit level, CPU kernel fusion.

`RuntimeConfig` is the `runtime` section of params.yaml (every stage that runs a model reads it);
`settings_for(config)` computes, as plain data, what that means on its device; `configure(config)`
applies it to this process. Both the data and the application are tested (tests/test_runtime.py).

When MindSpore reads each setting decides where it is applied:
- at `import mindspore`: `OMP_WAIT_POLICY` (libgomp, which MindSpore's libraries link, reads it when
  it is loaded). `configure` sets it when MindSpore is not imported yet, and otherwise warns that
  it came too late, naming the variable; a process that imports MindSpore first can call
  `configure` first, or export the variable itself.
- at the first launched task: `MS_DEV_HOST_BLOCKING_RUN` (MindSpore's AsyncRQueue reads it once, at
  its first push: mindspore/ccsrc/runtime/pipeline/async_rqueue.cc);
- when a graph compiles: the graph-kernel flags, the AKG paths and the compile cache;
- `mindspore.set_device` / `set_context` calls: the device (once per process), mode, jit level.

CPU (benchmarks/RESULTS.md, "Speed against open_clip on CPU"): MindSpore's stock CPU
kernels for Erf (exact GELU) and LayerNorm are slow; graph-kernel fusion (AKG) expands them and
fuses each element-wise chain into one vectorised kernel, MatMul stays MindSpore's own. Fused
kernels are compiled once per shape into `kernel_cache_dir()`. Idle OpenMP threads of the fused
kernels sleep (`OMP_WAIT_POLICY=PASSIVE`) instead of spinning and stealing the MatMul's cores, and
host runs block instead of spinning in the task queue (`MS_DEV_HOST_BLOCKING_RUN=1`). None of this
applies elsewhere. `CLIPMS_KERNEL_FUSION=0` turns fusion off for a process whatever the config
says, and variables already in the environment win over the computed ones.

Ascend (from MindSpore's documentation, not testable here): `jit_level` O1 by default, "commonly
used optimizations and automatic operator fusion" (the `mindspore.jit` docstring, MindSpore
2.10.0; O0, MindSpore's default, turns them off), and the graph compile cache,
`MS_COMPILER_CACHE_ENABLE=1` + `MS_COMPILER_CACHE_PATH` (the environment variables that the
`mindspore.set_context` docstring of 2.10.0 names in place of its deprecated `enable_compile_cache`
and `compile_cache_path`; https://www.mindspore.cn/docs/zh-CN/r2.10.0/api_python/env_var_list.html).
Host blocking stays at MindSpore's default (off: multi-threaded dispatch), as MindSpore's Ascend
performance checklist asks.

Data sinking (Ascend and GPU, from MindSpore's documentation, not testable here): training batches
reach the device through MindSpore's device-side data queue (`mindspore.data_sink`) instead of a
host-to-device copy when each step is launched. `mindspore.data_sink` lists Ascend and GPU as its
platforms and raises on any other device target (mindspore/train/data_sink.py of 2.10.0), and
`Model.train` falls back to non-sink on CPU, so CPU always feeds from the host.
`CLIPMS_DATA_SINK=0` turns sinking off for a process.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict

from clipms.schema import Section, cadence

log = logging.getLogger(__name__)

# Expand the slow kernels (LayerNormGrad: training), fuse at level 2, keep (Batch)MatMul out of the
# fused clusters. Softmax/SoftmaxGrad expansion was measured too and gained nothing.
# Cast stays out of the clusters too: under mixed precision the graph holds Casts whose target type
# reaches AKG as an integer type id, and AKG's CPU code generator accepts only a type name
# ("composite_topi.cc: Check failed: attr->IsInstance<StringImm>()"); the failed build then left
# MindSpore's kernel-build client waiting until its timeout ("Response is empty"). An fp32 graph
# holds only a few tiny Casts (of token ids), so this costs fp32 nothing.
FUSION_FLAGS = ("--opt_level=2 --enable_expand_ops=Erf,LayerNorm,LayerNormGrad "
                "--disable_cluster_ops=MatMul,BatchMatMul,Cast")
SWITCH = "CLIPMS_KERNEL_FUSION"
SINK_SWITCH = "CLIPMS_DATA_SINK"
DATA_SINK_DEVICES = ("Ascend", "GPU")  # mindspore.data_sink's "Supported Platforms"
DEFAULT_JIT_LEVEL = {"Ascend": "O1"}  # elsewhere MindSpore's own default (O0)


class RuntimeConfig(Section):
    """The `runtime` params section (params.yaml documents each key)."""

    model_config = ConfigDict(frozen=True)

    device_target: Literal["CPU", "GPU", "Ascend"] = "CPU"
    device_id: int | None = cadence(None, ge=0)  # None: MindSpore's choice (msrun: per rank)
    mode: Literal["graph", "pynative"] = "graph"
    jit_level: Literal["O0", "O1"] | None = None  # None: DEFAULT_JIT_LEVEL of the device
    kernel_fusion: bool = True  # CPU only: graph-kernel fusion (FUSION_FLAGS)


@dataclass(frozen=True)
class RuntimeSettings:
    """What a RuntimeConfig means on its device, as data (see the module docstring for when
    MindSpore reads each part)."""

    device_target: str
    device_id: int | None
    mode: str
    jit_level: str | None  # None: leave MindSpore's default
    kernel_fusion: bool  # CPU graph-kernel fusion is on
    data_sink: bool  # training batches go through MindSpore's device queue (mindspore.data_sink)
    import_env: dict[str, str] = field(default_factory=dict)  # needed before `import mindspore`
    env: dict[str, str] = field(default_factory=dict)  # needed before the first graph/launch

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def for_precision(config: RuntimeConfig, precision: str) -> RuntimeConfig:
    """`config` as a training run (`amp`) or an export (`fp16`) of `precision` applies it: CPU
    kernel fusion stays off for half-precision graphs. AKG builds fp16 kernels far more slowly than
    fp32 ones, a fused amp step holds many of them (142 for the micro test model), and MindSpore
    gives a graph's whole kernel build a fixed 300 s (`TIME_OUT` of its akg_kernel_build.cc, not
    configurable): on a busy machine the first fused amp compile missed it and training failed
    ("Response is empty"). amp is for Ascend/GPU (on CPU it is slower than fp32 either way), so this
    is deliberate (docs/training.md, "Mixed precision"); fp32 runs and the fp32 graphs of
    evaluate/export keep fusion."""
    if precision in ("amp", "fp16") and config.device_target == "CPU" and config.kernel_fusion:
        log.info("precision %s on CPU: kernel fusion off for its graphs (AKG's fp16 kernel "
                 "build is too slow for MindSpore's fixed 300 s deadline; docs/training.md)",
                 precision)
        return config.model_copy(update={"kernel_fusion": False})
    return config


def prepare_import(config: RuntimeConfig) -> None:
    """Export what MindSpore reads at import (`import_env`: OMP_WAIT_POLICY on CPU) for a process
    that imports MindSpore-backed modules before it can call configure(): the train stage builds
    and checks its job first. Its msrun workers inherit the environment."""
    if "mindspore" not in sys.modules:
        os.environ.update(settings_for(config).import_env)


def kernel_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where compiled kernels (and, on Ascend, compiled graphs) live: $CLIPMS_KERNEL_CACHE, else the
    user's cache folder (not the working directory, which is often a git or DVC checkout)."""
    environ = os.environ if environ is None else environ
    explicit = environ.get("CLIPMS_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    base = environ.get("XDG_CACHE_HOME") or Path(environ.get("HOME", "~")).expanduser() / ".cache"
    return Path(base) / "clipms" / "mindspore-kernels"


def settings_for(config: RuntimeConfig, environ: Mapping[str, str] | None = None,
                 mindspore_dir: Path | None = None) -> RuntimeSettings:
    """The settings `config` asks for on its device; a pure function of its arguments.

    `environ` (default: this process's) supplies the fusion and data-sink switches, the cache
    location and the user's own values, which win over computed ones; `mindspore_dir` is the
    installed package (AKG's tiling repository lives in it)."""
    environ = os.environ if environ is None else environ
    device = config.device_target
    fusion = device == "CPU" and config.kernel_fusion and environ.get(SWITCH, "1") != "0"
    import_env: dict[str, str] = {}
    env: dict[str, str] = {}
    cache = str(kernel_cache_dir(environ))
    if device == "CPU":
        import_env["OMP_WAIT_POLICY"] = "PASSIVE"
        env["MS_DEV_HOST_BLOCKING_RUN"] = "1"
        if fusion:
            env["MS_DEV_GRAPH_KERNEL_FLAGS"] = FUSION_FLAGS
            # AKG reads its tiling repository from its own package and, unless that folder is
            # "white listed", skips it and prints a warning to stdout (corrupting command output).
            env["AKG_WHITE_LIST_PATH"] = str((mindspore_dir or _mindspore_dir()) / "_akg")
            env["MS_COMPILER_CACHE_PATH"] = cache
    else:
        env["MS_COMPILER_CACHE_ENABLE"] = "1"
        env["MS_COMPILER_CACHE_PATH"] = cache
    keep = {key: environ[key] for key in (*import_env, *env) if key in environ}
    return RuntimeSettings(
        device_target=device, device_id=config.device_id, mode=config.mode,
        jit_level=config.jit_level or DEFAULT_JIT_LEVEL.get(device), kernel_fusion=fusion,
        data_sink=device in DATA_SINK_DEVICES and environ.get(SINK_SWITCH, "1") != "0",
        import_env={**import_env, **{k: v for k, v in keep.items() if k in import_env}},
        env={**env, **{k: v for k, v in keep.items() if k in env}})


def _mindspore_dir() -> Path:
    """The installed mindspore package, found without importing it (importing it would read
    the import-time settings before they are set)."""
    import importlib.util

    spec = importlib.util.find_spec("mindspore")
    if spec is None or spec.origin is None:
        raise RuntimeError("mindspore is not installed")
    return Path(spec.origin).parent


_APPLIED: RuntimeSettings | None = None


def configure(config: RuntimeConfig) -> RuntimeSettings:
    """Configure MindSpore for this process as `config` says; returns the applied settings.

    Call it at the start of a process, before any graph compiles (ideally before MindSpore is
    imported). The device can be chosen once per process: calling again with another device
    raises; mode, jit level and fusion follow the latest call.
    """
    global _APPLIED
    settings = settings_for(config)
    if _APPLIED is not None and (_APPLIED.device_target, _APPLIED.device_id) != (
            settings.device_target, settings.device_id):
        raise RuntimeError(f"this process already runs on {_APPLIED.device_target} "
                           f"(device {_APPLIED.device_id}); MindSpore chooses the device once per "
                           f"process, so {settings.device_target} needs a process of its own")
    if "mindspore" in sys.modules:
        late = {k: v for k, v in settings.import_env.items() if os.environ.get(k) != v}
        if late:
            log.warning("mindspore was imported before clipms.runtime.configure(), so %s cannot "
                        "take effect in this process; export it or call configure() first",
                        ", ".join(f"{k}={v}" for k, v in late.items()))
    else:
        os.environ.update(settings.import_env)
    os.environ.update(settings.env)
    if settings.device_target == "CPU" and not settings.kernel_fusion:
        os.environ.pop("MS_DEV_GRAPH_KERNEL_FLAGS", None)  # a previous call's fusion flags
    if settings.kernel_fusion:
        Path(settings.env["MS_COMPILER_CACHE_PATH"]).mkdir(parents=True, exist_ok=True)
    import mindspore as ms

    # The default device (CPU) needs no call, and a call after the first kernel ran would raise.
    if _APPLIED is None and (settings.device_id is not None
                             or ms.get_context("device_target") != settings.device_target):
        ms.set_device(settings.device_target, settings.device_id)
    context: dict[str, object] = {
        "mode": ms.GRAPH_MODE if settings.mode == "graph" else ms.PYNATIVE_MODE}
    if settings.jit_level is not None:
        context["jit_config"] = {"jit_level": settings.jit_level}
    ms.set_context(**context)
    _APPLIED = settings
    return settings


def main(argv: list[str] | None = None) -> int:
    """`python -m clipms.runtime --device Ascend`: print the settings a config means, as JSON."""
    parser = argparse.ArgumentParser(prog="python -m clipms.runtime", description=main.__doc__)
    parser.add_argument("--device", default="CPU", choices=("CPU", "GPU", "Ascend"))
    parser.add_argument("--mode", default="graph", choices=("graph", "pynative"))
    parser.add_argument("--jit-level", default=None, choices=("O0", "O1"))
    parser.add_argument("--kernel-fusion", default="on", choices=("on", "off"))
    args = parser.parse_args(argv)
    config = RuntimeConfig(device_target=args.device, mode=args.mode, jit_level=args.jit_level,
                           kernel_fusion=args.kernel_fusion == "on")
    print(json.dumps(settings_for(config).to_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One owner of how a process runs MindSpore: device, mode, jit level, CPU kernel fusion.

`RuntimeConfig` is the `runtime` section of params.yaml (every stage that runs a model reads it);
`settings_for(config)` computes, as plain data, what that means on its device; `configure(config)`
applies it to this process. Both the data and the application are tested
(tests/clipms/test_runtime.py).

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

Every device (MindSpore 2.10's documentation and source, read here): `jit_level` O0 unless the
config asks for O1. O0 is `mindspore.jit`'s default; its docstring calls O1 ("commonly used
optimizations and automatic operator fusion optimizations") experimental. On CPU O1 fuses
nothing (measured: same speed); on Ascend it is expected to fuse element-wise chains into fewer
kernels (fewer launches, less memory traffic): an option to measure on an NPU, not a default.
Off CPU, host blocking stays at MindSpore's default (off), as its Ascend performance checklist
asks.

The graph compile cache (`compile_cache`, off by default). MindSpore's cache
(`MS_COMPILER_CACHE_ENABLE`) decides whether a cached graph is still valid by hashing the entry
script and the files it imports, leaving out every file under `sys.path`
(`_get_compile_cache_dep_files` in mindspore/graph/api.py of 2.10), and matches cached graphs by
compile order. This project runs from `sys.path`, and the learning rate, schedule, clipping, loss
scale, world size and rank are constants in its train graph, so an unkeyed cache hands a changed
run yesterday's graph: shown on CPU (tests/clipms/train/test_graphcache.py). So `settings_for`
always turns MindSpore's cache off, and only a training run turns it on, after it knows its rank,
in a folder keyed by everything its graphs bake in (`enable_graph_cache`,
`clipms.train.graphcache`).

Data sinking (`data_sink`, off by default; Ascend and GPU only, the platforms of
`mindspore.data_sink`): training batches reach the device through MindSpore's device-side data
queue instead of a host-to-device copy when each step is launched (`clipms.train.feed.SinkFeed`).
It has not run on an NPU yet, hence off; a CPU config that asks for it is refused.
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

from pydantic import ConfigDict, ValidationInfo, field_validator

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
DATA_SINK_DEVICES = ("Ascend", "GPU")  # mindspore.data_sink's "Supported Platforms"
CACHE_SWITCH = "MS_COMPILER_CACHE_ENABLE"  # MindSpore's compile cache: this module owns it
CACHE_PATH = "MS_COMPILER_CACHE_PATH"  # its folder (and, on CPU with fusion, AKG's kernels)
# Makes MindSpore load cached graphs without checking anything (a string in its 2.10 library).
FORCE_CACHE = "MS_DEV_FORCE_USE_COMPILE_CACHE"


class RuntimeConfig(Section):
    """The `runtime` params section (params.yaml documents each key)."""

    model_config = ConfigDict(frozen=True)

    device_target: Literal["CPU", "GPU", "Ascend"] = "CPU"
    device_id: int | None = cadence(None, ge=0)  # None: MindSpore's choice (msrun: per rank)
    mode: Literal["graph", "pynative"] = "graph"
    jit_level: Literal["O0", "O1"] = "O0"  # O1 is experimental in MindSpore 2.10
    kernel_fusion: bool = True  # CPU only: graph-kernel fusion (FUSION_FLAGS)
    # Neither changes what a step computes: cadence fields, outside the resume fingerprint.
    compile_cache: bool = cadence(False)  # training graphs cached in keyed folders
    data_sink: bool = cadence(False)  # Ascend/GPU: batches through the device queue

    @field_validator("data_sink")
    @classmethod
    def _sink_where_mindspore_sinks(cls, value: bool, info: ValidationInfo) -> bool:
        device = info.data.get("device_target")
        if value and device not in DATA_SINK_DEVICES:
            raise ValueError(f"needs device_target {' or '.join(DATA_SINK_DEVICES)} "
                             f"(mindspore.data_sink's platforms), not {device}")
        return value


@dataclass(frozen=True)
class RuntimeSettings:
    """What a RuntimeConfig means on its device, as data (see the module docstring for when
    MindSpore reads each part)."""

    device_target: str
    device_id: int | None
    mode: str
    jit_level: str
    kernel_fusion: bool  # CPU graph-kernel fusion is on
    data_sink: bool  # training batches go through MindSpore's device queue (SinkFeed)
    compile_cache: bool  # a training run caches its graphs in a keyed folder (enable_graph_cache)
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


def for_data_parallel(config: RuntimeConfig) -> RuntimeConfig:
    """`config` as a data-parallel rank applies it: CPU kernel fusion off. With fusion, the ranks'
    collectives on CPU fell out of step (`AllReduce ... Memcpy error, dest size is 4, src size is
    256`, in the smoke run's data-parallel check); data parallel on CPU is for checking the
    distributed path, not for speed. Ascend and GPU are unchanged (fusion is CPU-only here)."""
    if config.device_target == "CPU" and config.kernel_fusion:
        log.info("data parallel on CPU: kernel fusion off for the ranks' graphs")
        return config.model_copy(update={"kernel_fusion": False})
    return config


def prepare_import(config: RuntimeConfig) -> None:
    """Export what MindSpore reads at import (`import_env`: OMP_WAIT_POLICY on CPU) for a process
    that imports MindSpore-backed modules before it can call configure(): the train stage builds
    and checks its job first. Its msrun workers inherit the environment."""
    if "mindspore" not in sys.modules:
        os.environ.update(settings_for(config).import_env)


def kernel_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where compiled kernels (and, with `compile_cache`, the keyed graph folders) live:
    $CLIPMS_KERNEL_CACHE, else the user's cache folder (not the working directory, which is often
    a git or DVC checkout)."""
    environ = os.environ if environ is None else environ
    explicit = environ.get("CLIPMS_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    base = environ.get("XDG_CACHE_HOME") or Path(environ.get("HOME", "~")).expanduser() / ".cache"
    return Path(base) / "clipms" / "mindspore-kernels"


def settings_for(config: RuntimeConfig, environ: Mapping[str, str] | None = None,
                 mindspore_dir: Path | None = None) -> RuntimeSettings:
    """The settings `config` asks for on its device; a pure function of its arguments.

    `environ` (default: this process's) supplies the fusion switch, the cache location and the
    user's own values, which win over computed ones -- except MindSpore's compile cache switch,
    which is always off here (`enable_graph_cache` turns it on in a keyed folder); `mindspore_dir`
    is the installed package (AKG's tiling repository lives in it)."""
    environ = os.environ if environ is None else environ
    device = config.device_target
    fusion = device == "CPU" and config.kernel_fusion and environ.get(SWITCH, "1") != "0"
    import_env: dict[str, str] = {}
    env: dict[str, str] = {CACHE_SWITCH: "0"}
    cache = str(kernel_cache_dir(environ))
    if device == "CPU":
        import_env["OMP_WAIT_POLICY"] = "PASSIVE"
        env["MS_DEV_HOST_BLOCKING_RUN"] = "1"
        if fusion:
            env["MS_DEV_GRAPH_KERNEL_FLAGS"] = FUSION_FLAGS
            # AKG reads its tiling repository from its own package and, unless that folder is
            # "white listed", skips it and prints a warning to stdout (corrupting command output).
            env["AKG_WHITE_LIST_PATH"] = str((mindspore_dir or _mindspore_dir()) / "_akg")
            env[CACHE_PATH] = cache
    keep = {key: environ[key] for key in (*import_env, *env) if key in environ
            and key != CACHE_SWITCH}
    return RuntimeSettings(
        device_target=device, device_id=config.device_id, mode=config.mode,
        jit_level=config.jit_level, kernel_fusion=fusion, data_sink=config.data_sink,
        compile_cache=config.compile_cache,
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
_KEYED_CACHE: Path | None = None  # the folder enable_graph_cache set


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
    _refuse_unkeyed_cache()
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
        "mode": ms.GRAPH_MODE if settings.mode == "graph" else ms.PYNATIVE_MODE,
        "jit_config": {"jit_level": settings.jit_level}}
    ms.set_context(**context)
    _APPLIED = settings
    return settings


def _refuse_unkeyed_cache() -> None:
    """MindSpore's compile cache left on by the environment would be unkeyed: turn it off and say
    why (settings_for's env then sets the switch to 0)."""
    ours = _KEYED_CACHE is not None and os.environ.get(CACHE_PATH) == str(_KEYED_CACHE)
    if os.environ.get(CACHE_SWITCH, "0") not in ("0", "") and not ours:
        log.warning("%s=%s in the environment is ignored: an unkeyed compile cache can hand a "
                    "run the graph of another learning rate, code or rank count; set "
                    "runtime.compile_cache: true instead (docs/ascend.md)", CACHE_SWITCH,
                    os.environ[CACHE_SWITCH])
    if os.environ.pop(FORCE_CACHE, None) is not None:
        log.warning("%s removed from the environment: it makes MindSpore load cached graphs "
                    "without checking that the network is the same", FORCE_CACHE)


def enable_graph_cache(folder: Path | str) -> Path:
    """Turn MindSpore's compile cache on for this process's next compiles, in `folder`.

    MindSpore reads both variables when a graph compiles (shown on CPU: set after `import
    mindspore`, they take effect), so a training run calls this once its rank is known and
    before its first graph. `folder` must be keyed by everything the graphs bake in
    (`clipms.train.graphcache.graph_cache_dir`); MindSpore adds a `rank_<RANK_ID>` folder inside.
    """
    global _KEYED_CACHE
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    os.environ.update({CACHE_SWITCH: "1", CACHE_PATH: str(folder)})
    _KEYED_CACHE = folder
    log.info("compile cache on: %s", folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    """`python -m clipms.runtime --device Ascend`: print the settings a config means, as JSON."""
    parser = argparse.ArgumentParser(prog="python -m clipms.runtime", description=main.__doc__)
    parser.add_argument("--device", default="CPU", choices=("CPU", "GPU", "Ascend"))
    parser.add_argument("--mode", default="graph", choices=("graph", "pynative"))
    parser.add_argument("--jit-level", default="O0", choices=("O0", "O1"))
    parser.add_argument("--kernel-fusion", default="on", choices=("on", "off"))
    parser.add_argument("--compile-cache", default="off", choices=("on", "off"))
    parser.add_argument("--data-sink", default="off", choices=("on", "off"))
    args = parser.parse_args(argv)
    config = RuntimeConfig(device_target=args.device, mode=args.mode, jit_level=args.jit_level,
                           kernel_fusion=args.kernel_fusion == "on",
                           compile_cache=args.compile_cache == "on",
                           data_sink=args.data_sink == "on")
    print(json.dumps(settings_for(config).to_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Graph-kernel fusion for MindSpore on CPU: the switch that makes CLIP's non-matmul work cheap.

Measured on the tiny preset (batch 64, 2 cores; benchmarks/RESULTS.md, "Summary: CPU kernel
fusion"): without fusion, MindSpore's CPU kernels for Erf (exact GELU) and LayerNorm are scalar and
single-threaded respectively, and with the element-wise Mul/Add/BiasAdd/Transpose passes they
take more time than every MatMul together. MindSpore's graph-kernel fusion (AKG) expands Erf and
LayerNorm into primitive maths and fuses each chain into one vectorised kernel; the MatMuls are
left to MindSpore's own kernel, which is faster than AKG's. Training gains the same way
(LayerNormGrad). The exported MindIR files are unchanged: fusion happens when a graph is
compiled, so the same bundle runs fused here and unfused elsewhere.

Fused kernels are compiled once per shape and cached on disk (`kernel_cache_dir()`); the first
compile of a graph costs seconds, later processes reuse the cache. `CLIPMS_KERNEL_FUSION=0`
turns fusion off; a `MS_DEV_GRAPH_KERNEL_FLAGS` already in the environment is respected.
"""

from __future__ import annotations

import os
from pathlib import Path

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


def kernel_cache_dir() -> Path:
    """Where compiled fused kernels live: $CLIPMS_KERNEL_CACHE, else the user's cache folder
    (not the working directory, which is often a git or DVC checkout)."""
    explicit = os.environ.get("CLIPMS_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "clipms" / "mindspore-kernels"


def enable_kernel_fusion() -> bool:
    """Turn graph-kernel fusion on for every graph this process compiles from now on.

    CPU only (the flags were chosen and measured there; Ascend and GPU keep MindSpore's own
    defaults). Returns whether fusion is active. Process-wide by MindSpore's design: call it
    before the first graph is compiled, e.g. at the start of a stage or an inference service.
    """
    import mindspore as ms

    if os.environ.get(SWITCH, "1") == "0" or ms.get_context("device_target") != "CPU":
        return False
    os.environ.setdefault("MS_DEV_GRAPH_KERNEL_FLAGS", FUSION_FLAGS)
    # AKG reads its tiling repository from its own package and, unless that folder is "white
    # listed", skips it and prints a warning to stdout, which corrupts command output.
    os.environ.setdefault("AKG_WHITE_LIST_PATH", str(Path(ms.__file__).parent / "_akg"))
    cache = kernel_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MS_COMPILER_CACHE_PATH", str(cache))
    return True


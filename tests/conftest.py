"""Shared fixtures. Servers that tests start listen on 127.0.0.1 and are stopped by the fixture."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

# Same offline defaults as the Makefile, for a bare `pytest` run too.
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("GLOG_v", "3")

# CPU graph-kernel fusion (clipms.runtime): the commands tests start (stages, `dvc repro`, servers;
# tests/workspace.py's tool_env) run fused, as users run them, compiling into a kernel cache of
# their own that starts empty. This pytest process itself stays unfused: after ~80 tests had
# compiled hundreds of unrelated graphs in it, MindSpore's AKG kernel-build client was found closed
# ("Send request before Open()"), which no single stage or inference process ever showed.
# tests/test_runtime.py compares fused and unfused runs in processes of their own.
if "CLIPMS_KERNEL_CACHE" not in os.environ:
    os.environ["CLIPMS_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="clipms-test-kernels-")
    atexit.register(shutil.rmtree, os.environ["CLIPMS_KERNEL_CACHE"], True)
os.environ["CLIPMS_KERNEL_FUSION"] = "0"

# The promotion gate's machine-wide lock (registry.gatelock, for HTTP tracking servers) is keyed by
# model name only; `make test` runs two pytest workers whose MLflow servers both register "clip",
# so each pytest process keeps its locks apart (the processes a test starts inherit this folder).
if "CLIPMS_LOCK_DIR" not in os.environ:
    os.environ["CLIPMS_LOCK_DIR"] = tempfile.mkdtemp(prefix="clipms-test-locks-")
    atexit.register(shutil.rmtree, os.environ["CLIPMS_LOCK_DIR"], True)

# The CPU settings clipms.runtime.configure would make, set before any test imports MindSpore (some
# are read at `import mindspore`); the tests' own configure() calls then find them in place.
from clipms.runtime import RuntimeConfig, settings_for  # noqa: E402

_cpu = settings_for(RuntimeConfig(kernel_fusion=False))
os.environ.update({**_cpu.import_env, **_cpu.env})


@pytest.fixture(params=["graph", "pynative"])
def mode(request):
    """Run a MindSpore test in each execution mode (or the one it parametrizes), then restore.

    Imported lazily so that tests without MindSpore do not pay for it; the modules that use this
    fixture import clipms first, which sets MindSpore's environment.
    """
    import mindspore as ms

    modes = {"graph": ms.GRAPH_MODE, "pynative": ms.PYNATIVE_MODE}
    previous = ms.get_context("mode")
    ms.set_context(mode=modes[request.param])
    yield request.param
    ms.set_context(mode=previous)

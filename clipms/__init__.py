"""clipms: CLIP in MindSpore. The library imports nothing from DVC, Prefect, MLflow or stages/."""

import os

# MindSpore's CPU runtime otherwise spins the main thread in its task queue while waiting on a
# result (asnumpy/sync), eating ~1.6 CPU-seconds a training step on a 2-core machine; blocking
# host runs made a tiny-CLIP step ~60% faster (../shared/stack-notes.md). It must be set before
# mindspore is imported, so it lives here, at the package root, and nowhere else.
os.environ.setdefault("MS_DEV_HOST_BLOCKING_RUN", "1")
os.environ.setdefault("GLOG_v", "3")  # MindSpore's C++ INFO/WARNING chatter buries real messages
# Fused CPU kernels (clipms.runtime) run on OpenMP threads that otherwise spin after each kernel and
# steal both cores from the next MatMul (measured: MatMul 8.3 -> 13.6 ms a call). Sleeping idle
# threads cost nothing measurable without fusion. libgomp reads this once, when it is loaded.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

"""An export's parity computed on the host CPU, where its bars were calibrated, from a process that
runs on a device.

`clipms.deploy.mindir.PARITY`'s fp32 bar (1e-5 absolute) was calibrated on CPU, where the static
graph and the dynamic-batch MindIR pick the same kernels and the error is 0. On an NPU they may
pick other kernels (another matmul tiling, fused element-wise ops, HF32 where allowed) and differ
by more than fp32 rounding, so the bar would fail a correct export. The gate is therefore the
host's parity, and the device's figures are reported beside it (`device_figures`), not gated.

A process chooses its device once, so the host parity runs in a process of its own:
`host_parity(...)` writes the inputs to a temporary file and runs `python -m
clipms.deploy.hostparity` on CPU, which loads the checkpoint and both MindIR graphs there.
"""

# tested by: tests/clipms/deploy/test_mindir.py

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from clipms.model.architecture import CLIPConfig


def host_parity(bundle_dir: Path | str, checkpoint: Path | str, model: CLIPConfig,
                images: np.ndarray, tokens: np.ndarray, batch_sizes: Sequence[int],
                precision: str = "fp32", tolerance: float | None = None,
                timeout: float = 1800) -> dict[str, Any]:
    """`clipms.deploy.mindir.parity_report` of the bundle against the checkpoint, on CPU."""
    with tempfile.TemporaryDirectory(prefix="clipms-host-parity-") as tmp:
        inputs, spec = Path(tmp) / "inputs.npz", Path(tmp) / "spec.json"
        np.savez(inputs, images=images, tokens=tokens)
        spec.write_text(json.dumps({
            "bundle": str(bundle_dir), "checkpoint": str(checkpoint), "model": model.to_dict(),
            "inputs": str(inputs), "batch_sizes": list(batch_sizes), "precision": precision,
            "tolerance": tolerance}))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH"))
            if p)}
        proc = subprocess.run([sys.executable, "-m", "clipms.deploy.hostparity", str(spec)],
                              env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the host parity check failed (exit {proc.returncode}): "
                           f"{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def gate_on_host(here: dict[str, Any], device: str,
                 on_host: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The report to gate on: `here` (this process's parity) when this process runs on CPU; on a
    device the host's (`on_host()`, e.g. `host_parity`) with this device's figures beside it."""
    if device == "CPU":
        return {**here, "parity_device": "CPU (host)"}
    return {**on_host(), **device_figures(here, device)}


def device_figures(report: dict[str, Any], device: str) -> dict[str, Any]:
    """The device's parity errors as `device_*` entries beside the host's gate (not gated)."""
    keys = [key for key in report if key.startswith(("image_", "text_"))]
    return {"parity_device": device, **{f"device_{key}": report[key] for key in keys}}


def main(argv: list[str] | None = None) -> int:
    """`python -m clipms.deploy.hostparity SPEC_JSON`: print the parity report as JSON."""
    parser = argparse.ArgumentParser(prog="python -m clipms.deploy.hostparity")
    parser.add_argument("spec", type=Path)
    spec = json.loads(parser.parse_args(argv).spec.read_text())
    from clipms.runtime import RuntimeConfig, configure, for_precision

    configure(for_precision(RuntimeConfig(device_target="CPU"), spec["precision"]))
    from clipms.deploy.mindir import parity_report
    from clipms.train.trained import load_clip

    net = load_clip(spec["checkpoint"], CLIPConfig.from_dict(spec["model"]))
    inputs = np.load(spec["inputs"])
    report = parity_report(net, spec["bundle"], inputs["images"], inputs["tokens"],
                           spec["batch_sizes"], spec["precision"], spec["tolerance"])
    print(json.dumps({**report, "parity_device": "CPU (host)"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

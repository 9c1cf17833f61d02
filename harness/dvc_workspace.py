"""A throw-away copy of the project in its own git repo, for tests that run real `dvc` commands.

`make_workspace` copies the files git would see (tracked + untracked-not-ignored), applies dotted
param overrides to params.yaml, and commits, so `dvc repro` runs exactly as a user's clone would.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from harness import project_copy
from harness.project_copy import set_params

PROJECT_ROOT = Path(__file__).resolve().parents[1]

# A pipeline small enough for CI: a few dozen images, a 1-layer model, a handful of steps.
# Each stage owner keeps its own section here in step with its params schema.
TINY_PARAMS: dict[str, Any] = {
    "metadata.num_images": 48,
    "metadata.synthetic_image_size": 64,
    "dedupe.val_fraction": 0.25,
    "download.processes": 1,
    "download.threads": 4,
    "download.samples_per_shard": 32,
    "download.image_size": 64,
    "shard.samples_per_shard": 16,
    "shard.workers": 1,
    "tokenizer.vocab_size": 600,
    "tokenizer.context_length": 16,
    "train.preset": "tiny",  # the overrides below shrink tiny (the default run's preset is mini)
    "train.batch_size": 8,
    "train.epochs": 1,
    "train.warmup_steps": 1,
    "train.model": {"embed_dim": 32, "vision": {"width": 64, "layers": 1, "head_width": 32},
                    "text": {"width": 64, "heads": 2, "layers": 1}},
    "train.workers": 1,
    "train.checkpoint_every": 2,
    "train.log_every": 1,
    "evaluate.batch_size": 16,
    "export.batch_sizes": [1, 3, 8],
    # CPU kernel fusion (the users' default) compiles AKG kernels in every stage process: measured
    # 778 s vs 521 s wall for the tiny `dvc repro` to export (run side by side, load ~20). Fused
    # runs are exercised where fusion is the subject: tests/clipms/test_runtime.py,
    # tests/clipms/train/test_step_amp.py
    # and the one full pipeline of tests/integration/test_registry_server.py (amp, fused), which
    # sets it back
    # to True.
    "runtime.kernel_fusion": False,
}


def project_files() -> list[Path]:
    """Paths (relative to the project root) that a clean clone of the working tree would hold."""
    return project_copy.project_files(PROJECT_ROOT)


def make_workspace(dst: Path, overrides: dict[str, Any] | None = None) -> Path:
    """Copy the project to `dst`, apply TINY_PARAMS, then `overrides`; commit it in a new repo."""
    project_copy.copy_project(PROJECT_ROOT, dst)
    set_params(dst / "params.yaml", {**TINY_PARAMS, **(overrides or {})})
    project_copy.commit_all(dst)
    return dst


def tool_env() -> dict[str, str]:
    """The environment for subprocesses: this venv's tools first on PATH, analytics off, CPU
    kernel fusion as the params say (conftest.py's process-wide "off" is lifted here)."""
    env = dict(os.environ)
    venv_bin = str(Path(os.sys.executable).parent)
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
    env.update(DVC_NO_ANALYTICS="1", NO_ALBUMENTATIONS_UPDATE="1", WANDB_MODE="disabled",
               GLOG_v="3", CLIPMS_KERNEL_FUSION="1")
    return env


def run(cmd: list[str], cwd: Path, timeout: float = 900, check: bool = True,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command in a workspace, failing the test with its output when it fails."""
    proc = subprocess.run(cmd, cwd=cwd, env=env or tool_env(), capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}"
            f"\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def checkpoint_arrays(path: Path) -> dict[str, Any]:
    """A MindSpore checkpoint's tensors as numpy arrays, by parameter name."""
    import mindspore as ms

    return {name: value.asnumpy() for name, value in ms.load_checkpoint(str(path)).items()}

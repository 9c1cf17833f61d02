"""Checkpoints: atomic writes and rotation; a real training process killed with SIGKILL mid-run and
resumed (`resume`) ends with the same weights as an uninterrupted run of the same seed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from clipms import checkpoint
from tests.workspace import checkpoint_arrays

PROJECT = Path(__file__).resolve().parents[1]

# A training process: micro CLIP, random batches (a function of seed and batch index) served with a
# little latency so that the kill lands mid-run, a checkpoint every 2 steps.
TRAIN_SCRIPT = textwrap.dedent("""
    import logging, sys, time
    import clipms
    from clipms.config import CLIPConfig, TextConfig, VisionConfig
    from clipms.trainer import RandomBatches, TrainConfig, save_model, train

    class SlowBatches(RandomBatches):
        def global_batch(self, epoch, index):
            time.sleep(0.3)
            return super().global_batch(epoch, index)

    logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True)
    micro = CLIPConfig(
        embed_dim=16,
        vision=VisionConfig(image_size=16, patch_size=8, width=32, layers=1, head_width=16),
        text=TextConfig(context_length=8, vocab_size=40, width=32, heads=2, layers=1))
    cfg = TrainConfig(model=micro, batch_size=4, epochs=2, lr=2e-3, warmup_steps=2,
                      checkpoint_every=2, keep_checkpoints=2, accum_steps=2)
    result = train(cfg, SlowBatches(micro, 4, 10, seed=7), sys.argv[1], resume=True)
    save_model(result.model, sys.argv[2])
    print("DONE", result.history[-1]["loss"], flush=True)
""")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(PROJECT), "GLOG_v": "3"}


def _start(script: Path, ckpt: Path, out: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(script), str(ckpt), str(out)], cwd=PROJECT,
                            env=_env(), stdout=log.open("w"), stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_sigkill_then_resume_reaches_the_uninterruptedcheckpoint_arrays(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    # The reference and the run to kill start together (2 cores, both mostly wait on data).
    reference = _start(script, tmp_path / "ref_ckpt", tmp_path / "ref.ckpt", tmp_path / "ref.log")
    victim = _start(script, tmp_path / "ckpt", tmp_path / "victim.ckpt", tmp_path / "victim.log")
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "ckpt" / "step-00000004.ckpt").exists():
            assert victim.poll() is None, (tmp_path / "victim.log").read_text()
            assert time.monotonic() < deadline, "no checkpoint at step 4 within 300 s"
            time.sleep(0.05)
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
        assert not (tmp_path / "victim.ckpt").exists()  # it really died before the end
        killed_at = [p.name for p in checkpoint.list_checkpoints(tmp_path / "ckpt")]
        assert "step-00000010.ckpt" not in killed_at
        resumed = _start(script, tmp_path / "ckpt", tmp_path / "victim.ckpt",
                         tmp_path / "resumed.log")
        assert resumed.wait(timeout=300) == 0, (tmp_path / "resumed.log").read_text()
        assert reference.wait(timeout=300) == 0, (tmp_path / "ref.log").read_text()
    finally:
        for proc in (reference, victim):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    resumed_log = (tmp_path / "resumed.log").read_text()
    assert "resuming from" in resumed_log and "from step 0" not in resumed_log
    expected = checkpoint_arrays(tmp_path / "ref.ckpt")
    got = checkpoint_arrays(tmp_path / "victim.ckpt")
    assert expected.keys() == got.keys() and len(expected) > 10
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    # keep-the-last-2 rotation, and the history survives the kill (all 10 steps in the final one)
    final = checkpoint.list_checkpoints(tmp_path / "ckpt")
    assert [p.name for p in final] == ["step-00000008.ckpt", "step-00000010.ckpt"]
    history = checkpoint.load(final[-1]).meta["history"]
    assert [row["step"] for row in history] == list(range(1, 11))


def test_save_is_atomic_and_temp_files_of_dead_writers_are_ignored(tmp_path):
    folder = tmp_path / "ckpt"
    checkpoint.save(folder, 1, {"w": np.ones(3, np.float32)}, {"step": 1})

    class Exploding:
        def __array__(self, dtype=None, copy=None):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        checkpoint.save(folder, 2, {"w": np.ones(3, np.float32), "x": Exploding()}, {"step": 2})
    assert [p.name for p in folder.iterdir()] == ["step-00000001.ckpt"]
    # what a writer killed mid-write leaves behind: a temp file, never a final-looking name
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = folder / f".step-00000002.ckpt.tmp-{dead.pid}-0badf00d.ckpt"
    stale.write_bytes(b"\x00" * 10)
    latest = checkpoint.load_latest(folder)
    assert latest is not None and latest.meta == {"step": 1}
    np.testing.assert_array_equal(latest.tensors["w"], np.ones(3, np.float32))
    for step in (3, 4, 5):
        checkpoint.save(folder, step, {"w": np.full(2, step, np.float32)}, {"step": step}, keep=2)
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000004.ckpt", "step-00000005.ckpt"]


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    checkpoint.save(tmp_path, 1, {"w": np.zeros(2, np.float32)}, {"step": 1})
    checkpoint.checkpoint_path(tmp_path, 2).write_bytes(b"not a checkpoint")
    latest = checkpoint.load_latest(tmp_path)
    assert latest is not None and latest.meta["step"] == 1

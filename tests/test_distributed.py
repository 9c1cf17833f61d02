"""Data parallel on CPU through a real `msrun` with 2 workers (MindSpore's CPU collectives):
both ranks end with identical weights, and the step-1 loss equals the single-process loss of the
same global batch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from clipms.distributed import msrun_command, worker_logs_tail
from tests.workspace import checkpoint_arrays

PROJECT = Path(__file__).resolve().parents[1]

# Each rank trains 2 steps on its half of the random global batches and saves its own weights;
# with `single` one process trains on the whole global batch.
SCRIPT = textwrap.dedent("""
    import json, sys
    import clipms
    import mindspore as ms
    from clipms.config import CLIPConfig, TextConfig, VisionConfig
    from clipms.trainer import RandomBatches, TrainConfig, init_distributed, save_model, train

    out, mode = sys.argv[1], sys.argv[2]
    micro = CLIPConfig(
        embed_dim=16,
        vision=VisionConfig(image_size=16, patch_size=8, width=32, layers=1, head_width=16),
        text=TextConfig(context_length=8, vocab_size=40, width=32, heads=2, layers=1))
    distributed = mode == "dp"
    rank, size = init_distributed() if distributed else (0, 1)
    per_rank = 4 if distributed else 8
    cfg = TrainConfig(model=micro, batch_size=per_rank, max_steps=2, lr=1e-3, warmup_steps=1)
    source = RandomBatches(micro, per_rank, 4, seed=5, rank=rank, group_size=size)
    result = train(cfg, source, None, distributed=distributed)
    save_model(result.model, f"{out}/{mode}-rank{rank}.ckpt")
    with open(f"{out}/{mode}-rank{rank}.json", "w") as f:
        json.dump([row["loss"] for row in result.history], f)
""")


@pytest.mark.slow
def test_two_msrun_workers_match_each_other_and_the_single_process_loss(tmp_path):
    import json

    script = tmp_path / "dp_train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(PROJECT), "GLOG_v": "3"}
    single = subprocess.Popen([sys.executable, str(script), str(tmp_path), "single"], cwd=PROJECT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cmd = msrun_command(2, tmp_path / "logs", script, [str(tmp_path), "dp"])
    proc = subprocess.run(cmd, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=400)
    single_out, _ = single.communicate(timeout=400)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{worker_logs_tail(tmp_path / 'logs')}"
    assert single.returncode == 0, single_out[-3000:]

    rank0 = checkpoint_arrays(tmp_path / "dp-rank0.ckpt")
    rank1 = checkpoint_arrays(tmp_path / "dp-rank1.ckpt")
    assert rank0.keys() == rank1.keys() and len(rank0) > 10
    for name in rank0:
        np.testing.assert_array_equal(rank0[name], rank1[name], err_msg=name)

    dp_losses = json.loads((tmp_path / "dp-rank0.json").read_text())
    single_losses = json.loads((tmp_path / "single-rank0.json").read_text())
    assert json.loads((tmp_path / "dp-rank1.json").read_text()) == dp_losses
    assert dp_losses[0] == pytest.approx(single_losses[0], rel=1e-5)
    # the gradients averaged over ranks are the global batch's: step 2 agrees too
    assert dp_losses[1] == pytest.approx(single_losses[1], rel=1e-3)
    single_weights = checkpoint_arrays(tmp_path / "single-rank0.ckpt")
    for name in rank0:
        np.testing.assert_allclose(rank0[name], single_weights[name], rtol=1e-3, atol=1e-5,
                                   err_msg=name)

"""`train.accum_steps` through the whole trainer: k micro-batches of b give the contrastive loss
over all k x b samples (x ranks), so a run with accumulation trains what one run on the
k-times larger batch trains, in one process and on 2 data-parallel msrun workers (CPU
collectives). The step's own arithmetic is tests/clipms/train/test_step.py's; here the loop feeds
it.

Every run draws from the same pool of 16 samples a step, each taking them in its own order (the
contrastive losses do not depend on the order of the pairs):
- `whole`: one process, batch 16, no accumulation (the reference);
- `accum`: one process, 2 micro-batches of 8;
- `dp-accum`: 2 msrun ranks, 2 micro-batches of 4 each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from clipms.parallel.launch import Cluster, msrun_command, worker_logs_tail
from harness.dvc_workspace import checkpoint_arrays
from harness.processes import finished_ok

PROJECT = Path(__file__).resolve().parents[3]
POOL = 16  # samples an optimizer step, in every mode

SCRIPT = textwrap.dedent("""
    import json, sys
    import clipms
    from clipms.model.architecture import CLIPConfig, TextConfig, VisionConfig
    from clipms.train.collectives import init_distributed
    from clipms.train.recipe import LOSS_INIT
    from clipms.train.loop import RandomBatches, TrainConfig, save_model, train

    out, mode, loss = sys.argv[1], sys.argv[2], sys.argv[3]
    micro = CLIPConfig(
        embed_dim=16,
        vision=VisionConfig(image_size=16, patch_size=8, width=32, layers=1, head_width=16),
        text=TextConfig(context_length=8, vocab_size=40, width=32, heads=2, layers=1),
        **LOSS_INIT[loss])
    POOL, STEPS = 16, 2
    distributed = mode.startswith("dp")
    rank, size = init_distributed() if distributed else (0, 1)
    accum = 1 if mode == "whole" else 2
    batch = POOL // accum // size
    pool = RandomBatches(micro, POOL, STEPS, seed=7)

    class Pooled:
        # micro-batch i is step i // accum's pool, part (i % accum) * size + rank of it
        batches_per_epoch = STEPS * accum

        def stream(self, start, stop):
            for i in range(start, stop):
                images, tokens = pool.global_batch(0, i // accum)
                part = (i % accum) * size + rank
                rows = slice(part * batch, (part + 1) * batch)
                yield images[rows], tokens[rows]

    cfg = TrainConfig(model=micro, batch_size=batch, accum_steps=accum, max_steps=STEPS,
                      lr=1e-3, warmup_steps=1, loss=loss, log_every=1)
    result = train(cfg, Pooled(), None, distributed=distributed)
    save_model(result.model, f"{out}/{mode}-{loss}-rank{rank}.ckpt")
    with open(f"{out}/{mode}-{loss}-rank{rank}.json", "w") as f:
        json.dump(result.history, f)
""")


def _env() -> dict[str, str]:
    """msrun starts `python` from PATH: this venv's first."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {**os.environ, "PATH": path, "PYTHONPATH": str(PROJECT), "GLOG_v": "3"}


def _start(out: Path, mode: str, loss: str) -> subprocess.Popen:
    args = [str(out), mode, loss]
    if mode.startswith("dp"):
        cmd = msrun_command(Cluster(workers=2), out / f"logs-{mode}-{loss}",
                            out / "accum_train.py", args)
    else:
        cmd = [sys.executable, str(out / "accum_train.py"), *args]
    return subprocess.Popen(cmd, cwd=PROJECT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, logs: Path, timeout: float = 600) -> None:
    finished_ok(proc, timeout, lambda: worker_logs_tail(logs))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("accum")
    (out / "accum_train.py").write_text(SCRIPT)
    for loss in ("clip", "siglip"):
        procs = [(_start(out, mode, loss), out / f"logs-{mode}-{loss}")
                 for mode in ("whole", "accum", "dp-accum")]
        for proc, logs in procs:
            _finish(proc, logs)
    return out


def _history(out: Path, name: str) -> list[dict]:
    return json.loads((out / f"{name}.json").read_text())


@pytest.mark.slow  # trains in processes of its own, and through msrun
@pytest.mark.parametrize("loss", ["clip", "siglip"])
@pytest.mark.parametrize("mode", ["accum", "dp-accum"])
def test_accumulated_steps_train_what_one_step_on_the_whole_batch_trains(runs, mode, loss):
    whole = _history(runs, f"whole-{loss}-rank0")
    got = _history(runs, f"{mode}-{loss}-rank0")
    assert len(got) == len(whole) == 2
    # step 1 starts from the same weights: the loss of all 16 samples and its gradient's norm
    assert got[0]["loss"] == pytest.approx(whole[0]["loss"], rel=1e-5)
    assert got[0]["grad_norm"] == pytest.approx(whole[0]["grad_norm"], rel=1e-4)
    assert got[1]["loss"] == pytest.approx(whole[1]["loss"], rel=1e-3)  # after one update
    reference = checkpoint_arrays(runs / f"whole-{loss}-rank0.ckpt")
    weights = checkpoint_arrays(runs / f"{mode}-{loss}-rank0.ckpt")
    assert weights.keys() == reference.keys()
    for name in reference:
        np.testing.assert_allclose(weights[name], reference[name], rtol=1e-3, atol=1e-5,
                                   err_msg=name)
    if mode.startswith("dp"):  # and the ranks agree with each other exactly
        other = checkpoint_arrays(runs / f"{mode}-{loss}-rank1.ckpt")
        for name in weights:
            np.testing.assert_array_equal(other[name], weights[name], err_msg=name)


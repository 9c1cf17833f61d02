"""Data parallel on CPU through real `msrun` launches (MindSpore's CPU collectives).

- 2 workers on one node: both ranks end with identical weights, and the step-1 loss equals the
  single-process loss of the same global batch.
- 2 "nodes" on this machine: two msrun launches (node_rank 0 and 1, one worker each, the master on
  127.0.0.1) train exactly what the 2-worker single-node run trains.

A second host cannot exist here. msrun decides whether to start the scheduler by asking whether
`master_addr` is one of this host's addresses; on one machine both launches would answer yes and
start two schedulers on one port. Node 1's msrun is therefore told, and told only, that 127.0.0.1
is not its own address -- what msrun finds on a real second host. Everything else (msrun, the
scheduler, both workers, the collectives) is real.
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

from clipms.parallel.launch import (
    Cluster,
    LaunchError,
    free_port,
    msrun_command,
    run_workers,
    worker_env,
    worker_logs_tail,
)
from harness.dvc_workspace import checkpoint_arrays
from harness.processes import finished_ok

PROJECT = Path(__file__).resolve().parents[3]

# Each rank trains 2 steps on its half of the random global batches and saves its own weights;
# with `single` one process trains on the whole global batch.
SCRIPT = textwrap.dedent("""
    import json, sys
    import clipms
    import mindspore as ms
    from clipms.model.architecture import CLIPConfig, TextConfig, VisionConfig
    from clipms.train.collectives import init_distributed
    from clipms.train.recipe import LOSS_INIT
    from clipms.train.loop import RandomBatches, TrainConfig, save_model, train

    out, mode = sys.argv[1], sys.argv[2]
    loss = sys.argv[3] if len(sys.argv) > 3 else "clip"  # siglip: with patch dropout 0.5 too
    micro = CLIPConfig(
        embed_dim=16,
        vision=VisionConfig(image_size=16, patch_size=8, width=32, layers=1, head_width=16,
                            patch_dropout=0.5 if loss == "siglip" else 0.0),
        text=TextConfig(context_length=8, vocab_size=40, width=32, heads=2, layers=1),
        **LOSS_INIT[loss])
    distributed = not mode.startswith("single")
    rank, size = init_distributed() if distributed else (0, 1)
    per_rank = 4 if distributed else 8
    cfg = TrainConfig(model=micro, batch_size=per_rank, max_steps=2, lr=1e-3, warmup_steps=1,
                      loss=loss)
    source = RandomBatches(micro, per_rank, 4, seed=5, rank=rank, world_size=size)
    # rank 0 writes checkpoints; in "split" the ranks see different folders, as hosts without a
    # shared filesystem would: rank 0 the finished dp run's, the others an empty one
    ckpt = {"single": None, "split": f"{out}/ckpt-dp" if rank == 0 else f"{out}/ckpt-empty"}.get(
        mode, f"{out}/ckpt-{mode}")
    result = train(cfg, source, ckpt, distributed=distributed)
    save_model(result.model, f"{out}/{mode}-rank{rank}.ckpt")
    with open(f"{out}/{mode}-rank{rank}.json", "w") as f:
        json.dump([row["loss"] for row in result.history], f)
""")


def _env() -> dict[str, str]:
    """msrun starts `python` from PATH: this venv's first."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {**os.environ, "PATH": path, "PYTHONPATH": str(PROJECT), "GLOG_v": "3"}


# msrun as it runs on a host that does not own master_addr (see the module docstring).
AS_OTHER_HOST = (
    "import sys\n"
    "from mindspore.parallel.cluster.process_entity import _api\n"
    "_api._is_local_ip = lambda address: False\n"
    "from mindspore.parallel.cluster.run import main\n"
    "sys.exit(main())\n")


def _msrun(cluster: Cluster, out: Path, mode: str, loss: str = "clip") -> subprocess.Popen:
    log_dir = out / f"logs-{mode}-node{cluster.node_rank}"
    cmd = msrun_command(cluster, log_dir, out / "dp_train.py", [str(out), mode, loss])
    if cluster.node_rank > 0:
        cmd = [sys.executable, "-c", AS_OTHER_HOST, *cmd[1:]]
    return subprocess.Popen(cmd, cwd=PROJECT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, logs: Path, timeout: float = 400) -> None:
    finished_ok(proc, timeout, lambda: worker_logs_tail(logs))


@pytest.fixture(scope="module")
def single_node(tmp_path_factory):
    """The single-process reference and the 2-worker single-node msrun run, side by side."""
    out = tmp_path_factory.mktemp("dp")
    (out / "dp_train.py").write_text(SCRIPT)
    single = subprocess.Popen([sys.executable, str(out / "dp_train.py"), str(out), "single"],
                              cwd=PROJECT, env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    dp = _msrun(Cluster(workers=2), out, "dp")
    _finish(dp, out / "logs-dp-node0")
    _finish(single, out)
    return out


@pytest.fixture(scope="module")
def siglip_node(single_node):
    """The same pair with train.loss siglip and patch dropout 0.5 (2 of the 4 patches kept)."""
    out = single_node
    single = subprocess.Popen([sys.executable, str(out / "dp_train.py"), str(out),
                               "single-siglip", "siglip"], cwd=PROJECT, env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    dp = _msrun(Cluster(workers=2), out, "dp-siglip", "siglip")
    _finish(dp, out / "logs-dp-siglip-node0")
    _finish(single, out)
    return out


def _losses(out: Path, mode: str, rank: int) -> list[float]:
    return json.loads((out / f"{mode}-rank{rank}.json").read_text())


def _ranks_match_each_other_and_the_single_process(out: Path, dp: str, single: str) -> None:
    rank0 = checkpoint_arrays(out / f"{dp}-rank0.ckpt")
    rank1 = checkpoint_arrays(out / f"{dp}-rank1.ckpt")
    assert rank0.keys() == rank1.keys() and len(rank0) > 10
    for name in rank0:
        np.testing.assert_array_equal(rank0[name], rank1[name], err_msg=name)

    dp_losses, single_losses = _losses(out, dp, 0), _losses(out, single, 0)
    assert _losses(out, dp, 1) == dp_losses
    assert dp_losses[0] == pytest.approx(single_losses[0], rel=1e-5)
    # the gradients averaged over ranks are the global batch's: step 2 agrees too
    assert dp_losses[1] == pytest.approx(single_losses[1], rel=1e-3)
    single_weights = checkpoint_arrays(out / f"{single}-rank0.ckpt")
    for name in rank0:
        np.testing.assert_allclose(rank0[name], single_weights[name], rtol=1e-3, atol=1e-5,
                                   err_msg=name)


@pytest.mark.slow
def test_two_msrun_workers_match_each_other_and_the_single_process_loss(single_node):
    _ranks_match_each_other_and_the_single_process(single_node, "dp", "single")


@pytest.mark.slow
def test_siglip_with_patch_dropout_on_two_workers_is_the_single_process_run(siglip_node):
    """Each rank scores its images against the all-gathered texts and drops the patches one
    process of the global batch would drop: the same losses and weights, the same draw count."""
    _ranks_match_each_other_and_the_single_process(siglip_node, "dp-siglip", "single-siglip")
    weights = checkpoint_arrays(siglip_node / "dp-siglip-rank0.ckpt")
    assert int(weights["visual.patch_dropout.draws"]) == 2
    assert float(weights["logit_bias"]) != -10.0  # the bias trained


@pytest.mark.slow
def test_two_nodes_of_one_worker_train_what_one_node_of_two_workers_trains(single_node):
    out, port = single_node, free_port()
    nodes = [_msrun(Cluster(workers=2, nodes=2, node_rank=rank, master_addr="127.0.0.1",
                            master_port=port), out, "nodes")
             for rank in (0, 1)]
    for rank, proc in enumerate(nodes):
        _finish(proc, out / f"logs-nodes-node{rank}")
    # node 0 ran global rank 0, node 1 global rank 1 (node_rank * local workers + k)
    assert [p.name for p in (out / "logs-nodes-node1").glob("worker_*.log")] == ["worker_1.log"]
    for rank in (0, 1):
        got = checkpoint_arrays(out / f"nodes-rank{rank}.ckpt")
        want = checkpoint_arrays(out / f"dp-rank{rank}.ckpt")
        assert got.keys() == want.keys()
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"rank {rank}: {name}")
        assert _losses(out, "nodes", rank) == _losses(out, "dp", rank)


@pytest.mark.slow
def test_ranks_that_resume_from_different_steps_stop_with_a_clear_error(single_node):
    out = single_node
    split = _msrun(Cluster(workers=2), out, "split")
    output, _ = split.communicate(timeout=400)
    assert split.returncode != 0
    logs = worker_logs_tail(out / "logs-split-node0")
    assert logs.count("the 2 ranks resumed from different steps") == 2, logs  # both ranks stop
    assert "all: [2, 0]" in logs, logs  # rank 0 resumed at step 2, rank 1 found nothing
    assert not (out / "split-rank0.ckpt").exists() and not (out / "split-rank1.ckpt").exists()


def test_cluster_spreads_workers_evenly_and_refuses_what_msrun_cannot_run(tmp_path):
    two_hosts = Cluster(workers=16, nodes=2, node_rank=1, master_addr="10.0.0.5",
                        master_port=8118)
    assert (two_hosts.local_workers, two_hosts.first_rank, two_hosts.writes_outputs) == (8, 8,
                                                                                          False)
    cmd = msrun_command(two_hosts, tmp_path, tmp_path / "w.py", ["job.json"])
    assert cmd[1:8] == ["--worker_num=16", "--local_worker_num=8", "--node_rank=1",
                        "--master_addr=10.0.0.5", "--master_port=8118", "--cluster_time_out=600",
                        f"--log_dir={tmp_path}"]
    assert cmd[-2:] == [str(tmp_path / "w.py"), "job.json"]
    for bad, message in [
        (dict(workers=3, nodes=2, master_port=8118), "spread evenly"),
        (dict(workers=2, nodes=2, node_rank=2, master_port=8118), "node_rank = 2"),
        (dict(workers=2, nodes=2), "explicit master_port"),
        (dict(workers=2, master_port=80), "1024..65535"),
        (dict(workers=2, master_addr="host; rm -rf /"), "neither an IP address"),
    ]:
        with pytest.raises(ValueError, match=message):
            Cluster(**bad)


def test_ascend_workers_are_bound_to_their_npus_cores_with_a_flag_msrun_parses(
        tmp_path, monkeypatch):
    from mindspore.parallel.cluster import run as msrun

    eight = Cluster(workers=8)
    cpu = msrun_command(eight, tmp_path, tmp_path / "w.py", ["job.json"])
    ascend = msrun_command(eight, tmp_path, tmp_path / "w.py", ["job.json"], device="Ascend")
    assert "--bind_core=True" in ascend and not [a for a in cpu if a.startswith("--bind")]
    monkeypatch.setattr(sys, "argv", ascend)  # msrun 2.10's own parser reads it
    args = msrun.get_args()
    assert args.bind_core is True and args.task_script == str(tmp_path / "w.py")
    assert args.task_script_args == ["job.json"]


# A worker that finishes its work and exits 0, but prints a traceback at shutdown (as libraries do
# from atexit hooks and __del__), and one that fails with exit code 3.
SHUTDOWN_NOISE = textwrap.dedent("""
    import os, sys, traceback
    if os.environ.get("MS_ROLE") == "MS_WORKER":
        try:
            raise RuntimeError("a library's complaint while shutting down")
        except RuntimeError:
            traceback.print_exc()
        if sys.argv[1] == "fail" and os.environ.get("RANK_ID") == "1":
            sys.exit(3)
""")


@pytest.mark.slow  # starts worker processes
def test_a_run_fails_by_a_workers_exit_code_not_by_a_traceback_in_its_log(tmp_path):
    logs = tmp_path / "ok"
    logs.mkdir()
    run_workers(Cluster(workers=2), logs, SHUTDOWN_NOISE, ["ok"], timeout=300)
    assert "Traceback (most recent call last)" in worker_logs_tail(logs)  # noise, not failure
    failing = tmp_path / "fail"
    failing.mkdir()
    with pytest.raises(LaunchError, match="msrun exited 1"):
        run_workers(Cluster(workers=2), failing, SHUTDOWN_NOISE, ["fail"], timeout=300)


# Each worker records the interpreter that runs it.
WHICH_PYTHON = textwrap.dedent("""
    import json, os, sys
    if os.environ.get("MS_ROLE") == "MS_WORKER":
        with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK_ID']}.json"), "w") as f:
            json.dump([sys.executable, sys.prefix], f)
""")


def _another_python_first_on_path(tmp_path: Path, monkeypatch) -> None:
    """PATH as a shell without the venv activated has it: another interpreter's `python` first
    (this venv's base interpreter, linked from outside the venv, so without its packages)."""
    other = tmp_path / "other-bin"
    other.mkdir()
    (other / "python").symlink_to(Path(sys.executable).resolve())
    monkeypatch.setenv("PATH", os.pathsep.join([str(other), os.environ.get("PATH", "")]))


def test_the_workers_python_is_the_interpreter_that_launched_them(tmp_path, monkeypatch):
    _another_python_first_on_path(tmp_path, monkeypatch)
    env = worker_env(tmp_path / "logs")
    probe = subprocess.run(["python", "-c", "import sys; print(sys.executable, sys.prefix)"],
                           env=env, capture_output=True, text=True, check=True)
    assert probe.stdout.split() == [sys.executable, sys.prefix]


@pytest.mark.slow  # starts msrun
def test_msrun_starts_the_workers_with_the_launchers_interpreter(tmp_path, monkeypatch):
    _another_python_first_on_path(tmp_path, monkeypatch)
    logs = tmp_path / "logs"
    logs.mkdir()
    run_workers(Cluster(workers=2), logs, WHICH_PYTHON, [str(tmp_path)], timeout=300)
    for rank in (0, 1):
        ran = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert ran == [sys.executable, sys.prefix], f"rank {rank} ran {ran}"


def test_the_train_stage_refuses_a_cluster_msrun_cannot_start(tmp_path):
    from harness.dvc_workspace import PROJECT_ROOT, run, tool_env

    env = {**tool_env(), "PYTHONPATH": str(PROJECT_ROOT)}
    (tmp_path / "params.yaml").write_text(
        "train:\n  distributed: {workers: 3, nodes: 2, master_port: 8118}\n")
    bad = run(["python", "-m", "stages.train"], cwd=tmp_path, check=False, env=env, timeout=120)
    assert bad.returncode == 1 and "spread evenly" in bad.stderr, bad.stderr
    assert not (tmp_path / "models").exists()  # nothing started, nothing written

"""Data-parallel training through MindSpore's `msrun` launcher, on one host or several.

`launch(job, cluster, log_dir)` writes the job as JSON and runs, on this host,

    msrun --worker_num=W --local_worker_num=W/N --node_rank=R --master_addr=ADDR \\
          --master_port=P --cluster_time_out=T --log_dir=DIR --join=True [--bind_core=True] \\
          DIR/worker.py DIR/job.json

`Cluster` says which part of the job this host runs: W workers in all, spread evenly over N hosts
("nodes"), this one being node R. Every host runs the same command with its own R; msrun on the
host that owns ADDR also starts the scheduler the workers register with (msrun's dynamic cluster:
no rank table). Worker k of node R is global rank R * W/N + k.

Every worker runs `clipms.train.job.run(job, distributed=True)`: `communication.init()` joins the
group (HCCL on Ascend, NCCL on GPU, MindSpore's own CPU collectives here), each rank reads its own
slice of every global batch, gradients are averaged and features all-gathered for the contrastive
loss, and only global rank 0 -- a worker of node 0 -- writes checkpoints and outputs.

On Ascend msrun binds each worker to the CPU cores of its NPU's NUMA node (`--bind_core=True`,
msrun 2.10's `run.py`/`process_entity/_bind.py`: affinity from the device topology, an even split
otherwise): 8 workers with up to 16 decode processes each would otherwise float over every core
of a multi-NUMA host. CPU runs stay unbound (their workers share a few cores).

msrun starts every worker (and its scheduler) as `python SCRIPT ...`, the first `python` on PATH
(`_generate_cmd_args_list` in `process_entity/_utils.py`; msrun 2.10 has no option for another
interpreter). A stage started as `.venv/bin/python -m stages.train` without an activated environment
would get the system's python there, so the launcher puts a folder whose `python` runs this
process's interpreter (`sys.executable`) first on the workers' PATH.

A failed run is msrun's exit code: with `--join=True` msrun polls every worker and exits non-zero
when one exits non-zero (or its scheduler does), killing the others (`join_processes` in
`process_entity/_api.py`). The worker logs are for the message only: a traceback a library prints
at shutdown, after the worker finished its work and exited 0, is not a failure.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shlex
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from clipms.train.job import TrainJob
from clipms.utils.jsonio import write_json

log = logging.getLogger(__name__)

# msrun runs a script path; a two-line script outside the package keeps the package directory off
# sys.path (its module names -- config, data, model -- would shadow others).
_WORKER = "from clipms.parallel.worker import worker_main\nworker_main()\n"
DEFAULT_MASTER_PORT = 8118  # msrun's own default; every node must use the same port
DEFAULT_CLUSTER_TIMEOUT = 600  # s msrun waits for all workers to register (msrun's default)


class LaunchError(RuntimeError):
    """msrun or one of its workers failed; the message carries the tail of the worker logs."""


@dataclass(frozen=True)
class Cluster:
    """Where the data-parallel workers run: `workers` in all, `workers // nodes` on each host."""

    workers: int
    nodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port (one node only)
    cluster_time_out: int = DEFAULT_CLUSTER_TIMEOUT

    def __post_init__(self) -> None:
        if self.workers < 1 or self.nodes < 1:
            raise ValueError(f"workers ({self.workers}) and nodes ({self.nodes}) must be >= 1")
        if self.workers % self.nodes:
            raise ValueError(f"workers = {self.workers} cannot be spread evenly over "
                             f"nodes = {self.nodes} (msrun starts the same number on each host)")
        if not 0 <= self.node_rank < self.nodes:
            raise ValueError(f"node_rank = {self.node_rank} must lie in 0..{self.nodes - 1}")
        if self.nodes > 1 and self.master_port is None:
            raise ValueError("a cluster of several nodes needs an explicit master_port "
                             "(the same on every node)")
        if self.master_port is not None and not 1024 <= self.master_port <= 65535:
            raise ValueError(f"master_port = {self.master_port} must lie in 1024..65535")
        _check_address(self.master_addr)

    @property
    def local_workers(self) -> int:
        return self.workers // self.nodes

    @property
    def first_rank(self) -> int:
        """Global rank of this node's first worker."""
        return self.node_rank * self.local_workers

    @property
    def writes_outputs(self) -> bool:
        """Whether global rank 0 (the only writer) runs on this host."""
        return self.node_rank == 0


def _check_address(addr: str) -> None:
    """msrun takes an IP address or a host name it can resolve; refuse anything else early."""
    try:
        ipaddress.ip_address(addr.strip("[]"))
        return
    except ValueError:
        pass
    labels = addr.split(".")
    if not addr or len(addr) > 253 or not all(
            label and len(label) <= 63 and label.replace("-", "").isalnum() for label in labels):
        raise ValueError(f"master_addr = {addr!r} is neither an IP address nor a host name")


BIND_CORE_DEVICES = ("Ascend",)  # where msrun binds workers to their NPU's cores


def msrun_command(cluster: Cluster, log_dir: Path, script: Path, args: list[str],
                  device: str = "CPU") -> list[str]:
    """The msrun command line that starts this host's share of `cluster` on `device`."""
    exe = shutil.which("msrun") or str(Path(sys.executable).parent / "msrun")
    port = cluster.master_port or free_port()
    bind = ["--bind_core=True"] if device in BIND_CORE_DEVICES else []
    return [exe, f"--worker_num={cluster.workers}", f"--local_worker_num={cluster.local_workers}",
            f"--node_rank={cluster.node_rank}", f"--master_addr={cluster.master_addr}",
            f"--master_port={port}", f"--cluster_time_out={cluster.cluster_time_out}",
            f"--log_dir={log_dir}", "--join=True", *bind, str(script), *args]


def launch(job: TrainJob, cluster: Cluster, log_dir: Path | str,
           timeout: float | None = None) -> None:
    """Run this host's workers of `job` and wait for them; raise LaunchError on failure."""
    _check_workers(cluster)
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    job_file = log_dir / "job.json"
    write_json(job_file, job.to_dict())
    run_workers(cluster, log_dir, _WORKER, [str(job_file)], job.config.runtime.device_target,
                timeout)


def run_workers(cluster: Cluster, log_dir: Path, script_text: str, args: list[str],
                device: str = "CPU", timeout: float | None = None) -> None:
    """Run `script_text` as this host's msrun workers of `cluster` and wait; LaunchError when
    msrun exits non-zero, i.e. when a worker (or the scheduler) did."""
    _check_workers(cluster)
    script = log_dir / "worker.py"
    script.write_text(script_text)
    cmd = msrun_command(cluster, log_dir, script, args, device)
    log.info("launching node %d of %d: %s", cluster.node_rank, cluster.nodes, " ".join(cmd))
    proc = subprocess.run(cmd, env=worker_env(log_dir), capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise LaunchError(f"msrun exited {proc.returncode} (a worker or the scheduler failed)\n"
                          f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}\n"
                          f"{worker_logs_tail(log_dir)}")


def _check_workers(cluster: Cluster) -> None:
    if cluster.workers < 2:
        raise ValueError(f"launch needs at least 2 workers in all, got {cluster.workers}")


def worker_env(log_dir: Path) -> dict[str, str]:
    """This process's environment with the project on PYTHONPATH (the workers import clipms) and
    `python` running this process's interpreter first on PATH (msrun starts `python`)."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env["PATH"] = os.pathsep.join(p for p in (str(python_shim(log_dir)), env.get("PATH")) if p)
    return env


def python_shim(log_dir: Path) -> Path:
    """A folder in `log_dir` whose `python` execs `sys.executable`. A script, not a symlink: a
    venv's interpreter finds its site-packages from the path it is started by (pyvenv.cfg beside
    it), which a symlink elsewhere would lose."""
    folder = Path(log_dir) / "bin"
    folder.mkdir(parents=True, exist_ok=True)
    shim = folder / "python"
    shim.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} \"$@\"\n")
    shim.chmod(0o755)
    return folder


def worker_logs_tail(log_dir: Path, chars: int = 3000) -> str:
    parts = []
    for path in sorted(Path(log_dir).glob("worker_*.log")):
        parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-chars:]}")
    return "\n".join(parts)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])

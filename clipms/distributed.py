"""Data-parallel training through MindSpore's `msrun` launcher.

`launch(job, workers)` writes the job as JSON and runs

    msrun --worker_num=N --local_worker_num=N --master_addr=127.0.0.1 --master_port=P \\
          --log_dir=DIR --join=True DIR/worker.py DIR/job.json

Every worker runs `clipms.train_job.run(job, distributed=True)`: `communication.init()` joins the
group (HCCL on Ascend, NCCL on GPU, MindSpore's own CPU collectives here; no rank table with
msrun), each rank reads its own slice of every global batch, gradients are averaged and features
all-gathered for the contrastive loss, and only rank 0 writes checkpoints and outputs.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from clipms.jsonio import read_json, write_json
from clipms.train_job import TrainJob

log = logging.getLogger(__name__)

# msrun runs a script path; a two-line script outside the package keeps the package directory off
# sys.path (its module names -- config, data, model -- would shadow others).
_WORKER = "from clipms.distributed import worker_main\nworker_main()\n"


class LaunchError(RuntimeError):
    """msrun or one of its workers failed; the message carries the tail of the worker logs."""


def msrun_command(workers: int, log_dir: Path, script: Path, args: list[str],
                  port: int | None = None, nodes_host: str = "127.0.0.1") -> list[str]:
    """The msrun command line for `workers` processes on this host (one per device)."""
    exe = shutil.which("msrun") or str(Path(sys.executable).parent / "msrun")
    return [exe, f"--worker_num={workers}", f"--local_worker_num={workers}",
            f"--master_addr={nodes_host}", f"--master_port={port or free_port()}",
            f"--log_dir={log_dir}", "--join=True", str(script), *args]


def launch(job: TrainJob, workers: int, log_dir: Path | str, timeout: float | None = None) -> None:
    """Run `job` on `workers` data-parallel processes and wait; raise LaunchError on failure."""
    if workers < 2:
        raise ValueError(f"launch needs at least 2 workers, got {workers}")
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    job_file, script = log_dir / "job.json", log_dir / "worker.py"
    write_json(job_file, job.to_dict())
    script.write_text(_WORKER)
    cmd = msrun_command(workers, log_dir, script, [str(job_file)])
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    log.info("launching: %s", " ".join(cmd))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or _worker_failed(log_dir):
        raise LaunchError(f"msrun exited {proc.returncode}\n{proc.stdout[-2000:]}\n"
                          f"{proc.stderr[-2000:]}\n{worker_logs_tail(log_dir)}")


def worker_main(argv: list[str] | None = None) -> None:
    """Entry point of one msrun worker: `worker.py JOB_JSON`."""
    from clipms.train_job import run

    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True,
                        format="%(asctime)s %(name)s: %(message)s")
    job = TrainJob.from_dict(read_json(argv[0]))
    run(job, distributed=True)


def worker_logs_tail(log_dir: Path, chars: int = 3000) -> str:
    parts = []
    for path in sorted(Path(log_dir).glob("worker_*.log")):
        parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-chars:]}")
    return "\n".join(parts)


def _worker_failed(log_dir: Path) -> bool:
    # msrun's own exit code already reflects failed workers; this also catches a Python traceback
    # in a worker that msrun reported as finished.
    return any("Traceback (most recent call last)" in p.read_text(errors="replace")
               for p in Path(log_dir).glob("worker_*.log"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])

"""What a command costs: wall time, CPU time, peak memory and bytes written, for the command and
every process under it (benchmarks/rehearsal.py measures each pipeline stage with it).

    python benchmarks/stage_clock.py --out clock.json -- python -m stages.shard

`measure(cmd)` runs `cmd` as a child and reaps it with `wait4`, whose resource usage covers the
child and every descendant it waited for (img2dataset's workers, the shard stage's pool, DVC's
stage command): CPU time, and `ru_maxrss`, the peak RSS of the largest single process. The sum of
the RSS of all the tree's processes at once is sampled (`sample_s`), so that worker pools show
with their real footprint (an upper bound: pages shared after fork count once per process).
Bytes written are the kernel's `write_bytes` I/O accounting (what was sent to the block layer)
of the reaped tree, read from this process's /proc/self/io, to which Linux adds every reaped
child's; the command's own output folders are measured apart by the caller.

As a wrapper (`main`) it runs the command after `--` and writes those figures as JSON to `--out`:
placed in front of a DVC stage's command, it separates the stage's own cost from DVC's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass
class Cost:
    """What one run of a command cost (its whole process tree)."""

    exit_code: int
    wall_s: float
    cpu_s: float  # user + system, the command and every descendant it reaped
    peak_rss_mb: float  # the largest single process (the kernel's ru_maxrss)
    peak_tree_rss_mb: float  # the tree's RSS summed, sampled (0.0 when not sampled)
    written_mb: float  # write_bytes (block-layer writes) of the reaped tree
    processes: int  # the most processes seen in the tree at once (sampled)

    def as_dict(self) -> dict[str, Any]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}


def io_bytes_written() -> int:
    """write_bytes of this process, its threads and every child it reaped (Linux /proc)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == "write_bytes":
            return int(value)
    raise RuntimeError("/proc/self/io has no write_bytes (kernel without task I/O accounting)")


class TreeSampler(threading.Thread):
    """Samples the summed RSS of a process and its descendants until stopped."""

    def __init__(self, pid: int, interval: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak_bytes, self.most_processes = 0, 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self._stop_event.wait(self.interval):
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            total = 0
            for proc in tree:
                try:
                    total += proc.memory_info().rss
                except psutil.NoSuchProcess:
                    continue
            self.peak_bytes = max(self.peak_bytes, total)
            self.most_processes = max(self.most_processes, len(tree))

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)


def measure(cmd: Sequence[str], sample_s: float | None = 0.5, **popen: Any) -> Cost:
    """Run `cmd` (Popen keyword arguments in `popen`) to its end and return what it cost. When
    this is interrupted (a signal, Ctrl-C) the command is killed - with everything it started
    when it runs in a session of its own (`start_new_session=True`)."""
    written, started = io_bytes_written(), time.perf_counter()
    proc = subprocess.Popen(list(cmd), **popen)
    sampler = TreeSampler(proc.pid, sample_s) if sample_s else None
    if sampler:
        sampler.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:
        if popen.get("start_new_session"):
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
        proc.wait()
        raise
    finally:
        if sampler:
            sampler.stop()
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    return Cost(exit_code=proc.returncode, wall_s=time.perf_counter() - started,
                cpu_s=usage.ru_utime + usage.ru_stime, peak_rss_mb=usage.ru_maxrss / 1024,
                peak_tree_rss_mb=(sampler.peak_bytes if sampler else 0) / 2**20,
                written_mb=(io_bytes_written() - written) / 2**20,
                processes=sampler.most_processes if sampler else 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="where the JSON figures go")
    parser.add_argument("--sample-s", type=float, default=0.5,
                        help="seconds between samples of the tree's summed RSS (0: none)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command to run")
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("no command given after --")
    cost = measure(cmd, args.sample_s or None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cmd": cmd, **cost.as_dict()}, indent=2) + "\n")
    return cost.exit_code if cost.exit_code >= 0 else 128 - cost.exit_code


if __name__ == "__main__":
    sys.exit(main())

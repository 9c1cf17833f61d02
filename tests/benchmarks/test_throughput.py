"""The throughput benchmarks (benchmarks/throughput/: one module per subcommand family):
`python -m benchmarks.throughput` reaches every subcommand, and importing it loads no MindSpore
(benchmarks/openclip_peer.py imports its inputs and timer in a venv without it)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import time

import pytest

from harness.dvc_workspace import PROJECT_ROOT

SUBCOMMANDS = {"encode", "forward", "retrieval", "loader", "train"}


def test_python_m_reaches_every_subcommand():
    bench = importlib.import_module("benchmarks.throughput")
    assert set(bench.SUBCOMMANDS) == SUBCOMMANDS
    for command in sorted(SUBCOMMANDS):
        out = subprocess.run([sys.executable, "-m", "benchmarks.throughput", command, "--help"],
                             cwd=PROJECT_ROOT, capture_output=True, text=True, check=True)
        usage = f"usage: python -m benchmarks.throughput {command}"
        assert out.stdout.startswith(usage), out.stdout


def test_importing_the_benchmarks_loads_no_mindspore():
    code = ("import sys; "
            "from benchmarks.throughput import random_images, random_tokens, time_steps; "
            "print('mindspore' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "False"


def busy(seconds: float) -> None:
    """Spend `seconds` of this process's CPU time."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_timed_steps_leave_the_warm_up_out_and_the_mean_counts_every_interruption():
    from benchmarks.throughput.common import timed_steps

    sleeps = iter([0.0, 0.0] + [0.01] * 7 + [0.2])  # two warm-up steps, then 8 timed

    def step() -> None:
        pause = next(sleeps)
        if pause == 0.0:
            busy(0.3)  # the warm-up: a compile's CPU time
        time.sleep(pause)

    run = timed_steps(step, warmup=2, steps=8)
    assert len(run.times_ms) == 8
    assert run.cpu_s < 0.1  # the warm-up's 0.6 CPU s are not in it; the timed steps sleep
    assert run.cpu_ms_per_item(4) == run.cpu_s * 1000 / 32
    assert 9.0 <= run.median_ms < 60.0  # the median step is a 10 ms one
    assert run.wall_s >= 0.27  # 7 x 10 ms + 200 ms
    assert run.mean_rate(4) == 32 / run.wall_s < run.median_rate(4) / 2  # the 200 ms step counts


def test_a_step_count_below_one_is_refused_not_rounded_up():
    from benchmarks.throughput.common import time_steps, timed_steps

    calls: list[int] = []
    for timer in (time_steps, timed_steps):
        with pytest.raises(ValueError, match="steps must be >= 1, got 0"):
            timer(lambda: calls.append(1), 1, 0)
    assert calls == []  # refused before the warm-up ran

"""A flow run with overrides that is killed mid-run (a worker crash) leaves the checkout untouched:
the real `clip-pipeline` flow on the session's Prefect server, in a toy checkout
whose one stage is slow; the process is SIGKILLed while the stage runs in the private worktree."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from flows.worktree import PREFIX, remove_stale
from harness import prefect_server
from harness.dvc_workspace import run
from harness.prefect_server import PrefectStack

pytestmark = pytest.mark.slow
prefect_stack = prefect_server.prefect_stack  # the session fixture (shared with test_flows_deploy)
PY = sys.executable
SLOW = {"cmd": f"{PY} -c \"import pathlib, time; pathlib.Path('started').write_text('x'); "
               "time.sleep(${slow.seconds}); pathlib.Path('out.txt').write_text('done')\"",
        "params": ["slow"], "outs": ["out.txt"]}


def private_worktrees(checkout: Path) -> list[Path]:
    listing = run(["git", "worktree", "list", "--porcelain"], checkout).stdout
    return [Path(line.split(" ", 1)[1]) for line in listing.splitlines()
            if line.startswith("worktree ") and PREFIX in line]


def test_a_killed_override_run_leaves_the_checkout_untouched(prefect_stack: PrefectStack,
                                                             tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "params.yaml").write_text(yaml.safe_dump({"slow": {"seconds": 0}}))
    (checkout / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"slow": SLOW}}))
    run(["git", "init", "-q", "-b", "main"], checkout)
    run([PY, "-m", "dvc", "init", "-q"], checkout)
    run(["git", "add", "-A"], checkout)
    run(["git", "-c", "user.email=t@clipms", "-c", "user.name=t", "commit", "-qm", "toy"],
        checkout)
    params_before = (checkout / "params.yaml").read_bytes()

    code = ("from flows.pipeline import clip_pipeline\n"
            "clip_pipeline(overrides={'slow.seconds': 300})\n")
    proc = subprocess.Popen([PY, "-c", code], cwd=checkout, env=prefect_stack.env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not any((w / "started").exists() for w in private_worktrees(checkout)):
            assert proc.poll() is None, proc.communicate()[0].decode()[-3000:]
            assert time.monotonic() < deadline, "the slow stage never started"
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGKILL)  # the worker, the flow run and the stage: all gone
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

    assert (checkout / "params.yaml").read_bytes() == params_before
    assert run(["git", "status", "--porcelain"], checkout).stdout == ""
    assert not (checkout / "started").exists() and not (checkout / "out.txt").exists()
    [left] = private_worktrees(checkout)  # what the next override run on this checkout removes
    assert remove_stale(checkout) == [left] and not private_worktrees(checkout)

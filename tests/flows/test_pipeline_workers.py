"""Several Prefect workers on one pool: two real `prefect worker start` processes
(`--limit 1` each, as two machines with one slot each) serve the `clipms` process pool of a real
server; two deployment runs started together land on both workers and still never overlap on the
one checkout (the flow's one-slot global concurrency limit per checkout, flows/pipeline.py), while
runs of two checkouts (a second deployment, deployed from a second copy) run side by side."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from flows.pipeline import lock_name
from harness.dvc_workspace import make_workspace
from harness.prefect_server import deployed
from harness.prefect_workers import MultiWorkerStack

pytestmark = pytest.mark.slow
WORKERS = ("clipms-worker-a", "clipms-worker-b")
MANUAL = "clip-pipeline/manual"
SECOND = "manual-second-checkout"  # the manual deployment, deployed from the second checkout
PARAMS = {"stages": ["metadata"], "force": True}  # a real stage run, a few seconds each


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MultiWorkerStack]:
    with deployed(tmp_path_factory.mktemp("two-workers"), MultiWorkerStack,
                  names=WORKERS) as stack:
        yield stack


SLACK = timedelta(seconds=5)


def locked_interval(stack: MultiWorkerStack, run_id: str) -> tuple[datetime, datetime]:
    """From the first to the last moment the run's tasks ran under the workspace lock (`plan`
    runs before the lock is taken)."""
    tasks = [t for t in stack.task_runs(run_id) if not t["name"].startswith("plan")]
    starts = [datetime.fromisoformat(t["start_time"]) for t in tasks if t["start_time"]]
    ends = [datetime.fromisoformat(t["end_time"]) for t in tasks if t["end_time"]]
    assert starts and ends, tasks
    return min(starts), max(ends)


def plan_end(stack: MultiWorkerStack, run_id: str) -> datetime:
    """When the run's `plan` task (the part before the workspace lock) ended."""
    ends = [datetime.fromisoformat(t["end_time"]) for t in stack.task_runs(run_id)
            if t["name"].startswith("plan") and t["end_time"]]
    assert ends, stack.task_runs(run_id)
    return max(ends)


def test_two_workers_take_runs_started_together_without_overlap(stack: MultiWorkerStack) -> None:
    run_ids = [stack.run_deployment(MANUAL, PARAMS) for _ in WORKERS]
    runs = {rid: stack.wait(rid, timeout=600) for rid in run_ids}
    for rid, run in runs.items():
        assert run["state_type"] == "COMPLETED", stack.logs(rid)[-4000:]
    # each worker ran one of them (the worker records its name on the flow runs it submits)
    ran_on = sorted(run["labels"].get("prefect.worker.name") for run in runs.values())
    assert ran_on == sorted(WORKERS), [run["labels"] for run in runs.values()]
    # ... and they took turns on the checkout
    (a_start, a_end), (b_start, b_end) = sorted(locked_interval(stack, rid) for rid in run_ids)
    assert a_end <= b_start, f"runs overlapped: {a_start}-{a_end} and {b_start}-{b_end}"
    limit = stack.api("GET", f"/v2/concurrency_limits/{lock_name(stack.workspace)}")
    assert (limit["limit"], limit["active_slots"]) == (1, 0)


def deploy_second_checkout(stack: MultiWorkerStack, root: Path) -> Path:
    """A second copy of the project whose `manual` deployment is renamed SECOND and deployed from
    there, so its runs work in that copy (prefect.yaml's default pull step)."""
    second = make_workspace(root)
    prefect_yaml = second / "prefect.yaml"
    text = prefect_yaml.read_text()
    assert text.count("  - name: manual\n") == 1
    prefect_yaml.write_text(text.replace("  - name: manual\n", f"  - name: {SECOND}\n"))
    proc = subprocess.run(["prefect", "--no-prompt", "deploy", "--name", SECOND], cwd=second,
                          env=stack.env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    return second


def test_runs_of_two_checkouts_run_side_by_side_on_the_two_workers(
        stack: MultiWorkerStack, tmp_path: Path) -> None:
    second = deploy_second_checkout(stack, tmp_path / "second")
    run_ids = [stack.run_deployment(MANUAL, PARAMS),
               stack.run_deployment(f"clip-pipeline/{SECOND}", PARAMS)]
    runs = [stack.wait(rid, timeout=600) for rid in run_ids]
    for rid, run in zip(run_ids, runs, strict=True):
        assert run["state_type"] == "COMPLETED", stack.logs(rid)[-4000:]
    assert sorted(run["labels"].get("prefect.worker.name") for run in runs) == sorted(WORKERS)
    # each checkout has its own lock, so neither waited for the other: a run whose plan ended
    # while the other held its lock, with more than SLACK of it left, started its own locked part
    # before the other's ended (under load a worker may pick its run up only after the other
    # finished: nothing to wait for then). SLACK is what taking an uncontended lock and starting
    # the first task may take on a loaded machine; one shared lock makes the second run wait out
    # the first's whole locked part.
    locked = [locked_interval(stack, rid) for rid in run_ids]
    planned = [plan_end(stack, rid) for rid in run_ids]
    for me, other in ((0, 1), (1, 0)):
        if locked[other][0] <= planned[me] < locked[other][1] - SLACK:
            assert locked[me][0] < locked[other][1], (
                f"runs of two checkouts took turns: locked {locked[me]} after {locked[other]}")
    assert lock_name(second) != lock_name(stack.workspace)
    # ... and each ran in its own checkout (the second one's first dvc.lock is this run's)
    assert "metadata:" in (second / "dvc.lock").read_text()
    for rid, checkout in zip(run_ids, (stack.workspace, second), strict=True):
        assert f"`{checkout}`" in stack.artifact(rid, "clip-pipeline-summary")["data"]

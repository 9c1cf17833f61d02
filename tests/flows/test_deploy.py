"""The deployments end to end: a real Prefect server, a process work pool and worker,
`prefect deploy` from prefect.yaml, and `prefect deployment run` on a tiny synthetic workspace.

One server, one worker and one workspace serve every test here (tests run in file order and build
on each other's workspace state, as a platform engineer's runs would). The pipeline is whatever
dvc.yaml holds; checks on later stages (metrics, registry) apply when those stages exist.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from flows import dvc_cli
from flows.pipeline import ARTIFACT_KEY
from flows.summary import SKIPPED_NO_DATA, UP_TO_DATE
from harness import prefect_server
from harness.dvc_workspace import run
from harness.prefect_server import PrefectStack

pytestmark = pytest.mark.slow
MANUAL = "clip-pipeline/manual"
STATE: dict[str, Any] = {}  # what earlier tests learned, for later ones
prefect_stack = prefect_server.prefect_stack  # the module fixture (pytest finds it by this name)


def _artifact(stack: PrefectStack, run_id: str) -> str:
    return str(stack.artifact(run_id, ARTIFACT_KEY)["data"])


def _stage_tasks(stack: PrefectStack, run_id: str) -> list[dict[str, Any]]:
    """Task runs of the stages, in start order (plan/status/summary tasks left out)."""
    stages = set(dvc_cli.declared_stages(stack.workspace))
    runs = [t for t in stack.task_runs(run_id) if t["name"] in stages]
    return sorted(runs, key=lambda t: t["start_time"] or "")


def _interval(stack: PrefectStack, run_id: str) -> tuple[datetime, datetime]:
    """From the first to the last moment a run's tasks ran while holding the workspace lock."""
    tasks = [t for t in stack.task_runs(run_id) if not t["name"].startswith("plan")]
    starts = [datetime.fromisoformat(t["start_time"]) for t in tasks if t["start_time"]]
    ends = [datetime.fromisoformat(t["end_time"]) for t in tasks if t["end_time"]]
    return min(starts), max(ends)


def _mlflow_runs(stack: PrefectStack) -> int | None:
    """Runs in the workspace's MLflow database (its tracking URI), None before it exists."""
    db = stack.workspace / "mlflow.db"
    if not db.exists():
        return None
    with contextlib.closing(sqlite3.connect(db)) as conn:
        tables = {row[0] for row in conn.execute("select name from sqlite_master")}
        return int(conn.execute("select count(*) from runs").fetchone()[0]) \
            if "runs" in tables else None


def _broken_param() -> tuple[str, str]:
    """An integer param of the latest stage that reads one, set to a string (validation error)."""
    for key in ("evaluate.batch_size", "train.batch_size", "tokenizer.vocab_size",
                "metadata.num_images"):
        if key.split(".")[0] in STATE["order"]:
            return key, key.split(".")[0]
    raise AssertionError(f"no known integer param among stages {STATE['order']}")


def test_deployments_from_prefect_yaml(prefect_stack: PrefectStack) -> None:
    nightly = prefect_stack.api("GET", "/deployments/name/clip-pipeline/nightly")
    manual = prefect_stack.api("GET", "/deployments/name/clip-pipeline/manual")
    declared = {d["name"]: d for d in yaml.safe_load(
        (prefect_stack.workspace / "prefect.yaml").read_text())["deployments"]}
    [schedule] = nightly["schedules"]
    assert schedule["schedule"]["cron"] == "0 2 * * *"
    assert schedule["schedule"]["timezone"] == declared["nightly"]["schedules"][0]["timezone"]
    assert nightly["parameters"] == {"refresh": ["metadata"], "train_without_new_data": False}
    assert manual["schedules"] == []
    for deployment in (manual, nightly):
        assert deployment["work_pool_name"] == "clipms"
        [step] = deployment["pull_steps"]
        directory = step["prefect.deployments.steps.set_working_directory"]["directory"]
        assert directory == str(prefect_stack.workspace.resolve())
    pool = prefect_stack.api("GET", "/work_pools/clipms")
    assert pool["type"] == "process"


def test_serve_refuses_to_take_over_work_pool_deployments(prefect_stack: PrefectStack) -> None:
    proc = prefect_stack.cli(["python", "-m", "flows.serve"], timeout=120, check=False)
    assert proc.returncode != 0
    assert "already deployed to a work pool" in proc.stderr, proc.stderr[-2000:]
    assert "prefect deployment delete 'clip-pipeline/manual'" in proc.stderr


def test_manual_run_completes_and_publishes_metrics(prefect_stack: PrefectStack) -> None:
    STATE["order"] = dvc_cli.stage_order(prefect_stack.workspace)
    run_id = prefect_stack.run_deployment(MANUAL, {"force": False})
    flow_run = prefect_stack.wait(run_id, timeout=900)
    assert flow_run["state_type"] == "COMPLETED", prefect_stack.logs(run_id)[-4000:]
    STATE["first_seconds"] = flow_run["total_run_time"]
    tasks = _stage_tasks(prefect_stack, run_id)
    assert [t["name"] for t in tasks] == STATE["order"]  # one task per stage, in DVC's order
    assert all(t["state_type"] == "COMPLETED" for t in tasks)
    artifact = _artifact(prefect_stack, run_id)
    assert f"updated {', '.join(STATE['order'])}" in artifact
    eval_json = prefect_stack.workspace / "metrics/eval.json"
    if "evaluate" in STATE["order"]:
        metrics = json.loads(eval_json.read_text())
        assert metrics and all(f"| {key} |" in artifact for key in metrics
                               if not isinstance(metrics[key], dict | list))
    if "register" in STATE["order"]:
        decision = json.loads((prefect_stack.workspace / "metrics/register.json").read_text())
        assert "From `metrics/register.json`" in artifact
        assert all(f"| {key} |" in artifact for key, value in decision.items()
                   if not isinstance(value, dict | list))
        if decision.get("run_id"):
            assert decision["run_id"] in artifact.split("## MLflow run")[1]


def test_broken_param_fails_with_the_validation_message(prefect_stack: PrefectStack) -> None:
    key, stage = _broken_param()
    params_before = (prefect_stack.workspace / "params.yaml").read_text()
    run_id = prefect_stack.run_deployment(MANUAL, {"overrides": {key: "many"}})
    flow_run = prefect_stack.wait(run_id, timeout=600)
    assert flow_run["state_type"] == "FAILED"
    logs = prefect_stack.logs_containing(run_id, f"invalid '{stage}' params", f"{key} = 'many'")
    assert f"invalid '{stage}' params" in logs and f"{key} = 'many'" in logs, logs[-4000:]
    ran = [t["name"] for t in _stage_tasks(prefect_stack, run_id)]
    assert ran[-1] == stage and not set(STATE["order"][STATE["order"].index(stage) + 1:]) & set(
        ran), ran  # the stages after the failing one never started
    assert (prefect_stack.workspace / "params.yaml").read_text() == params_before
    assert "failed at stage" in _artifact(prefect_stack, run_id)
    notices = [n for n in prefect_stack.webhook.received if n["flow_run_id"] == run_id]
    assert notices and f"{key} = 'many'" in notices[0]["message"]
    STATE["failed_stage"] = stage


def test_runs_started_together_do_not_overlap(prefect_stack: PrefectStack) -> None:
    """A manual and a nightly run at once, after the failed run: they take turns on the workspace,
    and both find everything up to date - the failed run had overrides, so it ran in a private
    worktree (flows/worktree.py) and left the checkout exactly as it was. The nightly run, finding
    no new data, does not train and says so in one notice."""
    manual = prefect_stack.run_deployment(MANUAL, {"stages": None})
    nightly = prefect_stack.run_deployment("clip-pipeline/nightly")
    runs = {rid: prefect_stack.wait(rid, timeout=600) for rid in (manual, nightly)}
    assert all(r["state_type"] == "COMPLETED" for r in runs.values()), runs
    (a_start, a_end), (b_start, b_end) = sorted(_interval(prefect_stack, r) for r in runs)
    assert a_end <= b_start, f"runs overlapped: {a_start}-{a_end} and {b_start}-{b_end}"
    outcomes = {rid: _outcomes(_artifact(prefect_stack, rid)) for rid in runs}
    # the nightly run always refreshes metadata; the synthetic source reproduces the same file
    assert outcomes[nightly]["metadata"] == "ran (forced), outputs unchanged"
    for rid in runs:
        assert all(_idle(outcome) for outcome in outcomes[rid].values()), outcomes[rid]
    assert _artifact(prefect_stack, manual).splitlines()[0].endswith(f": {UP_TO_DATE}")
    if "train" in STATE["order"]:
        assert outcomes[nightly]["train"] == SKIPPED_NO_DATA
        assert _artifact(prefect_stack, nightly).splitlines()[0].endswith(
            ": no new data: nothing trained")
        notices = [n for n in prefect_stack.webhook.received if n["flow_run_id"] == nightly]
        assert [n["kind"] for n in notices] == ["no new data"], notices


def _outcomes(artifact: str) -> dict[str, str]:
    """{stage: outcome} from the summary's stage table."""
    rows = [line.split(" | ") for line in artifact.splitlines() if line.startswith("| ")]
    return {row[0][2:]: row[1] for row in rows if row[0][2:] in STATE["order"]}


def _idle(outcome: str) -> bool:
    return outcome in (UP_TO_DATE, "ran (forced), outputs unchanged", SKIPPED_NO_DATA)


def test_overrides_run_is_its_own_experiment(prefect_stack: PrefectStack) -> None:
    key, value = ("train.lr", 1.0e-3) if "train" in STATE["order"] else ("metadata.seed", 1)
    stage = key.split(".")[0]
    params_before = (prefect_stack.workspace / "params.yaml").read_text()
    runs_before = _mlflow_runs(prefect_stack)
    run_id = prefect_stack.run_deployment(MANUAL, {"overrides": {key: value}})
    flow_run = prefect_stack.wait(run_id, timeout=900)
    assert flow_run["state_type"] == "COMPLETED", prefect_stack.logs(run_id)[-4000:]
    artifact = _artifact(prefect_stack, run_id)
    assert f": updated {stage}" in artifact.splitlines()[0], artifact
    name = f"clip-{run_id}"  # the flow run's id: unique, unlike its generated name
    assert f"DVC experiment `{name}`" in artifact
    shown = run(["dvc", "exp", "show", "--no-pager", "--json"], prefect_stack.workspace).stdout
    assert name in shown
    assert (prefect_stack.workspace / "params.yaml").read_text() == params_before
    if runs_before is not None:  # once the pipeline tracks to MLflow: a run of its own
        assert (_mlflow_runs(prefect_stack) or 0) > runs_before


def test_network_stage_retries_transient_failures_only(prefect_stack: PrefectStack,
                                                        tmp_path: Path) -> None:
    """The real retry policy of `metadata`/`download` in a flow on this server, on a toy project
    whose `metadata` fails once (a 503) and whose `download` has a params error (the retry delay
    is set to 0 here; the count and the retry condition are the flow's own)."""
    from prefect import flow
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    from flows.pipeline import stage_task

    # each script counts its attempts in a file DVC does not manage
    (tmp_path / "source.py").write_text(
        "import pathlib, sys\n"
        "tries = pathlib.Path('tries-metadata')\n"
        "tries.write_text(tries.read_text() + 'x' if tries.exists() else 'x')\n"
        "if tries.read_text() == 'x':\n"
        "    sys.exit('HTTP 503 from the source')\n"
        "pathlib.Path('m.txt').write_text('ok')\n")
    (tmp_path / "broken.py").write_text(
        "import pathlib, sys\n"
        "tries = pathlib.Path('tries-download')\n"
        "tries.write_text(tries.read_text() + 'x' if tries.exists() else 'x')\n"
        "sys.exit(\"params.yaml: invalid 'download' params\")\n")
    stages = {"metadata": {"cmd": "python source.py", "outs": ["m.txt"]},
              "download": {"cmd": "python broken.py", "outs": ["d.txt"]}}
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}))
    run(["git", "init", "-q"], tmp_path)
    run(["dvc", "init", "-q"], tmp_path)

    @flow
    def probe(stage: str) -> dict[str, Any]:
        return stage_task(stage).with_options(retry_delay_seconds=0)(tmp_path, stage)

    with temporary_settings({PREFECT_API_URL: prefect_stack.api_url,
                             PREFECT_HOME: prefect_stack.home}):
        assert probe("metadata")["outcome"] == "ran"
        with pytest.raises(dvc_cli.DvcError, match="params.yaml: invalid 'download' params"):
            probe("download")
        # send this process's logs and events while the server is still up, not at exit
        APILogWorker.drain_all(timeout=15)
        EventsWorker.drain_all(timeout=15)
    assert (tmp_path / "tries-metadata").read_text() == "xx"  # failed once, retried once
    assert (tmp_path / "tries-download").read_text() == "x"   # a params error: no retry

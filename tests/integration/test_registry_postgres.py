"""MLflow on a real database: a real PostgreSQL (harness/postgres_server.py, 127.0.0.1)
under a real `mlflow server` whose artifacts are proxied (`--artifacts-destination` +
`--serve-artifacts`: the client sees only `mlflow-artifacts:` URIs). The register stage, the gate
and the champion lookup run against it; two registrations from two "machines" race; the journal
replays after the tracking server was down. The database asks for a password, which the MLflow
server reads from a libpq password file: it is in no command line, log or client.

Two machines on one host: the gate's machine-wide lock (`registry.gatelock`, a remote server
without Prefect) is a file in `CLIPMS_LOCK_DIR`; giving each register process a lock folder of its
own is exactly what two hosts are to that lock. With a Prefect API the lock is the server's global
concurrency limit, which both processes share whatever their folders.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import chdir
from pathlib import Path

import pytest

from harness import register_workspace
from harness.fault_proxy import FaultProxy, Rule
from harness.postgres_server import MlflowOnPostgres, PostgresServer
from harness.prefect_server import PrefectStack
from harness.prefect_workers import start_server
from harness.register_workspace import (
    ALIAS,
    prepare_workspace,
    read_run_id,
    register_in,
    scores,
    train_like,
    write_pipeline_state,
)
from tracking import run as tracking_run
from tracking import settings
from tracking.callback import TrainCallback
from tracking.files import FILES

pytestmark = pytest.mark.slow
bundle = register_workspace.bundle  # module fixture: a real tiny MindIR export bundle
HOLD_S = 20.0  # how long the race's proxies hold an answer back, at most


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    server = PostgresServer().start()
    try:
        yield server
    finally:
        server.remove()


@pytest.fixture(scope="module")
def tracking_server(postgres: PostgresServer,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowOnPostgres]:
    server = MlflowOnPostgres(tmp_path_factory.mktemp("mlflow-on-postgres"), postgres)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def prefect(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectStack]:
    """A bare Prefect server: the gate's Prefect lock needs only an API. (The module fixture
    `prefect_stack` would deploy and start a worker too.)"""
    stack = start_server(tmp_path_factory.mktemp("prefect-home"))
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def server(tracking_server: MlflowOnPostgres, tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> MlflowOnPostgres:
    """The server, up (a test that took it away may have failed before bringing it back), as this
    process's tracking URI; no Prefect API (an empty Prefect home: no profile's URL either)."""
    if tracking_server.postgres.proc is None:
        tracking_server.postgres.start()
    if tracking_server.proc is None:
        tracking_server.start()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_server.uri)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "no-prefect"))
    return tracking_server


def pipeline_run(root: Path, bundle: Path, score: float, model: str) -> dict:
    """One pipeline run as the stages leave it (train's run, evaluate's metrics), then the real
    register stage, in-process."""
    eval_metrics = {"i2t_R@1": score / 2, "i2t_R@5": score, "mAP@10": score / 3, "images": 10}
    prepare_workspace(root, bundle, eval_metrics, model, train_params={"lr": score})
    code, record = register_in(root)
    assert code == 0 and record is not None
    return record


def test_register_gate_and_champion_lookup_on_postgres(server: MlflowOnPostgres, bundle: Path,
                                                       tmp_path: Path) -> None:
    import mlflow

    model = "pg-gate"
    first = pipeline_run(tmp_path / "run1", bundle, 0.50, model=model)
    better = pipeline_run(tmp_path / "run2", bundle, 0.60, model=model)
    assert [(r["version"], r["alias"]) for r in (first, better)] == [
        (1, "champion"), (2, "champion")]
    assert better["champion_version"] == "1" and better["lock"] == "machine"

    client = settings.client()
    champion = client.get_model_version_by_alias(model, "champion")
    assert champion.version == "2" and champion.run_id == better["run_id"]
    # The registry lives in PostgreSQL: the alias row is in its table.
    assert server.postgres.sql(
        f"SELECT version FROM registered_model_aliases WHERE name = '{model}' "
        "AND alias = 'champion'").split() == ["2"]
    # Artifacts go through the server: the client is only ever given mlflow-artifacts: URIs ...
    run = client.get_run(better["run_id"])
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.artifact_location.startswith("mlflow-artifacts:")
    assert run.info.artifact_uri.startswith("mlflow-artifacts:")
    assert champion.source.startswith(("models:/", "mlflow-artifacts:"))
    # ... and the champion's files come back over HTTP, from the server's destination folder.
    local = Path(mlflow.artifacts.download_artifacts(f"models:/{model}@champion",
                                                     dst_path=str(tmp_path / "download")))
    files = {p.name for p in local.rglob("*") if p.is_file()}
    assert {"image_encoder.mindir", "text_encoder.mindir", "MLmodel"} <= files
    stored = {p.name for p in server.artifacts.rglob("*.mindir")}
    assert {"image_encoder.mindir", "text_encoder.mindir"} <= stored


def group_command_lines(pgid: int) -> list[str]:
    """The command lines of every live process in process group `pgid`."""
    lines = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                lines.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, IndexError, ValueError):
            continue  # the process ended meanwhile
    return lines


def test_the_database_password_is_needed_and_never_shown(server: MlflowOnPostgres) -> None:
    """The server logs in with the password file; without it PostgreSQL refuses; the password is
    in no command line of the server's processes and not in its log."""
    import psycopg

    db = server.postgres
    with pytest.raises(psycopg.OperationalError, match="password"):
        psycopg.connect(f"host=127.0.0.1 port={db.port} user=postgres dbname={db.database} "
                        "passfile=/nonexistent connect_timeout=10").close()
    assert server.proc is not None
    command_lines = group_command_lines(server.proc.pid)
    assert any(db.url() in line for line in command_lines), command_lines  # seen: the real ones
    assert not any(db.password in line for line in command_lines)
    assert db.url() in " ".join(server.command()) and db.password not in server.tail(10**7)


def race(server: MlflowOnPostgres, bundle: Path, tmp_path: Path, model: str,
         env: dict[str, str]) -> tuple[dict, dict]:
    """v1 (0.5) is champion; `worse` (0.6) and `better` (0.7) are registered by two processes
    started together, each with its own lock folder (two machines). The proxies make their
    champion lookups interleave: each lookup's answer is held back (at most HOLD_S) until the
    other process has looked too (`better`) or has moved an alias (`worse`), so without a shared
    lock both decide on the stale v1 and `worse`, answered last, overwrites `better`.
    Returns the two register records (worse, better)."""
    fast, slow = FaultProxy(server.uri), FaultProxy(server.uri)
    try:
        code, _ = register_in(prepare_workspace(tmp_path / "v1", bundle, scores(0.5), model))
        assert code == 0
        worse = prepare_workspace(tmp_path / "worse", bundle, scores(0.6), model)
        better = prepare_workspace(tmp_path / "better", bundle, scores(0.7), model)
        looked, moved = threading.Event(), threading.Event()
        slow.on_forwarded.append(lambda method, path: looked.set() if (
            method == "GET" and path.startswith(ALIAS)) else None)
        fast.on_forwarded.append(lambda method, path: moved.set() if (
            method == "POST" and path.startswith(ALIAS)) else None)
        slow.add(Rule("GET", ALIAS, "hold", release=moved, hold_s=HOLD_S))
        fast.add(Rule("GET", ALIAS, "hold", release=looked, hold_s=HOLD_S))
        procs = [start_register(worse, slow.url, tmp_path / "machine-1", env),
                 start_register(better, fast.url, tmp_path / "machine-2", env)]
        outputs = [proc.communicate(timeout=600) for proc in procs]
    finally:
        fast.stop()
        slow.stop()
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, f"{out}\n{err}"
    records = []
    for workspace in (worse, better):
        from clipms.utils.jsonio import read_json

        records.append(read_json(workspace / "metrics" / "register.json"))
        assert records[-1]["run_id"] == read_run_id(workspace)
    return records[0], records[1]


def start_register(workspace: Path, tracking_uri: str, lock_dir: Path,
                   env: dict[str, str]) -> subprocess.Popen[str]:
    full = {**os.environ, **env, "MLFLOW_TRACKING_URI": tracking_uri,
            "CLIPMS_LOCK_DIR": str(lock_dir)}
    return subprocess.Popen([sys.executable, "-m", "stages.register"], cwd=workspace, env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def champion_of(model: str) -> str:
    return str(settings.client().get_model_version_by_alias(model, "champion").version)


def test_two_machines_registering_together_are_serialised_by_prefect(
        server: MlflowOnPostgres, prefect: PrefectStack, bundle: Path, tmp_path: Path) -> None:
    """Also: both create the gate's limit at once (Prefect's upsert is read-then-create; the
    slower create gets 409, which `registry.prefect_limits` absorbs)."""
    model = "pg-race-prefect"
    worse, better = race(server, bundle, tmp_path, model,
                         {"PREFECT_API_URL": prefect.api_url, "PREFECT_HOME": str(prefect.home)})
    assert worse["lock"] == better["lock"] == "prefect"
    assert champion_of(model) == str(better["version"])
    # the gate's limit on the Prefect server: one slot, free again
    limit = prefect.api("GET", f"/v2/concurrency_limits/mlflow-gate-{model}")
    assert (limit["limit"], limit["active_slots"]) == (1, 0)
    # they took turns: the second compared against the first one's result, not the stale v1
    first, second = (worse, better) if worse["champion_version"] == "1" else (better, worse)
    assert first["champion_version"] == "1", (worse, better)
    assert second["champion_version"] == str(first["version"]), (worse, better)


def test_journal_replays_after_the_server_was_down(server: MlflowOnPostgres, bundle: Path,
                                                   tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from clipms.utils.jsonio import write_json

    model = "pg-journal"
    root = tmp_path / "ws"
    root.mkdir()
    write_pipeline_state(root)
    (root / "params.yaml").write_text(
        f"register:\n  model_name: {model}\n  experiment: pg-exp\n  primary_metric: i2t_R@5\n")
    shutil.copytree(bundle, root / "models" / "export")
    for name in ("clip.ckpt", "clip.json", "tokenizer.json"):  # register logs the checkpoint too
        shutil.copy2(bundle.parent / "trained" / name, root / "models" / name)
    metrics = {"i2t_R@1": 0.25, "i2t_R@5": 0.5, "mAP@10": 0.2, "images": 10}
    write_json(root / "metrics" / "eval.json", metrics)
    monkeypatch.chdir(root)

    run = tracking_run.PipelineRun.open("train", {"lr": 1e-3}, FILES)
    train_like(run, 10)
    assert run.flush() and run.run_id and not run.pending
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail fast while it is down
    server.stop()  # mid-run: training goes on, evaluate runs, register cannot
    started = time.monotonic()
    train_like(run, 10, start=11)
    TrainCallback(run).on_train_end({"loss": 0.1})
    assert run.close() is False
    tracking_run.log_stage("evaluate", {"batch_size": 16}, FILES, metrics)
    assert time.monotonic() - started < 120
    code, record = register_in(root)
    assert code == 1 and record is None
    assert "cannot reach the MLflow tracking server" in capsys.readouterr().err
    journal = list(FILES.journal_dir.glob("*.json"))
    assert len(journal) == 1

    server.start()  # the same database: everything sent before the stop is still there
    code, record = register_in(root)  # the next attempt replays the journal, then registers
    assert code == 0 and record is not None
    assert (record["version"], record["alias"], record["run_id"]) == (1, "champion", run.run_id)
    assert not list(FILES.journal_dir.glob("*.json"))
    client = settings.client()
    assert sorted(m.step for m in client.get_metric_history(run.run_id, "loss")) == list(
        range(1, 21))
    data = client.get_run(run.run_id)
    assert data.info.status == "FINISHED"
    assert data.data.metrics["i2t_R_at_5"] == 0.5
    assert data.data.params["evaluate.batch_size"] == "16"
    with chdir(root):
        assert champion_of(model) == "1"

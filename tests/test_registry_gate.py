"""The promotion gate against a real MLflow server behind a fault-injecting loopback proxy: it
fails closed (a 503 or a timeout on the champion lookup fails `register`, no alias moves), respects
a lower-is-better primary metric, and two `register` processes racing leave the better champion.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from registry import settings
from tests import mlflow_server as server_fixtures
from tests import test_registry_server
from tests.fault_proxy import FaultProxy, Rule
from tests.mlflow_server import MlflowServer
from tests.test_registry_server import prepare_workspace, register_in

pytestmark = pytest.mark.slow
ALIAS = "/api/2.0/mlflow/registered-models/alias"  # GET: the gate's champion lookup; POST: a move
mlflow_server = server_fixtures.mlflow_server  # session fixtures, found by name
bundle = test_registry_server.bundle


def scores(i2t_r5: float, mean_rank: float = 10.0) -> dict[str, float]:
    return {"i2t_R@5": i2t_r5, "i2t_mean_rank": mean_rank, "mAP@10": i2t_r5 / 3,
            "num_images": 10, "chance_i2t_R@5": 0.5}


@pytest.fixture
def proxy(mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    if mlflow_server.proc is None:
        mlflow_server.start()
    fault = FaultProxy(mlflow_server.uri)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", fault.url)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    try:
        yield fault
    finally:
        fault.stop()


def champion_version(model: str) -> str | None:
    aliases = settings.client().get_registered_model(model).aliases or {}
    return aliases.get("champion")


@pytest.mark.parametrize("fault", ["503", "timeout"])
def test_a_registry_error_on_the_champion_lookup_fails_closed(
        fault: str, proxy: FaultProxy, bundle: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    model = f"gate-{fault}"
    code, first = register_in(prepare_workspace(tmp_path / "v1", bundle, scores(0.5), model))
    assert code == 0 and first is not None and first["alias"] == "champion"

    better = prepare_workspace(tmp_path / "v2", bundle, scores(0.9), model)
    if fault == "503":
        proxy.add(Rule("GET", ALIAS, "fail", status=503))
    else:  # accepted, never answered: the client's timeout must end it
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        proxy.add(Rule("GET", ALIAS, "hang"))
    started = time.monotonic()
    code, record = register_in(better)
    err = capsys.readouterr().err
    assert code == 1 and record is None
    assert "could not read the current champion" in err and "no alias was moved" in err, err
    assert time.monotonic() - started < 120
    assert any(m == "GET" and p.startswith(ALIAS) for m, p in proxy.seen)  # the fault was hit
    proxy.clear()
    assert champion_version(model) == "1"  # unchanged, although v2 scored higher
    client = settings.client()
    v2 = client.get_model_version(model, "2")
    assert not v2.aliases and not v2.description  # no decision recorded
    run = client.get_run(v2.run_id)
    assert run.info.status == "FAILED" and "could not read" in run.data.tags["error.message"]


def test_a_lower_is_better_primary_metric_promotes_the_lower_value(
        proxy: FaultProxy, bundle: Path, tmp_path: Path) -> None:
    model = "gate-mean-rank"
    records = []
    for name, rank in (("v1", 10.0), ("v2", 12.0), ("v3", 8.0)):
        ws = prepare_workspace(tmp_path / name, bundle, scores(0.5, mean_rank=rank), model,
                               primary_metric="i2t_mean_rank")
        code, record = register_in(ws)
        assert code == 0 and record is not None
        records.append(record)
    assert [r["alias"] for r in records] == ["champion", "challenger", "champion"]
    assert records[1]["direction"] == "lower" and "lower is better" in records[1]["reason"]
    assert champion_version(model) == "3"


def test_a_primary_metric_that_does_not_rank_models_is_refused(
        proxy: FaultProxy, bundle: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    for metric in ("chance_i2t_R@5", "num_images", "i2t_R@50"):
        ws = prepare_workspace(tmp_path / metric, bundle, scores(0.5), "gate-bad-metric",
                               primary_metric=metric)
        code, record = register_in(ws)
        err = capsys.readouterr().err
        assert code == 1 and record is None
        assert f"'{metric}'" in err and "allowed: i2t_R@5 (higher is better)" in err, err
        assert "i2t_mean_rank (lower is better)" in err
    assert not [v for v in settings.client().search_model_versions("name = 'gate-bad-metric'")]


def test_two_registrations_started_together_leave_the_better_champion(
        mlflow_server: MlflowServer, bundle: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A (worse) and B (better) both beat the old champion v1. A's proxy keeps the answer to A's
    champion lookup until B has moved an alias (at most 15 s): without the gate's lock, A then
    decides on the stale champion v1 and overwrites B. With the lock, they take turns."""
    model = "gate-race"
    fast, slow = FaultProxy(mlflow_server.uri), FaultProxy(mlflow_server.uri)
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", fast.url)
        monkeypatch.delenv("PREFECT_API_URL", raising=False)
        code, _ = register_in(prepare_workspace(tmp_path / "v1", bundle, scores(0.5), model))
        assert code == 0
        worse = prepare_workspace(tmp_path / "worse", bundle, scores(0.6), model)
        better = prepare_workspace(tmp_path / "better", bundle, scores(0.7), model)
        moved = threading.Event()
        fast.on_forwarded.append(lambda method, path: moved.set() if (
            method == "POST" and path.startswith(ALIAS)) else None)
        slow.add(Rule("GET", ALIAS, "hold", release=moved, hold_s=15.0))

        lock_dir = tmp_path / "locks"
        procs = [start_register(worse, slow.url, lock_dir),
                 start_register(better, fast.url, lock_dir)]
        outputs = [proc.communicate(timeout=600) for proc in procs]
        for proc, (out, err) in zip(procs, outputs, strict=True):
            assert proc.returncode == 0, f"{out}\n{err}"
            # the stage's own lines only: no MLflow INFO line or download bar of log_model
            assert "Validating input example" not in err and "Downloading artifacts" not in err
    finally:
        fast.stop()
        slow.stop()
    client = settings.client()
    versions = {v.run_id: v.version for v in client.search_model_versions(f"name = '{model}'")}
    better_run = read_run_id(better)
    assert champion_version(model) == versions[better_run], outputs


def start_register(workspace: Path, tracking_uri: str, lock_dir: Path) -> subprocess.Popen[str]:
    env = dict(os.environ, MLFLOW_TRACKING_URI=tracking_uri, CLIPMS_LOCK_DIR=str(lock_dir))
    return subprocess.Popen([sys.executable, "-m", "stages.register"], cwd=workspace, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_run_id(workspace: Path) -> str:
    from clipms.utils.jsonio import read_json

    return str(read_json(workspace / "models" / "mlflow_run.json")["run_id"])

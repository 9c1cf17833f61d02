"""MLflow tracking against a real `mlflow server` (SQLite, loopback, one worker): the pipeline run
and its lineage, batched metrics, the server going away mid-run (journal + replay), the UI page."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from registry import tracking
from tests.mlflow_server import MlflowServer, http_get
from tests.test_registry import write_pipeline_state

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, server: MlflowServer) -> Path:
    """A project-like cwd with dvc.lock + manifest, tracking to the test server."""
    write_pipeline_state(tmp_path)
    (tmp_path / "params.yaml").write_text("register:\n  experiment: test-exp\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    return tmp_path


def train_like(run: tracking.PipelineRun, steps: int, start: int = 1) -> None:
    callback = run.callback(flush_every_s=0.0, prefix="")
    for step in range(start, start + steps):
        callback.on_step_end(step, {"loss": 2.0 / step, "lr": 1e-3})


def test_ui_page_answers(server: MlflowServer) -> None:
    status, body = http_get(server.uri + "/", timeout=30)
    assert status == 200 and b"<html" in body.lower()


def test_pipeline_run_has_params_metrics_lineage_dataset(workspace: Path) -> None:
    run = tracking.PipelineRun.open("train", {"lr": 1e-3, "epochs": 1})
    assert run.run_id and not run.pending
    run.start_system_metrics(sampling_interval=1.0)
    train_like(run, 20)
    callback = run.callback()
    callback.on_train_end({"loss": 0.1, "samples_per_s": 42.0})
    time.sleep(2.5)  # let the monitor take a sample
    (workspace / "plots").mkdir()
    (workspace / "plots" / "train.csv").write_text("step,loss\n1,2.0\n")
    run.log_artifact("plots/train.csv", "plots")
    assert run.close() is True
    assert not tracking.JOURNAL_FILE.exists()

    resumed = tracking.log_stage("evaluate", {"batch_size": 16}, {"i2t_R@5": 0.5, "mAP@10": 0.25})
    assert resumed is not None and resumed.run_id == run.run_id

    client = tracking.client()
    data = client.get_run(run.run_id)
    assert data.info.status == "FINISHED"
    assert client.get_experiment(data.info.experiment_id).name == "test-exp"
    params = data.data.params
    assert params["train.lr"] == "0.001" and params["evaluate.batch_size"] == "16"
    assert params["metadata.source"] == "synthetic" and params["shard.samples_per_shard"] == "16"
    metrics = data.data.metrics
    assert metrics["i2t_R_at_5"] == 0.5 and metrics["train_loss"] == 0.1
    assert len(client.get_metric_history(run.run_id, "loss")) == 20
    assert any(k.startswith("system/") for k in metrics), sorted(metrics)
    tags = data.data.tags
    assert tags["lineage.data_shards_md5"] == "1" * 32 and tags["lineage.tokenizer_md5"] == "3" * 32
    assert tags["lineage.metadata_source"] == "synthetic"
    inputs = data.inputs.dataset_inputs
    assert [(i.dataset.name, i.dataset.digest) for i in inputs] == [("synthetic-shards", "1" * 32)]
    assert [a.path for a in client.list_artifacts(run.run_id, "plots")] == ["plots/train.csv"]

    # A rerun of a later stage with a changed param keeps the first value and records the new one.
    tracking.log_stage("evaluate", {"batch_size": 32}, {"i2t_R@5": 0.5})
    rerun = client.get_run(run.run_id).data
    assert rerun.params["evaluate.batch_size"] == "16"
    assert rerun.tags["rerun_param.evaluate.batch_size"] == "32"


def test_server_going_away_mid_run_loses_nothing(workspace: Path, server: MlflowServer,
                                                 tmp_path_factory: pytest.TempPathFactory,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    run = tracking.PipelineRun.open("train", {"lr": 1e-3})
    train_like(run, 10)
    assert not run.pending  # flushed while the server was up

    server.stop()
    started = time.monotonic()
    train_like(run, 10, start=11)  # training goes on; the failed flush backs off
    run.callback().on_train_end({"loss": 0.2})
    assert run.close() is False
    assert time.monotonic() - started < 60
    assert tracking.JOURNAL_FILE.exists() and tracking.RUN_FILE.exists()
    tracking.log_stage("evaluate", {"batch_size": 16}, {"i2t_R@5": 0.75})  # also journaled
    with pytest.raises(tracking.TrackingUnavailable, match="cannot reach the MLflow tracking"):
        tracking.PipelineRun.resume().require_sent()

    # A second pipeline that starts while the server is down has no run id at all yet.
    other = tmp_path_factory.mktemp("offline-start")
    write_pipeline_state(other)
    monkeypatch.chdir(other)
    offline = tracking.PipelineRun.open("train", {"lr": 2e-3})
    train_like(offline, 5)
    assert offline.close() is False and offline.run_id is None

    server.start()
    resumed = tracking.PipelineRun.resume()
    resumed.require_sent()  # replays the journal, creating the run first
    assert resumed.run_id and not resumed.pending
    monkeypatch.chdir(workspace)
    first = tracking.PipelineRun.resume()
    first.require_sent()
    assert first.run_id == run.run_id

    client = tracking.client()
    history = client.get_metric_history(run.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, 21))
    data = client.get_run(run.run_id).data
    assert data.metrics["i2t_R_at_5"] == 0.75 and data.metrics["train_loss"] == 0.2
    late = client.get_run(resumed.run_id)
    assert late.data.params["train.lr"] == "0.002"
    assert len(client.get_metric_history(resumed.run_id, "loss")) == 5
    assert late.data.tags["lineage.data_shards_md5"] == "1" * 32

"""MLflow tracking against a real `mlflow server` (SQLite, loopback, one worker): the pipeline run
and its lineage, batched metrics, the server going away mid-run (journal + replay), the UI page."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from harness import mlflow_server as server_fixtures
from harness import register_workspace
from harness.mlflow_server import MlflowServer, http_get
from harness.register_workspace import (
    MODEL,
    prepare_workspace,
    register_in,
    train_like,
    write_pipeline_state,
)
from registry import gate
from tracking import lineage, settings
from tracking import run as tracking_run
from tracking.callback import TrainCallback
from tracking.files import FILES

pytestmark = pytest.mark.slow
mlflow_server = server_fixtures.mlflow_server  # module fixtures (pytest finds them by name)
server = server_fixtures.server
workspace = register_workspace.workspace
bundle = register_workspace.bundle  # a real export bundle (two MindIR graphs) of a tiny CLIP


def journals() -> list[Path]:
    return sorted(FILES.journal_dir.glob("*.json"))


def test_ui_page_answers(server: MlflowServer) -> None:
    status, body = http_get(server.uri + "/", timeout=30)
    assert status == 200 and b"<html" in body.lower()


def test_pipeline_run_has_params_metrics_lineage_dataset(workspace: Path) -> None:
    run = tracking_run.PipelineRun.open("train", {"lr": 1e-3, "epochs": 1}, FILES)
    assert run.flush() and run.run_id and not run.pending
    run.start_system_metrics(sampling_interval=1.0)
    train_like(run, 20)
    callback = TrainCallback(run)
    callback.on_train_end({"loss": 0.1, "samples_per_s": 42.0})
    time.sleep(2.5)  # let the monitor take a sample
    (workspace / "plots").mkdir()
    (workspace / "plots" / "train.csv").write_text("step,loss\n1,2.0\n")
    run.log_artifact("plots/train.csv", "plots")
    assert run.close() is True
    assert not journals()

    resumed = tracking_run.log_stage("evaluate", {"batch_size": 16}, FILES,
                                     {"i2t_R@5": 0.5, "mAP@10": 0.25})
    assert resumed is not None and resumed.run_id == run.run_id

    client = settings.client()
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
    tracking_run.log_stage("evaluate", {"batch_size": 32}, FILES, {"i2t_R@5": 0.5})
    rerun = client.get_run(run.run_id).data
    assert rerun.params["evaluate.batch_size"] == "16"
    assert rerun.tags["rerun_param.evaluate.batch_size"] == "32"


def test_server_going_away_mid_run_loses_nothing(workspace: Path, server: MlflowServer,
                                                 tmp_path_factory: pytest.TempPathFactory,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    run = tracking_run.PipelineRun.open("train", {"lr": 1e-3}, FILES)
    train_like(run, 10)
    assert run.flush() and not run.pending  # sent while the server was up

    # Fail fast instead of ~3 s of retries per request (the default set by tracking.settings).
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    server.stop()
    started = time.monotonic()
    train_like(run, 10, start=11)  # training goes on; the failed flush backs off
    TrainCallback(run).on_train_end({"loss": 0.2})
    assert run.close() is False
    assert time.monotonic() - started < 60
    assert journals() and FILES.run_file.exists()
    tracking_run.log_stage("evaluate", {"batch_size": 16}, FILES, {"i2t_R@5": 0.75})  # journaled
    with pytest.raises(tracking_run.TrackingUnavailable, match="cannot reach the MLflow tracking"):
        tracking_run.PipelineRun.resume(FILES).require_sent()

    # A second pipeline that starts while the server is down has no run id at all yet.
    other = tmp_path_factory.mktemp("offline-start")
    write_pipeline_state(other)
    (other / "params.yaml").write_text("register:\n  experiment: test-exp\n")
    monkeypatch.chdir(other)
    offline = tracking_run.PipelineRun.open("train", {"lr": 2e-3}, FILES)
    train_like(offline, 5)
    assert offline.close() is False and offline.run_id is None

    server.start()
    resumed = tracking_run.PipelineRun.resume(FILES)
    resumed.require_sent()  # replays the journal, creating the run first
    assert resumed.run_id and not resumed.pending
    monkeypatch.chdir(workspace)
    first = tracking_run.PipelineRun.resume(FILES)
    first.require_sent()
    assert first.run_id == run.run_id

    client = settings.client()
    history = client.get_metric_history(run.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, 21))
    data = client.get_run(run.run_id).data
    assert data.metrics["i2t_R_at_5"] == 0.75 and data.metrics["train_loss"] == 0.2
    late = client.get_run(resumed.run_id)
    assert late.data.params["train.lr"] == "0.002"
    assert len(client.get_metric_history(resumed.run_id, "loss")) == 5
    assert late.data.tags["lineage.data_shards_md5"] == "1" * 32


# ---------------------------------------------------------------------------------------------
# the model: register stage + gate on real logged models, loading by alias, serving over HTTP

def pipeline_run(root: Path, bundle: Path, score: float, val_images: int | None = None) -> dict:
    """One pipeline run as the stages leave it, then the real register stage."""
    eval_metrics = {"i2t_R@1": score / 2, "i2t_R@5": score, "mAP@10": score / 3, "images": 10}
    prepare_workspace(root, bundle, eval_metrics, train_params={"lr": score},
                      val_images=val_images)
    code, record = register_in(root)
    assert code == 0 and record is not None
    return record


def test_gate_sequence_on_real_registered_models(workspace: Path, bundle: Path) -> None:
    first = pipeline_run(workspace / "run1", bundle, 0.50)
    assert (first["version"], first["alias"]) == (1, "champion")
    worse = pipeline_run(workspace / "run2", bundle, 0.40)
    assert (worse["alias"], worse["new_value"], worse["champion_value"]) == \
        ("challenger", 0.40, 0.50)
    better = pipeline_run(workspace / "run3", bundle, 0.60)
    assert (better["alias"], better["champion_version"]) == ("champion", "1")
    # the data grew: v4 was evaluated on another val set, so champion v3 is re-scored on it
    other_set = pipeline_run(workspace / "run4", bundle, 0.99, val_images=13)
    assert other_set["alias"] == "champion" and other_set["compared"] is True
    assert other_set["champion_recorded_value"] == 0.60
    assert other_set["champion_source"].startswith(f"re-scored from models:/{MODEL}/3")
    assert "re-scored" in other_set["reason"]

    client = settings.client()
    assert client.get_model_version_by_alias(MODEL, "champion").version == "4"
    assert client.get_model_version_by_alias(MODEL, "challenger").version == "2"
    v2 = client.get_model_version(MODEL, "2")
    assert gate.decided_alias(v2.description) == "challenger"
    assert v2.tags["metric.i2t_R_at_5"] == "0.4"
    assert v2.tags["lineage.data_shards_md5"] == "1" * 32
    assert v2.run_id == worse["run_id"]
    run = client.get_run(worse["run_id"])
    assert run.data.tags["register.decision"] == "challenger"
    assert run.data.params["register.model_name"] == MODEL

    out = subprocess.run([sys.executable, "-m", "registry", "compare", "--name", MODEL],
                         capture_output=True, text=True, check=True, timeout=120,
                         env=dict(os.environ))
    assert "4 version(s)" in out.stdout
    aliases = {line.split()[0]: line.split()[1] for line in out.stdout.splitlines()
               if line.startswith("v") and line[1].isdigit()}
    assert aliases == {"v1": "-", "v2": "challenger", "v3": "-", "v4": "champion"}
    assert "train.lr" in out.stdout  # the only param that differs between the runs
    assert "re-scored from" in out.stdout


def test_versions_registered_from_one_run_keep_their_own_index(workspace: Path,
                                                               bundle: Path) -> None:
    """`dvc repro -f -s register` or a re-export continues the pipeline's MLflow run: a second
    version (another bundle, its own index) is registered from the same run. Version 1 must still
    come back with version 1's index, so the service can serve it when it is the champion."""
    import shutil

    from clipms.deploy.searchindex import ImageIndex, bundle_digest
    from harness.tiny_model import export_tiny_bundle, make_index
    from serving.source import RegistrySource

    other = export_tiny_bundle(workspace / "other", seed=1)
    root = prepare_workspace(workspace / "run", bundle, {"i2t_R@5": 0.5, "mAP@10": 0.2},
                             model="clip-one-run")
    digests = []
    for source_bundle in (bundle, other):  # the second pass: a re-export, then index, register
        shutil.rmtree(root / "models" / "export")
        shutil.rmtree(root / "models" / "index", ignore_errors=True)
        shutil.copytree(source_bundle, root / "models" / "export")
        make_index(root / "models" / "export", root / "models" / "index")
        digests.append(bundle_digest(root / "models" / "export"))
        code, record = register_in(root)
        assert code == 0 and record is not None
    assert digests[0] != digests[1]
    client = settings.client()
    first, second = (client.get_model_version("clip-one-run", v) for v in ("1", "2"))
    assert first.run_id == second.run_id  # one pipeline run, two versions

    for version, digest in (("1", digests[0]), ("2", digests[1])):
        source = RegistrySource(f"models:/clip-one-run/{version}", settings.tracking_uri())
        fetched = source.fetch(*source.current())
        try:
            assert bundle_digest(fetched.bundle_dir) == digest
            index = ImageIndex.load(fetched.index_dir, digest)  # raises for another bundle's
            assert index.bundle_digest == digest and len(index) == 12
        finally:
            fetched.cleanup()


def champion_input(tmp_path: Path) -> tuple[object, list[str], list[str]]:
    import pandas as pd

    from registry.pyfunc import example_image

    texts = ["a red circle", "a blue square"]
    images = [example_image(24), example_image(40)]  # base64 only: the model reads no files
    return pd.DataFrame({"text": texts, "image": images}), texts, images


def expected(bundle: Path, texts: list[str], images: list[str]) -> tuple[np.ndarray, np.ndarray]:
    from clipms.deploy.infer import Encoder

    encoder = Encoder(bundle)
    raw = [base64.b64decode(image) for image in images]
    return encoder.encode_texts(texts), encoder.encode_images(raw)


def test_champion_loads_and_matches_clipms_infer(workspace: Path, bundle: Path) -> None:
    import mlflow

    if not settings.client().search_model_versions(f"name = '{MODEL}'"):
        pipeline_run(workspace / "run1", bundle, 0.5)
    model = mlflow.pyfunc.load_model(f"models:/{MODEL}@champion")
    frame, texts, images = champion_input(workspace)
    out = model.predict(frame)
    want_text, want_image = expected(bundle, texts, images)
    np.testing.assert_allclose(np.stack(out["text_embedding"]), want_text, atol=1e-6)
    np.testing.assert_allclose(np.stack(out["image_embedding"]), want_image, atol=1e-6)
    only_text = model.predict(frame[["text"]])
    assert list(only_text.columns) == ["text_embedding"]
    local = Path(mlflow.artifacts.download_artifacts(f"models:/{MODEL}@champion"))
    files = {p.name for p in local.rglob("*") if p.is_file() and "code" not in p.parts}
    assert {"image_encoder.mindir", "text_encoder.mindir", "MLmodel"} <= files
    assert not any(name.endswith((".pkl", ".pickle")) for name in files)


def test_mlflow_models_serve_answers_invocations(workspace: Path, bundle: Path,
                                                 server: MlflowServer) -> None:
    from harness.mlflow_server import free_port

    if not settings.client().search_model_versions(f"name = '{MODEL}'"):
        pipeline_run(workspace / "run1", bundle, 0.5)
    port = free_port()
    mlflow_bin = str(Path(sys.executable).parent / "mlflow")
    env = dict(os.environ, MLFLOW_TRACKING_URI=server.uri,
               PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])
    log = (workspace / "serve.log").open("wb")
    proc = subprocess.Popen(
        [mlflow_bin, "models", "serve", "-m", f"models:/{MODEL}@champion", "--env-manager",
         "local", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_for(f"http://127.0.0.1:{port}/ping", proc, workspace / "serve.log", timeout=240)
        frame, texts, images = champion_input(workspace)
        body = json.dumps({"dataframe_split": frame.to_dict(orient="split")}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            predictions = json.loads(response.read())["predictions"]
        want_text, want_image = expected(bundle, texts, images)
        np.testing.assert_allclose([p["text_embedding"] for p in predictions], want_text,
                                   atol=1e-5)
        np.testing.assert_allclose([p["image_embedding"] for p in predictions], want_image,
                                   atol=1e-5)
    finally:
        os.killpg(os.getpgid(proc.pid), signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
            proc.wait(timeout=20)
        log.close()


def wait_for(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if http_get(url, timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    raise AssertionError(f"{url} not answering after {timeout} s:\n{log.read_text()[-3000:]}")


# ---------------------------------------------------------------------------------------------
# the whole pipeline: `dvc repro` on the tiny synthetic config, tracked to the test server


EVAL_KEYS = ("i2t_R@1", "i2t_R@5", "i2t_R@10", "t2i_R@1", "t2i_R@5", "t2i_R@10", "mAP@10",
             "zeroshot_top1", "zeroshot_top5", "zeroshot_mean_per_class_recall")


def _metrics_are_shown_and_the_pipeline_is_up_to_date(ws: Path, env: dict[str, str]) -> None:
    """What a user sees after `dvc repro`: every metric in range and in `dvc metrics show`, a
    second repro that runs nothing, and the exported bundle answering a text query."""
    from clipms.utils.jsonio import read_json
    from harness.dvc_workspace import run

    found = read_json(ws / "metrics" / "eval.json")
    assert all(0.0 <= found[k] <= 1.0 for k in EVAL_KEYS), found
    assert found["num_captions"] >= found["num_images"] > 0
    shown = json.loads(run(["dvc", "metrics", "show", "--json"], ws).stdout)
    workspace_metrics = shown[""]["data"]  # DVC 3 keys the working tree as ""
    assert set(EVAL_KEYS) <= set(workspace_metrics["metrics/eval.json"]["data"])
    assert "text_max_abs_error" in workspace_metrics["metrics/export.json"]["data"]
    again = run(["dvc", "repro"], ws, env=env, timeout=300)
    assert "Running stage" not in again.stdout, again.stdout
    hits = run(["python", "-m", "clipms.deploy.infer", "search", "--bundle", "models/export",
                "--shards", "data/shards/val", "--top", "3", "a red circle"], ws)
    assert len(hits.stdout.strip().splitlines()) == 4  # a header and three hits


def test_dvc_repro_logs_one_run_through_all_stages(tmp_path: Path, server: MlflowServer,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from clipms.utils.jsonio import read_json
    from harness.dvc_workspace import make_workspace, run, tool_env

    # every stage with the users' default CPU kernel fusion (the tiny workspace turns it off),
    # trained with amp: the fp32 graphs of evaluate and export compile fused kernels, amp's
    # training step runs unfused on purpose
    ws = make_workspace(tmp_path / "ws", {"register.model_name": "clip-e2e",
                                          "runtime.kernel_fusion": True,
                                          "train.precision": "amp"})
    env = {**tool_env(), "MLFLOW_TRACKING_URI": server.uri}
    out = run(["dvc", "repro"], ws, env=env, timeout=1500).stdout
    assert "kernel fusion off for its graphs" in out
    trained = read_json(ws / "models" / "clip.json")["train"]
    assert trained["precision"] == "amp" and trained["runtime"]["kernel_fusion"] is True
    # amp keeps fp32 master weights and the checkpoint holds them, so the exported fp32 graphs
    # meet the fp32 parity bar against it
    export = read_json(ws / "metrics" / "export.json")
    assert export["passed"] and export["tolerance"] <= 1e-5
    _metrics_are_shown_and_the_pipeline_is_up_to_date(ws, env)

    info = read_json(ws / "models" / "mlflow_run.json")
    record = read_json(ws / "metrics" / "register.json")
    evaluation = read_json(ws / "metrics" / "eval.json")
    train_summary = read_json(ws / "metrics" / "train.json")
    assert record["run_id"] == info["run_id"]
    assert (record["version"], record["alias"]) == (1, "champion")
    assert not list((ws / FILES.journal_dir).glob("*.json"))

    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    client = settings.client()
    data = client.get_run(info["run_id"])
    assert data.info.status == "FINISHED"
    params = data.data.params
    for key in ("metadata.source", "tokenizer.vocab_size", "train.lr", "evaluate.batch_size",
                "export.tolerance", "register.model_name"):
        assert key in params, key
    assert params["train.batch_size"] == "8"  # the tiny config, as resolved
    metrics = data.data.metrics
    assert metrics["i2t_R_at_5"] == pytest.approx(evaluation["i2t_R@5"])
    assert metrics["mAP_at_10"] == pytest.approx(evaluation["mAP@10"])
    steps = len(client.get_metric_history(info["run_id"], "loss"))
    assert steps == metrics["train_steps"] > 0
    assert any(k.startswith("system/") for k in metrics)
    plots = {a.path for a in client.list_artifacts(info["run_id"], "plots")}
    assert {"plots/train.csv", "plots/recall_at_k.csv"} <= plots
    lock = lineage.read_lock(ws / "dvc.lock")
    tags = data.data.tags
    assert tags["lineage.data_shards_md5"] == lineage.lock_hash(lock, "data/shards")
    assert tags["lineage.tokenizer_md5"] == lineage.lock_hash(lock, "models/tokenizer.json")
    head = run(["git", "rev-parse", "HEAD"], ws).stdout.strip()
    assert tags["lineage.git_commit"] == head
    assert tags["lineage.git_dirty"] == "false"  # a fresh repro of a clean commit
    assert [i.dataset.digest for i in data.inputs.dataset_inputs] == [
        tags["lineage.data_shards_md5"]]
    version = client.get_model_version_by_alias("clip-e2e", "champion")
    assert version.version == "1" and version.run_id == info["run_id"]
    assert float(version.tags["metric.i2t_R_at_5"]) == pytest.approx(evaluation["i2t_R@5"])
    # The logged model carries the quality metrics only (the Models view's columns), not every
    # step-0 summary of the run (train_steps, counts, chance levels) that log_model would link.
    linked = {m.key for m in client.get_logged_model(gate.logged_model_id(version)).metrics}
    assert {"i2t_R_at_5", "mAP_at_10"} <= linked and "train_steps" not in linked, linked
    assert not any(k.startswith("chance_") for k in linked), linked
    assert train_summary  # train.json exists; its values are logged as train_* metrics
    # The index stage ran after export; register logged it into the version's model, so the
    # champion's model and its index come back from MLflow alone and belong together.
    from clipms.deploy.searchindex import ImageIndex, bundle_digest
    from serving.source import RegistrySource

    indexed = read_json(ws / "metrics" / "index.json")
    assert indexed["rows"] > 0 and indexed["search"] == "exact"
    logged = {a.path for a in client.list_logged_model_artifacts(
        gate.logged_model_id(version), "index")}  # the version's own model, not the shared run
    assert logged == {"index/index.ref.json"}  # its files are in the index store, by content
    source = RegistrySource("models:/clip-e2e@champion", server.uri)
    fetched = source.fetch(*source.current())
    try:
        index = ImageIndex.load(fetched.index_dir, bundle_digest(fetched.bundle_dir))
        assert len(index) == indexed["rows"]
        assert index.bundle_digest == bundle_digest(ws / "models" / "export")
    finally:
        fetched.cleanup()

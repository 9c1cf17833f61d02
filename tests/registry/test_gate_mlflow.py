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

from harness import mlflow_server as server_fixtures
from harness import register_workspace
from harness.fault_proxy import FaultProxy, Rule
from harness.mlflow_server import MlflowServer
from harness.register_workspace import ALIAS, prepare_workspace, read_run_id, register_in, scores
from tracking import settings

pytestmark = pytest.mark.slow
mlflow_server = server_fixtures.mlflow_server  # module fixtures, found by name
bundle = register_workspace.bundle


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


# ---------------------------------------------------------------------------------------------
# the data grew: the champion was scored on another evaluation set


def evaluate_defaults() -> tuple[int, object]:
    """(batch size, zero-shot spec) of the `evaluate` section these workspaces leave default."""
    from clipms.eval.options import EvaluateParams

    params = EvaluateParams()
    return params.batch_size, params.zeroshot_spec()


def bundle_scores(bundle: Path, shards: Path) -> dict[str, float]:
    """What the evaluate stage's code gives the bundle's MindIR graphs on the val split."""
    from clipms.deploy.infer import Encoder
    from clipms.eval.scoring import evaluate_towers

    batch_size, spec = evaluate_defaults()
    encoder = Encoder(bundle, batch_size=batch_size, kernel_fusion=False)
    return evaluate_towers(encoder, encoder.preprocess, shards, batch_size, spec, "val").metrics


def checkpoint_scores(trained: Path, shards: Path) -> dict[str, float]:
    """What the evaluate stage itself gives the checkpoint the bundle was exported from."""
    from clipms.eval.scoring import evaluate
    from clipms.text.clip_tokenizer import Tokenizer
    from clipms.train.trained import RunConfig, load_clip

    batch_size, spec = evaluate_defaults()
    run = RunConfig.read(trained / "clip.json")
    return evaluate(load_clip(trained / "clip.ckpt", run.model),
                    Tokenizer.load(trained / "tokenizer.json"), run.preprocess, shards,
                    batch_size, spec, "val").metrics


def metrics_with(primary: str, value: float) -> dict[str, float]:
    return {**scores(0.5), "zeroshot_top1": 0.5, primary: value}


@pytest.mark.parametrize("primary", ["i2t_R@5", "zeroshot_top1"])
def test_a_champion_scored_on_another_set_is_rescored_on_the_new_one(
        primary: str, proxy: FaultProxy, bundle: Path, tmp_path: Path) -> None:
    """v1 was evaluated on 11 val images; the data grew and v2 on 13. The gate scores v1's
    registered bundle on v2's set with the evaluate stage's code, compares there, and records
    both values, the set and where each came from. Today's gate only said "not compared"."""
    from harness.tiny_model import make_val_shards
    from tracking.lineage import val_digest

    model = f"gate-grown-{primary.replace('@', '')}"
    v1 = prepare_workspace(tmp_path / "v1", bundle, metrics_with(primary, 0.5), model,
                           primary_metric=primary, val_images=11)
    code, first = register_in(v1)
    assert code == 0 and first is not None and first["alias"] == "champion"
    # v1 on the grown set: as the re-scoring computes it, and as `evaluate` scores its checkpoint
    make_val_shards(tmp_path / "grown", n_images=13)
    expected = bundle_scores(bundle, tmp_path / "grown")
    from_checkpoint = checkpoint_scores(bundle.parent / "trained", tmp_path / "grown")
    assert abs(expected[primary] - from_checkpoint[primary]) <= 1 / 13  # one image, at most
    ws2 = prepare_workspace(tmp_path / "v2", bundle,
                            metrics_with(primary, min(1.0, expected[primary] + 0.01)), model,
                            primary_metric=primary, val_images=13)
    grown = ws2 / "data" / "shards"
    code, second = register_in(ws2)

    assert code == 0 and second is not None
    old_set, new_set = val_digest(v1 / "data/shards/manifest.json"), val_digest(
        grown / "manifest.json")
    assert old_set != new_set
    assert second["compared"] is True and second["alias"] == "champion"
    assert second["champion_value"] == pytest.approx(expected[primary], abs=1e-12)
    assert (second["champion_recorded_value"], second["champion_recorded_set"]) == (0.5, old_set)
    assert second["eval_set"] == new_set
    assert second["eval_set_name"] == "split val of data/shards"
    assert second["new_source"] == "evaluate stage of this run"
    assert second["champion_source"] == (f"re-scored from models:/{model}/1 (its registered "
                                         f"MindIR bundle) on evaluation set {new_set}")
    client = settings.client()
    description = client.get_model_version(model, "2").description
    assert description.startswith(f"champion ({primary} ") and new_set in description
    assert f"re-scored from models:/{model}/1" in description and old_set in description
    assert client.get_model_version(model, "2").tags["lineage.val_digest"] == new_set
    assert champion_version(model) == "2"


@pytest.mark.parametrize("fault", ["broken bundle", "metric not computed"])
def test_a_champion_that_cannot_be_rescored_fails_closed(
        fault: str, proxy: FaultProxy, bundle: Path, tmp_path: Path,
        mlflow_server: MlflowServer, capsys: pytest.CaptureFixture[str]) -> None:
    from registry.gate import logged_model_id

    model = f"gate-unscorable-{fault.split()[0]}"
    v1 = prepare_workspace(tmp_path / "v1", bundle, metrics_with("zeroshot_top1", 0.5), model,
                           primary_metric="zeroshot_top1", val_images=11)
    assert register_in(v1)[0] == 0
    v2 = prepare_workspace(tmp_path / "v2", bundle, metrics_with("zeroshot_top1", 0.9), model,
                           primary_metric="zeroshot_top1", val_images=13)
    client = settings.client()
    if fault == "broken bundle":  # the champion's graph, damaged in the artifact store
        model_id = logged_model_id(client.get_model_version(model, "1"))
        graphs = [p for p in mlflow_server.artifacts.rglob("image_encoder.mindir")
                  if model_id in p.parts]
        assert len(graphs) == 1, graphs
        graphs[0].write_bytes(b"not a MindIR graph")
    else:  # register's `evaluate` settings compute no zero-shot on this set
        with open(v2 / "params.yaml", "a") as params:
            params.write("evaluate:\n  zeroshot:\n    source: none\n")
    code, record = register_in(v2)
    err = capsys.readouterr().err
    assert code == 1 and record is None
    assert f"could not re-score champion v1 of '{model}'" in err, err
    assert "no alias was moved" in err
    if fault == "metric not computed":
        assert "gave no 'zeroshot_top1'" in err, err
    assert champion_version(model) == "1"
    v2_version = client.get_model_version(model, "2")
    assert not v2_version.aliases and not v2_version.description


def test_versions_scored_on_one_pinned_set_compare_without_rescoring(
        proxy: FaultProxy, bundle: Path, tmp_path: Path) -> None:
    """evaluate.pinned_set: the nights' val splits differ (11, then 13 images), the frozen set
    does not; the decision names it, and the champion's recorded value is compared as is."""
    import shutil

    from clipms.data.evalset import freeze
    from tracking.lineage import val_digest

    model = "gate-pinned"
    pinned = tmp_path / "frozen"
    records = []
    for name, images, value in (("v1", 11, 0.5), ("v2", 13, 0.6)):
        ws = prepare_workspace(tmp_path / name, bundle, metrics_with("i2t_R@5", value), model,
                               val_images=images)
        if not pinned.exists():
            freeze(ws / "data" / "shards", "val", pinned)  # today's split, frozen on night 1
        shutil.copytree(pinned, ws / "data" / "evalsets" / "2026-12")
        with open(ws / "params.yaml", "a") as params:
            params.write("evaluate:\n  pinned_set: '2026-12'\n")
        code, record = register_in(ws)
        assert code == 0 and record is not None
        records.append(record)
    digest = val_digest(pinned / "manifest.json")
    second = records[1]
    assert (second["alias"], second["compared"], second["eval_set"]) == ("champion", True, digest)
    assert second["eval_set_name"] == "pinned set 2026-12 (data/evalsets/2026-12)"
    assert second["champion_source"] == "recorded when v1 was registered"
    assert second["champion_value"] == 0.5 and second["champion_recorded_value"] is None
    description = settings.client().get_model_version(model, "2").description
    assert "pinned set 2026-12" in description and digest in description
    assert settings.client().get_model_version(model, "1").tags["lineage.eval_set"] == (
        "pinned set 2026-12 (data/evalsets/2026-12)")


def test_a_run_whose_creation_was_answered_too_late_still_registers(
        proxy: FaultProxy, bundle: Path, tmp_path: Path) -> None:
    """A server slower than the stage's wait when train opens the run: the run is created, but
    train never learns its id (the run file holds none) and evaluate's journal is gone once it
    was sent. register finds the run by its key instead of failing forever."""
    import json

    from tracking.sender import RUN_KEY_TAG

    proxy.add(Rule("POST", "/runs/create", "hold", release=threading.Event(), hold_s=20.0,
                   times=1))
    ws = prepare_workspace(tmp_path / "slow", bundle, scores(0.5), "gate-slow-create")
    run_file = json.loads((ws / "models" / "mlflow_run.json").read_text())
    assert run_file["run_id"] is None
    code, record = register_in(ws)
    assert code == 0 and record is not None and record["alias"] == "champion"
    tags = settings.client().get_run(record["run_id"]).data.tags
    assert tags[RUN_KEY_TAG] == run_file["run_key"]

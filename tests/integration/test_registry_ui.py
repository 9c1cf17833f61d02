"""What the MLflow UI shows of the registry, checked through the client API of a real server: the
experiment is a model-training one, the evaluation metrics are on each version's logged model (the
Models view's columns), version tags are only lineage and the gate's inputs, each version's
description is the gate's decision, and the registered model has a description; and the UI
itself, in headless Chromium, shows them (harness/mlflow_screenshots.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import mlflow_screenshots, register_workspace
from harness import mlflow_server as server_fixtures
from harness.mlflow_server import MlflowServer
from harness.register_workspace import prepare_workspace, register_in
from registry import gate
from registry.registration import MODEL_DESCRIPTION_START
from tracking import settings

pytestmark = pytest.mark.slow
mlflow_server = server_fixtures.mlflow_server  # the module fixture (pytest finds it by name)
bundle = register_workspace.bundle  # a real export bundle of a tiny CLIP
MODEL = "clip-ui"


def scores(r5: float) -> dict[str, float]:
    """eval.json as evaluate writes it: ranking metrics, a lower-is-better one, counts, chances."""
    return {"i2t_R@1": r5 / 2, "i2t_R@5": r5, "t2i_R@5": r5 - 0.05, "mAP@10": r5 / 3,
            "i2t_mean_rank": 10 - 10 * r5, "num_images": 10, "zeroshot_classes": 4,
            "chance_i2t_R@5": 0.5}


QUALITY = {"i2t_R_at_1", "i2t_R_at_5", "t2i_R_at_5", "mAP_at_10", "i2t_mean_rank"}


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
              mlflow_server: MlflowServer) -> Path:
    if mlflow_server.proc is None:
        mlflow_server.start()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    return tmp_path


def register(root: Path, exported: Path, r5: float, primary: str = "i2t_R@5") -> dict:
    prepare_workspace(root, exported, scores(r5), MODEL, primary_metric=primary)
    code, record = register_in(root)
    assert code == 0 and record is not None
    return record


def test_registered_versions_read_at_a_glance(workspace: Path, bundle: Path,
                                              mlflow_server: MlflowServer) -> None:
    first = register(workspace / "v1", bundle, 0.50)
    second = register(workspace / "v2", bundle, 0.75)
    assert (first["alias"], second["alias"]) == ("champion", "champion")
    client = settings.client()

    run = client.get_run(second["run_id"])
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.tags[settings.EXPERIMENT_KIND_TAG] == "custom_model_development"

    model = client.get_registered_model(MODEL)
    assert model.description.startswith(MODEL_DESCRIPTION_START)
    assert "`i2t_R@5` (higher is better" in model.description

    for record, r5 in ((first, 0.50), (second, 0.75)):
        version = client.get_model_version(MODEL, str(record["version"]))
        # One line: the gate's decision, with the value and the reason.
        assert version.description.startswith(f"{record['alias']} (i2t_R@5 {r5:g}): ")
        assert version.description.endswith(record["reason"]) and "\n" not in version.description
        # Tags: lineage and the gate's inputs only (no other metric, no chance level, no count).
        tags = version.tags
        assert {k for k in tags if not k.startswith("lineage.")} == {"metric.i2t_R_at_5"}, tags
        assert float(tags["metric.i2t_R_at_5"]) == r5
        assert tags["lineage.val_digest"] and tags["lineage.data_shards_md5"] == "1" * 32
        # Metrics: every model-quality metric on the version's logged model, nothing else.
        model_id = gate.logged_model_id(version)
        assert version.source == f"models:/{model_id}"
        logged = client.get_logged_model(model_id)
        metrics = {m.key: m.value for m in logged.metrics}
        assert set(metrics) == QUALITY, metrics
        assert metrics["i2t_R_at_5"] == r5 and metrics["mAP_at_10"] == pytest.approx(r5 / 3)
        assert {m.model_id for m in logged.metrics} == {model_id}
        assert {m.run_id for m in logged.metrics} == {record["run_id"]}

    # The Models view's query: the experiment's models ordered by a metric column.
    found = client.search_logged_models(
        experiment_ids=[experiment.experiment_id],
        order_by=[{"field_name": "metrics.i2t_R_at_5", "ascending": False}])
    ids = [m.model_id for m in found]
    v1, v2 = (gate.logged_model_id(client.get_model_version(MODEL, str(r["version"])))
              for r in (first, second))
    assert ids.index(v2) < ids.index(v1)

    # The UI itself, in headless Chromium: both pages render the versions, aliases and a metric
    # column (the screenshot tool waits for them, else it fails), and are saved as PNGs.
    shots = mlflow_screenshots.take(client, mlflow_server.uri, MODEL, "i2t_R_at_5",
                                    workspace / "shots", window=(1280, 800))
    assert [p.name for p in shots] == ["mlflow-registry.png", "mlflow-compare.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in shots)

    # A new primary metric: the champion has no tag for it, so the gate reads its logged model.
    third = register(workspace / "v3", bundle, 0.60, primary="mAP@10")
    assert third["compared"] is True and third["champion_value"] == pytest.approx(0.25)
    assert third["alias"] == "challenger"


def test_an_experiment_made_before_the_kind_tag_gets_it(workspace: Path) -> None:
    client = settings.client()
    legacy = client.create_experiment("made-by-hand-before")
    assert settings.EXPERIMENT_KIND_TAG not in client.get_experiment(legacy).tags
    assert settings.ensure_experiment(client, "made-by-hand-before") == legacy
    assert client.get_experiment(legacy).tags[settings.EXPERIMENT_KIND_TAG] == \
        settings.MODEL_TRAINING_KIND
    chosen = client.create_experiment("genai-on-purpose",
                                      tags={settings.EXPERIMENT_KIND_TAG: "genai_development"})
    settings.ensure_experiment(client, "genai-on-purpose")  # a kind someone chose is kept
    assert client.get_experiment(chosen).tags[settings.EXPERIMENT_KIND_TAG] == "genai_development"

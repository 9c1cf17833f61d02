"""Retention against a real local MLflow store: a removed version's run loses its plot pictures,
keeps the CSVs they draw, and a run that a kept version shares keeps them. The store is MLflow's
file store (in maintenance mode, allowed here): a SQLite store's schema migrations alone take
seconds, and retention reaches artifacts through the same local artifact repository either way."""

from __future__ import annotations

from pathlib import Path

import pytest

from registry.retention import RetentionParams, make_plan, plot_pictures, retain

MODEL = "clip-plots"


def files_under(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """v1 in its own run, v2 and v3 in one shared run; each run logged plots, each version a
    checkpoint and a logged model with a bundle folder."""
    from mlflow import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # what the registry's own lookups use
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    experiment = client.create_experiment("plots", artifact_location=(tmp_path / "art").as_uri())
    local = tmp_path / "local"
    (local / "plots" / "gallery").mkdir(parents=True)
    (local / "plots" / "recall_at_k.png").write_bytes(b"\x89PNG" + b"r" * 5000)
    (local / "plots" / "gallery" / "page.png").write_bytes(b"\x89PNG" + b"g" * 7000)
    (local / "plots" / "recall_at_k.csv").write_text("k,i2t\n1,0.5\n")
    (local / "ckpt").mkdir()
    (local / "ckpt" / "clip.ckpt").write_bytes(b"w" * 3000)
    (local / "bundle").mkdir()
    (local / "bundle" / "clip.mindir").write_bytes(b"m" * 2000)
    client.create_registered_model(MODEL)
    runs = [client.create_run(experiment).info.run_id for _ in range(2)]
    for run_id in runs:
        client.log_artifacts(run_id, str(local / "plots"), "plots")
    for number, run_id in ((1, runs[0]), (2, runs[1]), (3, runs[1])):
        model = client.create_logged_model(experiment, source_run_id=run_id, name=f"m{number}")
        client.log_artifacts(run_id, str(local / "ckpt"), f"checkpoint/{model.model_id}")
        client.log_model_artifacts(model.model_id, str(local / "bundle"))
        client.create_model_version(MODEL, f"models:/{model.model_id}", run_id,
                                    model_id=model.model_id)
    return client, runs, tmp_path


def run_folder(client, run_id: str) -> Path:
    from urllib.parse import urlparse

    return Path(urlparse(client.get_run(run_id).info.artifact_uri).path)


def test_a_removed_versions_own_run_loses_its_pictures_not_its_csvs(store) -> None:
    client, (own, shared), root = store
    params = RetentionParams(keep_last=1)
    plan, cache = make_plan(client, MODEL, params, root, root / "scratch")
    assert cache is None  # not a DVC project: its cache is left alone
    pictures = {(a.path, a.versions[0]) for a in plan.actions if a.path.startswith("plots/")}
    assert pictures == {("plots/recall_at_k.png", 1), ("plots/gallery/page.png", 1)}
    assert sum(a.bytes for a in plan.actions if a.path.startswith("plots/")) == 5004 + 7004

    report = retain(client, MODEL, params, root, on_line=lambda _: None)
    assert report["removed"].keys() == {"v1", "v2"} and report["kept"].keys() == {"v3"}
    assert files_under(run_folder(client, own) / "plots") == {"recall_at_k.csv"}
    assert files_under(run_folder(client, shared) / "plots") == {
        "recall_at_k.png", "gallery/page.png", "recall_at_k.csv"}  # v3 still uses the run
    assert not (run_folder(client, own) / "checkpoint").exists() or not files_under(
        run_folder(client, own) / "checkpoint")


def test_a_dry_run_names_the_pictures_and_removes_none(store) -> None:
    from registry.retention import _repo

    client, (own, _), root = store
    lines: list[str] = []
    retain(client, MODEL, RetentionParams(keep_last=1, dry_run=True), root, on_line=lines.append)
    assert "MLflow plots/gallery/page.png" in lines[0]
    run_root = client.get_run(own).info.artifact_uri
    assert sorted(plot_pictures(_repo(run_root, client.tracking_uri))) == [
        ("plots/gallery/page.png", 7004), ("plots/recall_at_k.png", 5004)]

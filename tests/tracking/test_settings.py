"""The tracking store a client reads follows the cwd it is made in."""

from __future__ import annotations

from pathlib import Path

import pytest

from tracking import settings


@pytest.mark.slow  # two SQLite stores made whole: MLflow's migrations, about 5 CPU-s
def test_a_client_made_in_another_checkout_opens_that_checkouts_database(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow keeps one store per URI string for the process's life: with the relative default
    URI the second checkout's client would read the first checkout's database."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    monkeypatch.chdir(first)
    settings.client().create_experiment("made-in-first")
    monkeypatch.chdir(second)
    assert settings.client().get_experiment_by_name("made-in-first") is None
    assert (second / "mlflow.db").is_file()


def test_only_a_relative_sqlite_path_is_made_absolute(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert settings.absolute_uri("sqlite:///mlflow.db") == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert settings.absolute_uri("sqlite:////srv/m.db") == "sqlite:////srv/m.db"
    assert settings.absolute_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"

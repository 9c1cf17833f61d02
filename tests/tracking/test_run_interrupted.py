"""What a kill leaves in MLflow, and how the next stage recovers from it, on a real MLflow
SQLite store in a temporary folder.

- A training killed before its first checkpoint leaves its run RUNNING; the next training starts
  over in a new run and ends the abandoned one as FAILED, saying why (tracking.run's `_abandon`,
  tracking.journal's `EndAbandoned`). The kill is a run never closed whose sender stops, as a
  SIGKILL leaves it.
- A process killed while MLflow creates a new SQLite store (its schema migrations) left a store
  no stage could open again; the store is now created whole or not at all
  (tracking.settings.prepare_local_store). The kill is a real SIGKILL, in the middle.

The process-level kills of a whole pipeline are benchmarks/bench_kill.py's (and
tests/e2e/test_kill_recovery.py's).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from clipms.utils.jsonio import write_json
from tracking.run import PipelineRun
from tracking.settings import TrackingFiles


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> TrackingFiles:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("register:\n  experiment: interrupted\n")
    return TrackingFiles(params=tmp_path / "params.yaml", run_file=tmp_path / "run.json",
                         journal_dir=tmp_path / "journal", lock=tmp_path / "dvc.lock",
                         manifest=tmp_path / "manifest.json")


def killed_training(files: TrackingFiles, record: Path) -> PipelineRun:
    """A training that opened its run and was killed before a checkpoint: never closed."""
    run = PipelineRun.open("train", {"lr": 0.001}, files, resume_record=record)
    assert record.exists()  # findable from disk before the run exists on the server
    assert run.flush(timeout=60) and run.run_id is not None  # (a first store takes seconds)
    run.stop_sending(timeout=30)
    return run


def status(run_id: str) -> tuple[str, dict[str, str]]:
    from tracking.settings import client

    found = client().get_run(run_id)
    return found.info.status, found.data.tags


def test_a_run_abandoned_before_its_first_checkpoint_ends_failed(files: TrackingFiles,
                                                                 tmp_path: Path) -> None:
    record = tmp_path / "checkpoints" / "mlflow_run.json"
    first = killed_training(files, record)
    assert status(first.run_id)[0] == "RUNNING"
    again = PipelineRun.open("train", {"lr": 0.001}, files, resume_record=record)
    again.resolve(resumed=False)  # no checkpoint: training starts over in a run of its own
    assert again.close() is True
    assert again.run_id != first.run_id and status(again.run_id)[0] == "FINISHED"
    ended, tags = status(first.run_id)
    assert ended == "FAILED" and tags["error.type"] == "Interrupted"
    assert again.run_key in tags["error.message"]


def test_a_run_that_never_learnt_its_id_is_found_by_its_key(files: TrackingFiles,
                                                          tmp_path: Path) -> None:
    record = tmp_path / "checkpoints" / "mlflow_run.json"
    first = killed_training(files, record)
    write_json(record, {"run_key": first.run_key, "run_id": None, "experiment": "interrupted"})
    again = PipelineRun.open("train", {"lr": 0.002}, files, resume_record=record)
    again.resolve(resumed=False)
    assert again.close() is True
    assert status(first.run_id)[0] == "FAILED"


def test_a_resumed_run_is_continued_and_a_finished_one_left_alone(files: TrackingFiles,
                                                                tmp_path: Path) -> None:
    record = tmp_path / "checkpoints" / "mlflow_run.json"
    first = killed_training(files, record)
    resumed = PipelineRun.open("train", {"lr": 0.001}, files, resume_record=record)
    resumed.resolve(resumed=True)  # a checkpoint of the first: the same run goes on
    assert resumed.close() is True
    assert resumed.run_id == first.run_id and status(first.run_id)[0] == "FINISHED"
    later = PipelineRun.open("train", {"lr": 0.003}, files, resume_record=record)
    later.resolve(resumed=False)  # the earlier run ended well: nothing to mark
    assert later.close() is True
    assert status(first.run_id)[0] == "FINISHED"


HALF_CREATED = """
import os, signal, sys
import mlflow.store.db.utils as db_utils
from tracking import settings

def half_of_the_migrations(engine):  # one table, then the kill: as a SIGKILL mid-way leaves it
    with engine.begin() as connection:
        connection.exec_driver_sql("CREATE TABLE experiments (experiment_id INTEGER)")
    os.kill(os.getpid(), signal.SIGKILL)

db_utils._initialize_tables = half_of_the_migrations
settings.client(sys.argv[1])
"""


@pytest.mark.slow  # kills a child process that creates an MLflow store: ~3-4 CPU-s
def test_a_store_killed_while_being_created_is_created_again_whole(tmp_path: Path) -> None:
    from tracking.settings import client

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    killed = subprocess.run([sys.executable, "-c", HALF_CREATED, uri], capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    left = [p.name for p in tmp_path.iterdir()]
    assert "mlflow.db" not in left and len(left) == 1 and ".tmp-" in left[0], left
    store = client(uri)  # the next stage: a whole store, the killed one's temp file gone
    experiment = store.create_experiment("after-the-kill")
    assert store.get_experiment(experiment).name == "after-the-kill"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db"]

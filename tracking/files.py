"""The files the tracking layer (`tracking.run`) reads and keeps, named by `pipeline.paths`: what
the stages that log to MLflow (train, evaluate, export, register) hand to it."""

# tested by: tests/integration/test_registry_postgres.py

from __future__ import annotations

from pipeline import paths
from tracking.settings import TrackingFiles

FILES = TrackingFiles(params=paths.PARAMS, run_file=paths.MLFLOW_RUN,
                      journal_dir=paths.MLFLOW_JOURNAL, lock=paths.LOCK, manifest=paths.MANIFEST,
                      data_changes=paths.CHANGES_METRICS)

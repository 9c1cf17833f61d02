"""MLflow tracking for the stages: the run a stage logs to, the journal that keeps what could not be
sent, lineage tags, the backend settings."""

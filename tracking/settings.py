"""Where tracking goes and how the registry is configured: the tracking URI, the MLflow client,
the `register` params section, and the files the tracking layer keeps in the project.

The tracking URI is `MLFLOW_TRACKING_URI` when set, else the project's SQLite database
`mlflow.db` (artifacts beside it in `mlartifacts/`). The registry lives in the same store.
"""

# tested by: tests/tracking/test_run_interrupted.py

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field

from clipms.schema import Section
from pipeline.params import load_section

# MLflow's HTTP client retries 7 times with exponential backoff (minutes) before giving up; a stage
# that cannot reach the server should notice in seconds and fall back to the journal instead.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"  # MLflow's store, not a pipeline file
LOCAL_ARTIFACTS_DIR = "mlartifacts"  # beside the SQLite database


@dataclass(frozen=True)
class TrackingFiles:
    """The project files the tracking layer reads and keeps; the stages name them
    (`tracking.files.FILES`, from `pipeline.paths`)."""

    params: Path  # params.yaml: `register.experiment` when a stage does not say
    run_file: Path  # a DVC out of train: the run the later stages log into
    journal_dir: Path  # unsent records, one file per pipeline run
    lock: Path  # dvc.lock: lineage and the params the data stages ran with
    manifest: Path  # the shard manifest: the val digest and the dataset profile
    data_changes: Path | None = None  # the data-change report: logged when train opens the run


class RegisterParams(Section):
    """The `register` section of params.yaml (the register stage, and train for `experiment`)."""

    model_name: str = Field("clip", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    experiment: str = Field("clip-mindspore", min_length=1)  # read by train, which opens the run
    primary_metric: str = "i2t_R@5"
    margin: float = Field(0.0, ge=0.0)
    lock_timeout: float = Field(600.0, gt=0)  # seconds to wait for another registration's gate


def register_params(params_file: Path) -> RegisterParams:
    """The validated `register` section of params.yaml (ParamsError if invalid)."""
    return load_section("register", RegisterParams, params_file)


def project_root() -> Path:
    """The DVC project root: DVC_ROOT when DVC runs the stage (for a queued or `--temp` experiment
    that is the user's repo, not the temporary copy that is deleted afterwards), else the cwd."""
    return Path(os.environ.get("DVC_ROOT") or ".")


def tracking_uri() -> str:
    """`MLFLOW_TRACKING_URI` if set, else the project's SQLite database `mlflow.db`."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    if os.environ.get("DVC_ROOT"):
        return f"sqlite:///{(project_root() / 'mlflow.db').resolve()}"
    return DEFAULT_TRACKING_URI


def absolute_uri(uri: str) -> str:
    """`uri` with a relative SQLite path made absolute against the cwd now."""
    db = sqlite_path(uri)
    return f"sqlite:///{db.resolve()}" if db is not None and not db.is_absolute() else uri


def absolute_tracking_uri() -> str:
    """`tracking_uri()` made absolute: what a long-lived sender binds, so a later change of cwd
    or environment cannot move its store."""
    return absolute_uri(tracking_uri())


def client(uri: str | None = None) -> Any:
    """An MlflowClient for `uri`, by default the tracking URI (the registry lives in the same
    store); a local SQLite store is created whole first, if it does not exist yet. A relative
    SQLite path is resolved against the cwd now: MLflow keeps one store per URI for the life of
    the process, so `sqlite:///mlflow.db` would otherwise stay the database of the first cwd it
    was opened in (a flow served in-process, run after run in other checkouts)."""
    from mlflow import MlflowClient

    uri = absolute_uri(uri or tracking_uri())
    prepare_local_store(uri)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def prepare_local_store(uri: str) -> bool:
    """Create the SQLite store of `uri` whole, if it does not exist yet; True when this call
    made it. MLflow creates a new database by running its schema migrations in place, and a
    process killed in the middle of them (a training killed seconds after it opened its run)
    left a database with the tables of a later migration under an earlier version stamp:
    every later open tried to create those tables again ("table span_metrics already exists"),
    and no stage reached the store again. Here the migrations run on a temp file beside it,
    which becomes the store only when complete (clipms.utils.atomic.atomic_create)."""
    from clipms.utils.atomic import atomic_create

    db = sqlite_path(uri)
    if db is None or db.exists():
        return False
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    with atomic_create(db) as (tmp, created):
        store = SqlAlchemyStore(f"sqlite:///{tmp}", local_artifact_location(uri))
        store.engine.dispose()  # no connection of this process keeps the temp name
    return created[0]


def is_local_store(uri: str) -> bool:
    return uri.startswith(("sqlite:", "file:")) or "://" not in uri


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///PATH` URI (None for any other store)."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri.removeprefix("sqlite:///"))


def local_artifact_location(uri: str | None = None) -> str:
    """Where a new experiment of the local store `uri` (default: the tracking URI) keeps its
    artifacts: `mlartifacts/` beside the SQLite database (so a run started from a temporary copy
    of the project still lands there)."""
    db = sqlite_path(uri or tracking_uri())
    folder = db.parent if db is not None else project_root()
    return (folder / LOCAL_ARTIFACTS_DIR).resolve().as_uri()


# MLflow 3's UI opens an experiment without this tag as a GenAI one ("Agent versions", traces);
# "custom_model_development" is its kind for model training ("Machine learning": runs, models).
EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND = "mlflow.experimentKind", "custom_model_development"


def ensure_experiment(mlflow_client: Any, name: str) -> str:
    """The experiment's id, created if missing (artifacts beside the database for a local store),
    marked as a model-training experiment unless it already says what kind it is."""
    from mlflow.exceptions import MlflowException

    experiment = mlflow_client.get_experiment_by_name(name)
    if experiment is None:
        uri = mlflow_client.tracking_uri
        location = local_artifact_location(uri) if is_local_store(uri) else None
        try:
            return str(mlflow_client.create_experiment(
                name, artifact_location=location, tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND}))
        except MlflowException as err:
            # Another process made it meanwhile, or a slow server made it for a request the
            # client timed out and retried: the experiment exists, which is all that was asked.
            experiment = mlflow_client.get_experiment_by_name(name)
            if err.error_code != "RESOURCE_ALREADY_EXISTS" or experiment is None:
                raise
    if not (experiment.tags or {}).get(EXPERIMENT_KIND_TAG):  # made before this tag existed
        mlflow_client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG,
                                         MODEL_TRAINING_KIND)
    return str(experiment.experiment_id)

"""The tracking journal: typed records of what a pipeline run sends to MLflow, and their file.

Every write of the tracking layer is a record (`CreateRun`, `LogParams`, `SetTags`, `LogMetrics`,
`LogArtifact`, `LogDataset`, `SetStatus`, `EndAbandoned`) queued in memory and sent in order. What
could not be sent is saved as one JSON file per pipeline run in the journal folder
(`models/mlflow-journal/<run_key>.json`) and replayed by the next stage that reaches the server; a
file is deleted only once every record in it was sent.

Records may be sent more than once (a send that timed out may still have reached the server, and
the journal then holds it too), so each is idempotent on the server: metrics and tags are keyed by
their values, params already logged with the same value are skipped, artifacts overwrite, and a
replayed `CreateRun` first looks for the run by its `pipeline.run_key` tag.
"""

# tested by: tests/tracking/test_run_interrupted.py

from __future__ import annotations

import math
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

from clipms.utils.jsonio import read_json, write_json

MAX_METRICS, MAX_PARAMS, MAX_TAGS = 1000, 100, 100  # MLflow's per-request limits for log_batch
MAX_TAG_CHARS = 8000
JOURNAL_VERSION = 1


def mlflow_key(key: str) -> str:
    """A metric/tag/param name MLflow accepts: `@` is not allowed, so `i2t_R@5` -> `i2t_R_at_5`."""
    key = key.replace("@", "_at_")
    return re.sub(r"[^A-Za-z0-9_\-. :/]", "_", key)


def finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class JournalError(ValueError):
    """A journal file that cannot be read back (it is left in place, untouched)."""


class MetricRow(NamedTuple):
    key: str
    value: float
    timestamp: int  # ms since the epoch
    step: int


@dataclass
class CreateRun:
    """Create the run in `experiment` (the journal file's); the first record of a run."""

    kind: ClassVar[str] = "create"
    run_name: str | None
    tags: dict[str, str]


@dataclass
class LogParams:
    kind: ClassVar[str] = "params"
    params: dict[str, str]


@dataclass
class SetTags:
    kind: ClassVar[str] = "tags"
    tags: dict[str, str]


@dataclass
class LogMetrics:
    """Consecutive metric calls share one record until it is sent."""

    kind: ClassVar[str] = "metrics"
    metrics: list[MetricRow] = field(default_factory=list)


@dataclass
class LogArtifact:
    """A file or folder to upload; it must still exist when the record is sent."""

    kind: ClassVar[str] = "artifact"
    path: str
    artifact_path: str | None = None


@dataclass
class LogDataset:
    kind: ClassVar[str] = "dataset"
    dataset: dict[str, str]  # name, digest, source_type, source, profile
    context: str = "training"


@dataclass
class SetStatus:
    """RUNNING (a resumed training run) or a terminal status (FINISHED, FAILED, KILLED)."""

    kind: ClassVar[str] = "status"
    status: str
    end_time: int | None = None


@dataclass
class EndAbandoned:
    """End another run of this checkout as FAILED, if it is still RUNNING: a training that was
    killed before it wrote a checkpoint to resume from, superseded by the run this record is
    queued in. Found by its id, or by its `run_key` tag when it never learnt its id. A run that
    has ended already is left as it is, so sending this twice is harmless."""

    kind: ClassVar[str] = "end_abandoned"
    run_key: str
    run_id: str | None
    experiment: str
    reason: str


Record = (CreateRun | LogParams | SetTags | LogMetrics | LogArtifact | LogDataset | SetStatus
          | EndAbandoned)
RECORD_TYPES: dict[str, type[Any]] = {t.kind: t for t in (
    CreateRun, LogParams, SetTags, LogMetrics, LogArtifact, LogDataset, SetStatus, EndAbandoned)}


def record_to_json(record: Record) -> dict[str, Any]:
    out = {"kind": record.kind, **asdict(record)}
    if isinstance(record, LogMetrics):
        out["metrics"] = [list(row) for row in record.metrics]
    return out


def record_from_json(data: dict[str, Any]) -> Record:
    """A record from its JSON form; an unknown kind or field is a JournalError."""
    fields = dict(data)
    kind = fields.pop("kind", None) or fields.pop("op", None)  # `op`: the journal before v1
    record_type = RECORD_TYPES.get(str(kind))
    if record_type is None:
        raise JournalError(f"unknown journal record kind {kind!r} (known: {sorted(RECORD_TYPES)})")
    if record_type is LogMetrics:
        fields["metrics"] = [MetricRow(str(k), float(v), int(ts), int(step))
                             for k, v, ts, step in fields.get("metrics", [])]
    try:
        return record_type(**fields)
    except TypeError as err:
        raise JournalError(f"bad {kind!r} journal record {data!r}: {err}") from None


def now_ms() -> int:
    return int(time.time() * 1000)


# ---------------------------------------------------------------------------------------------
# sending one record


def send(record: Record, mlflow_client: Any, run_id: str) -> None:
    """Apply one record to run `run_id` (a CreateRun is handled by the caller)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag

    if isinstance(record, LogMetrics):
        rows = record.metrics
        while rows:  # drop each chunk once sent, so a failure never resends it
            chunk = [Metric(*row) for row in rows[:MAX_METRICS]]
            mlflow_client.log_batch(run_id, metrics=chunk, synchronous=True)
            del rows[:MAX_METRICS]
    elif isinstance(record, LogParams):
        existing = mlflow_client.get_run(run_id).data.params
        fresh = [Param(k, v) for k, v in record.params.items() if k not in existing]
        for i in range(0, len(fresh), MAX_PARAMS):
            mlflow_client.log_batch(run_id, params=fresh[i:i + MAX_PARAMS])
        changed = {k: v for k, v in record.params.items() if k in existing and existing[k] != v}
        if changed:  # params are immutable in MLflow: a rerun's new values become tags
            send(SetTags({f"rerun_param.{k}": v for k, v in changed.items()}), mlflow_client,
                 run_id)
    elif isinstance(record, SetTags):
        items = [RunTag(k, v[:MAX_TAG_CHARS]) for k, v in record.tags.items()]
        for i in range(0, len(items), MAX_TAGS):
            mlflow_client.log_batch(run_id, tags=items[i:i + MAX_TAGS])
    elif isinstance(record, LogArtifact):
        path = Path(record.path)
        if path.is_dir():
            mlflow_client.log_artifacts(run_id, str(path), record.artifact_path)
        elif path.exists():
            mlflow_client.log_artifact(run_id, str(path), record.artifact_path)
        else:
            print(f"[mlflow] WARNING: {path} no longer exists; artifact not logged",
                  file=sys.stderr)
    elif isinstance(record, LogDataset):
        d = record.dataset
        dataset = Dataset(d["name"], d["digest"], d["source_type"], d["source"],
                          profile=d.get("profile"))
        tags = [InputTag("mlflow.data.context", record.context)]
        mlflow_client.log_inputs(run_id, datasets=[DatasetInput(dataset, tags)])
    elif isinstance(record, SetStatus):
        if record.status == "RUNNING":
            mlflow_client.update_run(run_id, status="RUNNING")
        else:
            mlflow_client.set_terminated(run_id, record.status, record.end_time)
    else:
        raise TypeError(f"cannot send {record!r}")


# ---------------------------------------------------------------------------------------------
# the file


@dataclass
class Journal:
    """The unsent records of one pipeline run (`run_key`), as saved between stages."""

    run_key: str
    run_id: str | None
    experiment: str
    records: list[Record] = field(default_factory=list)

    @staticmethod
    def path(folder: Path, run_key: str) -> Path:
        return Path(folder) / f"{run_key}.json"

    def save(self, folder: Path) -> Path:
        """Write the journal (atomically); an empty one is removed instead: nothing is left."""
        target = self.path(folder, self.run_key)
        if not self.records:
            target.unlink(missing_ok=True)
            return target
        write_json(target, {"version": JOURNAL_VERSION, "run_key": self.run_key,
                            "run_id": self.run_id, "experiment": self.experiment,
                            "records": [record_to_json(r) for r in self.records]})
        return target

    @classmethod
    def load(cls, path: Path, default_experiment: str = "") -> Journal:
        try:
            data = read_json(path)
        except (OSError, ValueError) as err:
            raise JournalError(f"{path}: unreadable journal ({err}); left in place") from None
        records = data.get("records", data.get("pending", []))  # `pending`: before v1
        return cls(str(data["run_key"]), data.get("run_id"),
                   str(data.get("experiment") or default_experiment),
                   [record_from_json(r) for r in records])

    @classmethod
    def find(cls, folder: Path, run_key: str) -> Journal | None:
        path = cls.path(folder, run_key)
        return cls.load(path) if path.exists() else None

    @staticmethod
    def all_paths(folder: Path) -> list[Path]:
        """Every journal file in `folder`, oldest first."""
        if not Path(folder).is_dir():
            return []
        files = [p for p in Path(folder).glob("*.json") if not p.name.startswith(".")]
        return sorted(files, key=lambda p: p.stat().st_mtime)

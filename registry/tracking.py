"""One MLflow run per pipeline run, threaded through the stages by a small file DVC tracks.

`train` opens the run (`PipelineRun.open`) and writes its id to `models/mlflow_run.json` (a DVC out
of train, so a rerun or `dvc exp run` carries the right id and `dvc checkout` restores it);
`evaluate`, `export` and `register` continue it (`PipelineRun.resume` / `log_stage`).

Nothing here may cost a trained model. Every write is queued locally and sent in batches
(`log_batch`, at most one request every `flush_every_s` during training). When the tracking server
is unreachable the stage still succeeds: what could not be sent is saved in
`models/mlflow_journal.json` with a warning, and the next stage that reaches the server replays it
(creating the run first if the server was already down when training started). Only `register`
needs the server - it replays the journal before registering, and fails with a message naming the
URI if it still cannot reach it.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml

from clipms.jsonio import read_json, write_json

# MLflow's HTTP client retries 7 times with exponential backoff (minutes) before giving up; a stage
# that cannot reach the server should notice in seconds and fall back to the journal instead.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
LOCAL_ARTIFACTS_DIR = Path("mlartifacts")
RUN_FILE = Path("models/mlflow_run.json")
JOURNAL_FILE = Path("models/mlflow_journal.json")
DEFAULT_EXPERIMENT = "clip-mindspore"
# Stages that never talk to MLflow: their resolved params are taken from dvc.lock by `open`.
DATA_STAGES = ("metadata", "dedupe", "download", "shard", "tokenizer")
# MLflow's per-request limits for log_batch.
MAX_METRICS, MAX_PARAMS, MAX_TAGS = 1000, 100, 100
SECRET_KEY = re.compile(r"(password|passwd|secret|credential|api_?key|(^|_)token$)", re.IGNORECASE)


def mlflow_key(key: str) -> str:
    """A metric/tag/param name MLflow accepts: `@` is not allowed, so `i2t_R@5` -> `i2t_R_at_5`."""
    key = key.replace("@", "_at_")
    return re.sub(r"[^A-Za-z0-9_\-. :/]", "_", key)


class TrackingUnavailable(RuntimeError):
    """The tracking server could not be reached; the message says what is safe and what to do."""


def experiment_from_params(path: Path = Path("params.yaml")) -> str:
    """`register.experiment` from params.yaml (the default experiment when absent)."""
    if not path.exists():
        return DEFAULT_EXPERIMENT
    section = (yaml.safe_load(path.read_text()) or {}).get("register") or {}
    return str(section.get("experiment") or DEFAULT_EXPERIMENT)


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


def redact_uri(uri: str) -> str:
    """The URI without user:password@, so it can be written to files and logs."""
    parts = urlsplit(uri)
    if parts.username or parts.password:
        host = parts.hostname or ""
        netloc = f"{host}:{parts.port}" if parts.port else host
        return urlunsplit(parts._replace(netloc=netloc))
    return uri


def client() -> Any:
    """An MlflowClient for the tracking URI (the registry lives in the same store)."""
    from mlflow import MlflowClient

    uri = tracking_uri()
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def is_local_store(uri: str) -> bool:
    return uri.startswith(("sqlite:", "file:")) or "://" not in uri


# ---------------------------------------------------------------------------------------------
# params and lineage


def flatten(prefix: str, value: Any) -> dict[str, str]:
    """{"train.lr": "0.0005", "export.batch_sizes": "[1, 7, 32]"} from nested mappings."""
    if isinstance(value, Mapping):
        out: dict[str, str] = {}
        for key, sub in value.items():
            out.update(flatten(f"{prefix}.{key}" if prefix else str(key), sub))
        return out
    if isinstance(value, list | tuple):
        return {prefix: json.dumps(list(value))}
    return {prefix: str(value)}


def safe_params(params: Mapping[str, str]) -> dict[str, str]:
    """Drop what must never be logged: secrets, credentials in URLs, the user's home directory."""
    home = str(Path.home())
    out = {}
    for key, value in params.items():
        leaf = key.rsplit(".", 1)[-1]
        if SECRET_KEY.search(leaf):
            value = "<redacted>"
        elif "://" in value:
            value = redact_uri(value)
        if home not in ("", "/") and home in value:
            value = value.replace(home, "~")
        out[key] = value[:6000]  # MLflow's limit on a param value
    return out


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def read_lock(path: Path = Path("dvc.lock")) -> dict[str, Any]:
    """dvc.lock's stages, or {} when the pipeline has not been locked yet."""
    if not path.exists():
        return {}
    return (yaml.safe_load(path.read_text()) or {}).get("stages", {})


def lock_hash(lock: Mapping[str, Any], out_path: str) -> str | None:
    """The DVC hash (md5, `.dir` suffix dropped) of an out path in dvc.lock. For a folder whose
    parts are separate outs (data/shards/train, .../val, .../manifest.json), the md5 of their
    sorted "path md5" lines: it changes exactly when one of their DVC hashes changes."""
    import hashlib

    found = {}
    for stage in lock.values():
        for out in stage.get("outs", []):
            path, md5 = out.get("path", ""), out.get("md5")
            if md5 and (path == out_path or path.startswith(out_path.rstrip("/") + "/")):
                found[path] = str(md5).removesuffix(".dir")
    if not found:
        return None
    if list(found) == [out_path]:
        return found[out_path]
    lines = "\n".join(f"{path} {md5}" for path, md5 in sorted(found.items()))
    return hashlib.md5(lines.encode()).hexdigest()


def lock_params(lock: Mapping[str, Any], stages: Iterable[str]) -> dict[str, str]:
    """The params each stage actually ran with, as dvc.lock recorded them, flattened."""
    out: dict[str, str] = {}
    for name in stages:
        for values in lock.get(name, {}).get("params", {}).values():
            out.update(flatten("", values))
    return out


def val_digest(manifest: Path = Path("data/shards/manifest.json")) -> str | None:
    """A digest of the evaluation set: sha256 over the val shards' names and sha256s."""
    import hashlib

    if not manifest.exists():
        return None
    shards = read_json(manifest).get("splits", {}).get("val", {}).get("shards", [])
    if not shards:
        return None
    lines = sorted(f"{s['name']}:{s['sha256']}" for s in shards)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:32]


def lineage(lock: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Tags that say exactly what a run was made from: code, data and tokenizer versions."""
    lock = read_lock() if lock is None else lock
    meta = lock.get("metadata", {}).get("params", {}).get("params.yaml", {}).get("metadata", {})
    source = str(meta.get("source", "unknown"))
    where = {"mscoco": meta.get("url"), "local": meta.get("path")}.get(source)
    tags = {
        "lineage.git_commit": _git("rev-parse", "HEAD"),
        "lineage.git_dirty": _dirty(),
        "lineage.data_shards_md5": lock_hash(lock, "data/shards"),
        "lineage.tokenizer_md5": lock_hash(lock, "models/tokenizer.json"),
        "lineage.metadata_source": source,
        "lineage.metadata_location": where,
        "lineage.metadata_md5": lock_hash(lock, "data/metadata.parquet"),
        "lineage.metadata_sha256": meta.get("sha256"),
        "lineage.val_digest": val_digest(),
    }
    if tags["lineage.git_commit"]:
        tags["mlflow.source.git.commit"] = tags["lineage.git_commit"]
    return safe_params({k: str(v) for k, v in tags.items() if v is not None})


def dvc_experiment_tags() -> dict[str, str]:
    """The DVC experiment this run belongs to, when DVC says so (queued/temp experiments)."""
    names = {"DVC_EXP_NAME": "dvc.exp_name", "DVC_EXP_BASELINE_REV": "dvc.exp_baseline_rev"}
    return {tag: os.environ[env] for env, tag in names.items() if os.environ.get(env)}


def _dirty() -> str | None:
    status = _git("status", "--porcelain", "--untracked-files=no")
    return None if status is None else str(bool(status)).lower()


def dataset_record(tags: Mapping[str, str]) -> dict[str, str] | None:
    """The shards as an MLflow dataset input: name, digest = DVC hash, source = their origin."""
    digest = tags.get("lineage.data_shards_md5")
    if not digest:
        return None
    source = tags.get("lineage.metadata_source", "unknown")
    location = tags.get("lineage.metadata_location")
    if source == "mscoco" and location:
        source_type, uri = "http", location
    elif source == "local" and location:
        source_type, uri = "local", location
    else:
        source_type, uri = "code", f"clipms.prep ({source} metadata)"
    manifest = Path("data/shards/manifest.json")
    splits = read_json(manifest).get("splits", {}) if manifest.exists() else {}
    profile = {name: split.get("samples") for name, split in splits.items()}
    return {"name": f"{source}-shards", "digest": digest[:36], "source_type": source_type,
            "source": json.dumps({"uri": uri}), "profile": json.dumps(profile)}


# ---------------------------------------------------------------------------------------------
# the run


class PipelineRun:
    """The MLflow run of one pipeline run, with a local queue of what has not been sent yet."""

    def __init__(self, run_key: str, run_id: str | None, experiment: str,
                 pending: list[dict[str, Any]] | None = None) -> None:
        self.run_key = run_key
        self.run_id = run_id
        self.experiment = experiment
        self.pending: list[dict[str, Any]] = pending or []
        self.last_error: str | None = None
        self.owns_run_file = False  # only train (which opened the run) writes its DVC out
        self._monitor: Any = None

    # -- opening ---------------------------------------------------------------------------

    @classmethod
    def open(cls, stage: str, params: Mapping[str, Any], experiment: str | None = None,
             run_name: str | None = None, run_file: Path | None = RUN_FILE) -> PipelineRun:
        """Start the run of a new pipeline run (the train stage): params, lineage, dataset input.

        The experiment defaults to `register.experiment` in params.yaml. `run_file=None` (a stage
        other than train) keeps the run in memory instead of writing train's DVC out.
        """
        JOURNAL_FILE.unlink(missing_ok=True)  # a new run: an old journal belongs to an old run
        run = cls(uuid.uuid4().hex, None, experiment or experiment_from_params())
        lock = read_lock()
        tags = {**lineage(lock), **dvc_experiment_tags()}
        run_name = run_name or os.environ.get("DVC_EXP_NAME")  # `dvc exp run` names the run
        run.pending.append({"op": "create", "run_name": run_name, "tags": {
            **tags, "pipeline.run_key": run.run_key, "pipeline.opened_by": stage}})
        run.log_params(lock_params(lock, DATA_STAGES))
        run.log_params(flatten(stage, dict(params)))
        dataset = dataset_record(tags)
        if dataset:
            run.pending.append({"op": "dataset", "dataset": dataset, "context": "training"})
        run.owns_run_file = run_file is not None
        run.flush()
        if run.owns_run_file:
            run.save()
        return run

    @classmethod
    def resume(cls, run_file: Path = RUN_FILE) -> PipelineRun:
        """Continue the run that train opened, with anything earlier stages could not send."""
        if not run_file.exists():
            raise FileNotFoundError(f"{run_file}: no MLflow run to continue (run the train stage)")
        info = read_json(run_file)
        run = cls(info["run_key"], info.get("run_id"), info.get("experiment", DEFAULT_EXPERIMENT))
        if JOURNAL_FILE.exists():
            journal = read_json(JOURNAL_FILE)
            if journal.get("run_key") == run.run_key:
                run.run_id = run.run_id or journal.get("run_id")
                run.pending = journal.get("pending", [])
        return run

    # -- queueing ----------------------------------------------------------------------------

    def log_params(self, params: Mapping[str, str]) -> None:
        if params:
            clean = {mlflow_key(k): v for k, v in safe_params(params).items()}
            self.pending.append({"op": "params", "params": clean})

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if tags:
            self.pending.append({"op": "tags",
                                 "tags": {mlflow_key(k): str(v) for k, v in tags.items()}})

    def log_metrics(self, metrics: Mapping[str, float], step: int = 0) -> None:
        """Queue metrics; consecutive calls share one batch until it is sent. Non-numbers and
        NaN/inf are skipped: one rejected value would make the server refuse the whole batch."""
        now = int(time.time() * 1000)
        rows = [[mlflow_key(k), float(v), now, int(step)] for k, v in metrics.items()
                if _finite_number(v)]
        if not rows:
            return
        if self.pending and self.pending[-1]["op"] == "metrics":
            self.pending[-1]["metrics"].extend(rows)
        else:
            self.pending.append({"op": "metrics", "metrics": rows})

    def log_artifact(self, path: Path | str, artifact_path: str | None = None) -> None:
        """Queue a file or folder for upload (it must still exist when it is sent)."""
        if Path(path).exists():
            self.pending.append({"op": "artifact", "path": str(path),
                                 "artifact_path": artifact_path})

    def queued_metrics(self) -> int:
        return sum(len(op["metrics"]) for op in self.pending if op["op"] == "metrics")

    # -- sending -----------------------------------------------------------------------------

    def flush(self) -> bool:
        """Send what is queued, in order; on any failure keep the rest queued and return False."""
        try:
            mlflow_client = client()
            while self.pending:
                op = self.pending[0]
                if op["op"] == "create":
                    self.run_id = self._create(mlflow_client, op)
                else:
                    self._require_run()
                    self._send_or_drop(mlflow_client, op)
                self.pending.pop(0)
        except Exception as err:  # an unreachable server surfaces as many exception types
            self.last_error = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            return False
        self.last_error = None
        return True

    def _send_or_drop(self, mlflow_client: Any, op: dict[str, Any]) -> None:
        """Send one record; one the server rejects as invalid is reported and dropped, because
        replaying it would fail forever and block everything queued behind it."""
        from mlflow.exceptions import MlflowException

        try:
            self._send(mlflow_client, op)
        except MlflowException as err:
            if err.error_code != "INVALID_PARAMETER_VALUE":
                raise
            print(f"[mlflow] WARNING: dropped a {op['op']} record the server rejected: "
                  f"{str(err).splitlines()[0][:300]}", file=sys.stderr)

    def _require_run(self) -> None:
        if self.run_id is None:
            raise TrackingUnavailable("the MLflow run has not been created yet")

    def _create(self, mlflow_client: Any, op: dict[str, Any]) -> str:
        experiment_id = ensure_experiment(mlflow_client, self.experiment)
        run = mlflow_client.create_run(experiment_id, tags=op["tags"], run_name=op.get("run_name"))
        return str(run.info.run_id)

    def _send(self, mlflow_client: Any, op: dict[str, Any]) -> None:
        from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag

        kind = op["op"]
        if kind == "metrics":
            rows = op["metrics"]
            while rows:  # drop each chunk once sent, so a failure never resends it
                chunk = [Metric(k, v, ts, step) for k, v, ts, step in rows[:MAX_METRICS]]
                mlflow_client.log_batch(self.run_id, metrics=chunk, synchronous=True)
                del rows[:MAX_METRICS]
        elif kind == "params":
            fresh, changed = self._split_params(mlflow_client, op["params"])
            items = [Param(k, v) for k, v in fresh.items()]
            for i in range(0, len(items), MAX_PARAMS):
                mlflow_client.log_batch(self.run_id, params=items[i:i + MAX_PARAMS])
            if changed:  # params are immutable in MLflow: a rerun's new values become tags
                self._send(mlflow_client, {"op": "tags", "tags": {
                    f"rerun_param.{k}": v for k, v in changed.items()}})
        elif kind == "tags":
            items = [RunTag(k, v[:8000]) for k, v in op["tags"].items()]
            for i in range(0, len(items), MAX_TAGS):
                mlflow_client.log_batch(self.run_id, tags=items[i:i + MAX_TAGS])
        elif kind == "artifact":
            path = Path(op["path"])
            if path.is_dir():
                mlflow_client.log_artifacts(self.run_id, str(path), op.get("artifact_path"))
            elif path.exists():
                mlflow_client.log_artifact(self.run_id, str(path), op.get("artifact_path"))
        elif kind == "dataset":
            d = op["dataset"]
            dataset = Dataset(d["name"], d["digest"], d["source_type"], d["source"],
                              profile=d.get("profile"))
            tags = [InputTag("mlflow.data.context", op.get("context", "training"))]
            mlflow_client.log_inputs(self.run_id, datasets=[DatasetInput(dataset, tags)])
        elif kind == "status":
            mlflow_client.set_terminated(self.run_id, op["status"], op.get("end_time"))
        else:
            raise ValueError(f"unknown journal operation {kind!r}")

    def _split_params(self, mlflow_client: Any,
                      params: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
        existing = mlflow_client.get_run(self.run_id).data.params
        fresh = {k: v for k, v in params.items() if k not in existing}
        changed = {k: v for k, v in params.items() if k in existing and existing[k] != v}
        return fresh, changed

    # -- training callback and system metrics ----------------------------------------------

    def callback(self, flush_every_s: float = 10.0, prefix: str = "") -> TrainCallback:
        return TrainCallback(self, flush_every_s=flush_every_s, prefix=prefix)

    def start_system_metrics(self, sampling_interval: float = 5.0) -> None:
        """CPU/memory/disk/network of this machine, logged into the run while it trains."""
        if self.run_id is None:
            return
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._monitor = SystemMetricsMonitor(self.run_id, sampling_interval=sampling_interval,
                                                 tracking_uri=tracking_uri())
            self._monitor.start()
        except Exception as err:  # optional: never let monitoring stop training
            print(f"[mlflow] system metrics disabled: {err}", file=sys.stderr)
            self._monitor = None

    def stop_system_metrics(self) -> None:
        if self._monitor is not None:
            try:
                self._monitor.finish()
            except Exception as err:
                print(f"[mlflow] system metrics monitor did not stop cleanly: {err}",
                      file=sys.stderr)
            self._monitor = None

    # -- closing -------------------------------------------------------------------------------

    def close(self, status: str = "FINISHED") -> bool:
        """Set the run's status, send everything, journal what failed; True if all was sent."""
        self.stop_system_metrics()
        self.pending.append({"op": "status", "status": status,
                             "end_time": int(time.time() * 1000)})
        sent = self.flush()
        if self.owns_run_file:
            self.save()
        else:
            self.save_journal()
        if not sent:
            print(f"[mlflow] WARNING: could not send to the tracking server "
                  f"{redact_uri(tracking_uri())} ({self.last_error}); "
                  f"{len(self.pending)} queued record(s) saved to "
                  f"{JOURNAL_FILE}; they are replayed by the next stage that reaches the server "
                  "(register requires it). Model files are unaffected.", file=sys.stderr)
        return sent

    def save(self) -> None:
        """Write the run file (train's DVC out) and the journal."""
        uri = tracking_uri()
        write_json(RUN_FILE, {"run_key": self.run_key, "run_id": self.run_id,
                              "experiment": self.experiment,  # no local paths in a DVC out:
                              "tracking_uri": DEFAULT_TRACKING_URI if is_local_store(uri)
                              else redact_uri(uri)})
        self.save_journal()

    def save_journal(self) -> None:
        if self.pending:
            write_json(JOURNAL_FILE, {"run_key": self.run_key, "run_id": self.run_id,
                                      "pending": self.pending})
        elif JOURNAL_FILE.exists():
            # Keep the resolved run id for later stages when train could not create the run.
            write_json(JOURNAL_FILE, {"run_key": self.run_key, "run_id": self.run_id,
                                      "pending": []})

    def require_sent(self) -> None:
        """Raise TrackingUnavailable unless the run exists and nothing is left queued."""
        if not self.flush() or self.run_id is None:
            self.save_journal()
            raise TrackingUnavailable(
                f"cannot reach the MLflow tracking server at {redact_uri(tracking_uri())} "
                f"({self.last_error}). The trained and exported model is safe in models/; "
                f"{len(self.pending)} queued record(s) are kept in {JOURNAL_FILE}. Start the "
                "server (or fix MLFLOW_TRACKING_URI) and rerun `dvc repro` to replay and register.")
        self.save_journal()  # records the run id if this replay created the run


class TrainCallback:
    """Trainer callback: per-step metrics queued and sent with log_batch every `flush_every_s`."""

    def __init__(self, run: PipelineRun, flush_every_s: float = 10.0, prefix: str = "",
                 retry_after_s: float = 60.0) -> None:
        self.run = run
        self.flush_every_s = flush_every_s
        self.retry_after_s = retry_after_s  # after a failure, do not stall training on every step
        self.prefix = prefix
        self._next_flush = time.monotonic() + flush_every_s

    def on_step_end(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log_metrics({self.prefix + k: v for k, v in metrics.items()
                              if k != "step" and _finite_number(v)}, step=step)
        if time.monotonic() >= self._next_flush:
            ok = self.run.flush()
            wait = self.flush_every_s if ok else self.retry_after_s
            self._next_flush = time.monotonic() + wait

    def on_train_end(self, summary: Mapping[str, float]) -> None:
        final = {k if k.startswith("train") else f"train_{k}": v for k, v in summary.items()}
        self.run.log_metrics({k: v for k, v in final.items() if _finite_number(v)})
        self.run.flush()


def _finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def ensure_experiment(mlflow_client: Any, name: str) -> str:
    """The experiment's id, created if missing (artifacts under ./mlartifacts for a local store)."""
    experiment = mlflow_client.get_experiment_by_name(name)
    if experiment is not None:
        return str(experiment.experiment_id)
    location = None
    if is_local_store(tracking_uri()):
        location = (project_root() / LOCAL_ARTIFACTS_DIR).resolve().as_uri()
    return str(mlflow_client.create_experiment(name, artifact_location=location))


def log_stage(stage: str, params: Mapping[str, Any], metrics: Mapping[str, float] | None = None,
              artifacts: Iterable[tuple[Path | str, str | None]] = ()) -> PipelineRun | None:
    """What evaluate/export call at their end: params, metrics, artifacts into the pipeline's run.

    Never fails the stage over tracking: without a run file (train ran without tracking) it only
    warns; an unreachable server leaves everything in the journal for `register` to replay.
    """
    try:
        run = PipelineRun.resume()
    except FileNotFoundError as err:
        print(f"[mlflow] WARNING: {err}; {stage} not tracked", file=sys.stderr)
        return None
    run.log_params(flatten(stage, dict(params)))
    if metrics:
        run.log_metrics(metrics)
    for path, artifact_path in artifacts:
        run.log_artifact(path, artifact_path)
    run.close()
    return run

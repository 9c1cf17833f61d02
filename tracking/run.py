"""One MLflow run per pipeline run, threaded through the stages by a small file DVC tracks.

`train` opens the run (`PipelineRun.open`) and writes its id to `models/mlflow_run.json` (a DVC out
of train, so a rerun or `dvc exp run` carries the right id and `dvc checkout` restores it);
`evaluate`, `export` and `register` continue it (`PipelineRun.resume` / `log_stage`).

Nothing here may cost a trained model or stall training. Every write is a journal record
(`tracking.journal`) queued in memory; one background thread per run (`tracking.sender`) sends the
queue in order, so the training loop never waits on the network (a step only appends to a list). A
server that stops answering costs a stage at most `OPEN_TIMEOUT_S` when train opens the run and
`CLOSE_TIMEOUT_S` (+ `MONITOR_STOP_TIMEOUT_S`) when it ends; what was not sent by then is saved in
the journal folder with a warning, and the next stage that reaches the server replays it (creating
the run first if the server was already down when training started). Only `register` needs it.

A training run that resumes from a checkpoint continues the MLflow run that wrote the checkpoint
(`resume_record`, a small file beside the checkpoints), and a run that fails ends as FAILED with
its error recorded (`failure_recorded`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import traceback
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from clipms.utils.jsonio import read_json, write_json
from clipms.utils.redact import redact_text, redact_url
from tracking.journal import (
    CreateRun,
    EndAbandoned,
    Journal,
    JournalError,
    LogArtifact,
    LogDataset,
    LogMetrics,
    LogParams,
    MetricRow,
    Record,
    SetStatus,
    SetTags,
    finite_number,
    mlflow_key,
    now_ms,
)
from tracking.lineage import (
    DATA_STAGES,
    data_change_metrics,
    dataset_record,
    dvc_experiment_tags,
    flatten,
    lineage,
    lock_params,
    read_lock,
    safe_params,
)
from tracking.sender import CLOSE_TIMEOUT_S, RUN_KEY_TAG, RecordSender, TrackingUnavailable
from tracking.settings import (
    DEFAULT_TRACKING_URI,
    TrackingFiles,
    is_local_store,
    register_params,
)

# How long a stage waits for a server that has stopped answering (no record sent for that long),
# besides CLOSE_TIMEOUT_S when it ends (tracking.sender):
OPEN_TIMEOUT_S = 5.0  # when train opens the run (then training starts; the sender keeps trying)
REPLAY_TIMEOUT_S = 10.0  # for the journals of earlier runs, replayed when a new run opens
MONITOR_STOP_TIMEOUT_S = 5.0  # for the system-metrics monitor's last upload
MAX_ERROR_CHARS = 5000


class Terminated(BaseException):
    """SIGTERM arrived (a cancelled flow run, a stopped worker): unwind and record the failure."""



class PipelineRun(RecordSender):
    """The MLflow run of one pipeline run, with a local queue of what has not been sent yet
    (sent in order by `tracking.sender.RecordSender`)."""

    def __init__(self, run_key: str, run_id: str | None, experiment: str, files: TrackingFiles,
                 records: Iterable[Record] = ()) -> None:
        super().__init__(run_key, run_id, experiment, records)
        self.files = files
        self.owns_run_file = False  # only train (which opened the run) writes its DVC out
        self.resume_record: Path | None = None  # train: which run wrote the checkpoints
        self._earlier: dict[str, Any] | None = None  # the run a resumed training continues
        self._monitor_interval: float | None = None
        self._monitor: Any = None

    # -- opening ---------------------------------------------------------------------------

    @classmethod
    def open(cls, stage: str, params: Mapping[str, Any], files: TrackingFiles,
             experiment: str | None = None, run_name: str | None = None,
             owns_run_file: bool = True, resume_record: Path | None = None) -> PipelineRun:
        """Start the run of a new pipeline run (the train stage): params, lineage, dataset input.

        The experiment defaults to `register.experiment` in params.yaml. `owns_run_file=False` (a
        stage other than train) keeps the run in memory instead of writing train's DVC out.
        `resume_record` (train: a file beside the checkpoints) names the run that wrote the
        checkpoints; when training turns out to resume from one (`resolve`), that run continues.
        """
        replay_journals(files)  # earlier runs' unsent records go first, and are never dropped
        run = cls(uuid.uuid4().hex, None,
                  experiment or register_params(files.params).experiment, files)
        lock = read_lock(files.lock)
        tags = {**lineage(lock, files.manifest), **dvc_experiment_tags()}
        run_name = run_name or os.environ.get("DVC_EXP_NAME")  # `dvc exp run` names the run
        run.pending.append(CreateRun(run_name, {**tags, RUN_KEY_TAG: run.run_key,
                                                "pipeline.opened_by": stage}))
        run.log_params(lock_params(lock, DATA_STAGES))
        run.log_params(flatten(stage, dict(params)))
        dataset = dataset_record(tags, files.manifest)
        if dataset:
            run.pending.append(LogDataset(dataset, "training"))
        run.log_data_changes()
        run.owns_run_file = owns_run_file
        run.resume_record = resume_record
        if resume_record is not None and resume_record.exists():
            run._earlier = read_json(resume_record)
            run._held = True  # until the first training step says whether it resumed
        else:
            if run.owns_run_file:  # its key on disk before it exists on the server: a kill
                run.save()         # right after it is created still leaves it findable
            run.flush(OPEN_TIMEOUT_S)
        if run.owns_run_file and not run._held:
            run.save()
        return run

    @classmethod
    def resume(cls, files: TrackingFiles) -> PipelineRun:
        """Continue the run that train opened, with anything earlier stages could not send."""
        if not files.run_file.exists():
            raise FileNotFoundError(
                f"{files.run_file}: no MLflow run to continue (run the train stage)")
        info = read_json(files.run_file)
        run = cls(info["run_key"], info.get("run_id"),
                  info.get("experiment") or register_params(files.params).experiment, files)
        saved = Journal.find(files.journal_dir, run.run_key)
        if saved is not None:
            run.run_id = run.run_id or saved.run_id
            run.pending = saved.records
        return run

    def resolve(self, resumed: bool) -> None:
        """Train's first step is known: continue the earlier run if training resumed from its
        checkpoint, else create a new one. Sending starts here."""
        with self._lock:
            if not self._held:
                return
            earlier, self._earlier, self._held = self._earlier, None, False
            if resumed and earlier and earlier.get("run_key"):
                self._continue(earlier)
            elif earlier and earlier.get("run_key") not in (None, self.run_key):
                self._abandon(earlier)
        if self.owns_run_file:
            self.save()
        self.flush(timeout=0)

    def _continue(self, earlier: dict[str, Any]) -> None:
        """Take over the earlier run's identity: its id (or, if it never reached the server,
        its queued records, creation first), then mark it RUNNING again."""
        self.run_key = str(earlier["run_key"])
        self.run_id = earlier.get("run_id")
        saved = Journal.find(self.files.journal_dir, self.run_key)
        head: list[Record] = saved.records if saved else []
        mine = [r for r in self.pending if not isinstance(r, CreateRun | LogDataset)]
        if self.run_id is None and not any(isinstance(r, CreateRun) for r in head):
            # It never reached the server, or its journal is gone: create (or find) it now.
            head = [CreateRun(r.run_name, {**r.tags, RUN_KEY_TAG: self.run_key})
                    for r in self.pending if isinstance(r, CreateRun)]
        self.pending = [*head, SetStatus("RUNNING"), *mine,
                        SetTags({"pipeline.resumed": "true"})]

    def _abandon(self, earlier: dict[str, Any]) -> None:
        """The earlier run is not continued (no checkpoint of it to resume): if its training was
        killed, it would stay RUNNING for ever; end it as FAILED, naming this run."""
        self.pending.append(EndAbandoned(
            str(earlier["run_key"]), earlier.get("run_id"),
            str(earlier.get("experiment") or self.experiment),
            f"interrupted before a checkpoint it could resume from; training started over in "
            f"the run tagged {RUN_KEY_TAG}={self.run_key}"))

    # -- queueing ----------------------------------------------------------------------------

    def _queue(self, record: Record) -> None:
        with self._lock:
            self.pending.append(record)

    def log_params(self, params: Mapping[str, str]) -> None:
        if params:
            self._queue(LogParams({mlflow_key(k): v for k, v in safe_params(params).items()}))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if tags:
            self._queue(SetTags({mlflow_key(k): str(v) for k, v in tags.items()}))

    def log_metrics(self, metrics: Mapping[str, float], step: int = 0) -> None:
        """Queue metrics; consecutive calls share one batch until it is sent. Non-numbers and
        NaN/inf are skipped: one rejected value would make the server refuse the whole batch."""
        now = now_ms()
        rows = [MetricRow(mlflow_key(k), float(v), now, int(step)) for k, v in metrics.items()
                if finite_number(v)]
        if not rows:
            return
        with self._lock:
            if self.pending and isinstance(self.pending[-1], LogMetrics):
                self.pending[-1].metrics.extend(rows)
            else:
                self.pending.append(LogMetrics(rows))

    def log_artifact(self, path: Path | str, artifact_path: str | None = None) -> None:
        """Queue a file or folder for upload (it must still exist when it is sent)."""
        if Path(path).exists():
            self._queue(LogArtifact(str(path), artifact_path))

    def log_data_changes(self) -> None:
        """The data-change report the run trains on (`files.data_changes`): its numbers as
        `data.*` metrics, the file as the artifact `data/<name>`."""
        report = self.files.data_changes
        if report is None or not report.is_file():
            return
        try:
            numbers = data_change_metrics(read_json(report))
        except (OSError, ValueError) as err:  # never fail training over a report
            print(f"[mlflow] WARNING: {report}: not logged ({err})", file=sys.stderr)
            return
        self.log_metrics(numbers)
        self.log_artifact(report, "data")

    def queued_metrics(self) -> int:
        with self._lock:
            return sum(len(r.metrics) for r in self.pending if isinstance(r, LogMetrics))


    # -- system metrics ----------------------------------------------------------------------

    def start_system_metrics(self, sampling_interval: float = 5.0) -> None:
        """CPU/memory/disk/network of this machine, logged into the run while it trains (the
        monitor starts once the run exists on the server, from the sender thread)."""
        self._monitor_interval = sampling_interval
        with self._lock:  # else the sender starts it once the run is created or RUNNING again
            ready = self.run_id is not None and not self._held and not any(
                isinstance(record, CreateRun | SetStatus) for record in self.pending)
        if ready:
            self._run_ready()

    def _run_ready(self) -> None:
        """Start the monitor, if asked for, once the run exists (called by the sender too)."""
        if self._monitor_interval is None or self._monitor is not None or self.run_id is None:
            return
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            # The monitor logs at INFO that it starts, stops and finds no GPU to sample ("Skip
            # logging GPU metrics"), in the middle of training: nothing a user can act on. Only
            # this logger, and its warnings (it could not start or sample) still show.
            logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
            self._monitor = SystemMetricsMonitor(self.run_id,
                                                 sampling_interval=self._monitor_interval,
                                                 tracking_uri=self.tracking_uri)
            self._monitor.start()
        except Exception as err:  # optional: never let monitoring stop training
            print(f"[mlflow] system metrics disabled: {err}", file=sys.stderr)
            self._monitor = None

    def stop_system_metrics(self, timeout: float = MONITOR_STOP_TIMEOUT_S) -> None:
        """Stop the monitor; its last upload may hang on a dead server, so wait `timeout` only."""
        monitor, self._monitor, self._monitor_interval = self._monitor, None, None
        if monitor is None:
            return
        stopper = threading.Thread(target=_finish_quietly, args=(monitor,), daemon=True)
        stopper.start()
        stopper.join(timeout)

    # -- closing -------------------------------------------------------------------------------

    def fail(self, error: BaseException) -> None:
        """Record why the run failed (type, message, traceback) and end it as FAILED."""
        message = redact_text(f"{type(error).__name__}: {error}".strip())
        trace = redact_text("".join(traceback.format_exception(error)))[-MAX_ERROR_CHARS:]
        self.set_tags({"error.type": type(error).__name__,
                       "error.message": message[:MAX_ERROR_CHARS],
                       "mlflow.note.content": f"Failed: {message[:MAX_ERROR_CHARS]}\n\n"
                                              f"```\n{trace}\n```"})
        self.close("FAILED")

    @contextmanager
    def failure_recorded(self) -> Iterator[PipelineRun]:
        """End the run as FAILED, with the error, if the block raises anything (SIGTERM too);
        the exception then propagates unchanged."""
        previous = _raise_on_sigterm()
        try:
            yield self
        except BaseException as err:
            self.fail(err)
            raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def close(self, status: str = "FINISHED", timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Set the run's status, send everything (giving up after `timeout` seconds without an
        answer, plus at most MONITOR_STOP_TIMEOUT_S for the system metrics), journal what was not
        sent; True if all was sent."""
        self.resolve(resumed=False)  # training that never reached a step: a run of its own
        self.stop_system_metrics()
        self._queue(SetStatus(status, now_ms()))
        sent = self.flush(timeout)
        self.save()
        self.stop_sending()
        if not sent:
            print(f"[mlflow] WARNING: could not send to the tracking server "
                  f"{redact_url(self.tracking_uri)} ({self.last_error}); "
                  f"{len(self.pending)} queued record(s) saved to "
                  f"{Journal.path(self.files.journal_dir, self.run_key)}; they are replayed by "
                  "the next stage that reaches the server (register requires it). Model files "
                  "are unaffected.", file=sys.stderr)
        return sent

    def save(self) -> None:
        """Write the journal (what is unsent, in flight included: sending twice is harmless)
        and, for train, the run file (its DVC out) and the resume record."""
        with self._lock:
            records = [r for r in (self._in_flight, *self.pending) if r is not None]
            Journal(self.run_key, self.run_id, self.experiment, records).save(
                self.files.journal_dir)
        if not self.owns_run_file:
            return
        uri = self.tracking_uri
        info = {"run_key": self.run_key, "run_id": self.run_id, "experiment": self.experiment,
                # no local paths in a DVC out:
                "tracking_uri": DEFAULT_TRACKING_URI if is_local_store(uri) else redact_url(uri)}
        write_json(self.files.run_file, info)
        if self.resume_record is not None:
            write_json(self.resume_record, info)

    def require_sent(self) -> None:
        """Raise TrackingUnavailable unless the run exists and nothing is left queued."""
        sent = self.flush(timeout=None)
        self.save()
        if not sent or self.run_id is None:
            raise TrackingUnavailable(
                f"cannot reach the MLflow tracking server at {redact_url(self.tracking_uri)} "
                f"({self.last_error}). The trained and exported model is safe in models/; "
                f"{len(self.pending)} queued record(s) are kept in "
                f"{Journal.path(self.files.journal_dir, self.run_key)}. Start the server (or fix "
                "MLFLOW_TRACKING_URI) and rerun `dvc repro` to replay and register.")


def _finish_quietly(monitor: Any) -> None:
    try:
        monitor.finish()
        # MLflow's monitor publishes once per sampling interval and drops the samples of the
        # unfinished last one: a stage shorter than the interval would log no system metrics.
        last = monitor.aggregate_metrics()
        if last:
            monitor.publish_metrics(last)
            monitor.mlflow_logger.flush()
    except Exception as err:  # noqa: BLE001 - monitoring is optional
        print(f"[mlflow] system metrics monitor did not stop cleanly: {err}", file=sys.stderr)


def _raise_on_sigterm() -> Any:
    """Turn SIGTERM into a `Terminated` exception in the main thread (None elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame: Any) -> None:
        raise Terminated(f"terminated by signal {signum} (SIGTERM)")

    return signal.signal(signal.SIGTERM, handler)


def replay_journals(files: TrackingFiles, exclude: str | None = None,
                    timeout: float = REPLAY_TIMEOUT_S) -> int:
    """Send the journals of earlier pipeline runs; a server that answers nothing for `timeout`
    seconds ends the replay (it would not answer the next one either). A journal is deleted only
    once all its records were sent. Returns how many journals are still unsent."""
    paths = Journal.all_paths(files.journal_dir)
    for done, path in enumerate(paths):
        try:
            saved = Journal.load(path)
        except (JournalError, KeyError) as err:
            print(f"[mlflow] WARNING: {err}", file=sys.stderr)
            continue
        if saved.run_key == exclude:
            continue
        run = PipelineRun(saved.run_key, saved.run_id, saved.experiment, files, saved.records)
        sent = run.flush(timeout)
        run.save()  # removes the file when everything went
        run.stop_sending()
        if not sent:
            print(f"[mlflow] WARNING: {len(paths) - done} earlier journal(s) in "
                  f"{files.journal_dir} not replayed yet ({run.last_error}); kept for the next "
                  "stage", file=sys.stderr)
            break
    return sum(1 for _ in Journal.all_paths(files.journal_dir))


def log_stage(stage: str, params: Mapping[str, Any], files: TrackingFiles,
              metrics: Mapping[str, float] | None = None,
              artifacts: Iterable[tuple[Path | str, str | None]] = ()) -> PipelineRun | None:
    """What evaluate/export call at their end: params, metrics, artifacts into the pipeline's run.

    Never fails the stage over tracking: without a run file (train ran without tracking) it only
    warns; an unreachable server leaves everything in the journal for `register` to replay.
    """
    try:
        run = PipelineRun.resume(files)
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

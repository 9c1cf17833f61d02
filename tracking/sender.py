"""Sending a run's records to the tracking server: in order, from one background thread.

`RecordSender` holds a run's queue of journal records (`tracking.journal`) and sends it; the
pipeline's run (`tracking.run.PipelineRun`) builds on it and adds what the stages call. The thread
(`Sender`) is the only one that waits on the network: a step of training only appends to the
queue, and a flush waits while records keep going out, giving up once a server stops answering.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

from clipms.utils.redact import redact_text
from tracking import journal
from tracking.journal import CreateRun, EndAbandoned, LogMetrics, Record, SetStatus, SetTags
from tracking.settings import absolute_tracking_uri, client, ensure_experiment

CLOSE_TIMEOUT_S = 15.0  # how long a stage's end waits for a server that has stopped answering
RUN_KEY_TAG = "pipeline.run_key"


class TrackingUnavailable(RuntimeError):
    """The tracking server could not be reached; the message says what is safe and what to do."""


class Sender:
    """A daemon thread that runs `work` in rounds; `kick` asks for a round, `wait` waits (bounded)
    for every round asked so far, `retire` lets it end after the round in hand. A hanging server
    blocks this thread, never its callers."""

    def __init__(self, work: Callable[[], bool]) -> None:
        self._work = work
        self._cond = threading.Condition()
        self._asked = self._done = 0
        self._retired = False
        self.ok = True
        self._thread = threading.Thread(target=self._loop, name="mlflow-sender", daemon=True)
        self._thread.start()

    def kick(self) -> int:
        with self._cond:
            self._asked += 1
            self._cond.notify_all()
            return self._asked

    def wait(self, target: int, timeout: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._done >= target, timeout)

    def retire(self) -> None:
        """Start no new round: the thread ends once the one in hand (if any) returns."""
        with self._cond:
            self._retired = True
            self._cond.notify_all()

    def join(self, timeout: float | None) -> bool:
        """Wait (bounded) for a retired thread to end; True once it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._retired or self._asked > self._done)
                if self._retired:
                    return
                target = self._asked
            try:
                ok = self._work()
            except BaseException:  # noqa: BLE001 - the thread must survive to report
                ok = False
            with self._cond:
                self._done, self.ok = target, ok
                self._cond.notify_all()


class RecordSender:
    """A run's queue of records not sent yet, and the thread that sends them in order, to the
    store that was the tracking URI when the run was made (a run never moves stores)."""

    def __init__(self, run_key: str, run_id: str | None, experiment: str,
                 records: Iterable[Record] = ()) -> None:
        self.tracking_uri = absolute_tracking_uri()
        self.run_key = run_key
        self.run_id = run_id
        self.experiment = experiment
        self.pending: list[Record] = list(records)
        self.last_error: str | None = None
        self._lock = threading.RLock()  # guards pending, run_id, _held
        self._in_flight: Record | None = None
        self._progress = 0  # records sent so far: a flush waits while this moves
        self._held = False  # sending waits until train knows whether it resumed (`resolve`)
        self._sender: Sender | None = None

    def _run_ready(self) -> None:
        """Called from the sender thread once the run exists (or is RUNNING again)."""

    def flush(self, timeout: float | None = CLOSE_TIMEOUT_S) -> bool:
        """Send what is queued, in order; True when everything was sent. Waits while records
        keep going out, and gives up once `timeout` seconds pass without one (a hung server);
        None waits until the sender is done, 0 starts sending and returns at once."""
        if self._sender is None:
            self._sender = Sender(self._send_all)
        target = self._sender.kick()
        if timeout == 0:
            return False
        while True:
            before = self._progress
            if self._sender.wait(target, timeout):
                break
            if self._progress == before:
                self.last_error = f"no answer from the server within {timeout:g} s"
                return False
        with self._lock:
            return self._sender.ok and not self.pending and self._in_flight is None

    def stop_sending(self, timeout: float | None = 0) -> bool:
        """Once the journal holds what is unsent, send nothing more from here: the thread ends
        after the request in hand (a hung server may still answer it; sending that one twice is
        harmless), so a queued record never goes out behind the journal's replay. Waits up to
        `timeout` seconds for the thread to end; True once it has (or there was none). A later
        flush starts a new thread."""
        sender, self._sender = self._sender, None
        if sender is None:
            return True
        sender.retire()
        return sender.join(timeout)

    def _send_all(self) -> bool:
        """The sender thread's round: records in order until the queue is empty or one fails."""
        try:
            mlflow_client = client(self.tracking_uri)
            while True:
                with self._lock:
                    if self._held or not self.pending:
                        break
                    record = self._in_flight = self._next_record()
                try:
                    self._send_one(mlflow_client, record)
                except BaseException:
                    with self._lock:  # unsent (or partly sent) records go back to the front
                        self.pending.insert(0, record)
                    raise
                finally:
                    with self._lock:
                        self._in_flight = None
                self._progress += 1
        except Exception as err:  # an unreachable server surfaces as many exception types
            first = str(err).splitlines()[0][:300] if str(err) else ""
            self.last_error = redact_text(f"{type(err).__name__}: {first}")
            return False
        self.last_error = None
        return True

    def _next_record(self) -> Record:
        """The first queued record, a big metrics batch cut to one request's worth (so that
        progress is visible request by request); the caller holds the lock."""
        record = self.pending[0]
        if isinstance(record, LogMetrics) and len(record.metrics) > journal.MAX_METRICS:
            head = LogMetrics(record.metrics[:journal.MAX_METRICS])
            del record.metrics[:journal.MAX_METRICS]
            return head
        return self.pending.pop(0)

    def _send_one(self, mlflow_client: Any, record: Record) -> None:
        """Send one record; one the server rejects as invalid is reported and dropped, because
        replaying it would fail forever and block everything queued behind it."""
        from mlflow.exceptions import MlflowException

        if isinstance(record, CreateRun):
            self.run_id = self._create(mlflow_client, record)
            self._run_ready()
            return
        if isinstance(record, EndAbandoned):
            self._end_abandoned(mlflow_client, record)
            return
        if self.run_id is None:
            # Created by an earlier stage whose answer came too late to be recorded (a slow
            # server): the run carries its key, so find it rather than never sending again.
            self.run_id = self._find(mlflow_client, self.experiment, self.run_key)
        if self.run_id is None:
            raise TrackingUnavailable("the MLflow run has not been created yet")
        try:
            journal.send(record, mlflow_client, self.run_id)
        except MlflowException as err:
            if err.error_code != "INVALID_PARAMETER_VALUE":
                raise
            print(f"[mlflow] WARNING: dropped a {record.kind} record the server rejected: "
                  f"{str(err).splitlines()[0][:300]}", file=sys.stderr)
        if isinstance(record, SetStatus) and record.status == "RUNNING":
            self._run_ready()

    def _end_abandoned(self, mlflow_client: Any, record: EndAbandoned) -> None:
        run_id = record.run_id or self._find(mlflow_client, record.experiment, record.run_key)
        if run_id is None:  # it never reached the server: nothing is left running there
            return
        if mlflow_client.get_run(run_id).info.status != "RUNNING":
            return
        journal.send(SetTags({"error.type": "Interrupted", "error.message": record.reason,
                              "mlflow.note.content": f"Failed: {record.reason}"}),
                     mlflow_client, run_id)
        mlflow_client.set_terminated(run_id, "FAILED")

    @staticmethod
    def _find(mlflow_client: Any, experiment: str, run_key: str) -> str | None:
        """The id of the run tagged with `run_key` in `experiment`, None when there is none (a
        lookup: it creates no experiment)."""
        found_experiment = mlflow_client.get_experiment_by_name(experiment)
        if found_experiment is None:
            return None
        found = mlflow_client.search_runs([found_experiment.experiment_id],
                                          filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}'",
                                          max_results=1)
        return str(found[0].info.run_id) if found else None

    def _create(self, mlflow_client: Any, record: CreateRun) -> str:
        """Create the run, or find it when an earlier attempt did but its answer was lost."""
        found = self._find(mlflow_client, self.experiment, self.run_key)
        if found is not None:
            return found
        experiment_id = ensure_experiment(mlflow_client, self.experiment)
        run = mlflow_client.create_run(experiment_id, tags=record.tags, run_name=record.run_name)
        return str(run.info.run_id)

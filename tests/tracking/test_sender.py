"""tracking.sender.RecordSender in seconds: a record that fails to send stays queued, in order,
and goes out exactly once when the server answers again, and what is unsent reads back from the
journal file whole. The tracking server is a stand-in MlflowClient that fails on command (the
fault-injection tests with a real server and a cutting proxy take minutes:
tests/integration/test_registry_server.py, harness/fault_proxy.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tracking import journal, sender
from tracking.journal import Journal, LogMetrics, MetricRow, SetStatus, SetTags

RUN_ID = "run-1"
WAIT_S = 60.0  # a flush's bound on a server that stops answering; every flush here ends sooner


class Server:
    """A stand-in MlflowClient that records what it was sent, and raises ConnectionError for
    every request while `down`, or for the request numbered `fail_at` (1-based)."""

    def __init__(self) -> None:
        self.down = False
        self.fail_at: int | None = None
        self.calls = 0
        self.tags: list[str] = []
        self.metrics: list[tuple[str, int]] = []
        self.status: list[str] = []

    def _request(self) -> None:
        self.calls += 1
        if self.down or self.calls == self.fail_at:
            raise ConnectionError("Connection refused")

    def log_batch(self, run_id: str, metrics=(), params=(), tags=(), synchronous=True) -> None:
        self._request()
        assert run_id == RUN_ID
        self.metrics += [(m.key, m.step) for m in metrics]
        self.tags += [t.key for t in tags]

    def set_terminated(self, run_id: str, status: str, end_time: int | None = None) -> None:
        self._request()
        self.status.append(status)


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Server:
    import mlflow.entities  # noqa: F401  (what a send imports first: seconds, once)

    stand_in = Server()
    monkeypatch.setattr(sender, "client", lambda uri=None: stand_in)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///unused.db")
    return stand_in


def rows(n: int, start: int = 0) -> list[MetricRow]:
    return [MetricRow("loss", 1.0 / (step + 1), 1_700_000_000_000, step)
            for step in range(start, start + n)]


def queued(records: list) -> sender.RecordSender:
    return sender.RecordSender("key-1", RUN_ID, "clip", records)


def test_a_record_that_fails_stays_first_in_the_queue_and_goes_once(server: Server) -> None:
    records = [SetTags({"stage": "train"}), LogMetrics(rows(3)), SetStatus("FINISHED", 1)]
    run = queued(records)
    server.down = True
    assert run.flush(timeout=WAIT_S) is False
    assert [type(r) for r in run.pending] == [SetTags, LogMetrics, SetStatus]
    assert run.last_error == "ConnectionError: Connection refused"
    server.down = False
    assert run.flush(timeout=WAIT_S) is True and run.pending == []
    assert (server.tags, server.metrics, server.status) == (
        ["stage"], [("loss", 0), ("loss", 1), ("loss", 2)], ["FINISHED"])
    run.stop_sending(timeout=WAIT_S)


def test_a_metrics_batch_cut_mid_way_resumes_where_it_stopped(server: Server) -> None:
    """Three requests' worth of rows; the second request fails: the first's rows are not sent
    twice, the rest are kept, and every row arrives exactly once."""
    total = 2 * journal.MAX_METRICS + 5
    run = queued([LogMetrics(rows(total)), SetStatus("FINISHED", 1)])
    server.fail_at = 2
    assert run.flush(timeout=WAIT_S) is False
    unsent = [row.step for record in run.pending[:-1] for row in record.metrics]
    assert unsent == list(range(journal.MAX_METRICS, total))
    assert isinstance(run.pending[-1], SetStatus)
    assert run.flush(timeout=WAIT_S) is True
    assert [step for _, step in server.metrics] == list(range(total))
    assert server.status == ["FINISHED"]
    run.stop_sending(timeout=WAIT_S)


def test_what_could_not_be_sent_reads_back_from_the_journal_whole(server: Server,
                                                                  tmp_path: Path) -> None:
    run = queued([SetTags({"a": "1"}), LogMetrics(rows(2)), SetStatus("FAILED", 7)])
    server.down = True
    assert run.flush(timeout=WAIT_S) is False
    run.stop_sending(timeout=WAIT_S)
    path = Journal("key-1", run.run_id, "clip", run.pending).save(tmp_path)
    replayed = Journal.load(path)
    assert [journal.record_to_json(r) for r in replayed.records] == [
        {"kind": "tags", "tags": {"a": "1"}},
        {"kind": "metrics", "metrics": [["loss", 1.0, 1_700_000_000_000, 0],
                                        ["loss", 0.5, 1_700_000_000_000, 1]]},
        {"kind": "status", "status": "FAILED", "end_time": 7}]
    server.down = False
    again = sender.RecordSender("key-1", replayed.run_id, replayed.experiment, replayed.records)
    assert again.flush(timeout=WAIT_S) is True
    assert (server.tags, server.status) == (["a"], ["FAILED"])
    again.stop_sending(timeout=WAIT_S)

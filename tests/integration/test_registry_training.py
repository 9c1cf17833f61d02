"""Tracking during training against real servers: unsent journal records are replayed
before anything deletes them, a server that accepts connections and never answers does not stall
the training loop, a training stage that fails (a signal) ends its MLflow run as FAILED with the
error, and the rerun that resumes from the checkpoint continues the same MLflow run."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from clipms.utils.jsonio import read_json
from harness import mlflow_server as server_fixtures
from harness.dvc_workspace import make_workspace, run, tool_env
from harness.mlflow_server import MlflowServer, free_port
from harness.register_workspace import write_pipeline_state
from tracking import run as tracking_run
from tracking import settings
from tracking.callback import TrainCallback
from tracking.files import FILES
from tracking.journal import CreateRun, Journal, LogMetrics

pytestmark = pytest.mark.slow
mlflow_server = server_fixtures.mlflow_server  # the module fixture, found by name


class SilentServer:
    """Accepts TCP connections on 127.0.0.1 and never answers (a hung tracking server)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    write_pipeline_state(tmp_path)
    (tmp_path / "params.yaml").write_text("register:\n  experiment: test-training\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def steps(pipeline_run: tracking_run.PipelineRun, count: int, start: int = 1,
          pause_s: float = 0.0, flush_every_s: float = 0.05) -> list[float]:
    """A training loop's calls into the callback; returns how long each call took."""
    callback = TrainCallback(pipeline_run, flush_every_s=flush_every_s)
    took = []
    for step in range(start, start + count):
        time.sleep(pause_s)
        t0 = time.perf_counter()
        callback.on_step_end(step, {"loss": 2.0 / step, "lr": 1e-3})
        took.append(time.perf_counter() - t0)
    return took


def test_unsent_journals_are_replayed_before_anything_deletes_them(
        workspace: Path, mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")  # nobody there
    offline = tracking_run.PipelineRun.open("train", {"lr": 1e-3}, FILES)
    steps(offline, 5)
    assert offline.close() is False and offline.run_id is None
    first_journal = Journal.path(FILES.journal_dir, offline.run_key)
    assert first_journal.exists()

    # Another pipeline run starts while the server is still down: the first journal stays.
    second = tracking_run.PipelineRun.open("train", {"lr": 2e-3}, FILES)
    assert second.close() is False
    assert first_journal.exists() and Journal.path(FILES.journal_dir, second.run_key).exists()
    assert [type(r) for r in Journal.load(first_journal).records][0] is CreateRun

    # The server is back: the next run to open replays both earlier runs first.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    third = tracking_run.PipelineRun.open("train", {"lr": 3e-3}, FILES)
    assert third.close() is True
    assert not list(FILES.journal_dir.glob("*.json"))
    client = settings.client()
    experiment = client.get_experiment_by_name("test-training")
    runs = {r.data.tags["pipeline.run_key"]: r for r in client.search_runs(
        [experiment.experiment_id])}
    assert {offline.run_key, second.run_key, third.run_key} <= set(runs)
    first_run = runs[offline.run_key]
    assert first_run.data.params["train.lr"] == "0.001"
    assert len(client.get_metric_history(first_run.info.run_id, "loss")) == 5
    assert first_run.info.status == "FINISHED"


def test_a_hanging_server_never_stalls_the_training_loop(
        workspace: Path, mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server accepts connections and never answers (MLflow's own timeout stays at its 30 s
    default): a step waits for no request, opening waits at most OPEN_TIMEOUT_S and closing at
    most CLOSE_TIMEOUT_S, and everything is journaled, then replayed once the server answers."""
    silent = SilentServer()
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", silent.url)
        t0 = time.monotonic()
        pipeline_run = tracking_run.PipelineRun.open("train", {"lr": 1e-3}, FILES)
        opened = time.monotonic() - t0
        pipeline_run.start_system_metrics(sampling_interval=0.5)
        took = steps(pipeline_run, 300, pause_s=0.01)
        t1 = time.monotonic()
        assert pipeline_run.close() is False
        closed = time.monotonic() - t1
        print(f"hung server: open {opened:.2f} s, steps max {max(took) * 1e3:.2f} ms / total "
              f"{sum(took) * 1e3:.1f} ms over {len(took)} steps, close {closed:.2f} s")
        assert opened < tracking_run.OPEN_TIMEOUT_S + 2
        assert max(took) < 0.05 and sum(took) < 0.5
        assert closed < tracking_run.CLOSE_TIMEOUT_S + tracking_run.MONITOR_STOP_TIMEOUT_S + 2
        saved = Journal.load(Journal.path(FILES.journal_dir, pipeline_run.run_key))
        rows = sum(len(r.metrics) for r in saved.records if isinstance(r, LogMetrics))
        assert rows == 600 and isinstance(saved.records[0], CreateRun)
    finally:
        silent.close()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    assert tracking_run.replay_journals(FILES) == 0
    client = settings.client()
    [found] = client.search_runs(
        [client.get_experiment_by_name("test-training").experiment_id],
        filter_string=f"tags.`pipeline.run_key` = '{pipeline_run.run_key}'")
    assert len(client.get_metric_history(found.info.run_id, "loss")) == 300


def test_a_closed_run_sends_nothing_more_and_never_moves_store(
        workspace: Path, tmp_path_factory: pytest.TempPathFactory,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Once close() gave up on a hung server and the journal holds the records, the run's sender
    thread ends with the request in hand, and it never resolves the tracking URI again: before,
    its next round sent the queue wherever the environment pointed by then (in this suite, the
    default ./mlflow.db of whatever the cwd had become: the checkout's own database)."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    before = set(threading.enumerate())
    silent = SilentServer()
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", silent.url)
        pipeline_run = tracking_run.PipelineRun.open("train", {"lr": 1e-3}, FILES)
        steps(pipeline_run, 20, pause_s=0.01)  # asks for rounds while one hangs
        senders = [t for t in threading.enumerate()
                   if t not in before and t.name == "mlflow-sender"]
        assert pipeline_run.close(timeout=0.5) is False
        assert Journal.path(FILES.journal_dir, pipeline_run.run_key).exists()
        elsewhere = tmp_path_factory.mktemp("elsewhere")
        monkeypatch.chdir(elsewhere)
        monkeypatch.delenv("MLFLOW_TRACKING_URI")
    finally:
        silent.close()  # the request in hand fails now
    assert senders
    for thread in senders:
        thread.join(20)
    assert not any(t.is_alive() for t in senders)
    assert not (elsewhere / "mlflow.db").exists()
    assert pipeline_run.tracking_uri == silent.url


# ---------------------------------------------------------------------------------------------
# the real train stage


TRAIN = {"train.epochs": 40, "train.checkpoint_every": 2, "train.log_every": 1,
         "register.experiment": "test-train-stage"}


@pytest.fixture(scope="module")
def trained_data(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A tiny workspace whose data stages and tokenizer have run (train has not)."""
    ws = make_workspace(tmp_path_factory.mktemp("train-ws") / "ws", TRAIN)
    run(["dvc", "repro", "tokenizer"], ws, timeout=900)
    yield ws


def start_train(ws: Path, uri: str) -> subprocess.Popen[str]:
    env = {**tool_env(), "MLFLOW_TRACKING_URI": uri, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "stages.train"], cwd=ws, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def signal_after_steps(proc: subprocess.Popen[str], count: int, signum: int,
                       timeout: float = 600) -> str:
    """Send `signum` once the stage has logged `count` training steps; returns its output."""
    assert proc.stdout is not None
    lines: list[str] = []
    seen = 0
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        lines.append(line)
        seen += " step " in line and " loss " in line
        if seen == count:
            time.sleep(0.5)  # past the step's callbacks (the log line comes first)
            proc.send_signal(signum)
            break
        assert time.monotonic() < deadline, "".join(lines[-40:])
    rest, _ = proc.communicate(timeout=120)
    return "".join(lines) + rest


def test_a_failed_training_ends_failed_and_its_resume_continues_the_run(
        trained_data: Path, mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch) -> None:
    ws = trained_data
    # Ctrl-C (SIGINT, what `dvc repro` passes on) and a cancelled flow run or stopped worker
    # (SIGTERM). MindSpore's runtime turns a SIGINT during training into a SIGTERM of its own.
    errors = {signal.SIGINT: {"KeyboardInterrupt", "Terminated"}, signal.SIGTERM: {"Terminated"}}
    for signum, error in errors.items():
        proc = start_train(ws, mlflow_server.uri)
        out = signal_after_steps(proc, 3, signum)
        assert proc.returncode != 0, out
        first = read_json(ws / "models" / "mlflow_run.json")
        monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
        failed = settings.client().get_run(first["run_id"])
        assert failed.info.status == "FAILED", out[-3000:]
        assert failed.data.tags["error.type"] in error, failed.data.tags
        assert "Traceback" in failed.data.tags["mlflow.note.content"]
        assert read_json(ws / "models" / "checkpoints" / "mlflow_run.json")["run_id"] \
            == first["run_id"]

    # The rerun resumes from the last checkpoint and continues the MLflow run that wrote it.
    proc = start_train(ws, mlflow_server.uri)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    resumed = read_json(ws / "models" / "mlflow_run.json")
    assert resumed["run_id"] == first["run_id"]
    client = settings.client()
    data = client.get_run(first["run_id"])
    assert data.info.status == "FINISHED"
    assert data.data.tags["pipeline.resumed"] == "true"
    total = int(read_json(ws / "metrics" / "train.json")["steps"])
    logged = {m.step for m in client.get_metric_history(first["run_id"], "loss")}
    assert logged == set(range(1, total + 1)), sorted(logged)  # earlier steps stay visible
    assert not list((ws / "models" / "mlflow-journal").glob("*.json"))

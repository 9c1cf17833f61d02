"""Live model swap: the service follows `champion` on a real MLflow server while clients query it.

Versions are registered the way the `register` stage leaves them (the pyfunc of a bundle, its index
logged into that logged model as `index`). A bounded client loop runs while a second version becomes
champion: no request fails, the served version changes, and once a client saw the new version it
never sees the old one again. Then a version whose index another bundle made becomes champion: it
is refused, and so is a version registered without an index: the old one keeps serving, and
/metrics says why.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import mlflow_server as server_fixtures
from harness.mlflow_server import MlflowServer
from harness.serving_server import ServingServer, post_json, request
from harness.tiny_model import make_index

pytestmark = pytest.mark.slow
mlflow_server = server_fixtures.mlflow_server  # the module's server, found by name
MODEL = "clip-swap"
LOOP_LIMIT_S = 240.0  # the client loop stops by itself after this, whatever happens


def register(bundle: Path, index: Path | None) -> str:
    """A new version of MODEL from `bundle`, `index` logged into its model (as the register stage
    does); returns its number."""
    import mlflow

    from registry import pyfunc
    from registry.index_store import INDEX_ARTIFACT

    with mlflow.start_run():
        info = pyfunc.log_model(bundle, name="clip")
        if index is not None:
            mlflow.MlflowClient().log_model_artifacts(info.model_id, str(index), INDEX_ARTIFACT)
    return str(mlflow.register_model(info.model_uri, MODEL).version)


def make_champion(version: str) -> None:
    from mlflow import MlflowClient

    MlflowClient().set_registered_model_alias(MODEL, "champion", version)


class ClientLoop:
    """Two threads querying /v1/search until stopped (or LOOP_LIMIT_S): (version, status) seen."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stop = threading.Event()
        self.seen: list[list[tuple[str, int]]] = [[], []]
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(2)]

    def _run(self, i: int) -> None:
        deadline = time.monotonic() + LOOP_LIMIT_S
        while not self.stop.is_set() and time.monotonic() < deadline:
            status, body = post_json(f"{self.url}/v1/search", {"text": f"a picture {i}", "k": 3})
            version = body.get("model", {}).get("version", "?") if status == 200 else "?"
            self.seen[i].append((version, status))

    def __enter__(self) -> ClientLoop:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)

    def latest(self) -> set[str]:
        return {seen[-1][0] for seen in self.seen if seen}


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture
def tracking(mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The module's server for this test's fluent MLflow calls, undone afterwards. Both the
    variable and the process-global URI: a URI an earlier test left set with
    mlflow.set_tracking_uri outranks MLFLOW_TRACKING_URI, and the versions would be registered
    in that store while the service follows this server."""
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    mlflow.set_tracking_uri(mlflow_server.uri)
    yield mlflow_server.uri
    mlflow.set_tracking_uri(None)  # monkeypatch then restores the variable


def test_follow_champion_swaps_live_and_refuses_a_mismatching_index(tmp_path: Path,
                                                                   tracking: str) -> None:
    from harness.tiny_model import export_tiny_bundle

    # Named like the pipeline's models/export: MLflow keeps the folder's name in the artifacts.
    first = export_tiny_bundle(tmp_path / "a", seed=0).rename(tmp_path / "a" / "export")
    second = export_tiny_bundle(tmp_path / "b", seed=1).rename(tmp_path / "b" / "export")
    index_a, index_b = make_index(first, tmp_path / "index-a"), make_index(second, tmp_path / "ib")
    make_champion(register(first, index_a))
    service = ServingServer(tmp_path / "serve", [
        "--follow", "champion", "--model", f"models:/{MODEL}@champion", "--poll-s", "1",
        "--max-batch", "4"], env={"MLFLOW_TRACKING_URI": tracking})
    with service:
        assert post_json(f"{service.url}/v1/search", {"text": "x"})[1]["model"] == {
            "name": MODEL, "version": "1"}
        with ClientLoop(service.url) as loop:
            wait_for(lambda: all(len(s) >= 3 for s in loop.seen), 60, "the clients to run")
            make_champion(register(second, index_b))
            wait_for(lambda: loop.latest() == {"2"}, 180, "v2 to be served")
            time.sleep(2)  # more requests on v2
        statuses = [status for seen in loop.seen for _, status in seen]
        assert statuses and set(statuses) == {200}, sorted(set(statuses))
        for seen in loop.seen:
            versions = [version for version, _ in seen]
            assert versions[0] == "1" and versions[-1] == "2"
            switch = versions.index("2")
            assert set(versions[switch:]) == {"2"}, versions  # never back to the old model

        # v3: the second bundle with the first bundle's index -> refused, v2 keeps serving.
        make_champion(register(second, index_a))
        wait_for(lambda: "clipms_model_swap_failures_total 1.0" in metrics(service.url),
                 120, "the refusal to show in /metrics")
        text = metrics(service.url)
        assert 'clipms_model_swap_failure_info{reason="ImageIndexError:' in text
        assert 'version="3"' in text and "not by the bundle being served" in text
        assert 'clipms_model_info{alias="champion",name="clip-swap",version="2"} 1.0' in text
        status, body = post_json(f"{service.url}/v1/search", {"text": "still v2"})
        assert status == 200 and body["model"]["version"] == "2"
        assert "v3 not swapped in, still serving v2" in service.tail(20000)

        # v4: registered without an index -> refused too, for its own reason.
        make_champion(register(second, None))
        wait_for(lambda: "clipms_model_swap_failures_total 2.0" in metrics(service.url),
                 120, "the second refusal")
        text = metrics(service.url)
        assert 'version="4"' in text and "has no 'index' artifact" in text
        assert post_json(f"{service.url}/v1/search", {"text": "x"})[1]["model"] == {
            "name": MODEL, "version": "2"}
        print(f"swap test: {[len(seen) for seen in loop.seen]} requests per client, all 200")


def metrics(url: str) -> str:
    return request(f"{url}/metrics")[1].decode()

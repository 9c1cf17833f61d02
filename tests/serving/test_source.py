"""The champion follower in seconds: `serving.state.ServiceState.follow` polling a
`serving.source.RegistrySource` whose registry answers are a stand-in MlflowClient (the one stub
here, as the live-swap test with a real MLflow server takes minutes:
tests/integration/test_serving_swap.py). Loading a version is recorded, not done (building an
encoder is the swap test's subject): what is checked is which versions the follower asks for, and
when.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

from serving.engine import BatchSettings, ModelInfo
from serving.prometheus import ServiceMetrics
from serving.source import Fetched, RegistrySource, SourceError
from serving.state import ServiceState

POLL_S = 0.01


class Registry:
    """A stand-in MlflowClient: the alias points to `versions[alias]`, which the test moves."""

    def __init__(self, version: str) -> None:
        self.alias = {"champion": version}
        self.asked = 0

    def get_model_version_by_alias(self, name: str, alias: str) -> SimpleNamespace:
        self.asked += 1
        return SimpleNamespace(version=self.alias[alias], run_id=f"run-{self.alias[alias]}")

    def get_model_version(self, name: str, version: str) -> SimpleNamespace:
        return SimpleNamespace(version=version, run_id=f"run-{version}")


def source_on(registry: Registry, failing: dict[str, Exception] | None = None,
              fetched: list[str] | None = None) -> RegistrySource:
    """A source on `registry` whose downloads are recorded in `fetched` (nothing is downloaded)
    and fail as `failing` says."""
    source = RegistrySource("models:/clip@champion", tracking_uri="sqlite:///unused.db")
    source._client = lambda: registry  # noqa: SLF001 - the registry stand-in (module docstring)

    def fetch(version: str, run_id: str | None) -> Fetched:
        (fetched if fetched is not None else []).append(version)
        if version in (failing or {}):
            raise failing[version]
        return Fetched(ModelInfo("clip", version, "champion", run_id), Path("bundle"),
                       Path("index"))

    source.fetch = fetch
    return source


def follower(registry: Registry, failing: dict[str, Exception] | None = None
             ) -> tuple[ServiceState, list[str]]:
    """A ServiceState serving v1 whose loads are recorded (and fail as `failing` says)."""
    state = ServiceState(BatchSettings(), ServiceMetrics())
    state.engine = SimpleNamespace(info=ModelInfo("clip", "1", "champion"))
    loaded: list[str] = []

    async def load(fetch) -> None:  # noqa: ANN001
        fetched = fetch()
        loaded.append(fetched.info.version)
        if fetched.info.version in (failing or {}):
            raise failing[fetched.info.version]
        state.engine = SimpleNamespace(info=fetched.info)

    state.load = load
    return state, loaded


async def until(condition, what: str, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(POLL_S)


async def following(state: ServiceState, source: RegistrySource, script) -> None:  # noqa: ANN001
    """Run the follower while `script()` (a coroutine function) moves the alias and waits."""
    task = asyncio.get_running_loop().create_task(state.follow(source, POLL_S))
    try:
        await script()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        state.model_thread.shutdown(wait=False)
        state.decode_pool.shutdown(wait=False)


def test_the_source_reads_the_alias_again_at_every_call() -> None:
    registry = Registry("1")
    source = source_on(registry)
    assert source.current() == ("1", "run-1")
    registry.alias["champion"] = "2"
    assert source.current() == ("2", "run-2")
    assert registry.asked == 2


def test_the_follower_swaps_in_each_version_the_alias_moves_to_once() -> None:
    registry = Registry("1")
    state, loaded = follower(registry)

    async def script() -> None:
        await until(lambda: registry.asked >= 3, "three polls")
        assert loaded == []  # the version it serves: nothing to load
        registry.alias["champion"] = "2"
        await until(lambda: loaded == ["2"], "v2 swapped in")
        registry.alias["champion"] = "3"
        await until(lambda: loaded == ["2", "3"], "v3 swapped in")
        asked = registry.asked
        await until(lambda: registry.asked >= asked + 5, "five more polls")

    asyncio.run(following(state, source_on(registry), script))
    assert loaded == ["2", "3"] and state.engine.info.version == "3"


def test_a_broken_version_is_not_tried_again_and_a_failed_download_is() -> None:
    registry = Registry("1")
    state, loaded = follower(registry, failing={"2": SourceError("no index")})
    fetched: list[str] = []
    source = source_on(registry, {"3": ConnectionError("registry down")}, fetched)

    async def script() -> None:
        registry.alias["champion"] = "2"
        await until(lambda: "2" in loaded, "v2 tried")
        asked = registry.asked
        await until(lambda: registry.asked >= asked + 5, "five more polls")
        registry.alias["champion"] = "3"
        await until(lambda: fetched.count("3") >= 5, "v3 downloaded at every poll")

    asyncio.run(following(state, source, script))
    assert loaded.count("2") == 1, loaded
    assert state.failed == {"2": "SourceError: no index"}
    assert state.engine.info.version == "1"  # still serving what it had


def test_a_version_that_does_not_build_is_tried_once_more_then_not_again() -> None:
    """A champion whose MindIR does not load here (MindSpore raises RuntimeError, which says
    nothing of whether it would pass) was downloaded and tried at every poll, forever."""
    registry = Registry("1")
    state, loaded = follower(registry, failing={"2": RuntimeError("MindIR load failed")})
    fetched: list[str] = []

    async def script() -> None:
        registry.alias["champion"] = "2"
        await until(lambda: "2" in state.failed, "v2 given up")
        asked = registry.asked
        await until(lambda: registry.asked >= asked + 10, "ten more polls")

    asyncio.run(following(state, source_on(registry, fetched=fetched), script))
    assert loaded == ["2", "2"] and fetched == ["2", "2"]
    assert state.failed == {"2": "RuntimeError: MindIR load failed"}
    assert state.engine.info.version == "1"  # the old version keeps serving

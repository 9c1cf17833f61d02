"""The model being served, its loading, and the live swap to a new champion.

Loading happens off the event loop: downloading and checking the index in a worker thread, then
building the encoder and compiling every batch shape in the model thread (MindSpore graphs are only
ever touched from that one thread). A version is swapped in only when all of that succeeded; the
swap itself is one assignment on the event loop, so a request sees the old engine or the new one,
never a mix. The old engine keeps answering the requests it accepted and is closed after the last.

`follow()` polls the registry every `poll_s` seconds. A version that cannot be served (another
bundle's index, no index, a broken bundle) is not tried again; a transient failure (the registry
unreachable mid-download) is retried at the next poll. Either way the reason is logged and shown
in `/metrics`, and the current version keeps serving.
"""

# tested by: tests/serving/test_source.py

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from serving.batcher import Returning
from serving.engine import BatchSettings, Engine
from serving.prometheus import ServiceMetrics
from serving.source import Fetched, RegistrySource, SourceError

log = logging.getLogger("clipms.serving")


class NotReady(RuntimeError):
    """No model is loaded yet (HTTP 503)."""


def open_index(fetched: Fetched) -> tuple[str, Any]:
    """(bundle digest, the checked index); numpy and files only, safe beside the model thread."""
    from clipms.deploy.searchindex import ImageIndex, bundle_digest

    digest = bundle_digest(fetched.bundle_dir)
    return digest, ImageIndex.load(fetched.index_dir, bundle_digest=digest)


def open_encoder(fetched: Fetched, index: Any, max_batch: int, runtime: Any = None) -> Any:
    """The bundle's Encoder on `runtime` (a clipms.runtime.RuntimeConfig; None: CPU defaults);
    MindSpore, so run in the model thread."""
    from clipms.deploy.infer import Encoder
    from clipms.deploy.searchindex import ImageIndexError

    encoder = Encoder(fetched.bundle_dir, batch_size=max_batch, device=runtime or "CPU")
    if index.meta["dim"] != encoder.embed_dim:
        raise ImageIndexError(f"index dim {index.meta['dim']} != model's {encoder.embed_dim}")
    return encoder


def mindspore_context() -> dict[str, Any]:
    """How MindSpore runs in this process, read back from MindSpore itself (not from the config
    that asked for it): /v1/model shows it, so a user sees the device that really serves."""
    import os

    import mindspore as ms

    jit = ms.get_context("jit_config") or {}
    return {"device_target": ms.get_context("device_target"),
            "mode": "graph" if ms.get_context("mode") == ms.GRAPH_MODE else "pynative",
            "jit_level": jit.get("jit_level") or None,
            "kernel_fusion": bool(os.environ.get("MS_DEV_GRAPH_KERNEL_FLAGS")),
            # the tokenizer's thread pool (serving.cli.sequential_tokenizer): "false", none
            "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM")}


# Builds (MindIR loaded, graphs compiled) of a downloaded version the follower tries before it
# gives the version up: one more after a failure that may have been passing (memory short while
# the old model served), not one at every poll.
BUILD_TRIES = 2


def broken_version(err: Exception) -> bool:
    """True for what is wrong with the version itself (its index, bundle or artifacts); other
    errors (the registry unreachable mid-download, a full disk) are retried at the next poll."""
    from clipms.data.preprocess import PreprocessError
    from clipms.deploy.infer import BundleError
    from clipms.deploy.searchindex import ImageIndexError

    return isinstance(err, ImageIndexError | BundleError | PreprocessError | SourceError)


class ServiceState:
    def __init__(self, batching: BatchSettings, metrics: ServiceMetrics,
                 runtime: Any = None) -> None:
        self.batching = batching
        self.metrics = metrics
        self.runtime = runtime  # clipms.runtime.RuntimeConfig of every model loaded
        # One thread runs every MindIR call (and model loads): MindSpore graphs are not shared
        # between threads, and on a small machine one call at a time uses all cores anyway.
        self.model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self.decode_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="decode")
        self.engine: Engine | None = None
        # Keep-alive clients answered within max_wait (serving.guard records them): a batch
        # waits for their next request rather than going short.
        self.returning = Returning(batching.max_wait_ms / 1000.0)
        self._fetched: dict[str, Fetched] = {}
        self.failed: dict[str, str] = {}  # version -> why it was not swapped in
        self._build_failures: dict[str, int] = {}  # version -> loads failed after its download
        self._retiring: set[asyncio.Task] = set()

    def acquire(self) -> Engine:
        if self.engine is None:
            raise NotReady("no model loaded yet")
        return self.engine.acquire()

    async def load(self, fetch: Any) -> Engine:
        """Fetch and check (`fetch()` -> Fetched, in a thread), build in the model thread, then
        swap in. MindSpore is only touched from the model thread (a graph compiled in another
        thread while one runs there was seen to hang), so building is split into steps - open
        the encoder, then one compile per batch shape - and the current model's batches run
        between them: a swap stalls serving by one compile at most, never by the whole load."""
        loop = asyncio.get_running_loop()
        fetched = await asyncio.to_thread(fetch)
        try:
            digest, index = await asyncio.to_thread(open_index, fetched)
            encoder = await loop.run_in_executor(self.model_thread, open_encoder, fetched, index,
                                                 self.batching.max_batch, self.runtime)
            engine = Engine(fetched.info, encoder, index, fetched.bundle_dir, digest)
            engine.runtime = await loop.run_in_executor(self.model_thread, mindspore_context)
            for step in engine.warm_up_steps(self.batching.max_batch):
                await loop.run_in_executor(self.model_thread, step)
        except BaseException:
            fetched.cleanup()
            raise
        self._swap(engine, fetched)
        return engine

    def _swap(self, engine: Engine, fetched: Fetched) -> None:
        engine.start(self.model_thread, self.batching, self.metrics.observe_batch,
                     self.returning.expected)
        old, self.engine = self.engine, engine  # the atomic swap: one assignment on the loop
        self._fetched[engine.info.version] = fetched
        info = engine.info
        self.metrics.serving(info.name, info.version, info.alias, len(engine.index))
        if old is not None:
            self.metrics.swaps.inc()
            log.info("serving %s v%s (was v%s)", info.name, info.version, old.info.version)
            task = asyncio.get_running_loop().create_task(self._retire(old))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
        else:
            log.info("serving %s v%s on MindSpore %s", info.name, info.version, engine.runtime)

    async def _retire(self, old: Engine) -> None:
        await old.retire()
        fetched = self._fetched.pop(old.info.version, None)
        if fetched is not None:
            fetched.cleanup()  # downloaded files of a version no longer served

    async def follow(self, source: RegistrySource, poll_s: float) -> None:
        """Swap in each new version the alias points to, until cancelled."""
        while True:
            await asyncio.sleep(poll_s)
            try:
                version, run_id = await asyncio.to_thread(source.current)
            except Exception as err:  # the registry is down: keep serving, try again later
                log.warning("follow %s: cannot read the registry (%s)", source.uri, err)
                continue
            current = self.engine.info.version if self.engine else None
            if version == current or version in self.failed:
                continue
            try:
                fetched = await asyncio.to_thread(source.fetch, version, run_id)
            except Exception as err:
                self._not_swapped(source.uri, version, current, err, downloaded=False)
                continue
            try:
                await self.load(lambda f=fetched: f)
            except Exception as err:
                self._not_swapped(source.uri, version, current, err, downloaded=True)

    def _not_swapped(self, uri: str, version: str, current: str | None, err: Exception,
                     downloaded: bool) -> None:
        """Record a version that was not swapped in: never tried again when the version itself
        is broken, or when it was downloaded but could not be built BUILD_TRIES times (its
        MindIR does not load here: downloading it at every poll would never end); a failed
        download is tried again at the next poll (the registry may be back)."""
        reason = f"{type(err).__name__}: {err}"
        if downloaded:
            self._build_failures[version] = self._build_failures.get(version, 0) + 1
        if broken_version(err) or self._build_failures.get(version, 0) >= BUILD_TRIES:
            self.failed[version] = reason
        self.metrics.swap_failed(version, reason, time.time())
        log.error("follow %s: v%s not swapped in, still serving v%s: %s", uri, version,
                  current, reason)

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.retire()
        self.model_thread.shutdown(wait=False, cancel_futures=True)
        self.decode_pool.shutdown(wait=False, cancel_futures=True)
        for fetched in self._fetched.values():
            fetched.cleanup()

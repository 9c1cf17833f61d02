"""One served model: its encoder, its index, one batcher per tower, and the requests using it.

Batches are padded up to the next power of two up to 4, then to the next multiple of 4 (at most
`max_batch`), so the MindIR graphs see a few shapes (10 for a max_batch of 32) and a batch of 21
computes 24 rows, not 32, all compiled (`warm_up_steps()`) before the engine serves a request (a
graph compiles once per input shape, for seconds when fused; a first request must not pay for
that).
Padding rows are zeros and are dropped from the output.

`acquire()` / `release()` count the requests in flight, so a retired engine (the model was swapped
out) is closed only when the last request it accepted has been answered.
"""

# tested by: tests/serving/test_source.py

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clipms.deploy.searchindex import ImageIndex
from serving.batcher import Batcher


@dataclass(frozen=True)
class ModelInfo:
    """What every response names: the registered model and version (or a local bundle)."""

    name: str
    version: str
    alias: str | None = None
    run_id: str | None = None

    def public(self) -> dict[str, str]:
        return {"name": self.name, "version": self.version}

    @functools.cached_property
    def header(self) -> bytes:
        """The X-Model-Version value: `<name>/<version>`."""
        return f"{self.name}/{self.version}".encode()


@dataclass(frozen=True)
class BatchSettings:
    max_batch: int = 32
    max_wait_ms: float = 5.0
    max_queue: int = 1024


BUCKET_STEP = 4


def bucket(n: int, max_batch: int) -> int:
    """The padded batch size of n items: the next power of two up to BUCKET_STEP, then the next
    multiple of BUCKET_STEP; capped at max_batch."""
    if n > BUCKET_STEP:
        return min(-(-n // BUCKET_STEP) * BUCKET_STEP, max_batch)
    size = 1
    while size < n:
        size *= 2
    return min(size, max_batch)


def bucket_sizes(max_batch: int) -> list[int]:
    return sorted({bucket(n, max_batch) for n in range(1, max_batch + 1)})


class Engine:
    """Encoder + index of one model version, served through two batchers."""

    def __init__(self, info: ModelInfo, encoder: Any, index: ImageIndex, bundle_dir: Path,
                 digest: str) -> None:
        self.info = info
        self.encoder = encoder
        self.index = index
        self.bundle_dir = bundle_dir
        self.digest = digest
        self.inflight = 0
        self.retired = False
        self._drained: asyncio.Event | None = None
        self.text: Batcher | None = None
        self.image: Batcher | None = None
        self.runtime: dict[str, Any] = {}  # MindSpore's own context (serving.state)

    # -- model calls, always in the model thread
    def warm_up_steps(self, max_batch: int) -> list[Callable[[], Any]]:
        """One compile per tower and padded batch shape, each to run in the model thread."""
        size = self.encoder.preprocess.image_size
        steps: list[Callable[[], Any]] = []
        for n in bucket_sizes(max_batch):
            steps.append(functools.partial(self.encoder.encode_texts, [""] * n))
            steps.append(functools.partial(self.encoder.encode_preprocessed,
                                           np.zeros((n, 3, size, size), np.float32)))
        return steps

    def _encode_texts(self, texts: list[str], max_batch: int) -> np.ndarray:
        padded = texts + [""] * (bucket(len(texts), max_batch) - len(texts))
        return self.encoder.encode_texts(padded)[:len(texts)]

    def _encode_images(self, arrays: list[np.ndarray], max_batch: int) -> np.ndarray:
        pad = bucket(len(arrays), max_batch) - len(arrays)
        stacked = np.stack(arrays + [np.zeros_like(arrays[0])] * pad)
        return self.encoder.encode_preprocessed(stacked)[:len(arrays)]

    # -- the event loop side
    def start(self, executor: Executor, settings: BatchSettings, on_batch: Any = None,
              returning: Callable[[], bool] = lambda: False) -> None:
        """The batchers; more rows can come while a request in flight has not queued yet, or
        while `returning()` (serving.batcher.Returning: a keep-alive client about to send)."""
        def batcher(tower: str, run: Any) -> Batcher:
            return Batcher(tower, lambda items: run(items, settings.max_batch), executor,
                           settings.max_batch, settings.max_wait_ms, settings.max_queue,
                           on_batch, more_coming=lambda waiting: self.inflight > waiting
                           or returning())

        self.text = batcher("text", self._encode_texts)
        self.image = batcher("image", self._encode_images)
        self.text.start()
        self.image.start()
        self._drained = asyncio.Event()

    def acquire(self) -> Engine:
        self.inflight += 1
        return self

    def release(self) -> None:
        self.inflight -= 1
        if self.retired and self.inflight == 0 and self._drained is not None:
            self._drained.set()

    async def retire(self) -> None:
        """Stop after the requests in flight are answered (the model was swapped out)."""
        self.retired = True
        if self.inflight and self._drained is not None:
            await self._drained.wait()
        for batcher in (self.text, self.image):
            if batcher is not None:
                await batcher.stop()

    def describe(self) -> dict[str, Any]:
        return {**self.info.public(), "alias": self.info.alias, "run_id": self.info.run_id,
                "bundle_digest": self.digest, "index_rows": len(self.index),
                "embed_dim": self.encoder.embed_dim, "search": self.index.meta["search"]["kind"],
                "runtime": self.runtime}

"""Dynamic batching: concurrent requests for one tower become one model call.

Each request row is an item with its own future in a bounded queue. One task per tower takes the
first waiting item, then whatever else arrives within `max_wait_ms` (no wait when no other request
is in flight), up to `max_batch` items, and runs the tower on all of them at once in the model
thread (never on the event loop). Row i of the output resolves item i's future, so a request only
ever sees its own rows. While the model computes, new items wait in the queue and form the next
batch; a queue that is full refuses the whole request at once (`Overloaded`, an HTTP 503) instead
of growing without bound.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np


class Overloaded(RuntimeError):
    """The queue of a tower is full: the client should retry later (HTTP 503)."""


@dataclass
class _Item:
    payload: Any
    future: asyncio.Future


class Batcher:
    """Coalesces items for one tower; `run(payloads) -> (len(payloads), E) array`."""

    def __init__(self, name: str, run: Callable[[list[Any]], np.ndarray], executor: Executor,
                 max_batch: int, max_wait_ms: float, max_queue: int,
                 on_batch: Callable[[str, int, float], None] | None = None,
                 more_coming: Callable[[int], bool] | None = None) -> None:
        if max_batch < 1 or max_queue < 1 or max_wait_ms < 0:
            raise ValueError(f"max_batch {max_batch} and max_queue {max_queue} must be >= 1, "
                             f"max_wait_ms {max_wait_ms} >= 0")
        self.name = name
        self._run = run
        self._executor = executor
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1000.0
        self.max_queue = max_queue
        # A deque and an event rather than asyncio.Queue + wait_for(get()): a timed-out get can
        # lose an item on Python 3.11; an event wait that times out loses nothing.
        self._pending: deque[_Item] = deque()
        self._arrived = asyncio.Event()
        self._on_batch = on_batch
        # Whether items beyond the `n` waiting may still arrive (requests in flight that have not
        # queued yet); when none can, waiting max_wait_ms would only add latency (one client).
        self._more_coming = more_coming or (lambda n: True)
        self._task: asyncio.Task | None = None

    @property
    def depth(self) -> int:
        """Items waiting for a batch (not counting the batch being computed)."""
        return len(self._pending)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=self.name)

    async def stop(self) -> None:
        """Stop taking batches; items still waiting fail (only a retired, drained model stops)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        while self._pending:
            item = self._pending.popleft()
            if not item.future.done():
                item.future.set_exception(Overloaded(f"{self.name}: model unloaded"))

    async def submit(self, payloads: Sequence[Any]) -> list[np.ndarray]:
        """The output rows of `payloads`, in order; Overloaded when they do not all fit."""
        if not payloads:
            return []
        if len(self._pending) + len(payloads) > self.max_queue:  # all or nothing
            raise Overloaded(f"{self.name} queue full ({len(self._pending)} waiting, "
                             f"{len(payloads)} more asked, limit {self.max_queue})")
        loop = asyncio.get_running_loop()
        items = [_Item(payload, loop.create_future()) for payload in payloads]
        self._pending.extend(items)
        self._arrived.set()
        return list(await asyncio.gather(*(item.future for item in items)))

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._pending:
                self._arrived.clear()
                await self._arrived.wait()
            deadline = loop.time() + self.max_wait
            while len(self._pending) < self.max_batch and self._more_coming(len(self._pending)):
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), remaining)
                except TimeoutError:
                    break
            batch = [self._pending.popleft()
                     for _ in range(min(self.max_batch, len(self._pending)))]
            batch = [item for item in batch if not item.future.done()]  # callers gone
            if batch:
                await self._compute(loop, batch)

    async def _compute(self, loop: asyncio.AbstractEventLoop, batch: list[_Item]) -> None:
        started = time.perf_counter()
        try:
            out = await loop.run_in_executor(self._executor, self._run,
                                             [item.payload for item in batch])
        except Exception as err:  # the model failed: every caller of this batch learns it
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(err)
            return
        if self._on_batch is not None:
            self._on_batch(self.name, len(batch), time.perf_counter() - started)
        for item, row in zip(batch, out, strict=True):
            if not item.future.done():
                item.future.set_result(row)

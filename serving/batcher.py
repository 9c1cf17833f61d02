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


class Returning:
    """Keep-alive connections answered within the last `window` seconds that have not sent their
    next request yet: a client in a loop, about to come back. While there are any, a batch waits
    for them (never longer than its max_wait); a connection that does not come back expires."""

    def __init__(self, window: float) -> None:
        self.window = window
        self._answered: dict[Any, float] = {}  # connection -> when its answer went, oldest first

    def arrived(self, connection: Any) -> None:
        self._answered.pop(connection, None)

    def answered(self, connection: Any) -> None:
        self._answered.pop(connection, None)
        self._answered[connection] = time.perf_counter()

    def expected(self) -> bool:
        """Whether a connection answered within the window has not come back yet."""
        answered = self._answered
        oldest = time.perf_counter() - self.window
        while answered:
            connection = next(iter(answered))
            if answered[connection] >= oldest:
                return True
            del answered[connection]
        return False


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
        self._pending: deque[_Item] = deque()
        # The batch task sleeps on one future, woken by submit() only when it has something to do:
        # an item arrived while the queue was empty, or the batch being gathered is complete
        # (max_batch, or nothing more can come). The wait's end is a timer (call_at), not
        # wait_for(), which would start a task per arriving item.
        self._waiter: asyncio.Future | None = None
        self._gathering = False
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
        waiter = self._waiter
        if waiter is not None and not waiter.done() and (not self._gathering or self._complete()):
            waiter.set_result(None)
        if len(items) == 1:  # one row (most requests): its future alone, no gather
            return [await items[0].future]
        return list(await asyncio.gather(*(item.future for item in items)))

    def _complete(self) -> bool:
        """Whether the waiting items make a batch now: max_batch of them, or no more coming."""
        waiting = len(self._pending)
        return waiting >= self.max_batch or not self._more_coming(waiting)

    async def _sleep(self, loop: asyncio.AbstractEventLoop, deadline: float | None) -> None:
        """Until submit() wakes this task, or `deadline` (loop time; None: no deadline)."""
        self._waiter = waiter = loop.create_future()
        self._gathering = deadline is not None
        timer = loop.call_at(deadline, _wake, waiter) if deadline is not None else None
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending:
                await self._sleep(loop, None)
                continue
            await self._gather(loop)
            batch = [self._pending.popleft()
                     for _ in range(min(self.max_batch, len(self._pending)))]
            batch = [item for item in batch if not item.future.done()]  # callers gone
            if batch:
                await self._compute(loop, batch)

    async def _gather(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wait until the waiting rows make a batch, at most max_wait. Before a batch short of
        max_batch goes because no request is in flight, the loop runs twice more: requests whose
        bytes have already arrived are parsed and queue their rows (a closed-loop client's
        next requests arrive while the answers of the last batch are still being sent)."""
        deadline = loop.time() + self.max_wait
        drained = False
        while len(self._pending) < self.max_batch and loop.time() < deadline:
            if not self._complete():
                await self._sleep(loop, deadline)
            elif drained:
                return
            else:
                drained = True
                await asyncio.sleep(0)  # the sockets are read
                await asyncio.sleep(0)  # the requests read run up to their submit()

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


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)

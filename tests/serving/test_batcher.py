"""serving.batcher.Batcher on a real event loop with a real model thread (a numpy function that
records each batch it is given): batch sizes, each caller's own rows, the queue bound, a failing
model call, cancelled callers, and that nothing waits when no more rows can come."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from serving.batcher import Batcher, Overloaded

HANG_GUARD_S = 60.0  # bounds a hang (a broken wake-up); not a speed check


class Tower:
    """The 'model': row i of a batch is [payload_i, 2 * payload_i]; every batch is recorded."""

    def __init__(self) -> None:
        self.batches: list[list[float]] = []

    def __call__(self, payloads: list[float]) -> np.ndarray:
        if any(p < 0 for p in payloads):
            raise RuntimeError("negative input")
        self.batches.append(list(payloads))
        values = np.asarray(payloads, np.float32)
        return np.stack([values, 2 * values], axis=1)


def run(scenario, **settings) -> tuple[object, Tower]:
    tower = Tower()

    async def main() -> object:
        with ThreadPoolExecutor(1) as pool:
            batcher = Batcher("text", tower, pool, **{"max_batch": 4, "max_wait_ms": 50.0,
                                                      "max_queue": 64, **settings})
            batcher.start()
            try:
                return await asyncio.wait_for(scenario(batcher), HANG_GUARD_S)
            finally:
                await batcher.stop()

    return asyncio.run(main()), tower


def test_rows_submitted_together_batch_up_to_max_batch_and_each_caller_gets_its_own() -> None:
    async def scenario(batcher: Batcher) -> list[list[np.ndarray]]:
        return await asyncio.gather(*(batcher.submit([float(i)]) for i in range(10)))

    answers, tower = run(scenario, more_coming=lambda waiting: True)
    assert [len(b) for b in tower.batches] == [4, 4, 2]  # the last 2 waited for more, then ran
    assert sorted(p for b in tower.batches for p in b) == [float(i) for i in range(10)]
    for i, rows in enumerate(answers):
        assert len(rows) == 1 and rows[0].tolist() == [i, 2 * i]


def test_a_request_with_nothing_more_coming_does_not_wait_and_keeps_its_row_order() -> None:
    async def scenario(batcher: Batcher) -> list[np.ndarray]:
        return await batcher.submit([3.0, 1.0, 2.0])

    # max_wait of ten minutes: only "no more rows can come" ends the wait (else the guard fails)
    rows, tower = run(scenario, max_wait_ms=600_000.0, more_coming=lambda waiting: False)
    assert [r.tolist() for r in rows] == [[3, 6], [1, 2], [2, 4]]
    assert tower.batches == [[3.0, 1.0, 2.0]]


def test_a_full_queue_refuses_the_whole_request_and_the_rest_goes_on() -> None:
    async def scenario(batcher: Batcher) -> list[np.ndarray]:
        with pytest.raises(Overloaded, match="queue full"):
            await batcher.submit([1.0] * 4)
        assert batcher.depth == 0  # all or nothing: no row of the refused request queued
        return await batcher.submit([5.0])

    rows, tower = run(scenario, max_queue=3, more_coming=lambda waiting: False)
    assert rows[0].tolist() == [5, 10] and tower.batches == [[5.0]]


def test_a_failing_model_call_fails_its_callers_only_and_batching_goes_on() -> None:
    async def scenario(batcher: Batcher) -> list[object]:
        failed = await asyncio.gather(batcher.submit([1.0]), batcher.submit([-1.0]),
                                      return_exceptions=True)
        return [*failed, await batcher.submit([7.0])]

    (first, second, after), tower = run(scenario, more_coming=lambda waiting: waiting < 2)
    assert isinstance(first, RuntimeError) and isinstance(second, RuntimeError)
    assert after[0].tolist() == [7, 14] and tower.batches == [[7.0]]


def test_a_cancelled_caller_is_left_out_of_the_batch() -> None:
    async def scenario(batcher: Batcher) -> list[list[np.ndarray]]:
        gone = asyncio.ensure_future(batcher.submit([1.0]))
        await asyncio.sleep(0)  # it queued its row
        gone.cancel()
        return await asyncio.gather(batcher.submit([2.0]), batcher.submit([3.0]))

    answers, tower = run(scenario, max_batch=3, max_wait_ms=600_000.0,
                         more_coming=lambda waiting: waiting < 3)
    assert tower.batches == [[2.0, 3.0]]
    assert [rows[0].tolist() for rows in answers] == [[2, 4], [3, 6]]


def test_returning_connections_are_expected_until_they_come_back_or_expire() -> None:
    from serving.batcher import Returning

    returning = Returning(window=3600.0)
    assert not returning.expected()
    returning.answered(("127.0.0.1", 5001))
    returning.answered(("127.0.0.1", 5002))
    assert returning.expected()
    returning.arrived(("127.0.0.1", 5001))
    assert returning.expected()  # 5002 has not come back
    returning.arrived(("127.0.0.1", 5002))
    assert not returning.expected()
    gone = Returning(window=5.0)
    gone.answered(("127.0.0.1", 5003))
    gone._answered[("127.0.0.1", 5003)] -= 10.0  # answered 10 s ago: past the window
    assert not gone.expected() and not gone._answered  # expired and forgotten


def test_a_batch_waits_for_a_returning_client_and_goes_when_it_is_back() -> None:
    """more_coming says yes while a client is expected: the lone row waits for the next one
    (ten minutes of max_wait, so only the arrival of B's row can end the wait)."""
    from serving.batcher import Returning

    returning = Returning(window=3600.0)
    returning.answered("client B")

    async def scenario(batcher: Batcher) -> list[list[np.ndarray]]:
        first = asyncio.ensure_future(batcher.submit([1.0]))
        await asyncio.sleep(0.05)  # the batcher had its turns; B is still expected
        assert not first.done()
        returning.arrived("client B")  # B is back: its row joins the waiting one
        second = asyncio.ensure_future(batcher.submit([2.0]))
        return [await first, await second]

    answers, tower = run(scenario, max_wait_ms=600_000.0,
                         more_coming=lambda waiting: returning.expected())
    assert tower.batches == [[1.0, 2.0]]
    assert [rows[0].tolist() for rows in answers] == [[1, 2], [2, 4]]

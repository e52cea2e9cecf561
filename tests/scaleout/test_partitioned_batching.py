"""A partition server's coalescer: requests waiting together share one batch, each gets its own
rows in order, a lone request is computed at once, a failure reaches every request of its batch,
and a caller that gave up is skipped."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from quiver_serve.scaleout.partitioned.batching import Coalescer


class Doubler:
    """Rows ``[id, 2 * id]`` per id; records each batch's ids; waits ``delay_s`` per batch."""

    def __init__(self, delay_s: float = 0.01, fail: bool = False) -> None:
        self.batches: list[list[int]] = []
        self.delay_s, self.fail = delay_s, fail

    async def __call__(self, ids: np.ndarray) -> np.ndarray:
        self.batches.append(ids.tolist())
        await asyncio.sleep(self.delay_s)
        if self.fail:
            raise ConnectionError("partition 1 is unavailable")
        return np.stack([ids, 2 * ids], 1).astype(np.float32)


def test_a_burst_shares_batches_and_each_request_gets_its_rows() -> None:
    run = Doubler()
    co = Coalescer(run, max_batch_nodes=10, max_in_flight=1)

    async def burst() -> list[np.ndarray]:
        return await asyncio.gather(*(co.submit(np.arange(i, i + 3)) for i in range(0, 30, 3)))

    got = asyncio.run(burst())
    for i, rows in enumerate(got):
        ids = np.arange(3 * i, 3 * i + 3)
        np.testing.assert_array_equal(rows, np.stack([ids, 2 * ids], 1))
    # ten requests of 3 ids arriving together: batches of whole requests up to 10 ids
    assert [len(b) for b in run.batches] == [9, 9, 9, 3]
    assert sum(run.batches, []) == list(range(30))


def test_a_lone_request_is_computed_at_once() -> None:
    run = Doubler(delay_s=0.0)
    co = Coalescer(run, max_batch_nodes=10)
    np.testing.assert_array_equal(asyncio.run(co.submit(np.array([4]))), [[4, 8]])
    assert run.batches == [[4]]


def test_a_failed_batch_fails_each_of_its_requests() -> None:
    co = Coalescer(Doubler(fail=True), max_batch_nodes=100)

    async def two() -> list[object]:
        return await asyncio.gather(co.submit(np.array([1])), co.submit(np.array([2])),
                                    return_exceptions=True)

    got = asyncio.run(two())
    assert all(isinstance(g, ConnectionError) for g in got)


def test_a_caller_that_gave_up_is_skipped() -> None:
    run = Doubler(delay_s=0.05)
    co = Coalescer(run, max_batch_nodes=100, max_in_flight=1)

    async def scenario() -> np.ndarray:
        first = asyncio.ensure_future(co.submit(np.array([1])))
        await asyncio.sleep(0)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(co.submit(np.array([7])), 0.01)  # waits behind the first
        kept = await co.submit(np.array([3]))
        await first
        return kept

    np.testing.assert_array_equal(asyncio.run(scenario()), [[3, 6]])
    assert [7] not in run.batches and all(7 not in b for b in run.batches)

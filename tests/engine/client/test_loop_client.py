"""The event-loop client's timers: answered requests leave no deadline behind.

Every request has a deadline (``server.request_timeout_s``); a loop client arms one timer for the
earliest deadline of the requests it still holds. Answered requests must not keep that timer
firing: a front-end that served 4 k requests a second would otherwise wake thousands of times a
second for ten seconds after the load stopped, chasing deadlines nobody waits for.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from quiver_serve import Pipeline
from quiver_serve.graph.csc import GraphData
from tests.conftest import small_config

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pipeline(cora: GraphData) -> Iterator[Pipeline]:
    p = Pipeline(small_config(model__weights=None), graph=cora).start()
    try:
        yield p
    finally:
        p.stop(drain_timeout_s=0.0)


def test_answered_requests_leave_no_deadline_and_no_timer_wakeups(pipeline: Pipeline) -> None:
    async def run() -> tuple[int, float | None, int]:
        await asyncio.gather(*(pipeline.embed_async([i % 2708]) for i in range(300)))
        client = pipeline.async_client()
        await asyncio.sleep(0.05)  # the last replies' callbacks
        timer_in_s = None if client._timer is None else client._timer_at_s - time.time()
        return len(client._deadlines), timer_in_s, client.pending_count

    left, timer_in_s, pending = asyncio.run(run())
    assert pending == 0
    assert left == 0, "answered requests still hold deadlines"
    # at most the one timer armed while requests were pending (the earliest deadline, about
    # server.request_timeout_s away), never one chasing the deadlines of answered requests
    assert timer_in_s is None or timer_in_s > 1.0


def test_front_end_requests_get_numpy_views_of_the_reply_and_others_tensors() -> None:
    """A front-end's requests (``numpy_rows``) are answered with read-only views of the reply
    buffer (no copy); the queue API's with tensors of one copy per micro-batch; both the same
    rows, and a failed request its error."""
    import numpy as np
    import torch

    from quiver_serve.engine.client.inflight import Admitted, Flight
    from quiver_serve.wire import MicroBatchDone, RequestError

    rows = np.arange(5 * 4, dtype=np.float32).reshape(5, 4)
    reply = rows.tobytes()

    def admitted(rid: str, n: int, numpy_rows: bool) -> Admitted:
        return Admitted(rid, np.arange(n, dtype=np.int64), False, None, time.time() + 9, None,
                        None, numpy_rows=numpy_rows)

    reqs = [admitted("a", 2, True), admitted("b", 1, False), admitted("c", 2, True)]
    done = MicroBatchDone(1, 4, [RequestError(1, "bad", "no", 400)], model="m", version=2)
    out = Flight(0, reqs, [], 5).answers(done, [b"", reply])
    a, b, c = (result for _, result in out)
    assert a.embeddings is None and isinstance(a.rows, np.ndarray)
    np.testing.assert_array_equal(a.rows, rows[0:2])
    np.testing.assert_array_equal(c.rows, rows[3:5])
    assert not a.rows.flags.writeable and np.shares_memory(a.rows, np.frombuffer(reply, np.float32))
    assert (a.model, a.version) == ("m", 2)
    assert b.error is not None and b.error.status == 400 and b.rows is None
    tensor_req = admitted("d", 5, False)
    (_, d), = Flight(0, [tensor_req], [], 5).answers(MicroBatchDone(2, 4), [b"", reply])
    assert isinstance(d.embeddings, torch.Tensor) and d.rows is None
    np.testing.assert_array_equal(d.embeddings.numpy(), rows)

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

"""Requests that wait together on a partition server are computed together: one sample across
partitions (one call per partition per hop for the whole batch, not per request), one gather,
one model call. As in the engine core's continuous batching (``engine/core/forming.py``), a batch
is formed whenever one of ``max_in_flight`` slots is free, from everything waiting up to
``max_batch_nodes`` ids, so a lone request is computed at once and a burst shares batches.
Unseeded sampled requests merge with each other, exact requests with each other (one coalescer
each: an exact row does not depend on its batch); a seeded request's answer is a function of
its own ids and seed, so it keeps a batch of its own (as in the engine core). What waits is bounded by
the server's admission (``partitioned.max_ongoing_requests``: past it, 503 before submitting).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable

import numpy as np


class Coalescer:
    """``await submit(ids)`` -> that request's rows of a shared batch (see the module doc)."""

    def __init__(self, run: Callable[[np.ndarray], Awaitable[np.ndarray]],
                 max_batch_nodes: int, max_in_flight: int = 2) -> None:
        self.run, self.max_batch_nodes, self.max_in_flight = run, max_batch_nodes, max_in_flight
        self.waiting: deque[tuple[np.ndarray, asyncio.Future[np.ndarray]]] = deque()
        self.in_flight = 0
        self.batches = 0

    async def submit(self, ids: np.ndarray) -> np.ndarray:
        fut: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        self.waiting.append((ids, fut))
        if self.in_flight < self.max_in_flight:
            self.in_flight += 1
            asyncio.ensure_future(self._drain())
        return await fut

    def _take(self) -> list[tuple[np.ndarray, asyncio.Future[np.ndarray]]]:
        """The next batch: waiting requests in arrival order up to ``max_batch_nodes`` ids
        (at least one), skipping those whose caller gave up."""
        taken: list[tuple[np.ndarray, asyncio.Future[np.ndarray]]] = []
        size = 0
        while self.waiting:
            ids, fut = self.waiting[0]
            if fut.done():
                self.waiting.popleft()
                continue
            if taken and size + ids.size > self.max_batch_nodes:
                break
            taken.append(self.waiting.popleft())
            size += ids.size
        return taken

    async def _drain(self) -> None:
        try:
            while True:
                taken = self._take()
                if not taken:
                    return
                await self._one(taken)
        finally:
            self.in_flight -= 1

    async def _one(self, taken: list[tuple[np.ndarray, asyncio.Future[np.ndarray]]]) -> None:
        self.batches += 1
        ids = taken[0][0] if len(taken) == 1 else np.concatenate([i for i, _ in taken])
        try:
            rows = await self.run(ids)
        except Exception as exc:  # noqa: BLE001 - every request of the batch hears it
            for _, fut in taken:
                if not fut.done():
                    fut.set_exception(exc)
            return
        start = 0
        for part, fut in taken:
            if not fut.done():
                fut.set_result(rows[start:start + part.size])
            start += part.size

"""Exact requests answered from the exact table (docs/architecture.md, "The exact table"), in the
engine step they arrive.

Every exact micro-batch waiting at a step whose requests name only non-stale rows is answered
by one gather for all of them (one copy to the host, one sync); the others go on to the
on-the-fly exact path, as every exact request did before the table, or wait (within their
deadline) for the refresh round to end (``exact.stale_rows``: ``wait``, or ``auto`` while a full
recompute is due). A stale row is one an
applied update may have changed and the refresh has not recomputed yet (``exact_table.py``), so
both paths answer for the version the engine core serves.
"""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np

from quiver_serve.engine.core.micro_batch import MicroBatch, Part, Reply, prune
from quiver_serve.engine.core.model_tables import ExactTables
from quiver_serve.messages import BatchStats
from quiver_serve.wire import MicroBatchDone


class AnsweringCore(Protocol):
    """The engine core as the table's answers see it (``core.EngineCore``)."""

    index: int
    tables: ExactTables
    exact_waiting: list[MicroBatch]

    def enqueue(self, mb: MicroBatch) -> None: ...

    def record_stats(self, stats: BatchStats) -> None: ...


def answer(core: AnsweringCore, now_s: float) -> list[Reply]:
    """Answer the waiting exact micro-batches the table can; queue the rest on the fly."""
    table = core.tables.table
    assert table is not None
    waiting, core.exact_waiting = core.exact_waiting, []
    replies: list[Reply] = []
    parts: list[Part] = []
    for mb in waiting:
        part = prune(mb, now_s)
        if part.alive is not None and not part.alive.any():
            replies.append(Reply(mb.client, MicroBatchDone(mb.seq, 0, part.errors), None))
            continue
        if table.servable(part.alive_ids()):
            parts.append(part)
        elif table.waits():
            core.exact_waiting.append(mb)  # answered when the refresh round ends
        else:
            table.counters.on_the_fly += part.num_alive
            core.enqueue(mb)
    if not parts:
        return replies
    ids = parts[0].alive_ids() if len(parts) == 1 else np.concatenate(
        [p.alive_ids() for p in parts])
    t0 = time.perf_counter()
    rows = table.lookup(ids)
    stats = _stats(core, parts, int(ids.size), time.perf_counter() - t0, now_s)
    table.counters.from_table += stats.num_requests
    start, dim = 0, table.dim
    for i, part in enumerate(parts):
        chunk, start = _rows_of(part, rows, start, dim)
        done = MicroBatchDone(part.mb.seq, dim, part.errors, stats if i == 0 else None,
                              model=part.mb.slot.name, version=part.mb.slot.version)
        replies.append(Reply(part.mb.client, done, chunk))
    core.record_stats(stats)
    return replies


def _stats(core: AnsweringCore, parts: list[Part], num_ids: int, gather_s: float,
           now_s: float) -> BatchStats:
    """The table answers of one step, reported as a batch of route ``table``."""
    oldest = min(p.mb.received_s for p in parts)
    return BatchStats(batch_id=-1, route="table", worker=core.index,
                      num_requests=sum(p.num_alive for p in parts), num_seeds=num_ids,
                      queue_s=max(now_s - oldest, 0.0), gather_s=gather_s, compute_s=gather_s,
                      received_s=parts[0].mb.received_s)


def _rows_of(part: Part, rows: np.ndarray, start: int, dim: int) -> tuple[np.ndarray, int]:
    mb: MicroBatch = part.mb
    if part.alive is None:
        return rows[start:start + mb.num_ids], start + mb.num_ids
    alive_pos = np.repeat(part.alive, mb.lengths)
    n_alive = int(alive_pos.sum())
    chunk = np.zeros((mb.num_ids, dim), np.float32)  # refused requests: zero rows, errors named
    chunk[alive_pos] = rows[start:start + n_alive]
    return chunk, start + n_alive

"""RequestBatcher: merge requests into batches closed on size (``max_batch_nodes``) or delay.

``BatchAssembler`` is the plain logic (tests drive it with explicit clocks); ``RequestBatcher`` owns
the thread that feeds it from a stream queue and emits to a bounded batched-request queue.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from quiver_serve.config import ServeConfig
from quiver_serve.engine.process import get_or_none, put_until
from quiver_serve.messages import BatchedRequest, EmbedRequest, Shutdown
from quiver_serve.sampling.base import new_batch_seed

log = logging.getLogger(__name__)


@dataclass
class _OpenBatch:
    opened_s: float
    requests: list[EmbedRequest] = field(default_factory=list)
    num_nodes: int = 0


class BatchAssembler:
    """Groups requests; a seeded request is a batch of its own so its sample is reproducible.

    Exact and sampled requests never share a batch (they sample with different fanouts). A request
    larger than ``max_batch_nodes`` is not split: it forms a batch alone.
    """

    def __init__(self, max_batch_nodes: int, max_delay_s: float, default_timeout_s: float,
                 generator: torch.Generator | None = None) -> None:
        self.max_batch_nodes = max_batch_nodes
        self.max_delay_s = max_delay_s
        self.default_timeout_s = default_timeout_s
        self._open: dict[bool, _OpenBatch] = {}
        self._ids = itertools.count()
        self._generator = generator

    def add(self, request: EmbedRequest, now_s: float) -> list[BatchedRequest]:
        """Add one request; returns the batches this closes (by size, or a seeded request)."""
        n = int(request.node_ids.numel())
        if request.seed is not None:
            return [self._make([request], seed=request.seed)]
        closed: list[BatchedRequest] = []
        current = self._open.get(request.exact)
        if current is not None and current.num_nodes + n > self.max_batch_nodes:
            closed.append(self._close(request.exact))
            current = None
        if current is None:
            current = self._open[request.exact] = _OpenBatch(opened_s=now_s)
        current.requests.append(request)
        current.num_nodes += n
        if current.num_nodes >= self.max_batch_nodes or self.max_delay_s == 0:
            closed.append(self._close(request.exact))
        return closed

    def poll(self, now_s: float) -> list[BatchedRequest]:
        """Close every open batch whose first request has waited ``max_delay_s``."""
        due = [k for k, b in self._open.items() if now_s - b.opened_s >= self.max_delay_s]
        return [self._close(k) for k in due]

    def next_due_s(self) -> float | None:
        """When the oldest open batch must close, or None when none is open."""
        if not self._open:
            return None
        return min(b.opened_s for b in self._open.values()) + self.max_delay_s

    def flush(self) -> list[BatchedRequest]:
        return [self._close(k) for k in list(self._open)]

    def _close(self, key: bool) -> BatchedRequest:
        batch = self._open.pop(key)
        return self._make(batch.requests, seed=None)

    def _make(self, requests: list[EmbedRequest], seed: int | None) -> BatchedRequest:
        offsets = [0]
        for r in requests:
            offsets.append(offsets[-1] + int(r.node_ids.numel()))
        return BatchedRequest(
            batch_id=next(self._ids),
            request_ids=[r.request_id for r in requests],
            offsets=offsets,
            node_ids=torch.cat([r.node_ids.reshape(-1).to(torch.int64) for r in requests]),
            exact=requests[0].exact,
            seed=new_batch_seed(self._generator) if seed is None else seed,
            deadlines_s=[
                r.deadline_s if r.deadline_s is not None else r.submitted_s + self.default_timeout_s
                for r in requests
            ],
            created_s=min(r.submitted_s for r in requests),
        )


def as_request(item: Any, seq: int) -> EmbedRequest | None:
    """Accept an EmbedRequest, or a bare LongTensor of node ids (request_id = its arrival number)."""
    if isinstance(item, EmbedRequest):
        return item
    if isinstance(item, Tensor):
        return EmbedRequest(request_id=str(seq), node_ids=item)
    return None


class RequestBatcher:
    """Reads ``stream_queue`` in a thread and emits batches to ``batched_request_queue_list()``.

    The thread starts on construction (as in the seed's API); ``stop()`` flushes and joins it.
    With ``downstream_idle`` (a cheap callable; the Pipeline passes one that reads queue depths),
    batching adapts to load: when nothing is queued downstream and no request is waiting, the open
    batch leaves at once instead of waiting ``max_delay_ms``; under load batches fill up to
    ``max_batch_nodes`` or the delay. Without it the batcher keeps the fixed size/delay rule.
    """

    def __init__(self, cfg: ServeConfig, stream_queue: Any, start: bool = True,
                 downstream_idle: Callable[[], bool] | None = None,
                 is_live: Callable[[str], bool] | None = None) -> None:
        self.cfg = cfg
        #: False for a request already answered (deadline, cancelled): it is skipped, not computed
        self.is_live = is_live
        self.stream_queue = stream_queue
        self.downstream_idle = downstream_idle if cfg.batching.adaptive else None
        self._out: queue.Queue[BatchedRequest] = queue.Queue(maxsize=cfg.batching.queue_capacity)
        self._assembler = BatchAssembler(
            cfg.batching.max_batch_nodes, cfg.batching.max_delay_ms / 1000.0,
            cfg.server.request_timeout_s,
        )
        self._stop = threading.Event()
        self._seq = itertools.count()
        self._thread = threading.Thread(target=self._run, name="quiver-batcher", daemon=True)
        self.dropped_items = 0
        self.skipped_requests = 0
        if start:
            self._thread.start()

    def batched_request_queue_list(self) -> list[queue.Queue[BatchedRequest]]:
        return [self._out]

    def start(self) -> None:
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def _emit(self, batches: list[BatchedRequest]) -> None:
        for b in batches:
            if self.is_live is not None:  # answered while waiting here (deadline, cancelled)
                keep = [i for i, rid in enumerate(b.request_ids) if self.is_live(rid)]
                self.skipped_requests += b.num_requests - len(keep)
                if not keep:
                    continue
                if len(keep) < b.num_requests:
                    b = b.subset(keep)
            if not put_until(self._out, b, lambda: not self._stop.is_set()):
                log.warning("batcher stopping: batch %d of %d requests not handed on",
                            b.batch_id, b.num_requests)

    def _run(self) -> None:
        while not self._stop.is_set():
            due = self._assembler.next_due_s()
            wait_s = 0.05 if due is None else min(0.05, max(due - time.time(), 0.0))
            item = get_or_none(self.stream_queue, wait_s) if wait_s > 0 else _get_nowait(self.stream_queue)
            if isinstance(item, Shutdown):
                break
            if item is not None:
                request = as_request(item, next(self._seq))
                if request is None:
                    self.dropped_items += 1
                    log.error("batcher: ignoring %s (expected EmbedRequest or LongTensor)", type(item))
                elif self.is_live is not None and not self.is_live(request.request_id):
                    self.skipped_requests += 1
                else:
                    self._emit(self._assembler.add(request, time.time()))
            self._emit(self._assembler.poll(time.time()))
            if self._should_flush_early():
                self._emit(self._assembler.flush())
        self._emit(self._assembler.flush())

    def _should_flush_early(self) -> bool:
        if self.downstream_idle is None or self._assembler.next_due_s() is None:
            return False
        return _qsize(self.stream_queue) == 0 and _qsize(self._out) == 0 and self.downstream_idle()


def _qsize(q: Any) -> int:
    try:
        return int(q.qsize())
    except (NotImplementedError, OSError):
        return 1  # unknown depth: assume busy, keep the fixed size/delay rule


def _get_nowait(q: Any) -> Any:
    try:
        return q.get_nowait()
    except queue.Empty:
        return None

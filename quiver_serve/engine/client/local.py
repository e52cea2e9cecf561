"""An engine core driven by one thread of this process: no sockets, no child processes.

Ray Serve replicas (``ray_serve.py``) use it: each replica is one engine core on one GPU (or the
CPU), built on graph arrays read zero-copy from Ray's object store. Requests are micro-batches of
one request each; the core merges whatever waits into batches as in the daemon (continuous
batching, the same cost model and fill policy), so concurrent callers share batches.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future

import numpy as np

from quiver_serve import errors
from quiver_serve.config import ServeConfig
from quiver_serve.engine.core.micro_batch import MicroBatch, Reply
from quiver_serve.graph.csc import GraphData
from quiver_serve.wire import NO_SEED

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05  # the loop's longest sleep when nothing is queued or computing


class LocalEngine:
    """``embed(ids) -> rows`` from any thread; one engine thread runs the core."""

    def __init__(self, cfg: ServeConfig, graph: GraphData) -> None:
        from quiver_serve.engine.core.build import build_core

        self.cfg = cfg
        self.core = build_core(cfg, graph, 0, None)
        self.num_nodes = graph.num_nodes
        self.dim = self.core.model.out_dim
        self._inbox: queue.Queue[MicroBatch] = queue.Queue(maxsize=cfg.batching.queue_capacity)
        self._waiting: dict[int, Future[np.ndarray]] = {}
        self._seq = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="quiver-local-engine", daemon=True)
        self._thread.start()

    def embed(self, node_ids: np.ndarray, exact: bool = False, seed: int | None = None,
              timeout_s: float | None = None) -> np.ndarray:
        """float32 [len(node_ids), dim]; raises :class:`errors.ServeError` with the daemon's
        codes (400 ids out of range, 503 queue full or stopped, 504 deadline)."""
        if self._stop.is_set():
            raise errors.unavailable("shutting_down", "the engine is stopping")
        ids = np.ascontiguousarray(np.asarray(node_ids, dtype=np.int64).reshape(-1))
        timeout_s = self.cfg.server.request_timeout_s if timeout_s is None else timeout_s
        seq = next(self._seq)
        mb = MicroBatch(b"local", seq, exact, NO_SEED if seed is None else seed, ids,
                        np.array([ids.size], np.int64), np.array([time.time() + timeout_s]))
        fut: Future[np.ndarray] = Future()
        self._waiting[seq] = fut
        try:
            self._inbox.put_nowait(mb)
        except queue.Full:
            self._waiting.pop(seq, None)
            raise errors.overloaded("engine queue is full; retry later", 503) from None
        try:
            return fut.result(timeout=timeout_s + 5.0)  # the engine answers 504 at the deadline
        except TimeoutError:
            self._waiting.pop(seq, None)
            raise errors.deadline() from None

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        for fut in list(self._waiting.values()):
            if not fut.done():
                fut.set_exception(errors.unavailable("shutting_down", "the engine stopped"))
        self._waiting.clear()

    def _run(self) -> None:
        core = self.core
        while not self._stop.is_set():
            try:
                wait_s = 0.0 if core.busy() else _IDLE_WAIT_S
                mb: MicroBatch | None = self._inbox.get(timeout=wait_s) if wait_s else \
                    self._inbox.get_nowait()
            except queue.Empty:
                mb = None
            replies: list[Reply] = []
            while mb is not None:
                refused = core.add(mb)
                if refused is not None:
                    replies.append(refused)
                try:
                    mb = self._inbox.get_nowait()
                except queue.Empty:
                    mb = None
            try:
                replies += core.step()
            except Exception as exc:  # noqa: BLE001 - a fault of the core: every waiter hears it
                log.exception("local engine step failed")
                self._fail_all(exc)
                continue
            for reply in replies:
                self._deliver(reply)

    def _deliver(self, reply: Reply) -> None:
        fut = self._waiting.pop(reply.done.seq, None)
        if fut is None or fut.done():
            return
        if reply.done.errors:
            e = reply.done.errors[0]
            fut.set_exception(errors.ServeError(e.code, e.message, e.status))
        elif reply.rows is None:
            fut.set_exception(errors.ServeError("internal", "the engine returned no rows", 500))
        else:
            fut.set_result(np.array(reply.rows, dtype=np.float32, copy=True))

    def _fail_all(self, exc: BaseException) -> None:
        for seq in list(self._waiting):
            fut = self._waiting.pop(seq)
            if not fut.done():
                fut.set_exception(errors.ServeError("internal", f"engine failure: {exc}", 500))

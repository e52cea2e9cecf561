"""What an HTTP front-end needs from the serving path, over its engine clients.

Two classes implement it: :class:`~quiver_serve.engine.pipeline.Pipeline` (the engine cores are
this process's children; one front-end in the main process) and
:class:`~quiver_serve.frontend.frontend_proc.RemotePipeline` (a front-end process of several, whose
clients reach the main process's engine cores). Admission, drain and the per-request submit are
here, once.

Coroutines are served by a :class:`~quiver_serve.engine.loop_client.LoopClient` per event loop
(made on a loop's first request: no thread hand-off on the request path); threads by the
IO-thread client ``self.client`` (``Pipeline`` only).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import Any

import numpy as np

from quiver_serve import errors
from quiver_serve.config import ServeConfig
from quiver_serve.engine.client.client import EngineClient, EngineEndpoints
from quiver_serve.engine.client.loop_client import LoopClient
from quiver_serve.metrics.observer import PipelineObserver
from quiver_serve.wire import InductiveNodes


class ClientFacade:
    """Admission (``ready``), drain, and ``submit_ids_async`` over ``self.client``."""

    cfg: ServeConfig
    client: EngineClient | None
    observer: PipelineObserver

    def _init_facade(self, id_prefix: str) -> None:
        #: what a loop client connects to; None until the engine cores are up
        self.client_endpoints: EngineEndpoints | None = None
        self._loop_clients: dict[asyncio.AbstractEventLoop, LoopClient] = {}
        self._clients_lock = threading.Lock()
        self._rids = itertools.count()
        self._rid_prefix = id_prefix
        self._accepting = False
        self._draining = False
        self._stopping = threading.Event()

    @property
    def ready(self) -> bool:
        """Admitting requests: started, not draining, not stopped."""
        return self._accepting and not self._stopping.is_set()

    @property
    def draining(self) -> bool:
        return self._draining

    def refusal(self) -> errors.ServeError:
        """The 503 to answer while not accepting: starting up, or shutting down."""
        if self._draining:
            return errors.unavailable("shutting_down", "the server is shutting down")
        return errors.unavailable("not_ready", "the server is starting up")

    @property
    def pending_count(self) -> int:
        return sum(c.pending_count for c in self.clients())

    def clients(self) -> list[EngineClient]:
        """Every engine client now: the blocking callers' and each event loop's."""
        with self._clients_lock:
            loop_clients: list[EngineClient] = list(self._loop_clients.values())
        return ([self.client] if self.client is not None else []) + loop_clients

    def async_client(self) -> LoopClient:
        """The client of the running event loop (made on its first request; clients of loops
        that have closed since are stopped here)."""
        loop = asyncio.get_running_loop()
        client = self._loop_clients.get(loop)
        if client is not None:
            return client
        if self.client_endpoints is None or not self.ready:
            raise self.refusal()
        with self._clients_lock:
            dead = [lp for lp in self._loop_clients if lp.is_closed()]
            stale = [self._loop_clients.pop(lp) for lp in dead]
            client = LoopClient(self.client_endpoints, self.observer,
                                f"{self._rid_prefix}loop{len(self._loop_clients)}", loop)
            self._loop_clients[loop] = client
        for old in stale:
            old.stop(timeout_s=0.1)
        return client

    def stop_clients(self) -> None:
        """Stop every client; what they still hold is answered 503."""
        for client in self.clients():
            client.stop()

    def begin_drain(self) -> None:
        """Readiness turns false and new requests get 503; admitted ones go on."""
        self._accepting = False
        self._draining = True

    def wait_drained(self, timeout_s: float) -> bool:
        """Wait (bounded) until no admitted request is left; True if none is."""
        end = time.monotonic() + timeout_s
        while self.pending_count and time.monotonic() < end:
            time.sleep(0.01)
        return not self.pending_count

    def submit_ids_async(self, ids: np.ndarray, exact: bool, seed: int | None,
                         timeout_s: float | None, min_version: int = 0,
                         inductive: InductiveNodes | None = None, model: str = "",
                         version: int = 0, node_type: str = "") -> tuple[str, Any]:
        """The hot path of a front-end: ids (and inductive nodes) already checked (int64, in
        range, not too many). Returns the request id (to cancel it) and an asyncio future of
        its EmbedResult (which names the model and version that computed it; its rows are
        ``EmbedResult.rows``, a NumPy view of the reply)."""
        if not self.ready:
            raise self.refusal()
        client = self.async_client()
        errors.check_seed(seed)
        limit = self.cfg.server.request_timeout_s
        deadline_s = time.time() + (limit if timeout_s is None else min(timeout_s, limit))
        rid = f"{self._rid_prefix}{next(self._rids)}"
        return rid, client.submit_async(ids, exact, seed, deadline_s, rid, min_version, inductive,
                                        model, version, numpy_rows=True, node_type=node_type)

    def cancel(self, request_id: str, reason: str = "client_disconnected") -> bool:
        """Forget a request nobody waits for; not computed if it has not been sent yet."""
        try:
            client: EngineClient | None = self._loop_clients.get(asyncio.get_running_loop())
        except RuntimeError:  # not on an event loop
            client = None
        if client is not None and client.cancel(request_id):
            return True
        return self.client.cancel(request_id) if self.client is not None else False

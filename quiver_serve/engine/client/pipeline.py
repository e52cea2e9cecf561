"""Pipeline: the facade over the supervisor (engine cores, CPU sampler pool) and one client.

``Pipeline(cfg).start()`` loads the graph into shared memory, starts every process, and connects an
in-process :class:`EngineClient`; then ``embed(ids)``, ``await embed_async(ids)``, ``submit()``,
or the multiprocessing queues ``request_queue()`` / ``result_queue()`` from any process. Other
processes that want the fast path connect their own client with ``connect(pipeline.endpoints())``.
Admission (bounded pending requests), deadlines and drain live in the client and here.
"""

from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch
from torch import Tensor

from quiver_serve import errors
from quiver_serve.config import ServeConfig
from quiver_serve.engine.client.client import EngineClient, EngineEndpoints
from quiver_serve.engine.client.facade import ClientFacade
from quiver_serve.engine.client.loop_client import connect_async
from quiver_serve.engine.client.queue_bridge import QueueBridge
from quiver_serve.engine.procs.process import spawn_context
from quiver_serve.engine.procs.supervisor import Supervisor
from quiver_serve.graph.csc import GraphData
from quiver_serve.messages import EmbedRequest, EmbedResult
from quiver_serve.metrics.observer import PipelineObserver

__all__ = ["Pipeline", "PipelineObserver", "connect", "connect_async"]

log = logging.getLogger(__name__)


def connect(endpoints: EngineEndpoints, observer: PipelineObserver | None = None) -> EngineClient:
    """A client of a running daemon's engine cores, in this process (the fast path), usable
    from any thread; coroutines on one event loop do better with :func:`connect_async`."""
    return EngineClient(endpoints, observer)


def engine_endpoints(cfg: ServeConfig, supervisor: Supervisor, num_nodes: int) -> EngineEndpoints:
    """What a client needs to reach the engine cores of a started ``supervisor`` (picklable)."""
    s = cfg.server
    return EngineEndpoints(
        supervisor.addrs, len(supervisor.engines), num_nodes,
        int(supervisor.engine_info(0)["dim"]), s.max_request_nodes, cfg.batching.max_batch_nodes,
        s.max_pending_requests, s.request_timeout_s, s.overload_status,
        hold_s=0.0 if cfg.batching.adaptive else cfg.batching.max_delay_ms / 1000.0)


class Pipeline(ClientFacade):
    """``Pipeline(cfg).start()``, then ``embed(ids)`` or ``submit(EmbedRequest)``; ``stop()``."""

    def __init__(self, cfg: ServeConfig | None = None, graph: GraphData | None = None,
                 observer: PipelineObserver | None = None) -> None:
        self.cfg = cfg or ServeConfig.default()
        self.graph = graph
        self.observer = observer or PipelineObserver()
        self.supervisor: Supervisor | None = None
        self.client: EngineClient | None = None
        self.out_dim: int | None = None
        self._ids = itertools.count()
        self._init_facade("h-")
        ctx = spawn_context()  # multiprocessing queues: callers in other processes use them too
        cap = self.cfg.batching.queue_capacity
        self._bridge = QueueBridge(ctx.Queue(maxsize=cap), ctx.Queue(maxsize=cap), self.submit,
                                   cap, name="quiver-user-queue")

    # ---- life cycle ------------------------------------------------------------------------------
    def start(self) -> Pipeline:
        if self.graph is None:
            from quiver_serve.graph.datasets import load_graph

            self.graph = load_graph(self.cfg.graph)
        self.supervisor = Supervisor(self.cfg, self.graph,
                                     on_restart=lambda role: self.observer.on_restart(role))
        try:
            self.supervisor.start()
        except BaseException:
            self.supervisor.stop(timeout_s=1.0)
            raise
        self.out_dim = int(self.supervisor.engine_info(0)["dim"])
        self.client_endpoints = self.endpoints()
        self.client = EngineClient(self.client_endpoints, self.observer, name="pipeline")
        self._bridge.start()
        self._accepting = True
        log.info("pipeline ready: %s; %d engine core(s), %d CPU sampler(s), embedding dim %d",
                 self.graph.describe(), len(self.supervisor.engines),
                 len(self.supervisor.samplers), self.out_dim)
        return self

    def endpoints(self) -> EngineEndpoints:
        """What a client in another process needs to reach this daemon (picklable)."""
        assert self.supervisor is not None and self.graph is not None
        return engine_endpoints(self.cfg, self.supervisor, self.graph.num_nodes)

    @property
    def num_nodes(self) -> int:
        assert self.graph is not None
        return self.graph.num_nodes

    @property
    def num_features(self) -> int | None:
        return self.graph.num_features if self.graph is not None else None

    @property
    def engines_ready(self) -> bool:
        """At least one engine core is up (one restarting after a crash is not)."""
        return self.supervisor is not None and self.supervisor.engines_ready()

    def workers(self) -> list[dict[str, Any]]:
        """Every supervised process: role, index, pid, alive, ready, restarts."""
        return self.supervisor.workers() if self.supervisor is not None else []

    def stop(self, drain_timeout_s: float | None = None) -> None:
        """Refuse new work, let in-flight requests finish (bounded), stop every process."""
        self.begin_drain()
        drain_s = self.cfg.server.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        if not self.wait_drained(drain_s):
            log.warning("drain timeout: %d request(s) still in flight are answered 503",
                        self.pending_count)
        self._stopping.set()
        self._bridge.stop()
        self.stop_clients()
        if self.supervisor is not None:
            self.supervisor.stop(timeout_s=max(min(drain_s, 5.0), 1.0))
        for q in (self._bridge.requests, self._bridge.results):
            q.cancel_join_thread()  # never block interpreter exit on a queue a peer left full

    # ---- submitting ----------------------------------------------------------------------------
    def validate(self, node_ids: Tensor | np.ndarray, seed: int | None) -> None:
        """Raise a ServeError naming what is wrong with a request (400/413)."""
        ids = node_ids.numpy() if isinstance(node_ids, Tensor) else np.asarray(node_ids)
        errors.check_node_ids(ids, self.num_nodes, self.cfg.server.max_request_nodes)
        errors.check_seed(seed)

    def _client_or_refuse(self) -> EngineClient:
        if not self.ready or self.client is None:
            raise self.refusal()
        return self.client

    def submit(self, request: EmbedRequest) -> Future[EmbedResult]:
        """Admit one request; the future resolves to its EmbedResult (or raises ServeError)."""
        client = self._client_or_refuse()
        self.validate(request.node_ids, request.seed)
        return client.submit(request.node_ids.numpy(), request.exact, request.seed,
                             request.deadline_s, request.request_id)

    def submit_async(self, request: EmbedRequest) -> Any:
        """``submit`` for coroutines: an asyncio future on the running loop (served by that
        loop's own client: no thread hand-off)."""
        self._client_or_refuse()
        client = self.async_client()
        self.validate(request.node_ids, request.seed)
        return client.submit_async(request.node_ids.numpy(), request.exact, request.seed,
                                   request.deadline_s, request.request_id)

    def new_request(self, node_ids: Any, exact: bool = False, seed: int | None = None,
                    timeout_s: float | None = None) -> EmbedRequest:
        ids = torch.as_tensor(node_ids)
        now = time.time()
        limit = self.cfg.server.request_timeout_s
        deadline = now + (limit if timeout_s is None else min(timeout_s, limit))
        return EmbedRequest(request_id=f"p-{next(self._ids)}", node_ids=ids, exact=exact, seed=seed,
                            deadline_s=deadline, submitted_s=now)

    def embed(self, node_ids: Any, exact: bool = False, seed: int | None = None,
              timeout_s: float | None = None) -> Tensor:
        """Embeddings [len(node_ids), dim] (one row per requested position); raises ServeError."""
        request = self.new_request(node_ids, exact, seed, timeout_s)
        result = self.submit(request).result(timeout=self.cfg.server.request_timeout_s + 5.0)
        return _unwrap(result)

    async def embed_async(self, node_ids: Any, exact: bool = False, seed: int | None = None,
                          timeout_s: float | None = None) -> Tensor:
        """``embed`` for coroutines: thousands in flight from one thread."""
        request = self.new_request(node_ids, exact, seed, timeout_s)
        return _unwrap(await self.submit_async(request))

    def request_queue(self) -> Any:
        """A multiprocessing queue taking EmbedRequest (or LongTensor) from any process."""
        return self._bridge.requests

    def result_queue(self) -> Any:
        """Where results of ``request_queue()`` requests arrive: EmbedResult(request_id, …)."""
        return self._bridge.results


def _unwrap(result: EmbedResult) -> Tensor:
    if result.error is not None:
        raise errors.ServeError.from_info(result.error)
    assert result.embeddings is not None
    return result.embeddings


"""The seed's stage API (docs/architecture.md, "Outside contracts", torch-quiver's names) as a thin
layer over the one engine::

    batcher = RequestBatcher(cfg, stream_queue)      # items: EmbedRequest, or a LongTensor of ids
    sampler = HybridSampler(cfg, graph, batcher.batched_request_queue_list()); sampler.start()
    server = InferenceServer(cfg, graph, sampler.sampled_request_queue_list()); server.start()
    results = server.result_queue_list()             # items: EmbedResult(request_id, ...)

The names are the seed's; the work is the daemon's, with nothing of its own:

- ``RequestBatcher`` holds the caller's stream queue and hands it on. Batching is the client's
  (one micro-batch per loop tick) and the engine core's (continuous batching to the deadline).
- ``HybridSampler.start()`` starts the engine: the :class:`Supervisor` with its engine cores
  (routing by the cost model, ``sampling.route``) and the CPU sampler pool, on ``graph``.
- ``InferenceServer.start()`` connects an :class:`EngineClient` to that engine and runs one
  :class:`QueueBridge` (the code behind ``Pipeline.request_queue()``) per stream queue: it reads
  the stream, validates, submits, and puts one EmbedResult per request on its result queue, in
  arrival order, bounded by ``batching.queue_capacity`` with backpressure.

What could not be thin, and why:

- ``sampled_request_queue_list()`` holds :class:`EngineFeed` handles (stream queue + engine),
  not queues: there is no queue of sampled batches any more (a CPU sampler answers the engine
  core that asked, over ZeroMQ, docs/architecture.md, "Pipeline"), yet the seed passes a list from
  stage to stage, and its example builds the InferenceServer before ``HybridSampler.start()``, so
  the handle reads the engine's address only at ``InferenceServer.start()``.
- ``result_queue_list()`` has one queue per stream queue, not one per inference worker: one
  client spreads the requests over every engine core.
- Dropped arguments: ``HybridSampler(router=)`` (routing is the engine core's) and
  ``InferenceServer(batch_results=)``; ``graph`` of InferenceServer is the sampler's.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from quiver_serve import errors
from quiver_serve.config import ServeConfig
from quiver_serve.engine.client.client import EngineClient, EngineEndpoints
from quiver_serve.engine.client.pipeline import engine_endpoints
from quiver_serve.engine.client.queue_bridge import QueueBridge
from quiver_serve.engine.procs.process import spawn_context
from quiver_serve.engine.procs.supervisor import Supervisor
from quiver_serve.graph.csc import GraphData
from quiver_serve.messages import EmbedRequest, EmbedResult


class RequestBatcher:
    """The seed's first stage: ``batched_request_queue_list()`` is ``[stream_queue]``.

    No thread: requests are batched downstream (see the module docstring), so ``start()`` and
    ``stop()`` have nothing to do; the stream is read by the InferenceServer until its ``stop()``.
    """

    def __init__(self, cfg: ServeConfig, stream_queue: Any) -> None:
        self.cfg = cfg
        self.stream_queue = stream_queue

    def batched_request_queue_list(self) -> list[Any]:
        return [self.stream_queue]

    def start(self) -> None:
        """Nothing to start (kept for the seed's API)."""

    def stop(self, timeout_s: float = 5.0) -> None:
        """Nothing to stop (kept for the seed's API)."""


@dataclass(frozen=True)
class EngineFeed:
    """One entry of ``sampled_request_queue_list()``: a stream queue and the engine serving it."""

    stream_queue: Any
    sampler: HybridSampler


class HybridSampler:
    """The seed's second stage: ``start()`` brings up the engine cores and the CPU sampler pool."""

    def __init__(self, cfg: ServeConfig, graph: GraphData, batched_queue_list: list[Any]) -> None:
        self.cfg, self.graph = cfg, graph
        self.supervisor: Supervisor | None = None
        self._feeds = [EngineFeed(q, self) for q in batched_queue_list]
        self._lock = threading.Lock()

    def sampled_request_queue_list(self) -> list[EngineFeed]:
        return self._feeds

    def start(self) -> None:
        """Start every engine process and wait (``server.start_timeout_s``) until each is ready;
        raises with the reason if one fails. A second call does nothing."""
        with self._lock:
            if self.supervisor is not None:
                return
            supervisor = Supervisor(self.cfg, self.graph)
            try:
                supervisor.start()
            except BaseException:
                supervisor.stop(timeout_s=1.0)
                raise
            self.supervisor = supervisor

    def endpoints(self) -> EngineEndpoints:
        """How a client reaches the running engine (picklable)."""
        supervisor = self.supervisor
        if supervisor is None:
            raise RuntimeError("the engine is not running: call HybridSampler.start() first")
        return engine_endpoints(self.cfg, supervisor, self.graph.num_nodes)

    def workers(self) -> list[dict[str, Any]]:
        """Every engine process: role, index, pid, alive, ready, restarts."""
        supervisor = self.supervisor
        return supervisor.workers() if supervisor is not None else []

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop every engine process (bounded by ``timeout_s`` each, then killed). A client
        still connected answers what it holds 504 at its deadline, or 503 when it stops."""
        with self._lock:
            supervisor, self.supervisor = self.supervisor, None
        if supervisor is not None:
            supervisor.stop(timeout_s=timeout_s)


class InferenceServer:
    """The seed's last stage: ``start()`` connects a client to the engine and answers the stream
    on ``result_queue_list()``."""

    def __init__(self, cfg: ServeConfig, graph: GraphData,
                 sampled_queue_list: list[EngineFeed]) -> None:
        if not sampled_queue_list or not all(isinstance(f, EngineFeed) for f in sampled_queue_list):
            raise TypeError("pass HybridSampler.sampled_request_queue_list()")
        if len({id(f.sampler) for f in sampled_queue_list}) != 1:
            raise ValueError("every feed must come from the same HybridSampler")
        self.cfg, self.graph = cfg, graph
        self.feeds = sampled_queue_list
        # the bound of requests in flight and results unread: at most what the client admits,
        # so a fast stream waits here (backpressure) instead of being answered 503
        cap = min(cfg.batching.queue_capacity, cfg.server.max_pending_requests)
        ctx = spawn_context()  # multiprocessing queues: results may be read in another process
        self._results = [ctx.Queue(maxsize=cap) for _ in sampled_queue_list]
        self._bridges = [
            QueueBridge(f.stream_queue, out, self._submit, cap, ordered=True,
                        name=f"quiver-seed-api-{i}")
            for i, (f, out) in enumerate(zip(sampled_queue_list, self._results, strict=True))
        ]
        self.client: EngineClient | None = None
        self._lock = threading.Lock()
        self._stopped = False

    def result_queue_list(self) -> list[Any]:
        """One queue per stream queue; one EmbedResult per request, in arrival order."""
        return self._results

    def start(self) -> None:
        """Connect to the engine (``HybridSampler.start()`` first) and start reading the stream."""
        with self._lock:
            if self._stopped:
                raise RuntimeError("InferenceServer was stopped; make a new one")
            if self.client is not None:
                return
            self.client = EngineClient(self.feeds[0].sampler.endpoints(), name="seed-api")
            for bridge in self._bridges:
                bridge.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop reading the stream, then the client: each request taken and not yet answered
        gets its 503 on the result queue. Any order with the other stages, any number of times."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            client, self.client = self.client, None
        for bridge in self._bridges:
            bridge.stop(timeout_s)
        if client is not None:
            client.stop(timeout_s)
        for q in self._results:
            q.cancel_join_thread()  # never block interpreter exit on results nobody read

    def _submit(self, request: EmbedRequest) -> Future[EmbedResult]:
        """Validate (400/413, named as everywhere: ``errors``), then hand to the client."""
        client = self.client
        if client is None:
            raise errors.unavailable("shutting_down", "the server is shutting down")
        ep = client.endpoints
        ids = np.asarray(request.node_ids)
        errors.check_node_ids(ids, ep.num_nodes, ep.max_request_nodes)
        errors.check_seed(request.seed)
        return client.submit(ids, request.exact, request.seed, request.deadline_s,
                             request.request_id)

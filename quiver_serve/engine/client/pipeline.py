"""Pipeline: the facade over the supervisor (engine cores, CPU sampler pool) and one client.

``Pipeline(cfg).start()`` loads the graph into shared memory, starts every process, and connects an
in-process :class:`EngineClient`; then ``embed(ids)``, ``await embed_async(ids)``, ``submit()``,
or the multiprocessing queues ``request_queue()`` / ``result_queue()`` from any process. Other
processes that want the fast path connect their own client with ``connect(pipeline.endpoints())``.
Admission (bounded pending requests), deadlines and drain live in the client and here.

The living graph (docs/architecture.md, "The living graph") has the same operations here as over
HTTP: ``add_edges``, ``add_nodes``, ``put_features``, ``graph_info`` and ``compact`` (plain calls to
the supervisor's graph writer, in the caller's thread), ``graph_ops`` (the same as coroutines, for
the HTTP routes), and ``min_version`` / ``new_nodes`` on ``embed``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from quiver_serve import errors
from quiver_serve.config import ServeConfig
from quiver_serve.engine.client.checks import (
    check_min_version,
    check_rows,
    check_typed_request,
    inductive_from_dicts,
    names_a_type,
    split_new_nodes,
    typed_inductive_nodes,
)
from quiver_serve.engine.client.client import EngineClient, EngineEndpoints
from quiver_serve.engine.client.facade import ClientFacade
from quiver_serve.engine.client.graph_client import (
    LocalGraph,
    ModelOps,
    graph_timeout_s,
    model_timeout_s,
)
from quiver_serve.engine.client.loop_client import connect_async
from quiver_serve.engine.client.queue_bridge import QueueBridge
from quiver_serve.engine.procs.graph_service import WriterCalls, typed_params, unavailable
from quiver_serve.engine.procs.process import spawn_context
from quiver_serve.engine.procs.supervisor import Supervisor
from quiver_serve.engine.procs.typed_engine_proc import config_is_typed
from quiver_serve.graph import state as slots
from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.typed import stand_in
from quiver_serve.graph.typed_base import typed_graph_at_start
from quiver_serve.graph.typed_writer import TypedGraphWriter
from quiver_serve.messages import EmbedRequest, EmbedResult
from quiver_serve.metrics.observer import PipelineObserver
from quiver_serve.wire import InductiveNodes

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
        self._node_types: dict[str, int] | None = None
        self._ids = itertools.count()
        self._init_facade("h-")
        ctx = spawn_context()  # multiprocessing queues: callers in other processes use them too
        cap = self.cfg.batching.queue_capacity
        self._bridge = QueueBridge(ctx.Queue(maxsize=cap), ctx.Queue(maxsize=cap), self.submit,
                                   cap, name="quiver-user-queue")
        self._writer_calls: WriterCalls | None = None
        self._writer_lock = threading.Lock()
        #: the graph updates as coroutines (the HTTP routes): the writer on worker threads
        self.graph_ops = LocalGraph(self.writer_calls,
                                    graph_timeout_s(self.cfg.server.request_timeout_s))
        #: the model repository's calls as coroutines (``model_manager.py``, worker threads)
        self.model_ops = ModelOps(LocalGraph(self._calls, model_timeout_s(self.cfg)))

    # ---- life cycle ------------------------------------------------------------------------------
    def start(self) -> Pipeline:
        base_version, log_dir, typed = 0, None, None
        if self.graph is None:  # the dataset, or its newest compacted base
            from quiver_serve.graph.living import load_serving_graph
            from quiver_serve.graph.living import log_dir as config_log_dir

            log_dir = str(config_log_dir(self.cfg.graph))
            if config_is_typed(self.cfg):  # docs/architecture.md, "Typed graphs"
                typed, base_version = typed_graph_at_start(self.cfg.graph, Path(log_dir),
                                                           write_snapshot=True)
                self.graph = stand_in(typed)
            else:
                self.graph, base_version = load_serving_graph(self.cfg.graph)
        self.supervisor = Supervisor(self.cfg, self.graph,
                                     on_restart=lambda role: self.observer.on_restart(role),
                                     base_version=base_version, log_dir=log_dir,
                                     typed_graph=typed)
        self.graph = self.supervisor.graph  # a newer compacted base, when there is one
        try:
            self.supervisor.start()
        except BaseException:
            self.supervisor.stop(timeout_s=1.0)
            raise
        info = self.supervisor.engine_info(0)
        self.out_dim = int(info["dim"])
        self._node_types = info.get("node_types")
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
    def node_types(self) -> dict[str, int] | None:
        """Node count per type of a typed graph (its writer's, so ids of nodes just added
        pass; engine/procs/typed_engine_proc.py); None: one type."""
        writer = self.supervisor.graph_writer if self.supervisor is not None else None
        if self._node_types is not None and isinstance(writer, TypedGraphWriter):
            return writer.num_nodes
        return self._node_types

    @property
    def num_nodes(self) -> int:
        """Nodes of the acknowledged graph (appended nodes count once acknowledged)."""
        if self.supervisor is not None:
            return max(self.supervisor.graph_state.num_nodes, 1)
        assert self.graph is not None
        return self.graph.num_nodes

    @property
    def node_capacity(self) -> int:
        """Ids below this may be appended while serving (the writer's preallocated headroom)."""
        cap = self.supervisor.graph_state.get(slots.NODE_CAP) if self.supervisor else 0
        return max(self.num_nodes, cap)

    @property
    def graph_version(self) -> int | None:
        """The acknowledged graph version; None before start."""
        return self.supervisor.graph_state.acked if self.supervisor is not None else None

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
        if self._writer_calls is not None:
            self._writer_calls.stop()
        if self.supervisor is not None:
            self.supervisor.stop(timeout_s=max(min(drain_s, 5.0), 1.0))
        for q in (self._bridge.requests, self._bridge.results):
            q.cancel_join_thread()  # never block interpreter exit on a queue a peer left full

    # ---- submitting ----------------------------------------------------------------------------
    def validate(self, node_ids: Tensor | np.ndarray, seed: int | None,
                 new_nodes: Any = None, min_version: int = 0,
                 node_type: str = "") -> InductiveNodes | None:
        """Raise a ServeError naming what is wrong with a request (400/413/422); returns its
        inductive nodes (``new_nodes`` as checked), if any. Ids are checked against the exact
        acknowledged node count (this process holds the writer)."""
        ids = node_ids.numpy() if isinstance(node_ids, Tensor) else np.asarray(node_ids)
        limit = self.cfg.server.max_request_nodes
        if names_a_type(node_type, self.node_types):
            inductive = typed_inductive_nodes(*split_new_nodes(new_nodes or []))
            check_typed_request(ids, node_type, self.node_types, limit,
                                inductive.count if inductive is not None else 0)
            errors.check_seed(seed)
            check_min_version(min_version)
            return inductive
        inductive = None
        if new_nodes is not None and len(new_nodes):
            num_nodes = self.num_nodes
            inductive = inductive_from_dicts(new_nodes, self.num_features or 0, num_nodes,
                                             num_nodes)
            assert inductive is not None
            check_rows(int(ids.size), inductive.count, limit)
        if inductive is None or ids.size:
            errors.check_node_ids(ids, self.num_nodes, limit)
        errors.check_seed(seed)
        check_min_version(min_version)
        return inductive

    def _client_or_refuse(self) -> EngineClient:
        if not self.ready or self.client is None:
            raise self.refusal()
        return self.client

    def submit(self, request: EmbedRequest, min_version: int = 0,
               new_nodes: Any = None) -> Future[EmbedResult]:
        """Admit one request; the future resolves to its EmbedResult (or raises ServeError).
        ``min_version``: the graph version it must see (read-your-writes); ``new_nodes``:
        ``[{"features": [...], "in_neighbors": [...]}, ...]``, embedded as if added (their rows
        follow the ids' rows)."""
        client = self._client_or_refuse()
        inductive = self.validate(request.node_ids, request.seed, new_nodes, min_version,
                                  request.node_type)
        return client.submit(request.node_ids.numpy(), request.exact, request.seed,
                             request.deadline_s, request.request_id, min_version, inductive,
                             request.model, request.version, request.node_type)

    def submit_async(self, request: EmbedRequest, min_version: int = 0,
                     new_nodes: Any = None) -> Any:
        """``submit`` for coroutines: an asyncio future on the running loop (served by that
        loop's own client: no thread hand-off)."""
        self._client_or_refuse()
        client = self.async_client()
        inductive = self.validate(request.node_ids, request.seed, new_nodes, min_version,
                                  request.node_type)
        return client.submit_async(request.node_ids.numpy(), request.exact, request.seed,
                                   request.deadline_s, request.request_id, min_version, inductive,
                                   request.model, request.version, node_type=request.node_type)

    def new_request(self, node_ids: Any = None, exact: bool = False, seed: int | None = None,
                    timeout_s: float | None = None, model: str = "",
                    version: int = 0, node_type: str = "") -> EmbedRequest:
        ids = torch.as_tensor(_as_ids(node_ids))
        now = time.time()
        limit = self.cfg.server.request_timeout_s
        deadline = now + (limit if timeout_s is None else min(timeout_s, limit))
        return EmbedRequest(request_id=f"p-{next(self._ids)}", node_ids=ids, exact=exact, seed=seed,
                            deadline_s=deadline, submitted_s=now, model=model, version=version,
                            node_type=node_type)

    def embed(self, node_ids: Any = None, exact: bool = False, seed: int | None = None,
              timeout_s: float | None = None, min_version: int = 0,
              new_nodes: Any = None, model: str = "", version: int = 0,
              node_type: str = "") -> Tensor:
        """Embeddings [len(node_ids) + len(new_nodes), dim] (one row per requested position,
        then one per new node) from ``model`` ("": the default) at ``version`` (0: by the
        model's traffic split), of ``node_type``'s nodes on a typed graph ("": the only
        type); raises ServeError. ``node_ids`` may be left out (None: no ids)
        when ``new_nodes`` are given. The calling thread blocks on its answer
        (``EngineClient.call``: no future, no request object)."""
        client = self._client_or_refuse()
        ids = _as_ids(node_ids)
        inductive = self.validate(ids, seed, new_nodes, min_version, node_type)
        limit = self.cfg.server.request_timeout_s
        deadline_s = time.time() + (limit if timeout_s is None else min(timeout_s, limit))
        return _unwrap(client.call(ids, exact, seed, deadline_s, f"p-{next(self._ids)}",
                                   min_version, inductive, model, version, node_type=node_type))

    async def embed_async(self, node_ids: Any = None, exact: bool = False, seed: int | None = None,
                          timeout_s: float | None = None, min_version: int = 0,
                          new_nodes: Any = None, model: str = "", version: int = 0,
                          node_type: str = "") -> Tensor:
        """``embed`` for coroutines: thousands in flight from one thread."""
        request = self.new_request(node_ids, exact, seed, timeout_s, model, version, node_type)
        return _unwrap(await self.submit_async(request, min_version, new_nodes))

    # ---- the living graph (docs/architecture.md, "The living graph"): the writer's calls ----
    def writer_calls(self) -> WriterCalls:
        """The writer's calls; 503 while not serving, 501 when this daemon has no writer."""
        calls = self._calls()
        if calls.writer is None:
            raise unavailable(calls.read_only_reason)
        return calls

    def _calls(self) -> WriterCalls:
        """The graph writer's and the model manager's calls; 503 while not serving."""
        if not self.ready or self.supervisor is None:
            raise self.refusal()
        if self._writer_calls is None:
            sup = self.supervisor
            with self._writer_lock:
                if self._writer_calls is None:
                    self._writer_calls = WriterCalls(
                        getattr(sup, "graph_writer", None), len(sup.engines),
                        models=sup.models, read_only_reason=sup.graph_read_only_reason)
        return self._writer_calls

    # ---- the model repository (docs/architecture.md, "Models and versions") ----------------
    @property
    def models_state(self) -> dict[str, Any] | None:
        """Every model and version with its state (what the front-ends publish)."""
        return self.supervisor.models.published() if self.supervisor is not None else None

    def load_model(self, name: str, config: dict[str, Any] | None = None) -> dict[str, Any]:
        """Load the versions of ``name`` its repository policy names (``config`` may override
        ``version_policy`` and ``traffic``) while the others keep serving; returns the
        versions' states. Raises ServeError (400 ``model_load_failed`` names the cause; the
        old versions then keep serving)."""
        return self._calls().run("model_load", [], params={"name": name, "config": config})

    def unload_model(self, name: str) -> dict[str, Any]:
        """Drain and release every version of ``name``."""
        return self._calls().run("model_unload", [], params={"name": name})

    def model_index(self, ready: bool = False) -> list[dict[str, Any]]:
        """Every model and version of the repository with its state and why."""
        rows: list[dict[str, Any]] = self._calls().run(
            "model_index", [], params={"ready": ready})["models"]
        return rows

    def add_edges(self, add: Any = None, remove: Any = None,
                  edge_type: Any = None) -> dict[str, Any]:
        """Add (a repeat is a second copy) and remove (every copy) directed edges src -> dst,
        each ``[[src, dst], ...]``: ``{"version", "added", "removed", "missing"}``. On a typed
        graph ``edge_type`` ``(src, rel, dst)`` names the relation (optional when it has one);
        ids are the source and destination types' own."""
        return self.writer_calls().run("add_edges", [add, remove],
                                       params=typed_params(edge_type=edge_type))

    def add_nodes(self, features: Any = None, node_type: str | None = None,
                  count: int | None = None) -> dict[str, Any]:
        """Append nodes with these feature rows: ``{"version", "node_ids"}`` (consecutive). On
        a typed graph ``node_type`` names their type (ids follow its count); a type without
        features takes ``count`` instead of rows."""
        rows = features if count is None else np.zeros((count, 0), np.float32)
        return self.writer_calls().run("add_nodes", [rows],
                                       params=typed_params(node_type=node_type))

    def put_features(self, node_ids: Any, features: Any,
                     node_type: str | None = None) -> dict[str, Any]:
        """Overwrite the feature rows of ``node_ids`` (of ``node_type`` on a typed graph):
        ``{"version"}``."""
        return self.writer_calls().run("put_features", [node_ids, features],
                                       params=typed_params(node_type=node_type))

    def graph_info(self) -> dict[str, Any]:
        """Versions acknowledged and visible per engine core, sizes, staleness."""
        return self.writer_calls().run("info", [])

    def compact(self) -> dict[str, Any]:
        """Fold every acknowledged update into a new base now (returns when it is on disk;
        the engine cores and samplers move onto it while serving): ``{"version", "compacted"}``."""
        writer = self.supervisor.graph_writer if self.supervisor is not None else None
        if writer is None:
            return self.writer_calls().run("compact", [])  # answers why there is no writer
        return writer.compact()

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


def _as_ids(node_ids: Any) -> np.ndarray:
    """A caller's node ids as an int64 array (None: none, for a request of new nodes alone)."""
    if node_ids is None:
        return np.empty(0, dtype=np.int64)
    if isinstance(node_ids, Tensor):
        return node_ids.detach().cpu().numpy()  # type: ignore[no-any-return]
    ids = np.asarray(node_ids)
    return ids.astype(np.int64) if ids.size == 0 else ids

"""Pipeline: the facade that wires batcher → hybrid sampler → inference server in one call.

It owns admission (bounded pending requests), a future per request, deadlines (every request is
answered by its deadline, whatever a worker does), and the result dispatch. The HTTP front-end and
in-process callers use it; the queue API (``request_queue()`` / ``result_queue()``) serves callers in
other processes.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from quiver_serve import errors
from quiver_serve.config import ServeConfig
from quiver_serve.engine.batcher import RequestBatcher, as_request
from quiver_serve.engine.hybrid_sampler import HybridSampler
from quiver_serve.engine.inference import InferenceServer
from quiver_serve.engine.process import get_or_none, spawn_context
from quiver_serve.engine.router import RouteDecision
from quiver_serve.engine.work import check_node_ids
from quiver_serve.graph.csc import GraphData
from quiver_serve.messages import BatchedRequest, BatchStats, EmbedRequest, EmbedResult, ResultBatch
from quiver_serve.sampling.base import MAX_SEED

log = logging.getLogger(__name__)

_SWEEP_S = 0.02


class PipelineObserver:
    """Hooks the front-end implements to turn pipeline events into metrics (default: no-op)."""

    def on_batch(self, stats: BatchStats) -> None: ...

    def on_rejected(self, reason: str) -> None: ...

    def on_late_result(self) -> None: ...

    def on_restart(self, role: str) -> None: ...


@dataclass
class _Pending:
    """An admitted request: its future, and where it is (for retry when a worker dies)."""

    future: Future[EmbedResult]
    request: EmbedRequest
    attempts: int = 1
    sampler: int | None = None  # CPU sampler holding it, until its sample is forwarded
    worker: int | None = None  # inference worker it is routed to


@dataclass(order=True)
class _Deadline:
    deadline_s: float
    request_id: str


class Pipeline:
    """``Pipeline(cfg).start()``, then ``embed(ids)`` or ``submit(EmbedRequest)``; ``stop()``."""

    def __init__(self, cfg: ServeConfig | None = None, graph: GraphData | None = None,
                 observer: PipelineObserver | None = None) -> None:
        self.cfg = cfg or ServeConfig.default()
        self.graph = graph
        self.observer = observer or PipelineObserver()
        self._pending: dict[str, _Pending] = {}
        self._deadlines: list[_Deadline] = []
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._accepting = False
        self._draining = False
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self.batcher: RequestBatcher | None = None
        self.sampler: HybridSampler | None = None
        self.server: InferenceServer | None = None
        self.out_dim: int | None = None
        ctx = spawn_context()
        cap = self.cfg.batching.queue_capacity
        self._user_requests = ctx.Queue(maxsize=cap)
        self._user_results = ctx.Queue(maxsize=cap)
        self._user_in_flight = 0

    # ---- life cycle ------------------------------------------------------------------------
    def start(self) -> Pipeline:
        if self.graph is None:
            from quiver_serve.graph.datasets import load_graph

            self.graph = load_graph(self.cfg.graph)
        self.graph.share_memory_()
        self._stream: queue.Queue[Any] = queue.Queue(maxsize=self.cfg.batching.queue_capacity)
        self.batcher = RequestBatcher(self.cfg, self._stream, start=False,
                                      downstream_idle=lambda: self.sampler is not None and self.sampler.idle(),
                                      is_live=self.is_pending)
        self.sampler = HybridSampler(self.cfg, self.graph, self.batcher.batched_request_queue_list())
        self.server = InferenceServer(self.cfg, self.graph, self.sampler.sampled_request_queue_list(),
                                      batch_results=True)
        self.sampler.on_dispatch = self._on_dispatch
        self.sampler.on_sampled = self._on_sampled
        try:
            self.sampler.start()
            self.server.start()
            self.batcher.start()
        except BaseException:
            self.stop(drain_timeout_s=0)
            raise
        self.out_dim = int(self.server.ready_info[0]["dim"])
        for i in range(len(self.server.workers)):
            self._spawn_thread(self._dispatch_loop, (i,), f"quiver-results-{i}")
        self._spawn_thread(self._sweep_loop, (), "quiver-deadlines")
        self._spawn_thread(self._supervise_loop, (), "quiver-supervisor")
        self._spawn_thread(self._user_queue_loop, (), "quiver-user-queue")
        self._accepting = True
        log.info("pipeline ready: %s; %d sampler(s), %d inference worker(s), embedding dim %d",
                 self.graph.describe(), len(self.sampler.workers), len(self.server.workers), self.out_dim)
        return self

    def _spawn_thread(self, target: Any, args: tuple, name: str) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    @property
    def ready(self) -> bool:
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
    def num_nodes(self) -> int:
        assert self.graph is not None
        return self.graph.num_nodes

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def workers(self) -> list[dict[str, Any]]:
        """Every worker process: role, index, pid, alive, restarts (for operators and fault tests)."""
        handles = (self.sampler.workers if self.sampler else []) + (self.server.workers if self.server else [])
        return [{"role": h.role, "index": h.index, "pid": h.pid, "alive": h.is_alive(),
                 "restarts": h.restarts} for h in handles]

    def begin_drain(self) -> None:
        """Readiness turns false and new requests get 503; admitted ones go on."""
        self._accepting = False
        self._draining = True

    def wait_drained(self, timeout_s: float) -> bool:
        """Wait (bounded) until no admitted request is left; True if none is."""
        end = time.monotonic() + timeout_s
        while self._pending and time.monotonic() < end:
            time.sleep(0.01)
        return not self._pending

    def stop(self, drain_timeout_s: float | None = None) -> None:
        """Refuse new work, let in-flight requests finish (bounded), stop every process."""
        self.begin_drain()
        drain_s = self.cfg.server.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        if not self.wait_drained(drain_s):
            log.warning("drain timeout: %d request(s) still in flight are answered 503", len(self._pending))
        self._stopping.set()
        with self._lock:
            left = list(self._pending.items())
            self._pending.clear()
        for rid, entry in left:
            _fail(entry.future, rid, errors.unavailable("shutting_down", "the server is shutting down"))
        for part in (self.batcher, self.sampler, self.server):
            if part is not None:
                part.stop(timeout_s=max(min(drain_s, 5.0), 1.0))
        for t in self._threads:
            t.join(timeout=1.0)
        for q in self._all_mp_queues():
            q.cancel_join_thread()  # never block interpreter exit on a queue a dead peer left full

    def _all_mp_queues(self) -> list[Any]:
        qs = [self._user_requests, self._user_results]
        if self.sampler is not None:
            qs += self.sampler.sampled_request_queue_list() + self.sampler._task_qs + self.sampler._out_qs
        if self.server is not None:
            qs += self.server.result_queue_list()
        return qs

    # ---- submitting ------------------------------------------------------------------------
    def validate(self, node_ids: Tensor, seed: int | None) -> None:
        """Raise a ServeError naming what is wrong with a request (400/413)."""
        n = int(node_ids.numel())
        if node_ids.dim() != 1:
            raise errors.invalid(f"node_ids must be a 1-D list, got shape {tuple(node_ids.shape)}")
        if n > self.cfg.server.max_request_nodes:
            raise errors.too_large(n, self.cfg.server.max_request_nodes)
        problem = check_node_ids(node_ids, self.num_nodes)
        if problem is not None:
            raise errors.invalid(problem)
        if seed is not None and not 0 <= seed <= MAX_SEED:
            raise errors.ServeError("invalid_seed", f"seed must be in [0, {MAX_SEED}], got {seed}", 400)

    def submit(self, request: EmbedRequest) -> Future[EmbedResult]:
        """Admit one request; the future resolves to its EmbedResult (or raises ServeError)."""
        if not self.ready:
            raise self.refusal()
        self.validate(request.node_ids, request.seed)
        if request.deadline_s is None:
            request.deadline_s = request.submitted_s + self.cfg.server.request_timeout_s
        fut: Future[EmbedResult] = Future()
        with self._lock:
            if len(self._pending) >= self.cfg.server.max_pending_requests:
                self.observer.on_rejected("pending_full")
                raise errors.overloaded("too many requests in flight; retry later",
                                        self.cfg.server.overload_status)
            if request.request_id in self._pending:
                raise errors.ServeError("duplicate_request_id",
                                        f"request_id {request.request_id!r} is already in flight", 409)
            self._pending[request.request_id] = _Pending(fut, request)
            heapq.heappush(self._deadlines, _Deadline(request.deadline_s, request.request_id))
        try:
            self._stream.put_nowait(request)
        except queue.Full:
            with self._lock:
                self._pending.pop(request.request_id, None)
            self.observer.on_rejected("queue_full")
            raise errors.overloaded("request queue is full; retry later",
                                    self.cfg.server.overload_status) from None
        return fut

    def cancel(self, request_id: str, reason: str = "client_disconnected") -> bool:
        """Forget a request nobody waits for; the batcher skips it if it has not been batched yet."""
        with self._lock:
            entry = self._pending.pop(request_id, None)
        if entry is None:
            return False
        self.observer.on_rejected(reason)
        _fail(entry.future, request_id, errors.ServeError("cancelled", "request cancelled", 499))
        return True

    def is_pending(self, request_id: str) -> bool:
        return request_id in self._pending

    def new_request(self, node_ids: Any, exact: bool = False, seed: int | None = None,
                    timeout_s: float | None = None) -> EmbedRequest:
        ids = torch.as_tensor(node_ids)
        now = time.time()
        deadline = None if timeout_s is None else now + min(timeout_s, self.cfg.server.request_timeout_s)
        return EmbedRequest(request_id=f"p-{next(self._ids)}", node_ids=ids, exact=exact, seed=seed,
                            deadline_s=deadline, submitted_s=now)

    def embed(self, node_ids: Any, exact: bool = False, seed: int | None = None,
              timeout_s: float | None = None) -> Tensor:
        """Embeddings [len(node_ids), dim] (one row per requested position); raises ServeError."""
        request = self.new_request(node_ids, exact, seed, timeout_s)
        result = self.submit(request).result(timeout=self.cfg.server.request_timeout_s + 5.0)
        if result.error is not None:
            raise errors.ServeError.from_info(result.error)
        assert result.embeddings is not None
        return result.embeddings

    def request_queue(self) -> Any:
        """A multiprocessing queue taking EmbedRequest (or LongTensor) from any process."""
        return self._user_requests

    def result_queue(self) -> Any:
        """Where results of ``request_queue()`` requests arrive: EmbedResult(request_id, …)."""
        return self._user_results

    # ---- background loops ------------------------------------------------------------------
    def _dispatch_loop(self, index: int) -> None:
        """Resolve futures from inference worker ``index``; follow its queue across restarts."""
        assert self.server is not None
        current = self.server.result_queue_list()[index]
        while not self._stopping.is_set():
            msg = get_or_none(current)
            if msg is None:
                latest = self.server.result_queue_list()[index]
                if current is not latest:  # the worker was restarted and its old queue is drained
                    current = latest
                continue
            for result in msg.unpack() if isinstance(msg, ResultBatch) else [msg]:
                self._resolve(result)

    def _resolve(self, result: EmbedResult) -> None:
        if result.stats is not None:
            self.observer.on_batch(result.stats)
        with self._lock:
            entry = self._pending.pop(result.request_id, None)
        if entry is not None and result.error is not None and result.error.status == 504:
            self.observer.on_rejected("deadline")  # expired in a worker queue, skipped there
        if entry is None:
            self.observer.on_late_result()
        elif not entry.future.done():
            entry.future.set_result(result)

    def _sweep_loop(self) -> None:
        while not self._stopping.wait(_SWEEP_S):
            now = time.time()
            expired: list[tuple[str, _Pending]] = []
            with self._lock:
                while self._deadlines and self._deadlines[0].deadline_s <= now:
                    rid = heapq.heappop(self._deadlines).request_id
                    entry = self._pending.pop(rid, None)
                    if entry is not None:
                        expired.append((rid, entry))
                if not self._pending:
                    self._deadlines.clear()
            for rid, entry in expired:
                self.observer.on_rejected("deadline")
                _fail(entry.future, rid, errors.deadline())

    # ---- supervision -------------------------------------------------------------------------
    def _on_dispatch(self, batch: BatchedRequest, decision: RouteDecision) -> None:
        sampler = decision.sampler if decision.route == "cpu" else None
        with self._lock:
            for rid in batch.request_ids:
                entry = self._pending.get(rid)
                if entry is not None:
                    entry.sampler, entry.worker = sampler, decision.worker

    def _on_sampled(self, sampler: int, request_ids: list[str]) -> None:
        with self._lock:
            for rid in request_ids:
                entry = self._pending.get(rid)
                if entry is not None and entry.sampler == sampler:
                    entry.sampler = None

    def _supervise_loop(self) -> None:
        assert self.sampler is not None and self.server is not None
        while not self._stopping.wait(0.1):
            for i in self.sampler.check_workers():
                self.observer.on_restart("sampler")
                self._recover(lambda e, i=i: e.sampler == i, f"sampler {i} died")
            for i in self.server.check_workers():
                self.observer.on_restart("inference")
                self._recover(lambda e, i=i: e.sampler is None and e.worker == i,
                              f"inference worker {i} died")

    def _recover(self, held: Any, why: str) -> None:
        """Requests a dead worker held: retry each once (embedding is idempotent), else 503."""
        retry: list[tuple[str, _Pending]] = []
        failed: list[tuple[str, _Pending]] = []
        with self._lock:
            for rid, e in list(self._pending.items()):
                if not held(e):
                    continue
                e.sampler = e.worker = None
                if e.attempts < 2:
                    e.attempts += 1
                    retry.append((rid, e))
                else:
                    failed.append((rid, self._pending.pop(rid)))
        log.warning("%s: retrying %d request(s), failing %d", why, len(retry), len(failed))
        for rid, e in retry:
            try:
                self._stream.put_nowait(e.request)
            except queue.Full:
                with self._lock:
                    self._pending.pop(rid, None)
                failed.append((rid, e))
        for rid, e in failed:
            _fail(e.future, rid, errors.unavailable("worker_died", f"{why} while serving it"))

    def _user_queue_loop(self) -> None:
        seq = itertools.count()
        while not self._stopping.is_set():
            if self._user_in_flight + _qsize(self._user_results) >= self.cfg.batching.queue_capacity:
                time.sleep(0.005)  # the caller is not reading results: hold back (backpressure)
                continue
            item = get_or_none(self._user_requests)
            if item is None:
                continue
            request = as_request(item, next(seq))
            if request is None:
                log.error("request_queue: ignoring %s (expected EmbedRequest or LongTensor)", type(item))
                continue
            self._submit_user(request)

    def _submit_user(self, request: EmbedRequest) -> None:
        try:
            fut = self.submit(request)
        except errors.ServeError as exc:
            self._user_results.put(EmbedResult(request.request_id, error=exc.info), timeout=1.0)
            return
        with self._lock:
            self._user_in_flight += 1
        fut.add_done_callback(functools.partial(self._deliver_user, request.request_id))

    def _deliver_user(self, request_id: str, fut: Future[EmbedResult]) -> None:
        with self._lock:
            self._user_in_flight -= 1
        result = fut.result()
        try:  # admission above keeps room for every in-flight result, so this does not wait
            self._user_results.put(result, timeout=1.0)
        except queue.Full:
            log.error("result_queue full: result of %s dropped", request_id)


def _fail(fut: Future[EmbedResult], request_id: str, exc: errors.ServeError) -> None:
    if not fut.done():
        fut.set_result(EmbedResult(request_id=request_id, error=exc.info))


def _qsize(q: Any) -> int:
    try:
        return int(q.qsize())
    except (NotImplementedError, OSError):
        return 0

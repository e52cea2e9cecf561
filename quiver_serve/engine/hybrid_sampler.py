"""HybridSampler: routes each batch to the CPU sampler pool or to the GPU path.

CPU sampler workers are spawned processes that map the ONE shared-memory CSC (no copies). GPU-routed
batches go straight to an inference worker, which samples them on its GPU.

Queue topology: every queue has one writer process and one reader process, with this (front-end)
process at the hub: router → ``task_q[s]`` → sampler ``s`` → ``out_q[s]`` → forwarder thread →
``sampled_q[w]`` → inference worker ``w``. A worker killed mid-``get`` (kill -9) dies holding its
queue's reader lock, so supervision replaces a dead worker's queues with fresh ones; with one
process on each side, only the front-end needs to learn the new queues.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from quiver_serve.config import ServeConfig
from quiver_serve.engine.devices import inference_on_gpu, num_inference_workers
from quiver_serve.engine.process import (
    WorkerHandle,
    get_or_none,
    put_until,
    report_ready,
    restart_dead,
    retire_queue,
    serve_queue,
    spawn_context,
    start_up,
    wait_ready,
)
from quiver_serve.engine.router import QueueDepthRouter, RouteDecision, Router, RouterState
from quiver_serve.engine.work import SamplingEngine
from quiver_serve.errors import internal_error
from quiver_serve.graph.csc import GraphData
from quiver_serve.messages import BatchedRequest, EmbedResult, SamplerReply, Shutdown
from quiver_serve.sampling import make_cpu_sampler

log = logging.getLogger(__name__)


def sampler_worker_main(
    index: int, cfg: ServeConfig, indptr: torch.Tensor, indices: torch.Tensor,
    task_q: Any, out_q: Any, control_q: Any,
) -> None:
    """CPU sampler process: take batches, sample, send one SamplerReply per batch back."""

    def build() -> SamplingEngine:
        torch.set_num_threads(cfg.sampling.cpu_threads_per_worker)
        sampler = make_cpu_sampler(indptr, indices, cfg.sampling.implementation)
        return SamplingEngine(sampler, cfg.sampling.fanouts, indptr.numel() - 1)

    engine = start_up(control_q, "sampler", index, build)
    report_ready(control_q, "sampler", index, impl=engine.sampler.name)

    def handle(batch: BatchedRequest) -> list[SamplerReply]:
        try:
            sampled, failed = engine.step(batch)
        except Exception as exc:  # noqa: BLE001 - fail this batch only
            log.exception("sampler %d: batch %d failed", index, batch.batch_id)
            info = internal_error(exc, f"sampler {index}: batch {batch.batch_id}", log).info
            sampled, failed = None, [EmbedResult(request_id=rid, error=info) for rid in batch.request_ids]
        return [SamplerReply(batch_id=batch.batch_id, worker=batch.worker, sampled=sampled, failed=failed)]

    serve_queue(task_q, out_q, handle)


class HybridSampler:
    """Reads batched-request queues, routes each batch, and owns the CPU sampler pool."""

    def __init__(self, cfg: ServeConfig, graph: GraphData, batched_queue_list: list[Any],
                 router: Router | None = None) -> None:
        self.cfg = cfg
        self.graph = graph
        self.batched_queue_list = batched_queue_list
        self.router = router or QueueDepthRouter(cfg.sampling.route)
        self.on_gpu = inference_on_gpu(cfg)
        self._ctx = spawn_context()
        cap = cfg.batching.queue_capacity
        self._sampled_qs = [self._ctx.Queue(maxsize=cap) for _ in range(num_inference_workers(cfg))]
        n_cpu = cfg.sampling.num_cpu_workers
        self._task_qs = [self._ctx.Queue(maxsize=cap) for _ in range(n_cpu)]
        self._out_qs = [self._ctx.Queue(maxsize=cap) for _ in range(n_cpu)]
        self._control_q = self._ctx.Queue(maxsize=256)  # readiness messages only
        self.workers = [
            WorkerHandle("sampler", i, sampler_worker_main, self._args_for(i)) for i in range(n_cpu)
        ]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.route_counts: dict[str, int] = {}
        #: called from the routing thread after a batch is queued for its path
        self.on_dispatch: Callable[[BatchedRequest, RouteDecision], None] | None = None
        #: called from a forwarder thread once a batch has left its sampler
        self.on_sampled: Callable[[int, list[str]], None] | None = None

    def _args_for(self, i: int) -> Callable[[], tuple]:
        return lambda: (i, self.cfg, self.graph.indptr, self.graph.indices, self._task_qs[i],
                        self._out_qs[i], self._control_q)

    def sampled_request_queue_list(self) -> list[Any]:
        """One queue per inference worker; InferenceServer replaces an entry when it restarts one."""
        return self._sampled_qs

    def start(self, wait: bool = True) -> None:
        """Spawn the CPU pool, wait for it, then start routing and forwarding."""
        self.graph.share_memory_()
        for w in self.workers:
            w.start()
        if wait and self.workers:
            wait_ready(self._control_q, self.workers, self.cfg.server.start_timeout_s, "sampler")
        for i, q in enumerate(self.batched_queue_list):
            self._thread(self._route_loop, (q,), f"quiver-router-{i}")
        for i in range(len(self.workers)):
            self._thread(self._forward_loop, (i,), f"quiver-forward-{i}")

    def _thread(self, target: Any, args: tuple, name: str) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=timeout_s)
        for w in self.workers:
            w.stop(self._task_qs[w.index], timeout_s)

    # ---- routing ---------------------------------------------------------------------------
    def state(self) -> RouterState:
        return RouterState(
            cpu_queue_depths=[_depth(q) for q in self._task_qs],
            inference_queue_depths=[_depth(q) for q in self._sampled_qs],
            inference_on_gpu=self.on_gpu,
        )

    def idle(self) -> bool:
        """True when no batch waits in any queue of this stage (workers may still be busy)."""
        qs = (*self.batched_queue_list, *self._task_qs, *self._out_qs, *self._sampled_qs)
        return all(_depth(q) == 0 for q in qs)

    def dispatch(self, batch: BatchedRequest) -> bool:
        """Route one batch and hand it on; False if stopping before it could be queued."""
        decision = self.router.decide(batch, self.state())
        batch.route, batch.worker = decision.route, decision.worker
        self.route_counts[decision.route] = self.route_counts.get(decision.route, 0) + 1
        if self.on_dispatch is not None:  # before the put, so a fast result finds the record
            self.on_dispatch(batch, decision)
        if decision.route == "cpu":
            return put_until(self._task_qs[decision.sampler], batch, self._running)
        return put_until(self._sampled_qs[decision.worker], batch, self._running)

    def _running(self) -> bool:
        return not self._stop.is_set()

    def _route_loop(self, in_q: Any) -> None:
        while not self._stop.is_set():
            batch = get_or_none(in_q)
            if batch is None:
                continue
            if isinstance(batch, Shutdown):
                break
            if not self.dispatch(batch):
                log.warning("router stopping: batch %d not dispatched", batch.batch_id)

    def _forward_loop(self, i: int) -> None:
        """Move sampler ``i``'s replies to their inference worker; follow queue replacements."""
        current = self._out_qs[i]
        while not self._stop.is_set():
            reply = get_or_none(current)
            if reply is None:
                if current is not self._out_qs[i]:  # replaced after a restart, and drained
                    current = self._out_qs[i]
                continue
            target = lambda w=reply.worker: self._sampled_qs[w]  # noqa: E731 - re-read on each put
            for item in [*reply.failed, *([reply.sampled] if reply.sampled is not None else [])]:
                put_until(target(), item, self._running)
            if self.on_sampled is not None:
                ids = reply.sampled.batch.request_ids if reply.sampled is not None else []
                self.on_sampled(i, ids)

    # ---- supervision -----------------------------------------------------------------------
    def check_workers(self) -> list[int]:
        """Restart dead samplers on fresh queues; returns the indices restarted."""
        if self._stop.is_set():
            return []
        return restart_dead(self.workers, self._renew_queues)

    def _renew_queues(self, i: int) -> None:
        for qs in (self._task_qs, self._out_qs):
            retire_queue(qs[i])
            qs[i] = self._ctx.Queue(maxsize=self.cfg.batching.queue_capacity)


def _depth(q: Any) -> int:
    try:
        return int(q.qsize())
    except (NotImplementedError, OSError):  # macOS has no sem_getvalue
        return 0

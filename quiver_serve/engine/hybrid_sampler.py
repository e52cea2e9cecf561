"""HybridSampler: routes each batch to the CPU sampler pool or to the GPU path.

CPU sampler workers are spawned processes that map the ONE shared-memory CSC (no copies). GPU-routed
batches go straight to an inference worker, which samples them on its GPU.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from quiver_serve.config import ServeConfig
from quiver_serve.engine.devices import inference_on_gpu, num_inference_workers
from quiver_serve.engine.process import (
    WorkerHandle,
    get_or_none,
    parent_alive,
    put_until,
    report_failed,
    report_ready,
    spawn_context,
    wait_ready,
)
from quiver_serve.engine.router import QueueDepthRouter, Router, RouterState
from quiver_serve.engine.work import SamplingEngine, error_result
from quiver_serve.graph.csc import GraphData
from quiver_serve.messages import BatchedRequest, Shutdown
from quiver_serve.sampling import make_cpu_sampler

log = logging.getLogger(__name__)


def sampler_worker_main(
    index: int, cfg: ServeConfig, indptr: torch.Tensor, indices: torch.Tensor,
    task_q: Any, sampled_qs: list[Any], control_q: Any,
) -> None:
    """CPU sampler process: take batches, sample, hand them to their inference worker."""
    try:
        torch.set_num_threads(cfg.sampling.cpu_threads_per_worker)
        sampler = make_cpu_sampler(indptr, indices, cfg.sampling.implementation)
        engine = SamplingEngine(sampler, cfg.sampling.fanouts, indptr.numel() - 1)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails start-up
        report_failed(control_q, "sampler", index, exc)
        raise
    report_ready(control_q, "sampler", index, impl=sampler.name)
    while parent_alive():
        item = get_or_none(task_q)
        if item is None:
            continue
        if isinstance(item, Shutdown):
            break
        try:
            sampled, failed = engine.step(item)
        except Exception as exc:  # noqa: BLE001 - fail this batch only
            log.exception("sampler %d: batch %d failed", index, item.batch_id)
            sampled, failed = None, [
                error_result(rid, "internal", f"sampling failed: {exc}", 500) for rid in item.request_ids
            ]
        out_q = sampled_qs[item.worker]
        for msg in [*failed, *([sampled] if sampled is not None else [])]:
            put_until(out_q, msg, parent_alive)


class HybridSampler:
    """Reads batched-request queues, routes each batch, and owns the CPU sampler pool."""

    def __init__(self, cfg: ServeConfig, graph: GraphData, batched_queue_list: list[Any],
                 router: Router | None = None) -> None:
        self.cfg = cfg
        self.graph = graph
        self.batched_queue_list = batched_queue_list
        self.router = router or QueueDepthRouter(cfg.sampling.route)
        ctx = spawn_context()
        cap = cfg.batching.queue_capacity
        self.on_gpu = inference_on_gpu(cfg)
        self._sampled_qs = [ctx.Queue(maxsize=cap) for _ in range(num_inference_workers(cfg))]
        n_cpu = cfg.sampling.num_cpu_workers
        self._task_qs = [ctx.Queue(maxsize=cap) for _ in range(n_cpu)]
        self._control_q = ctx.Queue()
        self.workers = [
            WorkerHandle("sampler", i, sampler_worker_main,
                         (i, cfg, graph.indptr, graph.indices, self._task_qs[i], self._sampled_qs,
                          self._control_q))
            for i in range(n_cpu)
        ]
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._route_loop, args=(q,), name=f"quiver-router-{i}", daemon=True)
            for i, q in enumerate(batched_queue_list)
        ]
        self.route_counts: dict[str, int] = {}

    def sampled_request_queue_list(self) -> list[Any]:
        return self._sampled_qs

    def start(self, wait: bool = True) -> None:
        """Spawn the CPU pool, wait for it, then start routing."""
        self.graph.share_memory_()
        for w in self.workers:
            w.start()
        if wait and self.workers:
            wait_ready(self._control_q, self.workers, self.cfg.server.start_timeout_s, "sampler")
        for t in self._threads:
            t.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=timeout_s)
        for w, q in zip(self.workers, self._task_qs, strict=True):
            w.stop(q, timeout_s)

    def state(self) -> RouterState:
        return RouterState(
            cpu_queue_depths=[_depth(q) for q in self._task_qs],
            inference_queue_depths=[_depth(q) for q in self._sampled_qs],
            inference_on_gpu=self.on_gpu,
        )

    def idle(self) -> bool:
        """True when no batch waits in any queue of this stage (workers may still be busy)."""
        return all(_depth(q) == 0 for q in (*self.batched_queue_list, *self._task_qs, *self._sampled_qs))

    def dispatch(self, batch: BatchedRequest) -> bool:
        """Route one batch and hand it on; False if stopping before it could be queued."""
        decision = self.router.decide(batch, self.state())
        batch.route, batch.worker = decision.route, decision.worker
        self.route_counts[decision.route] = self.route_counts.get(decision.route, 0) + 1
        target = self._task_qs[decision.sampler] if decision.route == "cpu" else self._sampled_qs[decision.worker]
        return put_until(target, batch, lambda: not self._stop.is_set())

    def _route_loop(self, in_q: Any) -> None:
        while not self._stop.is_set():
            batch = get_or_none(in_q)
            if batch is None:
                continue
            if isinstance(batch, Shutdown):
                break
            if not self.dispatch(batch):
                log.warning("router stopping: batch %d not dispatched", batch.batch_id)


def _depth(q: Any) -> int:
    try:
        return int(q.qsize())
    except (NotImplementedError, OSError):  # macOS has no sem_getvalue
        return 0


"""InferenceServer: one worker process per GPU (or one on a CPU-only machine).

A worker takes sampled batches (from the CPU pool) or raw batches (GPU/local route, sampled here),
gathers features, runs the model in eval/no-grad, and puts one EmbedResult per request on its
result queue.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from quiver_serve.config import ServeConfig
from quiver_serve.engine.devices import num_inference_workers, worker_device
from quiver_serve.engine.process import (
    WorkerHandle,
    report_ready,
    restart_dead,
    retire_queue,
    serve_queue,
    spawn_context,
    start_up,
    wait_ready,
)
from quiver_serve.engine.work import InferenceEngine, SamplingEngine
from quiver_serve.features.build import build_feature_store
from quiver_serve.features.store import FeatureStore
from quiver_serve.graph.csc import GraphData
from quiver_serve.messages import BatchedRequest, ResultBatch
from quiver_serve.models import ServedModel, build_model
from quiver_serve.sampling import BaseSampler, make_cpu_sampler

log = logging.getLogger(__name__)


def local_sampler(cfg: ServeConfig, graph: GraphData, device: torch.device) -> BaseSampler:
    """The sampler an inference worker uses for batches routed to it unsampled."""
    gpu = gpu_sampler_or_none(cfg, graph, device)
    return gpu if gpu is not None else make_cpu_sampler(graph.indptr, graph.indices,
                                                        cfg.sampling.implementation)


def _gpu_sampler(cfg: ServeConfig, graph: GraphData, device: torch.device) -> BaseSampler:
    from quiver_serve.sampling.gpu import CudaSampler, UvaSampler, gpu_sampler_available

    if not gpu_sampler_available():
        raise RuntimeError("CuPy is not importable or CUDA is not available")
    mode = cfg.sampling.gpu_mode
    if mode == "auto":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        csc_bytes = (graph.indptr.numel() + graph.indices.numel()) * 8
        mode = "device" if csc_bytes < free_bytes // 2 else "uva"
    if mode == "device":
        sampler: BaseSampler = CudaSampler(graph.indptr, graph.indices, device=device)
    else:
        sampler = UvaSampler(graph.indptr, graph.indices, device=device,
                             adjacency_cache=_adjacency_cache(cfg, graph, device))
    sampler.sample(graph.indptr.new_zeros(1), cfg.sampling.fanouts, 0)  # compiles the kernel now
    return sampler


def _adjacency_cache(cfg: ServeConfig, graph: GraphData, device: torch.device) -> Any:
    """The UVA sampler's GPU copy of the hottest neighbour lists (None: no budget for it)."""
    budget = cfg.sampling.gpu_graph_cache_bytes
    if budget <= 0:
        return None
    from quiver_serve.features.adjacency import EF_BITS, build_adjacency_cache, expansion_scores

    scores = expansion_scores(graph.indptr, graph.indices, cfg.sampling.fanouts,
                              cfg.features.fap_batch_size)
    layout = EF_BITS if cfg.sampling.graph_cache_layout == "elias_fano" else None
    cache = build_adjacency_cache(graph.indptr, graph.indices, scores, budget, device, layout)
    if cache is None:
        log.warning("sampling.gpu_graph_cache_bytes=%d is below the cache's fixed part (16 bytes "
                    "per node): no adjacency cache", budget)
    else:
        log.info("adjacency cache: %d of %d neighbour lists (%s), %d bytes on %s",
                 cache.num_cached, graph.num_nodes, "Elias-Fano" if cache.index_bits == EF_BITS
                 else f"{cache.index_bits} bits per entry", cache.nbytes, device)
    return cache


def place_model_and_features(cfg: ServeConfig, graph: GraphData,
                             index: int) -> tuple[torch.device, ServedModel, FeatureStore]:
    """Worker ``index``'s device, its model there (weights-only), and its feature store: the
    hottest rows on the GPU within ``inference.gpu_cache_bytes``, the rest in host memory."""
    device = worker_device(cfg, index)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    self_loops = graph.self_loop_count() if cfg.model.pyg_class == "GCN" else None
    model = ServedModel(build_model(cfg.model, graph.num_features), graph.degree(),
                        self_loops, precision=cfg.inference.precision,
                        fast=cfg.inference.fast_model).to(device)
    return device, model, build_feature_store(cfg, graph, device)


def build_engine(cfg: ServeConfig, graph: GraphData, index: int) -> InferenceEngine:
    """Everything a worker needs: device, model (weights-only), local sampler, warm-up."""
    device, model, features = place_model_and_features(cfg, graph, index)
    sampler = local_sampler(cfg, graph, device)
    engine = InferenceEngine(model, features, device,
                             SamplingEngine(sampler, cfg.sampling.fanouts, graph.num_nodes), index,
                             gather=features.gather)
    _warm_up(engine)
    return engine


def _warm_up(engine: InferenceEngine) -> None:
    """One tiny batch so the first real request does not pay for lazy initialisation."""

    probe = BatchedRequest(batch_id=-1, request_ids=["warm-up"], offsets=[0, 1],
                           node_ids=torch.zeros(1, dtype=torch.int64), exact=False, seed=0,
                           deadlines_s=[time.time() + 60.0])
    results = engine.step(probe)
    if not results or results[0].error is not None:
        raise RuntimeError(f"warm-up batch failed: {results[0].error if results else 'no result'}")


def inference_worker_main(
    index: int, cfg: ServeConfig, graph: GraphData, in_q: Any, result_q: Any, control_q: Any,
    batch_results: bool = False,
) -> None:
    torch.set_num_threads(cfg.inference.torch_threads)
    engine = start_up(control_q, "inference", index, lambda: build_engine(cfg, graph, index))
    report_ready(control_q, "inference", index, device=str(engine.device),
                 sampler=engine.local.sampler.name, dim=engine.model.out_dim,
                 features_on=str(engine.features.device))
    if batch_results:
        serve_queue(in_q, result_q, lambda item: [ResultBatch.pack(engine.step(item))])
    else:
        serve_queue(in_q, result_q, engine.step)


class InferenceServer:
    """Owns the inference worker processes and their result queues."""

    def __init__(self, cfg: ServeConfig, graph: GraphData, sampled_queue_list: list[Any],
                 batch_results: bool = False) -> None:
        """``batch_results``: result queues carry one ResultBatch per batch (the Pipeline unpacks
        them) instead of one EmbedResult per request; fewer queue operations per request."""
        expected = num_inference_workers(cfg)
        if len(sampled_queue_list) != expected:
            raise ValueError(f"{len(sampled_queue_list)} sampled queues for {expected} inference workers")
        self.cfg = cfg
        self.graph = graph
        self.in_qs = sampled_queue_list  # shared with the HybridSampler: replaced in place
        self._ctx = spawn_context()
        self._result_cap = cfg.batching.queue_capacity * 4
        self._result_qs = [self._ctx.Queue(maxsize=self._result_cap) for _ in sampled_queue_list]
        self._control_q = self._ctx.Queue(maxsize=256)  # readiness messages only
        self.workers = [
            WorkerHandle("inference", i, inference_worker_main, self._args_for(i))
            for i in range(len(sampled_queue_list))
        ]
        self.ready_info: dict[int, Any] = {}
        self._stopping = False
        self.batch_results = batch_results

    def _args_for(self, i: int) -> Any:
        return lambda: (i, self.cfg, self.graph, self.in_qs[i], self._result_qs[i], self._control_q,
                        self.batch_results)

    def result_queue_list(self) -> list[Any]:
        """One queue per worker. After a restart the entry is a new queue: read it from this list."""
        return self._result_qs

    def start(self, wait: bool = True) -> None:
        self.graph.share_memory_()
        for w in self.workers:
            w.start()
        if wait:
            ready = wait_ready(self._control_q, self.workers, self.cfg.server.start_timeout_s,
                               "inference worker")
            self.ready_info = {i: r.info for i, r in ready.items()}

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping = True
        for w in self.workers:
            w.stop(self.in_qs[w.index], timeout_s)

    def check_workers(self) -> list[int]:
        """Restart dead inference workers on fresh queues; returns the indices restarted.

        What the dead worker held (its input queue, a batch in progress) is lost: the Pipeline
        retries those requests once, then answers 503.
        """
        if self._stopping:
            return []
        return restart_dead(self.workers, self._renew_queues)

    def _renew_queues(self, i: int) -> None:
        retire_queue(self.in_qs[i])
        self.in_qs[i] = self._ctx.Queue(maxsize=self.cfg.batching.queue_capacity)
        retire_queue(self._result_qs[i])
        self._result_qs[i] = self._ctx.Queue(maxsize=self._result_cap)


def gpu_sampler_or_none(cfg: ServeConfig, graph: GraphData, device: torch.device) -> BaseSampler | None:
    """The GPU sampler of an engine core on ``device``, or None (CPU device, no CuPy, no build)."""
    if device.type != "cuda":
        return None
    try:
        return _gpu_sampler(cfg, graph, device)
    except Exception as exc:  # noqa: BLE001 - the engine samples on the CPU instead
        log.warning("GPU sampler unavailable (%s: %s); sampling on the CPU", type(exc).__name__, exc)
        return None

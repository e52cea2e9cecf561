"""Stage logic without processes: sampling a batch and running the model on it.

The process wrappers (``hybrid_sampler.py``, ``inference.py``) own queues and loops; these classes
own the work, so tests drive them directly and the CPU-only "local" route reuses them in-process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import Tensor

from quiver_serve.errors import internal_error
from quiver_serve.messages import (
    BatchedRequest,
    BatchStats,
    EmbedResult,
    ErrorInfo,
    SampledBatch,
)
from quiver_serve.models import ServedModel
from quiver_serve.sampling.base import BaseSampler

log = logging.getLogger(__name__)


def error_result(request_id: str, code: str, message: str, status: int) -> EmbedResult:
    return EmbedResult(request_id=request_id, error=ErrorInfo(code=code, message=message, status=status))


def check_node_ids(node_ids: Tensor, num_nodes: int) -> str | None:
    """Why these ids cannot be served, or None when they can."""
    if node_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        return f"node_ids must be integers, got dtype {node_ids.dtype}"
    if node_ids.numel() == 0:
        return "node_ids is empty"
    lo, hi = int(node_ids.min()), int(node_ids.max())
    if lo < 0 or hi >= num_nodes:
        bad = lo if lo < 0 else hi
        return f"node id {bad} is out of range: valid ids are 0..{num_nodes - 1}"
    return None


def prune_batch(
    batch: BatchedRequest, num_nodes: int, now_s: float
) -> tuple[BatchedRequest | None, list[EmbedResult]]:
    """Drop expired or invalid requests before any work; answer them. None if nothing is left."""
    keep: list[int] = []
    failed: list[EmbedResult] = []
    for i, (rid, start, end) in enumerate(batch.slices()):
        if batch.deadlines_s[i] <= now_s:
            failed.append(error_result(rid, "deadline_exceeded",
                                       "the request's deadline passed before it was served", 504))
            continue
        problem = check_node_ids(batch.node_ids[start:end], num_nodes)
        if problem is not None:
            failed.append(error_result(rid, "invalid_node_ids", problem, 400))
            continue
        keep.append(i)
    if len(keep) == batch.num_requests:
        return batch, failed
    return (batch.subset(keep) if keep else None), failed


class SamplingEngine:
    """Samples batches with one sampler; exact batches use every neighbour on every hop."""

    def __init__(self, sampler: BaseSampler, fanouts: list[int], num_nodes: int) -> None:
        self.sampler = sampler
        self.fanouts = list(fanouts)
        self.num_nodes = num_nodes

    def step(self, batch: BatchedRequest) -> tuple[SampledBatch | None, list[EmbedResult]]:
        kept, failed = prune_batch(batch, self.num_nodes, time.time())
        if kept is None:
            return None, failed
        fanouts = [-1] * len(self.fanouts) if kept.exact else self.fanouts
        t0 = time.perf_counter()
        out = self.sampler.sample(kept.node_ids, fanouts, kept.seed)
        sampled = SampledBatch(
            batch=kept, n_id=out.n_id, edge_index=out.edge_index, seed_index=out.seed_index,
            num_sampled_nodes=out.num_sampled_nodes, num_sampled_edges=out.num_sampled_edges,
            sample_s=time.perf_counter() - t0,
        )
        return sampled, failed


class InferenceEngine:
    """Gathers features, runs the model, splits the output back into per-request results."""

    def __init__(self, model: ServedModel, features: Tensor, device: torch.device,
                 local: SamplingEngine, worker_index: int = 0,
                 gather: Callable[[Tensor], Tensor] | None = None) -> None:
        self.model = model
        self.features = features
        self.device = device
        self.local = local
        self.worker_index = worker_index
        self._gather = gather or self._gather_host

    def _count_rows(self, rows_read: int) -> tuple[int, int]:
        """(hits, misses) of the batch just computed: counted per row by a feature store (its
        counters, read after the batch's own sync), else by where the matrix lives."""
        counts = getattr(self.features, "counts", None)
        if counts is not None:
            hits, misses = (int(v) for v in counts.tolist())
            counts.zero_()
            return hits, misses
        on_gpu = self.features.device == self.device and self.device.type == "cuda"
        return (rows_read, 0) if on_gpu else (0, rows_read)

    def _gather_host(self, n_id: Tensor) -> Tensor:
        rows = self.features.index_select(0, n_id.to(self.features.device))
        return rows.to(self.device, non_blocking=True)

    def step(self, item: SampledBatch | BatchedRequest | EmbedResult) -> list[EmbedResult]:
        if isinstance(item, EmbedResult):  # answered upstream (invalid or expired): pass it on
            return [item]
        failed: list[EmbedResult] = []
        if isinstance(item, BatchedRequest):
            sampled, failed = self.local.step(item)
            if sampled is None:
                return failed
        else:
            sampled = item
            expired = [i for i, d in enumerate(sampled.batch.deadlines_s) if d <= time.time()]
            if len(expired) == sampled.batch.num_requests:  # nobody waits for it: skip the work
                return [error_result(rid, "deadline_exceeded",
                                     "the request's deadline passed before it was served", 504)
                        for rid in sampled.batch.request_ids]
        try:
            return failed + self._compute(sampled)
        except Exception as exc:  # noqa: BLE001 - one bad batch fails its own requests only
            info = internal_error(exc, f"inference of batch {sampled.batch.batch_id}", log).info
            return failed + [EmbedResult(request_id=rid, error=info)
                             for rid in sampled.batch.request_ids]

    def _compute(self, sb: SampledBatch) -> list[EmbedResult]:
        batch = sb.batch
        t0 = time.perf_counter()
        x = self._gather(sb.n_id)
        t1 = time.perf_counter()  # on a GPU the gather is asynchronous: its tail lands in compute_s
        edge_index = sb.edge_index.to(self.device, non_blocking=True)
        n_id = sb.n_id.to(self.device, non_blocking=True)
        out = self.model(x, n_id, edge_index, sb.num_sampled_nodes, sb.num_sampled_edges, batch.exact)
        rows = out[sb.seed_index.to(self.device)].float().cpu()
        t2 = time.perf_counter()
        stats = BatchStats(
            batch_id=batch.batch_id, route=batch.route or "local", worker=self.worker_index,
            num_requests=batch.num_requests, num_seeds=int(batch.node_ids.numel()),
            num_sampled_nodes=int(sb.n_id.numel()), num_sampled_edges=int(sb.edge_index.size(1)),
            queue_s=max(time.time() - batch.created_s - (t2 - t0) - sb.sample_s, 0.0),
            sample_s=sb.sample_s, gather_s=t1 - t0, compute_s=t2 - t1,
        )
        stats.cache_hits, stats.cache_misses = self._count_rows(int(sb.n_id.numel()))
        results = [
            EmbedResult(request_id=rid, embeddings=rows[start:end].clone())
            for rid, start, end in batch.slices()
        ]
        results[0].stats = stats
        return results

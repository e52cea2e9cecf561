"""The formed batch of an engine core, the CPU sampler pool as the core sees it, and the
per-batch numbers it reports (``BatchStats``): the data the stage logic in ``core.py`` moves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from quiver_serve.engine.core.micro_batch import Part
from quiver_serve.features.store import FeatureStore
from quiver_serve.messages import BatchStats
from quiver_serve.models.graphed import Staged
from quiver_serve.sampling.base import SamplerOutput

if TYPE_CHECKING:
    from quiver_serve.engine.core.model_slots import ModelSlot


@dataclass
class Batch:
    """Micro-batches merged for one pass of sample → gather → model."""

    batch_id: int
    parts: list[Part]
    seeds: Tensor  # int64, the alive requests' ids concatenated
    exact: bool
    seed: int
    route: str = ""
    formed_s: float = 0.0
    sample_s: float = 0.0
    sampled: SamplerOutput | None = None
    staged: Staged | None = None  # packed for a CUDA graph (small sampled batches)
    # set once launched
    rows: Tensor | None = None
    counts: Tensor | None = None  # the feature store's hit/miss counters after this batch
    done_event: torch.cuda.Event | None = None
    start_event: torch.cuda.Event | None = None
    launched_s: float = 0.0
    expected_done_s: float = 0.0
    # routing: predicted sampled-graph size and batch latency; the pool sampler it went to
    psgs: float = 0.0
    predicted_s: float = 0.0
    sampler: int = -1
    sent_s: float = 0.0
    sent_idle: bool = False
    #: the ``ModelSlot`` (model version) every micro-batch of it asked for
    slot: ModelSlot | None = None


class SamplerPool:
    """The CPU sampler pool as the engine core sees it (the process wrapper implements it)."""

    def outstanding(self) -> list[int]:
        return []

    def send(self, worker: int, task_id: int, seeds: Tensor, fanouts: list[int], seed: int) -> None:
        raise NotImplementedError


def batch_stats(batch: Batch, compute_s: float, index: int, features: FeatureStore,
                counts_seen: tuple[int, int]) -> tuple[BatchStats, tuple[int, int]]:
    """One finished batch's stats, and the store's hit/miss counters now (for the next batch)."""
    sb = batch.sampled
    assert sb is not None
    oldest = min(p.mb.received_s for p in batch.parts)
    hits, misses, now = _batch_counts(batch, features, counts_seen)
    return BatchStats(
        batch_id=batch.batch_id, route=batch.route, worker=index,
        num_requests=sum(p.num_alive for p in batch.parts),
        num_seeds=int(batch.seeds.numel()), num_sampled_nodes=int(sb.n_id.numel()),
        num_sampled_edges=int(sb.edge_index.size(1)),
        queue_s=max(batch.formed_s - oldest, 0.0), sample_s=batch.sample_s, gather_s=0.0,
        compute_s=compute_s, cache_hits=hits, cache_misses=misses, psgs=batch.psgs,
        predicted_s=batch.predicted_s, received_s=batch.parts[0].mb.received_s,
        model=batch.slot.name if batch.slot is not None else "",
        version=batch.slot.version if batch.slot is not None else 0), now


def _batch_counts(batch: Batch, features: FeatureStore,
                  seen: tuple[int, int]) -> tuple[int, int, tuple[int, int]]:
    """Rows this batch read from GPU memory (hits) and host memory (misses): the store's
    device counters (copied out with the batch's rows; on a CPU read directly) minus their
    value at the previous batch. A CUDA graph also reads node 0's row for every padding
    slot: those reads are taken off again."""
    counts = batch.counts if batch.counts is not None else features.counts
    now = (int(counts[0]), int(counts[1]))
    hits, misses = now[0] - seen[0], now[1] - seen[1]
    if batch.staged is not None and batch.sampled is not None:
        pad = batch.staged.graph.layout.num_nodes - sum(batch.sampled.num_sampled_nodes)
        if features.is_hit(0):
            hits -= pad
        else:
            misses -= pad
    return max(hits, 0), max(misses, 0), now


def is_cuda_fatal(exc: BaseException) -> bool:
    """CUDA errors that leave the context unusable (illegal address, launch failure, ECC...)."""
    text = f"{type(exc).__name__}: {exc}".lower()
    sticky = ("illegal memory access", "illegal address", "unspecified launch failure",
              "device-side assert", "ecc error", "cudaerrorlaunchfailure", "misaligned address",
              "an illegal instruction")
    return any(s in text for s in sticky) or type(exc).__name__ == "AcceleratorError"

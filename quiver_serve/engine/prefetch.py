"""Feature prefetch: a batch's rows are gathered on the sampling stream as soon as it is sampled.

Without it the engine core queues gather and model on one compute stream, so a batch's gather
waits for the model of the batch before it. When part of the feature matrix lives in pinned host
memory (``inference.gpu_cache_bytes`` below the matrix), the gather is the bus-bound half of a
batch (misses cross PCIe at ~45 GB/s: 3-9 ms for a few thousand Reddit-scale seeds in fp32) and
the model the compute-bound half, so the two can overlap: batch k+1's host reads run while batch
k's model runs.

The gather is the store's one kernel on the sampling stream, counting its hits and misses into a
counter of its own (the store's counters are snapshot on the compute stream, in batch order, for
the batches that still gather there: CUDA-graph batches, and every batch when prefetch is off).
The compute stream waits on the gather's event before the model; the batch's compute time is
measured from the gather's start, so the cost model keeps predicting gather + model.

``features.prefetch``: ``auto`` (default) prefetches while the store keeps rows in host memory,
``on`` always (on a GPU), ``off`` never. Batches small enough for a CUDA graph keep the gather in
their graph (one launch; their host reads are few).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from quiver_serve.features.store import FeatureStore

MODES = ("auto", "on", "off")


@dataclass
class Prefetched:
    """A batch's gathered rows, made on the sampling stream."""

    x: Tensor
    start: Any  # torch.cuda.Event before the gather (timing)
    ready: Any  # torch.cuda.Event after it: the compute stream waits on this
    counts: Tensor  # pinned int64 [hits, misses] of this gather, filled when ``ready``


class FeaturePrefetch:
    """Decides which batches prefetch and queues their gathers on the sampling stream."""

    def __init__(self, features: FeatureStore, stream: Any, mode: str = "auto") -> None:
        if mode not in MODES:
            raise ValueError(f"features.prefetch must be one of {MODES}, got {mode!r}")
        self.features, self.stream, self.mode = features, stream, mode
        self.count = 0  # batches prefetched so far

    def active(self) -> bool:
        if self.stream is None or self.mode == "off":
            return False
        return self.mode == "on" or self.features.has_host_rows

    def start(self, batch: Any) -> None:
        """Queue the gather of ``batch``'s rows (sampled, not staged for a CUDA graph)."""
        sampled = batch.sampled
        if batch.staged is not None or sampled is None or batch.prefetched is not None \
                or not self.active():
            return
        device = self.features.device
        with torch.cuda.stream(self.stream):
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            counts = torch.zeros(2, dtype=torch.int64, device=device)
            x = self.features.gather(sampled.n_id, counts)
            host_counts = torch.empty(2, dtype=torch.int64, pin_memory=True)
            host_counts.copy_(counts, non_blocking=True)
            ready = torch.cuda.Event(enable_timing=True)
            ready.record(self.stream)
        batch.prefetched = Prefetched(x, start, ready, host_counts)
        self.count += 1

    @staticmethod
    def hand_over(batch: Any, stream: Any) -> Tensor | None:
        """Make ``stream`` wait for the batch's gather; its rows (None: not prefetched)."""
        pre = batch.prefetched
        if pre is None:
            return None
        stream.wait_event(pre.ready)
        pre.x.record_stream(stream)  # made on the sampling stream, read on this one
        return pre.x

    @staticmethod
    def reading(batch: Any) -> bool:
        """The batch's gather still reads (the bus is busy with its rows)."""
        pre = batch.prefetched
        return pre is not None and not pre.ready.query()

"""Feature prefetch: a batch's rows are gathered on the sampling stream as soon as it is sampled.

Without it the engine core queues gather and model on one compute stream, so a batch's gather
waits for the model of the batch before it. When part of the feature matrix lives in pinned host
memory (``inference.gpu_cache_bytes`` below the matrix), the gather is the bus-bound half of a
batch (misses cross PCIe at ~45 GB/s: 3-9 ms for a few thousand Reddit-scale seeds in fp32) and
the model the compute-bound half, so the two can overlap: batch k+1's host reads run while batch
k's model runs.

The gather is the store's one kernel on a stream of its own (the gather stream: gathers queue
there in batch order, one reading the bus at a time, while the next batch samples on the
sampling stream), on a grid of two blocks per SM so the model's kernels find room beside it. It
counts its hits and misses into a counter of its own (the store's counters are snapshot on the
compute stream, in batch order, for the batches that still gather there: CUDA-graph batches, and
every batch when prefetch is off). The compute stream waits on the gather's event before the
model; the batch's compute time is measured from the gather's start, so the cost model keeps
predicting gather + model.

Pacing: the bus is the bottleneck resource, so the engine forms the next batch when the last
gather is predicted to end within the time a batch takes to form and sample
(:meth:`FeaturePrefetch.ready_s`): its gather then starts as the bus frees. The prediction is a
line in sampled nodes, learnt from the gathers' own events.

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
#: the gather time line's prior: fixed seconds, and seconds per sampled node (Reddit-scale rows
#: at 45 GB/s with a third of them hits: ~35 ns); replaced by what the events measure
PRIOR_FIXED_S, PRIOR_PER_NODE_S = 5e-5, 3.5e-8
#: weight of each measured gather in the per-node rate
EWMA = 0.2


@dataclass
class Prefetched:
    """A batch's gathered rows, made on the gather stream."""

    x: Tensor
    start: Any  # torch.cuda.Event before the gather (timing)
    ready: Any  # torch.cuda.Event after it: the compute stream waits on this
    counts: Tensor  # pinned int64 [hits, misses] of this gather, filled when ``ready``
    num_nodes: int = 0
    expected_ready_s: float = 0.0  # wall clock
    learnt: bool = False


class FeaturePrefetch:
    """Decides which batches prefetch, queues their gathers and paces the next batch."""

    def __init__(self, features: FeatureStore, sample_stream: Any, mode: str = "auto") -> None:
        if mode not in MODES:
            raise ValueError(f"features.prefetch must be one of {MODES}, got {mode!r}")
        self.features, self.sample_stream, self.mode = features, sample_stream, mode
        self.stream: Any = None  # the gather stream, made at the first prefetch
        self.count = 0  # batches prefetched so far
        self.per_node_s = PRIOR_PER_NODE_S
        self._last: Prefetched | None = None

    def active(self) -> bool:
        if self.sample_stream is None or self.mode == "off":
            return False
        return self.mode == "on" or self.features.has_host_rows

    def start(self, batch: Any, now_s: float) -> None:
        """Queue the gather of ``batch``'s rows (sampled, not staged for a CUDA graph)."""
        sampled = batch.sampled
        if batch.staged is not None or sampled is None or batch.prefetched is not None \
                or not self.active():
            return
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.features.device)
        stream = self.stream
        stream.wait_stream(self.sample_stream)  # the sample's tensors are made there
        with torch.cuda.stream(stream):
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            counts = torch.zeros(2, dtype=torch.int64, device=self.features.device)
            x = self.features.gather(sampled.n_id, counts, beside=True)
            host_counts = torch.empty(2, dtype=torch.int64, pin_memory=True)
            host_counts.copy_(counts, non_blocking=True)
            ready = torch.cuda.Event(enable_timing=True)
            ready.record(stream)
        if sampled.n_id.is_cuda:
            sampled.n_id.record_stream(stream)
        nodes = int(sampled.n_id.numel())
        last = self._last
        begin = now_s if last is None else max(now_s, last.expected_ready_s)
        batch.prefetched = pre = Prefetched(x, start, ready, host_counts, nodes,
                                            begin + self.predict_s(nodes))
        self._last = pre
        self.count += 1

    def predict_s(self, num_nodes: int) -> float:
        return PRIOR_FIXED_S + self.per_node_s * num_nodes

    def learn(self, batch: Any) -> None:
        """Fold the batch's measured gather time into the line (once its gather is done)."""
        pre = batch.prefetched
        if pre is None or pre.learnt or pre.num_nodes <= 0 or not pre.ready.query():
            return
        pre.learnt = True
        took_s = pre.start.elapsed_time(pre.ready) / 1e3
        rate = max(took_s - PRIOR_FIXED_S, 0.0) / pre.num_nodes
        self.per_node_s += EWMA * (rate - self.per_node_s)

    def ready_s(self, batch: Any) -> float:
        """When the batch's gather is expected to end (wall clock; 0 once it has)."""
        pre = batch.prefetched
        if pre is None or pre.ready.query():
            if pre is not None:
                self.learn(batch)
            return 0.0
        return pre.expected_ready_s

    @staticmethod
    def hand_over(batch: Any, stream: Any) -> Tensor | None:
        """Make ``stream`` wait for the batch's gather; its rows (None: not prefetched)."""
        pre = batch.prefetched
        if pre is None:
            return None
        stream.wait_event(pre.ready)
        pre.x.record_stream(stream)  # made on the gather stream, read on this one
        return pre.x

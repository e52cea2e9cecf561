"""Every message that crosses a thread or process boundary, as a typed class (never a bare tuple).

Tensors travel two ways. Small ones (under ``INLINE_TENSOR_BYTES``) are pickled inline as NumPy
bytes: a round trip through a ``multiprocessing`` queue then costs ~0.1 ms, where torch's
shared-memory reduction costs ~0.7 ms whatever the size (measured on the 2-core dev box). Large
ones keep torch's shared-memory path, which copies nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

INLINE_TENSOR_BYTES = 256 * 1024


class _InlineSmallTensors:
    """Pickle small tensor fields as NumPy arrays; large ones through shared memory."""

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for key, value in state.items():
            if isinstance(value, Tensor) and value.device.type == "cpu":
                if value.numel() * value.element_size() <= INLINE_TENSOR_BYTES:
                    state[key] = _InlineArray(value.detach().contiguous().numpy())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            if isinstance(value, _InlineArray):
                state[key] = torch.from_numpy(value.array)
        self.__dict__.update(state)


@dataclass
class _InlineArray:
    array: np.ndarray


@dataclass
class ErrorInfo:
    """Why a request failed; ``status`` is the HTTP status the front-end answers with."""

    code: str
    message: str
    status: int = 500


@dataclass
class EmbedRequest(_InlineSmallTensors):
    """One caller's request: embeddings for ``node_ids`` (repeats allowed, order kept).

    ``deadline_s`` is a ``time.time()`` instant (comparable across processes); ``None`` means the
    pipeline's default timeout. ``seed`` makes sampling reproducible; ``exact`` samples all
    neighbours so the embedding equals the full-graph model output.
    """

    request_id: str
    node_ids: Tensor
    exact: bool = False
    seed: int | None = None
    deadline_s: float | None = None
    submitted_s: float = field(default_factory=time.time)


@dataclass
class BatchStats:
    """Per-batch timings and counters a worker reports; the front-end turns them into metrics."""

    batch_id: int
    route: str
    worker: int
    num_requests: int
    num_seeds: int
    num_sampled_nodes: int = 0
    num_sampled_edges: int = 0
    queue_s: float = 0.0
    sample_s: float = 0.0
    gather_s: float = 0.0
    compute_s: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0
    psgs: float = 0.0  # predicted unique nodes of the batch (0: no prediction)
    predicted_s: float = 0.0  # predicted sample + gather + model seconds (0: no prediction)
    #: ``time.time()`` when the engine core took in the micro-batch this stats rides on, and
    #: when its process sent that micro-batch's reply (0: not sent over a socket): with the
    #: client's send and receive times they split a request's time into transport out, engine,
    #: transport back
    received_s: float = 0.0
    replied_s: float = 0.0


@dataclass
class EmbedResult(_InlineSmallTensors):
    """The answer to one :class:`EmbedRequest`: ``embeddings`` [n, dim] float32, or ``error``.

    ``stats`` is set on exactly one result of each batch, so per-batch metrics count once.
    """

    request_id: str
    embeddings: Tensor | None = None
    error: ErrorInfo | None = None
    stats: BatchStats | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class ResultBatch(_InlineSmallTensors):
    """Every result of one batch in one message: one queue operation per batch instead of one per
    request (the Pipeline's path). ``rows`` holds the embeddings of the answered requests, one
    after another; ``spans[i]`` is (request_id, start, end) into it."""

    rows: Tensor | None
    spans: list[tuple[str, int, int]]
    errors: list[EmbedResult]
    stats: BatchStats | None

    @classmethod
    def pack(cls, results: list[EmbedResult]) -> ResultBatch:
        ok = [r for r in results if r.embeddings is not None]
        spans, start = [], 0
        for r in ok:
            assert r.embeddings is not None
            spans.append((r.request_id, start, start + int(r.embeddings.size(0))))
            start = spans[-1][2]
        rows = torch.cat([r.embeddings for r in ok]) if ok else None  # type: ignore[misc]
        stats = next((r.stats for r in results if r.stats is not None), None)
        return cls(rows=rows, spans=spans, errors=[r for r in results if r.embeddings is None],
                   stats=stats)

    def unpack(self) -> list[EmbedResult]:
        """The per-request results; the first carries the batch stats, as in the unpacked form."""
        out = [EmbedResult(rid, embeddings=self.rows[a:b]) for rid, a, b in self.spans
               if self.rows is not None]
        out += self.errors
        if out and self.stats is not None:
            out[0].stats = self.stats
        return out


@dataclass
class BatchedRequest(_InlineSmallTensors):
    """Requests merged into one batch: ``node_ids`` is their concatenation.

    Request ``i`` owns ``node_ids[offsets[i]:offsets[i+1]]``. ``route`` and ``worker`` are filled
    in by the router.
    """

    batch_id: int
    request_ids: list[str]
    offsets: list[int]
    node_ids: Tensor
    exact: bool
    seed: int
    deadlines_s: list[float]
    created_s: float = field(default_factory=time.time)
    route: str = ""
    worker: int = 0

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    def subset(self, keep: list[int]) -> BatchedRequest:
        """The same batch with only requests ``keep`` (indices into ``request_ids``)."""
        slices = self.slices()
        parts = [self.node_ids[slices[i][1]:slices[i][2]] for i in keep]
        offsets = [0]
        for p in parts:
            offsets.append(offsets[-1] + int(p.numel()))
        return BatchedRequest(
            batch_id=self.batch_id, request_ids=[self.request_ids[i] for i in keep], offsets=offsets,
            node_ids=torch.cat(parts) if parts else self.node_ids[:0], exact=self.exact,
            seed=self.seed, deadlines_s=[self.deadlines_s[i] for i in keep], created_s=self.created_s,
            route=self.route, worker=self.worker,
        )

    def slices(self) -> list[tuple[str, int, int]]:
        """(request_id, start, end) of every request in the batch."""
        return [
            (rid, self.offsets[i], self.offsets[i + 1]) for i, rid in enumerate(self.request_ids)
        ]


@dataclass
class SampledBatch(_InlineSmallTensors):
    """A batch with its sampled subgraph (PyG-shaped, see ``sampling.base.SamplerOutput``)."""

    batch: BatchedRequest
    n_id: Tensor
    edge_index: Tensor
    seed_index: Tensor  # row of n_id for each entry of batch.node_ids
    num_sampled_nodes: list[int]
    num_sampled_edges: list[int]
    sample_s: float


@dataclass
class SamplerReply:
    """What a CPU sampler sends back for one batch: the sample (if any request was left) and the
    requests it answered itself (invalid or expired)."""

    batch_id: int
    worker: int  # inference worker the batch was routed to
    sampled: SampledBatch | None
    failed: list[EmbedResult]


@dataclass
class WorkerReady:
    """A worker process finished start-up (graph mapped, model loaded)."""

    role: str
    index: int
    pid: int
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class WorkerFailed:
    """A worker process could not start; ``message`` says why."""

    role: str
    index: int
    message: str


@dataclass
class Shutdown:
    """Sentinel: the receiving loop finishes what it holds and exits."""

"""The queue API's messages (EmbedRequest in, EmbedResult out, ErrorInfo) and per-batch stats,
as typed classes; every socket message is in ``wire.py``.

Their tensors travel through ``multiprocessing`` queues two ways. Small ones (under
``INLINE_TENSOR_BYTES``) are pickled inline as NumPy bytes: a round trip through a queue then
costs ~0.1 ms, where torch's shared-memory reduction costs ~0.7 ms whatever the size (on two CPU
cores). Large ones keep torch's shared-memory path, which copies nothing.
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
    #: the model ("": the default) and version (0: by its traffic split) asked for
    model: str = ""
    version: int = 0
    #: the node type of ``node_ids`` (typed graphs; "": the graph's only type)
    node_type: str = ""


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
    #: the model and version the batch ran ("" for batches of no model, e.g. the table's)
    model: str = ""
    version: int = 0


@dataclass
class EmbedResult(_InlineSmallTensors):
    """The answer to one :class:`EmbedRequest`: ``embeddings`` [n, dim] float32, or ``error``."""

    request_id: str
    embeddings: Tensor | None = None
    error: ErrorInfo | None = None
    #: the model and version that computed ``embeddings``
    model: str = ""
    version: int = 0
    #: the rows as a read-only NumPy view of the engine's reply, instead of ``embeddings``, for
    #: callers that asked for them (``EngineClient.submit_async(numpy_rows=True)``: front-ends)
    rows: np.ndarray | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

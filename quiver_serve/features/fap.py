"""Feature access probability (FAP, docs/architecture.md, "Feature store") and the seed
distributions it starts from.

FAP of node ``v`` is ``P_L(v)`` of the access recursion (``graph/access.py``, the one copy of it):
the probability that one batch's sampled subgraph contains ``v``, given ``P_0`` = the probability
that ``v`` is among the batch's seeds. Uniform requests give ``P_0 = batch_size / num_nodes``;
a request log gives each node ``batch_size`` times its share of the logged ids (capped at 1).
"""

from __future__ import annotations

import threading

import numpy as np
import torch
from torch import Tensor

from quiver_serve.graph.access import access_probability


def uniform_seed_probability(num_nodes: int, batch_size: int) -> Tensor:
    """``P_0`` when every node is equally likely to be requested."""
    if num_nodes <= 0:
        return torch.zeros(0, dtype=torch.float32)
    p = min(1.0, max(batch_size, 1) / num_nodes)
    return torch.full((num_nodes,), p, dtype=torch.float32)


def logged_seed_probability(ids: np.ndarray, num_nodes: int, batch_size: int) -> Tensor:
    """``P_0`` from requested ids: each node's share of the log times the batch size, at most 1.

    An empty log gives the uniform distribution."""
    ids = np.asarray(ids, dtype=np.int64)
    ids = ids[(ids >= 0) & (ids < num_nodes)]
    if ids.size == 0:
        return uniform_seed_probability(num_nodes, batch_size)
    counts = np.bincount(ids, minlength=num_nodes).astype(np.float32)
    p = torch.from_numpy(counts * (max(batch_size, 1) / ids.size))
    return p.clamp_(max=1.0)


def feature_access_probability(indptr: Tensor, indices: Tensor, fanouts: list[int],
                               seed_prob: Tensor) -> Tensor:
    """Per node: the probability that a batch's sampled subgraph contains it (float32)."""
    if seed_prob.numel() != indptr.numel() - 1:
        raise ValueError(f"seed_prob has {seed_prob.numel()} entries for "
                         f"{indptr.numel() - 1} nodes")
    return access_probability(indptr, indices, seed_prob, list(fanouts))[-1]


def degree_scores(indptr: Tensor) -> Tensor:
    """The baseline order (torch-quiver's serving cache): hottest = highest in-degree."""
    return (indptr[1:] - indptr[:-1]).to(torch.float32)


class RequestLog:
    """The last ``capacity`` requested node ids, a ring buffer: the learnt seed distribution.

    ``record`` takes a batch's seeds (one numpy copy, no per-request work); ``snapshot`` returns
    what is held, oldest first. Thread-safe: the engine records, a re-placement thread reads."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"request log capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._ids = np.zeros(capacity, dtype=np.int64)
        self._next = 0  # total ids ever recorded
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return min(self._next, self.capacity)

    def record(self, ids: np.ndarray | Tensor) -> None:
        if self.capacity == 0:
            return
        arr = ids.numpy() if isinstance(ids, Tensor) else np.asarray(ids, dtype=np.int64)
        arr = arr.reshape(-1)[-self.capacity:]
        with self._lock:
            at = self._next % self.capacity
            first = min(arr.size, self.capacity - at)
            self._ids[at:at + first] = arr[:first]
            self._ids[:arr.size - first] = arr[first:]
            self._next += arr.size

    def snapshot(self) -> np.ndarray:
        with self._lock:
            if self._next <= self.capacity:
                return self._ids[:self._next].copy()
            at = self._next % self.capacity
            return np.concatenate([self._ids[at:], self._ids[:at]])

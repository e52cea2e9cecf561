"""Rows of other partitions replicated on a partition (docs/decisions/0042-partitioning.md): the
ones its requests are likeliest to read, by feature access probability (FAP,
``features/fap.py``).

A partition's requests name the nodes it owns, so ``P_0`` is uniform over them (``batch_size``
seeds per batch); the access recursion with the served fanouts gives ``P_L(v)``, the probability
that one such batch's sampled subgraph holds ``v``, hence reads its feature row. The rows of other
partitions with the highest ``P_L`` are replicated, as many as the byte budget holds.
"""

from __future__ import annotations

import numpy as np
import torch

from quiver_serve.features.fap import feature_access_probability


def seed_probability(owner: np.ndarray, part: int, batch_size: int) -> torch.Tensor:
    """``P_0`` of requests naming only nodes of ``part``, uniformly (float32 per node)."""
    owned = owner == part
    count = int(owned.sum())
    p = min(1.0, max(batch_size, 1) / max(count, 1))
    return torch.from_numpy(np.where(owned, np.float32(p), np.float32(0.0)))


def remote_access(indptr: torch.Tensor, indices: torch.Tensor, owner: np.ndarray, part: int,
                  fanouts: list[int], batch_size: int) -> np.ndarray:
    """Per node: ``P_L`` under ``part``'s requests, 0 for the nodes ``part`` owns (float32)."""
    prob = feature_access_probability(indptr, indices, list(fanouts),
                                      seed_probability(owner, part, batch_size)).numpy()
    prob = prob.copy()
    prob[owner == part] = 0.0
    return prob


def top_rows(prob: np.ndarray, max_rows: int) -> np.ndarray:
    """The ids of the ``max_rows`` highest positive entries of ``prob`` (ties: lower id first),
    returned sorted by id (int64) so a lookup is a ``searchsorted``."""
    candidates = np.flatnonzero(prob > 0)
    if max_rows <= 0 or candidates.size == 0:
        return np.empty(0, dtype=np.int64)
    if candidates.size > max_rows:
        # lexsort's last key is the primary one: probability descending, then id ascending
        order = np.lexsort((candidates, -prob[candidates]))
        candidates = candidates[order[:max_rows]]
    return np.sort(candidates).astype(np.int64)


def hot_rows(indptr: torch.Tensor, indices: torch.Tensor, owner: np.ndarray, part: int,
             fanouts: list[int], batch_size: int, max_rows: int) -> tuple[np.ndarray, float]:
    """``(hot ids sorted, expected share of remote row reads they serve)`` for ``part``; the
    share is ``sum P_L`` over the chosen rows over ``sum P_L`` over every remote row (1.0 when
    no remote row is ever read)."""
    if max_rows <= 0:
        return np.empty(0, dtype=np.int64), 0.0
    prob = remote_access(indptr, indices, owner, part, fanouts, batch_size)
    ids = top_rows(prob, max_rows)
    total = float(prob.sum(dtype=np.float64))
    return ids, (float(prob[ids].sum(dtype=np.float64)) / total if total > 0 else 1.0)

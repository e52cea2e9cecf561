"""Feature rows of a typed graph on a GPU (docs/architecture.md, "Feature store" and "Typed
graphs"; decision 0050): one GPU budget across the node types, filled hottest row first.

* FAP per typed row (``typed_access_probability``): the access recursion of ``graph/access.py``
  run over the relations: at hop ``l`` each relation ``(s, r, t)`` expands the nodes of type
  ``t`` added at hop ``l - 1`` (the typed sampler expands each node once), with its own fanout
  and degree, and the chance that a node of type ``s`` is missed is the product over every
  relation into ``s``. A row's score is its FAP averaged over the seed
  types (a batch is of one type; ``seed_types`` are those requests name, each as likely).
* One budget (``plan_typed_placement``): every featured row of every type ranked by its score,
  the hottest first, until ``budget_bytes`` is spent; a type whose rows do not all fit pays its
  location map (8 bytes per node) out of the budget first, as the homogeneous store does.
* Each type's rows are a homogeneous ``FeatureStore`` with that type's share of the placement:
  its gather (the zero-copy kernel on a GPU, the torch twin on a CPU) and hit/miss counts.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from quiver_serve.features.fap import uniform_seed_probability
from quiver_serve.features.placement import LOC_BYTES_PER_NODE, Placement
from quiver_serve.features.store import FeatureStore
from quiver_serve.graph.access import expand_probability, miss_probability
from quiver_serve.graph.typed import EdgeType, TypedGraph

log = logging.getLogger(__name__)


def typed_access_probability(graph: TypedGraph, fanouts: Mapping[EdgeType, list[int]],
                             seed_type: str, batch_size: int) -> dict[str, Tensor]:
    """Per node type: the probability that a batch of ``batch_size`` uniform ``seed_type`` ids
    has each node in its sampled subgraph (float32 per node)."""
    prob = {t: torch.zeros(n, dtype=torch.float32) for t, n in graph.num_nodes.items()}
    prob[seed_type] = uniform_seed_probability(graph.num_nodes[seed_type], batch_size)
    frontier = dict(prob)  # the chance a node is added at the previous hop (expanded now)
    num_layers = len(next(iter(fanouts.values()), []))
    for hop in range(num_layers):
        miss = {t: torch.ones(n, dtype=torch.float32) for t, n in graph.num_nodes.items()}
        for et, rel in graph.relations.items():
            src, _, dst = et
            indptr, indices = rel.indptr.cpu(), rel.indices.cpu()
            draw = frontier[dst] * expand_probability(indptr[1:] - indptr[:-1],
                                                      fanouts[et][hop])
            miss[src] *= miss_probability(indptr, indices, draw, graph.num_nodes[src])
        after = {t: 1.0 - (1.0 - p) * miss[t] for t, p in prob.items()}
        frontier = {t: (after[t] - prob[t]).clamp_(min=0.0) for t in prob}
        prob = after
    return prob


def typed_fap(graph: TypedGraph, fanouts: Mapping[EdgeType, list[int]], seed_types: list[str],
              batch_size: int) -> dict[str, Tensor]:
    """Per featured node type: each row's FAP averaged over ``seed_types``."""
    total = {t: torch.zeros(graph.num_nodes[t], dtype=torch.float32) for t in graph.x}
    for seed_type in seed_types:
        for t, p in typed_access_probability(graph, fanouts, seed_type, batch_size).items():
            if t in total:
                total[t] += p / max(len(seed_types), 1)
    return total


@dataclass
class TypedPlacement:
    """Per featured node type, its rows in GPU memory (hottest first; all of them in id order
    when the type fits whole) and its bytes per row."""

    gpu_nodes: dict[str, Tensor]
    row_bytes: dict[str, int]
    num_nodes: dict[str, int]

    def placement(self, node_type: str) -> Placement:
        """The homogeneous placement of one type's rows (one GPU shard, the rest in place)."""
        return Placement("replicate", self.num_nodes[node_type], self.row_bytes[node_type],
                         [self.gpu_nodes[node_type]])

    def gpu_bytes(self) -> int:
        total = 0
        for t, nodes in self.gpu_nodes.items():
            total += int(nodes.numel()) * self.row_bytes[t]
            if 0 < nodes.numel() < self.num_nodes[t]:
                total += self.num_nodes[t] * LOC_BYTES_PER_NODE
        return total


def plan_typed_placement(scores: Mapping[str, Tensor], row_bytes: Mapping[str, int],
                         budget_bytes: int) -> TypedPlacement:
    """Rows of every type by score, highest first (ties: type order, then id), into
    ``budget_bytes`` (module docstring)."""
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    types = list(scores)
    num_nodes = {t: int(scores[t].numel()) for t in types}
    whole = sum(num_nodes[t] * row_bytes[t] for t in types)
    if whole <= budget_bytes:
        return TypedPlacement({t: torch.arange(num_nodes[t]) for t in types}, dict(row_bytes),
                              num_nodes)
    flat = torch.cat([scores[t].to(torch.float32) for t in types]) if types else torch.zeros(0)
    owner = torch.cat([torch.full((num_nodes[t],), i, dtype=torch.int64)
                       for i, t in enumerate(types)]) if types else torch.zeros(0, torch.int64)
    order = torch.sort(flat, descending=True, stable=True).indices
    cost = torch.tensor([row_bytes[t] for t in types], dtype=torch.int64)[owner[order]]
    # a type with some rows on the GPU needs its map: charge it when its first row is taken
    first_of_type = torch.zeros_like(order, dtype=torch.bool)
    ranked_owner = owner[order]
    for i in range(len(types)):
        hits = (ranked_owner == i).nonzero()
        if hits.numel():
            first_of_type[hits[0, 0]] = True
    maps = torch.tensor([num_nodes[t] * LOC_BYTES_PER_NODE for t in types], dtype=torch.int64)
    cost = cost + first_of_type * maps[ranked_owner]
    taken = int((torch.cumsum(cost, 0) <= budget_bytes).sum())
    hot = order[:taken]
    offsets = torch.cumsum(torch.tensor([0] + [num_nodes[t] for t in types]), 0)
    gpu_nodes = {}
    for i, t in enumerate(types):
        mine = hot[owner[hot] == i] - offsets[i]
        gpu_nodes[t] = torch.arange(num_nodes[t]) if mine.numel() == num_nodes[t] else mine
    return TypedPlacement(gpu_nodes, dict(row_bytes), num_nodes)


class TypedFeatures:
    """Each featured type's ``FeatureStore`` under one ``TypedPlacement``; ``gather`` answers a
    type's rows on the compute device as float32 (what the typed model reads)."""

    def __init__(self, x: Mapping[str, Tensor], device: torch.device, placement: TypedPlacement,
                 dtype: torch.dtype | None = None, shard_device: torch.device | None = None
                 ) -> None:
        shard = shard_device or device
        self.device, self.placement = device, placement
        self.stores = {t: FeatureStore(rows, device, dtype=dtype, shard_devices=[shard],
                                       progress=False) for t, rows in x.items()}
        for t, store in self.stores.items():
            store.place(placement.placement(t))

    def gather(self, node_type: str, ids: Tensor) -> Tensor:
        rows = self.stores[node_type].gather(ids)
        return rows if rows.dtype == torch.float32 else rows.float()

    def counts(self) -> dict[str, tuple[int, int]]:
        """(hits, misses) per node type so far (a host sync on a GPU: off the hot path)."""
        return {t: s.read_counts() for t, s in self.stores.items()}

    def reset_counts(self) -> None:
        for store in self.stores.values():
            store.reset_counts()

    def describe(self) -> dict[str, dict[str, int]]:
        return {t: {"gpu_rows": int(self.placement.gpu_nodes[t].numel()),
                    "rows": self.placement.num_nodes[t]} for t in self.stores}

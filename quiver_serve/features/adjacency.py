"""Adjacency cache for the UVA GPU sampler (DESIGN §4, applied to the graph itself).

Sampling from pinned host memory pays one bus round trip per sampled neighbour. Within
``sampling.gpu_graph_cache_bytes`` this puts in GPU memory: ``indptr`` (every frontier node reads
it), a per-node offset (8 bytes: where the node's list starts in the cached copy, or -1), and the
neighbour lists of the nodes the sampler expands most often per byte: by the access probability
of the §3 recursion at hop ``L-1`` (a node reached there is expanded at hop ``L``) times the
share of its list one expansion reads (``min(k, deg) / deg``). The lists are byte-for-byte the
host's, so sampling with the cache is bit-identical to sampling without it.

:func:`plan_adjacency_cache` and :func:`cached_neighbours` are pure torch (the CPU twin of what
the kernel reads); :func:`build_adjacency_cache` copies the plan to a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from quiver_serve.graph.access import access_probability

#: bytes per node of the cache's fixed part: indptr and the offset
FIXED_BYTES_PER_NODE = 16
NODES_PER_CHUNK = 1 << 20


@dataclass
class AdjacencyCache:
    """What the sampler kernel reads from GPU memory (or, in the twin, from these tensors)."""

    indptr: Tensor  # int64 [N + 1], the graph's own
    offsets: Tensor  # int64 [N]: start of the node's list in ``indices``, -1 = not cached
    indices: Tensor  # int64: the cached lists, packed
    num_cached: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.indptr, self.offsets, self.indices))


def expansion_scores(indptr: Tensor, indices: Tensor, fanouts: list[int],
                     batch_size: int) -> Tensor:
    """Per node: expected neighbour reads from its list per batch, per byte of the list."""
    num_nodes = indptr.numel() - 1
    p0 = torch.full((num_nodes,), min(1.0, batch_size / max(num_nodes, 1)))
    probs = access_probability(indptr, indices, p0, fanouts[:-1]) if len(fanouts) > 1 else [p0]
    expanded = torch.stack(probs[:len(fanouts)]).max(dim=0).values  # expanded at some hop
    deg = (indptr[1:] - indptr[:-1]).to(torch.float32)
    k = max(fanouts)
    read = deg if k < 0 else torch.minimum(deg, torch.tensor(float(k)))
    return expanded * read / deg.clamp(min=1.0)


def plan_adjacency_cache(indptr: Tensor, scores: Tensor, budget_bytes: int) -> Tensor:
    """The nodes whose lists fit the budget, best score first (a prefix of that order); empty
    when the fixed part alone does not fit."""
    num_nodes = indptr.numel() - 1
    room = budget_bytes - FIXED_BYTES_PER_NODE * num_nodes - 16  # indptr's last entry, spare
    if room <= 0:
        return torch.empty(0, dtype=torch.int64)
    deg = indptr[1:] - indptr[:-1]
    order = torch.sort(scores, descending=True, stable=True).indices
    order = order[deg[order] > 0]
    fits = torch.cumsum(deg[order] * 8, 0) <= room
    return order[:int(fits.sum())]


def pack_lists(indptr: Tensor, indices: Tensor, nodes: Tensor) -> tuple[Tensor, Tensor]:
    """(offsets per node, packed lists) of ``nodes``, host tensors."""
    num_nodes = indptr.numel() - 1
    deg = indptr[1:] - indptr[:-1]
    sizes = deg[nodes]
    starts = torch.cumsum(sizes, 0) - sizes
    offsets = torch.full((num_nodes,), -1, dtype=torch.int64)
    offsets[nodes] = starts
    packed = torch.empty(int(sizes.sum()), dtype=torch.int64)
    for lo in range(0, int(nodes.numel()), NODES_PER_CHUNK):
        part, part_sizes = nodes[lo:lo + NODES_PER_CHUNK], sizes[lo:lo + NODES_PER_CHUNK]
        total = int(part_sizes.sum())
        if total == 0:
            continue
        first = int(starts[lo])
        within = torch.arange(total) - torch.repeat_interleave(
            torch.cumsum(part_sizes, 0) - part_sizes, part_sizes, output_size=total)
        src = torch.repeat_interleave(indptr[part], part_sizes, output_size=total) + within
        packed[first:first + total] = indices[src]
    return offsets, packed


def cached_neighbours(cache: AdjacencyCache, host_indices: Tensor, v: int) -> Tensor:
    """The list the kernel reads for ``v``: from the cache when cached, else from the host (the
    twin of ``plan_frontier``/``expand_node``'s choice)."""
    start, end = int(cache.indptr[v]), int(cache.indptr[v + 1])
    off = int(cache.offsets[v])
    if off >= 0:
        return cache.indices[off:off + end - start]
    return host_indices[start:end]


def build_adjacency_cache(indptr: Tensor, indices: Tensor, scores: Tensor, budget_bytes: int,
                          device: torch.device) -> AdjacencyCache | None:
    """The cache on ``device`` within ``budget_bytes`` (None: not even indptr fits)."""
    nodes = plan_adjacency_cache(indptr, scores, budget_bytes)
    if budget_bytes < FIXED_BYTES_PER_NODE * (indptr.numel() - 1) + 16:
        return None
    offsets, packed = pack_lists(indptr, indices, nodes)
    if packed.numel() == 0:
        packed = torch.zeros(1, dtype=torch.int64)  # a valid pointer
    return AdjacencyCache(indptr.to(device), offsets.to(device), packed.to(device),
                          int(nodes.numel()))

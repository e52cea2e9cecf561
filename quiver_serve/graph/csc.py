"""The served graph: CSC adjacency (in-neighbours) and node features, in shared memory or
mapped from a snapshot's files."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class GraphData:
    """A graph in CSC form: the in-neighbours of node ``v`` are ``indices[indptr[v]:indptr[v+1]]``.

    That is the orientation of PyG's ``NeighborLoader``: an ``edge_index`` column ``(u, v)`` is an
    edge u→v, and u is sampled as a neighbour of v. Neighbours of each node are sorted by id.
    """

    name: str
    indptr: Tensor  # int64 [num_nodes + 1]
    indices: Tensor  # int64 [num_edges], source node ids
    x: Tensor  # float32 [num_nodes, num_features]
    y: Tensor | None = None  # labels, when the dataset has them
    #: the update-log folder whose base in force these tensors map read-only (None: in memory);
    #: processes are handed the folder, not the tensors (``graph/living.py``: ``MappedGraph``)
    mapped_from: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.indptr.dtype != torch.int64 or self.indices.dtype != torch.int64:
            raise TypeError("indptr and indices must be int64")
        if self.indptr.dim() != 1 or self.indptr.numel() < 1:
            raise ValueError("indptr must be a 1-D tensor of num_nodes + 1 entries")
        if int(self.indptr[-1]) != self.indices.numel():
            raise ValueError(
                f"indptr[-1]={int(self.indptr[-1])} but there are {self.indices.numel()} indices"
            )
        if self.x.dim() != 2 or self.x.size(0) != self.num_nodes:
            raise ValueError(f"x must be [num_nodes={self.num_nodes}, F], got {tuple(self.x.shape)}")

    @property
    def num_nodes(self) -> int:
        return self.indptr.numel() - 1

    @property
    def num_edges(self) -> int:
        return self.indices.numel()

    @property
    def num_features(self) -> int:
        return self.x.size(1)

    def degree(self) -> Tensor:
        """In-degree of every node (int64)."""
        return self.indptr[1:] - self.indptr[:-1]

    def self_loop_count(self, edges_per_chunk: int = 1 << 24) -> Tensor:
        """Number of self loops (edges v→v, duplicates counted) of every node (int64).

        GCN's exact mode needs it: PyG's ``gcn_norm`` replaces a node's loops by exactly one.
        Chunked over nodes so the temporary target ids stay near ``edges_per_chunk`` entries
        (8 bytes each) whatever the graph's size.
        """
        counts = torch.zeros(self.num_nodes, dtype=torch.int64)
        lo = 0
        while lo < self.num_nodes:
            # Last node whose edges end within the budget; at least one node per chunk.
            limit = torch.tensor([int(self.indptr[lo]) + edges_per_chunk])
            hi = max(lo + 1, min(self.num_nodes, int(torch.searchsorted(self.indptr, limit,
                                                                         right=True)) - 1))
            dst = torch.repeat_interleave(torch.arange(lo, hi), self.indptr[lo + 1:hi + 1]
                                          - self.indptr[lo:hi])
            src = self.indices[int(self.indptr[lo]):int(self.indptr[hi])]
            counts[lo:hi] = torch.bincount(dst[src == dst] - lo, minlength=hi - lo)
            lo = hi
        return counts

    @classmethod
    def from_edge_index(
        cls, edge_index: Tensor, x: Tensor, name: str, y: Tensor | None = None
    ) -> GraphData:
        """Build the CSC from a PyG ``edge_index`` (row 0 sources, row 1 targets)."""
        num_nodes = x.size(0)
        edge_index = edge_index.to(torch.int64)
        if edge_index.numel() and (edge_index.min() < 0 or edge_index.max() >= num_nodes):
            raise ValueError(f"edge_index refers to nodes outside [0, {num_nodes})")
        src, dst = edge_index[0], edge_index[1]
        # Sort by (target, source) so every node's neighbour list is ordered by id.
        order = torch.argsort(dst * num_nodes + src) if num_nodes < 3_037_000_499 else _lexsort(dst, src)
        indices = src[order].contiguous()
        counts = torch.bincount(dst, minlength=num_nodes)
        indptr = torch.zeros(num_nodes + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=indptr[1:])
        return cls(name=name, indptr=indptr, indices=indices, x=x.to(torch.float32).contiguous(), y=y)

    def edge_index(self) -> Tensor:
        """The PyG ``edge_index`` [2, E] (sources, targets) of this graph."""
        dst = torch.repeat_interleave(torch.arange(self.num_nodes), self.degree())
        return torch.stack([self.indices, dst])

    def share_memory_(self) -> GraphData:
        """Move every tensor to shared memory so spawned workers map it instead of copying
        (a mapped graph is shared through the page cache already: left as it is)."""
        if self.mapped_from is not None:
            return self
        for t in (self.indptr, self.indices, self.x, self.y):
            if t is not None:
                t.share_memory_()
        return self

    def describe(self) -> str:
        return (
            f"{self.name}: {self.num_nodes:,} nodes, {self.num_edges:,} edges, "
            f"{self.num_features} features"
        )


def _lexsort(primary: Tensor, secondary: Tensor) -> Tensor:
    """Stable two-key sort for graphs whose ``dst * N + src`` would overflow int64."""
    order = torch.argsort(secondary, stable=True)
    return order[torch.argsort(primary[order], stable=True)]

"""In- and out-neighbourhoods of node sets on the current graph, vectorised in torch on any device.

The exact table (docs/architecture.md, "The exact table") computes a layer's rows for a set of
target nodes from their in-edges, and marks what an update can change by following out-edges. Both
read the graph as it is now: an immutable base CSC plus the living graph's overlay
(``overlay_view.py``), on whatever device holds them, so one code path serves a GPU (the sampler's
device CSC and device overlay) and a CPU (the shared-memory CSC and the host overlay).

* :class:`CurrentGraph`: in-degrees and in-edges (``counts``, sources) of a node set, in list
  order (base list unless replaced, then the tail).
* :class:`OutIndex`: out-neighbours of a node set, for dirty marking. A transposed CSC built from
  the graph once, plus a log of edges added since; removed edges stay in it, so what it returns is
  a superset of the true out-neighbours (marking a row more is safe, missing one is not). When the
  log is full it is rebuilt from the current graph.

Every index read from the overlay is clamped into its array: another stream may be writing a
node's list while this one reads it, and such a node is re-marked by the update that wrote it,
so its values may be wrong but must never be read out of bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from quiver_serve.graph.overlay_view import LENGTH_MASK, REPLACED, OverlayView, cut_of

#: above this fraction of the nodes, "every node" is cheaper to mark than the set's out-lists
ALL_NODES_FRACTION = 0.125


def segment_positions(starts: Tensor, counts: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """For segments ``[starts[i], starts[i] + counts[i])``: every position, and its segment."""
    owner = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts,
                                    output_size=total)
    offsets = torch.cumsum(counts, 0) - counts
    return starts.index_select(0, owner) + torch.arange(total, device=counts.device) \
        - offsets.index_select(0, owner), owner


def split_by_edges(targets: Tensor, degree: Tensor, max_edges: int,
                   max_rows: int) -> list[Tensor]:
    """``targets`` in order, in chunks of at most ``max_edges`` in-edges (``degree``: each
    one's in-degree; a node with more is a chunk of its own) and ``max_rows`` nodes."""
    if targets.numel() == 0:
        return []
    cum = torch.cumsum(degree, 0).cpu().numpy()
    n, cuts, prev = len(cum), [], 0
    while prev < n:
        reached = int(cum[prev - 1]) if prev else 0
        nxt = int(np.searchsorted(cum, reached + max_edges, side="right"))
        prev = min(max(nxt, prev + 1), prev + max_rows, n)
        cuts.append(prev)
    return list(torch.tensor_split(targets, cuts[:-1]))


@dataclass
class CurrentGraph:
    """The base CSC and the overlay view (None: no edge changed since the base), on one device."""

    indptr: Tensor  # int64 [n_base + 1]
    indices: Tensor  # int64 or int32 [E]
    view: OverlayView | None
    num_nodes: int

    @property
    def device(self) -> torch.device:
        return self.indptr.device

    @property
    def n_base(self) -> int:
        return int(self.indptr.numel()) - 1

    def _parts(self, nodes: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(base start, counted base entries, tail start, tail length) of each node."""
        in_base = nodes < self.n_base
        b = nodes.clamp(max=max(self.n_base - 1, 0))
        if self.n_base > 0:
            start = self.indptr.index_select(0, b)
            base = torch.where(in_base, self.indptr.index_select(0, b + 1) - start, 0)
        else:
            start = base = torch.zeros_like(nodes)
        if self.view is None:
            zeros = torch.zeros_like(nodes)
            return start, base, zeros, zeros
        cap = self.view.node_capacity
        safe = nodes.clamp(max=cap - 1)
        raw = self.view.length.index_select(0, safe)
        cut = torch.where(in_base & ((raw & REPLACED) == 0), cut_of(raw), 0)
        base = torch.where((raw & REPLACED) != 0, 0, base - cut)
        t_start = self.view.start.index_select(0, safe)
        t_len = torch.where(t_start >= 0, raw & LENGTH_MASK, 0)
        t_start = torch.where(t_start >= 0, t_start + 2 * cut, t_start)
        arena = int(self.view.tail.numel())
        t_start = t_start.clamp(0, arena)
        t_len = torch.minimum(t_len, arena - t_start)
        return start, base, t_start, t_len

    def in_degree(self, nodes: Tensor) -> Tensor:
        _, base, _, tail = self._parts(nodes)
        return base + tail

    def in_edges(self, nodes: Tensor) -> tuple[Tensor, Tensor]:
        """(in-degree of each node, their in-neighbours concatenated in list order), int64."""
        start, base, t_start, t_len = self._parts(nodes)
        counts = base + t_len
        total = int(counts.sum())
        out = torch.empty(total, dtype=torch.int64, device=self.device)
        if total == 0:
            return counts, out
        n_base_edges = int(base.sum())
        node_off = torch.cumsum(counts, 0) - counts
        if n_base_edges:
            pos, owner = segment_positions(start, base, n_base_edges)
            dest = pos - start.index_select(0, owner) + node_off.index_select(0, owner)
            out.index_copy_(0, dest, self.indices.index_select(0, pos).to(torch.int64))
        if total > n_base_edges:
            assert self.view is not None
            pos, owner = segment_positions(t_start, t_len, total - n_base_edges)
            dest = pos - t_start.index_select(0, owner) + node_off.index_select(0, owner) \
                + base.index_select(0, owner)
            out.index_copy_(0, dest, self.view.tail.index_select(0, pos))
        if self.view is not None:
            self._overrides(nodes, base, node_off, out)
        return counts, out.clamp_(0, max(self.num_nodes - 1, 0))

    def _overrides(self, nodes: Tensor, base: Tensor, node_off: Tensor, out: Tensor) -> None:
        """Write the live override pairs of nodes with a cut over their base entries in
        ``out`` (laid out per node at ``node_off``; ``graph/overlay_view.py``)."""
        assert self.view is not None
        safe = nodes.clamp(max=self.view.node_capacity - 1)
        cut = torch.where(base > 0, cut_of(self.view.length.index_select(0, safe)), 0)
        total = int(cut.sum())
        if total == 0:
            return
        first = self.view.start.index_select(0, safe)
        pos, owner = segment_positions(first, 2 * cut, 2 * total)
        flat = self.view.tail.index_select(0, pos)
        owner, at, val = owner[0::2], flat[0::2], flat[1::2]
        live = at < base.index_select(0, owner)
        out.index_copy_(0, node_off.index_select(0, owner[live]) + at[live], val[live])

    def edge_list(self, chunk_nodes: int = 1 << 20) -> tuple[Tensor, Tensor]:
        """Every current edge as (sources, targets), int64."""
        srcs, dsts = [], []
        for lo in range(0, self.num_nodes, chunk_nodes):
            nodes = torch.arange(lo, min(lo + chunk_nodes, self.num_nodes), device=self.device)
            counts, src = self.in_edges(nodes)
            srcs.append(src)
            dsts.append(torch.repeat_interleave(nodes, counts, output_size=src.numel()))
        if not srcs:
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            return empty, empty
        return torch.cat(srcs), torch.cat(dsts)


class OutIndex:
    """Out-neighbours of node sets (a superset; see the module docstring)."""

    def __init__(self, graph: CurrentGraph, capacity_nodes: int, log_capacity: int) -> None:
        self.capacity_nodes = capacity_nodes
        self.log_capacity = max(int(log_capacity), 1)
        self.device = graph.device
        self.log_src = torch.empty(self.log_capacity, dtype=torch.int64, device=self.device)
        self.log_dst = torch.empty(self.log_capacity, dtype=torch.int64, device=self.device)
        self.rebuild(graph)

    def rebuild(self, graph: CurrentGraph) -> None:
        """Transpose the current graph (the log starts empty again)."""
        src, dst = graph.edge_list()
        order = torch.argsort(src, stable=True)
        counts = torch.bincount(src, minlength=self.capacity_nodes)[:self.capacity_nodes]
        self.ptr = torch.zeros(self.capacity_nodes + 1, dtype=torch.int64, device=self.device)
        torch.cumsum(counts, 0, out=self.ptr[1:])
        small = self.capacity_nodes < 2 ** 31
        self.targets = dst.index_select(0, order).to(torch.int32 if small else torch.int64)
        self.logged = 0

    def add_edges(self, src: Tensor, dst: Tensor, graph: CurrentGraph) -> None:
        """Edges added to the graph (already applied to ``graph``)."""
        n = int(src.numel())
        if self.logged + n > self.log_capacity:
            self.rebuild(graph)  # the graph already holds them
            return
        self.log_src[self.logged:self.logged + n] = src.to(self.device)
        self.log_dst[self.logged:self.logged + n] = dst.to(self.device)
        self.logged += n

    def reach(self, mask: Tensor) -> Tensor:
        """bool [capacity]: nodes with an in-edge from a node of ``mask`` (bool [capacity])."""
        ids = torch.nonzero(mask).flatten()
        out = torch.zeros_like(mask)
        if ids.numel() == 0:
            return out
        if ids.numel() > ALL_NODES_FRACTION * self.capacity_nodes:
            return torch.ones_like(mask)
        starts = self.ptr.index_select(0, ids)
        counts = self.ptr.index_select(0, ids + 1) - starts
        total = int(counts.sum())
        if total:
            pos, _ = segment_positions(starts, counts, total)
            out[self.targets.index_select(0, pos).to(torch.int64)] = True
        if self.logged:
            hit = mask.index_select(0, self.log_src[:self.logged])
            out[self.log_dst[:self.logged][hit]] = True
        return out

"""Pure-torch reference sampler: vectorised over the frontier, no Python loop per node.

It defines the semantics the compiled samplers must reproduce bit for bit (see ``base``), and it
is the fallback wherever no compiler or GPU is present. With an overlay, a node's list is read in
two parts (:func:`node_lists`: base range, then tail range) and a hop's draws are offsets into
their concatenation; a draw into a base list with a cut reads its override pair where one names
the place (``graph/overlay_view.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from quiver_serve.graph.overlay_view import LENGTH_MASK, REPLACED, OverlayView, cut_of
from quiver_serve.sampling.base import (
    BaseSampler,
    SamplerOutput,
    check_seed_range,
    draw32,
    node_hash,
    seed_base,
)


def unique_first(values: Tensor) -> tuple[Tensor, Tensor]:
    """Unique values in order of first occurrence, and each input's index into them (on the
    device of ``values``)."""
    dev = values.device
    if values.numel() == 0:
        return values.clone(), torch.empty(0, dtype=torch.int64, device=dev)
    uniq, inverse = torch.unique(values, return_inverse=True)
    first = torch.full((uniq.numel(),), values.numel(), dtype=torch.int64, device=dev)
    first.scatter_reduce_(0, inverse, torch.arange(values.numel(), device=dev), reduce="amin")
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=dev)
    return uniq[order], rank[inverse]


#: draws held at once by ``floyd_select`` (rows x k), so a hop over every node of a large graph
#: (the PSGS tables) draws in chunks instead of materialising all its draws
FLOYD_CHUNK_DRAWS = 1 << 22


def floyd_select(degree: Tensor, k: int, node_h: Tensor) -> Tensor:
    """Floyd's k-of-d sampling for nodes with ``degree > k``: local offsets [P, k], draw order.
    Every random number is drawn up front ([P, k] at once); only the collision check, which
    depends on the draws before it, runs draw by draw (a fifth of the operations of drawing
    in that loop: on a small frontier the cost is their count)."""
    num = degree.numel()
    chosen = torch.empty((num, k), dtype=torch.int64, device=degree.device)
    rows = max(1, FLOYD_CHUNK_DRAWS // max(k, 1))
    draws = torch.arange(k, device=degree.device)
    for lo in range(0, num, rows):
        hi = min(num, lo + rows)
        top = degree[lo:hi].unsqueeze(1) - k + draws  # [rows, k]: the last offset of each draw
        j = (draw32(node_h[lo:hi].unsqueeze(1), draws) * (top + 1)) >> 32
        out = chosen[lo:hi]
        out.copy_(j)
        for i in range(1, k):  # a draw already taken takes its range's top instead
            taken = (out[:, :i] == j[:, i:i + 1]).any(dim=1)
            out[:, i] = torch.where(taken, top[:, i], j[:, i])
    return chosen


def sample_hop(
    indptr: Tensor, indices: Tensor, frontier: Tensor, k: int, hop: int, base: int,
    overlay: OverlayView | None = None, hash_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Sample one hop: (global neighbour ids, frontier position of each), in frontier order.

    Runs on the device of its tensors (the PSGS tables sample every node at once on a GPU).
    ``hash_ids``: the ids the draws hash, when ``frontier`` holds rows of a partition's CSC
    rather than global ids (a partition server samples the rows it owns by their global ids,
    so its draws are the whole graph's; docs/architecture.md, "Partitioned serving")."""
    edge_pos, count = hop_edge_positions(indptr, frontier, k, hop, base, overlay, hash_ids)
    owner = torch.repeat_interleave(torch.arange(frontier.numel(), device=frontier.device), count)
    return read_positions(indices, edge_pos, overlay), owner


def read_positions(indices: Tensor, edge_pos: Tensor, overlay: OverlayView | None) -> Tensor:
    """The entries at ``edge_pos`` (:func:`hop_edge_positions`' encoding: ``indices`` below
    ``len(indices)``, the overlay's tail above)."""
    if overlay is None:
        return indices[edge_pos]
    num_indices = indices.numel()
    in_base = edge_pos < num_indices
    out = torch.empty_like(edge_pos)
    out[in_base] = indices[edge_pos[in_base]]
    out[~in_base] = overlay.tail[edge_pos[~in_base] - num_indices]
    return out


def node_lists(
    indptr: Tensor, frontier: Tensor, overlay: OverlayView | None
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """Per frontier node: (base start, base count, tail start, tail count); the tail parts are
    None without an overlay. A node with no counted base list (added since the base, or
    replaced) has base count 0, and ``indptr`` is never indexed with its id."""
    if overlay is None:
        start = indptr[frontier]
        return start, indptr[frontier + 1] - start, None, None
    n_base = overlay.n_base
    raw_length = overlay.length[frontier]
    has_base = (frontier < n_base) & ((raw_length & REPLACED) == 0)
    zero = torch.zeros_like(frontier)
    cut = torch.where(has_base, cut_of(raw_length), zero)  # only a counted base list has one
    if n_base > 0:
        v = torch.where(has_base, frontier, zero)
        start = torch.where(has_base, indptr[v], zero)
        base_count = torch.where(has_base, indptr[v + 1] - indptr[v] - cut, zero)
    else:
        start, base_count = zero, zero
    tail_start = overlay.start[frontier]
    has_tail = tail_start >= 0
    tail_count = torch.where(has_tail, raw_length & LENGTH_MASK, zero)
    return start, base_count, torch.where(has_tail, tail_start + 2 * cut, zero), tail_count


def _override_positions(overlay: OverlayView, frontier: Tensor, node: Tensor, local: Tensor,
                        split: Tensor, edge_pos: Tensor, num_indices: int) -> Tensor:
    """``edge_pos`` with each base read of a node with a cut moved to its override pair's value
    when a pair names its place (a binary search over the node's pairs, by position)."""
    cut = cut_of(overlay.length[frontier])[node]
    pick = ((local < split) & (cut > 0)).nonzero().flatten()  # split > 0: a counted base list
    if pick.numel() == 0:
        return edge_pos
    first, n, target = overlay.start[frontier][node[pick]], cut[pick], local[pick]
    lo, hi = torch.zeros_like(n), n.clone()
    for _ in range(int(n.max()).bit_length()):
        mid = (lo + hi) // 2
        below = (lo < hi) & (overlay.tail[first + 2 * torch.minimum(mid, n - 1)] < target)
        hi = torch.where((lo < hi) & ~below, mid, hi)
        lo = torch.where(below, mid + 1, lo)
    at = first + 2 * torch.minimum(lo, n - 1)
    found = (lo < n) & (overlay.tail[at] == target)
    out = edge_pos.clone()
    out[pick[found]] = num_indices + at[found] + 1
    return out


def hop_edge_positions(
    indptr: Tensor, frontier: Tensor, k: int, hop: int, base: int,
    overlay: OverlayView | None = None, hash_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The CSC positions (into ``indices``) one hop reads, in frontier order, and how many per
    frontier node: exactly the neighbour reads of every sampler (the adjacency cache's read
    model counts them, ``sampling/graph_cache/reads.py``). With an overlay, entry ``p`` of
    its tail is position ``len(indices) + p`` (``len(indices) == indptr[-1]``). ``hash_ids``
    (default ``frontier``): the node ids the draws hash, one per frontier entry."""
    start, base_count, tail_start, tail_count = node_lists(indptr, frontier, overlay)
    degree = base_count if tail_count is None else base_count + tail_count
    count = degree if k < 0 else torch.clamp(degree, max=k)
    node, local = _drawn_offsets(frontier if hash_ids is None else hash_ids, degree, count, k,
                                 hop, base)
    edge_pos = start[node] + local
    if tail_start is not None:
        split = base_count[node]
        in_tail = local >= split
        tail_pos = int(indptr[-1]) + tail_start[node] + local - split
        edge_pos = torch.where(in_tail, tail_pos, edge_pos)
        assert overlay is not None
        edge_pos = _override_positions(overlay, frontier, node, local, split, edge_pos,
                                       int(indptr[-1]))
    return edge_pos, count


def _drawn_offsets(
    frontier: Tensor, degree: Tensor, count: Tensor, k: int, hop: int, base: int
) -> tuple[Tensor, Tensor]:
    """Every read of one hop in output order: (frontier index of its node, offset into that
    node's list). A whole list in list order when ``k < 0`` or ``degree <= k``, else Floyd's
    draws in draw order."""
    dev = frontier.device
    total = int(count.sum())
    out_offset = torch.cumsum(count, 0) - count
    node = torch.empty(total, dtype=torch.int64, device=dev)
    local = torch.empty(total, dtype=torch.int64, device=dev)

    full = torch.ones_like(degree, dtype=torch.bool) if k < 0 else degree <= k
    full_idx = full.nonzero().flatten()
    if full_idx.numel():
        cnt = count[full_idx]
        owner = torch.repeat_interleave(full_idx, cnt)
        within = torch.arange(int(cnt.sum()), device=dev) - torch.repeat_interleave(
            torch.cumsum(cnt, 0) - cnt, cnt)
        slots = out_offset[owner] + within
        node[slots] = owner
        local[slots] = within

    part_idx = (~full).nonzero().flatten()
    if part_idx.numel():
        chosen = floyd_select(degree[part_idx], k, node_hash(base, hop, frontier[part_idx]))
        slots = (out_offset[part_idx].unsqueeze(1) + torch.arange(k, device=dev)).flatten()
        node[slots] = part_idx.repeat_interleave(k)
        local[slots] = chosen.flatten()
    return node, local


class SubgraphBuilder:
    """The sampled subgraph of one batch as its hops arrive (the ``n_id`` order, local ids and
    per-hop counts of ``base``'s semantics), whoever draws the hops: the reference sampler here,
    or the partition servers of a partitioned deployment (``scaleout/partitioned/sampling.py``)."""

    def __init__(self, seeds: Tensor) -> None:
        self.n_id, self.seed_index = unique_first(seeds.to(torch.int64))
        self._known_sorted, self._known_local = torch.sort(self.n_id)
        self._frontier_local = torch.arange(self.n_id.numel())
        self._rows: list[Tensor] = []
        self._cols: list[Tensor] = []
        self.num_nodes = [int(self.n_id.numel())]
        self.num_edges: list[int] = []

    @property
    def frontier(self) -> Tensor:
        """Global ids of the nodes the next hop expands (those the last hop added)."""
        return self.n_id[self._frontier_local]

    def add_hop(self, nbr: Tensor, owner: Tensor) -> None:
        """A hop's drawn neighbours (global ids, in frontier order) and each one's frontier
        position: new nodes appended in order of first occurrence."""
        known_sorted, known_local = self._known_sorted, self._known_local
        local = torch.empty_like(nbr)
        pos = torch.searchsorted(known_sorted, nbr).clamp_(max=max(known_sorted.numel() - 1, 0))
        found = known_sorted[pos] == nbr if known_sorted.numel() else torch.zeros_like(nbr, dtype=torch.bool)
        local[found] = known_local[pos[found]]
        new_nodes, new_rank = unique_first(nbr[~found])
        first_new = self.n_id.numel()
        local[~found] = first_new + new_rank
        self._rows.append(local)
        self._cols.append(self._frontier_local[owner])
        self.n_id = torch.cat([self.n_id, new_nodes])
        self._frontier_local = torch.arange(first_new, self.n_id.numel())
        self._known_sorted, order = torch.sort(torch.cat([known_sorted, new_nodes]))
        self._known_local = torch.cat([known_local, self._frontier_local])[order]
        self.num_nodes.append(int(new_nodes.numel()))
        self.num_edges.append(int(nbr.numel()))

    def output(self) -> SamplerOutput:
        edge_index = torch.stack([torch.cat(self._rows), torch.cat(self._cols)]) if self._rows \
            else torch.empty((2, 0), dtype=torch.int64)
        return SamplerOutput(self.n_id, edge_index, self.seed_index, self.num_nodes,
                             self.num_edges)


class ReferenceSampler(BaseSampler):
    """Neighbour sampling (docs/architecture.md, "Sampling") in plain vectorised torch."""

    name = "reference"

    def sample(self, seeds: Tensor, fanouts: list[int], seed: int) -> SamplerOutput:
        base = seed_base(seed)
        seeds = seeds.to(torch.int64)
        check_seed_range(seeds, self.num_nodes)
        sub = SubgraphBuilder(seeds)
        for hop, k in enumerate(fanouts, start=1):
            sub.add_hop(*sample_hop(self.indptr, self.indices, sub.frontier, k, hop, base,
                                    self.overlay))
        return sub.output()

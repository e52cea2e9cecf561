"""Pure-torch reference sampler: vectorised over the frontier, no Python loop per node.

It defines the semantics the compiled samplers must reproduce bit for bit (see ``base``), and it
is the fallback wherever no compiler or GPU is present.
"""

from __future__ import annotations

import torch
from torch import Tensor

from quiver_serve.sampling.base import (
    BaseSampler,
    SamplerOutput,
    draw32,
    node_hash,
    seed_base,
)


def unique_first(values: Tensor) -> tuple[Tensor, Tensor]:
    """Unique values in order of first occurrence, and each input's index into them."""
    if values.numel() == 0:
        return values.clone(), torch.empty(0, dtype=torch.int64)
    uniq, inverse = torch.unique(values, return_inverse=True)
    first = torch.full((uniq.numel(),), values.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(values.numel()), reduce="amin")
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    return uniq[order], rank[inverse]


def floyd_select(degree: Tensor, k: int, node_h: Tensor) -> Tensor:
    """Floyd's k-of-d sampling for nodes with ``degree > k``: local offsets [P, k], draw order."""
    num = degree.numel()
    chosen = torch.empty((num, k), dtype=torch.int64, device=degree.device)
    for i in range(k):  # loop over draws, vectorised over nodes
        t = degree - k + i
        j = (draw32(node_h, i) * (t + 1)) >> 32
        if i:
            taken = (chosen[:, :i] == j.unsqueeze(1)).any(dim=1)
            j = torch.where(taken, t, j)
        chosen[:, i] = j
    return chosen


def sample_hop(
    indptr: Tensor, indices: Tensor, frontier: Tensor, k: int, hop: int, base: int
) -> tuple[Tensor, Tensor]:
    """Sample one hop: (global neighbour ids, frontier position of each), in frontier order.

    Runs on the device of its tensors (the PSGS tables sample every node at once on a GPU)."""
    edge_pos, count = hop_edge_positions(indptr, frontier, k, hop, base)
    owner = torch.repeat_interleave(torch.arange(frontier.numel(), device=frontier.device), count)
    return indices[edge_pos], owner


def hop_edge_positions(
    indptr: Tensor, frontier: Tensor, k: int, hop: int, base: int
) -> tuple[Tensor, Tensor]:
    """The CSC positions (into ``indices``) one hop reads, in frontier order, and how many per
    frontier node: exactly the neighbour reads of every sampler (the adjacency cache's read
    model counts them, ``sampling/graph_cache/reads.py``)."""
    dev = frontier.device
    start = indptr[frontier]
    degree = indptr[frontier + 1] - start
    count = degree if k < 0 else torch.clamp(degree, max=k)
    total = int(count.sum())
    out_offset = torch.cumsum(count, 0) - count
    edge_pos = torch.empty(total, dtype=torch.int64, device=dev)

    full = torch.ones_like(degree, dtype=torch.bool) if k < 0 else degree <= k
    full_idx = full.nonzero().flatten()
    if full_idx.numel():
        cnt = count[full_idx]
        rep_start = torch.repeat_interleave(start[full_idx], cnt)
        rep_out = torch.repeat_interleave(out_offset[full_idx], cnt)
        within = torch.arange(int(cnt.sum()), device=dev) - torch.repeat_interleave(
            torch.cumsum(cnt, 0) - cnt, cnt)
        edge_pos[rep_out + within] = rep_start + within

    part_idx = (~full).nonzero().flatten()
    if part_idx.numel():
        chosen = floyd_select(degree[part_idx], k, node_hash(base, hop, frontier[part_idx]))
        slots = out_offset[part_idx].unsqueeze(1) + torch.arange(k, device=dev)
        edge_pos[slots.flatten()] = (start[part_idx].unsqueeze(1) + chosen).flatten()
    return edge_pos, count


class ReferenceSampler(BaseSampler):
    """DESIGN §2 neighbour sampling in plain vectorised torch."""

    name = "reference"

    def sample(self, seeds: Tensor, fanouts: list[int], seed: int) -> SamplerOutput:
        base = seed_base(seed)
        n_id, seed_index = unique_first(seeds.to(torch.int64))
        known_sorted, known_local = torch.sort(n_id)
        frontier_local = torch.arange(n_id.numel())
        rows: list[Tensor] = []
        cols: list[Tensor] = []
        num_nodes = [n_id.numel()]
        num_edges: list[int] = []
        for hop, k in enumerate(fanouts, start=1):
            nbr, owner = sample_hop(self.indptr, self.indices, n_id[frontier_local], k, hop, base)
            local = torch.empty_like(nbr)
            pos = torch.searchsorted(known_sorted, nbr).clamp_(max=max(known_sorted.numel() - 1, 0))
            found = known_sorted[pos] == nbr if known_sorted.numel() else torch.zeros_like(nbr, dtype=torch.bool)
            local[found] = known_local[pos[found]]
            new_nodes, new_rank = unique_first(nbr[~found])
            first_new = n_id.numel()
            local[~found] = first_new + new_rank
            rows.append(local)
            cols.append(frontier_local[owner])
            n_id = torch.cat([n_id, new_nodes])
            frontier_local = torch.arange(first_new, n_id.numel())
            known_sorted, order = torch.sort(torch.cat([known_sorted, new_nodes]))
            known_local = torch.cat([known_local, frontier_local])[order]
            num_nodes.append(new_nodes.numel())
            num_edges.append(nbr.numel())
        edge_index = torch.stack([torch.cat(rows), torch.cat(cols)]) if rows else torch.empty(
            (2, 0), dtype=torch.int64
        )
        return SamplerOutput(n_id, edge_index, seed_index, num_nodes, num_edges)

"""What the UVA sampler kernel reads over the bus, with and without an adjacency cache (CPU twin).

The kernel (``csrc/gpu_sampler.cu``) expands each frontier node with one warp: it reads the
node's CSC range from ``indptr`` (two neighbouring int64 words) and then, in one warp load
instruction per 32 draws, the sampled entries of its neighbour list. Loads of one instruction
that fall into the same 32-byte sector are merged by the memory system, so from pinned host
memory a node costs one bus request per distinct sector it touches, not one per entry: a list of
``deg <= k`` int64 entries costs ``ceil(deg / 4)`` requests, ``k`` draws from a long list about
``k``. UVA sampling is bound by that request count (PCIe read requests), not by latency
(docs/decisions/0008-elias-fano-adjacency-cache.md), so the share of requests the cache absorbs
predicts the share of the UVA excess over device-resident sampling it removes.

:func:`trace_reads` replays a batch exactly (the reference sampler's frontier per hop and
:func:`~quiver_serve.sampling.reference.hop_edge_positions`, the same draws as the kernel) and
counts, per hop, the neighbour reads, bus sectors, ``indptr`` reads and lists the cache serves.
"""

from __future__ import annotations

import torch
from torch import Tensor

from quiver_serve.sampling.base import seed_base
from quiver_serve.sampling.reference import ReferenceSampler, hop_edge_positions

#: bytes of one memory transaction of the GPU's load path (an L2 sector)
SECTOR_BYTES = 32
#: bytes per entry of the host CSC the UVA kernel reads (int64)
HOST_INDEX_BYTES = 8

COUNTERS = ("lists", "lists_cached", "reads", "reads_cached", "sectors", "sectors_cached",
            "indptr_reads", "indptr_reads_cached")


def node_sectors(edge_pos: Tensor, count: Tensor, index_bytes: int = HOST_INDEX_BYTES) -> Tensor:
    """Per frontier node: distinct ``SECTOR_BYTES`` sectors its reads touch (``edge_pos`` are
    entry positions in an array of ``index_bytes``-wide entries, grouped by node as ``count``)."""
    owner = torch.repeat_interleave(torch.arange(count.numel()), count)
    sector = edge_pos * index_bytes // SECTOR_BYTES
    key = torch.unique(owner * (int(sector.max()) + 1 if sector.numel() else 1) + sector)
    per_node = torch.zeros(count.numel(), dtype=torch.int64)
    if key.numel():
        width = int(sector.max()) + 1
        per_node.scatter_add_(0, key // width, torch.ones_like(key))
    return per_node


def trace_reads(indptr: Tensor, indices: Tensor, seeds: Tensor, fanouts: list[int], seed: int,
                cached: Tensor | None) -> list[dict[str, int]]:
    """Per hop, the kernel's reads of one batch and how many of them a cache serves.

    ``cached``: bool per node, True where the node's list is in the cache (None: no cache, then
    ``indptr`` is read over the bus too; with a cache it is always on the GPU). Keys:
    ``COUNTERS`` (``sectors``: host sectors without the cache; ``sectors_cached``: of those,
    the ones the cache absorbs)."""
    out = ReferenceSampler(indptr, indices).sample(seeds, fanouts, seed)
    base = seed_base(seed)
    hops: list[dict[str, int]] = []
    lo = 0
    for hop, k in enumerate(fanouts, start=1):
        hi = lo + out.num_sampled_nodes[hop - 1]
        frontier = out.n_id[lo:hi]
        edge_pos, count = hop_edge_positions(indptr, frontier, k, hop, base)
        sectors = node_sectors(edge_pos, count)
        hit = cached[frontier] if cached is not None else torch.zeros_like(frontier, dtype=torch.bool)
        n = int(frontier.numel())
        hops.append({
            "lists": n, "lists_cached": int(hit.sum()),
            "reads": int(count.sum()), "reads_cached": int(count[hit].sum()),
            "sectors": int(sectors.sum()), "sectors_cached": int(sectors[hit].sum()),
            "indptr_reads": 2 * n, "indptr_reads_cached": 2 * n if cached is not None else 0,
        })
        lo = hi
    return hops


def served_shares(indptr: Tensor, indices: Tensor, batches: list[Tensor], fanouts: list[int],
                  cached: Tensor | None) -> dict[str, float]:
    """Over ``batches`` (seed tensors, sampled with seeds 0, 1, ...): totals of the counters and
    the share of lists, reads, sectors and indptr reads the cache serves; ``hop_sector_share``
    is each hop's share of all host sectors."""
    totals = dict.fromkeys(COUNTERS, 0)
    per_hop = [0] * len(fanouts)
    for i, seeds in enumerate(batches):
        for h, counts in enumerate(trace_reads(indptr, indices, seeds, fanouts, i, cached)):
            for key in COUNTERS:
                totals[key] += counts[key]
            per_hop[h] += counts["sectors"]
    shares = {f"{what}_served": totals[f"{what}_cached"] / max(totals[what], 1)
              for what in ("lists", "reads", "sectors", "indptr_reads")}
    hop_share = [s / max(sum(per_hop), 1) for s in per_hop]
    return {**{k: float(v) for k, v in totals.items()}, **shares, "hop_sector_share": hop_share}

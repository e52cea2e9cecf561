"""Adjacency cache for the UVA GPU sampler (docs/architecture.md, "Feature store", applied to the
graph itself).

Sampling from pinned host memory pays one bus request per 32-byte sector of neighbour list the
kernel reads (``reads.py`` counts them). Within ``sampling.gpu_graph_cache_bytes``
this puts in GPU memory: ``indptr`` (every frontier node reads it), a per-node offset (8 bytes:
where the node's list starts in the cached copy, or -1), and the neighbour lists of the nodes
whose expansions are expected to read the most bus sectors per list entry (the access
probability per hop times the sectors one expansion reads; :func:`expansion_scores`).

The lists are bit-packed: ``index_bits`` bits per entry, by default the fewest that hold every
node id (18 on a Reddit-sized graph), in little-endian 32-bit words; the kernel reads an entry
as a 64-bit window of two neighbouring words. On a graph whose expansions touch a small share of
long lists (Reddit: 10 of ~500 entries per hop-2 expansion), the bus requests a budget absorbs
grow with the number of entries it holds, so 18-bit entries cache 3.6x the lists of the int64
CSC (``index_bits=64``, the first layout, kept for comparisons). ``index_bits=0`` (``EF_BITS``;
the daemon's default through ``sampling.graph_cache_layout``) stores them as Elias-Fano
(``elias_fano.py``: about ``log2(U / deg) + 2.5`` bits per entry, ~10.7 on Reddit: every list in
17% of the int64 CSC). The entries are the host's values, so sampling with the cache is
bit-identical to sampling without it.

:func:`plan_adjacency_cache`, :func:`pack_lists` and :func:`cached_neighbours` are pure torch
(the CPU twin of what the kernel reads); :func:`build_adjacency_cache` copies the plan to a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from quiver_serve.graph.access import access_probability
from quiver_serve.sampling.graph_cache import elias_fano
from quiver_serve.sampling.graph_cache.packing import (
    add_bits,
    as_int32_words,
    entry_positions,
    read_bits,
)

#: bytes per node of the cache's fixed part: indptr and the offset
FIXED_BYTES_PER_NODE = 16
#: bytes beyond the fixed part and the lists: indptr's last entry, one spare word, the padding
#: word the kernel's two-word read of the last packed entry may touch
EXTRA_BYTES = 24
ENTRIES_PER_CHUNK = 1 << 24
#: ``index_bits`` of the Elias-Fano layout
EF_BITS = 0


@dataclass
class AdjacencyCache:
    """What the sampler kernel reads from GPU memory (or, in the twin, from these tensors)."""

    indptr: Tensor  # int64 [N + 1], the graph's own
    offsets: Tensor  # int64 [N]: first entry of the node's list in ``indices``, -1 = not cached
    indices: Tensor  # int32 words of ``index_bits``-bit entries (int64 entries when 64)
    num_cached: int
    index_bits: int = 64

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.indptr, self.offsets, self.indices))


def id_bits(num_nodes: int) -> int:
    """The fewest bits that hold every node id of a graph of ``num_nodes`` nodes."""
    return max(1, (max(num_nodes, 1) - 1).bit_length())


SCORE_COSTS = ("sectors", "reads", "reads_any_hop")


def expansion_scores(indptr: Tensor, indices: Tensor, fanouts: list[int], batch_size: int,
                     cost: str = "sectors", seed_prob: Tensor | None = None) -> Tensor:
    """Per node: what one batch is expected to read from its list over the bus, per list entry.

    ``P_h`` is the access probability (``seed_prob``, else uniform seeds of ``batch_size``);
    a node first reached at hop ``h - 1`` (probability ``P_{h-1} - P_{h-2}``) is expanded at hop
    ``h`` with fanout ``k_h``. ``cost``: ``sectors`` (default) counts the 32-byte bus requests of
    an expansion (a short list read whole coalesces: about ``(deg + 3) / 4`` of them; ``k`` draws
    from a long one about ``k``); ``reads`` counts entries ``min(k_h, deg)``; ``reads_any_hop``
    is the first version (``max_h P_h * min(max k, deg)``), kept for comparisons."""
    if cost not in SCORE_COSTS:
        raise ValueError(f"cost must be one of {SCORE_COSTS}, got {cost!r}")
    num_nodes = indptr.numel() - 1
    if seed_prob is None:
        seed_prob = torch.full((num_nodes,), min(1.0, batch_size / max(num_nodes, 1)))
    seed_prob = seed_prob.to(indptr.device)
    probs = access_probability(indptr, indices, seed_prob, fanouts[:-1]) if len(fanouts) > 1 \
        else [seed_prob.to(torch.float32)]
    deg = (indptr[1:] - indptr[:-1]).to(torch.float32)
    if cost == "reads_any_hop":
        k = max(fanouts)
        read = deg if k < 0 else torch.clamp(deg, max=float(k))
        return torch.stack(probs[:len(fanouts)]).max(dim=0).values * read / deg.clamp(min=1.0)
    total = torch.zeros(num_nodes, dtype=torch.float32, device=indptr.device)
    for h, k in enumerate(fanouts):
        first = probs[h] - (probs[h - 1] if h else 0.0)  # first reached at hop h, expanded at h+1
        per_expansion = expansion_sectors(deg, k) if cost == "sectors" else \
            (deg if k < 0 else torch.clamp(deg, max=float(k)))
        total += first.clamp(min=0.0) * per_expansion
    return total / deg.clamp(min=1.0)


def expansion_sectors(deg: Tensor, k: int, entries_per_sector: int = 4) -> Tensor:
    """Expected 32-byte sectors one expansion reads from a host list of ``deg`` int64 entries
    (the list's start at a uniform offset within a sector; ``k`` draws without replacement)."""
    span = (deg + entries_per_sector - 1) / entries_per_sector  # sectors the list covers
    if k < 0:
        return span * (deg > 0)
    # a sector is missed when all its entries are missed: about (1 - k/deg)^entries
    miss = torch.clamp(1.0 - k / deg.clamp(min=1.0), min=0.0) ** entries_per_sector
    return torch.where(deg <= k, span, span * (1.0 - miss)) * (deg > 0)


def plan_adjacency_cache(indptr: Tensor, scores: Tensor, budget_bytes: int,
                         index_bits: int = 64) -> Tensor:
    """The nodes whose lists (``index_bits`` per entry) fit the budget, best score first (a
    prefix of that order); empty when the fixed part alone does not fit."""
    num_nodes = indptr.numel() - 1
    room_bits = 8 * (budget_bytes - FIXED_BYTES_PER_NODE * num_nodes - EXTRA_BYTES)
    if index_bits != 64:
        room_bits -= 31  # packed entries fill whole 32-bit words
    if room_bits <= 0:
        return torch.empty(0, dtype=torch.int64)
    deg = indptr[1:] - indptr[:-1]
    order = torch.sort(scores, descending=True, stable=True).indices
    order = order[deg[order] > 0]
    if index_bits == EF_BITS:
        order = order[deg[order] < elias_fano.MAX_DEG]
    cost = elias_fano.list_bits(deg[order], num_nodes) if index_bits == EF_BITS \
        else deg[order] * index_bits
    fits = torch.cumsum(cost, 0) <= room_bits
    return order[:int(fits.sum())]


def pack_lists(indptr: Tensor, indices: Tensor, nodes: Tensor,
               index_bits: int = 64) -> tuple[Tensor, Tensor]:
    """(offsets per node, the lists of ``nodes`` packed), host tensors: int64 entries when
    ``index_bits`` is 64, else ``index_bits``-bit entries in int32 words plus one padding word."""
    num_nodes = indptr.numel() - 1
    if index_bits == EF_BITS:
        return elias_fano.pack(indptr, indices, nodes, num_nodes)
    deg = indptr[1:] - indptr[:-1]
    sizes = deg[nodes]
    starts = torch.cumsum(sizes, 0) - sizes
    offsets = torch.full((num_nodes,), -1, dtype=torch.int64)
    offsets[nodes] = starts
    total = int(sizes.sum())
    src = entry_positions(indptr, nodes, sizes)
    if index_bits == 64:
        packed = torch.empty(total, dtype=torch.int64)
        for lo in range(0, total, ENTRIES_PER_CHUNK):
            pos = torch.arange(lo, min(total, lo + ENTRIES_PER_CHUNK))
            packed[pos] = indices[src[pos]]
        return offsets, packed
    words = torch.zeros((total * index_bits + 31) // 32 + 1, dtype=torch.int64)
    for lo in range(0, total, ENTRIES_PER_CHUNK):
        pos = torch.arange(lo, min(total, lo + ENTRIES_PER_CHUNK))
        add_bits(words, pos * index_bits, indices[src[pos]])
    return offsets, as_int32_words(words)


def unpack_entries(cache: AdjacencyCache, first: int, count: int) -> Tensor:
    """Entries ``[first, first + count)`` of the packed lists, int64 (the kernel's read)."""
    if cache.index_bits == EF_BITS:
        raise ValueError("Elias-Fano lists are read per list (cached_neighbours)")
    if cache.index_bits == 64:
        return cache.indices[first:first + count].to(torch.int64)
    pos = torch.arange(first, first + count, device=cache.indices.device)
    return read_bits(cache.indices, pos * cache.index_bits, cache.index_bits)


def cached_neighbours(cache: AdjacencyCache, host_indices: Tensor, v: int) -> Tensor:
    """The list the kernel reads for ``v``: from the cache when cached, else from the host (the
    twin of ``plan_frontier``/``expand_node``'s choice)."""
    start, end = int(cache.indptr[v]), int(cache.indptr[v + 1])
    off = int(cache.offsets[v])
    if off >= 0 and cache.index_bits == EF_BITS:
        return elias_fano.decode_list(cache.indices, off, end - start, cache.offsets.numel())
    if off >= 0:
        return unpack_entries(cache, off, end - start)
    return host_indices[start:end]


def build_adjacency_cache(indptr: Tensor, indices: Tensor, scores: Tensor, budget_bytes: int,
                          device: torch.device, index_bits: int | None = None
                          ) -> AdjacencyCache | None:
    """The cache on ``device`` within ``budget_bytes`` (None: not even the fixed part fits).
    ``index_bits``: bits per cached entry, 1-32 or 64, or 0 (``EF_BITS``): Elias-Fano, which
    needs sorted lists (else the fewest bits are used); None: :func:`id_bits`, the fewest."""
    num_nodes = indptr.numel() - 1
    need = id_bits(num_nodes)
    bits = need if index_bits is None else int(index_bits)
    if bits not in (64, EF_BITS) and not need <= bits <= 32:
        raise ValueError(f"index_bits must be 64, 0 (Elias-Fano) or in [{need}, 32] (node ids of "
                         f"{num_nodes} nodes need {need} bits), got {index_bits}")
    if budget_bytes < FIXED_BYTES_PER_NODE * num_nodes + EXTRA_BYTES:
        return None
    nodes = plan_adjacency_cache(indptr, scores, budget_bytes, bits)
    if bits == EF_BITS and not elias_fano.is_sorted(indptr, indices, nodes):
        bits = need  # a list not sorted by id: the packed layout
        nodes = plan_adjacency_cache(indptr, scores, budget_bytes, bits)
    offsets, packed = pack_lists(indptr, indices, nodes, bits)
    if packed.numel() == 0:
        packed = torch.zeros(1, dtype=packed.dtype)  # a valid pointer
    return AdjacencyCache(indptr.to(device), offsets.to(device), packed.to(device),
                          int(nodes.numel()), bits)

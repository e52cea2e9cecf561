"""Access probability: how likely serving is to touch each node (docs/architecture.md, "Routing" and
"Feature store").

One recursion serves both the batch-size prediction (PSGS) and the feature store's placement
(FAP). With ``P_0`` the probability that a node is a seed, hop ``l`` (fanout ``k_l``) gives

    P_l(v) = 1 - (1 - P_{l-1}(v)) * prod_{u: v in N(u)} (1 - P_{l-1}(u) * min(1, k_l / deg(u)))

where ``N(u)`` are the in-neighbours of ``u`` (the nodes the sampler may draw when it expands
``u``). Draws of different expanding nodes are treated as independent, which is the estimator's
only approximation. ``-1`` (all neighbours) is ``k_l = deg(u)``.

The product runs over edges, as a ``scatter_reduce(prod)`` keyed by the edge's source node, so
a hop costs one pass over ``indices`` on whatever device the tensors are on; edges are taken in
chunks so the per-edge temporaries stay bounded on graphs of billions of edges.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

#: edges per chunk of the per-edge temporaries (float32 + int64 indices: ~12 bytes each)
EDGES_PER_CHUNK = 1 << 25


def expand_probability(degree: Tensor, fanout: int) -> Tensor:
    """Per node ``u``: the probability that one given in-neighbour is drawn when ``u`` expands."""
    deg = degree.to(torch.float32)
    if fanout < 0:
        return torch.where(deg > 0, torch.ones_like(deg), torch.zeros_like(deg))
    return torch.clamp(float(fanout) / deg.clamp(min=1.0), max=1.0) * (deg > 0)


def _edge_chunks(indptr: Tensor, edges_per_chunk: int) -> Iterator[tuple[int, int, int, int]]:
    """(first node, end node, first edge, end edge) spans of whole columns, ~edges_per_chunk each."""
    num_nodes = indptr.numel() - 1
    lo = 0
    while lo < num_nodes:
        limit = torch.tensor([int(indptr[lo]) + edges_per_chunk], device=indptr.device)
        hi = int(torch.searchsorted(indptr, limit, right=True)) - 1
        hi = max(lo + 1, min(num_nodes, hi))
        yield lo, hi, int(indptr[lo]), int(indptr[hi])
        lo = hi


def propagate_hop(indptr: Tensor, indices: Tensor, prob: Tensor, fanout: int,
                  edges_per_chunk: int = EDGES_PER_CHUNK) -> Tensor:
    """One hop of the recursion: ``P_l`` from ``P_{l-1}`` (``prob``, float32 per node)."""
    degree = indptr[1:] - indptr[:-1]
    # probability that expanding u draws any given neighbour, times the chance u is expanded
    draw = prob * expand_probability(degree, fanout).to(prob.device)
    miss = miss_probability(indptr, indices, draw, prob.numel(), edges_per_chunk)
    return 1.0 - (1.0 - prob) * miss


def miss_probability(indptr: Tensor, indices: Tensor, draw: Tensor, num_sources: int,
                     edges_per_chunk: int = EDGES_PER_CHUNK) -> Tensor:
    """Per source node ``v`` (``num_sources`` of them): ``prod_{u: v in N(u)} (1 - draw(u))``,
    the probability that no expanding node draws it; ``draw`` (float32 per destination ``u``)
    is the chance that ``u`` is expanded and draws any one given in-neighbour. A typed graph's
    relation has sources of another type than its destinations (``features/typed.py``)."""
    degree = indptr[1:] - indptr[:-1]
    miss = torch.ones(num_sources, dtype=torch.float32, device=draw.device)
    for lo, hi, e0, e1 in _edge_chunks(indptr, edges_per_chunk):
        if e1 == e0:
            continue
        counts = degree[lo:hi]
        per_edge = torch.repeat_interleave(1.0 - draw[lo:hi], counts, output_size=e1 - e0)
        miss.scatter_reduce_(0, indices[e0:e1], per_edge, reduce="prod")
    return miss


def access_probability(indptr: Tensor, indices: Tensor, seed_prob: Tensor, fanouts: list[int],
                       edges_per_chunk: int = EDGES_PER_CHUNK) -> list[Tensor]:
    """``[P_0, P_1, ..., P_L]``: per hop, the probability each node is in the sampled subgraph.

    ``seed_prob`` is ``P_0`` (float, one entry per node): 1 for the seeds of one batch, or the
    probability a node is among a batch's seeds under a request distribution.
    """
    probs = [seed_prob.to(torch.float32)]
    for fanout in fanouts:
        probs.append(propagate_hop(indptr, indices, probs[-1], fanout, edges_per_chunk))
    return probs


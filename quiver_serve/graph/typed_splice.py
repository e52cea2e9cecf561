"""One relation's CSC with edges added and removed, rebuilt in vectorised passes
(docs/architecture.md, "Typed graphs"; docs/decisions/0048-typed-updates.md).

A typed graph keeps no overlay: an update to a relation builds that relation's next CSC from
the current one in O(E) array passes (no sort of the relation's entries), and the other
relations are untouched. Within a destination's list the surviving entries keep their order and
the added ones follow in request order; edge ids stay PyG's columns: survivors are renumbered in
their old order, added edges take the next ids in request order (``edge_attr`` rows follow).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from quiver_serve.graph.typed import Relation


@dataclass(frozen=True)
class SpliceResult:
    """What an update did to one relation: entries added, entry copies removed, and removal
    pairs that named no edge."""

    added: int
    removed: int
    missing: int


def range_positions(starts: Tensor, counts: Tensor) -> Tensor:
    """Positions ``starts[i] .. starts[i] + counts[i] - 1`` for every i, concatenated."""
    total = int(counts.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    first = torch.cumsum(counts, 0) - counts
    offsets = torch.arange(total) - torch.repeat_interleave(first, counts)
    return torch.repeat_interleave(starts, counts) + offsets


def entries_of(rel: Relation, dsts: Tensor, num_src: int) -> tuple[Tensor, Tensor]:
    """(positions, keys ``dst * num_src + src``) of every entry in the lists of ``dsts``."""
    deg = rel.indptr[dsts + 1] - rel.indptr[dsts]
    pos = range_positions(rel.indptr[dsts], deg)
    owner = torch.repeat_interleave(dsts, deg)
    return pos, owner * num_src + rel.indices[pos]


def splice(rel: Relation, num_src: int, add: Tensor, remove: Tensor,
           ) -> tuple[Relation, SpliceResult]:
    """``rel`` with ``add`` (int64 [a, 2] (src, dst), each a new copy) appended and every copy
    of each ``remove`` pair taken out; the caller checked ids and that a relation with edge
    features gets no additions."""
    num_dst, num_edges = rel.num_dst, rel.num_edges
    keep = torch.ones(num_edges, dtype=torch.bool)
    removed_per_dst = torch.zeros(num_dst, dtype=torch.int64)
    removed = missing = 0
    if remove.numel():
        pos, keys = entries_of(rel, torch.unique(remove[:, 1]), num_src)
        wanted = remove[:, 1] * num_src + remove[:, 0]
        hit = torch.isin(keys, wanted)
        keep[pos[hit]] = False
        removed = int(hit.sum())
        missing = int((~torch.isin(wanted, keys)).sum())
        removed_per_dst = torch.bincount(keys[hit] // num_src, minlength=num_dst)
    if removed == 0 and add.numel() == 0:
        return rel, SpliceResult(0, 0, missing)
    added_per_dst = torch.bincount(add[:, 1], minlength=num_dst)
    old_deg = rel.degree()
    new_deg = old_deg - removed_per_dst + added_per_dst
    indptr = torch.zeros(num_dst + 1, dtype=torch.int64)
    torch.cumsum(new_deg, 0, out=indptr[1:])
    added_before = torch.cumsum(added_per_dst, 0) - added_per_dst
    kept_dst = torch.repeat_interleave(torch.arange(num_dst), old_deg)[keep]
    kept_at = torch.arange(kept_dst.numel()) + added_before[kept_dst]
    order = torch.argsort(add[:, 1], stable=True)
    add_dst = add[order, 1]
    rank = torch.arange(add_dst.numel()) - added_before[add_dst]
    add_at = indptr[add_dst] + (new_deg - added_per_dst)[add_dst] + rank
    indices = torch.empty(int(indptr[-1]), dtype=torch.int64)
    indices[kept_at] = rel.indices[keep]
    indices[add_at] = add[order, 0]
    old_ids = rel.edge_ids()
    alive = torch.ones(num_edges, dtype=torch.bool)
    alive[old_ids[~keep]] = False
    renumbered = torch.cumsum(alive, 0) - 1
    edge_id = torch.empty_like(indices)
    edge_id[kept_at] = renumbered[old_ids[keep]]
    edge_id[add_at] = kept_dst.numel() + order
    attr = None if rel.edge_attr is None else rel.edge_attr[alive]
    out = Relation(rel.edge_type, indptr, indices, edge_id, attr)
    return out, SpliceResult(int(add.size(0)), removed, missing)


def undirected_pairs(rel: Relation, num_nodes: int, add: Tensor, remove: Tensor,
                     ) -> tuple[Tensor, Tensor]:
    """The directed (add, remove) pairs that keep a relation made undirected by
    ``ToUndirected`` (coalesced: one entry per direction) what ``ToUndirected`` makes of the
    updated graph: an added pair enters both ways unless that direction is there (or named
    twice), a removed pair leaves both ways."""
    if add.numel():
        both = torch.unique(torch.cat([add, add.flip(1)]), dim=0)
        _, keys = entries_of(rel, torch.unique(both[:, 1]), num_nodes)
        add = both[~torch.isin(both[:, 1] * num_nodes + both[:, 0], keys)]
    if remove.numel():
        remove = torch.cat([remove, remove.flip(1)])
    return add, remove


def grow_destinations(rel: Relation, count: int) -> Relation:
    """``rel`` over ``count`` more destination nodes, each with an empty list."""
    tail = rel.indptr[-1:].expand(count)
    return Relation(rel.edge_type, torch.cat([rel.indptr, tail]), rel.indices, rel.edge_id,
                    rel.edge_attr)

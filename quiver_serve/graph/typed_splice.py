"""One relation's CSC with edges added and removed, rebuilt in vectorised passes
(docs/architecture.md, "Typed graphs"; docs/decisions/0048-typed-updates.md).

A typed graph keeps no overlay: an update to a relation builds that relation's next CSC from
the current one in bulk copies of its arrays (no sort or gather of the relation's entries when
only edges are added; removals renumber the edge ids in one pass), and the other relations are
untouched. Within a destination's list the surviving entries keep their order and
the added ones follow in request order; edge ids stay PyG's columns: survivors are renumbered in
their old order, added edges take the next ids in request order (``edge_attr`` rows follow).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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
    features gets no additions. NumPy's ``delete`` and ``insert`` move the unchanged entries
    in bulk (a few passes of memory copies over the relation, no gather per entry)."""
    removed_at = np.zeros(0, np.int64)
    missing = 0
    if remove.numel():
        pos, keys = entries_of(rel, torch.unique(remove[:, 1]), num_src)
        wanted = remove[:, 1] * num_src + remove[:, 0]
        hit = torch.isin(keys, wanted)
        removed_at = pos[hit].numpy()
        missing = int((~torch.isin(wanted, keys)).sum())
    if removed_at.size == 0 and add.numel() == 0:
        return rel, SpliceResult(0, 0, missing)
    indptr = rel.indptr.numpy()
    indices, ids = rel.indices.numpy(), rel.edge_ids().numpy()
    attr = rel.edge_attr
    if removed_at.size:
        removed_ids = ids[removed_at]
        drop_per_dst = np.bincount(np.searchsorted(indptr, removed_at, side="right") - 1,
                                   minlength=rel.num_dst)
        indptr = indptr - np.concatenate([[0], np.cumsum(drop_per_dst)])
        indices, ids = np.delete(indices, removed_at), np.delete(ids, removed_at)
        alive = np.ones(rel.num_edges, bool)
        alive[removed_ids] = False
        ids = (np.cumsum(alive) - 1)[ids]  # survivors renumbered in their old order
        attr = None if attr is None else attr[torch.from_numpy(alive)]
    if add.numel():
        pairs = add.numpy()
        order = np.argsort(pairs[:, 1], kind="stable")
        at = indptr[pairs[order, 1] + 1]  # the end of each destination's list
        indices = np.insert(indices, at, pairs[order, 0])
        ids = np.insert(ids, at, indices.size - len(pairs) + order)
        indptr = indptr + np.concatenate([[0], np.cumsum(np.bincount(pairs[:, 1],
                                                                     minlength=rel.num_dst))])
    out = Relation(rel.edge_type, torch.from_numpy(np.ascontiguousarray(indptr)),
                   torch.from_numpy(indices), torch.from_numpy(ids), attr)
    return out, SpliceResult(int(add.size(0)), int(removed_at.size), missing)


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

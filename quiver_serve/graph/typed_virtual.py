"""New nodes of a typed graph that are not added: an inductive request's nodes, embedded as if
they were added with their in-edges (docs/architecture.md, "Typed graphs"; decision 0061).

``virtual_nodes`` gives ``count`` nodes of one type the next ids past its nodes, their in-edges
per relation and what ``add_reverse_edges`` derives from them (the ``rev_`` relation's flipped
pair, or both directions within a type, as a typed update would), for the duration of a block:
the changed relations are rebuilt beside the graph's (``typed_splice.py``), swapped into the
``TypedGraph`` and swapped back after, so nothing acknowledged changes and samplers reading the
graph see the new nodes only inside the block. The caller runs nothing else on the graph
meanwhile (the engine core's loop is single-threaded).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

from quiver_serve import errors
from quiver_serve.graph import living
from quiver_serve.graph.typed import NAME_JOINER, EdgeType
from quiver_serve.graph.typed_living import TypedLiveGraph
from quiver_serve.graph.typed_splice import grow_destinations, splice, undirected_pairs


def _bad(message: str, status: int = 400) -> errors.ServeError:
    return errors.ServeError("invalid_new_nodes", message, status)


def in_relation(live: TypedLiveGraph, node_type: str, name: str) -> EdgeType:
    """The relation into ``node_type`` that new nodes' in-neighbours name: ``src__rel__dst``,
    ``rel`` when one relation of that name enters the type, "" when one relation enters it."""
    into = [et for et in live.edge_types if et[2] == node_type]
    if not name and len(into) == 1:
        return into[0]
    key = tuple(name.split(NAME_JOINER))
    match = [et for et in into if et == key or (len(key) == 1 and et[1] == name)]
    if len(match) != 1:
        named = "no relation" if not name else f"{name[:128]!r}"
        raise _bad(f"new_nodes in_neighbors name {named}: give source ids per relation into "
                   f"{node_type!r}, one of {[NAME_JOINER.join(et) for et in into]}")
    return match[0]


def in_edges(live: TypedLiveGraph, node_type: str, offsets: np.ndarray, rel_index: np.ndarray,
             sources: np.ndarray, names: tuple[str, ...], check_ranges: bool = True,
             ) -> dict[EdgeType, tuple[Tensor, Tensor]]:
    """Per relation, (source ids, new node index) of new nodes' in-neighbours: node i's are
    entries ``offsets[i]:offsets[i + 1]``, each a source id and the index of its relation's name
    in ``names``; a 400 naming a relation or (``check_ranges``) a source out of range."""
    owner = np.repeat(np.arange(offsets.size - 1), np.diff(offsets))
    if rel_index.size and int(rel_index.max()) >= max(len(names), 1):
        raise _bad("new_nodes in_neighbors name a relation the request does not list")
    out: dict[EdgeType, tuple[Tensor, Tensor]] = {}
    for k in np.unique(rel_index).tolist():
        et = in_relation(live, node_type, names[k] if names else "")
        pick = rel_index == k
        if check_ranges:
            living.check_ids(sources[pick], live.graph.num_nodes[et[0]],
                             f"new_nodes in_neighbors ({NAME_JOINER.join(et)})")
        for rel in (et, live.mirror.get(et), live.derived.get(et)):
            if rel is not None and live.graph.relations[rel].edge_attr is not None:
                raise _bad(f"relation {list(rel)} carries edge features; new nodes' edges along "
                           "it are not served", 422)
        src, new = torch.from_numpy(sources[pick]), torch.from_numpy(owner[pick])
        if et in out:
            src, new = torch.cat([out[et][0], src]), torch.cat([out[et][1], new])
        out[et] = (src, new)
    return out


@contextlib.contextmanager
def virtual_nodes(live: TypedLiveGraph, node_type: str, count: int,
                  edges: dict[EdgeType, tuple[Tensor, Tensor]]) -> Iterator[Tensor]:
    """``count`` nodes of ``node_type`` with these in-edges (``in_edges``), inside the block
    only (module docstring); yields their ids."""
    g = live.graph
    first = g.num_nodes[node_type]
    saved_relations, saved_count = dict(g.relations), first
    none = torch.zeros((0, 2), dtype=torch.int64)
    try:
        for et, rel in saved_relations.items():
            if et[2] == node_type:
                g.relations[et] = grow_destinations(rel, count)
        g.num_nodes[node_type] = first + count
        for et, (src, new) in edges.items():
            add = torch.stack([src, new + first], 1)
            if et in live.undirected:
                add, _ = undirected_pairs(g.relations[et], g.num_nodes[et[0]], add, none)
            g.relations[et], _ = splice(g.relations[et], g.num_nodes[et[0]], add, none)
            other = live.mirror.get(et) or live.derived.get(et)
            if other is not None:
                g.relations[other], _ = splice(g.relations[other], g.num_nodes[other[0]],
                                               add.flip(1), none)
        yield torch.arange(first, first + count)
    finally:
        for et, rel in saved_relations.items():
            g.relations[et] = rel
        g.num_nodes[node_type] = saved_count

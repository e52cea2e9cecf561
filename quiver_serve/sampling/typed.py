"""Neighbour sampling on a typed graph, in PyG's heterogeneous shape (reference, pure torch).

Semantics (docs/architecture.md, "Typed graphs"; the homogeneous rules of ``base`` per relation):

* The seeds are of one node type; ``node[seed_type]`` starts with the unique seeds in order of
  first occurrence and ``seed_index[i]`` is the row of ``seeds[i]`` there.
* Hop ``l`` (1-based) expands, for every edge type ``(s, r, t)`` in the graph's edge-type order,
  every node of type ``t`` added at hop ``l - 1`` (in ``node[t]`` order) along that relation with
  fanout ``fanouts[(s, r, t)][l - 1]``: all its in-neighbours when ``k == -1`` or its degree is at
  most ``k``, else ``k`` distinct ones by Floyd's draws, exactly as the homogeneous sampler does
  (``reference.hop_edge_positions``), with the relation's own random numbers
  (``base.relation_base``: a pure function of seed, hop, edge type, node and draw).
* A relation's sampled neighbours, in frontier order, are its edges of that hop (``edge_index``
  row 0: local id in ``node[s]``, row 1: local id in ``node[t]``; ``e_id``: the edge's id, its
  column in the relation's PyG ``edge_index``). Neighbours not yet in ``node[s]`` are appended in
  order of first occurrence, relation by relation; nodes added at hop ``l`` are expanded at hop
  ``l + 1`` only.
* ``num_sampled_nodes[t]`` has ``L + 1`` entries (hop 0: the seeds for the seed type, else 0),
  ``num_sampled_edges[et]`` ``L``: what PyG's ``to_hetero`` models read to trim per layer.

A one-type graph (``TypedGraph.from_graph_data``) samples exactly what ``ReferenceSampler`` does:
relation 0 draws the homogeneous numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from quiver_serve.graph.typed import NAME_JOINER, EdgeType, Relation, TypedGraph
from quiver_serve.sampling.base import check_seed_range, relation_base, seed_base
from quiver_serve.sampling.reference import hop_edge_positions, unique_first

#: fanouts as a config or request gives them: one list for every relation, or one per relation
#: keyed by ``(src, rel, dst)`` or ``"src__rel__dst"``
TypedFanouts = Sequence[int] | Mapping[EdgeType | str, Sequence[int]]


@dataclass
class TypedSamplerOutput:
    """A sampled typed subgraph in PyG's ``HeteroSamplerOutput`` shape (module docstring)."""

    seed_type: str
    node: dict[str, Tensor]  # int64 global ids per node type, seeds first in node[seed_type]
    edge_index: dict[EdgeType, Tensor]  # int64 [2, E] local ids (row: source, col: destination)
    e_id: dict[EdgeType, Tensor]  # int64 [E] edge ids
    seed_index: Tensor  # int64 [len(seeds)] row of each requested seed in node[seed_type]
    num_sampled_nodes: dict[str, list[int]]  # [L + 1] per node type
    num_sampled_edges: dict[EdgeType, list[int]]  # [L] per edge type

    @property
    def num_nodes(self) -> int:
        return sum(int(n.numel()) for n in self.node.values())

    @property
    def num_edges(self) -> int:
        return sum(int(e.size(1)) for e in self.edge_index.values())

    def x_dict(self, graph: TypedGraph) -> dict[str, Tensor]:
        """The sampled nodes' feature rows, per featured type (where the features are)."""
        return {t: graph.x[t][ids.to(graph.x[t].device)] for t, ids in self.node.items()
                if t in graph.x}

    def edge_attr_dict(self, graph: TypedGraph) -> dict[EdgeType, Tensor]:
        """The sampled edges' feature rows, per relation with edge features."""
        out = {}
        for et, ids in self.e_id.items():
            attr = graph.relations[et].edge_attr
            if attr is not None:
                out[et] = attr[ids.to(attr.device)]
        return out


def typed_fanouts(graph: TypedGraph, fanouts: TypedFanouts) -> dict[EdgeType, list[int]]:
    """One fanout list per edge type of ``graph``; ValueError naming a missing, unknown or
    ill-sized relation (every list has one entry per layer)."""
    if isinstance(fanouts, Mapping):
        given = {_edge_key(k): [int(f) for f in v] for k, v in fanouts.items()}
        unknown = [list(k) for k in given if k not in graph.relations]
        if unknown:
            raise ValueError(f"fanouts name edge types the graph does not have: {unknown}; it "
                             f"has {[list(e) for e in graph.edge_types]}")
        missing = [list(e) for e in graph.edge_types if e not in given]
        if missing:
            raise ValueError(f"fanouts lack edge types {missing} (give one list per edge type, "
                             "or one list for all)")
        out = {et: given[et] for et in graph.edge_types}
    else:
        out = {et: [int(f) for f in fanouts] for et in graph.edge_types}
    depths = {len(v) for v in out.values()}
    if len(depths) > 1:
        raise ValueError(f"fanouts per edge type must have the same number of layers, got "
                         f"{ {NAME_JOINER.join(k): v for k, v in out.items()} }")
    for et, values in out.items():
        if any(f < -1 for f in values):
            raise ValueError(f"fanouts of {list(et)} must be >= 0 or -1 (all), got {values}")
    return out


def _edge_key(key: EdgeType | str | Sequence[str]) -> EdgeType:
    parts = key.split(NAME_JOINER) if isinstance(key, str) else list(key)
    if len(parts) != 3:
        raise ValueError(f"an edge type is (src, rel, dst) or 'src__rel__dst', got {key!r}")
    return (parts[0], parts[1], parts[2])


class _TypeIds:
    """The sampled nodes of one type: global ids in order, and a sorted index to find them."""

    def __init__(self, ids: Tensor) -> None:
        self.ids = ids
        self.sorted, self.local = torch.sort(ids)

    def add(self, nbr: Tensor) -> Tensor:
        """Local ids of ``nbr``, appending those not yet known in order of first occurrence."""
        local = torch.empty_like(nbr)
        if self.sorted.numel():
            pos = torch.searchsorted(self.sorted, nbr).clamp_(max=self.sorted.numel() - 1)
            found = self.sorted[pos] == nbr
            local[found] = self.local[pos[found]]
        else:
            found = torch.zeros_like(nbr, dtype=torch.bool)
        new, rank = unique_first(nbr[~found])
        first_new = self.ids.numel()
        local[~found] = first_new + rank
        if new.numel():
            self.ids = torch.cat([self.ids, new])
            self.sorted, order = torch.sort(torch.cat([self.sorted, new]))
            self.local = torch.cat([self.local, torch.arange(first_new, self.ids.numel(),
                                                             device=nbr.device)])[order]
        return local


class TypedReferenceSampler:
    """Sampling per edge type (module docstring) in plain vectorised torch, on the device of the
    graph's CSCs (``TypedGraph.to``): on a GPU it is the GPU typed sampler, bit for bit the CPU's
    output."""

    name = "reference"

    def __init__(self, graph: TypedGraph) -> None:
        self.graph = graph
        devices = {rel.indptr.device for rel in graph.relations.values()}
        if len(devices) > 1:
            raise ValueError(f"the graph's relations are on several devices: {sorted(map(str, devices))}")
        #: where the graph's CSCs are and the sampling runs (a GPU: the same torch code there)
        self.device = devices.pop() if devices else torch.device("cpu")

    def hop_positions(self, rel: Relation, frontier: Tensor, k: int, hop: int,
                      base: int) -> tuple[Tensor, Tensor]:
        """One hop of one relation: the CSC positions read for ``frontier`` (global ids), in
        frontier order, and how many per frontier node; ``base`` is the relation's."""
        return hop_edge_positions(rel.indptr, frontier, k, hop, base)

    def hop_edges(self, number: int, rel: Relation, frontier: Tensor, k: int, hop: int,
                  base: int) -> tuple[Tensor, Tensor, Tensor]:
        """One hop of relation ``number`` (its position in the graph's edge types): the drawn
        neighbours' ids and edge ids in frontier order, and how many per frontier node; the
        GPU sampler (``sampling/typed_gpu.py``) draws the three in one kernel."""
        pos, count = self.hop_positions(rel, frontier, k, hop, base)
        return rel.indices[pos], pos if rel.edge_id is None else rel.edge_id[pos], count

    def sample(self, seed_type: str, seeds: Tensor, fanouts: TypedFanouts,
               seed: int) -> TypedSamplerOutput:
        graph = self.graph
        graph.check_node_type(seed_type)
        per_rel = typed_fanouts(graph, fanouts)
        num_layers = len(next(iter(per_rel.values()), []))
        dev = self.device
        seeds = seeds.to(device=dev, dtype=torch.int64)
        check_seed_range(seeds, graph.num_nodes[seed_type])
        seed_ids, seed_index = unique_first(seeds)
        ids = {t: _TypeIds(seed_ids if t == seed_type else
                           torch.empty(0, dtype=torch.int64, device=dev))
               for t in graph.node_types}
        frontier = {t: torch.arange(ids[t].ids.numel(), device=dev) for t in graph.node_types}
        num_nodes = {t: [ids[t].ids.numel()] for t in graph.node_types}
        rows: dict[EdgeType, list[Tensor]] = {et: [] for et in graph.edge_types}
        cols: dict[EdgeType, list[Tensor]] = {et: [] for et in graph.edge_types}
        eids: dict[EdgeType, list[Tensor]] = {et: [] for et in graph.edge_types}
        base = seed_base(seed)
        for hop in range(1, num_layers + 1):
            before = {t: ids[t].ids.numel() for t in graph.node_types}
            # one lookup per source type of the hop's neighbours over its relations, in relation
            # order: the same first occurrences as adding them relation by relation
            found: dict[str, list[tuple[EdgeType, Tensor]]] = {t: [] for t in graph.node_types}
            for r, (et, rel) in enumerate(graph.relations.items()):
                targets = frontier[et[2]]
                nbr, eid, count = self.hop_edges(r, rel, ids[et[2]].ids[targets],
                                                 per_rel[et][hop - 1], hop, relation_base(base, r))
                # the size is known here: no wait for the device to count it
                owner = torch.repeat_interleave(torch.arange(targets.numel(), device=dev), count,
                                                output_size=nbr.numel())
                found[et[0]].append((et, nbr))
                cols[et].append(targets[owner])
                eids[et].append(eid)
            for t, parts in found.items():
                if parts:
                    local = ids[t].add(torch.cat([nbr for _, nbr in parts]))
                    for (et, _), piece in zip(parts, local.split([n.numel() for _, n in parts]),
                                              strict=True):
                        rows[et].append(piece)
            for t in graph.node_types:
                frontier[t] = torch.arange(before[t], ids[t].ids.numel(), device=dev)
                num_nodes[t].append(ids[t].ids.numel() - before[t])
        return TypedSamplerOutput(
            seed_type, {t: ids[t].ids for t in graph.node_types},
            {et: _stack(rows[et], cols[et], dev) for et in graph.edge_types},
            {et: torch.cat(eids[et]) if eids[et] else torch.empty(0, dtype=torch.int64,
                                                                  device=dev)
             for et in graph.edge_types},
            seed_index, num_nodes,
            {et: [int(r.numel()) for r in rows[et]] for et in graph.edge_types})


def _stack(rows: list[Tensor], cols: list[Tensor], dev: torch.device) -> Tensor:
    if not rows:
        return torch.empty((2, 0), dtype=torch.int64, device=dev)
    return torch.stack([torch.cat(rows), torch.cat(cols)])


class TypedCppSampler(TypedReferenceSampler):
    """The same sampling with each relation's hop drawn by the C++ sampler
    (``csrc/cpu_sampler.cpp``, ``hop_positions``), parallel over the frontier; the bookkeeping
    between hops stays in torch. Bit for bit the reference's output."""

    name = "cpp"

    def __init__(self, graph: TypedGraph) -> None:
        from quiver_serve.sampling.cpu import cpu_extension

        super().__init__(graph)
        for et, rel in graph.relations.items():
            for label, t in (("indptr", rel.indptr), ("indices", rel.indices)):
                if not t.is_contiguous():
                    raise ValueError(f"relation {list(et)}: {label} must be contiguous (it is "
                                     "read in place)")
        self._hop = cpu_extension().hop_positions

    def hop_positions(self, rel: Relation, frontier: Tensor, k: int, hop: int,
                      base: int) -> tuple[Tensor, Tensor]:
        return self._hop(rel.indptr, rel.indices, frontier, k, base, hop)

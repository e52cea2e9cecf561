"""Exact rows of a typed inductive request from the typed exact table (decision 0064; 0061 for
the request, 0060 for the table).

Inside ``graph/typed_virtual.virtual_nodes`` the graph holds the new nodes, their in-edges and
what ``add_reverse_edges`` derives from them. Which rows that changes is what the table's marking
finds for a record (``TypedExactTable.mark``): at layer 1 the new nodes (new inputs), their
out-neighbours and every destination whose in-edges changed (the new nodes, and their sources
when a reverse edge points back at them); at each later layer those, their out-neighbours and
the destinations again. Of those rows only the ones the answer reads are computed: the asked
rows at the last layer, and at each layer below the rows the computed ones read (themselves and
their in-neighbours). Every other row read is the table's, which must be clean there (a row the
new nodes do not reach is the same on the graph with them). Else the caller samples at full
fanout as before.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from quiver_serve.engine.core.typed_table import TypedExactTable
from quiver_serve.graph.typed import EdgeType
from quiver_serve.graph.typed_living import TypedLiveGraph
from quiver_serve.models.typed_layerwise import TypedLayerwise, one_hop

Ids = dict[str, Tensor]


def changed_destinations(live: TypedLiveGraph, node_type: str, new_ids: Tensor,
                         edges: dict[EdgeType, tuple[Tensor, Tensor]]) -> Ids:
    """Per type, the nodes whose in-edges the new nodes' edges change (``virtual_nodes``'
    splice): the new nodes, and each source a derived or undirected edge points back at."""
    out: dict[str, list[Tensor]] = {node_type: [new_ids]}
    for et, (src, _) in edges.items():
        if et in live.undirected or live.mirror.get(et) or live.derived.get(et):
            out.setdefault(et[0], []).append(src)
    return {t: torch.unique(torch.cat(parts)) for t, parts in out.items()}


def _union(*sets: Ids) -> Ids:
    keys = {t for s in sets for t in s}
    return {t: torch.unique(torch.cat([s[t] for s in sets if t in s])) for t in keys}


def _intersect(a: Ids, b: Ids) -> Ids:
    return {t: ids[torch.isin(ids, b[t])] for t, ids in a.items() if t in b}


def _read_by(graph: object, targets: Ids) -> Ids:
    """The targets and their in-neighbours along every relation, per type."""
    parts: list[Ids] = [targets]
    for t, ids in targets.items():
        if ids.numel():
            parts.append(one_hop(graph, t, ids)[0])  # type: ignore[arg-type]
    return _union(*parts)


class _Overlaid:
    """A layer's rows of one type: the table's, with the rows computed for the request over
    them (the new nodes' ids are past the table's rows and always among them)."""

    def __init__(self, base: Tensor | None, ids: Tensor, rows: Tensor) -> None:
        self.base, self.ids, self.rows = base, ids, rows
        self.device = rows.device

    def __getitem__(self, index: Tensor) -> Tensor:
        pos = torch.searchsorted(self.ids, index).clamp_(max=max(self.ids.numel() - 1, 0))
        hit = self.ids[pos] == index if self.ids.numel() else torch.zeros_like(index, dtype=torch.bool)
        if self.base is None:
            return self.rows[pos]
        out = self.base[index.clamp(max=self.base.size(0) - 1)].to(self.rows.dtype)
        out[hit] = self.rows[pos[hit]]
        return out


def inductive_rows(table: TypedExactTable, layerwise: TypedLayerwise, node_type: str,
                   ids: Tensor, new_ids: Tensor, changed: Ids) -> np.ndarray | None:
    """float32 rows of ``ids`` then ``new_ids`` (of ``node_type``) on the graph with the new
    nodes (inside ``virtual_nodes``), or None when a row it would read is stale in the table
    (module docstring)."""
    graph, num_layers = table.graph, table.num_layers
    asked = {node_type: torch.unique(torch.cat([ids, new_ids]))}
    reach, frontier = [], {node_type: new_ids}
    for _ in range(num_layers):  # rows of each layer the new nodes change
        frontier = _union(frontier, table.out_neighbours(frontier), changed)
        reach.append(frontier)
    read: list[Ids] = [asked] * num_layers  # rows of each layer the answer reads
    for i in range(num_layers - 1, 0, -1):
        read[i - 1] = _read_by(graph, read[i])
    computed: list[dict[str, _Overlaid]] = []
    for i in range(num_layers):
        work = {t: v for t, v in _intersect(reach[i], read[i]).items() if v.numel()}
        if i and not _clean_inputs(table, i - 1, _read_by(graph, work), reach[i - 1]):
            return None
        prev = computed[-1] if i else None
        layer: dict[str, _Overlaid] = {}
        for t, targets in work.items():
            rows = layerwise.layer_rows(i, t, targets, prev)  # type: ignore[arg-type]
            if rows is not None:
                base = table.layer(i).get(t)
                layer[t] = _Overlaid(base, targets, rows.float().cpu())
        if i < num_layers - 1:
            none = torch.empty(0, dtype=torch.int64)
            for t, base in table.layer(i).items():  # every type a later layer may read
                layer.setdefault(t, _Overlaid(base, none, base[:0].float()))
        computed.append(layer)
    return _answer(table, computed[-1], node_type, ids, new_ids)


def _clean_inputs(table: TypedExactTable, i: int, needed: Ids, computed: Ids) -> bool:
    """Every row of layer ``i`` in ``needed`` that is not among ``computed`` is clean."""
    for t, ids in needed.items():
        from_table = ids[~torch.isin(ids, computed[t])] if t in computed else ids
        if from_table.numel() and not bool(table.clean_at(i, t, from_table).all()):
            return False
    return True


def _answer(table: TypedExactTable, last: dict[str, _Overlaid], node_type: str, ids: Tensor,
            new_ids: Tensor) -> np.ndarray | None:
    mine = last.get(node_type)
    if mine is None:
        return None
    plain = ~torch.isin(ids, mine.ids)
    if bool(plain.any()) and not bool(table.clean(node_type, ids[plain]).all()):
        return None
    return mine[torch.cat([ids, new_ids])].float().numpy()

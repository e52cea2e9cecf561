"""A random typed graph the repository does not ship, and a plain model of typed updates on
it: the original directed edge lists of a PyG ``HeteroData`` changed as a user asks, from which
``add_reverse_edges`` (PyG's ``ToUndirected``) gives what the served graph must be. Shared by
the typed update tests of the graph, the engine and the daemon."""

from __future__ import annotations

import numpy as np
import torch
from torch_geometric.data import HeteroData

from quiver_serve.graph.typed import TypedGraph, add_reverse_edges

WRITES = ("author", "writes", "paper")
CITES = ("paper", "cites", "paper")
HAS = ("paper", "has", "field")


def random_papers(seed: int = 0) -> HeteroData:
    """Papers (6 features), authors (4), fields (none); authors write papers, papers cite
    papers, papers have fields (edge features: only removals are served on it)."""
    g = torch.Generator().manual_seed(seed)
    data = HeteroData()
    sizes = {"paper": 60, "author": 35, "field": 8}
    data["paper"].x = torch.randn(60, 6, generator=g)
    data["author"].x = torch.randn(35, 4, generator=g)
    data["field"].num_nodes = 8
    for et, num in ((WRITES, 150), (CITES, 140), (HAS, 70)):
        src, _, dst = et
        data[et].edge_index = torch.stack([torch.randint(0, sizes[src], (num,), generator=g),
                                           torch.randint(0, sizes[dst], (num,), generator=g)])
    data[HAS].edge_attr = torch.randn(70, 2, generator=g)
    return data


class UpdateModel:
    """The original (directed, before reverse relations) graph as lists, updated the plain
    way: an add appends columns; a removal drops every copy (on ``paper-cites-paper``, made
    undirected, both directions)."""

    def __init__(self, data: HeteroData) -> None:
        self.data = data.clone()

    def add(self, et: tuple, pairs: np.ndarray) -> None:
        store = self.data[et]
        store.edge_index = torch.cat([store.edge_index, torch.as_tensor(pairs).t()], 1)

    def remove(self, et: tuple, pairs: np.ndarray) -> None:
        store = self.data[et]
        ei = store.edge_index
        drop = torch.zeros(ei.size(1), dtype=torch.bool)
        for u, v in pairs.tolist():
            drop |= (ei[0] == u) & (ei[1] == v)
            if et[0] == et[2]:
                drop |= (ei[0] == v) & (ei[1] == u)
        store.edge_index = ei[:, ~drop]
        if "edge_attr" in store:
            store.edge_attr = store.edge_attr[~drop]

    def add_nodes(self, node_type: str, rows: np.ndarray) -> None:
        store = self.data[node_type]
        if "x" in store:
            store.x = torch.cat([store.x, torch.as_tensor(rows)])
        else:
            store.num_nodes = store.num_nodes + len(rows)

    def put_features(self, node_type: str, ids: list[int], rows: np.ndarray) -> None:
        self.data[node_type].x[ids] = torch.as_tensor(rows)

    def served(self) -> TypedGraph:
        """What the served graph must be: PyG's ``ToUndirected`` of the updated graph."""
        return add_reverse_edges(TypedGraph.from_hetero_data(self.data, "papers"))


def coalesced(edge_index: torch.Tensor) -> torch.Tensor:
    """Columns sorted (by target, then source), duplicates kept."""
    if edge_index.numel() == 0:
        return edge_index
    key = edge_index[1] * (int(edge_index.max()) + 1) + edge_index[0]
    return edge_index[:, torch.argsort(key, stable=True)]


def assert_same_graph(got: TypedGraph, want: TypedGraph) -> None:
    """Same types, counts, features; per relation the same edges (in PyG's column order for
    relations between types, as a multiset within one)."""
    assert got.num_nodes == want.num_nodes
    assert got.edge_types == want.edge_types
    for t, x in want.x.items():
        assert torch.equal(got.x[t], x), t
    for et, rel in want.relations.items():
        mine = got.relations[et]
        assert mine.num_dst == rel.num_dst, et
        if et[0] == et[2]:
            assert torch.equal(coalesced(mine.edge_index()), coalesced(rel.edge_index())), et
        else:
            assert torch.equal(mine.edge_index(), rel.edge_index()), et
            if rel.edge_attr is not None:
                assert torch.equal(mine.edge_attr, rel.edge_attr), et

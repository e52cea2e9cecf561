"""Typed graphs: HeteroData both ways, reverse relations as PyG's ToUndirected, the loaders
(saved HeteroData, npz per type, ogbn-mag-shaped synthetic) and the one-type view."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch_geometric.transforms as T
from torch_geometric.data import HeteroData

from quiver_serve.config import DEFAULTS_DIR, GraphConfig
from quiver_serve.graph.datasets import load_planetoid_raw
from quiver_serve.graph.synthetic import generate_synthetic
from quiver_serve.graph.typed import Relation, TypedGraph, add_reverse_edges
from quiver_serve.graph.typed_load import (
    load_hetero_pyg,
    load_typed_graph,
    load_typed_npz,
    save_typed_npz,
)
from quiver_serve.graph.typed_synthetic import TYPED_PRESETS, generate_typed_synthetic


def random_hetero(seed: int = 0, edge_dim: int = 3) -> HeteroData:
    """Users, items (no features) and tags; a relation within one type; duplicate edges."""
    g = torch.Generator().manual_seed(seed)
    data = HeteroData()
    data["user"].x = torch.randn(40, 5, generator=g)
    data["item"].num_nodes = 30
    data["tag"].x = torch.randn(7, 2, generator=g)
    data["user"].y = torch.randint(0, 3, (40,), generator=g)
    sizes = {"user": 40, "item": 30, "tag": 7}
    for (src, rel, dst), num in ((("user", "buys", "item"), 120), (("user", "follows", "user"), 90),
                                 (("item", "has", "tag"), 45)):
        ei = torch.stack([torch.randint(0, sizes[src], (num,), generator=g),
                          torch.randint(0, sizes[dst], (num,), generator=g)])
        data[src, rel, dst].edge_index = ei
        data[src, rel, dst].edge_attr = torch.randn(num, edge_dim, generator=g)
    return data


def assert_relation_invariants(graph: TypedGraph) -> None:
    for (src, _, dst), rel in graph.relations.items():
        assert rel.indptr.dtype == rel.indices.dtype == torch.int64
        assert int(rel.indptr[0]) == 0 and bool((rel.indptr.diff() >= 0).all())
        assert rel.num_dst == graph.num_nodes[dst]
        if rel.num_edges:
            assert 0 <= int(rel.indices.min()) and int(rel.indices.max()) < graph.num_nodes[src]
        owner = torch.repeat_interleave(torch.arange(rel.num_dst), rel.degree())
        same = owner[1:] == owner[:-1]
        assert bool((rel.indices[1:][same] >= rel.indices[:-1][same]).all()), "lists sorted"


def assert_same_as_pyg(graph: TypedGraph, data: HeteroData) -> None:
    assert graph.edge_types == list(data.edge_types)
    assert graph.node_types == list(data.node_types)
    for et in data.edge_types:
        assert torch.equal(graph.relations[et].edge_index(), data[et].edge_index), et
        if "edge_attr" in data[et]:
            assert torch.equal(graph.relations[et].edge_attr, data[et].edge_attr), et
    for t in data.node_types:
        assert graph.num_nodes[t] == data[t].num_nodes
        if "x" in data[t]:
            assert torch.equal(graph.x[t], data[t].x)
        else:
            assert t not in graph.x and graph.feature_width(t) == 0


def test_hetero_data_both_ways_keeps_edges_ids_and_features() -> None:
    data = random_hetero()
    graph = TypedGraph.from_hetero_data(data, "shop")
    assert_relation_invariants(graph)
    assert_same_as_pyg(graph, data)
    # CSC entry p is edge edge_id[p] of the PyG edge_index: same source, same target.
    rel = graph.relations[("user", "buys", "item")]
    dst = torch.repeat_interleave(torch.arange(rel.num_dst), rel.degree())
    ei = data["user", "buys", "item"].edge_index
    assert torch.equal(ei[0, rel.edge_id], rel.indices) and torch.equal(ei[1, rel.edge_id], dst)
    back = graph.to_hetero_data()
    assert_same_as_pyg(TypedGraph.from_hetero_data(back, "shop"), data)
    assert graph.metadata() == data.metadata()


@pytest.mark.parametrize("merge", [True, False])
def test_reverse_edges_are_pyg_to_undirected(merge: bool) -> None:
    data = random_hetero(seed=1)
    graph = add_reverse_edges(TypedGraph.from_hetero_data(data, "shop"), merge=merge)
    expected = T.ToUndirected(merge=merge)(random_hetero(seed=1))
    assert_relation_invariants(graph)
    assert_same_as_pyg(graph, expected)
    if merge:
        assert ("user", "rev_follows", "user") not in graph.relations
    assert ("item", "rev_buys", "user") in graph.relations


def test_reverse_relation_that_exists_is_refused() -> None:
    data = random_hetero()
    data["item", "rev_buys", "user"].edge_index = torch.zeros((2, 1), dtype=torch.int64)
    with pytest.raises(ValueError, match="rev_buys"):
        add_reverse_edges(TypedGraph.from_hetero_data(data, "shop"))


def test_one_type_view_shares_the_homogeneous_tensors() -> None:
    cora = load_planetoid_raw(DEFAULTS_DIR / "planetoid" / "cora" / "raw", "cora")
    typed = TypedGraph.from_graph_data(cora)
    rel = typed.relations[("node", "to", "node")]
    assert rel.indices.data_ptr() == cora.indices.data_ptr()
    assert typed.x["node"].data_ptr() == cora.x.data_ptr()
    assert torch.equal(rel.edge_index(), cora.edge_index())


def test_errors_name_the_type_or_relation() -> None:
    data = random_hetero()
    graph = TypedGraph.from_hetero_data(data, "shop")
    with pytest.raises(KeyError, match="'paper'.*item"):
        graph.check_node_type("paper")
    with pytest.raises(KeyError, match="likes"):
        graph.check_edge_type(["user", "likes", "item"])
    with pytest.raises(ValueError, match="destination id is outside \\[0, 30\\)"):
        Relation.from_edge_index(("user", "buys", "item"), torch.tensor([[0], [30]]), 40, 30)
    with pytest.raises(ValueError, match="without '__'"):
        TypedGraph("bad", {"a__b": 1}, {}, {})
    with pytest.raises(ValueError, match="source type 'shop' is not a node type"):
        et = ("shop", "sells", "item")
        TypedGraph("bad", {"item": 2}, {}, {et: Relation.from_edge_index(
            et, torch.zeros((2, 0), dtype=torch.int64), 1, 2)})


def test_npz_layout_round_trip_and_named_errors(tmp_path: Path) -> None:
    graph = TypedGraph.from_hetero_data(random_hetero(), "shop")
    path = tmp_path / "shop.npz"
    save_typed_npz(graph, path)
    again = load_typed_npz(path, "shop")
    assert_same_as_pyg(again, random_hetero())
    assert torch.equal(again.y["user"], graph.y["user"])
    bad = tmp_path / "bad.npz"
    np.savez(bad, x__user=np.zeros((2, 2), np.float32), edge_index__user__to__shop=np.zeros((2, 1)))
    with pytest.raises(ValueError, match="'shop'"):
        load_typed_npz(bad, "bad")
    np.savez(bad, x__user=np.zeros((2, 2), np.float32), weights__user=np.zeros(2))
    with pytest.raises(ValueError, match="'weights__user'"):
        load_typed_npz(bad, "bad")


def test_saved_hetero_data_loads_weights_only(tmp_path: Path) -> None:
    data = random_hetero()
    for obj, name in ((data, "whole.pt"), (data.to_dict(), "dict.pt")):
        torch.save(obj, tmp_path / name)
        assert_same_as_pyg(load_hetero_pyg(tmp_path / name, "shop"), data)
    cfg = GraphConfig(format="pyg", path=str(tmp_path / "whole.pt"), name="shop",
                      add_reverse_edges=True)
    typed = load_typed_graph(cfg)
    assert_same_as_pyg(typed, T.ToUndirected()(random_hetero()))


class _Payload:
    def __reduce__(self) -> tuple:
        return (print, ("code ran",))


def test_a_pickle_that_runs_code_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    with open(path, "wb") as f:
        pickle.dump({("a", "r", "b"): _Payload()}, f)
    with pytest.raises(ValueError, match="refused"):
        load_hetero_pyg(path, "evil")


def test_mag_synthetic_matches_the_published_counts_at_scale() -> None:
    scale = 0.01
    graph = generate_typed_synthetic("mag", scale, seed=5)
    preset = TYPED_PRESETS["mag"]
    assert graph.num_nodes == {t: round(n * scale) for t, n in preset.num_nodes.items()}
    for et, full in preset.num_edges.items():
        rel = graph.relations[et]
        assert rel.num_edges == round(full * scale), et
        owner = torch.repeat_interleave(torch.arange(rel.num_dst), rel.degree())
        same = owner[1:] == owner[:-1]
        assert bool((rel.indices[1:][same] > rel.indices[:-1][same]).all()), f"{et}: distinct"
    assert_relation_invariants(graph)
    assert graph.feature_width("paper") == 128 and graph.feature_width("author") == 0
    # heavy tails: the largest in-degree is many times the mean
    writes = graph.relations[("author", "writes", "paper")]
    assert int(writes.degree().max()) > 5 * writes.num_edges / writes.num_dst
    again = generate_typed_synthetic("mag", scale, seed=5)
    other = generate_typed_synthetic("mag", scale, seed=6)
    for et in preset.num_edges:
        assert torch.equal(graph.relations[et].indices, again.relations[et].indices)
    assert not torch.equal(graph.relations[("paper", "cites", "paper")].indices,
                           other.relations[("paper", "cites", "paper")].indices)
    assert torch.equal(graph.x["paper"], again.x["paper"])


def test_mag_config_with_reverse_relations() -> None:
    cfg = GraphConfig(format="synthetic", synthetic_preset="mag", synthetic_scale=0.002,
                      add_reverse_edges=True)
    graph = load_typed_graph(cfg)
    assert len(graph.edge_types) == 7  # three rev_ relations, cites made undirected
    assert ("paper", "rev_writes", "author") in graph.relations
    with pytest.raises(ValueError, match="typed graph"):
        generate_synthetic(cfg)


def test_homogeneous_config_is_the_one_type_case() -> None:
    typed = load_typed_graph(GraphConfig())
    assert typed.node_types == ["node"] and typed.num_nodes["node"] == 2708
    assert typed.feature_width("node") == 1433

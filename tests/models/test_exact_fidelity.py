"""Exact mode equals PyG's full-graph ``model(x, edge_index)`` on awkward graphs.

Random directed graphs with self loops (some repeated), duplicate edges and isolated nodes,
sampled with the reference sampler (all fanouts -1), for every served model class and every GCN
normalisation setting, at 1 to 3 layers.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch_geometric.nn import models as pyg_models

from quiver_serve.graph.csc import GraphData
from quiver_serve.models.exact_gcn import improved_applies_without_weights
from quiver_serve.models.served import ServedModel
from quiver_serve.sampling.reference import ReferenceSampler

NUM_NODES = 40
NUM_FEATURES = 6


def awkward_edges(seed: int) -> tuple[Tensor, Tensor]:
    """(edge_index with loops, repeated loops and duplicate edges; the isolated node ids)."""
    g = torch.Generator().manual_seed(seed)
    isolated = torch.tensor([NUM_NODES - 2, NUM_NODES - 1])  # no edge in or out
    connected = NUM_NODES - isolated.numel()
    edges = torch.randint(0, connected, (2, 120), generator=g)
    loop_nodes = torch.randperm(connected, generator=g)[:8]
    loops = torch.cat([loop_nodes, loop_nodes[:3]]).expand(2, -1)  # three nodes with two loops
    duplicates = edges[:, :15]
    edge_index = torch.cat([edges, loops, duplicates], dim=1)
    return edge_index[:, torch.randperm(edge_index.size(1), generator=g)], isolated


MODELS = [
    ("GraphSAGE", {}),
    ("GAT", {}),
    ("GCN", {"improved": False, "add_self_loops": True}),
    ("GCN", {"improved": True, "add_self_loops": True}),
    ("GCN", {"improved": False, "add_self_loops": False}),
    ("GCN", {"improved": True, "add_self_loops": False}),
    ("GCN", {"normalize": False}),
    ("GCN", {"cached": True}),  # ignored (see below); exact mode never used the cache anyway
]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("layers", [1, 2, 3])
@pytest.mark.parametrize(("cls", "kwargs"), MODELS, ids=lambda v: str(v) if v else "default")
def test_exact_mode_equals_full_graph(cls: str, kwargs: dict, layers: int, seed: int) -> None:
    edge_index, isolated = awkward_edges(seed)
    x = torch.randn(NUM_NODES, NUM_FEATURES, generator=torch.Generator().manual_seed(seed))
    graph = GraphData.from_edge_index(edge_index, x, name="awkward")
    torch.manual_seed(seed)
    model = getattr(pyg_models, cls)(NUM_FEATURES, 16, layers, 5, **kwargs).eval()
    with torch.no_grad():
        full = model(x, edge_index)  # PyG on the whole graph, edges in their original order
    loops = graph.self_loop_count()
    seeds = torch.cat([torch.tensor([3, 3]), edge_index[1, edge_index[0] == edge_index[1]][:4],
                       isolated, torch.tensor([17, 0])])
    out = ReferenceSampler(graph.indptr, graph.indices).sample(seeds, [-1] * layers, seed=0)
    served = ServedModel(model, graph.degree(), loops)
    emb = served(x[out.n_id], out.n_id, out.edge_index, out.num_sampled_nodes,
                 out.num_sampled_edges, exact=True)[out.seed_index]
    torch.testing.assert_close(emb, full[seeds], atol=1e-5, rtol=1e-5)


def test_graph_has_what_the_test_claims() -> None:
    edge_index, isolated = awkward_edges(0)
    graph = GraphData.from_edge_index(edge_index, torch.zeros(NUM_NODES, 1), name="awkward")
    loops = graph.self_loop_count()
    assert int(loops.sum()) >= 11 and int(loops.max()) >= 2  # random edges may add loops
    assert int(graph.degree()[isolated].sum()) == 0
    assert bool((graph.indices.unsqueeze(0) != isolated.unsqueeze(1)).all())
    pairs = edge_index[0] * NUM_NODES + edge_index[1]
    assert torch.unique(pairs).numel() < pairs.numel()  # duplicate edges present


def test_gcn_cache_is_not_reused_across_requests() -> None:
    """``cached=True`` would answer every request with the first request's subgraph."""
    edge_index, _ = awkward_edges(0)
    x = torch.randn(NUM_NODES, NUM_FEATURES)
    graph = GraphData.from_edge_index(edge_index, x, name="awkward")
    torch.manual_seed(0)
    model = pyg_models.GCN(NUM_FEATURES, 16, 2, 5, cached=True).eval()
    reference = pyg_models.GCN(NUM_FEATURES, 16, 2, 5).eval()
    reference.load_state_dict(model.state_dict())
    served = ServedModel(model, graph.degree(), graph.self_loop_count())
    uncached = ServedModel(reference, graph.degree(), graph.self_loop_count())
    sampler = ReferenceSampler(graph.indptr, graph.indices)
    for seeds in (torch.tensor([0, 1]), torch.tensor([5, 9, 20])):
        out = sampler.sample(seeds, [3, 3], seed=1)
        args = (x[out.n_id], out.n_id, out.edge_index, out.num_sampled_nodes,
                out.num_sampled_edges)
        torch.testing.assert_close(served(*args, exact=False), uncached(*args, exact=False))


@pytest.mark.parametrize("edges_per_chunk", [1, 7, 1 << 24])
def test_self_loop_count_matches_edge_list(edges_per_chunk: int) -> None:
    edge_index, _ = awkward_edges(1)
    graph = GraphData.from_edge_index(edge_index, torch.zeros(NUM_NODES, 1), name="awkward")
    is_loop = edge_index[0] == edge_index[1]
    expected = torch.bincount(edge_index[1, is_loop], minlength=NUM_NODES)
    assert torch.equal(graph.self_loop_count(edges_per_chunk), expected)


def test_improved_probe_matches_gcn_conv() -> None:
    """The probe agrees with GCNConv itself on whether ``improved`` changes an unweighted graph."""
    from torch_geometric.nn import GCNConv

    torch.manual_seed(0)
    x, edge_index = torch.randn(3, 4), torch.tensor([[0, 1], [1, 2]])
    plain, improved = GCNConv(4, 4), GCNConv(4, 4, improved=True)
    improved.load_state_dict(plain.state_dict())
    differs = not torch.allclose(plain(x, edge_index), improved(x, edge_index))
    assert improved_applies_without_weights() == differs

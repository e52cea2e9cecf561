"""Sampling per edge type (docs/architecture.md, "Typed graphs"): the one-type case is the
homogeneous sampler, a slow per-node loop agrees draw for draw, per-relation draws are uniform
and independent, and the output drives PyG's heterogeneous models, trimmed per layer by PyG's
``trim_to_layer``."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from torch_geometric.data import HeteroData
from torch_geometric.nn import HeteroConv, SAGEConv, to_hetero
from torch_geometric.nn.models import GraphSAGE
from torch_geometric.utils import trim_to_layer

from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.typed import Relation, TypedGraph, add_reverse_edges
from quiver_serve.sampling.base import draw32, node_hash, relation_base, seed_base
from quiver_serve.sampling.reference import ReferenceSampler
from quiver_serve.sampling.typed import TypedReferenceSampler, typed_fanouts


def small_typed(seed: int = 0) -> TypedGraph:
    g = torch.Generator().manual_seed(seed)
    data = HeteroData()
    data["paper"].x = torch.randn(60, 6, generator=g)
    data["author"].x = torch.randn(45, 4, generator=g)
    data["venue"].num_nodes = 5
    sizes = {"paper": 60, "author": 45, "venue": 5}
    for (src, rel, dst), num in ((("author", "writes", "paper"), 200),
                                 (("paper", "cites", "paper"), 260),
                                 (("paper", "in", "venue"), 60)):
        ei = torch.stack([torch.randint(0, sizes[src], (num,), generator=g),
                          torch.randint(0, sizes[dst], (num,), generator=g)])
        data[src, rel, dst].edge_index = ei
        data[src, rel, dst].edge_attr = torch.randn(num, 2, generator=g)
    return add_reverse_edges(TypedGraph.from_hetero_data(data, "papers"))


def slow_sample(graph: TypedGraph, seed_type: str, seeds: list[int], fanouts: dict,
                seed: int) -> dict:
    """The semantics of sampling/typed.py, one node and one draw at a time."""
    base = seed_base(seed)
    node = {t: [] for t in graph.node_types}
    for s in seeds:
        if s not in node[seed_type]:
            node[seed_type].append(s)
    frontier = {t: list(range(len(node[t]))) for t in graph.node_types}
    edges = {et: [] for et in graph.edge_types}
    for hop in range(1, len(next(iter(fanouts.values()))) + 1):
        before = {t: len(node[t]) for t in graph.node_types}
        for r, (et, rel) in enumerate(graph.relations.items()):
            k = fanouts[et][hop - 1]
            for local in frontier[et[2]]:
                v = node[et[2]][local]
                lo, hi = int(rel.indptr[v]), int(rel.indptr[v + 1])
                d = hi - lo
                if k < 0 or d <= k:
                    offsets = list(range(d))
                else:
                    h = node_hash(relation_base(base, r), hop, torch.tensor([v]))
                    offsets = []
                    for i in range(k):
                        t = d - k + i
                        j = (int(draw32(h, i)) * (t + 1)) >> 32
                        offsets.append(t if j in offsets else j)
                for q in offsets:
                    u = int(rel.indices[lo + q])
                    if u not in node[et[0]]:
                        node[et[0]].append(u)
                    edges[et].append((node[et[0]].index(u), local, int(rel.edge_ids()[lo + q])))
        frontier = {t: list(range(before[t], len(node[t]))) for t in graph.node_types}
    return {"node": node, "edges": edges}


@pytest.mark.parametrize("fanouts", [[3, 2], [-1, 2], [2, 2, 1]])
def test_equals_a_slow_per_node_loop(fanouts: list[int]) -> None:
    graph = small_typed()
    per_rel = typed_fanouts(graph, fanouts)
    per_rel[("paper", "cites", "paper")] = [1] * len(fanouts)
    for seed in (0, 7, 2**40 + 3):
        out = TypedReferenceSampler(graph).sample("paper", torch.tensor([4, 9, 4, 30]), per_rel,
                                                  seed)
        slow = slow_sample(graph, "paper", [4, 9, 4, 30], per_rel, seed)
        assert {t: v.tolist() for t, v in out.node.items()} == slow["node"]
        for et in graph.edge_types:
            got = list(zip(*out.edge_index[et].tolist(), out.e_id[et].tolist(), strict=True))
            assert got == slow["edges"][et], et
        assert out.seed_index.tolist() == [0, 1, 0, 2]


def test_one_type_graph_samples_the_homogeneous_numbers(cora: GraphData) -> None:
    typed = TypedReferenceSampler(TypedGraph.from_graph_data(cora))
    plain = ReferenceSampler(cora.indptr, cora.indices)
    et = ("node", "to", "node")
    seeds = torch.tensor([5, 17, 5, 2000, 1])
    for fanouts, seed in (([10, 5], 3), ([4, 4, 4], 99), ([-1, -1], 0)):
        a = plain.sample(seeds, fanouts, seed)
        b = typed.sample("node", seeds, fanouts, seed)
        assert torch.equal(a.n_id, b.node["node"])
        assert torch.equal(a.edge_index, b.edge_index[et])
        assert a.num_sampled_nodes == b.num_sampled_nodes["node"]
        assert a.num_sampled_edges == b.num_sampled_edges[et]


def test_edges_ids_and_features_are_the_graphs() -> None:
    graph = small_typed(1)
    out = TypedReferenceSampler(graph).sample("paper", torch.arange(10), [4, 3], 5)
    attrs = out.edge_attr_dict(graph)
    for et, ei in out.edge_index.items():
        full = graph.relations[et].edge_index()
        src_ids, dst_ids = out.node[et[0]][ei[0]], out.node[et[2]][ei[1]]
        assert torch.equal(full[0, out.e_id[et]], src_ids) and torch.equal(full[1, out.e_id[et]],
                                                                           dst_ids)
        assert torch.equal(attrs[et], graph.relations[et].edge_attr[out.e_id[et]])
        assert sum(out.num_sampled_edges[et]) == ei.size(1)
    for t, ids in out.node.items():
        assert sum(out.num_sampled_nodes[t]) == ids.numel() == ids.unique().numel()
    assert out.num_sampled_nodes["author"][0] == 0 and out.num_sampled_nodes["paper"][0] == 10


def test_same_seed_same_subgraph_other_seed_differs() -> None:
    sampler = TypedReferenceSampler(small_typed())
    seeds = torch.tensor([1, 2, 3])
    a, b, c = (sampler.sample("paper", seeds, [2, 2], s) for s in (11, 11, 12))
    assert all(torch.equal(a.edge_index[et], b.edge_index[et]) for et in a.edge_index)
    assert any(not torch.equal(a.e_id[et], c.e_id[et]) for et in a.e_id)


def twin_relations(degree: int) -> TypedGraph:
    """Paper 0 has the same ``degree`` in-neighbours along two relations."""
    src = torch.arange(degree)
    ei = torch.stack([src, torch.zeros_like(src)])
    rels = {et: Relation.from_edge_index(et, ei, degree, 1)
            for et in (("author", "writes", "paper"), ("author", "reviews", "paper"))}
    return TypedGraph("twin", {"author": degree, "paper": 1}, {}, rels)


def test_per_relation_draws_are_uniform_and_independent() -> None:
    degree, k, trials = 12, 3, 3000
    sampler = TypedReferenceSampler(twin_relations(degree))
    writes, reviews = ("author", "writes", "paper"), ("author", "reviews", "paper")
    hits = {writes: torch.zeros(degree), reviews: torch.zeros(degree)}
    joint = torch.zeros(degree, degree)
    for s in range(trials):
        out = sampler.sample("paper", torch.tensor([0]), [k], s)
        picked = {et: out.node["author"][out.edge_index[et][0]] for et in hits}
        for et in hits:
            hits[et][picked[et]] += 1
        joint[picked[writes][0], picked[reviews][0]] += 1
    for et, counts in hits.items():
        assert counts.sum() == trials * k
        assert chisquare(counts.numpy()).pvalue > 1e-3, et
    # the first draw of one relation tells nothing of the other's: the pairs of first draws
    # (Floyd's first draw is uniform over offsets 0..d-k) are uniform
    first = degree - k + 1
    assert joint[first:].sum() == 0 and joint[:, first:].sum() == 0
    assert chisquare(joint[:first, :first].flatten().numpy()).pvalue > 1e-3


def test_fanouts_errors_name_the_relation() -> None:
    graph = small_typed()
    with pytest.raises(ValueError, match="lack edge types"):
        typed_fanouts(graph, {("author", "writes", "paper"): [2]})
    with pytest.raises(ValueError, match="'likes'"):
        typed_fanouts(graph, {"author__likes__paper": [2]})
    full = {"__".join(et): [2] for et in graph.edge_types}
    full["paper__cites__paper"] = [2, 2]
    with pytest.raises(ValueError, match="same number of layers"):
        typed_fanouts(graph, full)
    with pytest.raises(KeyError, match="'user'"):
        TypedReferenceSampler(graph).sample("user", torch.tensor([0]), [2], 0)
    with pytest.raises(IndexError, match=r"\[0, 5\)"):
        TypedReferenceSampler(graph).sample("venue", torch.tensor([5]), [2], 0)


class TrimmedHeteroSage(torch.nn.Module):
    """Two HeteroConv(SAGEConv) layers that trim with PyG's ``trim_to_layer`` when given the
    per-type hop counts (PyG's documented hierarchical-sampling pattern)."""

    def __init__(self, metadata: tuple) -> None:
        super().__init__()
        self.convs = torch.nn.ModuleList(
            HeteroConv({et: SAGEConv((-1, -1), 8) for et in metadata[1]}, aggr="sum")
            for _ in range(2))

    def forward(self, x_dict, edge_index_dict, nodes=None, edges=None):  # noqa: ANN001, ANN201
        for i, conv in enumerate(self.convs):
            if nodes is not None:
                x_dict, edge_index_dict, _ = trim_to_layer(i, nodes, edges, x_dict,
                                                           edge_index_dict)
            x_dict = conv(x_dict, edge_index_dict)
            if i == 0:
                x_dict = {t: v.relu() for t, v in x_dict.items()}
        return x_dict


def test_output_trims_per_layer_and_exact_mode_is_the_full_graph() -> None:
    graph = small_typed(2)
    x_full = {t: graph.x.get(t, torch.ones(n, 1)) for t, n in graph.num_nodes.items()}
    torch.manual_seed(0)
    models = (TrimmedHeteroSage(graph.metadata()),
              to_hetero(GraphSAGE((-1, -1), 8, 2, 5), graph.metadata(), aggr="sum"))
    sampler = TypedReferenceSampler(graph)
    seeds = torch.tensor([3, 8, 3, 41])
    with torch.no_grad():
        for model in models:
            full = model(x_full, graph.edge_index_dict())["paper"]
            for fanouts in ([3, 2], [-1, -1]):
                out = sampler.sample("paper", seeds, fanouts, 1)
                x = {t: x_full[t][ids] for t, ids in out.node.items()}
                plain = model(x, out.edge_index)["paper"][out.seed_index]
                if isinstance(model, TrimmedHeteroSage):
                    trimmed = model(x, out.edge_index, out.num_sampled_nodes,
                                    out.num_sampled_edges)["paper"]
                    torch.testing.assert_close(trimmed[out.seed_index], plain, rtol=0, atol=1e-5)
            # all fanouts -1: the whole 2-hop neighbourhood, hence the full graph's answer
            torch.testing.assert_close(plain, full[seeds], rtol=0, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_cpp_sampler_is_the_reference_bit_for_bit(threads: int) -> None:
    from quiver_serve.sampling import cpu as cpu_mod
    from quiver_serve.sampling.typed import TypedCppSampler

    if not cpu_mod.cpp_sampler_available():
        pytest.skip(f"no C++ sampler here: {cpu_mod.cpu_sampler_status()}")
    graph = small_typed(3)
    reference, cpp = TypedReferenceSampler(graph), TypedCppSampler(graph)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for fanouts, seed in (([3, 2], 0), ([-1, 1], 5), ([1, 4, 2], 2**50 + 1), ([0, 3], 8)):
            seeds = torch.tensor([7, 0, 7, 59, 33])
            a = reference.sample("paper", seeds, fanouts, seed)
            b = cpp.sample("paper", seeds, fanouts, seed)
            assert all(torch.equal(a.node[t], b.node[t]) for t in graph.node_types)
            for et in graph.edge_types:
                assert torch.equal(a.edge_index[et], b.edge_index[et]), et
                assert torch.equal(a.e_id[et], b.e_id[et]), et
            assert a.num_sampled_nodes == b.num_sampled_nodes
            assert a.num_sampled_edges == b.num_sampled_edges
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_sampling_on_the_graphs_device_is_the_cpu_sample(device: str) -> None:
    graph = small_typed(4)
    cpu = TypedReferenceSampler(graph)
    there = TypedReferenceSampler(graph.to(device))
    assert there.device.type == device
    seeds = torch.tensor([5, 2, 5, 40])
    for fanouts, seed in (([3, 2], 1), ([-1, 2], 6), ([2, 2, 2], 2**33)):
        a = cpu.sample("paper", seeds, fanouts, seed)
        b = there.sample("paper", seeds, fanouts, seed)
        assert all(b.node[t].device.type == device for t in graph.node_types)
        assert all(torch.equal(a.node[t], b.node[t].cpu()) for t in graph.node_types)
        for et in graph.edge_types:
            assert torch.equal(a.edge_index[et], b.edge_index[et].cpu()), et
            assert torch.equal(a.e_id[et], b.e_id[et].cpu()), et
        assert a.num_sampled_edges == b.num_sampled_edges
        attrs = b.edge_attr_dict(graph)
        assert all(torch.equal(attrs[et], a.edge_attr_dict(graph)[et]) for et in attrs)

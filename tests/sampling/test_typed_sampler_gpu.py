"""The typed GPU sampler's kernels (``csrc/typed_hop.cu``) against the torch reference, bit for
bit: relations in GPU memory and in pinned host memory (uva), fanouts below and above a warp
(k > 32: Floyd's draws over several rounds), every neighbour (-1), edge ids and the identity."""

from __future__ import annotations

import pytest
import torch
from torch_geometric.data import HeteroData

from quiver_serve.graph.typed import Relation, TypedGraph, add_reverse_edges
from quiver_serve.sampling.gpu import gpu_sampler_available
from quiver_serve.sampling.typed import TypedReferenceSampler
from quiver_serve.sampling.typed_gpu import TypedGpuSampler

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpu_sampler_available(), reason="needs a CUDA device and CuPy"),
]


def small_typed(seed: int) -> TypedGraph:
    """Papers, authors and venues with edge features and reverse relations (the graph of
    ``test_typed_sampler.py``, built here: this file imports nothing beyond the GPU box's
    packages)."""
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


def assert_same(got, want) -> None:  # noqa: ANN001
    assert got.num_sampled_nodes == want.num_sampled_nodes
    assert got.num_sampled_edges == want.num_sampled_edges
    for t in want.node:
        assert torch.equal(got.node[t].cpu(), want.node[t]), t
    for et in want.edge_index:
        assert torch.equal(got.edge_index[et].cpu(), want.edge_index[et]), et
        assert torch.equal(got.e_id[et].cpu(), want.e_id[et]), et
    assert torch.equal(got.seed_index.cpu(), want.seed_index)


@pytest.mark.parametrize("mode", ["device", "uva"])
@pytest.mark.parametrize("fanouts", [[3, 2], [40, 5], [-1, -1], [25, 10]])
def test_kernels_sample_the_references_subgraph(mode: str, fanouts: list[int]) -> None:
    graph = small_typed(seed=3)
    ref = TypedReferenceSampler(graph)
    gpu = TypedGpuSampler(graph, torch.device("cuda", 0), mode)
    assert gpu.kernels is not None
    for seed, ids in ((0, [0, 5, 5, 59]), (7, list(range(60))), (2**40 + 3, [11])):
        seeds = torch.tensor(ids)
        assert_same(gpu.sample("paper", seeds, fanouts, seed),
                    ref.sample("paper", seeds, fanouts, seed))
        assert_same(gpu.sample("author", seeds[seeds < 45], fanouts, seed),
                    ref.sample("author", seeds[seeds < 45], fanouts, seed))
        # seeds already on the device: hop 0 by the kernels, not the host
        assert_same(gpu.sample("paper", seeds.cuda(), fanouts, seed),
                    ref.sample("paper", seeds, fanouts, seed))
    gpu.close()


def test_high_degree_lists_draw_the_references_neighbours() -> None:
    """Lists of thousands of entries: whole lists (-1) and k-of-n draws with k above a warp."""
    g = torch.Generator().manual_seed(0)
    data = HeteroData()
    data["a"].x = torch.randn(300, 2, generator=g)
    data["b"].x = torch.randn(4, 2, generator=g)
    src = torch.randint(0, 300, (9000,), generator=g)
    dst = torch.randint(0, 4, (9000,), generator=g)
    data["a", "to", "b"].edge_index = torch.stack([src, dst])
    data["b", "back", "a"].edge_index = torch.stack([dst, src])
    graph = TypedGraph.from_hetero_data(data, "dense")
    et = ("a", "to", "b")
    rel = graph.relations[et]
    graph.relations[et] = Relation(et, rel.indptr, rel.indices)  # edge ids: CSC positions
    ref, gpu = TypedReferenceSampler(graph), TypedGpuSampler(graph, torch.device("cuda", 0))
    for fanouts in ([70, 3], [-1, 2], [1000, 1]):
        seeds = torch.tensor([0, 1, 2, 3])
        assert_same(gpu.sample("b", seeds, fanouts, 5), ref.sample("b", seeds, fanouts, 5))

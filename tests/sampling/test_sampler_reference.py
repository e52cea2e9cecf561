"""The reference sampler implements docs/architecture.md, "Sampling"; other samplers are tested
against it."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from quiver_serve.graph.csc import GraphData
from quiver_serve.sampling.reference import ReferenceSampler, unique_first


def star(degree: int) -> GraphData:
    """Node 0 has in-neighbours 1..degree."""
    src = torch.arange(1, degree + 1)
    ei = torch.stack([src, torch.zeros_like(src)])
    return GraphData.from_edge_index(ei, torch.zeros(degree + 1, 1), "star")


def edge_set(g: GraphData) -> set[tuple[int, int]]:
    ei = g.edge_index()
    return set(zip(ei[0].tolist(), ei[1].tolist(), strict=True))


def test_unique_first_keeps_first_occurrence_order() -> None:
    u, inv = unique_first(torch.tensor([5, 3, 5, 9, 3, 1]))
    assert u.tolist() == [5, 3, 9, 1]
    assert inv.tolist() == [0, 1, 0, 2, 1, 3]


def test_output_shape_and_seed_rows(cora: GraphData) -> None:
    s = ReferenceSampler(cora.indptr, cora.indices)
    seeds = torch.tensor([7, 3, 7, 2707, 3])
    out = s.sample(seeds, [5, 3], seed=1)
    assert out.n_id[:3].tolist() == [7, 3, 2707]  # unique seeds first, request order
    assert torch.equal(out.n_id[out.seed_index], seeds)
    assert len(out.num_sampled_nodes) == 3 and len(out.num_sampled_edges) == 2
    assert sum(out.num_sampled_nodes) == out.n_id.numel() == out.n_id.unique().numel()
    assert sum(out.num_sampled_edges) == out.edge_index.size(1)


def test_every_edge_exists_and_counts_are_min_k_deg(cora: GraphData) -> None:
    s = ReferenceSampler(cora.indptr, cora.indices)
    edges = edge_set(cora)
    k = 3
    out = s.sample(torch.arange(0, 2708, 7), [k, 2], seed=42)
    src, dst = out.n_id[out.edge_index[0]], out.n_id[out.edge_index[1]]
    assert all((u, v) in edges for u, v in zip(src.tolist(), dst.tolist(), strict=True))
    hop1 = out.num_sampled_edges[0]
    targets = out.edge_index[1, :hop1]
    counts = torch.bincount(targets, minlength=out.num_sampled_nodes[0])
    expected = torch.clamp(cora.degree()[out.n_id[: out.num_sampled_nodes[0]]], max=k)
    assert torch.equal(counts, expected)
    pairs = set(zip(src[:hop1].tolist(), dst[:hop1].tolist(), strict=True))
    assert len(pairs) == hop1  # without replacement: no neighbour twice for one node


def test_exact_mode_takes_whole_neighbourhoods(cora: GraphData) -> None:
    s = ReferenceSampler(cora.indptr, cora.indices)
    out = s.sample(torch.tensor([0, 1]), [-1, -1], seed=0)
    hop1 = out.num_sampled_edges[0]
    got = sorted(out.n_id[out.edge_index[0, :hop1]].tolist())
    want = sorted(torch.cat([cora.indices[cora.indptr[v]:cora.indptr[v + 1]] for v in (0, 1)]).tolist())
    assert got == want
    again = s.sample(torch.tensor([0, 1]), [-1, -1], seed=999)
    assert torch.equal(out.edge_index, again.edge_index)  # exact mode ignores the seed


def test_same_seed_same_subgraph_different_seed_differs(cora: GraphData) -> None:
    s = ReferenceSampler(cora.indptr, cora.indices)
    seeds = torch.arange(0, 2708, 11)
    a, b = s.sample(seeds, [4, 4], 5), s.sample(seeds, [4, 4], 5)
    c = s.sample(seeds, [4, 4], 6)
    assert torch.equal(a.n_id, b.n_id) and torch.equal(a.edge_index, b.edge_index)
    assert not torch.equal(a.n_id, c.n_id)


@pytest.mark.parametrize("degree,k", [(20, 5), (7, 6), (50, 1)])
def test_uniform_inclusion_chi_square(degree: int, k: int) -> None:
    """Each neighbour is drawn with probability k/d, never twice for one node."""
    g = star(degree)
    s = ReferenceSampler(g.indptr, g.indices)
    hits = torch.zeros(degree + 1, dtype=torch.int64)
    for t in range(3000):
        out = s.sample(torch.tensor([0]), [k], seed=t)
        nbrs = out.n_id[out.edge_index[0]]
        assert nbrs.unique().numel() == k
        hits += torch.bincount(nbrs, minlength=degree + 1)
    assert chisquare(hits[1:].numpy()).pvalue > 1e-3


def test_every_subset_equally_likely() -> None:
    """Uniform without replacement means all C(5, 2) = 10 neighbour sets are equally likely."""
    g = star(5)
    s = ReferenceSampler(g.indptr, g.indices)
    counts: dict[tuple[int, ...], int] = {}
    for t in range(4000):
        out = s.sample(torch.tensor([0]), [2], seed=t)
        key = tuple(sorted(out.n_id[out.edge_index[0]].tolist()))
        counts[key] = counts.get(key, 0) + 1
    assert len(counts) == 10
    assert chisquare(list(counts.values())).pvalue > 1e-3


def test_degree_zero_and_small_degree_nodes() -> None:
    ei = torch.tensor([[1, 2], [0, 0]])  # node 0 <- 1, 2; nodes 1, 2, 3 have no in-neighbours
    g = GraphData.from_edge_index(ei, torch.zeros(4, 1), "tiny")
    out = ReferenceSampler(g.indptr, g.indices).sample(torch.tensor([3, 0]), [5, 5], seed=0)
    assert out.n_id.tolist() == [3, 0, 1, 2]
    assert out.num_sampled_nodes == [2, 2, 0] and out.num_sampled_edges == [2, 0]

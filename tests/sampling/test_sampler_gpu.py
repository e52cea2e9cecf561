"""The CUDA samplers (device-resident CSC and UVA) against the pure-torch reference, bit for bit.

Every test is ``gpu``-marked and skips without CUDA and CuPy. The file also runs on a bare GPU box
without the server's dependencies (pydantic, ...): then only the dependency-free modules are
imported (see ``_light_package_import``), and pytest is run with ``--noconftest`` by
``python -m bench.gpu gate``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
CORA_RAW = REPO_ROOT / "quiver_serve" / "defaults" / "planetoid" / "cora" / "raw"  # package data



from quiver_serve.graph.csc import GraphData  # noqa: E402
from quiver_serve.sampling.base import SamplerOutput  # noqa: E402
from quiver_serve.sampling.gpu import CudaSampler, UvaSampler, gpu_sampler_available  # noqa: E402
from quiver_serve.sampling.reference import ReferenceSampler  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpu_sampler_available(), reason="needs a CUDA device and CuPy"),
]

MODES = ["cuda", "uva"]
# Significance of the goodness-of-fit tests; draws are a pure function of the seed, so a given
# seed passes or fails deterministically.
ALPHA = 1e-3


def make(
    mode: str, graph: GraphData, items_per_block: int | None = None
) -> CudaSampler | UvaSampler:
    sampler = (CudaSampler if mode == "cuda" else UvaSampler)(graph.indptr, graph.indices, device=0)
    if items_per_block is not None:
        sampler.items_per_block = items_per_block  # small values force multi-block grids
    return sampler


def assert_same(gpu: SamplerOutput, ref: SamplerOutput) -> None:
    assert gpu.n_id.is_cuda and gpu.edge_index.is_cuda and gpu.seed_index.is_cuda
    assert torch.equal(gpu.n_id.cpu(), ref.n_id)
    assert torch.equal(gpu.edge_index.cpu(), ref.edge_index)
    assert torch.equal(gpu.seed_index.cpu(), ref.seed_index)
    assert gpu.num_sampled_nodes == ref.num_sampled_nodes
    assert gpu.num_sampled_edges == ref.num_sampled_edges


@pytest.fixture(scope="module")
def cora() -> GraphData:
    # Read the raw Planetoid files directly: graph.datasets imports the config (pydantic).
    from torch_geometric.io import read_planetoid_data

    data = read_planetoid_data(str(CORA_RAW), "cora")
    return GraphData.from_edge_index(data.edge_index, data.x, name="cora")


def random_graph(num_nodes: int, num_edges: int, gen: torch.Generator) -> GraphData:
    """Random multigraph; targets are the low half of the ids, so the high half has degree 0."""
    src = torch.randint(0, num_nodes, (num_edges,), generator=gen)
    dst = torch.randint(0, max(1, num_nodes // 2), (num_edges,), generator=gen)
    return GraphData.from_edge_index(
        torch.stack([src, dst]), torch.zeros(num_nodes, 1), name="random"
    )


def power_law_graph(num_nodes: int, mean_degree: int, gen: torch.Generator) -> GraphData:
    """Pareto in-degrees (hubs far above any fanout) with preferentially chosen sources."""
    u = torch.rand(num_nodes, generator=gen, dtype=torch.float64)
    degree = (mean_degree / 3 * u.pow(-1 / 1.5)).clamp(max=num_nodes // 4).long()
    degree[torch.rand(num_nodes, generator=gen) < 0.05] = 0
    weights = torch.rand(num_nodes, generator=gen, dtype=torch.float64).pow(-1.2)
    cdf = torch.cumsum(weights, 0) / weights.sum()
    src = torch.searchsorted(cdf, torch.rand(int(degree.sum()), generator=gen, dtype=torch.float64))
    dst = torch.repeat_interleave(torch.arange(num_nodes), degree)
    edges = torch.stack([src.clamp(max=num_nodes - 1), dst])
    return GraphData.from_edge_index(edges, torch.zeros(num_nodes, 1), name="power-law")


# ---- bit-identical to the reference ---------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fanouts", [[25, 10], [10, 5, 3], [-1, -1], [100], [1], []])
def test_cora_matches_reference(cora, mode, fanouts) -> None:
    gpu, ref = make(mode, cora), ReferenceSampler(cora.indptr, cora.indices)
    gen = torch.Generator().manual_seed(len(fanouts))
    for batch in (1, 37, 600, cora.num_nodes):
        for seed in (0, 12345, 2**63 - 1):
            seeds = torch.randint(0, cora.num_nodes, (batch,), generator=gen)
            assert_same(gpu.sample(seeds, fanouts, seed), ref.sample(seeds, fanouts, seed))


@pytest.mark.parametrize("mode", MODES)
def test_multi_block_grids_match_reference(cora, mode) -> None:
    """Tiny work per block: small batches then run on many blocks and meet at grid barriers."""
    gpu, ref = make(mode, cora, items_per_block=4), ReferenceSampler(cora.indptr, cora.indices)
    gen = torch.Generator().manual_seed(1)
    for fanouts in ([25, 10], [3, 3, 3], [-1], [40, -1]):
        for batch in (1, 5, 64, 700):
            seeds = torch.randint(0, cora.num_nodes, (batch,), generator=gen)
            assert_same(gpu.sample(seeds, fanouts, batch), ref.sample(seeds, fanouts, batch))


@pytest.mark.parametrize("mode", MODES)
def test_random_graphs_match_reference(mode) -> None:
    gen = torch.Generator().manual_seed(7)
    fanout_choices = [[2], [3, -1], [-1], [1000], [4, 2, 1], [-1, 3, 2], [70, 2], [33, 0]]
    for trial in range(48):
        num_nodes = int(torch.randint(1, 400, (1,), generator=gen))
        # The dense graphs exercise fanouts above 32 (two rounds of the warp's draws).
        density = [0.5, 3, 150][trial % 3]
        graph = random_graph(num_nodes, int(num_nodes * density), gen)
        gpu, ref = (
            make(mode, graph, items_per_block=[2048, 8][trial % 2]),
            ReferenceSampler(graph.indptr, graph.indices),
        )
        # Repeated ids, and every length from one node to more than all of them.
        batch = int(torch.randint(1, 2 * num_nodes + 2, (1,), generator=gen))
        seeds = torch.randint(0, num_nodes, (batch,), generator=gen)
        fanouts = fanout_choices[trial % len(fanout_choices)]
        assert_same(gpu.sample(seeds, fanouts, trial), ref.sample(seeds, fanouts, trial))


@pytest.mark.parametrize("mode", MODES)
def test_large_batches_on_power_law_graph(mode) -> None:
    gen = torch.Generator().manual_seed(3)
    graph = power_law_graph(30_000, 40, gen)
    assert int(graph.degree().max()) > 1000  # hubs of degree >> k
    gpu, ref = make(mode, graph), ReferenceSampler(graph.indptr, graph.indices)
    for batch, fanouts in ((8192, [25, 10]), (2048, [5, 5, 5]), (4096, [-1])):
        seeds = torch.randint(0, graph.num_nodes, (batch,), generator=gen)
        seeds[batch // 2 :: 7] = seeds[: len(seeds[batch // 2 :: 7])]  # duplicates
        assert_same(gpu.sample(seeds, fanouts, batch), ref.sample(seeds, fanouts, batch))


@pytest.mark.parametrize("mode", MODES)
def test_exact_mode_matches_reference(cora, mode) -> None:
    gpu, ref = make(mode, cora), ReferenceSampler(cora.indptr, cora.indices)
    seeds = torch.arange(0, cora.num_nodes, 3)
    assert_same(gpu.sample(seeds, [-1, -1], 1), ref.sample(seeds, [-1, -1], 1))
    out = gpu.sample(torch.tensor([3, 1000]), [-1], seed=5)
    want = torch.cat([cora.indices[cora.indptr[v] : cora.indptr[v + 1]] for v in (3, 1000)])
    assert torch.equal(out.n_id[out.edge_index[0]].cpu(), want)  # CSC order, nothing dropped


@pytest.mark.parametrize("mode", MODES)
def test_buffers_regrow_when_a_hop_exceeds_the_guess(mode) -> None:
    graph = power_law_graph(5_000, 30, torch.Generator().manual_seed(4))
    gpu, ref = make(mode, graph), ReferenceSampler(graph.indptr, graph.indices)
    gpu.hop_edges_guess = 16  # every -1 hop overflows once, then the batch is re-run
    seeds = torch.arange(0, 200)
    assert_same(gpu.sample(seeds, [-1, -1], 9), ref.sample(seeds, [-1, -1], 9))
    assert gpu.hop_edges_guess > 16


def test_uva_equals_cuda_and_reads_the_csc_in_place(cora) -> None:
    indptr, indices = cora.indptr.clone().share_memory_(), cora.indices.clone().share_memory_()
    uva, cuda = UvaSampler(indptr, indices, device=0), CudaSampler(indptr, indices, device=0)
    assert indices.is_pinned() and indptr.is_pinned()  # pinned where it lies, not copied
    seeds = torch.randint(0, cora.num_nodes, (300,))
    want = cuda.sample(seeds, [10, 5], 3)
    for sampler in (uva, second := UvaSampler(indptr, indices, device=0)):
        got = sampler.sample(seeds, [10, 5], 3)
        assert torch.equal(got.n_id, want.n_id) and torch.equal(got.edge_index, want.edge_index)
    uva.close()
    assert indices.is_pinned()  # the second sampler still reads it
    assert torch.equal(second.sample(seeds, [10, 5], 3).edge_index, want.edge_index)
    second.close()
    assert not indices.is_pinned()


# ---- properties of one sample ---------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fanouts", [[25, 10], [3, 3, 3], [-1, 5]])
def test_edges_exist_and_counts_are_min_k_deg(cora, mode, fanouts) -> None:
    out = make(mode, cora).sample(torch.arange(0, cora.num_nodes, 7), fanouts, seed=99)
    n_id, edge_index = out.n_id.cpu(), out.edge_index.cpu()
    src, dst = n_id[edge_index[0]], n_id[edge_index[1]]
    graph_edges = cora.edge_index()
    assert set((dst * cora.num_nodes + src).tolist()) <= set(
        (graph_edges[1] * cora.num_nodes + graph_edges[0]).tolist()
    )
    assert torch.unique(n_id).numel() == n_id.numel()
    degree, first_edge = cora.degree(), 0
    for hop, k in enumerate(fanouts):
        cols = edge_index[1, first_edge : first_edge + out.num_sampled_edges[hop]]
        rows = edge_index[0, first_edge : first_edge + out.num_sampled_edges[hop]]
        lo = sum(out.num_sampled_nodes[:hop])
        frontier_degree = degree[n_id[lo : lo + out.num_sampled_nodes[hop]]]
        want = frontier_degree if k < 0 else frontier_degree.clamp(max=k)
        assert torch.equal(torch.bincount(cols - lo, minlength=want.numel()), want)
        pairs = torch.stack([cols, rows], 1)
        assert torch.unique(pairs, dim=0).size(0) == pairs.size(0), "a node drew a neighbour twice"
        first_edge += out.num_sampled_edges[hop]


def chi2_sf(statistic: float, dof: int) -> float:
    """Upper tail of chi-square: scipy's when present, else the Wilson-Hilferty approximation."""
    try:
        from scipy.stats import chi2

        return float(chi2.sf(statistic, dof))
    except ImportError:
        z = ((statistic / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
        return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("degree", "k"), [(20, 5), (200, 80)])
def test_star_centres_sample_uniformly(mode, degree, k) -> None:
    """``centres`` stars share the leaves 0..degree-1: one batch gives that many k-of-d draws."""
    centres = 4000 if degree == 20 else 600
    leaves = torch.arange(degree).repeat(centres)
    targets = torch.arange(degree, degree + centres).repeat_interleave(degree)
    graph = GraphData.from_edge_index(
        torch.stack([leaves, targets]), torch.zeros(degree + centres, 1), name="stars"
    )
    out = make(mode, graph).sample(torch.arange(degree, degree + centres), [k], seed=2024)
    leaf = out.n_id[out.edge_index[0]].view(centres, k).cpu()
    assert (leaf.sort(1).values.diff(dim=1) > 0).all(), "a draw repeated a neighbour"
    # Each leaf is in a draw with probability p = k/d; the counts of one draw are k distinct hits,
    # so Pearson's statistic over (1-p) d/(d-1) is chi-square with d-1 degrees of freedom.
    hits = torch.bincount(leaf.flatten(), minlength=degree).double()
    expected = centres * k / degree
    pearson = float(((hits - expected) ** 2 / expected).sum())
    assert chi2_sf(pearson / ((1 - k / degree) * degree / (degree - 1)), degree - 1) > ALPHA


@pytest.mark.parametrize("mode", MODES)
def test_same_seed_same_subgraph_other_seed_differs(cora, mode) -> None:
    gpu = make(mode, cora)
    seeds = torch.arange(0, 300)
    first, again, other = (gpu.sample(seeds, [10, 5], s) for s in (7, 7, 8))
    assert torch.equal(first.n_id, again.n_id) and torch.equal(first.edge_index, again.edge_index)
    assert not torch.equal(first.edge_index, other.edge_index)


# ---- inputs, errors, streams --------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_request_forms_and_bad_input(cora, mode) -> None:
    gpu, ref = make(mode, cora), ReferenceSampler(cora.indptr, cora.indices)
    for seeds in (
        torch.tensor([5, 9, 5], dtype=torch.int32),
        torch.tensor([5, 9, 5], device="cuda"),
    ):
        assert_same(gpu.sample(seeds, [4, 4], 3), ref.sample(seeds.cpu(), [4, 4], 3))
    empty = gpu.sample(torch.tensor([], dtype=torch.int64), [5, 5], 1)
    assert empty.num_sampled_nodes == [0, 0, 0] and empty.edge_index.shape == (2, 0)
    for bad in (torch.tensor([0, cora.num_nodes]), torch.tensor([-1])):
        with pytest.raises(IndexError, match=str(cora.num_nodes)):
            gpu.sample(bad, [5], seed=0)
    with pytest.raises(ValueError, match="seed"):
        gpu.sample(torch.tensor([0]), [5], seed=-3)
    seeds = torch.arange(50)  # the sampler is clean after the errors
    assert_same(gpu.sample(seeds, [5, 5], 2), ref.sample(seeds, [5, 5], 2))


@pytest.mark.parametrize("mode", MODES)
def test_runs_on_the_callers_stream(cora, mode) -> None:
    gpu, ref = make(mode, cora), ReferenceSampler(cora.indptr, cora.indices)
    seeds = torch.arange(0, 500)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        out = gpu.sample(seeds, [10, 10], 4)
        assert out.edge_index.is_contiguous()
        doubled = out.edge_index * 2  # consumed on the same stream, no extra sync
    torch.cuda.synchronize()
    assert torch.equal(doubled.cpu(), ref.sample(seeds, [10, 10], 4).edge_index * 2)

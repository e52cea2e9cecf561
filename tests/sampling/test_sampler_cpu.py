"""The C++ CPU sampler against the pure-torch reference (the ground truth), plus its statistics.

Every test that needs the extension skips when it cannot be built here; the fallback tests run
everywhere. ``cora`` comes from conftest.
"""

from __future__ import annotations

import itertools
import pickle

import pytest
import torch
from scipy.stats import chi2, chisquare

from quiver_serve.graph.csc import GraphData
from quiver_serve.sampling import ReferenceSampler, make_cpu_sampler
from quiver_serve.sampling import cpu as cpu_mod
from quiver_serve.sampling.base import BaseSampler, SamplerOutput

# Significance of the goodness-of-fit tests; the draws are a pure function of the seed, so a
# given seed either passes or fails deterministically (no flakiness).
ALPHA = 1e-3


@pytest.fixture(scope="module")
def cpp_ok() -> None:
    if not cpu_mod.cpp_sampler_available():
        pytest.skip(f"C++ sampler unavailable: {cpu_mod.cpu_sampler_status()}")


@pytest.fixture
def threads(request: pytest.FixtureRequest):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def assert_same(a: SamplerOutput, b: SamplerOutput) -> None:
    assert torch.equal(a.n_id, b.n_id)
    assert torch.equal(a.edge_index, b.edge_index)
    assert torch.equal(a.seed_index, b.seed_index)
    assert a.num_sampled_nodes == b.num_sampled_nodes
    assert a.num_sampled_edges == b.num_sampled_edges
    assert a.n_id.dtype == a.edge_index.dtype == a.seed_index.dtype == torch.int64


def random_graph(num_nodes: int, num_edges: int, gen: torch.Generator) -> GraphData:
    """Random multigraph; the low half of the ids draw more edges, so some nodes have degree 0."""
    src = torch.randint(0, num_nodes, (num_edges,), generator=gen)
    dst = torch.randint(0, max(1, num_nodes // 2), (num_edges,), generator=gen)
    x = torch.zeros(num_nodes, 1)
    return GraphData.from_edge_index(torch.stack([src, dst]), x, name="random")


def both(graph: GraphData) -> tuple[BaseSampler, BaseSampler]:
    return cpu_mod.CppSampler(graph.indptr, graph.indices), ReferenceSampler(graph.indptr, graph.indices)


# ---- bit-identical to the reference ---------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("fanouts", [[25, 10], [10, 5, 3], [-1, -1], [100], [1], []])
def test_cora_matches_reference(cpp_ok, cora, threads, fanouts) -> None:
    cpp, ref = both(cora)
    gen = torch.Generator().manual_seed(len(fanouts) * 7 + threads)
    # Batch sizes span the sequential path (1) and frontiers large enough to run in parallel.
    for batch, seed in itertools.product([1, 37, 600, cora.num_nodes], [0, 12345, 2**63 - 1]):
        seeds = torch.randint(0, cora.num_nodes, (batch,), generator=gen)
        assert_same(cpp.sample(seeds, fanouts, seed), ref.sample(seeds, fanouts, seed))


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_random_graphs_match_reference(cpp_ok, threads) -> None:
    gen = torch.Generator().manual_seed(threads)
    fanout_choices = [[2], [3, -1], [-1], [1000], [4, 2, 1], [-1, 3, 2], [70, 2]]
    for trial in range(60):
        num_nodes = int(torch.randint(1, 400, (1,), generator=gen))
        density = [0.5, 3, 150][trial % 3]  # the dense graphs exercise fanouts above 64
        graph = random_graph(num_nodes, int(num_nodes * density), gen)
        cpp, ref = both(graph)
        # Repeated ids in the request, and every length from one node to more than all of them.
        seeds = torch.randint(0, num_nodes, (int(torch.randint(1, 2 * num_nodes + 2, (1,), generator=gen)),),
                              generator=gen)
        fanouts = fanout_choices[trial % len(fanout_choices)]
        assert_same(cpp.sample(seeds, fanouts, trial), ref.sample(seeds, fanouts, trial))
    # Frontiers of thousands of nodes, so the threads really split the work.
    graph = random_graph(6000, 40_000, gen)
    cpp, ref = both(graph)
    seeds = torch.randint(0, 6000, (3000,), generator=gen)
    for fanouts in ([3, -1, 2], [-1, -1], [1000, 4]):
        assert_same(cpp.sample(seeds, fanouts, 77), ref.sample(seeds, fanouts, 77))


def test_empty_request_and_isolated_nodes(cpp_ok) -> None:
    graph = GraphData.from_edge_index(torch.tensor([[1], [2]]), torch.zeros(4, 1), name="tiny")
    cpp, ref = both(graph)
    for seeds in (torch.tensor([], dtype=torch.int64), torch.tensor([0, 3, 0]), torch.tensor([2, 2])):
        assert_same(cpp.sample(seeds, [5, -1], 1), ref.sample(seeds, [5, -1], 1))


def test_int32_request_ids_are_accepted(cpp_ok, cora) -> None:
    cpp, ref = both(cora)
    seeds = torch.tensor([5, 9, 5], dtype=torch.int32)
    assert_same(cpp.sample(seeds, [4, 4], 3), ref.sample(seeds, [4, 4], 3))


# ---- properties of one sample ---------------------------------------------------------------


@pytest.mark.parametrize("fanouts", [[25, 10], [3, 3, 3], [-1, 5]])
def test_edges_exist_and_counts_are_min_k_deg(cpp_ok, cora, fanouts) -> None:
    cpp = cpu_mod.CppSampler(cora.indptr, cora.indices)
    out = cpp.sample(torch.arange(0, cora.num_nodes, 7), fanouts, seed=99)
    src, dst = out.n_id[out.edge_index[0]], out.n_id[out.edge_index[1]]
    # Every sampled edge is a graph edge: src is an in-neighbour of dst.
    graph_keys = set((cora.edge_index()[1] * cora.num_nodes + cora.edge_index()[0]).tolist())
    assert set((dst * cora.num_nodes + src).tolist()) <= graph_keys
    degree = cora.degree()
    first_edge = 0
    for hop, k in enumerate(fanouts):
        cols = out.edge_index[1, first_edge:first_edge + out.num_sampled_edges[hop]]
        rows = out.edge_index[0, first_edge:first_edge + out.num_sampled_edges[hop]]
        lo = sum(out.num_sampled_nodes[:hop])
        frontier = torch.arange(lo, lo + out.num_sampled_nodes[hop])
        want = degree[out.n_id[frontier]] if k < 0 else degree[out.n_id[frontier]].clamp(max=k)
        assert torch.equal(torch.bincount(cols - lo, minlength=frontier.numel()), want)
        pairs = torch.stack([cols, rows], 1)
        assert torch.unique(pairs, dim=0).size(0) == pairs.size(0), "a node drew a neighbour twice"
        first_edge += out.num_sampled_edges[hop]


def test_same_seed_same_subgraph_other_seed_differs(cpp_ok, cora) -> None:
    cpp = cpu_mod.CppSampler(cora.indptr, cora.indices)
    seeds = torch.arange(0, 300)
    assert_same(cpp.sample(seeds, [10, 5], 7), cpp.sample(seeds, [10, 5], 7))
    other = cpp.sample(seeds, [10, 5], 8)
    assert not torch.equal(cpp.sample(seeds, [10, 5], 7).edge_index, other.edge_index)


def test_exact_mode_is_the_whole_neighbourhood(cpp_ok, cora) -> None:
    cpp = cpu_mod.CppSampler(cora.indptr, cora.indices)
    out = cpp.sample(torch.tensor([3, 1000]), [-1], seed=5)
    want = torch.cat([cora.indices[cora.indptr[v]:cora.indptr[v + 1]] for v in (3, 1000)])
    assert torch.equal(out.n_id[out.edge_index[0]], want)  # CSC order, nothing dropped


def star_bundle(num_centres: int, degree: int) -> GraphData:
    """``num_centres`` stars sharing the leaves 0..degree-1: one batch gives that many draws."""
    leaves = torch.arange(degree).repeat(num_centres)
    centres = torch.arange(degree, degree + num_centres).repeat_interleave(degree)
    return GraphData.from_edge_index(torch.stack([leaves, centres]), torch.zeros(degree + num_centres, 1),
                                     name="stars")


@pytest.mark.parametrize("impl", ["reference", "cpp"])
@pytest.mark.parametrize(("degree", "k"), [(20, 5), (200, 80)])
def test_uniform_without_replacement_chi_square(impl, degree, k, request) -> None:
    if impl == "cpp":
        request.getfixturevalue("cpp_ok")
    num_centres = 4000 if degree == 20 else 600
    graph = star_bundle(num_centres, degree)
    sampler = (cpu_mod.CppSampler if impl == "cpp" else ReferenceSampler)(graph.indptr, graph.indices)
    out = sampler.sample(torch.arange(degree, degree + num_centres), [k], seed=2024)
    leaf = out.n_id[out.edge_index[0]].view(num_centres, k)  # row i: the draw of centre i
    assert (leaf.sort(1).values.diff(dim=1) > 0).all(), "a draw repeated a neighbour"
    # Each neighbour is in a draw with probability p = k/d. A draw adds k distinct hits, so the
    # counts have covariance M p (1-p) d/(d-1) (I - 11'/d), not the multinomial's: Pearson's
    # statistic divided by (1-p) d/(d-1) is chi-square with d-1 degrees of freedom.
    hits = torch.bincount(leaf.flatten(), minlength=degree).double()
    scale = (1 - k / degree) * degree / (degree - 1)
    assert chi2.sf(chisquare(hits.numpy()).statistic / scale, degree - 1) > ALPHA
    # Each pair with probability k(k-1)/(d(d-1)): catches correlated draws that still look
    # uniform one neighbour at a time (plain Pearson here, which is conservative for these counts).
    a, b = torch.triu_indices(k, k, offset=1)
    lo, hi = torch.minimum(leaf[:, a], leaf[:, b]), torch.maximum(leaf[:, a], leaf[:, b])
    pair_hits = torch.bincount((lo * degree + hi).flatten(), minlength=degree * degree).double()
    i, j = torch.triu_indices(degree, degree, offset=1)
    assert chisquare(pair_hits[i * degree + j].numpy()).pvalue > ALPHA


# ---- bad input and the fallback -------------------------------------------------------------


def test_bad_input_raises_clear_errors(cpp_ok, cora) -> None:
    with pytest.raises(TypeError, match="indptr"):
        cpu_mod.CppSampler(cora.indptr.to(torch.int32), cora.indices)
    with pytest.raises(TypeError, match="indices"):
        cpu_mod.CppSampler(cora.indptr, cora.indices.double())
    with pytest.raises(ValueError, match="contiguous"):
        cpu_mod.CppSampler(cora.indptr, torch.stack([cora.indices, cora.indices], 1)[:, 0])
    with pytest.raises(ValueError, match="indptr"):
        cpu_mod.CppSampler(cora.indptr, cora.indices[:-1])
    cpp = cpu_mod.CppSampler(cora.indptr, cora.indices)
    with pytest.raises(IndexError, match=str(cora.num_nodes)):
        cpp.sample(torch.tensor([0, cora.num_nodes]), [5], seed=0)
    with pytest.raises(IndexError):
        cpp.sample(torch.tensor([-1]), [5], seed=0)
    with pytest.raises(ValueError, match="seed"):
        cpp.sample(torch.tensor([0]), [5], seed=-3)
    # The kernel checks again for callers that bypass the wrapper.
    with pytest.raises(TypeError, match="int64"):
        cpp._sample_neighbors(cora.indptr.int(), cora.indices, torch.tensor([0]), [5], 0)
    bad = cora.indptr.clone()
    bad[11] = bad[10] - 1  # a negative degree
    with pytest.raises(ValueError, match="valid CSC"):
        cpp._sample_neighbors(bad, cora.indices, torch.tensor([10]), [5], 0)


def test_graph_is_read_in_place(cpp_ok, cora) -> None:
    cpp = cpu_mod.CppSampler(cora.indptr, cora.indices)
    assert cpp.indptr.data_ptr() == cora.indptr.data_ptr()
    assert cpp.indices.data_ptr() == cora.indices.data_ptr()


def test_pickles_for_spawned_workers(cpp_ok, cora) -> None:
    cpp = cpu_mod.CppSampler(cora.indptr, cora.indices)
    clone = pickle.loads(pickle.dumps(cpp))
    assert_same(clone.sample(torch.arange(50), [5, 5], 1), cpp.sample(torch.arange(50), [5, 5], 1))


def test_disable_env_forces_reference(monkeypatch, cora) -> None:
    monkeypatch.setenv(cpu_mod.DISABLE_ENV, "1")
    assert not cpu_mod.cpp_sampler_available()
    assert isinstance(make_cpu_sampler(cora.indptr, cora.indices), ReferenceSampler)
    assert cpu_mod.DISABLE_ENV in cpu_mod.cpu_sampler_status()


def test_missing_compiler_falls_back(monkeypatch, cora) -> None:
    for name, value in (("WITH_CPP_SAMPLER", None), ("_extension", None), ("_build_reason", "")):
        monkeypatch.setattr(cpu_mod, name, value)
    monkeypatch.delenv(cpu_mod.DISABLE_ENV, raising=False)
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    assert not cpu_mod.cpp_sampler_available()
    assert cpu_mod.WITH_CPP_SAMPLER is False
    assert "no-such-compiler-xyz" in cpu_mod.cpu_sampler_status()
    assert isinstance(make_cpu_sampler(cora.indptr, cora.indices), ReferenceSampler)
    with pytest.raises(RuntimeError, match="could not be built"):
        make_cpu_sampler(cora.indptr, cora.indices, implementation="cpp")


def test_auto_picks_cpp_when_it_builds(cpp_ok, cora) -> None:
    assert make_cpu_sampler(cora.indptr, cora.indices).name == "cpp"
    assert cpu_mod.cpu_sampler_status().startswith("cpp")


def test_build_lock_clears_a_dead_builders_torch_lock(tmp_path) -> None:
    (tmp_path / "lock").touch()  # what torch leaves when a build is killed midway
    with cpu_mod._process_build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_build_lock_wait_is_bounded(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(cpu_mod, "BUILD_LOCK_TIMEOUT_S", 0.3)
    with cpu_mod._process_build_lock(tmp_path):
        with pytest.raises(TimeoutError, match="build lock"):
            with cpu_mod._process_build_lock(tmp_path):
                pass

"""The feature store's gather kernel and the UVA sampler's adjacency cache on a GPU.

Imports only dependency-free modules (runs under ``python -m bench.gpu gate`` and
``python -m bench.gpu features`` with ``--noconftest``). References: ``x[n_id]`` and the pure-torch
twin's counts for the gather; the sampler without the cache (and the device-resident one) for
the adjacency cache, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from quiver_serve.features.placement import LOC_BYTES_PER_NODE, plan_placement
from quiver_serve.features.store import FeatureStore
from quiver_serve.sampling.gpu import CudaSampler, UvaSampler, gpu_sampler_available
from quiver_serve.sampling.graph_cache.adjacency import build_adjacency_cache, expansion_scores
from quiver_serve.sampling.reference import ReferenceSampler

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpu_sampler_available(), reason="needs a CUDA device and CuPy"),
]

NUM_NODES = 3000


def power_law_csc(num_nodes: int = NUM_NODES, num_edges: int = 40000,
                  seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = 1.0 / torch.arange(1, num_nodes + 1, dtype=torch.float64) ** 1.1
    src = torch.multinomial(w, num_edges, replacement=True, generator=g)
    dst = torch.multinomial(w, num_edges, replacement=True, generator=g)
    dst = dst[torch.randperm(num_edges, generator=g)]
    order = torch.argsort(dst * num_nodes + src)
    src, dst = src[order], dst[order]
    indptr = torch.zeros(num_nodes + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(torch.bincount(dst, minlength=num_nodes), 0)
    return indptr, src.to(torch.int64)


def stores(x: torch.Tensor, budget: int, policy: str, dtype: torch.dtype
           ) -> tuple[FeatureStore, FeatureStore]:
    """The kernel store and its torch twin over the same placement (two shards on one GPU
    stand in for two peers: the same code path, addresses in another allocation)."""
    dev = torch.device("cuda", 0)
    scores = torch.rand(x.size(0), generator=torch.Generator().manual_seed(1))
    out = []
    for kernel in (True, False):
        st = FeatureStore(x, dev, dtype=dtype, shard_devices=[dev, dev], use_kernel=kernel,
                          progress=False)
        st.place(plan_placement(scores, st.row_bytes, budget, 2, policy))
        out.append(st)
    return out[0], out[1]


@pytest.mark.parametrize("dim", [7, 8, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("policy", ["replicate", "partition"])
@pytest.mark.parametrize("budget_rows", [0, 10, 500, NUM_NODES])
def test_kernel_gather_returns_exactly_the_rows(dim: int, dtype: torch.dtype, policy: str,
                                                budget_rows: int) -> None:
    x = torch.randn(NUM_NODES, dim)
    row_bytes = dim * torch.empty(0, dtype=dtype).element_size()
    budget = budget_rows * row_bytes + (NUM_NODES * LOC_BYTES_PER_NODE if budget_rows else 0)
    kernel, twin = stores(x, budget, policy, dtype)
    assert kernel.kernel is not None and twin.kernel is None
    for ids in (torch.randint(0, NUM_NODES, (5000,)), torch.tensor([4, 4, 4, 0]),
                torch.empty(0, dtype=torch.int64)):
        want = x.to(dtype)[ids]
        got = kernel.gather(ids.cuda())
        assert got.dtype == dtype and torch.equal(got.cpu(), want)
        assert torch.equal(twin.gather(ids.cuda()).cpu(), want)
    assert kernel.read_counts() == twin.read_counts()
    for g in range(2 if policy == "partition" else 1):
        assert kernel.placement.gpu_bytes(g) <= max(budget, 0) or budget_rows == NUM_NODES


def test_gather_inside_a_cuda_graph_follows_a_replacement() -> None:
    """Captured once, the gather reads whatever layout is committed later (the table swap)."""
    x = torch.randn(NUM_NODES, 64)
    budget = NUM_NODES * LOC_BYTES_PER_NODE + 200 * 256
    store, _ = stores(x, budget, "replicate", torch.float32)
    ids = torch.randint(0, NUM_NODES, (1024,), device="cuda")
    store.gather(ids)  # compile and warm up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = store.gather(ids)
    for trial in range(4):
        ids.copy_(torch.randint(0, NUM_NODES, (1024,)))
        if trial == 2:  # re-place: another hot set, partitioned over the two shards
            store.commit(store.build(plan_placement(torch.rand(NUM_NODES), store.row_bytes,
                                                    budget, 2, "partition")))
        store.reset_counts()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), x[ids.cpu()])
        assert sum(store.read_counts()) == 1024


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_partition_over_two_gpus_reads_the_peer() -> None:
    devs = [torch.device("cuda", 0), torch.device("cuda", 1)]
    x = torch.randn(NUM_NODES, 32)
    store = FeatureStore(x, devs[0], shard_devices=devs, progress=False)
    store.place(plan_placement(torch.rand(NUM_NODES), store.row_bytes,
                               NUM_NODES * LOC_BYTES_PER_NODE + 1000 * 128, 2, "partition"))
    assert store.layout.tiers[1].device == devs[1]
    ids = torch.arange(NUM_NODES)
    assert torch.equal(store.gather(ids).cpu(), x)
    assert store.read_counts() == (2000, NUM_NODES - 2000)


# ---- adjacency cache ------------------------------------------------------------------------
# packed at the fewest bits, int32, int64, Elias-Fano
@pytest.mark.parametrize("index_bits", [None, 32, 64, 0])
@pytest.mark.parametrize("share", [0.0, 0.05, 0.3, 1.0])
def test_sampling_with_the_adjacency_cache_is_bit_identical(share: float,
                                                            index_bits: int | None) -> None:
    """Kernel with the cache vs kernel without it vs the device-resident CSC vs the pure-torch
    twin (the reference sampler), bit for bit, for every cache layout."""
    indptr, indices = power_law_csc()
    fanouts = [10, 5]
    budget = int(16 * NUM_NODES + 24 + share * indices.numel() * 8)
    scores = expansion_scores(indptr, indices, fanouts, 256)
    cache = build_adjacency_cache(indptr, indices, scores, budget, torch.device("cuda", 0),
                                  index_bits)
    assert cache is not None and cache.nbytes <= budget
    assert (cache.num_cached == 0) == (share == 0.0)
    assert cache.index_bits == (index_bits if index_bits is not None else cache.index_bits)
    plain = UvaSampler(indptr, indices, device=0)
    cached = UvaSampler(indptr, indices, device=0, adjacency_cache=cache)
    device = CudaSampler(indptr, indices, device=0)
    twin = ReferenceSampler(indptr, indices)
    g = torch.Generator().manual_seed(5)
    for trial, n in enumerate((1, 64, 1024, 3000)):
        seeds = torch.randint(0, NUM_NODES, (n,), generator=g)
        for f in (fanouts, [-1, 3], [40, 2]):
            ref = plain.sample(seeds, f, trial)
            ref_twin = twin.sample(seeds, f, trial)
            assert torch.equal(ref.n_id.cpu(), ref_twin.n_id)
            assert torch.equal(ref.edge_index.cpu(), ref_twin.edge_index)
            for other in (cached.sample(seeds, f, trial), device.sample(seeds, f, trial)):
                assert torch.equal(other.n_id, ref.n_id)
                assert torch.equal(other.edge_index, ref.edge_index)
                assert torch.equal(other.seed_index, ref.seed_index)
                assert other.num_sampled_nodes == ref.num_sampled_nodes
    plain.close()
    cached.close()


def test_rows_ranked_on_the_gpu_are_ranked_as_on_the_cpu() -> None:
    """A start ranks the placement's rows on the engine core's GPU (milliseconds, not seconds
    for 22 M rows): the same order as the CPU's stable sort, ties in id order."""
    from quiver_serve.features.placement import hottest_first

    scores = torch.randint(0, 50, (100_003,)).float() / 7  # many ties
    on_gpu = hottest_first(scores, torch.device("cuda"))
    assert torch.equal(on_gpu, hottest_first(scores))
    assert on_gpu.device.type == "cpu"

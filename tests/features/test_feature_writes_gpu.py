"""Feature rows written in place on a GPU (docs/architecture.md, "The living graph"): the gather
kernel returns the written rows from every tier (GPU shards under replicate and partition, pinned
host memory read zero-copy, capacity rows of appended nodes), in fp32 exactly and fp16/bf16 to the
dtype, with the same hit and miss counts as the pure-torch twin; a CUDA graph captured before the
writes reads them.

Imports only dependency-free modules (runs with ``--noconftest``)."""

from __future__ import annotations

import pytest
import torch

from quiver_serve.features.placement import LOC_BYTES_PER_NODE, plan_placement
from quiver_serve.features.store import FeatureStore
from quiver_serve.sampling.gpu import gpu_sampler_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpu_sampler_available(), reason="needs a CUDA device and CuPy"),
]

NUM_NODES, CAPACITY = 3000, 3500  # rows NUM_NODES.. : nodes not added yet (zero, score 0)


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Every draw of these tests is reproducible: a failure names its placement."""
    torch.manual_seed(0)


def capacity_matrix(dim: int) -> torch.Tensor:
    x = torch.zeros(CAPACITY, dim)
    x[:NUM_NODES] = torch.randn(NUM_NODES, dim, generator=torch.Generator().manual_seed(0))
    return x


def scores() -> torch.Tensor:
    s = torch.zeros(CAPACITY)
    s[:NUM_NODES] = torch.rand(NUM_NODES, generator=torch.Generator().manual_seed(1)) + 0.1
    return s


def stores(x: torch.Tensor, budget: int, policy: str, dtype: torch.dtype
           ) -> tuple[FeatureStore, FeatureStore]:
    """The kernel store and its torch twin over the same placement (two shards on one GPU stand
    in for two peers), each over its own copy of ``x``."""
    dev = torch.device("cuda", 0)
    out = []
    for kernel in (True, False):
        st = FeatureStore(x.clone(), dev, dtype=dtype, shard_devices=[dev, dev],
                          use_kernel=kernel, progress=False)
        st.place(plan_placement(scores(), st.row_bytes, budget, 2, policy))
        out.append(st)
    return out[0], out[1]


def ids_of_every_kind(store: FeatureStore, per_kind: int = 50) -> torch.Tensor:
    hot = torch.zeros(CAPACITY, dtype=torch.bool)
    for nodes in store.placement.gpu_nodes:
        hot[nodes] = True
    existing = torch.arange(CAPACITY) < NUM_NODES
    kinds = [hot & existing, ~hot & existing, ~existing]
    return torch.cat([k.nonzero().view(-1)[:per_kind] for k in kinds])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("policy", ["replicate", "partition"])
@pytest.mark.parametrize("budget_rows", [0, 500, CAPACITY])
def test_kernel_gather_returns_written_rows(dtype: torch.dtype, policy: str,
                                            budget_rows: int) -> None:
    dim = 24
    x = capacity_matrix(dim)
    row_bytes = dim * torch.empty(0, dtype=dtype).element_size()
    budget = budget_rows * row_bytes + (CAPACITY * LOC_BYTES_PER_NODE if budget_rows else 0)
    kernel, twin = stores(x, budget, policy, dtype)
    assert kernel.kernel is not None and twin.kernel is None
    ids = ids_of_every_kind(kernel)
    new = torch.randn(ids.numel(), dim) * 3
    for store, rows in ((kernel, new.cuda()), (twin, new)):  # rows from either device
        store.write_rows(ids.cuda(), rows)
    want = x.to(dtype)
    want[ids] = new.to(dtype)
    probe = torch.cat([ids, torch.randint(0, CAPACITY, (4000,))])
    for store in (kernel, twin):
        store.reset_counts()
        got = store.gather(probe.cuda())
        assert got.dtype == dtype and torch.equal(got.cpu(), want[probe])
    assert kernel.read_counts() == twin.read_counts()


def test_captured_gather_reads_rows_written_later() -> None:
    """Writes go into the storage a CUDA graph captured: replays see them, hot and cold."""
    x = capacity_matrix(64)
    budget = CAPACITY * LOC_BYTES_PER_NODE + 300 * 256
    store, _ = stores(x, budget, "partition", torch.float32)
    ids = torch.randint(0, CAPACITY, (1024,), device="cuda")
    store.gather(ids)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = store.gather(ids)
    want = x.clone()
    written = ids_of_every_kind(store)
    for trial in range(3):
        new = torch.randn(written.numel(), 64)
        store.write_rows(written, new)
        want[written] = new
        ids.copy_(torch.cat([written, torch.randint(0, CAPACITY, (1024 - written.numel(),))]))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), want[ids.cpu()]), trial


@pytest.mark.parametrize("seed", range(8))
def test_writes_between_build_and_commit_reach_the_gpu_shards(seed: int) -> None:
    """Rows written while a new layout is built (hot rows of the new placement, capacity rows,
    and one id written twice in one call, whose last row wins) are there after the commit, for
    several seeded placements."""
    gen = torch.Generator().manual_seed(seed)
    x = capacity_matrix(32)
    budget = CAPACITY * LOC_BYTES_PER_NODE + 800 * 128
    store, _ = stores(x, budget, "replicate", torch.float16)
    layout = store.build(plan_placement(torch.rand(CAPACITY, generator=gen), store.row_bytes,
                                        budget, 2, "partition"))
    hot = torch.cat(layout.placement.gpu_nodes)
    ids = torch.cat([hot[:100], torch.arange(NUM_NODES, CAPACITY)[:20], hot[:1]])
    new = torch.randn(ids.numel(), 32, generator=gen)
    store.write_rows(ids, new)
    store.commit(layout)
    want = x.half()
    for i, row in zip(ids.tolist(), new.half(), strict=True):  # in order: a repeated id's last row
        want[i] = row
    assert torch.equal(store.gather(torch.arange(CAPACITY, device="cuda")).cpu(), want)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_partition_write_reaches_the_peer_shard() -> None:
    devs = [torch.device("cuda", 0), torch.device("cuda", 1)]
    x = capacity_matrix(32)
    store = FeatureStore(x.clone(), devs[0], shard_devices=devs, progress=False)
    store.place(plan_placement(scores(), store.row_bytes,
                               CAPACITY * LOC_BYTES_PER_NODE + 1000 * 128, 2, "partition"))
    peer_rows = store.placement.gpu_nodes[1][:30]
    new = torch.randn(30, 32)
    store.write_rows(peer_rows, new)
    x[peer_rows] = new
    assert torch.equal(store.gather(torch.arange(CAPACITY, device=devs[0])).cpu(), x)

"""Feature rows written in place (docs/architecture.md, "The living graph"): after ``write_rows``
the gather returns the new rows whatever tier holds them (simulated GPU shards, the host matrix,
NUMA host shards), capacity rows of nodes appended later included; hit and miss counts are unchanged
by writes; a layout built while rows are written gets them at commit. CPU twins; the kernel's
variants are in ``test_feature_writes_gpu.py``."""

from __future__ import annotations

import threading

import pytest
import torch

from quiver_serve.features.build import build_feature_store, pad_scores, plan_for
from quiver_serve.features.placement import LOC_BYTES_PER_NODE, plan_placement
from quiver_serve.features.store import FeatureStore
from quiver_serve.graph.csc import GraphData
from tests.conftest import small_config

CPU = torch.device("cpu")
NUM_NODES, CAPACITY, DIM = 300, 400, 5  # rows NUM_NODES .. CAPACITY-1: nodes not added yet
ROW_BYTES = DIM * 4


def capacity_matrix(seed: int = 0) -> torch.Tensor:
    x = torch.zeros(CAPACITY, DIM)
    x[:NUM_NODES] = torch.randn(NUM_NODES, DIM, generator=torch.Generator().manual_seed(seed))
    return x


def store_for(x: torch.Tensor, budget: int, gpus: int, policy: str, numa: int = 1,
              dtype: torch.dtype | None = None) -> FeatureStore:
    """A CPU store whose "GPU shards" are CPU tensors (the twin of the kernel's layout)."""
    store = FeatureStore(x, CPU, dtype=dtype, shard_devices=[CPU] * gpus, numa_cpus=[[0]] * numa,
                         use_kernel=False, progress=False)
    scores = pad_scores(torch.rand(NUM_NODES, generator=torch.Generator().manual_seed(1)),
                        x.size(0))
    store.place(plan_placement(scores, store.row_bytes, budget, gpus, policy, numa))
    return store


def hot_mask(store: FeatureStore) -> torch.Tensor:
    hot = torch.zeros(store.num_nodes, dtype=torch.bool)
    for nodes in store.placement.gpu_nodes:
        hot[nodes] = True
    return hot


def rows_to_write(store: FeatureStore, per_kind: int = 6) -> torch.Tensor:
    """Ids of hot (GPU-tier) rows, cold existing rows and capacity rows, as far as each exists."""
    hot = hot_mask(store)
    existing = torch.arange(store.num_nodes) < NUM_NODES
    kinds = [hot & existing, ~hot & existing, torch.arange(store.num_nodes) >= NUM_NODES]
    return torch.cat([k.nonzero().view(-1)[:per_kind] for k in kinds])


BUDGETS = [0, CAPACITY * LOC_BYTES_PER_NODE + 30 * ROW_BYTES, CAPACITY * ROW_BYTES]


@pytest.mark.parametrize("policy", ["replicate", "partition"])
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize(("gpus", "numa"), [(0, 1), (1, 1), (2, 1), (2, 2), (1, 3)])
def test_gather_returns_written_rows_in_every_tier(policy: str, budget: int, gpus: int,
                                                   numa: int) -> None:
    want = capacity_matrix()
    store = store_for(want.clone(), budget, gpus, policy, numa)
    tiers_before = [t.data_ptr() for t in store.layout.tiers]
    ids = rows_to_write(store)
    new = torch.randn(ids.numel(), DIM, generator=torch.Generator().manual_seed(2))
    store.write_rows(ids, new)
    want[ids] = new
    assert [t.data_ptr() for t in store.layout.tiers] == tiers_before  # same storage
    hot = hot_mask(store)
    store.reset_counts()
    probe = torch.cat([ids, torch.randint(0, CAPACITY, (200,)), ids.flip(0)])
    got = store.gather(probe)
    assert torch.equal(got, want[probe])
    assert store.read_counts() == (int(hot[probe].sum()), int((~hot[probe]).sum()))
    assert torch.equal(store.gather(torch.arange(CAPACITY)), want)


def test_rows_of_appended_nodes_start_zero_and_take_their_writes() -> None:
    store = store_for(capacity_matrix(), CAPACITY * LOC_BYTES_PER_NODE + 50 * ROW_BYTES, 1,
                      "replicate")
    assert not hot_mask(store)[NUM_NODES:].any()  # capacity rows score 0: host memory
    appended = torch.arange(NUM_NODES, NUM_NODES + 3)
    assert torch.equal(store.gather(appended), torch.zeros(3, DIM))
    store.write_rows(appended, torch.ones(3, DIM))
    assert torch.equal(store.gather(appended), torch.ones(3, DIM))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_storage_keeps_written_rows_to_the_dtype(dtype: torch.dtype) -> None:
    store = store_for(capacity_matrix(), CAPACITY * LOC_BYTES_PER_NODE + 40 * ROW_BYTES, 2,
                      "partition", dtype=dtype)
    ids = rows_to_write(store)
    new = torch.randn(ids.numel(), DIM) * 10
    store.write_rows(ids, new.double())  # any float dtype in, the stored dtype kept
    got = store.gather(ids)
    assert got.dtype == dtype and torch.equal(got, new.to(dtype))


def test_repeated_ids_take_the_last_row_and_bad_writes_change_nothing() -> None:
    x = capacity_matrix()
    store = store_for(x.clone(), CAPACITY * LOC_BYTES_PER_NODE + 40 * ROW_BYTES, 2, "partition")
    hot = int(store.placement.gpu_nodes[0][0])
    store.write_rows(torch.tensor([hot, 7, hot]), torch.arange(3.0).view(3, 1).expand(3, DIM))
    assert torch.equal(store.gather(torch.tensor([hot, 7])), torch.tensor([[2.0], [1.0]])
                       .expand(2, DIM))
    before = store.gather(torch.arange(CAPACITY))
    with pytest.raises(IndexError):
        store.write_rows(torch.tensor([CAPACITY]), torch.zeros(1, DIM))
    with pytest.raises(IndexError):
        store.write_rows(torch.tensor([-1]), torch.zeros(1, DIM))
    with pytest.raises(ValueError, match="rows must be"):
        store.write_rows(torch.tensor([1, 2]), torch.zeros(2, DIM + 1))
    store.write_rows(torch.empty(0, dtype=torch.int64), torch.empty(0, DIM))
    assert torch.equal(store.gather(torch.arange(CAPACITY)), before)


def test_writes_while_a_layout_is_built_reach_it_at_commit() -> None:
    """Rows written after a build copied them (mid-build, and between build and commit) are in
    the committed layout, wherever it puts them (its GPU shard, its host shards)."""
    want = capacity_matrix()
    budget = CAPACITY * LOC_BYTES_PER_NODE + 60 * ROW_BYTES
    store = store_for(want.clone(), budget, 2, "partition", numa=2)
    placement = plan_placement(torch.rand(CAPACITY, generator=torch.Generator().manual_seed(5)),
                               ROW_BYTES, budget, 1, "replicate", numa_nodes=2)
    g = torch.Generator().manual_seed(4)

    def write(n: int) -> None:
        ids = torch.randint(0, CAPACITY, (n,), generator=g)
        new = torch.randn(n, DIM, generator=g)
        store.write_rows(ids, new)
        for i, v in enumerate(ids.tolist()):  # a repeated id keeps its last row
            want[v] = new[i]

    copy_host_shard = store._host_shard

    def host_shard_after_a_write(*args: object) -> torch.Tensor:
        write(40)  # the GPU shard is copied already, this host shard not yet
        return copy_host_shard(*args)

    store._host_shard = host_shard_after_a_write  # type: ignore[method-assign]
    layout = store.build(placement)
    store._host_shard = copy_host_shard  # type: ignore[method-assign]
    write(40)  # built, not committed yet
    store.commit(layout)
    assert store.layout is layout and layout.journal is None and store._journals == []
    assert torch.equal(store.gather(torch.arange(CAPACITY)), want)


def test_writes_racing_a_background_build() -> None:
    want = capacity_matrix()
    budget = CAPACITY * LOC_BYTES_PER_NODE + 60 * ROW_BYTES
    store = store_for(want.clone(), budget, 2, "partition", numa=2)
    g = torch.Generator().manual_seed(6)
    for trial in range(5):
        layouts = []
        placement = plan_placement(torch.rand(CAPACITY, generator=g), ROW_BYTES, budget, 2,
                                   ("replicate", "partition")[trial % 2], numa_nodes=2)
        builder = threading.Thread(
            target=lambda p=placement, out=layouts: out.append(store.build(p)))
        builder.start()
        for _ in range(10):
            ids = torch.randint(0, CAPACITY, (25,), generator=g).unique()
            new = torch.randn(ids.numel(), DIM, generator=g)
            store.write_rows(ids, new)
            want[ids] = new
        builder.join(timeout=60)
        store.commit(layouts[0])
        assert torch.equal(store.gather(torch.arange(CAPACITY)), want)


def test_a_discarded_layout_stops_journalling() -> None:
    store = store_for(capacity_matrix(), 0, 1, "replicate")
    layout = store.build(plan_placement(torch.rand(CAPACITY), ROW_BYTES, 1 << 20, 1))
    store.write_rows(torch.tensor([3]), torch.ones(1, DIM))
    assert len(layout.journal) == 1
    store.discard(layout)
    assert store._journals == [] and layout.journal is None
    assert torch.equal(store.gather(torch.tensor([3])), torch.ones(1, DIM))


def test_store_over_a_capacity_matrix_from_the_config(cora: GraphData) -> None:
    """``build_feature_store`` over ``[capacity, F]`` with the real graph: FAP on its nodes,
    capacity rows ranked last (host memory), every row writable."""
    capacity = cora.num_nodes + 100
    x = torch.zeros(capacity, cora.num_features)
    x[:cora.num_nodes] = cora.x
    budget = capacity * LOC_BYTES_PER_NODE + 500 * cora.num_features * 4
    cfg = small_config(inference__gpu_cache_bytes=budget, features__placement="fap")
    store = build_feature_store(cfg, cora, CPU, x=x)
    assert store.num_nodes == capacity and store.placement.num_nodes == capacity
    store = FeatureStore(x, CPU, shard_devices=[CPU], use_kernel=False, progress=False)
    store.place(plan_for(cfg, cora, store))
    hot = hot_mask(store)
    assert int(hot.sum()) == 500 and not hot[cora.num_nodes:].any()
    ids = torch.tensor([int(hot.nonzero()[0]), int((~hot).nonzero()[0]), capacity - 1])
    store.write_rows(ids, torch.full((3, cora.num_features), 0.5))
    assert torch.equal(store.gather(ids), torch.full((3, cora.num_features), 0.5))
    assert x[capacity - 1, 0] == 0.5  # the matrix it was built over is its host tier
    with pytest.raises(ValueError, match="does not hold"):
        build_feature_store(cfg, cora, CPU, x=x[:10])
    with pytest.raises(ValueError, match="do not fit"):
        pad_scores(torch.ones(5), 4)

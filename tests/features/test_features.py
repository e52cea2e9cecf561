"""Feature store (docs/architecture.md, "Feature store"): the gather returns exactly ``x[n_id]`` for
every policy and budget, budgets hold, hits and misses are counted per row, FAP ranks rows as the
sampler touches them, stored fp16/bf16 stay within their rounding, and re-placement while serving
keeps rows correct. CPU twins here (GPU shards simulated by CPU tensors); the kernel's tests are
marked ``gpu``."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from quiver_serve.config import GraphConfig
from quiver_serve.features.fap import (
    RequestLog,
    degree_scores,
    feature_access_probability,
    logged_seed_probability,
    uniform_seed_probability,
)
from quiver_serve.features.placement import (
    LOC_BYTES_PER_NODE,
    _parse_cpulist,
    numa_nodes,
    plan_placement,
)
from quiver_serve.features.replace import Replacer
from quiver_serve.features.store import FeatureStore
from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.datasets import load_graph
from quiver_serve.graph.synthetic import generate_synthetic
from quiver_serve.sampling import make_cpu_sampler
from tests.conftest import small_config
from tests.engine.core.test_engine_core import make_core, mb, run

CPU = torch.device("cpu")
NUM_NODES, DIM = 500, 7
ROW_BYTES = DIM * 4


def store_for(x: torch.Tensor, scores: torch.Tensor, budget: int, gpus: int, policy: str,
              numa: int = 1, device: torch.device = CPU) -> FeatureStore:
    shards = [device] * gpus
    store = FeatureStore(x, device, shard_devices=shards, numa_cpus=[[0]] * numa,
                         use_kernel=None if device.type == "cuda" else False, progress=False)
    store.place(plan_placement(scores, store.row_bytes, budget, gpus, policy, numa))
    return store


def id_sets() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, NUM_NODES, (300,), generator=g), torch.tensor([3, 3, 3, 0, 499]),
            torch.empty(0, dtype=torch.int64), torch.arange(NUM_NODES)]


BUDGETS = [0, 100, NUM_NODES * LOC_BYTES_PER_NODE + 10 * ROW_BYTES, NUM_NODES * 20,
           NUM_NODES * ROW_BYTES, 1 << 40]


@pytest.mark.parametrize("policy", ["replicate", "partition"])
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize(("gpus", "numa"), [(0, 1), (1, 1), (2, 1), (3, 2), (1, 2)])
def test_gather_returns_exactly_the_rows(policy: str, budget: int, gpus: int, numa: int) -> None:
    x = torch.randn(NUM_NODES, DIM)
    scores = torch.rand(NUM_NODES)
    store = store_for(x, scores, budget, gpus, policy, numa)
    p = store.placement
    assert p is not None
    hot = torch.zeros(NUM_NODES, dtype=torch.bool)
    for nodes in p.gpu_nodes:
        hot[nodes] = True
    hits = misses = 0
    for ids in id_sets():
        got = store.gather(ids)
        assert got.shape == (ids.numel(), DIM) and torch.equal(got, x[ids])
        hits += int(hot[ids].sum())
        misses += int((~hot[ids]).sum())
    assert store.read_counts() == (hits, misses)  # per row, not by where the matrix lives
    for g in range(len(p.gpu_nodes)):  # bytes actually placed on each GPU <= its budget
        shard = store.layout.tiers[g]
        placed = shard.numel() * shard.element_size()
        if store.layout.loc is not None:
            placed += store.layout.loc.numel() * store.layout.loc.element_size()
        assert placed <= budget and placed == p.gpu_bytes(g)
    covered = torch.cat([*p.gpu_nodes, *p.host_nodes]) if not p.host_in_place else None
    if covered is not None:  # every row is somewhere exactly once
        assert torch.equal(covered.sort().values, torch.arange(NUM_NODES))


def test_hottest_rows_go_to_the_gpus_first() -> None:
    scores = torch.arange(NUM_NODES, dtype=torch.float32)  # node 499 hottest
    budget = NUM_NODES * LOC_BYTES_PER_NODE + 50 * ROW_BYTES
    rep = plan_placement(scores, ROW_BYTES, budget, 2, "replicate")
    assert torch.equal(rep.gpu_nodes[0], torch.arange(499, 449, -1))
    part = plan_placement(scores, ROW_BYTES, budget, 2, "partition")
    assert [t.numel() for t in part.gpu_nodes] == [50, 50]  # twice the hot set over two GPUs
    assert set(torch.cat(part.gpu_nodes).tolist()) == set(range(400, 500))
    with pytest.raises(ValueError, match="policy"):
        plan_placement(scores, ROW_BYTES, budget, 2, "mirror")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_storage_within_rounding(dtype: torch.dtype) -> None:
    x = torch.randn(NUM_NODES, DIM) * 10
    store = FeatureStore(x, CPU, dtype=dtype, shard_devices=[CPU], use_kernel=False,
                         progress=False)
    store.place(plan_placement(torch.rand(NUM_NODES), store.row_bytes, 1 << 12, 1))
    ids = torch.randint(0, NUM_NODES, (200,))
    got = store.gather(ids)
    assert got.dtype == dtype and store.row_bytes == DIM * 2
    unit = 2.0 ** -11 if dtype == torch.float16 else 2.0 ** -8  # half an ulp, relative
    assert ((got.float() - x[ids]).abs() <= unit * x[ids].abs() + 1e-6).all()


def test_half_precision_embeddings_error(cora: GraphData) -> None:
    """What fp16/bf16 storage does to served embeddings (exact mode, GraphSAGE): computed in fp32
    from the stored values, so the error is that of the rounded inputs. Cora's 0/1 features are
    stored exactly; Gaussian features lose what the format's mantissa cannot hold."""
    ids = [0, 5, 633, 1862, 2707]
    gauss = GraphData("gauss", cora.indptr, cora.indices,
                      torch.randn(cora.num_nodes, cora.num_features, generator=torch.Generator()
                                  .manual_seed(0)))
    for graph, limits in ((cora, (0.0, 0.0)), (gauss, (2e-3, 2e-2))):
        want = run(make_core(graph), mb(1, [ids], exact=True))[1].rows
        for name, limit in zip(("fp16", "bf16"), limits, strict=True):
            core = make_core(graph, features__storage_dtype=name)
            got = run(core, mb(1, [ids], exact=True))[1].rows
            rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            assert rel <= limit and (limit == 0 or rel > 0), (graph.name, name, rel)


# ---- FAP vs the sampler's Monte-Carlo access frequencies -----------------------------------
def heterophilous_graph(tmp_path: Path, num_nodes: int = 1500, num_edges: int = 9000) -> GraphData:
    """A graph in the yandex-research heterophilous layout (tolokers.npz's keys), with skewed
    endpoints so that access probabilities spread over orders of magnitude."""
    rng = np.random.default_rng(1)
    weights = 1.0 / np.arange(1, num_nodes + 1) ** 0.9
    weights = rng.permutation(weights / weights.sum())
    edges = np.stack([rng.choice(num_nodes, num_edges, p=weights),
                      rng.integers(0, num_nodes, num_edges)], axis=1)
    masks = np.ones((10, num_nodes), bool)
    path = tmp_path / "hetero.npz"
    np.savez(path, edges=edges.astype(np.int64),
             node_features=rng.standard_normal((num_nodes, 4)).astype(np.float32),
             node_labels=rng.integers(0, 2, num_nodes), train_masks=masks, val_masks=masks,
             test_masks=masks)
    return load_graph(GraphConfig(format="npz", path=str(path), name="hetero"))


def monte_carlo_access(graph: GraphData, fanouts: list[int], batch: int,
                       batches: int) -> np.ndarray:
    sampler = make_cpu_sampler(graph.indptr, graph.indices)
    g = torch.Generator().manual_seed(2)
    seen = np.zeros(graph.num_nodes)
    for b in range(batches):
        seeds = torch.randperm(graph.num_nodes, generator=g)[:batch]
        seen[sampler.sample(seeds, fanouts, seed=b).n_id.numpy()] += 1
    return seen / batches


@pytest.mark.parametrize("kind", ["heterophilous", "power-law"])
def test_fap_ranks_rows_as_the_sampler_touches_them(kind: str, tmp_path: Path) -> None:
    if kind == "power-law":
        graph = generate_synthetic(GraphConfig(
            format="synthetic", synthetic_preset="custom", synthetic_num_nodes=3000,
            synthetic_num_edges=30000, synthetic_num_features=4))
    else:
        graph = heterophilous_graph(tmp_path)
    fanouts, batch = [10, 5], 32
    fap = feature_access_probability(graph.indptr, graph.indices, fanouts,
                                     uniform_seed_probability(graph.num_nodes, batch))
    freq = monte_carlo_access(graph, fanouts, batch, 600)
    rho = spearmanr(fap.numpy(), freq).statistic
    assert rho >= 0.9, rho
    # and it beats in-degree, the baseline, at picking the rows touched most
    top = graph.num_nodes // 10
    by_fap = freq[torch.topk(fap, top).indices.numpy()].sum()
    by_degree = freq[torch.topk(degree_scores(graph.indptr), top).indices.numpy()].sum()
    assert by_fap >= by_degree


def test_fap_from_a_request_log_favours_requested_nodes(cora: GraphData) -> None:
    log = RequestLog(capacity=1000)
    log.record(np.arange(50, dtype=np.int64))  # overwritten below: the log is a ring
    for _ in range(10):
        log.record(np.full(100, 7, dtype=np.int64))
    ids = log.snapshot()
    assert len(log) == 1000 and ids.size == 1000 and (ids == 7).all()
    p0 = logged_seed_probability(ids, cora.num_nodes, 64)
    assert float(p0[7]) == 1.0 and float(p0.sum()) == 1.0
    fap = feature_access_probability(cora.indptr, cora.indices, [10, 5], p0)
    assert int(fap.argmax()) == 7
    neighbours = cora.indices[cora.indptr[7]:cora.indptr[8]]
    assert (fap[neighbours] > 0).all() and int((fap > 0).sum()) < cora.num_nodes // 2
    assert torch.equal(logged_seed_probability(np.array([], np.int64), 10, 2),
                       uniform_seed_probability(10, 2))


def test_request_log_keeps_the_newest_ids_in_order() -> None:
    log = RequestLog(capacity=5)
    log.record(np.array([1, 2, 3]))
    assert log.snapshot().tolist() == [1, 2, 3]
    log.record(np.array([4, 5, 6, 7]))
    assert log.snapshot().tolist() == [3, 4, 5, 6, 7]
    log.record(np.arange(10, 22))
    assert log.snapshot().tolist() == [17, 18, 19, 20, 21]
    RequestLog(0).record(np.array([1]))  # capacity 0: records nothing


def test_numa_topology_from_sysfs(tmp_path: Path) -> None:
    for n, cpus in ((0, "0-3,8"), (1, "4-7"), (2, "")):
        (tmp_path / f"node{n}").mkdir()
        (tmp_path / f"node{n}" / "cpulist").write_text(cpus + "\n")
    assert numa_nodes(str(tmp_path)) == [[0, 1, 2, 3, 8], [4, 5, 6, 7]]
    assert _parse_cpulist("2,5-6") == [2, 5, 6]
    assert numa_nodes(str(tmp_path / "absent"))  # no sysfs: one node, this process's CPUs


# ---- re-placement while serving ------------------------------------------------------------
def test_replacement_while_gathering_returns_correct_rows() -> None:
    x = torch.randn(NUM_NODES, DIM)
    budget = NUM_NODES * LOC_BYTES_PER_NODE + 40 * ROW_BYTES
    store = store_for(x, torch.rand(NUM_NODES), budget, 2, "partition")
    errors: list[str] = []
    stop = threading.Event()

    def serve() -> None:
        g = torch.Generator().manual_seed(3)
        while not stop.is_set():
            ids = torch.randint(0, NUM_NODES, (64,), generator=g)
            if not torch.equal(store.gather(ids), x[ids]):
                errors.append("wrong rows")

    reader = threading.Thread(target=serve)
    reader.start()
    try:
        for i in range(5):
            layout = store.build(plan_placement(torch.rand(NUM_NODES), ROW_BYTES, budget, 2,
                                                ("replicate", "partition")[i % 2]))
            store.commit(layout)
    finally:
        stop.set()
        reader.join(timeout=30)
    assert not errors and not reader.is_alive()


def test_engine_replaces_from_its_request_log_and_keeps_serving(cora: GraphData) -> None:
    """An engine core re-places its rows (from the ids it served) between batches; exact-mode
    rows equal the full-graph forward before, during and after."""
    core = make_core(cora)
    cfg = small_config(model__weights=None, inference__gpu_cache_bytes=cora.num_nodes * 8
                       + 300 * cora.x.size(1) * 4, features__placement="degree")
    store = FeatureStore(cora.x, CPU, shard_devices=[CPU], use_kernel=False, progress=False)
    store.place(plan_placement(degree_scores(cora.indptr), store.row_bytes,
                               cfg.inference.gpu_cache_bytes, 1))
    core.features = store
    core.replacer = Replacer(cfg.model_copy(update={"features": cfg.features.model_copy(
        update={"placement": "fap"})}), cora, store)
    before = set(store.placement.gpu_nodes[0].tolist())
    hot = list(range(1200, 1240))
    want = run(core, mb(0, [hot], exact=True))[0].rows
    run(core, *[mb(i, [hot]) for i in range(1, 40)])  # the request log: 40 x the hot ids
    core.replacer.request()
    seq, deadline = 100, time.monotonic() + 120
    while core.replacer.done == 0 and time.monotonic() < deadline:
        got = run(core, mb(seq, [hot], exact=True))[seq].rows
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        seq += 1
    assert core.replacer.done == 1
    after = set(store.placement.gpu_nodes[0].tolist())
    assert after != before and set(hot) <= after  # the requested nodes are cached now
    got = run(core, mb(seq, [hot], exact=True))[seq].rows
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    hits, misses = store.read_counts()
    assert hits > 0 and misses > 0


# ---- adjacency cache (CPU twin of what the sampler kernel reads) ----------------------------
@pytest.mark.parametrize("index_bits", [None, 32, 64, 0])  # 0: Elias-Fano
@pytest.mark.parametrize("share", [0.0, 0.1, 1.0])
def test_adjacency_cache_maps_every_node_to_its_own_list(cora: GraphData, share: float,
                                                         index_bits: int | None) -> None:
    from quiver_serve.sampling.graph_cache.adjacency import (
        EXTRA_BYTES,
        FIXED_BYTES_PER_NODE,
        build_adjacency_cache,
        cached_neighbours,
        expansion_scores,
    )

    n = cora.num_nodes
    budget = FIXED_BYTES_PER_NODE * n + EXTRA_BYTES + int(share * cora.num_edges * 8)
    scores = expansion_scores(cora.indptr, cora.indices, [25, 10], 64)
    cache = build_adjacency_cache(cora.indptr, cora.indices, scores, budget, CPU, index_bits)
    assert cache is not None and cache.nbytes <= budget
    assert cache.num_cached == (0 if share == 0 else int((cache.offsets >= 0).sum()))
    if share == 1.0:
        assert cache.num_cached == int((cora.degree() > 0).sum())
    for v in range(n):
        want = cora.indices[cora.indptr[v]:cora.indptr[v + 1]]
        assert torch.equal(cached_neighbours(cache, cora.indices, v), want)
    if 0 < share < 1:  # the cached lists are the most-expanded per byte
        cached = cache.offsets >= 0
        assert scores[cached].min() >= scores[~cached & (cora.degree() > 0)].max()
    assert build_adjacency_cache(cora.indptr, cora.indices, scores, 100, CPU) is None


def test_without_a_gpu_or_with_room_for_every_row_nothing_is_ranked() -> None:
    """The stable sort of every row's score (seconds at 22 M rows) runs only when some rows go
    to a GPU and others stay: with no GPU, or room for all, rows are in id order."""
    scores = torch.rand(1000)
    none = plan_placement(scores, ROW_BYTES, 0, 0)
    assert none.num_gpu_rows == 0
    every = plan_placement(scores, ROW_BYTES, 1 << 30, 1)
    assert torch.equal(every.gpu_nodes[0], torch.arange(1000))
    some = plan_placement(scores, ROW_BYTES, 1000 * LOC_BYTES_PER_NODE + 100 * ROW_BYTES, 1)
    assert torch.equal(some.gpu_nodes[0], torch.sort(scores, descending=True).indices[:100])

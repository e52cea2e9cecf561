"""Shared parts of bench/features/features.py and features_2gpu.py (and the adjacency and
end-to-end benches): graphs, traces of sampled batches, hit rates, gather timing."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from quiver_serve.config import GraphConfig
from quiver_serve.features.fap import (
    degree_scores,
    feature_access_probability,
    logged_seed_probability,
    uniform_seed_probability,
)
from quiver_serve.features.placement import plan_placement
from quiver_serve.features.store import FeatureStore
from quiver_serve.graph.synthetic import generate_synthetic

FANOUTS = [25, 10]


def make_graph(preset: str, scale: float) -> tuple[Any, float]:
    t0 = time.perf_counter()
    g = generate_synthetic(GraphConfig(format="synthetic", synthetic_preset=preset,
                                       synthetic_scale=scale))
    return g, time.perf_counter() - t0


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn: Any, dev: torch.device, iters: int) -> float:
    """Mean seconds per call after one warm-up call."""
    fn()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(dev)
    return (time.perf_counter() - t0) / iters


def sampler_for(graph: Any, dev: torch.device) -> Any:
    if dev.type == "cuda":
        from quiver_serve.sampling.gpu import CudaSampler

        return CudaSampler(graph.indptr, graph.indices, device=dev)
    from quiver_serve.sampling import make_cpu_sampler

    return make_cpu_sampler(graph.indptr, graph.indices)


def hot_set(degree: np.ndarray, size: int = 1500, seed: int = 0) -> np.ndarray:
    """Workload (a)'s hot set (as bench_pipeline.py): half lowest, half highest in-degree."""
    n, half = degree.size, min(size // 2, degree.size // 2)
    perm = np.random.default_rng(seed).permutation(n)
    order = perm[np.argsort(degree[perm], kind="stable")]
    return np.concatenate([order[:half], order[n - half:]]).astype(np.int64)


def seed_batches(workload: str, graph: Any, batch: int, count: int, seed: int) -> list[Any]:
    """Seed ids of ``count`` batches: (a) from the hot set, (b) uniform."""
    rng = np.random.default_rng(seed)
    if workload == "a":
        hot = hot_set(graph.degree().numpy())
        return [torch.from_numpy(hot[rng.integers(0, hot.size, batch)]) for _ in range(count)]
    return [torch.from_numpy(rng.integers(0, graph.num_nodes, batch, dtype=np.int64))
            for _ in range(count)]


def trace(graph: Any, sampler: Any, seeds: list[Any]) -> list[Any]:
    """n_id of each sampled batch (on the sampler's device)."""
    return [sampler.sample(s, FANOUTS, i).n_id for i, s in enumerate(seeds)]


def scores_by(graph: Any, dev: torch.device, batch: int,
              logged: np.ndarray | None = None) -> dict[str, Any]:
    """Placement orders: FAP (uniform seeds; and from a request log when given), in-degree.
    FAP is computed on ``dev`` (the recursion runs wherever its tensors are)."""
    t0 = time.perf_counter()
    indptr, indices = graph.indptr.to(dev), graph.indices.to(dev)
    fap = feature_access_probability(indptr, indices, FANOUTS, uniform_seed_probability(
        graph.num_nodes, batch).to(dev)).cpu()
    sync(dev)
    out = {"fap": fap, "degree": degree_scores(graph.indptr), "fap_s": time.perf_counter() - t0}
    if logged is not None:
        out["fap-log"] = feature_access_probability(indptr, indices, FANOUTS,
                                                    logged_seed_probability(
                                                        logged, graph.num_nodes, batch).to(dev)).cpu()
    del indptr, indices
    return out


def hit_rate(placement: Any, n_ids: list[Any], num_nodes: int) -> float:
    hot = torch.zeros(num_nodes, dtype=torch.bool)
    for nodes in placement.gpu_nodes:
        hot[nodes] = True
    hits = total = 0
    for n_id in n_ids:
        ids = n_id.cpu()
        hits += int(hot[ids].sum())
        total += ids.numel()
    return hits / max(total, 1)


def store_point(graph: Any, dev: torch.device, shards: list[torch.device], scores: Any,
                budget: int, policy: str, n_ids: list[Any], iters: int,
                gather_on: torch.device | None = None) -> dict:
    """Place with ``scores`` in ``budget`` bytes per GPU; hit rate (counted by the store's
    gather, checked against the placement) and gather GB/s over the trace."""
    store = FeatureStore(graph.x, dev, shard_devices=shards, progress=False,
                         use_kernel=None if dev.type == "cuda" else False)
    t0 = time.perf_counter()
    store.place(plan_placement(scores, store.row_bytes, budget, len(shards), policy))
    place_s = time.perf_counter() - t0
    ids = [n.to(dev) for n in n_ids]
    rows = sum(int(n.numel()) for n in ids)
    store.reset_counts()
    for n in ids:
        out = store.gather(n)
    hits, misses = store.read_counts()
    assert hits + misses == rows
    assert torch.equal(out.cpu(), graph.x[ids[-1].cpu()])
    expect = hit_rate(store.placement, ids, graph.num_nodes)
    assert abs(hits / rows - expect) < 1e-9, (hits / rows, expect)
    def gather_all() -> None:
        for n in ids:
            store.gather(n)  # each output freed at once: memory stays one batch deep

    sec = timed(gather_all, dev, iters)
    gpu_bytes = store.gpu_bytes()
    store.close()
    return {"hit_rate": hits / rows, "gather_gb_s": rows * graph.x.size(1) * 4 / sec / 1e9,
            "gather_ms_per_batch": 1e3 * sec / len(ids), "place_s": place_s,
            "gpu_bytes": gpu_bytes}

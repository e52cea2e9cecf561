"""The feature store an engine core serves from, built from the config (start-up and
re-placement).

The store's matrix may have more rows than the graph has nodes (capacity for nodes appended while
serving, docs/architecture.md, "The living graph"): scores are computed on the graph's nodes and the
capacity rows score 0, so they rank last and stay in host memory unless the GPU budget holds every
row."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from quiver_serve import envs
from quiver_serve.config import ServeConfig
from quiver_serve.features.fap import (
    degree_scores,
    feature_access_probability,
    logged_seed_probability,
    uniform_seed_probability,
)
from quiver_serve.features.placement import Placement, numa_nodes, plan_placement, rows_within
from quiver_serve.features.store import FeatureStore
from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.snapshot import csc_key

log = logging.getLogger(__name__)

#: bump when the cached scores' meaning changes: old files are then recomputed
FAP_CACHE_VERSION = 1

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def placement_scores(cfg: ServeConfig, graph: GraphData, log_ids: np.ndarray | None = None,
                     rank_by: str | None = None, num_rows: int | None = None) -> Tensor:
    """Per row, how hot it is: FAP (uniform seeds, or the request log's) or in-degree of the
    graph's nodes, then zeros up to ``num_rows`` (capacity rows of nodes not added yet)."""
    rank_by = rank_by or cfg.features.placement
    if rank_by == "degree":
        return pad_scores(degree_scores(graph.indptr), num_rows)
    batch = cfg.features.fap_batch_size
    if log_ids is None:
        return pad_scores(uniform_fap(graph, cfg.sampling.fanouts, batch), num_rows)
    seed_prob = logged_seed_probability(log_ids, graph.num_nodes, batch)
    return pad_scores(timed_fap(graph, cfg.sampling.fanouts, seed_prob), num_rows)


def timed_fap(graph: GraphData, fanouts: list[int], seed_prob: Tensor) -> Tensor:
    t0 = time.perf_counter()
    fap = feature_access_probability(graph.indptr, graph.indices, fanouts, seed_prob)
    log.info("feature access probability of %d nodes in %.2f s", graph.num_nodes,
             time.perf_counter() - t0)
    return fap


def fap_cache_path(graph: GraphData, fanouts: list[int], batch: int) -> Path:
    """``$QUIVER_SERVE_CACHE/fap/``, one .npy per graph content key, fanouts and batch size."""
    tag = "_".join(str(k) for k in fanouts)
    return (envs.QUIVER_SERVE_CACHE / "fap"
            / f"fap-v{FAP_CACHE_VERSION}-{csc_key(graph.indptr, graph.indices)}-f{tag}-b{batch}.npy")


def uniform_fap(graph: GraphData, fanouts: list[int], batch: int) -> Tensor:
    """FAP under uniform seeds: from the cache when one was saved for the same graph content,
    fanouts and batch size (a restart maps it, decision 0039), else computed and saved."""
    path = fap_cache_path(graph, fanouts, batch)
    try:
        saved = np.load(path, allow_pickle=False)
        if saved.dtype == np.float32 and saved.shape == (graph.num_nodes,):
            log.info("feature access probability loaded from %s", path)
            return torch.from_numpy(saved)
        log.warning("FAP cache %s holds %s%s, not float32[%d]; recomputing", path, saved.dtype,
                    list(saved.shape), graph.num_nodes)
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:
        log.warning("FAP cache %s unreadable (%s); recomputing", path, exc)
    fap = timed_fap(graph, fanouts, uniform_seed_probability(graph.num_nodes, batch))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, fap.detach().cpu().to(torch.float32).numpy(), allow_pickle=False)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("FAP cache not written (%s): recomputed at the next start", exc)
    return fap


def pad_scores(scores: Tensor, num_rows: int | None) -> Tensor:
    """``scores`` followed by zeros up to ``num_rows`` entries (None: as they are)."""
    if num_rows is None or num_rows == scores.numel():
        return scores
    if num_rows < scores.numel():
        raise ValueError(f"{scores.numel()} nodes do not fit in {num_rows} feature rows")
    return torch.cat([scores, scores.new_zeros(num_rows - scores.numel())])


def plan_for(cfg: ServeConfig, graph: GraphData, store: FeatureStore,
             log_ids: np.ndarray | None = None) -> Placement:
    """The placement the config asks for on ``store``'s GPUs, over all of its rows (``graph``'s
    nodes first, then capacity rows)."""
    num_gpus = len(store.shard_devices)
    budget = cfg.inference.gpu_cache_bytes
    policy = cfg.features.policy if num_gpus > 1 else "replicate"
    rows = store.num_nodes
    if rows < graph.num_nodes:
        raise ValueError(f"feature store has {rows} rows for a graph of {graph.num_nodes} nodes")
    if not num_gpus or (policy == "replicate" and rows_within(
            budget, rows, store.row_bytes) >= rows):
        scores = torch.zeros(rows)  # all on the host, or all fit: no ranking needed
    else:
        scores = placement_scores(cfg, graph, log_ids, num_rows=rows)
    numa = len(store.numa_cpus) if cfg.features.numa_shards else 1
    return plan_placement(scores, store.row_bytes, budget if num_gpus else 0, num_gpus,
                          policy, numa_nodes=max(numa, 1),
                          scores_name=cfg.features.placement, device=store.device)


def build_feature_store(cfg: ServeConfig, graph: GraphData, device: torch.device,
                        x: Tensor | None = None) -> FeatureStore:
    """Place ``x`` (default ``graph.x``) for an engine core on ``device`` (one GPU shard: its
    own). ``x`` may be a capacity matrix, ``[capacity, F]`` with ``capacity >= graph.num_nodes``:
    its first rows are the graph's nodes, the rest unused until nodes are added. The store
    writes into ``x`` in place (``FeatureStore.write_rows``): give each engine core its own."""
    x = graph.x if x is None else x
    if x.dim() != 2 or x.size(0) < graph.num_nodes or x.size(1) != graph.num_features:
        raise ValueError(f"feature matrix {tuple(x.shape)} does not hold the graph's "
                         f"{graph.num_nodes} x {graph.num_features} rows")
    policy = cfg.features.policy
    if policy == "partition" and device.type == "cuda":
        log.warning("features.policy=partition needs one process to drive the GPUs of a peer "
                    "clique (bench/features/features.py does); an engine core per GPU replicates")
    numa = numa_nodes() if cfg.features.numa_shards and device.type == "cuda" else []
    store = FeatureStore(x, device, dtype=DTYPES[cfg.features.storage_dtype],
                         numa_cpus=numa if len(numa) > 1 else None)
    plan = plan_for(cfg, graph, store)
    t0 = time.perf_counter()
    store.place(plan)
    p = store.placement
    assert p is not None
    log.info("feature store on %s: %d of %d rows on the GPU (%s), %s bytes there, %s; host "
             "matrix page-locked in %.2f s, rows placed in %.2f s", device, p.num_gpu_rows,
             store.num_nodes, p.scores_name, store.gpu_bytes(),
             "kernel gather" if store.kernel is not None else "torch gather", store.pin_s,
             time.perf_counter() - t0)
    return store

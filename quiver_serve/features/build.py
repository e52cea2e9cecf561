"""The feature store an engine core serves from, built from the config (start-up and
re-placement)."""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from torch import Tensor

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

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def placement_scores(cfg: ServeConfig, graph: GraphData, log_ids: np.ndarray | None = None,
                     rank_by: str | None = None) -> Tensor:
    """Per node, how hot its row is: FAP (uniform seeds, or the request log's) or in-degree."""
    rank_by = rank_by or cfg.features.placement
    if rank_by == "degree":
        return degree_scores(graph.indptr)
    batch = cfg.features.fap_batch_size
    seed_prob = (logged_seed_probability(log_ids, graph.num_nodes, batch) if log_ids is not None
                 else uniform_seed_probability(graph.num_nodes, batch))
    t0 = time.perf_counter()
    fap = feature_access_probability(graph.indptr, graph.indices, cfg.sampling.fanouts, seed_prob)
    log.info("feature access probability of %d nodes in %.2f s", graph.num_nodes,
             time.perf_counter() - t0)
    return fap


def plan_for(cfg: ServeConfig, graph: GraphData, store: FeatureStore,
             log_ids: np.ndarray | None = None) -> Placement:
    """The placement the config asks for on ``store``'s GPUs."""
    num_gpus = len(store.shard_devices)
    budget = cfg.inference.gpu_cache_bytes
    policy = cfg.features.policy if num_gpus > 1 else "replicate"
    if not num_gpus or (policy == "replicate" and rows_within(
            budget, graph.num_nodes, store.row_bytes) >= graph.num_nodes):
        scores = torch.zeros(graph.num_nodes)  # all on the host, or all fit: no ranking needed
    else:
        scores = placement_scores(cfg, graph, log_ids)
    numa = len(store.numa_cpus) if cfg.features.numa_shards else 1
    return plan_placement(scores, store.row_bytes, budget if num_gpus else 0, num_gpus,
                          policy, numa_nodes=max(numa, 1),
                          scores_name=cfg.features.placement)


def build_feature_store(cfg: ServeConfig, graph: GraphData, device: torch.device) -> FeatureStore:
    """Place ``graph.x`` for an engine core on ``device`` (one GPU shard: its own)."""
    policy = cfg.features.policy
    if policy == "partition" and device.type == "cuda":
        log.warning("features.policy=partition needs one process to drive the GPUs of a peer "
                    "clique (bench/features/features.py does); an engine core per GPU replicates")
    numa = numa_nodes() if cfg.features.numa_shards and device.type == "cuda" else []
    store = FeatureStore(graph.x, device, dtype=DTYPES[cfg.features.storage_dtype],
                         numa_cpus=numa if len(numa) > 1 else None)
    store.place(plan_for(cfg, graph, store))
    p = store.placement
    assert p is not None
    log.info("feature store on %s: %d of %d rows on the GPU (%s), %s bytes there, %s", device,
             p.num_gpu_rows, graph.num_nodes, p.scores_name, store.gpu_bytes(),
             "kernel gather" if store.kernel is not None else "torch gather")
    return store

"""The GPU sampler of an engine core (device or UVA, with its adjacency cache), built over a
graph: at start-up (``build.py``) and over a compacted base (``rebase.py``)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

import torch

from quiver_serve.config import ServeConfig
from quiver_serve.graph.csc import GraphData
from quiver_serve.sampling import BaseSampler, make_cpu_sampler

if TYPE_CHECKING:
    from quiver_serve.features.store import FeatureStore

log = logging.getLogger(__name__)


class SamplingCore(Protocol):
    """What every helper that samples and gathers for the engine core reads of it: its two
    samplers, its compute device and its feature store (``core.EngineCore``)."""

    local_sampler: BaseSampler
    gpu_sampler: BaseSampler | None

    @property
    def device(self) -> torch.device: ...

    @property
    def features(self) -> FeatureStore: ...


def local_sampler(cfg: ServeConfig, graph: GraphData, device: torch.device) -> BaseSampler:
    """The sampler an inference worker uses for batches routed to it unsampled."""
    gpu = gpu_sampler_or_none(cfg, graph, device)
    return gpu if gpu is not None else make_cpu_sampler(graph.indptr, graph.indices,
                                                        cfg.sampling.implementation)


def _gpu_sampler(cfg: ServeConfig, graph: GraphData, device: torch.device) -> BaseSampler:
    from quiver_serve.sampling.gpu import CudaSampler, UvaSampler, gpu_sampler_available

    if not gpu_sampler_available():
        raise RuntimeError("CuPy is not importable or CUDA is not available")
    mode = cfg.sampling.gpu_mode
    if mode == "auto":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        csc_bytes = (graph.indptr.numel() + graph.indices.numel()) * 8
        mode = "device" if csc_bytes < free_bytes // 2 else "uva"
    if mode == "device":
        sampler: BaseSampler = CudaSampler(graph.indptr, graph.indices, device=device)
    else:  # pinned in place: a graph mapped read-only from its files is copied first
        private = graph.mapped_from is not None
        sampler = UvaSampler(graph.indptr.clone() if private else graph.indptr,
                             graph.indices.clone() if private else graph.indices, device=device,
                             adjacency_cache=_adjacency_cache(cfg, graph, device))
    sampler.sample(graph.indptr.new_zeros(1), cfg.sampling.fanouts, 0)  # compiles the kernel now
    return sampler


def _adjacency_cache(cfg: ServeConfig, graph: GraphData, device: torch.device) -> Any:
    """The UVA sampler's GPU copy of the hottest neighbour lists (None: no budget for it)."""
    budget = cfg.sampling.gpu_graph_cache_bytes
    if budget <= 0:
        return None
    from quiver_serve.sampling.graph_cache.adjacency import (
        EF_BITS,
        build_adjacency_cache,
        expansion_scores,
    )

    scores = expansion_scores(graph.indptr, graph.indices, cfg.sampling.fanouts,
                              cfg.features.fap_batch_size)
    layout = EF_BITS if cfg.sampling.graph_cache_layout == "elias_fano" else None
    cache = build_adjacency_cache(graph.indptr, graph.indices, scores, budget, device, layout)
    if cache is None:
        log.warning("sampling.gpu_graph_cache_bytes=%d is below the cache's fixed part (16 bytes "
                    "per node): no adjacency cache", budget)
    else:
        log.info("adjacency cache: %d of %d neighbour lists (%s), %d bytes on %s",
                 cache.num_cached, graph.num_nodes, "Elias-Fano" if cache.index_bits == EF_BITS
                 else f"{cache.index_bits} bits per entry", cache.nbytes, device)
    return cache


def gpu_sampler_or_none(cfg: ServeConfig, graph: GraphData, device: torch.device) -> BaseSampler | None:
    """The GPU sampler of an engine core on ``device``, or None (CPU device, no CuPy, no build)."""
    if device.type != "cuda":
        return None
    try:
        return _gpu_sampler(cfg, graph, device)
    except Exception as exc:  # noqa: BLE001 - the engine samples on the CPU instead
        log.warning("GPU sampler unavailable (%s: %s); sampling on the CPU", type(exc).__name__, exc)
        return None

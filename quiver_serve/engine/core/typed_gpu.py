"""The typed engine core on a GPU (docs/architecture.md, "Typed graphs"; decision 0050).

``TypedGpuEngineCore`` is ``TypedEngineCore`` (batching by node type and mode, replies, the
exact table) with the homogeneous core's GPU parts per seed type:

* the graph's relations on the GPU, or in pinned host memory read over the bus when they do not
  fit (``sampling/typed_gpu.py``, ``sampling.gpu_mode``);
* feature rows of every type placed by FAP under one ``inference.gpu_cache_bytes``, the rest in
  host memory (``features/typed.py``);
* each batch routed by its predicted sampled-subgraph size for its seed type
  (``routing/typed_psgs.py``) to the GPU sampler or the C++ sampler here, by the cost model
  (``routing/router.py``, the lines learnt from measured batches, seeded by a warm-up through
  both paths); both paths sample the same subgraph for a seed;
* the model on the GPU, sampling and compute on a high-priority stream;
* counts per node type and path (``stats_by_type``), feature rows per type and tier, and
  per-batch stats for metrics labelled by node type (``on_typed_stats``, ``metrics/typed.py``).

On a CPU device the same core runs with the GPU sampler's torch twin and CPU tensors as the
"GPU" tier: the tests drive it there.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from quiver_serve.config import ServeConfig
from quiver_serve.engine.core.devices import worker_device
from quiver_serve.engine.core.micro_batch import Reply
from quiver_serve.engine.core.typed_core import TypedEngineCore, TypedSettings
from quiver_serve.features.build import DTYPES
from quiver_serve.features.typed import TypedFeatures, plan_typed_placement, typed_fap
from quiver_serve.graph.typed import TypedGraph
from quiver_serve.metrics.typed import TypedBatchStats
from quiver_serve.models.spec import ModelSpec
from quiver_serve.models.typed_layerwise import TypedLayerwise
from quiver_serve.models.typed_served import build_typed_model
from quiver_serve.routing.router import EngineRouter, EngineRouteState, Route
from quiver_serve.routing.typed_psgs import TypedPsgs, measure_typed_psgs
from quiver_serve.sampling.typed import TypedCppSampler, TypedReferenceSampler, typed_fanouts
from quiver_serve.sampling.typed_gpu import TypedGpuSampler, typed_gpu_mode

log = logging.getLogger(__name__)

#: seeds per warm-up batch through each path (first points of the cost model's lines)
WARM_BATCH_SEEDS = (1, 48, 256)


@dataclass
class TypeStats:
    """What one node type's batches did on one path."""

    batches: int = 0
    seeds: int = 0
    sampled_nodes: int = 0
    sampled_edges: int = 0
    sample_s: float = 0.0
    compute_s: float = 0.0


@dataclass
class TypedGpuParts:
    """What the GPU core has beyond the CPU one."""

    device: torch.device
    gpu_sampler: TypedReferenceSampler | None
    features: TypedFeatures
    psgs: TypedPsgs
    router: EngineRouter


class TypedGpuEngineCore(TypedEngineCore):
    """See the module docstring; ``sampler`` is the CPU (C++) sampler over the host graph."""

    def __init__(self, served, fanouts: dict, sampler: TypedReferenceSampler,
                 settings: TypedSettings, parts: TypedGpuParts, *, index: int = 0) -> None:
        super().__init__(served, fanouts, sampler, settings, index=index)
        self.device, self.gpu_sampler = parts.device, parts.gpu_sampler
        self.features, self.psgs, self.router = parts.features, parts.psgs, parts.router
        self.served.gather = self.features.gather
        self.on_gpu = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device, priority=-1) if self.on_gpu else None
        #: (node type, path) -> what its batches did
        self.type_stats: dict[tuple[str, str], TypeStats] = {}
        #: learn the cost model's lines from measured batches (off while warming up)
        self.learn_costs = True
        #: called with each batch's stats (the process wrapper turns them into metrics)
        self.on_typed_stats: Callable[[TypedBatchStats], None] | None = None
        self._rows_seen = self.features.counts()  # feature reads per type at the last batch
        #: the graph changed since the device copies were made: the CPU path serves (``follow``)
        self.device_stale = False
        #: small sampled batches run wholly on the CPU: the model's twin there, its layers, and
        #: the most seeds such a batch has (``inference.typed_cpu_max_seeds``; resolved by the
        #: warm-up when -1)
        wanted = settings.cpu_max_seeds > 0 or (self.on_gpu and settings.cpu_max_seeds == -1)
        self.cpu_twin = served.copy_on("cpu") if wanted else None
        self.cpu_layerwise = TypedLayerwise(self.cpu_twin, settings.fast_model) \
            if self.cpu_twin is not None and self.layerwise is not None else None
        self.cpu_max_seeds = max(0, settings.cpu_max_seeds) if self.cpu_twin is not None else 0

    def route(self, node_type: str, num_seeds: int, exact: bool) -> tuple[Route, float]:
        """Where a batch samples, and its predicted sampled nodes (exact: the whole
        neighbourhood, on the GPU when there is one)."""
        if self.gpu_sampler is None:
            return Route.LOCAL, 0.0
        psgs = self.psgs.estimate(node_type, num_seeds)
        if exact:
            return Route.GPU, psgs
        state = EngineRouteState(num_seeds, len(self.waiting), [], on_gpu=True, psgs=psgs,
                                 quiver_size=int(psgs), waiting_batches=float(len(self.waiting)))
        return self.router.decide(state).route, psgs

    def follow(self) -> list[Reply]:
        """The living graph's step (``TypedEngineCore.follow``); once it has changed the
        graph, batches sample on the CPU over the updated host graph and the model reads host
        rows (its device copies are not patched in place; decision 0050): answers stay those of
        the updated graph."""
        version = self.sync.version if self.sync is not None else None
        replies = super().follow()
        if self.sync is not None and self.sync.version != version and not self.device_stale:
            self.device_stale = True
            self.served.gather = None
            log.info("engine %d: typed graph updated (version %d): batches sample on the CPU "
                     "and read host rows from now on", self.index, self.sync.version)
        return replies

    @torch.no_grad()
    def rows(self, node_type: str, seeds: Tensor, exact: bool, seed: int) -> np.ndarray:
        if seeds.numel() == 0 or (exact and self.table is not None) or self.device_stale:
            return super().rows(node_type, seeds, exact, seed)
        if not exact and int(seeds.numel()) <= self.cpu_max_seeds:
            return self.rows_on_cpu(node_type, seeds, seed)
        route, _ = self.route(node_type, int(seeds.numel()), exact)
        with torch.cuda.stream(self._stream) if self._stream is not None \
                else contextlib.nullcontext():
            return self.rows_on(route, node_type, seeds, exact, seed)

    def rows_on(self, route: Route, node_type: str, seeds: Tensor, exact: bool,
                seed: int) -> np.ndarray:
        """The batch's rows with its sample drawn on ``route`` (GPU or the CPU here)."""
        sampler = self.gpu_sampler if route == Route.GPU and self.gpu_sampler is not None \
            else self.sampler
        t0 = time.perf_counter()
        out = sampler.sample(node_type, seeds, self.all_fanouts if exact else self.fanouts, seed)
        # every hop's sizes were read on the host: what is left of the sample on the device
        # (the last concatenations) is counted in compute_s
        sample_s = time.perf_counter() - t0
        result = self.layerwise.sampled(out) if self.layerwise is not None else self.served(out)
        rows = result.float().cpu().numpy()
        compute_s = time.perf_counter() - t0 - sample_s
        path = Route.GPU if sampler is self.gpu_sampler else Route.LOCAL
        if self.learn_costs and not exact:
            self.router.cost.observe_sample(path, out.num_nodes, sample_s)
            self.router.cost.observe_compute(out.num_nodes, compute_s)
        batch = TypedBatchStats(node_type, str(path), int(seeds.numel()), out.num_nodes,
                                out.num_edges, sample_s, compute_s)
        self.record(batch)
        return rows

    def rows_on_cpu(self, node_type: str, seeds: Tensor, seed: int) -> np.ndarray:
        """A sampled batch wholly on the CPU: the C++ sampler and the model's twin there, over
        the host graph (the same answers as the GPU path)."""
        assert self.cpu_twin is not None
        t0 = time.perf_counter()
        out = self.sampler.sample(node_type, seeds, self.fanouts, seed)
        sample_s = time.perf_counter() - t0
        result = self.cpu_layerwise.sampled(out) if self.cpu_layerwise is not None \
            else self.cpu_twin(out)
        rows = result.float().numpy()
        self.record(TypedBatchStats(node_type, str(Route.CPU), int(seeds.numel()), out.num_nodes,
                                    out.num_edges, sample_s,
                                    time.perf_counter() - t0 - sample_s))
        return rows

    def calibrate_cpu_path(self, seed_types: list[str], gen: torch.Generator) -> None:
        """``cpu_max_seeds`` when configured -1: the largest warm-up batch size whose batches
        the CPU path ran faster than the GPU path (best of three each; 0: none)."""
        if self.cpu_twin is None or self.settings.cpu_max_seeds != -1:
            return
        faster, t = 0, seed_types[0]
        for b in WARM_BATCH_SEEDS:
            best = {"cpu": float("inf"), "gpu": float("inf")}
            for _ in range(3):
                ids = torch.randint(0, self.graph.num_nodes[t], (b,), generator=gen)
                for path in best:
                    t0 = time.perf_counter()
                    if path == "cpu":
                        self.rows_on_cpu(t, ids, b)
                    else:
                        self.rows_on(Route.GPU, t, ids, False, b)
                    best[path] = min(best[path], time.perf_counter() - t0)
            if best["cpu"] < best["gpu"]:
                faster = b
            log.info("engine %d: a batch of %d seeds, CPU path %.2f ms, GPU path %.2f ms",
                     self.index, b, best["cpu"] * 1e3, best["gpu"] * 1e3)
        self.cpu_max_seeds = faster
        log.info("engine %d: sampled batches of up to %d seeds run on the CPU", self.index,
                 faster)

    def record(self, batch: TypedBatchStats) -> None:
        """Add a batch to ``type_stats`` and hand it to ``on_typed_stats`` with the feature
        rows it read per type (the counters' change since the last batch: a small copy from
        the device once the batch is done)."""
        stats = self.type_stats.setdefault((batch.node_type, batch.route), TypeStats())
        stats.batches += 1
        stats.seeds += batch.num_seeds
        stats.sampled_nodes += batch.sampled_nodes
        stats.sampled_edges += batch.sampled_edges
        stats.sample_s += batch.sample_s
        stats.compute_s += batch.compute_s
        if self.on_typed_stats is None:
            return
        now = self.features.counts()
        batch.feature_rows = {t: (h - self._rows_seen[t][0], m - self._rows_seen[t][1])
                              for t, (h, m) in now.items()}
        self._rows_seen = now
        self.on_typed_stats(batch)

    def warm_up(self, seed_types: list[str]) -> None:
        """Batches of each seed type through each path, so the first request pays no lazy
        initialisation (kernel compiles, cuBLAS handles) and the cost model's lines start from
        this machine's times (each path's second round: the first pays the one-off costs)."""
        paths = [Route.LOCAL] + ([Route.GPU] if self.gpu_sampler is not None else [])
        gen = torch.Generator().manual_seed(self.index)
        for learn in (False, True):
            self.learn_costs = learn
            for t in seed_types:
                for b in WARM_BATCH_SEEDS:
                    ids = torch.randint(0, self.graph.num_nodes[t], (b,), generator=gen)
                    for path in paths:
                        self.rows_on(path, t, ids, False, b)
        self.learn_costs = True
        if self.gpu_sampler is not None:
            self.calibrate_cpu_path(seed_types, gen)
        self.type_stats.clear()
        self.features.reset_counts()  # the warm-up's rows are no requests' hits or misses
        self._rows_seen = self.features.counts()

    def stats_by_type(self) -> dict[str, dict]:
        """Per node type: batches, seeds and sampled nodes per path, and feature hits/misses."""
        out: dict[str, dict] = {}
        for (t, path), s in self.type_stats.items():
            out.setdefault(t, {})[path] = {
                "batches": s.batches, "seeds": s.seeds, "sampled_nodes": s.sampled_nodes,
                "sampled_edges": s.sampled_edges, "sample_s": round(s.sample_s, 6),
                "compute_s": round(s.compute_s, 6)}
        for t, (hits, misses) in self.features.counts().items():
            out.setdefault(t, {})["features"] = {"hits": hits, "misses": misses}
        return out


def seed_types_of(graph: TypedGraph, out_dims: dict[str, int]) -> list[str]:
    """The node types requests may name: those the model gives rows for."""
    return [t for t in graph.node_types if t in out_dims] or graph.node_types


def typed_gpu_sampler(cfg: ServeConfig, graph: TypedGraph,
                      device: torch.device) -> TypedReferenceSampler | None:
    """The GPU sampler (its kernels; their torch twin on the device when they do not build, or
    with ``sampling.implementation: reference``); the twin on a CPU device."""
    if device.type != "cuda":
        return TypedGpuSampler(graph, device, "device", kernels=False)
    mode = typed_gpu_mode(graph, device, cfg.sampling.gpu_mode)
    kernels = cfg.sampling.implementation != "reference"
    try:
        return TypedGpuSampler(graph, device, mode, kernels=kernels)
    except Exception as exc:  # noqa: BLE001 - the torch twin (device) or the CPU (uva) instead
        log.warning("typed GPU sampler kernels unavailable (%s: %s)", type(exc).__name__, exc)
        return TypedGpuSampler(graph, device, "device", kernels=False) if mode == "device" \
            else None


def typed_features(cfg: ServeConfig, graph: TypedGraph, device: torch.device, fanouts: dict,
                   seed_types: list[str]) -> TypedFeatures:
    """Every featured type's rows placed by FAP under one ``inference.gpu_cache_bytes``."""
    dtype = DTYPES[cfg.features.storage_dtype]
    row_bytes = {t: int(x.size(1)) * torch.empty(0, dtype=dtype).element_size()
                 for t, x in graph.x.items()}
    budget = cfg.inference.gpu_cache_bytes
    if sum(graph.num_nodes[t] * b for t, b in row_bytes.items()) <= budget:
        scores = {t: torch.zeros(graph.num_nodes[t]) for t in graph.x}  # all fit: no ranking
    else:
        scores = typed_fap(graph, fanouts, seed_types, cfg.features.fap_batch_size)
    placement = plan_typed_placement(scores, row_bytes, budget)
    features = TypedFeatures(graph.x, device, placement, dtype)
    log.info("typed feature store on %s: %s, %d bytes of %d", device, features.describe(),
             placement.gpu_bytes(), budget)
    return features


def build_typed_gpu_core(cfg: ServeConfig, graph: TypedGraph, index: int = 0,
                         spec: ModelSpec | None = None,
                         device: torch.device | None = None) -> TypedGpuEngineCore:
    """The typed engine core of ``cfg`` on its device (``device`` overrides it; a CPU device
    runs the GPU parts' torch twins): model (weights-only, probe forward), samplers, feature
    placement, PSGS per seed type, warm-up, then the exact table when ``exact.materialize``."""
    device = device or worker_device(cfg, index)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    spec = spec or ModelSpec.from_config(cfg.model)
    served = build_typed_model(spec, graph).to(device)
    fanouts = typed_fanouts(graph, cfg.sampling.fanouts if spec.fanouts is None else spec.fanouts)
    local = TypedReferenceSampler(graph) if cfg.sampling.implementation == "reference" \
        else TypedCppSampler(graph)
    seed_types = seed_types_of(graph, served.out_dims)
    features = typed_features(cfg, graph, device, fanouts, seed_types)
    psgs = measure_typed_psgs(local, graph.num_nodes, fanouts, seed_types)
    router = EngineRouter(cfg.sampling.route, quiver_threshold=cfg.sampling.quiver_threshold)
    parts = TypedGpuParts(device, typed_gpu_sampler(cfg, graph, device), features, psgs, router)
    settings = TypedSettings.of(cfg)
    core = TypedGpuEngineCore(served, fanouts, local, settings, parts, index=index)
    core.warm_up(seed_types)
    log.info("engine %d: typed core on %s, GPU sampler %s, PSGS per seed %s", index, device,
             getattr(parts.gpu_sampler, "kernels", None) is not None and "kernels" or "torch",
             {t: round(psgs.per_seed(t), 1) for t in seed_types})
    if settings.materialize:
        core.build_table()
    return core

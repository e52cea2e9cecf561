"""Routing: which path samples a batch. An interface returning a decision object, no processes.

The policy here is join-the-shortest-queue over the available paths; the PSGS issue replaces it
with a calibrated cost model behind the same interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from quiver_serve.messages import BatchedRequest

#: routes: "cpu" = CPU sampler pool; "gpu" = sampled on the GPU inside the inference worker;
#: "local" = sampled on the CPU inside the inference worker (no pool, no GPU)
ROUTES = ("cpu", "gpu", "local")


@dataclass
class RouterState:
    """What a router may look at: queue depths of every path, and what hardware there is."""

    cpu_queue_depths: list[int]  # one per CPU sampler worker (empty when there is no pool)
    inference_queue_depths: list[int]  # one per inference worker
    inference_on_gpu: bool


@dataclass
class RouteDecision:
    route: str  # one of ROUTES
    sampler: int  # CPU sampler worker index (route "cpu")
    worker: int  # inference worker index that computes the batch
    reason: str = ""


class Router(ABC):
    @abstractmethod
    def decide(self, batch: BatchedRequest, state: RouterState) -> RouteDecision:
        """Pick the path and workers for one batch."""


def _argmin(values: list[int]) -> int:
    return min(range(len(values)), key=values.__getitem__)


class QueueDepthRouter(Router):
    """Join the shortest queue; ``forced`` pins one route (config ``sampling.route``)."""

    def __init__(self, forced: str = "auto") -> None:
        if forced not in ("auto", *ROUTES):
            raise ValueError(f"unknown route {forced!r}")
        self.forced = forced

    def decide(self, batch: BatchedRequest, state: RouterState) -> RouteDecision:
        worker = _argmin(state.inference_queue_depths)
        has_pool = bool(state.cpu_queue_depths)
        sampler = _argmin(state.cpu_queue_depths) if has_pool else 0
        route = self.forced
        if route == "auto":
            if not has_pool:
                route = "gpu" if state.inference_on_gpu else "local"
            elif not state.inference_on_gpu:
                route = "cpu"
            else:
                cpu_depth = state.cpu_queue_depths[sampler]
                route = "cpu" if cpu_depth < state.inference_queue_depths[worker] else "gpu"
        if route == "cpu" and not has_pool:
            raise RuntimeError("route 'cpu' needs sampling.num_cpu_workers >= 1")
        if route == "gpu" and not state.inference_on_gpu:
            raise RuntimeError("route 'gpu' needs inference workers on a CUDA device")
        return RouteDecision(route=route, sampler=sampler, worker=worker, reason="queue depth")


# ---- the engine core's router (serving path) ----------------------------------------------------
#: engine-core routes: "gpu" = sampled on this engine's GPU; "cpu" = the CPU sampler pool;
#: "local" = sampled on the CPU inside the engine core
ENGINE_ROUTES = ("gpu", "cpu", "local")
#: below this many seeds the C++ sampler beats the GPU kernel's fixed cost (0.016 vs 0.065 ms on
#: an H200 box, plus the GPU sampler's host sync for its counts); such batches are sampled inside
#: the engine core (no hop to the pool, which costs more than it saves). The PSGS cost model of
#: the routing issue replaces this measured constant.
SMALL_BATCH_SEEDS = 16


@dataclass
class EngineRouteState:
    """What the engine router may look at for one batch."""

    num_seeds: int
    waiting_micro_batches: int  # left waiting after this batch was formed
    pool_outstanding: list[int]  # batches at each CPU sampler (empty: no pool)
    on_gpu: bool  # this engine samples on a GPU
    in_flight: int = 0  # batches launched on the GPU and not finished


class EngineRouter:
    """Route one batch: ``forced`` pins a path (config ``sampling.route``); ``auto`` decides.

    auto on a GPU engine: the GPU, except tiny batches, which the C++ sampler samples right here
    (its fixed cost is lower, and a hop to the pool would cost more than the sampling). auto on a CPU-only engine: sample here when nothing else waits (lowest
    latency); hand the batch to an idle CPU sampler when more work waits, so sampling of this batch
    overlaps the model of the next.
    """

    def __init__(self, forced: str = "auto", pool_depth: int = 2) -> None:
        if forced not in ("auto", *ENGINE_ROUTES):
            raise ValueError(f"unknown route {forced!r}")
        self.forced = forced
        self.pool_depth = pool_depth

    def decide(self, state: EngineRouteState) -> RouteDecision:
        free = _least(state.pool_outstanding)
        route = self.forced
        if route == "auto":
            pool_free = free is not None and state.pool_outstanding[free] < self.pool_depth
            if state.on_gpu:
                route = "local" if state.num_seeds < SMALL_BATCH_SEEDS else "gpu"
            else:
                route = "cpu" if pool_free and state.waiting_micro_batches > 0 else "local"
        if route == "cpu" and free is None:
            raise RuntimeError("route 'cpu' needs sampling.num_cpu_workers >= 1")
        if route == "gpu" and not state.on_gpu:
            route = "local"  # no GPU sampler (no CuPy, or it failed to build): sample on the CPU
        return RouteDecision(route=route, sampler=free or 0, worker=0, reason=self.forced)


def _least(values: list[int]) -> int | None:
    return _argmin(values) if values else None

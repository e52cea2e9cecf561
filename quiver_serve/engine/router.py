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

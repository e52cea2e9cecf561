"""Routing: which path samples a batch. One interface: ``EngineRouter.decide(state)`` returns an
``EngineRouteDecision`` naming a :class:`Route`; no processes.

The engine core routes each batch by the calibrated cost model of every path over the batch's
predicted sampled-graph size (PSGS), or by torch-quiver's fixed-threshold rule as a baseline.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import StrEnum

from quiver_serve.routing.cost import CostModel

log = logging.getLogger(__name__)


class Route(StrEnum):
    """Where a batch is sampled (a ``str``: metrics labels and cost-model keys take it as is)."""

    GPU = "gpu"  # on this engine core's GPU
    CPU = "cpu"  # by the CPU sampler pool
    LOCAL = "local"  # on the CPU inside the engine core


#: config ``sampling.route``: ``auto`` = every path, by the cost model; ``cpu`` = the CPU paths
#: (pool and engine) by the cost model; ``gpu`` / ``local`` = one path; ``quiver`` = torch-quiver's
#: rule (one draw's size per seed, summed, against ``quiver_threshold``: GPU above, CPU below)
ROUTE_MODES = ("auto", "cpu", "gpu", "local", "quiver")
#: route auto (and cpu) re-measure a path they have not chosen for this many decisions: a path
#: that is never chosen is never measured, so a line pushed up by one kind of batch (one-seed
#: GPU batches, a busy moment) would never come back down ...
EXPLORE_EVERY = 256
#: ... when that path is predicted at most this much slower than the best for the batch
EXPLORE_MAX_EXTRA_S = 1e-3


@dataclass
class EngineRouteState:
    """What the engine router may look at for one batch."""

    num_seeds: int
    waiting_micro_batches: int  # left waiting after this batch was formed
    pool_outstanding: list[int]  # batches at each CPU sampler (empty: no pool)
    on_gpu: bool  # this engine samples on a GPU
    in_flight: int = 0  # batches launched on the GPU and not finished
    psgs: float = 0.0  # predicted unique nodes of the batch (routing/psgs.py)
    quiver_size: int = 0  # torch-quiver's estimate: one draw's size per seed, summed
    pool_queued_s: list[float] = field(default_factory=list)  # predicted work at each sampler
    waiting_batches: float = 0.0  # work left waiting, in batches of this one's size


@dataclass
class EngineRouteDecision:
    route: Route
    sampler: int  # CPU sampler index (route "cpu"; else the least busy one, unused)
    predicted_s: float = 0.0  # predicted sampling time on the chosen path


class EngineRouter:
    """Route one batch by the cost model (``routing/cost.py``).

    Each path's finish time is its queued work plus its sampling time for the batch's PSGS. The
    engine thread is a path's queue too: the C++ sampler here and the GPU sampler (one host sync
    per batch) hold the thread while they sample, so every batch still waiting is delayed by that
    time; a pool sampler does not (the thread only sends). So a path scores
    ``queued + sample(psgs) + waiting_batches x engine_time(psgs)``, and the lowest score wins:
    with nothing waiting it is plain "finishes first"; under load, work moves to the pool while
    its queue is shorter than what it saves the engine thread. A path left unchosen for
    ``EXPLORE_EVERY`` decisions gets one batch when it is predicted at most
    ``EXPLORE_MAX_EXTRA_S`` slower, so its line is measured again.
    """

    def __init__(self, mode: str = "auto", cost: CostModel | None = None, pool_depth: int = 2,
                 quiver_threshold: int = 800) -> None:
        if mode not in ROUTE_MODES:
            raise ValueError(f"unknown route {mode!r}: expected one of {', '.join(ROUTE_MODES)}")
        self.forced = mode
        self.cost = cost if cost is not None else CostModel()
        self.pool_depth = pool_depth
        self.quiver_threshold = quiver_threshold
        self._logged_cpu_only = False
        #: the next decision goes to a free CPU sampler (set by ``overlap.PoolOverlap``: a batch
        #: split off for the pool while the GPU is busy); reset by every decision
        self.pool_next = False
        #: decisions since each path was last chosen, and how many batches were sent to a path
        #: only to measure it again (``EXPLORE_EVERY``)
        self._since = dict.fromkeys(Route, 0)
        self.explored = 0

    def decide(self, state: EngineRouteState) -> EngineRouteDecision:
        free = _least_free(state.pool_outstanding, self.pool_depth)
        any_pool = _least(state.pool_outstanding)
        mode = self.forced
        to_pool, self.pool_next = self.pool_next and free is not None, False
        if to_pool:
            mode = "pool"
        elif mode == "auto" and not state.on_gpu:
            if not self._logged_cpu_only:
                log.info("route auto on an engine without a GPU sampler: auto is cpu here")
                self._logged_cpu_only = True
            mode = "cpu"
        route = self._route(mode, state, free)
        for p in self._since:
            self._since[p] += 1
        self._since[route] = 0
        if route == Route.CPU and any_pool is None:
            raise RuntimeError("route 'cpu' needs sampling.num_cpu_workers >= 1")
        sampler = free if free is not None else (any_pool or 0)
        return EngineRouteDecision(route=route, sampler=sampler,
                                   predicted_s=self.cost.sample_s(route, state.psgs))

    def _route(self, mode: str, state: EngineRouteState, free: int | None) -> Route:
        if mode == "pool":
            return Route.CPU
        if mode == "gpu":  # no GPU sampler (no CuPy): the CPU here
            return Route.GPU if state.on_gpu else Route.LOCAL
        if mode == "local":
            return Route.LOCAL
        if mode == "quiver":
            if state.quiver_size >= self.quiver_threshold and state.on_gpu:
                return Route.GPU
            return Route.CPU if free is not None else Route.LOCAL
        paths = [Route.LOCAL] + ([Route.GPU] if mode == "auto" else [])
        if free is not None:
            paths.append(Route.CPU)
        best = min(paths, key=lambda p: self._score(p, state, free))
        return self._explore(paths, best, state.psgs)

    def _explore(self, paths: list[Route], best: Route, psgs: float) -> Route:
        """``best``, or a path not chosen for ``EXPLORE_EVERY`` decisions whose predicted
        sampling time is within ``EXPLORE_MAX_EXTRA_S`` of the best's: one batch in 256 at most
        pays that much, and the path's line learns from it (see ``cost.LatencyModel``)."""
        if psgs <= 0:
            return best
        best_s = self.cost.sample_s(best, psgs)
        for p in paths:
            if p != best and self._since[p] >= EXPLORE_EVERY \
                    and self.cost.sample_s(p, psgs) - best_s <= EXPLORE_MAX_EXTRA_S:
                self.explored += 1
                return p
        return best

    def paths(self, on_gpu: bool, has_pool: bool) -> tuple[Route, ...]:
        """The paths this router may send a batch to (the batch former sizes for the best)."""
        mode = "cpu" if self.forced == "auto" and not on_gpu else self.forced
        if mode in ("gpu", "local"):
            return (Route.GPU,) if mode == "gpu" and on_gpu else (Route.LOCAL,)
        out = [Route.LOCAL] + ([Route.GPU] if on_gpu and mode in ("auto", "quiver") else [])
        return tuple(out + ([Route.CPU] if has_pool else []))

    def _score(self, path: Route, state: EngineRouteState, sampler: int | None) -> float:
        sample_s = self.cost.sample_s(path, state.psgs)
        if path == Route.CPU:
            queued = state.pool_queued_s[sampler] if sampler is not None and \
                sampler < len(state.pool_queued_s) else 0.0
            return queued + sample_s
        return sample_s * (1.0 + state.waiting_batches)


def _least(values: list[int]) -> int | None:
    return min(range(len(values)), key=values.__getitem__) if values else None


def _least_free(values: list[int], depth: int) -> int | None:
    """The sampler holding the fewest batches, if it holds fewer than ``depth``."""
    j = _least(values)
    return j if j is not None and values[j] < depth else None


class PoolClock:
    """When each CPU sampler's queued batches are predicted to be done (``time.time()``)."""

    def __init__(self) -> None:
        self.busy_until: list[float] = []

    def queued_s(self, outstanding: list[int], now_s: float) -> list[float]:
        if len(self.busy_until) != len(outstanding):
            self.busy_until = [now_s] * len(outstanding)
        return [max(0.0, t - now_s) if k else 0.0 for t, k in zip(self.busy_until, outstanding, strict=True)]

    def on_send(self, sampler: int, predicted_s: float, now_s: float) -> None:
        if sampler < len(self.busy_until):
            self.busy_until[sampler] = max(now_s, self.busy_until[sampler]) + predicted_s

"""Pool overlap (route ``auto``): batches for idle CPU samplers while the GPU path is busy.

The engine core forms the next GPU batch only near the end of the one computing (``may_form``),
so that it holds as many requests as possible. Between two such moments the CPU sampler pool has
nothing to do, even when GPU sampling is the slower stage (UVA: the graph in pinned host memory,
2.2 ms for 8 k seeds against 0.25 ms device-resident) and the GPU idles while the engine thread
samples. This module decides, from the cost model alone (no processes: ``offload_seeds`` is a
pure function), how many of the waiting seeds to sample on an idle CPU sampler now:

* the next GPU batch is what the expected fill says (``fill.target_ids``) less what is already at
  the pool, ``P`` nodes by PSGS. Sampling it on the GPU holds the engine thread ``g(P)``; its
  model holds the GPU ``c(P)``. A batch split off to the pool saves ``b_g`` per node of thread
  time and adds the compute's fixed cost ``a_c`` (one batch more). So it pays only while
  ``g(P) > c(P) + a_c`` (sampling-bound), and balances the two stages at ``P_n = (g(P) - c(P) -
  a_c) / b_g`` nodes;
* the pool must finish it first: back no later than the GPU path would have sampled it
  (``pool(P_n) <= gpu_free_in + g(P)``, the GPU's launched work counted), and inside the oldest
  request's deadline budget with its compute;
* only a whole chunk is sent (the waiting seeds reach it), so the pool never gets slivers that
  each cost a batch's fixed compute.

That assumes GPU sampling runs beside the model (its own stream) and only holds the engine thread
(``sampling.pool_overlap: hidden``). If instead it takes GPU time from the model (UVA kernels
stalled on the bus occupy the GPU: ``serial``), the GPU saves ``b_g`` per node moved whatever the
stages' balance, so the pool takes as much as it returns in time, whenever that saves more than
the added batch's fixed cost ``a_c``. Which one holds is the hardware's: the bench measures both.

Device-resident sampling is ~10x faster than the model, so there it never fires: route auto then
behaves as before. Config ``sampling.pool_overlap``: hidden (default), serial, off.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from quiver_serve.engine.core.batch import Batch, SamplerPool
from quiver_serve.engine.core.forming import BatchFormer
from quiver_serve.engine.core.micro_batch import Reply
from quiver_serve.routing.cost import CostModel
from quiver_serve.routing.psgs import PsgsTable
from quiver_serve.routing.router import EngineRouter
from quiver_serve.sampling.base import BaseSampler
from quiver_serve.wire import NO_SEED


@dataclass
class OverlapInputs:
    """What the planner looks at (all from the engine core's own state)."""

    waiting_ids: int  # seeds waiting to be formed
    psgs_per_seed: float  # the waiting work's predicted unique nodes per seed
    expected_ids: float  # seeds of the next GPU batch, as the expected fill has it
    at_pool_ids: int  # seeds already at the pool (split off this cycle)
    gpu_free_in_s: float  # until the GPU's launched work is predicted done
    idle_samplers: int  # CPU samplers holding nothing
    budget_s: float  # the oldest waiting request's deadline budget


def may_pay(cost: CostModel) -> bool:
    """Whether a split can ever pay: ``g(P) - c(P) - a_c`` grows with P only while GPU sampling
    costs more per node than the model, or starts positive. False on device-resident sampling,
    so the engine loop skips the planner there (it would run at every spin while the GPU works)."""
    gpu, compute = cost.paths["gpu"], cost.compute
    return gpu.per_seed_s > compute.per_seed_s or gpu.fixed_s > 2.0 * compute.fixed_s


def offload_seeds(cost: CostModel, x: OverlapInputs, serial: bool = False) -> int:
    """Seeds to sample on an idle CPU sampler now; 0: leave them for the next GPU batch.
    ``serial``: GPU sampling takes GPU time from the model (see the module doc)."""
    if x.idle_samplers <= 0 or x.waiting_ids <= 0 or x.psgs_per_seed <= 0:
        return 0
    gpu, pool, compute = cost.paths["gpu"], cost.paths["cpu"], cost.compute
    p_next = x.psgs_per_seed * max(x.expected_ids - x.at_pool_ids, x.waiting_ids)
    g_s = gpu.predict_s(p_next)
    if gpu.per_seed_s <= 0:
        return 0
    if serial:
        p_off = p_next
    else:
        surplus_s = g_s - compute.predict_s(p_next) - compute.fixed_s
        if surplus_s <= 0:
            return 0  # compute-bound: a batch more costs the GPU more than it saves the thread
        p_off = min(surplus_s / gpu.per_seed_s, p_next)
    if pool.per_seed_s > 0:  # back before the GPU path would have it sampled, and in budget
        p_off = min(p_off, (x.gpu_free_in_s + g_s - pool.fixed_s) / pool.per_seed_s,
                    (x.budget_s - pool.fixed_s - compute.predict_s(p_off)) / pool.per_seed_s)
    if serial and gpu.per_seed_s * p_off <= compute.fixed_s:
        return 0  # saves the GPU less sampling time than the added batch's fixed cost
    seeds = int(p_off / x.psgs_per_seed)
    return seeds if 0 < seeds <= x.waiting_ids else 0


class OverlapCore(Protocol):
    """The engine core as the planner sees it (``core.EngineCore``)."""

    former: BatchFormer
    router: EngineRouter
    pool: SamplerPool | None
    gpu_sampler: BaseSampler | None
    in_flight: deque[Batch]
    sampling: dict[int, Batch]

    @property
    def psgs(self) -> PsgsTable | None: ...

    @property
    def cost(self) -> CostModel: ...

    def form(self, now_s: float, cap: int | None = None) -> tuple[Batch | None, list[Reply]]: ...

    def route_and_run(self, batch: Batch) -> list[Reply]: ...


class PoolOverlap:
    """The engine core's side: inputs from its state, then form and send one pool batch."""

    def __init__(self, serial: bool = False) -> None:
        self.serial = serial
        self.sent_batches = 0
        #: (waiting ids, batches at the pool, on the GPU) at the last "no": skip repeats
        self._refused_at = (-1, -1, -1)

    def inputs(self, core: OverlapCore, now_s: float) -> OverlapInputs | None:
        if not (core.in_flight and core.pool is not None and core.psgs is not None
                and core.gpu_sampler is not None and core.router.forced == "auto"):
            return None
        former = core.former
        first = former.waiting[0]
        if first.exact or first.seed != NO_SEED:
            return None  # exact and seeded requests keep their own paths
        idle = sum(1 for k in core.pool.outstanding() if k == 0)
        if idle == 0:
            return None
        waiting = former.waiting_ids
        per_seed = former.per_seed_psgs()
        at_pool = sum(int(b.seeds.numel()) for b in core.sampling.values())
        at_pool_s = sum(core.cost.compute.predict_s(b.psgs) for b in core.sampling.values())
        free_in_s = max(0.0, core.in_flight[-1].expected_done_s - now_s) + at_pool_s
        return OverlapInputs(waiting, per_seed, former.fill.target_ids(former.max_batch_nodes),
                             at_pool, free_in_s, idle, first.min_deadline_s - now_s)

    def step(self, core: OverlapCore) -> list[Reply]:
        """Send one batch to an idle CPU sampler if the planner says so (see module doc)."""
        if not self.serial and not may_pay(core.cost):
            return []
        # the engine loop spins while the GPU computes: plan again only when the work changed
        seen = (core.former.waiting_ids, len(core.sampling), len(core.in_flight))
        if seen == self._refused_at:
            return []
        now_s = time.time()
        x = self.inputs(core, now_s)
        seeds = offload_seeds(core.cost, x, self.serial) if x is not None else 0
        if seeds <= 0:
            self._refused_at = seen
            return []
        self._refused_at = (-1, -1, -1)
        fill = core.former.fill
        usual = fill.recent_ids, fill.hit_rate  # a pool chunk is no sample of the GPU batches
        batch, replies = core.form(now_s, cap=seeds)
        fill.recent_ids, fill.hit_rate = usual
        if batch is not None:
            # the next GPU batch waits for fewer ids: they are at the pool (the estimate of
            # what is in the system returns to the full count as batches are answered)
            fill.system_ids = max(0.0, fill.system_ids - int(batch.seeds.numel()))
            core.router.pool_next = True
            replies += core.route_and_run(batch)
            self.sent_batches += 1
        return replies

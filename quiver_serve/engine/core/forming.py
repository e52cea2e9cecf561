"""The batch former: when the engine core forms its next batch, and which waiting
micro-batches go in it.

A batch is formed only near the end of the one computing on the GPU (at most ``MAX_IN_FLIGHT``
launched), and then only once enough ids wait for the batch size the expected fill predicts, or
the wait for them is over (``fill.py``). It merges waiting micro-batches of one kind (exact or
not, one model slot; a seeded request alone) in arrival order, up to the most seeds that still
finish inside the oldest request's deadline budget by the cost model; expired requests are
dropped before any work.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from quiver_serve.engine.core.batch import Batch
from quiver_serve.engine.core.micro_batch import Part, Reply, prune
from quiver_serve.sampling.base import new_batch_seed
from quiver_serve.wire import NO_SEED, MicroBatchDone

#: finished GPU batches are noticed by polling their event; at most this many are launched at once
MAX_IN_FLIGHT = 2
#: this many waiting ids or fewer form one batch whatever the deadline (no cost-model sizing)
SMALL_BATCH_IDS = 16


def may_form(core: Any) -> bool:
    """Form the next batch now, or wait so it gathers more requests while the GPU is busy."""
    if len(core.in_flight) >= MAX_IN_FLIGHT:
        return False
    now_s = time.time()
    if core.in_flight:
        lead_s = core.sample_latency.predict_s(core.max_batch_nodes) + 2e-4
        if now_s < core.in_flight[-1].expected_done_s - lead_s:
            return False
    return filled(core, now_s)


def filled(core: Any, now_s: float) -> bool:
    """Enough ids wait for a batch of the expected size, or the wait for them is over
    (``fill.py``)."""
    first = core.waiting[0]
    if first.seed != NO_SEED or not core.expected_fill:
        core.fill.release()
        return True  # a seeded request forms a batch alone: nothing to wait for
    target = int(core.fill.target_ids(core.max_batch_nodes))
    batch_s = core.latency.predict_s(target)
    return bool(core.fill.ready(core._waiting_ids, core.max_batch_nodes, now_s,
                                core.latency.fixed_s, first.min_deadline_s - now_s - batch_s,
                                bool(core.in_flight), core.waiting[-1].received_s))


def form(core: Any, now_s: float, cap: int | None = None) -> tuple[Batch | None, list[Reply]]:
    """Merge waiting micro-batches of one kind into a batch sized to the deadline budget (or
    to ``cap`` seeds); the replies of micro-batches whose every request expired."""
    first = core.waiting[0]
    cap = seed_cap(core, first.min_deadline_s - now_s) if cap is None else cap
    parts: list[Part] = []
    refused: list[Reply] = []
    taken = 0
    while core.waiting:
        mb = core.waiting[0]
        if parts and (mb.exact != first.exact or mb.seed != NO_SEED or first.seed != NO_SEED
                      or mb.slot is not first.slot or taken + mb.num_ids > cap):
            break
        core.waiting.popleft()
        core._waiting_ids -= mb.num_ids
        core._waiting_draws -= mb.draws
        part = prune(mb, now_s)
        if part.alive is not None and not part.alive.any():
            refused.append(Reply(mb.client, MicroBatchDone(mb.seq, 0, part.errors), None))
            continue
        parts.append(part)
        taken += mb.num_ids
    core.fill.on_formed(taken)
    if not parts:
        return None, refused
    seeds = parts[0].alive_ids() if len(parts) == 1 else np.concatenate(
        [p.alive_ids() for p in parts])
    seed = first.seed if first.seed != NO_SEED else new_batch_seed()
    batch = Batch(next(core._ids), parts, torch.from_numpy(seeds), first.exact, seed,
                  formed_s=now_s, slot=first.slot)
    core.request_log.record(seeds)
    return batch, refused


def seed_cap(core: Any, budget_s: float) -> int:
    """Most seeds a batch may take and finish inside ``budget_s``: the cost model's largest
    PSGS over the paths the router may use, turned into seeds at the waiting work's mean PSGS
    per seed (the union grows slower than the seeds, so this errs small)."""
    if core._waiting_ids <= SMALL_BATCH_IDS:
        return int(core.max_batch_nodes)  # splitting a handful of ids finishes none sooner
    if core.psgs is None:
        return int(core.latency.max_seeds_within(budget_s, core.max_batch_nodes))
    paths = core.router.paths(core.gpu_sampler is not None, core.pool is not None)
    psgs_cap = core.cost.max_psgs_within(budget_s, paths)
    per_seed = core.psgs.union_of(max(core._waiting_draws, 0.0), core._waiting_ids) \
        / core._waiting_ids
    if psgs_cap == float("inf") or per_seed <= 0:
        return int(core.max_batch_nodes)
    return max(1, min(core.max_batch_nodes, int(psgs_cap / per_seed)))

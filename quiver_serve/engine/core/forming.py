"""The batch former: the micro-batches waiting in an engine core, when the core forms its next
batch, and which of them go in it.

A batch is formed only near the end of the one computing on the GPU (at most ``MAX_IN_FLIGHT``
launched), and then only once enough ids wait for the batch size the expected fill predicts, or
the wait for them is over (``fill.py``). It merges waiting micro-batches of one kind (exact or
not, one model slot; a seeded request alone) in arrival order, up to the most seeds that still
finish inside the oldest request's deadline budget by the cost model; expired requests are
dropped before any work.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Sequence

import numpy as np
import torch

from quiver_serve.engine.core.batch import Batch
from quiver_serve.engine.core.fill import ExpectedFill
from quiver_serve.engine.core.micro_batch import MicroBatch, Part, Reply, prune
from quiver_serve.engine.core.model_slots import ModelSlot
from quiver_serve.features.fap import RequestLog
from quiver_serve.routing.cost import CostModel, LatencyModel
from quiver_serve.routing.psgs import PsgsTable
from quiver_serve.sampling.base import new_batch_seed
from quiver_serve.wire import NO_SEED, MicroBatchDone

#: finished GPU batches are noticed by polling their event; at most this many are launched at once
MAX_IN_FLIGHT = 2
#: this many waiting ids or fewer form one batch whatever the deadline (no cost-model sizing)
SMALL_BATCH_IDS = 16
#: a client's report of its outstanding ids counts this long after its last micro-batch
CLIENT_REPORT_S = 1.0


class BatchFormer:
    """The waiting micro-batches of one engine core and the batches formed from them.

    ``psgs``: the PSGS table sizing batches by their sampled-graph size (None: by seed count);
    ``expected_fill``: hold a batch for the callers expected back (``fill.py``), else form from
    what waits; ``request_log``: every formed batch's seeds are recorded in it (the seed
    distribution of a feature re-placement)."""

    def __init__(self, max_batch_nodes: int, psgs: PsgsTable | None, request_log: RequestLog,
                 expected_fill: bool = True) -> None:
        self.max_batch_nodes, self.psgs = max_batch_nodes, psgs
        self.request_log, self.expected_fill = request_log, expected_fill
        self.waiting: deque[MicroBatch] = deque()
        self.fill = ExpectedFill()
        self._waiting_ids = 0
        self._waiting_draws = 0.0
        #: per client: ids it had outstanding at its last micro-batch, and when that arrived
        self._client_ids: dict[bytes, tuple[int, float]] = {}
        self._batch_ids = itertools.count()

    @property
    def waiting_ids(self) -> int:
        """Ids of the waiting micro-batches."""
        return self._waiting_ids

    def per_seed_psgs(self) -> float:
        """The waiting work's predicted sampled nodes per seed (0 without a PSGS table)."""
        if self.psgs is None:
            return 0.0
        waiting = self._waiting_ids
        return self.psgs.union_of(max(self._waiting_draws, 0.0), waiting) / max(waiting, 1)

    def reset_fill(self) -> None:
        """Forget what the expected fill learned (warm-up batches are no traffic)."""
        self.fill = ExpectedFill()

    # ---- the queue -----------------------------------------------------------------------------
    def push(self, mb: MicroBatch, num_nodes: int) -> None:
        """Queue a checked micro-batch (ids of ``num_nodes`` nodes are valid)."""
        if self.psgs is not None:
            ids = mb.ids if mb.valid is None else mb.ids[(mb.ids >= 0) & (mb.ids < num_nodes)]
            mb.draws = self.psgs.draws(ids)
            self._waiting_draws += mb.draws
        self.waiting.append(mb)
        self._waiting_ids += mb.num_ids
        if mb.outstanding_ids:
            self._client_ids[mb.client] = (mb.outstanding_ids, mb.received_s)

    def put_back(self, mbs: Sequence[MicroBatch]) -> None:
        """Queue ``mbs`` again at the front, in their order (a batch that must run again)."""
        for mb in reversed(mbs):
            self.waiting.appendleft(mb)
            self._waiting_ids += mb.num_ids

    def take_slot(self, slot: ModelSlot) -> list[MicroBatch]:
        """Remove and return the waiting micro-batches that run on ``slot``."""
        mine = [mb for mb in self.waiting if mb.slot is slot]
        if mine:
            keep = [mb for mb in self.waiting if mb.slot is not slot]
            self.waiting.clear()
            self.waiting.extend(keep)
            self._waiting_ids = sum(mb.num_ids for mb in keep)
            self._waiting_draws = sum(mb.draws for mb in keep)
        return mine

    def clients_outstanding(self, now_s: float) -> int:
        """Ids the clients heard from in the last second say they have outstanding: callers
        between two requests count too, which the engine cannot see itself."""
        stale = [c for c, (_, at) in self._client_ids.items() if now_s - at > CLIENT_REPORT_S]
        for c in stale:
            del self._client_ids[c]
        return sum(ids for ids, _ in self._client_ids.values())

    # ---- when to form --------------------------------------------------------------------------
    def may_form(self, in_flight: Sequence[Batch], latency: LatencyModel,
                 sample_latency: LatencyModel) -> bool:
        """Form the next batch now, or wait so it gathers more requests while the GPU is busy
        (``in_flight``: the batches launched on it)."""
        if len(in_flight) >= MAX_IN_FLIGHT:
            return False
        now_s = time.time()
        if in_flight:
            lead_s = sample_latency.predict_s(self.max_batch_nodes) + 2e-4
            if now_s < in_flight[-1].expected_done_s - lead_s:
                return False
        return self.filled(now_s, latency, bool(in_flight))

    def filled(self, now_s: float, latency: LatencyModel, device_busy: bool) -> bool:
        """Enough ids wait for a batch of the expected size, or the wait for them is over
        (``fill.py``)."""
        first = self.waiting[0]
        if first.seed != NO_SEED or not self.expected_fill:
            self.fill.release()
            return True  # a seeded request forms a batch alone: nothing to wait for
        target = int(self.fill.target_ids(self.max_batch_nodes))
        batch_s = latency.predict_s(target)
        return bool(self.fill.ready(self._waiting_ids, self.max_batch_nodes, now_s,
                                    latency.fixed_s, first.min_deadline_s - now_s - batch_s,
                                    device_busy, self.waiting[-1].received_s))

    # ---- which micro-batches -------------------------------------------------------------------
    def form(self, now_s: float, cap: int) -> tuple[Batch | None, list[Reply]]:
        """Merge waiting micro-batches of one kind into a batch of at most ``cap`` seeds; the
        replies of micro-batches whose every request expired."""
        first = self.waiting[0]
        parts: list[Part] = []
        refused: list[Reply] = []
        taken = 0
        while self.waiting:
            mb = self.waiting[0]
            if parts and (mb.exact != first.exact or mb.seed != NO_SEED or first.seed != NO_SEED
                          or mb.slot is not first.slot or taken + mb.num_ids > cap):
                break
            self.waiting.popleft()
            self._waiting_ids -= mb.num_ids
            self._waiting_draws -= mb.draws
            part = prune(mb, now_s)
            if part.alive is not None and not part.alive.any():
                refused.append(Reply(mb.client, MicroBatchDone(mb.seq, 0, part.errors), None))
                continue
            parts.append(part)
            taken += mb.num_ids
        self.fill.on_formed(taken)
        if not parts:
            return None, refused
        seeds = parts[0].alive_ids() if len(parts) == 1 else np.concatenate(
            [p.alive_ids() for p in parts])
        seed = first.seed if first.seed != NO_SEED else new_batch_seed()
        batch = Batch(next(self._batch_ids), parts, torch.from_numpy(seeds), first.exact, seed,
                      formed_s=now_s, slot=first.slot)
        self.request_log.record(seeds)
        return batch, refused

    def seed_cap(self, budget_s: float, latency: LatencyModel, cost: CostModel,
                 paths: tuple[str, ...]) -> int:
        """Most seeds a batch may take and finish inside ``budget_s``: the cost model's largest
        PSGS over the ``paths`` the router may use, turned into seeds at the waiting work's mean
        PSGS per seed (the union grows slower than the seeds, so this errs small)."""
        if self._waiting_ids <= SMALL_BATCH_IDS:
            return int(self.max_batch_nodes)  # splitting a handful of ids finishes none sooner
        if self.psgs is None:
            return int(latency.max_seeds_within(budget_s, self.max_batch_nodes))
        psgs_cap = cost.max_psgs_within(budget_s, paths)
        per_seed = self.psgs.union_of(max(self._waiting_draws, 0.0), self._waiting_ids) \
            / self._waiting_ids
        if psgs_cap == float("inf") or per_seed <= 0:
            return int(self.max_batch_nodes)
        return max(1, min(self.max_batch_nodes, int(psgs_cap / per_seed)))

"""EngineCore: the serving path's stage logic, one instance per GPU (or one on a CPU-only box).

A plain class driven by ``step()`` (tests drive it directly; ``engine/procs/engine_proc.py`` owns
the process, its sockets and its loop). Work arrives as micro-batches (one per front-end loop
tick) and leaves as one reply per micro-batch. Each ``step()``:

1. finishes batches whose GPU work is done (one host sync per batch: the copy-out), and computes
   batches whose sample came back from the CPU sampler pool;
2. forms the next batch from whatever micro-batches wait (continuous batching, ``forming.py``),
   as large as the cost model says still finishes inside the oldest request's deadline budget,
   dropping expired requests before any work;
3. routes it (GPU sampling here, the CPU pool, or CPU sampling here), samples, gathers features
   and launches the model. On a GPU the model runs on its own stream, so batch k+1 is formed and
   sampled while batch k computes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np
import torch
from torch import Tensor

from quiver_serve.engine.core import exact_answers, versions
from quiver_serve.engine.core.batch import Batch, batch_stats, is_cuda_fatal
from quiver_serve.engine.core.exact_table import ExactTable
from quiver_serve.engine.core.forming import MAX_IN_FLIGHT
from quiver_serve.engine.core.micro_batch import (
    MicroBatch,
    Reply,
    check_ids,
    failed_replies,
    refused_whole,
    split_rows,
    untyped_refusal,
)
from quiver_serve.engine.core.model_load import ModelLoads
from quiver_serve.engine.core.model_slots import ModelSlot, ModelTable, Refusal
from quiver_serve.engine.core.parts import CoreParts
from quiver_serve.features.store import FeatureStore
from quiver_serve.graph.typed import HOMOGENEOUS_NODE_TYPE
from quiver_serve.messages import BatchStats
from quiver_serve.models.graphed import GraphedForward
from quiver_serve.models.served import ServedModel
from quiver_serve.models.spec import ModelSpec
from quiver_serve.routing.cost import CostModel, LatencyModel
from quiver_serve.routing.psgs import PsgsTable
from quiver_serve.routing.router import EngineRouteState, PoolClock
from quiver_serve.sampling.base import BaseSampler, SamplerOutput
from quiver_serve.wire import MicroBatchDone, RequestError

log = logging.getLogger(__name__)

class EngineCore:
    """Stage logic of one engine core; see the module docstring."""

    def __init__(self, model: ServedModel, features: FeatureStore, device: torch.device,
                 local_sampler: BaseSampler, fanouts: list[int], num_nodes: int,
                 parts: CoreParts, *, index: int = 0, spec: ModelSpec | None = None) -> None:
        self.model, self.features, self.device = model, features, device
        spec = spec or ModelSpec("model", 1, type(model.model).__name__, num_layers=len(fanouts))
        #: every loaded (model, version) (``model_slots.py``); ``primary`` is the one built at
        #: start-up, whose model ``self.model`` is (the exact table's, the calibration's)
        self.primary = ModelSlot(spec, model, spec.fanouts_or(fanouts))
        self.models = ModelTable(spec.name)
        self.models.add(self.primary)
        self.former, self.router, self.tables = parts.former, parts.router, parts.tables
        self.pool, self.overlap, self.graph_sync = parts.pool, parts.overlap, parts.graph_sync
        self.replacer, self.current_degrees = parts.replacer, parts.current_degrees
        self.local_sampler, self.gpu_sampler = local_sampler, parts.gpu_sampler
        self.fanouts, self.num_nodes, self.index = list(fanouts), num_nodes, index
        self.max_waiting, self.quiet = parts.max_waiting, parts.quiet
        #: while above 0, no update is applied (a GCN's degrees or a new exact table being read)
        self.updates_held = 0
        self.sampling: dict[int, Batch] = {}  # batch_id -> batch at the CPU pool
        self.sampled: deque[Batch] = deque()  # back from the pool, not yet computed
        self.in_flight: deque[Batch] = deque()  # launched on the GPU
        #: micro-batches waiting for a graph version (``versions.py``)
        self.parked: deque[MicroBatch] = deque()
        #: exact micro-batches taken in since the last step (``exact_answers.py``)
        self.exact_waiting: list[MicroBatch] = []
        self.latency = LatencyModel()
        self.sample_latency = LatencyModel(prior_fixed_s=2e-4)
        self._pool_clock = PoolClock()  # when each CPU sampler's queue is predicted done
        #: learn from measured batches (off during the warm-up: one-off costs)
        self.learn_costs = True
        self.on_gpu = device.type == "cuda"
        # Serving streams at high priority: background work on the device (an exact table's
        # build and refresh, a model version loading, a re-placement) yields to them.
        self._compute_stream = torch.cuda.Stream(device, priority=-1) if self.on_gpu else None
        self._sample_stream = torch.cuda.Stream(device, priority=-1) if self.on_gpu else None
        self._counts_seen = (0, 0)  # hit/miss counters at the last batch answered
        #: timing events of answered batches, used again: an event made and destroyed per batch
        #: costs two more driver calls, slow while the GPU computes
        self._spare_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        #: called with each finished batch's stats (the process wrapper turns them into metrics)
        self.on_stats: Callable[[BatchStats], None] | None = None
        #: hold stats until ``flush_stats()`` (the process loop sends replies first, then records)
        self.defer_stats = False
        self._stats_held: list[BatchStats] = []
        #: sends replies at once (the process loop's socket): a finished batch is then answered
        #: before the next batch is sampled and launched, not after; None: ``step()`` returns them
        self.send_now: Callable[[list[Reply]], None] | None = None
        #: loads building and unloads draining (``model_load.py``); None: fixed models
        self.loads = ModelLoads(self, parts.loads) if parts.loads is not None else None

    # ---- the parts' state, read through the core ---------------------------------------------
    @property
    def waiting(self) -> deque[MicroBatch]:
        """Micro-batches waiting for the batch former (``BatchFormer.waiting``)."""
        return self.former.waiting

    @property
    def psgs(self) -> PsgsTable | None:
        """The PSGS table (``engine/core/calibrate.py``); None: route and size by seed count."""
        return self.former.psgs

    @property
    def exact_table(self) -> ExactTable | None:
        """The exact table (``model_tables.ExactTables``); None: exact requests on the fly."""
        return self.tables.table

    @property
    def graphed(self) -> GraphedForward | None:
        """The primary model's CUDA graphs for small sampled batches; None: always eager."""
        return self.primary.graphed

    def degree_weighted(self) -> bool:
        """Whether any loaded model normalises by full-graph degrees (GCN in exact mode)."""
        return any(slot.served.gcn_norm is not None for slot in self.models.each())

    def update_degrees(self, nodes: Tensor, in_degree: Tensor,
                       self_loops: Tensor | None = None) -> None:
        """New in-degrees (and self-loop counts) of ``nodes`` for every loaded model that
        normalises by them (``ServedModel.update_degrees``); between batches."""
        for slot in self.models.each():
            slot.served.update_degrees(nodes, in_degree, self_loops)

    def reset_feature_counts(self) -> None:
        self.features.reset_counts()
        self._counts_seen = (0, 0)

    def reset_cost_models(self) -> None:
        """Forget the fill and latencies learned so far (the warm-up's one-off costs)."""
        self.former.reset_fill()
        self.latency = LatencyModel()
        self.sample_latency = LatencyModel(prior_fixed_s=2e-4)

    @property
    def cost(self) -> CostModel:
        """The per-path cost model (the router's)."""
        return self.router.cost

    def set_cost_model(self, model: CostModel) -> None:
        self.router.cost = model

    # ---- intake --------------------------------------------------------------------------------
    def add(self, mb: MicroBatch) -> Reply | None:
        """Queue a micro-batch; a reply at once when it is refused (bad ids, engine overloaded).
        One that needs a graph version not applied here yet waits in ``parked``."""
        if mb.slot is None:
            slot = self.models.resolve(mb.model, mb.version, mb.num_requests)
            if isinstance(slot, Refusal):
                errs = [RequestError(i, slot.code, slot.message, slot.status)
                        for i in range(max(mb.num_requests, 1))]
                return Reply(mb.client, MicroBatchDone(mb.seq, 0, errs), None)
            mb.slot = slot
        if mb.node_type and (refused := untyped_refusal(mb, HOMOGENEOUS_NODE_TYPE)) is not None:
            return refused
        if mb.exact and mb.slot.no_exact is not None:
            return refused_whole(mb, "exact_unsupported", mb.slot.no_exact, 422)
        if self.graph_sync is not None and versions.must_wait(self, mb):
            return versions.park(self, mb)
        n_req = mb.num_requests
        total = int(mb.lengths[0]) if n_req == 1 else int(mb.lengths.sum())
        if n_req == 0 or total != mb.num_ids or mb.deadlines_s.size != n_req:
            err = RequestError(0, "invalid_request", "malformed micro-batch: ids, lengths and "
                               "deadlines do not agree", 400)
            return Reply(mb.client, MicroBatchDone(mb.seq, 0, [err]), None)
        mb.valid, mb.errors = check_ids(mb, self.num_nodes)
        mb.min_deadline_s = float(mb.deadlines_s[0] if n_req == 1 else mb.deadlines_s.min())
        if len(self.waiting) + len(self.exact_waiting) >= self.max_waiting:
            errs = [RequestError(i, "overloaded", "engine queue is full; retry later", 503)
                    for i in range(mb.num_requests)]
            return Reply(mb.client, MicroBatchDone(mb.seq, 0, errs), None)
        if mb.exact and self.tables.serves(mb.slot.served):
            self.exact_waiting.append(mb)  # answered from the table at the next step
            return None
        self.enqueue(mb)
        return None

    def enqueue(self, mb: MicroBatch) -> None:
        """Queue a checked micro-batch for the batch former (background table work waits
        from now: ``quiet.py``)."""
        self.quiet.note(False)
        self.former.push(mb, self.num_nodes)

    def ids_in_hand(self) -> int:
        """Ids waiting, at the CPU pool, sampled or on the GPU (not the batch being answered)."""
        return self.former.waiting_ids + sum(
            int(b.seeds.numel()) for group in (self.sampling.values(), self.sampled,
                                               self.in_flight) for b in group)

    @property
    def compute_stream(self) -> torch.cuda.Stream | None:
        """The CUDA stream batches are gathered and computed on (None on a CPU)."""
        return self._compute_stream

    @property
    def sample_stream(self) -> torch.cuda.Stream | None:
        """The CUDA stream samples are drawn on (None on a CPU)."""
        return self._sample_stream

    def finish_all(self) -> list[Reply]:
        """Wait for every batch on the GPU and answer them."""
        replies: list[Reply] = []
        while self.in_flight:
            replies += self._finish(block=True)
        return replies

    def has_ready_work(self) -> bool:
        return bool(self.waiting or self.sampled or self.exact_waiting)

    def busy(self) -> bool:
        return bool(self.waiting or self.sampled or self.in_flight or self.sampling or self.parked
                    or self.exact_waiting)

    def table_paused(self) -> AbstractContextManager[object]:
        """A block during which no exact-table chunk runs (swap what chunks read inside it)."""
        table = self.tables.table
        return table.work_lock if table is not None else contextlib.nullcontext()

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[Reply]:
        if self.replacer is not None:  # a finished re-placement switches here, between batches
            self.replacer.poll(self.former.request_log, self._compute_stream,
                              self.table_paused)
        replies = self._answer_finished()
        if self.loads is not None and self.loads.pending:
            replies += self.loads.poll()  # a built version joins, a drained one leaves
        if self.exact_waiting:  # first: rows a finished refresh round made clean
            replies += exact_answers.answer(self, time.time())
        if self.graph_sync is not None and not self.updates_held and not (  # updates apply
                self.exact_waiting and self.exact_table is not None  # between batches, and not
                and self.exact_table.holds_updates()):  # while requests wait for a round
            replies += self.graph_sync.poll(self)
            if self.parked:
                replies += versions.unpark(self, time.time())
            if self.exact_waiting:
                replies += exact_answers.answer(self, time.time())
        while self.sampled:
            replies += self._launch(self.sampled.popleft())
        if self.waiting and self.may_form():
            batch, refused = self.form(time.time())
            replies += refused
            if batch is not None:
                replies += self.route_and_run(batch)
        elif self.waiting and self.overlap is not None:  # GPU busy: idle CPU samplers' share
            replies += self.overlap.step(self)
        if not replies and not self.has_ready_work() and self.in_flight:
            replies += self._finish(block=not self.waiting)
        self.quiet.note(self.serving_quiet())
        return replies

    def serving_quiet(self) -> bool:
        """No batch to form, sample or finish (requests parked for a version or waiting for
        the table's round do not count: background work is what they wait for)."""
        return not (self.waiting or self.sampled or self.in_flight or self.sampling)

    def may_form(self) -> bool:
        """Form the next batch now (``BatchFormer.may_form``)."""
        return self.former.may_form(self.in_flight, self.latency, self.sample_latency)

    def form(self, now_s: float, cap: int | None = None) -> tuple[Batch | None, list[Reply]]:
        """The next batch from what waits (``BatchFormer.form``), of at most ``cap`` seeds
        (default: as many as finish inside the oldest request's deadline budget)."""
        if cap is None:
            budget_s = self.former.waiting[0].min_deadline_s - now_s
            cap = self.former.seed_cap(budget_s, self.latency, self.cost, self.router.paths(
                self.gpu_sampler is not None, self.pool is not None))
        return self.former.form(now_s, cap)

    # ---- routing, sampling, launching ------------------------------------------------------------
    def _route_state(self, batch: Batch) -> EngineRouteState:
        n = int(batch.seeds.numel())
        outstanding = self.pool.outstanding() if self.pool is not None else []
        state = EngineRouteState(n, len(self.waiting), outstanding, self.gpu_sampler is not None,
                                 len(self.in_flight),
                                 waiting_batches=self.former.waiting_ids / max(n, 1))
        if self.psgs is not None and not batch.exact and batch.slot.fanouts == self.fanouts:
            ids = batch.seeds.numpy()
            state.psgs = batch.psgs = float(self.psgs.estimate(ids))
            if self.router.forced == "quiver":
                state.quiver_size = self.psgs.quiver_sum(ids)
        if outstanding:
            state.pool_queued_s = self._pool_clock.queued_s(outstanding, time.time())
        return state

    def route_and_run(self, batch: Batch) -> list[Reply]:
        """Route a formed batch and sample it here, or send it to the CPU pool."""
        state = self._route_state(batch)
        decision = self.router.decide(state)
        batch.route = decision.route
        if batch.psgs > 0:
            batch.predicted_s = float(decision.predicted_s
                                      + self.cost.compute.predict_s(batch.psgs))
        if decision.route == "cpu":
            assert self.pool is not None
            self.sampling[batch.batch_id] = batch
            now = time.time()
            batch.sampler, batch.sent_s = decision.sampler, now
            batch.sent_idle = not state.pool_outstanding[decision.sampler]
            self._pool_clock.on_send(decision.sampler, decision.predicted_s, now)
            self.pool.send(decision.sampler, batch.batch_id, batch.seeds, self._fanouts(batch),
                           batch.seed)
            return []
        sampler = self.gpu_sampler if decision.route == "gpu" else self.local_sampler
        assert sampler is not None
        t0 = time.perf_counter()
        try:
            if self._sample_stream is not None:
                with torch.cuda.stream(self._sample_stream):
                    batch.sampled = sampler.sample(batch.seeds, self._fanouts(batch), batch.seed)
                    self.stage(batch)  # its copy to the host waits for sampling only
            else:
                batch.sampled = sampler.sample(batch.seeds, self._fanouts(batch), batch.seed)
        except Exception as exc:  # noqa: BLE001 - fails this batch only (CUDA faults re-raise)
            return self._fail(batch, exc)
        batch.sample_s = time.perf_counter() - t0
        self.sample_latency.observe(int(batch.seeds.numel()), batch.sample_s)
        if self.learn_costs and not batch.exact:
            self.cost.observe_sample(decision.route, batch.sampled.num_nodes, batch.sample_s)
        return self._launch(batch)

    def on_sampled(self, task_id: int, out: SamplerOutput | None, sample_s: float,
                   error: str | None = None) -> list[Reply]:
        """A CPU sampler's answer; the batch is computed at the next step."""
        batch = self.sampling.pop(task_id, None)
        if batch is None:
            return []  # answered already (retried elsewhere after its sampler died)
        if out is None:
            return self._fail(batch, RuntimeError(f"CPU sampler failed: {error}"))
        batch.sampled, batch.sample_s = out, sample_s
        if self.learn_costs and batch.sent_idle and not batch.exact:
            # sent to an idle sampler: the round trip is the path's own time (no queue in it)
            self.cost.observe_sample("cpu", out.num_nodes, time.time() - batch.sent_s)
        self.sampled.append(batch)
        return []

    def pool_lost(self, task_ids: list[int]) -> None:
        """A sampler died holding these batches: sample them here instead."""
        for task_id in task_ids:
            batch = self.sampling.pop(task_id, None)
            if batch is not None:
                self.former.put_back([part.mb for part in batch.parts])

    def stage(self, batch: Batch) -> None:
        """Pack a small sampled batch for its CUDA graph; always right before it is launched,
        so a host buffer is never packed twice before its copy is queued."""
        graphed = batch.slot.graphed
        if graphed is not None and not batch.exact and batch.sampled is not None \
                and batch.staged is None:
            batch.staged = graphed.stage(batch.sampled)

    def _fanouts(self, batch: Batch) -> list[int]:
        fanouts: list[int] = batch.slot.fanouts
        return [-1] * len(fanouts) if batch.exact else fanouts

    def _launch(self, batch: Batch) -> list[Reply]:
        """Gather and run the model; on a GPU asynchronously (finished by ``_finish``). A batch
        the GPU finished meanwhile is answered first: launching takes the host a millisecond or
        more, which its callers would otherwise wait on top."""
        try:
            if self._compute_stream is None:
                return self._run_sync(batch)
            early = self._answer_finished() if self.in_flight else []
            self.stage(batch)  # pool samples (host tensors); GPU samples were staged already
            self._run_async(batch)
            return early
        except Exception as exc:  # noqa: BLE001 - fails this batch only (CUDA faults re-raise)
            return self._fail(batch, exc)

    def _answer_finished(self) -> list[Reply]:
        """Answer the batches the GPU has finished: sent at once through ``send_now`` when the
        loop gave one (then nothing is returned), else returned."""
        replies = self._finish(block=False)
        if replies and self.send_now is not None:
            self.send_now(replies)
            return []
        return replies

    def forward(self, batch: Batch) -> Tensor:
        """Gather and model of a sampled batch, its seeds' rows (on the current stream)."""
        sb = batch.sampled
        assert sb is not None
        if batch.staged is not None:
            return GraphedForward.launch(batch.staged)  # one launch instead of dozens
        n_id = sb.n_id
        x = self.features.gather(n_id)  # GPU hits, zero-copy host misses, counted on the device
        edge_index = sb.edge_index.to(self.device, torch.int64, non_blocking=True)
        out = batch.slot.served(x, n_id.to(self.device, non_blocking=True), edge_index,
                                sb.num_sampled_nodes, sb.num_sampled_edges, batch.exact)
        return out.index_select(0, sb.seed_index.to(self.device, non_blocking=True))

    def _run_sync(self, batch: Batch) -> list[Reply]:
        t0 = time.perf_counter()
        rows = self.forward(batch).float()
        compute_s = time.perf_counter() - t0
        self.latency.observe(int(batch.seeds.numel()), compute_s + batch.sample_s)
        self._observe_compute(batch, compute_s)
        return self.answer(batch, rows.numpy(), compute_s)

    def _run_async(self, batch: Batch) -> None:
        stream = self._compute_stream
        assert stream is not None and batch.sampled is not None
        for t in (batch.sampled.n_id, batch.sampled.edge_index, batch.sampled.seed_index):
            if t.is_cuda:
                t.record_stream(stream)  # made on the sampling stream, read on this one
        batch.start_event, batch.done_event = self._spare_events.pop() if self._spare_events \
            else (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        with torch.cuda.stream(stream):
            batch.start_event.record(stream)
            rows = self.forward(batch).float()
            host = torch.empty(rows.shape, dtype=torch.float32, pin_memory=True)
            host.copy_(rows, non_blocking=True)
            batch.counts = torch.empty(2, dtype=torch.int64, pin_memory=True)
            batch.counts.copy_(self.features.counts, non_blocking=True)  # read with the rows
            batch.done_event.record(stream)
        batch.rows = host
        now = time.time()
        start = max(now, self.in_flight[-1].expected_done_s) if self.in_flight else now
        batch.launched_s = now
        batch.expected_done_s = start + self.latency.predict_s(int(batch.seeds.numel()))
        self.in_flight.append(batch)

    def _finish(self, block: bool) -> list[Reply]:
        replies: list[Reply] = []
        while self.in_flight:
            batch = self.in_flight[0]
            if not batch.done_event.query():
                if not block:
                    break
                batch.done_event.synchronize()  # the batch's one host sync: its copy-out
            self.in_flight.popleft()
            compute_s = batch.start_event.elapsed_time(batch.done_event) / 1e3
            if len(self._spare_events) < 2 * MAX_IN_FLIGHT:
                self._spare_events.append((batch.start_event, batch.done_event))
            batch.start_event = batch.done_event = None
            self.latency.observe(int(batch.seeds.numel()), compute_s)
            self._observe_compute(batch, compute_s)
            assert batch.rows is not None
            replies += self.answer(batch, batch.rows.numpy(), compute_s)
            block = False
        return replies

    def _observe_compute(self, batch: Batch, compute_s: float) -> None:
        if self.learn_costs and not batch.exact and batch.sampled is not None:
            self.cost.observe_compute(batch.sampled.num_nodes, compute_s)

    # ---- replies ---------------------------------------------------------------------------------
    def answer(self, batch: Batch, rows: np.ndarray, compute_s: float) -> list[Reply]:
        """The replies of a computed batch (``rows``: its seeds' rows, in part order), one per
        micro-batch; its stats are recorded and the expected fill learns from it."""
        stats = self._stats(batch, compute_s)
        self.former.fill.on_answered(sum(p.mb.num_ids for p in batch.parts), self.ids_in_hand(),
                              self.former.clients_outstanding(time.time()))
        dim = int(rows.shape[1])
        replies = []
        for i, (part, chunk) in enumerate(zip(batch.parts, split_rows(batch.parts, rows),
                                              strict=True)):
            done = MicroBatchDone(part.mb.seq, dim, part.errors, stats if i == 0 else None,
                                  model=batch.slot.name, version=batch.slot.version)
            replies.append(Reply(part.mb.client, done, chunk))
        self.record_stats(stats)
        return replies

    def record_stats(self, stats: BatchStats) -> None:
        """Hand a finished batch's stats to ``on_stats`` (now, or at ``flush_stats``)."""
        if self.on_stats is not None:
            self._stats_held.append(stats)
            if not self.defer_stats:
                self.flush_stats()

    def flush_stats(self) -> None:
        """Hand held batch stats to ``on_stats`` (metrics: off the replies' path)."""
        held, self._stats_held = self._stats_held, []
        if self.on_stats is not None:
            for stats in held:
                self.on_stats(stats)

    def _stats(self, batch: Batch, compute_s: float) -> BatchStats:
        stats, self._counts_seen = batch_stats(batch, compute_s, self.index, self.features,
                                               self._counts_seen)
        return stats

    def _fail(self, batch: Batch, exc: BaseException) -> list[Reply]:
        if is_cuda_fatal(exc):
            raise exc  # a sticky CUDA error: the process restarts; clients retry its batches
        from quiver_serve.errors import internal_error

        err = internal_error(exc, f"engine {self.index} batch {batch.batch_id}", log).info
        return failed_replies(batch.parts, err.code, err.message, err.status)

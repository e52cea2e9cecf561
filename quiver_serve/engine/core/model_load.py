"""Loads and unloads of model versions while the engine core serves (docs/architecture.md, "Models
and versions").

A load builds the new version in a thread beside the serving loop: the module from its spec and
its weights-only ``state_dict`` (``models/served.py`` names what is wrong: a missing file, a
shape mismatch, an import error, NaN weights), the fast layers and their check against PyG's,
the CUDA graphs (captured thread-locally on their own stream, so the loop's kernels go on), and
one sampled and one exact warm-up forward whose rows must be finite. Only then does the loop
thread take it in (:meth:`ModelLoads.poll`, between two steps): GCN's degrees are brought up to
the graph the core serves now and the slot joins the table, serving pinned requests at once and
unpinned ones once the main process sets its traffic weight. A failed build leaves nothing
behind: its tensors and graphs are dropped and the CUDA cache is emptied.

The swap does not wait for the version's exact table: a version of the table's model joins with
none, its exact requests answered on the fly, and its table is built by the loop thread between
steps, at most ``models.table_build_step_ms`` of work per step (``table_build.py``), then swapped
in (``model_tables.follow_table``) once built and the version takes the model's traffic
(docs/decisions/0040-model-load-duty.md).

An unload marks the slot draining (no new requests resolve to it); what it holds finishes on it,
then it is released. Requests still waiting after ``unload_drain_s`` are answered 503.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from quiver_serve.engine.core import model_tables
from quiver_serve.engine.core.batch import Batch
from quiver_serve.engine.core.forming import BatchFormer
from quiver_serve.engine.core.micro_batch import MicroBatch, Reply
from quiver_serve.engine.core.model_slots import DRAINING, Hold, ModelSlot
from quiver_serve.engine.core.model_tables import TablesCore
from quiver_serve.engine.core.slot_checks import SlotCore, capture_graphs, check_fast_model
from quiver_serve.engine.core.table_build import StepwiseBuild
from quiver_serve.models.served import ServedModel, build_model
from quiver_serve.models.spec import ModelSpec
from quiver_serve.sampling import make_cpu_sampler
from quiver_serve.sampling.base import BaseSampler, new_batch_seed
from quiver_serve.wire import MicroBatchDone, RequestError

log = logging.getLogger(__name__)

#: called once with the loaded slot's description, or with the error that stopped the load
Done = Callable[[dict[str, Any] | None, str | None], None]
WARM_SEEDS = 8
#: loads one engine core takes at once (more are refused, named)
MAX_QUEUED_LOADS = 16
#: an idle loader thread checks this often whether its engine core is gone
LOADER_CHECK_S = 300.0



@dataclass(frozen=True)
class LoadSettings:
    """How an engine core builds the versions it loads (``inference.*``, ``models.*``)."""

    precision: str
    fast: bool
    cuda_graph_max_seeds: int
    unload_drain_s: float
    #: most seconds of exact-table build per engine step (``models.table_build_step_ms``)
    table_build_step_s: float = 0.002


class LoadingCore(TablesCore, SlotCore, Protocol):
    """The engine core as loads and unloads see it (``core.EngineCore``)."""

    former: BatchFormer
    parked: deque[MicroBatch]
    sampling: dict[int, Batch]
    sampled: deque[Batch]
    in_flight: deque[Batch]
    fanouts: list[int]
    model: ServedModel
    current_degrees: Callable[[], tuple[Tensor, Tensor | None]] | None

    def serving_quiet(self) -> bool: ...


class ModelLoads:
    """Builds in flight and slots draining, for one engine core; see the module docstring."""

    def __init__(self, core: LoadingCore, settings: LoadSettings) -> None:
        self.core, self.precision, self.fast = core, settings.precision, settings.fast
        self.cuda_graph_max_seeds = settings.cuda_graph_max_seeds
        self.unload_drain_s = settings.unload_drain_s
        self.table_build_step_s = settings.table_build_step_s
        self._last_build_s = 0.0  # time.monotonic() of the last build step (``quiet.py``)
        #: exact tables of installed versions being built by the loop thread, by ``id(slot)``
        self._builds: dict[int, tuple[ModelSlot, StepwiseBuild]] = {}
        #: after each step of a table build: its chunks' seconds and the build's progress (0..1)
        self.on_build_step: Callable[[list[float], float], None] | None = None
        self._built: deque[tuple[tuple[str, int], ModelSlot | None, str | None, Done]] = deque()
        self._draining: dict[int, tuple[ModelSlot, Done]] = {}
        #: loads for the loader thread (None: end it); one more slot than loads, for that
        self._queue: queue.Queue[tuple[ModelSpec, Done] | None] = queue.Queue(
            MAX_QUEUED_LOADS + 1)
        self._thread: threading.Thread | None = None
        self._stream: torch.cuda.Stream | None = None  # the loader thread's CUDA stream
        self._lock = threading.Lock()
        self._asked: list[model_tables.Hold] = []  # holds on updates loaders wait for
        self._building: set[tuple[str, int]] = set()  # queued or building (loop thread's view)
        self._cancelled: set[tuple[str, int]] = set()  # unloaded before they were installed
        self._dead: list[model_tables.Hold] = []  # holds of failed builds, given back by the loop

    @property
    def pending(self) -> bool:
        return bool(self._built or self._draining or self._asked or self._dead
                    or self.core.updates_held or self._builds)

    @property
    def building(self) -> bool:
        """An exact table is being built: the loop steps without sleeping until it is done."""
        return bool(self._builds)

    def table_builds(self) -> list[StepwiseBuild]:
        """The exact-table builds in progress (their progress and chunk times, for metrics)."""
        return [build for _, build in self._builds.values()]

    def _ask(self, hold: model_tables.Hold) -> None:
        with self._lock:
            self._asked.append(hold)

    # ---- load ----------------------------------------------------------------------------------
    def load(self, spec: ModelSpec, done: Done) -> None:
        """Build ``spec`` on the loader thread; ``done`` is called from the loop thread once it
        serves (or failed)."""
        if self.core.models.get(spec.name, spec.version) is not None:
            done(None, f"model {spec.name!r} version {spec.version} is loaded already")
            return
        self._cancelled.discard(spec.key)
        try:
            if self._queue.qsize() >= MAX_QUEUED_LOADS:
                raise queue.Full
            self._queue.put_nowait((spec, done))
            self._building.add(spec.key)
        except queue.Full:
            done(None, f"{MAX_QUEUED_LOADS} loads are queued in engine {self.core.index}; "
                 "retry when they are done")
            return
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=_loader_main, args=(weakref.ref(self), self._queue), daemon=True,
                name=f"quiver-model-loader-{self.core.index}")
            self._thread.start()

    def close(self) -> None:
        """End the loader thread (after the build it is on)."""
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass

    def __del__(self) -> None:
        self.close()

    def _build(self, spec: ModelSpec, done: Done) -> None:
        holds: list[model_tables.Hold] = []
        try:
            slot = build_slot(self.core, spec, self.precision, self.fast,
                              self.cuda_graph_max_seeds, self._stream, self._ask, holds)
            result: tuple[tuple[str, int], ModelSlot | None, str | None, Done] = (
                spec.key, slot, None, done)
        except Exception as exc:  # noqa: BLE001 - a failed load is answered, never fatal
            log.warning("engine %d: loading %s version %d failed: %s", self.core.index,
                        spec.name, spec.version, exc)
            with self._lock:
                self._dead += holds
            release_cache(self.core.device)
            result = (spec.key, None, f"{type(exc).__name__}: {exc}", done)
        with self._lock:
            self._built.append(result)

    # ---- unload --------------------------------------------------------------------------------
    def unload(self, name: str, version: int, done: Done) -> None:
        """Drain, then release, ``name`` version ``version``."""
        slot = self.core.models.get(name, version)
        if slot is None and (name, version) in self._building:
            self._cancelled.add((name, version))  # dropped when its build ends
            done({"name": name, "version": version, "released": True}, None)
            return
        if slot is None:
            done(None, f"model {name!r} version {version} is not loaded")
            return
        slot.state, slot.weight = DRAINING, 0.0
        slot.drain_since_s = time.monotonic()
        self._builds.pop(id(slot), None)
        model_tables.discard_pending(self.core, slot)
        self._draining[id(slot)] = (slot, done)

    # ---- the loop thread -------------------------------------------------------------------------
    def poll(self) -> list[Reply]:
        """Between two steps: take finished builds in, release drained slots."""
        replies: list[Reply] = []
        with self._lock:
            asked, self._asked = self._asked, []
            dead, self._dead = self._dead, []
        model_tables.give_holds(self.core, asked)
        for hold in dead:
            model_tables.give_back(self.core, hold)
        if self.core.updates_held:
            model_tables.expire_holds(self.core)
            for key, (slot, _) in list(self._builds.items()):
                if slot.hold is None:  # expired: the table would be served stale
                    del self._builds[key]
        while self._built:
            with self._lock:
                key, slot, error, done = self._built.popleft()
            self._building.discard(key)
            cancelled = key in self._cancelled
            self._cancelled.discard(key)
            if slot is not None:
                if cancelled:
                    model_tables.discard_pending(self.core, slot)
                    release(slot)
                    slot, error = None, "the load was cancelled (the version was unloaded)"
            if slot is not None:
                error = self._install(slot)
            done(slot.describe() if slot is not None and error is None else None, error)
        if self._builds:
            self._build_tables()
        for key, (slot, done) in list(self._draining.items()):
            replies += self._drain(slot)
            if not in_use(self.core, slot):
                del self._draining[key]
                self._release_slot(slot)
                done({"name": slot.name, "version": slot.version, "released": True}, None)
        return replies

    def _install(self, slot: ModelSlot) -> str | None:
        core = self.core
        if core.models.get(slot.name, slot.version) is not None:
            model_tables.discard_pending(core, slot)
            release(slot)
            return f"model {slot.name!r} version {slot.version} is loaded already"
        core.models.add(slot)
        build = model_tables.start_pending_build(core, slot, self.table_build_step_s) \
            if core.tables.wants(slot.name) else None
        if build is None:  # degrees read under the hold are current: give it back
            model_tables.release_hold(core, slot)
        else:  # the graph stays held until the table is built and swapped in
            self._builds[id(slot)] = (slot, build)
            self._last_build_s = time.monotonic()  # a busy loop's first step waits too
        log.info("engine %d: %s version %d serving (load %s)", core.index, slot.name,
                 slot.version, {k: round(v, 3) for k, v in slot.load_s.items()})
        return None

    def _build_tables(self) -> None:
        """One step's budget of exact-table work (the oldest build first) when the loop is quiet
        or ``exact.quiet_wait_ms`` after the last (``quiet.py``); a built table waits
        in ``slot.pending_table`` and is swapped in at once if its version is the model's main
        one (else when the traffic split makes it so: ``follow_table``)."""
        now_s = time.monotonic()
        if not self.core.quiet.due(self.core.serving_quiet(), self._last_build_s, now_s):
            return  # serving first: a step runs when the loop is quiet, or after quiet_wait_ms
        self._last_build_s = now_s
        key = next(iter(self._builds))
        slot, build = self._builds[key]
        try:
            done = build.step()
        except Exception as exc:  # noqa: BLE001 - the version serves; exact answers on the fly
            log.warning("engine %d: exact table of %s version %d failed: %s", self.core.index,
                        slot.name, slot.version, exc)
            del self._builds[key]
            model_tables.discard_pending(self.core, slot)
            done = True
        if self.on_build_step is not None:
            self.on_build_step(build.take_chunk_s(), 1.0 if done else build.progress())
        if key not in self._builds or not done:
            return
        del self._builds[key]
        slot.pending_table = build.table
        slot.load_s["exact_table_s"] = build.clock() - build.started_s
        slot.load_s["exact_table_compute_s"] = build.compute_s
        log.info("engine %d: exact table of %s version %d built beside serving: %d chunks in "
                 "%d steps, %.3f s computing, %.3f s in all", self.core.index, slot.name,
                 slot.version, build.chunks_done, build.steps, build.compute_s,
                 slot.load_s["exact_table_s"])
        if slot.weight > 0:
            self.follow_table(slot.name)

    def _drain(self, slot: ModelSlot) -> list[Reply]:
        """Past the drain limit: answer the slot's waiting requests 503 (batches already
        sampling or computing finish)."""
        if time.monotonic() - slot.drain_since_s < self.unload_drain_s:
            return []
        core = self.core
        mine = core.former.take_slot(slot)
        if not mine and not any(mb.slot is slot for mb in core.exact_waiting) \
                and not any(mb.slot is slot for mb in core.parked):
            return []
        gone = mine + [mb for mb in core.exact_waiting if mb.slot is slot] \
            + [mb for mb in core.parked if mb.slot is slot]
        core.exact_waiting = [mb for mb in core.exact_waiting if mb.slot is not slot]
        parked = [mb for mb in core.parked if mb.slot is not slot]
        core.parked.clear()
        core.parked.extend(parked)
        return [_refuse(mb, slot) for mb in gone]

    def follow_table(self, name: str) -> None:
        """``name``'s traffic split changed: the exact table follows its main version (a
        version whose table is still building keeps building if it is the main one)."""
        building = {id(slot) for slot, _ in self._builds.values()}
        for slot in model_tables.follow_table(self.core, name, building):
            self._builds.pop(id(slot), None)

    def _release_slot(self, slot: ModelSlot) -> None:
        core = self.core
        core.models.remove(slot)
        self._builds.pop(id(slot), None)
        model_tables.discard_pending(core, slot)
        if core.tables.serves(slot.served):
            model_tables.drop_exact_table(core, f"{slot.name} version {slot.version} was "
                                          "unloaded")
        if slot is core.primary:
            rest = core.models.of(core.models.default) or core.models.each()
            if rest:
                core.primary = rest[-1]
                core.model = core.primary.served
        release(slot)
        release_cache(core.device)
        log.info("engine %d: %s version %d released", core.index, slot.name, slot.version)


def _loader_main(ref: weakref.ref[ModelLoads],
                 jobs: queue.Queue[tuple[ModelSpec, Done] | None]) -> None:
    """The loader thread: one for the core's life, so its CUDA stream (and the cuBLAS
    workspaces kept per thread and stream) is made once, not per load. It waits on the queue
    (waking only every ``LOADER_CHECK_S``, so almost nothing it holds is freed under a frozen
    heap) and holds its ``ModelLoads`` only while it builds, so it ends when that is closed or
    collected."""
    loads = ref()
    if loads is None:
        return
    if loads.core.on_gpu:
        torch.cuda.set_device(loads.core.device)  # per thread: this one builds there
        loads._stream = torch.cuda.Stream(loads.core.device)
    del loads
    while True:
        try:
            job = jobs.get(timeout=LOADER_CHECK_S)
        except queue.Empty:
            if ref() is None:  # the core went without closing it
                return
            continue
        loads = ref()
        if job is None or loads is None:
            return
        loads._build(*job)
        del loads


def _refuse(mb: MicroBatch, slot: ModelSlot) -> Reply:
    msg = (f"model {slot.name!r} version {slot.version} was unloaded before this request ran "
           "(it waited past models.unload_drain_s)")
    errs = [RequestError(i, "model_version_unavailable", msg, 503) for i in range(mb.num_requests)]
    return Reply(mb.client, MicroBatchDone(mb.seq, 0, errs), None)


def in_use(core: LoadingCore, slot: ModelSlot) -> bool:
    """Whether any work the core holds runs on ``slot``."""
    if any(mb.slot is slot for group in (core.waiting, core.exact_waiting, core.parked)
           for mb in group):
        return True
    return any(b.slot is slot for group in (core.sampling.values(), core.sampled, core.in_flight)
               for b in group)


def release(slot: ModelSlot) -> None:
    """Drop the slot's tensors and CUDA graphs (it is unusable after)."""
    slot.graphed = None
    slot.served.release()


def release_cache(device: torch.device) -> None:
    """Return freed blocks to the device, so an unloaded version's memory is free for others."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# ---- building one version (the loader thread) ------------------------------------------------------
def build_slot(core: LoadingCore, spec: ModelSpec, precision: str, fast: bool,
               cuda_graph_max_seeds: int, stream: torch.cuda.Stream | None = None,
               ask: Callable[[Hold], None] | None = None,
               holds: list[Hold] | None = None) -> ModelSlot:
    """The slot of ``spec`` on the core's device, checked and warmed up; raises naming what is
    wrong. ``stream``: the CUDA stream to build on (default: a new one). ``ask``: beside a
    serving loop (``ModelLoads``), how to ask it to hold updates while the graph is read (a
    GCN's degrees, a new exact table); the hold taken is appended to ``holds``."""
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    fanouts = spec.fanouts_or(core.fanouts)
    if len(fanouts) != spec.num_layers:
        raise ValueError(f"{spec.name}: {len(fanouts)} fanouts for {spec.num_layers} layers")
    module = build_model(spec, core.features.dim)
    gcn = degree_weighted(module)
    table = ask is not None and core.tables.wants(spec.name)
    hold = model_tables.take_hold(ask) if ask is not None and (gcn or table) else None
    if hold is not None and holds is not None:
        holds.append(hold)
    degree, loops = core.current_degrees() if gcn and core.current_degrees is not None \
        else (None, None)
    served = ServedModel(module, degree, loops, precision=precision, fast=fast,
                         capacity=None if degree is None else int(degree.numel()),
                         in_channels=core.features.dim)
    served.to(core.device)
    slot = ModelSlot(spec, served, fanouts, hold=hold)
    times["build_s"] = time.perf_counter() - t0
    sampler = loader_sampler(core)
    if stream is None and core.on_gpu:
        stream = torch.cuda.Stream(core.device)
    with torch.cuda.stream(stream) if stream is not None else _null():
        t1 = time.perf_counter()
        if served.fast is not None:
            check_fast_model(core, slot=slot, sampler=sampler)
        warm_up(core, slot, sampler)
        times["warm_up_s"] = time.perf_counter() - t1
    if stream is not None:
        stream.synchronize()
        t2 = time.perf_counter()
        capture_graphs(core, cuda_graph_max_seeds, slot, sampler, stream=stream)
        times["cuda_graphs_s"] = time.perf_counter() - t2
    slot.load_s = times
    return slot


def degree_weighted(module: torch.nn.Module) -> bool:
    """Whether the module normalises by node degrees (GCN): it then needs the graph's."""
    from torch_geometric.nn import GCNConv

    return any(isinstance(m, GCNConv) and m.normalize for m in module.modules())


def loader_sampler(core: LoadingCore) -> BaseSampler:
    """A sampler of its own over the base graph (the loop's samplers are not shared across
    threads); its samples only check and warm the new version."""
    ref = core.local_sampler
    return make_cpu_sampler(ref.indptr, ref.indices, "reference")


@torch.no_grad()
def warm_up(core: LoadingCore, slot: ModelSlot, sampler: BaseSampler) -> None:
    """One sampled and one exact forward of a few seeds; their rows must be finite."""
    n = max(min(sampler.num_nodes, core.num_nodes), 1)
    seeds = torch.from_numpy(np.random.default_rng().integers(0, n, WARM_SEEDS))
    for exact in (False, True):
        if exact:  # the full L-hop neighbourhood: of the sparsest of them (cheap on any graph)
            degree = sampler.indptr[seeds + 1] - sampler.indptr[seeds]
            seeds = seeds[degree.argmin()].reshape(1)
        fanouts = [-1] * len(slot.fanouts) if exact else slot.fanouts
        sb = sampler.sample(seeds, fanouts, new_batch_seed())
        n_id = sb.n_id.to(core.device)
        x = core.features.gather(n_id)
        out = slot.served(x, n_id, sb.edge_index.to(core.device, torch.int64),
                          sb.num_sampled_nodes, sb.num_sampled_edges, exact)
        rows = out.index_select(0, sb.seed_index.to(core.device)).float()
        if not bool(torch.isfinite(rows).all()):
            raise ValueError(f"{slot.name} version {slot.version} answers NaN or inf "
                             f"({'exact' if exact else 'sampled'} warm-up)")


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None

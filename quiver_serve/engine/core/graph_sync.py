"""GraphSync: keeps one engine core at the acknowledged graph version (docs/architecture.md, "The
living graph").

Between batches (``EngineCore.step`` calls :meth:`GraphSync.poll`) it reads the update log's new
records (``LogFollower``) and applies each, in version order, to everything of the core that
depends on the graph: the host overlay its CPU samplers read, the device copy its GPU sampler reads
(written on the sampling stream, after the kernels of earlier batches), the feature rows (after
the batches in flight finish: a batch never mixes two versions' rows), GCN's exact degrees and the
PSGS table. Every engine core applies the same records in the same order, so all reach the same
state; each publishes the version it serves and the staleness of its last application
(acknowledged -> visible) in the shared ``GraphState``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sized
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from torch import Tensor

from quiver_serve.config import ServeConfig
from quiver_serve.engine.core.batch import Batch
from quiver_serve.engine.core.exact_table import ExactTable, union_of
from quiver_serve.engine.core.micro_batch import Reply
from quiver_serve.features.store import FeatureStore
from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.device_overlay import DeviceOverlay
from quiver_serve.graph.living import Capacities
from quiver_serve.graph.overlay import Overlay, Patch
from quiver_serve.graph.overlay_view import OverlayView
from quiver_serve.graph.records import EdgeRecord, FeatureRecord, NodeRecord, Record
from quiver_serve.graph.state import GraphState
from quiver_serve.graph.update_log import LogFollower
from quiver_serve.routing.psgs import PsgsTable
from quiver_serve.sampling.base import BaseSampler

if TYPE_CHECKING:
    from quiver_serve.engine.core.rebase import Rebase

log = logging.getLogger(__name__)

#: records applied per poll at most (a long backlog is applied over several steps)
MAX_RECORDS_PER_POLL = 256
#: after a failed move to a compacted base, the wait before the next try
REBASE_RETRY_S = 10.0


class StageTimer:
    """Seconds spent per named stage of one poll (laps add up; ``total`` is their sum)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.started = self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self._last
        self.seconds["total"] = now - self.started
        self._last = now


class Changes:
    """Nodes the records applied in one step changed: ``struct`` (their in-lists) and
    ``feature`` (their feature rows, or appended), and the overlay arena positions written."""

    def __init__(self) -> None:
        #: ``arena``: overlay arena positions written (for the device copy)
        self.nodes: dict[str, list[np.ndarray]] = {"struct": [], "feature": [], "arena": []}

    def add(self, kind: str, nodes: np.ndarray) -> None:
        if nodes.size:
            self.nodes[kind].append(nodes)

    def unique(self, kind: str) -> np.ndarray:
        return union_of(self.nodes[kind])


class SyncedCore(Protocol):
    """The engine core as the update log's follower sees it (``core.EngineCore``)."""

    num_nodes: int
    local_sampler: BaseSampler
    gpu_sampler: BaseSampler | None
    in_flight: deque[Batch]
    waiting: Sized

    @property
    def device(self) -> torch.device: ...

    @property
    def features(self) -> FeatureStore: ...

    @property
    def psgs(self) -> PsgsTable | None: ...

    @property
    def exact_table(self) -> ExactTable | None: ...

    @property
    def sample_stream(self) -> torch.cuda.Stream | None: ...

    def finish_all(self) -> list[Reply]: ...

    def degree_weighted(self) -> bool: ...

    def update_degrees(self, nodes: Tensor, in_degree: Tensor,
                       self_loops: Tensor | None = None) -> None: ...

    def table_paused(self) -> AbstractContextManager[object]: ...


class GraphSync:
    """Applies the update log to one engine core; see the module docstring. ``cfg``: to build
    samplers over a compacted base (``rebase.py``); None: the core stays on its base."""

    def __init__(self, base: GraphData, base_version: int, caps: Capacities, log_dir: Path,
                 state: GraphState | None, index: int, cfg: ServeConfig | None = None) -> None:
        self.overlay = Overlay(base.indptr, base.indices, caps.node_capacity, caps.edge_capacity,
                               base_version)
        self.follower = LogFollower(log_dir, base_version)
        #: records read from the log and not applied yet, and the last version read
        self.pending: deque[Record] = deque()
        #: (nodes, their in-degrees) whose PSGS entries follow at the next step (``poll``)
        self._psgs_due: list[tuple[np.ndarray, np.ndarray]] = []
        self.read_version = base_version
        #: loop time per step for applying updates while requests wait (``graph.apply_budget_ms``)
        self.budget_s = (cfg.graph.apply_budget_ms if cfg is not None else 2.0) / 1e3
        self.version = self.base_version = base_version
        self.log_dir, self.caps = log_dir, caps
        #: the next base being built (``rebase.py``), and the config it needs
        self.rebase: Rebase | None = None
        self.cfg = cfg
        self._rebase_after_s = 0.0
        self.state, self.index = state, index
        self.device_overlay: DeviceOverlay | None = None
        self.views: list[tuple[BaseSampler, OverlayView]] = []  # (sampler, its view)
        if state is not None:
            state.set_reader_base("engine", index, base_version)
        #: called with (kind, staleness_s) per applied record (metrics)
        self.on_applied: Callable[[str, float], None] | None = None
        #: called after each poll that applied records: (seconds per stage, records applied)
        self.on_poll: Callable[[dict[str, float], int], None] | None = None

    # ---- polling -----------------------------------------------------------------------------------
    def behind(self) -> bool:
        return self.state is not None and self.state.acked > self.version

    def poll(self, core: SyncedCore, max_records: int = MAX_RECORDS_PER_POLL,
             budget_s: float | None = None) -> list[Reply]:
        """Apply what was acknowledged since the last poll, within ``budget_s`` of loop time
        while requests wait (default ``graph.apply_budget_ms``; None when idle: every record
        read). While requests wait, one stage per step: the PSGS entries of the nodes the last
        step changed, or reading records (when none is pending), or applying the pending ones
        (each gap between batches holds only one; the routing sizes lag by a step). Records
        read but not applied stay for the next step. Replies of batches finished first. Also moves the core onto a newer compacted
        base once it is built beside."""
        busy = bool(core.waiting or core.in_flight)
        if self._psgs_due:
            self._update_psgs(core)
            if busy:
                return []
        if self.state is not None and self.cfg is not None:
            self._follow_base(core)
        timer = StageTimer()
        fresh = False
        if not (busy and self.pending) and len(self.pending) < max_records and (
                self.state is None or self.state.acked > self.read_version):
            records = self.follower.poll(max_records - len(self.pending))
            if records:
                self.pending.extend(records)
                self.read_version = records[-1].version
                fresh = True
        timer.lap("read")
        if not self.pending:
            return []
        if busy and fresh:  # applied at the next step
            if self.on_poll is not None:
                self.on_poll(timer.seconds, 0)
            return []
        if budget_s is None and busy:
            budget_s = self.budget_s
        replies: list[Reply] = []
        applied: list[Record] = []
        changed = Changes()
        while self.pending and (not applied or budget_s is None
                                or time.perf_counter() - timer.started < budget_s):
            record = self.pending[0]
            if core.in_flight and not isinstance(record, EdgeRecord):
                replies += core.finish_all()  # feature rows change: no batch may be reading them
                timer.lap("drain")
            self.apply(core, self.pending.popleft(), changed, timer)
            applied.append(record)
        self._changes_applied(core, changed, timer, defer_psgs=busy)
        self._publish(applied[-1])
        if core.exact_table is not None:
            self._mark_table(core, applied, changed)
            timer.lap("mark")
        if self.on_poll is not None:
            self.on_poll(timer.seconds, len(applied))
        return replies

    def _mark_table(self, core: SyncedCore, records: list[Record], changed: Changes) -> None:
        """Tell the exact table what these applied records changed (``exact_table.py``)."""
        added = [r.add.reshape(-1, 2) for r in records if isinstance(r, EdgeRecord)]
        assert core.exact_table is not None
        core.exact_table.mark(changed.unique("struct"), changed.unique("feature"),
                              np.concatenate(added) if added else None, self.version,
                              float(records[0].accepted_s), core.sample_stream)

    def _follow_base(self, core: SyncedCore) -> None:
        from quiver_serve.engine.core.rebase import Rebase
        from quiver_serve.graph.state import NEWEST_BASE

        assert self.state is not None and self.cfg is not None
        if self.rebase is None:
            if self.state.get(NEWEST_BASE) > self.base_version \
                    and time.monotonic() >= self._rebase_after_s:
                self.rebase = Rebase(self.cfg, self.log_dir, self.caps, lambda: self.version,
                                     core.device, core.gpu_sampler is not None)
            return
        if not self.rebase.done.is_set():
            return
        rebase, self.rebase = self.rebase, None
        if rebase.error is not None:
            self._rebase_after_s = time.monotonic() + REBASE_RETRY_S
            log.warning("engine %d: moving to the compacted base failed (%s); serving on the "
                        "current one, trying again in %.0f s", self.index, rebase.error,
                        REBASE_RETRY_S)
            return
        try:
            with core.table_paused():  # no exact-table chunk reads the old base meanwhile
                self._switch(core, rebase)
        except Exception as exc:  # noqa: BLE001 - the old state is untouched until the swap
            log.warning("engine %d: switching to the compacted base failed (%s)", self.index, exc)
            return
        self.state.set_reader_base("engine", self.index, self.base_version)

    def _switch(self, core: SyncedCore, rebase: Rebase) -> None:
        """Swap ``core`` onto the rebased samplers and overlay (at a step boundary)."""
        assert rebase.overlay is not None and rebase.local is not None
        rebase.catch_up(self.version)
        if rebase.follower is not None:
            rebase.follower.close()
        old_views = self.views
        self.overlay, self.views, self.device_overlay = rebase.overlay, [], None
        core.local_sampler = rebase.local
        if core.gpu_sampler is not None and rebase.gpu_sampler is not None:
            core.gpu_sampler = rebase.gpu_sampler
        ov = rebase.overlay
        if old_views or ov.active or ov.num_nodes > ov.n_base:
            stream = core.sample_stream
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                self.attach_views(core)
        self.base_version = rebase.base_version
        log.info("engine %d: on the compacted base of version %d (built in %.2f s; overlay %d "
                 "of %d entries)", self.index, rebase.base_version, rebase.seconds, ov.top,
                 ov.edge_capacity)

    def catch_up(self, core: SyncedCore) -> list[Reply]:
        """Poll until nothing acknowledged is left (start-up replay, tests)."""
        replies: list[Reply] = []
        while True:
            before = self.version
            replies += self.poll(core, max_records=1 << 20)
            if self.version == before:
                return replies

    def _publish(self, last: Record) -> None:
        staleness_s = max(0.0, time.time() - float(last.accepted_s))
        if self.state is not None:
            self.state.publish_engine(self.index, self.version, staleness_s)

    # ---- applying records ------------------------------------------------------------------------
    def apply(self, core: SyncedCore, record: Record, changed: Changes | None = None,
              timer: StageTimer | None = None) -> None:
        """Apply one record's writes (what depends on the nodes it changed, such as degrees
        and PSGS entries, follows once per step: ``_changes_applied``)."""
        if record.version != self.version + 1:
            raise RuntimeError(f"update log gap: engine {self.index} at version {self.version} "
                               f"read version {record.version}")
        own = changed is None
        changed = changed if changed is not None else Changes()
        if isinstance(record, EdgeRecord):
            kind = "edges"
            patch = self.overlay.apply_record(record)  # the writer's plan when it fits
            changed.add("struct", patch.nodes)
            changed.add("arena", patch.tail_pos)  # the device copy follows once per step
            self.attach_views(core)
            if timer is not None:
                timer.lap("overlay")
        elif isinstance(record, NodeRecord):
            kind = "nodes"
            ids = self.overlay.add_nodes(int(record.features.shape[0]))
            self._nodes_added(core, ids, record.features)
            changed.add("feature", ids)
        elif isinstance(record, FeatureRecord):
            kind = "features"
            changed.add("feature", np.asarray(record.node_ids, dtype=np.int64))
            core.features.write_rows(torch.from_numpy(np.ascontiguousarray(record.node_ids)),
                                     torch.from_numpy(np.ascontiguousarray(record.features)))
            if timer is not None:
                timer.lap("features")
        else:
            raise RuntimeError(f"unknown update record {type(record).__name__}")
        self.version = record.version
        if own:
            self._changes_applied(core, changed)
        if self.on_applied is not None:
            self.on_applied(kind, max(0.0, time.time() - float(record.accepted_s)))

    def _changes_applied(self, core: SyncedCore, changed: Changes,
                         timer: StageTimer | None = None, defer_psgs: bool = False) -> None:
        """What follows the nodes whose in-lists the applied records changed, once for all of
        them: the device copy (one patch: the host overlay's entries now), degrees and PSGS
        entries."""
        nodes = changed.unique("struct")
        if not nodes.size:
            return
        if self.device_overlay is not None:
            patch = self.overlay.current_patch(nodes, changed.unique("arena"))
            stream = core.sample_stream  # after the batches sampled before
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                self.device_overlay.apply(patch)
            if timer is not None:
                timer.lap("device")
        degree = torch.from_numpy(self.overlay.degree(nodes))
        t_nodes = torch.from_numpy(nodes)
        if core.degree_weighted():
            core.update_degrees(t_nodes, degree, torch.from_numpy(self.overlay.self_loops(nodes)))
        if core.psgs is not None:
            self._psgs_due.append((nodes, degree.numpy()))
            if not defer_psgs:
                self._update_psgs(core, report=False)  # timed in "degrees"
        if timer is not None:
            timer.lap("degrees")

    def _update_psgs(self, core: SyncedCore, report: bool = True) -> None:
        """The PSGS entries (routing's size predictions) of the nodes changed since the last
        call, in the order they changed; timed as the stage "psgs" when ``report``."""
        due, self._psgs_due = self._psgs_due, []
        if core.psgs is None or not due:
            return
        t0 = time.perf_counter()
        for nodes, degree in due:
            core.psgs.update_nodes(nodes, degree)
        if report and self.on_poll is not None:
            self.on_poll({"psgs": time.perf_counter() - t0}, 0)

    def _nodes_added(self, core: SyncedCore, ids: np.ndarray, features: np.ndarray) -> None:
        self.attach_views(core)  # the samplers must know the new ids even before any edge
        core.features.write_rows(torch.from_numpy(ids), torch.from_numpy(np.ascontiguousarray(features)))
        zeros = torch.zeros(ids.size, dtype=torch.int64)
        t_ids = torch.from_numpy(ids)
        if core.degree_weighted():
            core.update_degrees(t_ids, zeros, zeros)
        if core.psgs is not None:
            core.psgs.update_nodes(t_ids, zeros)
        self.set_num_nodes(core, self.overlay.num_nodes)

    def set_num_nodes(self, core: SyncedCore, num_nodes: int) -> None:
        core.num_nodes = num_nodes
        if self.device_overlay is not None:
            self.device_overlay.num_nodes = num_nodes
        for _, view in self.views:
            view.num_nodes = num_nodes

    def attach_views(self, core: SyncedCore) -> None:
        """Hand the samplers their views at the first edge update (before it, they read the
        base alone, at the base's speed)."""
        if self.views:
            return
        self.overlay.ensure_active()
        host = self.overlay.view()
        assert host is not None
        self.views.append((core.local_sampler, host))
        core.local_sampler.set_overlay(host)
        gpu = core.gpu_sampler
        if gpu is not None:
            device = getattr(gpu, "device", core.device)
            self.device_overlay = DeviceOverlay(self.overlay, torch.device(device))
            view = self.device_overlay.view()
            self.views.append((gpu, view))
            gpu.set_overlay(view)

    # ---- temporary nodes (inductive requests) ------------------------------------------------------
    @contextlib.contextmanager
    def virtual_nodes(self, core: SyncedCore, ids: np.ndarray, offsets: np.ndarray,
                      neighbors: np.ndarray, features: np.ndarray) -> Iterator[None]:
        """Nodes ``ids`` (the next free ids) with these in-neighbours and feature rows, for the
        duration of the block; the overlay's free space holds their lists, so nothing of the
        acknowledged graph is written. The caller runs nothing else meanwhile."""
        from quiver_serve import errors

        ov = self.overlay
        if ov.num_nodes + ids.size > ov.node_capacity or ov.top + neighbors.size > ov.edge_capacity:
            raise errors.ServeError("overlay_full", "no room for the request's new nodes until "
                                    "the next compaction", 503)
        ov.ensure_active()
        self.attach_views(core)
        counts = np.diff(offsets).astype(np.int64)
        patch = Patch(ids, ov.top + offsets[:-1].astype(np.int64), counts,
                      ov.top + np.arange(neighbors.size, dtype=np.int64),
                      neighbors.astype(np.int64), ov.num_nodes + int(ids.size))
        reset = Patch(ids, np.full(ids.size, -1, np.int64), np.zeros(ids.size, np.int64),
                      np.empty(0, np.int64), np.empty(0, np.int64), ov.num_nodes)
        self._write_patch(core, patch)
        core.features.write_rows(torch.from_numpy(ids), torch.from_numpy(np.ascontiguousarray(features)))
        if core.degree_weighted():
            core.update_degrees(torch.from_numpy(ids), torch.from_numpy(counts),
                                torch.zeros(ids.size, dtype=torch.int64))
        self.set_num_nodes(core, patch.num_nodes)
        try:
            yield
        finally:
            self._write_patch(core, reset)
            self.set_num_nodes(core, ov.num_nodes)

    def _write_patch(self, core: SyncedCore, patch: Patch) -> None:
        """Write a patch that is not an acknowledged update into the host and device overlays."""
        ov = self.overlay
        host = ov.view()
        assert host is not None
        if patch.tail_pos.size:
            host.tail[torch.from_numpy(patch.tail_pos)] = torch.from_numpy(patch.tail_val)
        host.start[torch.from_numpy(patch.nodes)] = torch.from_numpy(patch.start)
        host.length[torch.from_numpy(patch.nodes)] = torch.from_numpy(patch.length)
        if self.device_overlay is not None:
            stream = core.sample_stream
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                self.device_overlay.apply(patch)

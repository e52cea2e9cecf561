"""The exact table across a model change (docs/architecture.md, "The exact table"): a new version of
the table's model gets its own table, built beside the old one once the version serves (by the
loop thread, a budget per step: ``table_build.py``), and the two swap when the new version takes
the model's traffic and its table is built; its exact requests are answered on the fly until then.

The table must be exact for the version the core serves, so while the new table builds (and
until the swap or until the version is dropped) the core applies no update: the load asks the
loop thread for a :class:`Hold` and builds once it is given, so the graph it reads does not move.
The swap (:func:`follow_table`) happens in the loop thread when the main process sets the new
traffic split, or when the table of the version that has it is built: the version with the
largest weight keeps a table; the new table's refresh thread starts at the version the core
serves, the old table's stops, and exact requests waiting for the old table go to the on-the-fly
path. A hold is given back at the swap, when its version is dropped or failed, and at the latest
after ``HOLD_LIMIT_S`` (the pending table is then discarded: a table may never be served stale).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from quiver_serve.config import ExactConfig
from quiver_serve.engine.core.exact_table import ExactTable, TableGraph, new_exact_table
from quiver_serve.engine.core.micro_batch import MicroBatch
from quiver_serve.engine.core.model_slots import Hold, ModelSlot, ModelTable
from quiver_serve.engine.core.quiet import QuietGate
from quiver_serve.engine.core.table_build import StepwiseBuild
from quiver_serve.features.store import FeatureStore
from quiver_serve.graph.neighbourhood import CurrentGraph
from quiver_serve.models.served import ServedModel
from quiver_serve.sampling.base import BaseSampler

if TYPE_CHECKING:
    from quiver_serve.engine.core.graph_sync import GraphSync

log = logging.getLogger(__name__)

#: the longest updates are held for a pending table (built, or not yet, or its version never
#: took the traffic)
HOLD_LIMIT_S = 60.0


@dataclass(frozen=True)
class TableArgs:
    """What an exact table is built from: the exact config, the base CSC (indptr, indices), and
    the node capacity (rows for nodes appended later)."""

    cfg: ExactConfig
    static: tuple[Tensor, Tensor]
    capacity: int


class TablesCore(Protocol):
    """The engine core as its exact tables and update holds see it."""

    index: int
    #: while above 0, no update is applied (a GCN's degrees or a new exact table being read)
    updates_held: int
    exact_waiting: list[MicroBatch]
    num_nodes: int
    #: whether the loop is quiet (background table work runs then: ``quiet.py``)
    quiet: QuietGate

    @property
    def device(self) -> torch.device: ...

    @property
    def features(self) -> FeatureStore: ...

    @property
    def models(self) -> ModelTable: ...

    @property
    def tables(self) -> ExactTables: ...

    @property
    def graph_sync(self) -> GraphSync | None: ...

    @property
    def gpu_sampler(self) -> BaseSampler | None: ...

    def enqueue(self, mb: MicroBatch) -> None: ...


class ExactTables:
    """The exact table an engine core answers from (None: every exact request is computed on
    the fly), what a new one is built from, and the model whose versions it follows."""

    def __init__(self, args: TableArgs | None, model_name: str,
                 device: torch.device) -> None:
        self.args, self.model_name = args, model_name
        self.table: ExactTable | None = None
        self.graph = TableGraph(device, args.static if args is not None
                                else (torch.empty(0), torch.empty(0)))

    def graph_of(self, core: TablesCore) -> Callable[[], CurrentGraph]:
        """() -> the graph ``core`` serves now, as a table reads it."""
        def current() -> CurrentGraph:
            sync = core.graph_sync
            return self.graph.current(core.gpu_sampler, sync.overlay if sync else None,
                                      sync.device_overlay if sync else None, core.num_nodes)

        return current

    def new_table(self, core: TablesCore, served: ServedModel, progress: bool = True,
                  yield_fraction: float = 0.0) -> ExactTable | None:
        """A table of ``served`` over the graph ``core`` serves now, built (no refresh thread
        yet); None when there are no table args, or the config or the model says no."""
        if self.args is None:
            return None
        return new_exact_table(self.args.cfg, served, core.features, core.device,
                               self.args.capacity, self.graph_of(core), progress,
                               yield_fraction)

    def build(self, core: TablesCore, served: ServedModel, progress: bool = True) -> None:
        """The start-up table of ``served`` (the model ``model_name``), with its refresh
        thread: mapped from a snapshot of it when one matches (``exact.snapshot``; the rows
        the log changed since are marked for the refresh), else computed and snapshotted."""
        sync = core.graph_sync
        if self.args is None or sync is None or not self.args.cfg.snapshot:
            self.table = self.new_table(core, served, progress)
        else:
            self.table = self._mapped_or_built(core, served, sync.log_dir, sync.version,
                                               progress)
        if self.table is not None:
            self.start_refresh(core, self.table)

    def _mapped_or_built(self, core: TablesCore, served: ServedModel, log_dir: Path,
                         version: int, progress: bool) -> ExactTable | None:
        from quiver_serve.engine.core import table_snapshot

        assert self.args is not None
        key = table_snapshot.table_key(served, log_dir)
        found = table_snapshot.find(log_dir, key, version) if key is not None else None
        if found is not None:
            table = new_exact_table(self.args.cfg, served, core.features, core.device,
                                    self.args.capacity, self.graph_of(core), progress,
                                    restore=found[1])
            if table is not None:
                marked = table_snapshot.mark_since(table, log_dir, found[0], version,
                                                   core.num_nodes)
                log.info("exact table from its snapshot at version %d; %d update(s) since "
                         "marked for the refresh", found[0], marked)
                return table
        table = self.new_table(core, served, progress)
        if table is not None and key is not None:
            try:
                table_snapshot.save(table, log_dir, key, version, core.num_nodes)
            except OSError as exc:
                log.warning("exact table snapshot not written (%s): computed again at the "
                            "next start", exc)
        return table

    def start_refresh(self, core: TablesCore, table: ExactTable) -> None:
        """``table`` serves the version ``core`` serves now, and its refresh thread runs."""
        sync = core.graph_sync
        if sync is not None:
            from quiver_serve.engine.core.table_refresh import Refresher

            table.version = table.marked_version = sync.version
            refresher = Refresher(table, core.quiet)
            table.refresher = refresher
            refresher.start()

    def serves(self, served: ServedModel) -> bool:
        """Whether the table (if any) is of ``served``."""
        return self.table is not None and self.table.model.served is served

    def wants(self, name: str) -> bool:
        """Whether ``name`` is the model the exact table serves."""
        return self.table is not None and self.args is not None and self.model_name == name


def take_hold(ask: Callable[[Hold], None]) -> Hold | None:
    """In the loader thread: a hold on the core's updates (``ask(hold)`` queues it for the loop
    thread, which gives it between two steps); None when none came in ``HOLD_LIMIT_S``."""
    hold = Hold()
    ask(hold)
    if not hold.given.wait(HOLD_LIMIT_S):
        log.warning("no hold on updates came within %.0f s", HOLD_LIMIT_S)
        return None
    return hold


def start_pending_build(core: TablesCore, slot: ModelSlot,
                        budget_s: float) -> StepwiseBuild | None:
    """In the loop thread, as ``slot`` joins with ``slot.hold`` given: its table, allocated, to
    be computed a step's ``budget_s`` at a time. None (the slot's exact requests are computed
    on the fly) without a hold, table args, or a model the table supports, or on an error."""
    args = core.tables.args
    if args is None:
        return None
    if slot.hold is None:
        log.warning("engine %d: %s version %d gets no exact table: updates could not be held",
                    core.index, slot.name, slot.version)
        return None
    try:
        table = new_exact_table(args.cfg, slot.served, core.features, core.device,
                                args.capacity, core.tables.graph_of(core), progress=False,
                                build=False)
        return StepwiseBuild(table, budget_s) if table is not None else None
    except Exception as exc:  # noqa: BLE001 - the version serves; its exact answers on the fly
        log.warning("engine %d: exact table of %s version %d failed: %s", core.index, slot.name,
                    slot.version, exc)
        return None


def give_holds(core: TablesCore, asked: list[Hold]) -> None:
    """In the loop thread: hold updates for every loader that asked."""
    while asked:
        hold = asked.pop()
        core.updates_held += 1
        hold.active, hold.since_s = True, time.monotonic()
        hold.given.set()


def release_hold(core: TablesCore, slot: ModelSlot) -> None:
    hold, slot.hold = slot.hold, None
    give_back(core, hold)


def give_back(core: TablesCore, hold: Hold | None) -> None:
    if hold is not None and hold.active:
        hold.active = False
        core.updates_held -= 1


def discard_pending(core: TablesCore, slot: ModelSlot) -> None:
    """Drop ``slot``'s pending table and give back its hold."""
    table, slot.pending_table = slot.pending_table, None
    if table is not None:
        table.stop(timeout_s=0.0)
    release_hold(core, slot)


def expire_holds(core: TablesCore) -> None:
    """Give back holds kept past ``HOLD_LIMIT_S`` (their tables are discarded)."""
    now = time.monotonic()
    for slot in core.models.each():
        if slot.hold is not None and slot.hold.active and now - slot.hold.since_s > HOLD_LIMIT_S:
            log.warning("engine %d: %s version %d did not take the traffic within %.0f s: its "
                        "exact table is discarded", core.index, slot.name, slot.version,
                        HOLD_LIMIT_S)
            discard_pending(core, slot)


def drop_exact_table(core: TablesCore, why: str) -> None:
    """Stop serving from the exact table (its model left): exact requests waiting for it go to
    the on-the-fly path."""
    table, core.tables.table = core.tables.table, None
    if table is None:
        return
    log.info("engine %d: exact table dropped: %s", core.index, why)
    table.stop(timeout_s=0.0)
    waiting, core.exact_waiting = core.exact_waiting, []
    for mb in waiting:
        core.enqueue(mb)


def follow_table(core: TablesCore, name: str,
                 building: Collection[int] = ()) -> list[ModelSlot]:
    """In the loop thread, after ``name``'s traffic split changed: the version with the largest
    weight takes the table (swapped in if it has a pending one); other pending tables go.
    ``building``: ``id()`` of the slots whose table is being built; returns the slots among
    them whose build must stop (not the main version: it keeps building, and holding)."""
    slots = core.models.of(name)
    active = [s for s in slots if s.weight > 0]
    main = max(active, key=lambda s: (s.weight, s.version)) if active else None
    stopped = [s for s in slots if id(s) in building and s is not main]
    for slot in slots:
        if (slot.pending_table is not None or slot in stopped) and slot is not main:
            discard_pending(core, slot)
    if main is None or main.pending_table is None:
        if main is not None and id(main) not in building:
            release_hold(core, main)
        return stopped
    new, main.pending_table = main.pending_table, None
    core.tables.start_refresh(core, new)
    old, core.tables.table = core.tables.table, new
    if old is not None:
        old.stop(timeout_s=0.0)  # not waited for in the loop thread
    waiting, core.exact_waiting = core.exact_waiting, []
    for mb in waiting:
        if mb.slot is main:
            core.exact_waiting.append(mb)
        else:
            core.enqueue(mb)  # its version no longer has the table
    release_hold(core, main)
    log.info("engine %d: exact table now serves %s version %d", core.index, main.name,
             main.version)
    return stopped

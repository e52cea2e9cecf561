"""The living graph of a partition server (docs/architecture.md, "The living graph across
partitions"): its log opened and followed (decisions 0047, 0053), updates of what it owns, the
version waits, and the compaction of its log with the move to the new base (decision 0063,
``compaction.py``). ``PartitionServer`` (``server.py``) is this plus the answering."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from quiver_serve import errors
from quiver_serve.config import ServeConfig
from quiver_serve.models.served import ServedModel
from quiver_serve.partition.data import load_partition
from quiver_serve.scaleout.partitioned.compaction import (
    BASE_CHECK_S,
    Moves,
    ServingBase,
    base_in_force,
    base_meta,
    fold,
    grown_book,
    serving_base,
)
from quiver_serve.scaleout.partitioned.features import PartitionFeatures
from quiver_serve.scaleout.partitioned.live import (
    LiveBase,
    PartitionLive,
    load_dropped,
    save_dropped,
)
from quiver_serve.scaleout.partitioned.sampling import LocalGraph, PartitionSampler, as_tensor
from quiver_serve.scaleout.partitioned.table import OutEdges, PartitionTable
from quiver_serve.scaleout.partitioned.table_marks import MarkGroups, MarkTarget, mark_tables

log = logging.getLogger(__name__)
T = TypeVar("T")
#: a mark call's time beyond ``partitioned.remote_timeout_s`` (the peer follows its log first)
MARK_MARGIN_S = 1.0


def refusal(exc: errors.ServeError) -> dict[str, Any]:
    return {"code": exc.info.code, "message": exc.info.message, "status": exc.info.status}


class LivingPartition:
    """A partition server's living graph (module docstring). The attributes below are set by
    ``PartitionServer.__init__``; every method runs on the server's event loop."""

    cfg: ServeConfig
    args: Any  # server.ServerArgs
    live: PartitionLive
    graph: LocalGraph
    sampler: PartitionSampler
    features: PartitionFeatures
    model: ServedModel
    moves: Moves
    #: the own rows of the base in force, in host memory (what a compaction folds)
    base_x: np.ndarray
    num_nodes: int
    num_parts: int
    owned: int
    edges: int
    device: Any  # torch.device
    table: PartitionTable | None
    #: whether updates mark the exact tables (``exact.materialize`` not off, a layer-wise model)
    table_wanted: bool
    #: the servers an update's marks go to (``table_marks.link_targets``; tests set their own)
    mark_targets: Callable[[], list[MarkTarget]]
    #: versions whose marks are under way: a compaction folds a version only after its marks
    marking: set[int]
    mark_groups: MarkGroups

    def _open_live(self, folder: Path, book: Any, base: ServingBase) -> PartitionLive:
        """The partition's living graph over its update log, replayed after ``base``: replica
        0 writes the log, the others follow it (decision 0053); its written rows and dropped
        hot copies shown to the feature source, its grown book and overlay to the sampler."""
        live = PartitionLive(folder, self.cfg.graph, self.args.part, book, self.graph.indptr,
                             self.graph.indices, self.features.dim,
                             follow=self.args.replica != 0,
                             base=LiveBase(base.version, base.entries))
        self.features.written = live.written
        self.features.drop_hot(load_dropped(folder))
        self.live = live
        self._refresh()
        log.info("partition %d replica %d: %d updates replayed from %s over the base of version "
                 "%d (version %d)", self.args.part, self.args.replica, live.replayed, folder,
                 base.version, live.version)
        return live

    def _refresh(self, moved: bool = False) -> None:
        """Show the living graph's state to the sampler and the feature source: the grown
        book's owner and local rows (always after a move: a new book), the overlay's view."""
        live = self.live
        if moved or self.graph.owner.numel() != live.owner.numel():
            self.graph.owner, self.graph.local = live.owner, live.local
            self.features.grow(live.owner, live.local)
            self.num_nodes = int(live.owner.numel())
            if self.table is not None:
                self.table.follow_book(live.owner, live.local)
        self.graph.overlay = live.view()

    async def _current(self, work: Callable[[], Awaitable[T]]) -> T:
        """``work()`` once this server holds every record its primary logged: a follower whose
        next records were folded into a base first waits for its move to that base, and for
        the next one when its primary compacted again meanwhile (for
        ``server.request_timeout_s`` at most: then it answers at the version it holds)."""
        self._follow()
        deadline = time.monotonic() + self.cfg.server.request_timeout_s
        while self.live.stalled and self.moves.running is not None \
                and time.monotonic() < deadline:
            try:
                await asyncio.wait_for(asyncio.shield(self.moves.running),
                                       deadline - time.monotonic())
            except TimeoutError:
                break
            self._follow()
        return await work()

    def _follow(self) -> None:
        """A replica other than 0 applies what its partition's primary logged since its last
        read, before it reads (one ``fstat`` when nothing is new; decision 0053), and moves to
        a newer base its primary wrote (``compaction.py``); a ticker does the same while it
        answers nothing. On the event loop only."""
        live = self.live
        if live.follower is None:
            return
        if live.catch_up():
            self._refresh()
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # not on the loop: the next call on it starts the tasks below
            return
        if self.moves.ticker is None or self.moves.ticker.done():
            self.moves.ticker = asyncio.ensure_future(self._tick())
        now = time.monotonic()
        if self.moves.running is None and (live.stalled or now >= self.moves.checked_s
                                           + BASE_CHECK_S):
            self.moves.checked_s = now
            if base_in_force(live.directory) > live.base_version:
                self.moves.start(self._move_to_newest())

    async def _tick(self) -> None:
        """A follower's check for new records and bases every ``BASE_CHECK_S`` (supervised by
        ``_follow``, which starts it again when it ended)."""
        while True:
            await asyncio.sleep(BASE_CHECK_S)
            try:
                self._follow()
            except Exception:  # noqa: BLE001 - logged; the next read follows again
                log.exception("partition %d replica %d: following the log failed",
                              self.args.part, self.args.replica)

    # ---- the living graph (``live.py``) ------------------------------------------------------------
    async def update(self, kind: str, first: Any, second: Any) -> dict[str, Any]:
        """``edges`` (add, remove) or ``features`` (node_ids, rows) of nodes this partition
        owns, or ``nodes`` (``first``: [first id, count, owner], ``second``: their rows at the
        owner): the durable version's answer, or a refusal. Replica 0 only (it writes the log)."""
        if kind in ("edges", "nodes") and self.model.gcn_norm is not None:
            return refusal(errors.ServeError(
                "unsupported_on_ray", f"{kind} updates are not supported on a partitioned graph "
                "serving a GCN: its exact mode uses the in-degrees of the snapshot", 400))
        try:
            if kind == "edges":
                out = self.live.add_edges(first, second)
            elif kind == "nodes":
                out = self.live.add_nodes(*(int(v) for v in first), second)
            else:
                out = self.live.put_features(first, second)
            self._refresh()
            if self.table_wanted and kind != "nodes":  # a new node has no edges yet
                await self._mark(kind, first, second, int(out["version"]))
            if self.live.wants_compaction():
                self._start_compaction()
            return out
        except errors.ServeError as exc:
            if exc.info.code == "overlay_full":
                self._start_compaction()
            return refusal(exc)
        except Exception as exc:  # noqa: BLE001 - a fault: a 500 naming an id in the log
            return refusal(errors.internal_error(exc, f"partition {self.args.part} update", log))

    async def _mark(self, kind: str, first: Any, second: Any, version: int) -> None:
        """Every server's exact table marked for this update before it is answered
        (``table_marks.py``): the written rows, or the destinations of the edges."""
        if kind == "edges":
            pairs = [np.asarray(a, np.int64).reshape(-1, 2) for a in (first, second)]
            changed, lists = np.empty(0, np.int64), np.concatenate([p[:, 1] for p in pairs])
        else:
            changed, lists = np.asarray(first, np.int64).reshape(-1), np.empty(0, np.int64)
        await self.mark_rows(changed, lists, version)

    async def mark_rows(self, changed: np.ndarray, lists: np.ndarray, version: int) -> None:
        """Every table marked for the update of ``version`` (grouped with the updates marked
        at the same time: ``MarkGroups``), counted in ``marking`` meanwhile."""
        self.marking.add(version)
        t0 = time.perf_counter()
        try:
            done = await self.mark_groups.mark(changed, lists)
        finally:
            self.marking.discard(version)
        if self.table is not None:
            self.table.counts.restarted += done["restarted"]
            self.table.counts.observe_marking(time.perf_counter() - t0)

    async def mark_all(self, changed: np.ndarray, lists: np.ndarray) -> dict[str, int]:
        """One marking of every server (``MarkGroups`` runs it for a group of updates)."""
        return await mark_tables(self.mark_targets(), changed, lists,
                                 self.cfg.partitioned.remote_timeout_s + MARK_MARGIN_S)

    # ---- compaction (``compaction.py``) -------------------------------------------------------
    async def compact(self) -> dict[str, Any]:
        """Fold this partition's updates into a new base now (replica 0; ``POST
        /v1/graph/compact``): ``{version, compacted, ...}`` once it serves from it."""
        if self.live.log is None:
            return refusal(errors.ServeError("not_primary", f"partition {self.args.part}: "
                                             "replica 0 compacts its log", 400))
        if self.moves.running is not None:
            await asyncio.shield(self.moves.running)
        return await self._start_compaction()

    def _start_compaction(self) -> asyncio.Future[Any]:
        running = self.moves.running
        return running if running is not None else self.moves.start(self._compact())

    async def _compact(self) -> dict[str, Any]:
        """The fold (beside the loop, on a frozen overlay), the base written, the move."""
        live, t0 = self.live, time.perf_counter()
        version = live.version
        if version == live.base_version:
            return {"version": version, "compacted": False, "reason": "nothing new"}
        while any(v <= version for v in self.marking):  # bounded by the marks' timeouts
            await asyncio.sleep(0.005)
        frozen = live.overlay.freeze()
        written, entries = dict(live.rows_written), [list(e) for e in live.entries]
        try:
            arrays = await asyncio.to_thread(fold, frozen, self.base_x, written, entries,
                                             self.num_nodes)
        finally:
            live.overlay.thaw()
        assert live.log is not None
        await asyncio.to_thread(live.log.write_base, version, arrays,
                                base_meta(self.args.part, self.num_parts, version))
        del arrays
        await self._move_to_newest()
        seconds = time.perf_counter() - t0
        self.moves.compactions += 1
        self.moves.last_compaction_s = seconds
        log.info("partition %d: compacted at version %d in %.2f s", self.args.part, version,
                 seconds)
        return {"version": version, "compacted": True, "duration_s": round(seconds, 3)}

    async def _move_to_newest(self) -> None:
        """Serve from the newest base of the log: built beside the loop (mapped, the records
        after it replayed, placed on the device), then the last records and the swap on it."""
        old, args = self.live, self.args

        def build() -> tuple[PartitionLive, LocalGraph, Any, ServingBase, OutEdges | None]:
            data = load_partition(Path(args.data_dir), args.part, mmap=True)
            base = serving_base(old.directory, data)
            book = grown_book(Path(args.data_dir), base.entries)
            graph = LocalGraph(args.part, as_tensor(book.owner), as_tensor(book.local),
                               as_tensor(base.indptr), as_tensor(base.indices))
            live = PartitionLive(old.directory, self.cfg.graph, args.part, book, graph.indptr,
                                 graph.indices, self.features.dim, follow=old.log is None,
                                 base=LiveBase(base.version, base.entries, old.log))
            if live.log is not None:
                live.replay_until(old.version)
            budget = self.cfg.partitioned.device_bytes
            placed = graph.place(self.device, budget)
            own, _ = self.features.own_rows_on(as_tensor(base.features), self.device,
                                               budget - placed - self.features.hot_bytes)
            out_edges = None if self.table is None else OutEdges.of_base(graph.indptr,
                                                                         graph.indices)
            return live, graph, own, base, out_edges

        live, graph, own, base, out_edges = await asyncio.to_thread(build)
        if live.base_version <= old.base_version:
            return
        if live.log is not None:  # the records logged while it was built
            live.replay_until(self.live.version)
        else:
            live.catch_up()
        self.graph = self.sampler.graph = graph  # a batch under way keeps the old one
        self.features.rebase(own, live.written)
        self.live, self.base_x = live, base.features
        if out_edges is not None and self.table is not None:  # with the log it extends
            self.table.rebase(out_edges)
        self.owned, self.edges = int(base.features.shape[0]), int(base.indices.size)
        self._refresh(moved=True)
        self.moves.moves += 1
        log.info("partition %d replica %d: serving from the base of version %d (version %d)",
                 args.part, args.replica, live.base_version, live.version)

    def drop_hot(self, ids: np.ndarray) -> int:
        """Drop the replicated copies of global ``ids`` held here, durably (a feature write to
        their owner follows); returns how many copies this server held."""
        ids = np.asarray(ids, np.int64)
        dropped = self.features.drop_hot(ids)
        if self.live.log is not None and dropped:  # replica 0 keeps the partition's file
            folder = self.live.directory
            save_dropped(folder, np.union1d(load_dropped(folder), ids))
        return dropped

    async def wait_version(self, version: int, timeout_s: float) -> int:
        """This partition's version once it reaches ``version`` (-1 past ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        self._follow()
        while self.graph_version() < version:
            if time.monotonic() >= deadline:
                return -1
            await asyncio.sleep(0.005)
            self._follow()
        return self.graph_version()

    def graph_version(self) -> int:
        return self.live.version

    async def growth(self) -> list[list[int]]:
        """The book's entries since the snapshot, ``[first id, count, owner]`` in id order."""
        self._follow()
        return [list(e) for e in self.live.entries]

    def close(self) -> None:
        """Release the partition's log (a server started again in this process takes it)."""
        self.live.close()

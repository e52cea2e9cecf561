"""GraphWriter: the one place updates are validated, versioned, logged and acknowledged.

An update is checked (ids, widths, finite values, sizes), planned against the writer's own overlay
(so a call that does not fit is refused with nothing written), appended to the update log and
synced per ``graph.fsync``, and only then applied and acknowledged: the version it returns is
durable. Engine cores and CPU samplers follow the log themselves (``LogFollower``) and apply the
same records in the same order. One lock orders the calls; it is held across the sync, so with
``fsync: always`` the update rate is bounded by the disk's sync rate (``group`` shares syncs).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from quiver_serve.config import GraphConfig
from quiver_serve.graph import living
from quiver_serve.graph import state as slots
from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.overlay import (
    Overlay,
    OverlayFull,
    plan_record,
)
from quiver_serve.graph.records import EdgeRecord, FeatureRecord, NodeRecord
from quiver_serve.graph.state import GraphState, readers_reach
from quiver_serve.graph.update_log import UpdateLog, load_base

log = logging.getLogger(__name__)

#: longest wait of a compaction for the sampling processes to apply its version
READERS_WAIT_S = 30.0
#: a writer moving to a new base replays the log beside updates in up to this many rounds, until
#: at most this many records are left for the round under the lock
REBASE_ROUNDS = 8
REBASE_LAG_RECORDS = 4
#: list entries sorted per torch call in a compaction (``sort_lists``; torch leaves the
#: interpreter lock while it sorts, so this bounds only the chunk's memory)
SORT_CHUNK_EDGES = 1 << 20



@contextlib.contextmanager
def intra_op_threads(threads: int) -> Iterator[None]:
    """Run torch's operations of the block on at most ``threads`` threads (process-wide while
    it lasts; ``graph.compact_threads``): a compaction is background work beside serving."""
    before = torch.get_num_threads()
    torch.set_num_threads(min(threads, before))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def sort_lists(indptr: np.ndarray, indices: np.ndarray, nodes: np.ndarray,
               edges_per_chunk: int = SORT_CHUNK_EDGES, id_bound: int | None = None) -> None:
    """Sort the lists of ``nodes`` (ascending ids) by id, in place, a group of about
    ``edges_per_chunk`` entries at a time. In torch, whose operations leave the interpreter lock
    while they run: NumPy's ``lexsort`` and fancy indexing hold it, and a compaction's sort
    beside the writer stalled update calls for 60 ms a group (decision 0057). One sort of a
    key (the list's place in the group, then the id) orders every list of a group at once.
    Every id is below ``id_bound`` (None: the number of lists, as in a whole graph's CSC)."""
    ip, ix = torch.from_numpy(indptr), torch.from_numpy(indices)
    n = max(1, indptr.size - 1 if id_bound is None else id_bound)
    counts = ip[1:] - ip[:-1]
    sizes = np.cumsum(counts.numpy()[nodes])
    lo = 0
    while lo < nodes.size:
        done = sizes[lo - 1] if lo else 0
        hi = min(nodes.size, max(lo + 1, int(np.searchsorted(sizes, done + edges_per_chunk,
                                                             side="right"))))
        group = torch.from_numpy(nodes[lo:hi])
        c = counts[group]
        total = int(c.sum())
        if total:
            place = torch.repeat_interleave(torch.arange(group.numel()), c, output_size=total)
            pos = (ip[group] - (c.cumsum(0) - c))[place] + torch.arange(total)
            key = place * n + ix[pos]
            ix[pos] = torch.sort(key).values.remainder_(n)
        lo = hi


class GraphWriter:
    """Validates, logs and acknowledges updates; see the module docstring."""

    def __init__(self, cfg: GraphConfig, base: GraphData, base_version: int, update_log: UpdateLog,
                 state: GraphState | None = None, retry_after_s: int = 1,
                 caps: living.Capacities | None = None) -> None:
        self.cfg, self.base, self.log = cfg, base, update_log
        #: the overlay's capacities (every process that samples sizes its overlay the same)
        self.caps = caps or living.capacities(cfg, base.num_nodes, base.num_edges)
        self.overlay = Overlay(base.indptr, base.indices, self.caps.node_capacity,
                               self.caps.edge_capacity, base_version)
        self.num_features = base.num_features
        self.base_version = self.version = base_version
        self.state = state or GraphState()
        self.retry_after_s = retry_after_s
        self.lock = threading.Lock()  # versions and the overlay: one update at a time
        self._ack_lock = threading.Lock()
        self.acked = base_version
        self.updates_by_kind = {"edges": 0, "nodes": 0, "features": 0}
        #: feature rows since the base (compaction writes them into the new base)
        self.appended_rows: list[np.ndarray] = []
        self.written_rows: dict[int, np.ndarray] = {}
        self._compact_lock = threading.Lock()
        self.last_update_s = 0.0
        #: called after each acknowledged update: (kind, seconds, record version)
        self.on_update: Any = None
        #: called after each acknowledged edge update with its seconds per stage (waiting for
        #: the lock, planning, writing the log, waiting until durable and applied here)
        self.on_stages: Callable[[dict[str, float]], None] | None = None
        #: called after each compaction with its duration in seconds
        self.on_compaction: Any = None
        #: base versions and applied versions of the processes that sample (the supervisor
        #: sets them)
        self.reader_bases: Callable[[], list[int]] = list
        self.reader_versions: Callable[[], list[int]] = list

    # ---- start-up --------------------------------------------------------------------------------
    def replay(self) -> int:
        """Apply the log's records after the base (start-up; a progress bar from 10,000
        records); returns how many."""
        from tqdm import tqdm

        total = max(self.log.durable_version - self.version, 0)
        count = 0
        with tqdm(total=total, desc="replaying the update log", unit="update",
                  disable=total < 10_000, leave=False) as bar:
            for record in self.log.records_after(self.version):
                self._apply(record)
                self.version = self.acked = record.version
                count += 1
                bar.update()
        self.publish()
        return count

    def replay_until(self, version: int) -> None:
        """Apply the log's records after this writer's version up to ``version`` (durable),
        without logging them (a writer built over a newer base catching up)."""
        if version <= self.version:
            return
        for record in self.log.records_after(self.version):
            if record.version > version:
                break
            self._apply(record)
            self.version = self.acked = record.version

    def _apply(self, record: Any) -> Any:
        if isinstance(record, EdgeRecord):
            return self.overlay.apply_record(record)
        if isinstance(record, NodeRecord):
            self.appended_rows.append(record.features)
            return self.overlay.add_nodes(int(record.features.shape[0]))
        self._remember_rows(record.node_ids, record.features)
        return None

    def _remember_rows(self, ids: np.ndarray, rows: np.ndarray) -> None:
        for i, row in zip(ids.tolist(), rows, strict=True):
            self.written_rows[i] = row

    # ---- the update calls ------------------------------------------------------------------------
    def add_edges(self, add: Any, remove: Any) -> dict[str, int]:
        add_arr, rm_arr = living.as_pairs(add, "add"), living.as_pairs(remove, "remove")
        living.check_count(len(add_arr) + len(rm_arr), self.cfg.max_update_edges, "edges")
        t0 = time.perf_counter()
        marks = [t0]  # lock taken, planned, logged (the stages of an update call)

        def log_planned(_result: Any, patch: Any) -> None:
            marks.append(time.perf_counter())
            self.log.write(plan_record(record, patch))
            marks.append(time.perf_counter())

        with self.lock:
            marks.append(time.perf_counter())
            n = self.overlay.num_nodes
            living.check_ids(add_arr, n, "add")
            living.check_ids(rm_arr, n, "remove")
            version = self.version + 1
            record = EdgeRecord(version, time.time(), add_arr, rm_arr)
            try:
                result, _ = self.overlay.apply_edges(add_arr, rm_arr, before_commit=log_planned)
            except OverlayFull as exc:
                self.request_compaction()
                raise living.overlay_full(str(exc), self.retry_after_s) from None
            self.version = version
        self._durable(version, "edges", t0)
        if self.on_stages is not None and len(marks) == 4:
            done = time.perf_counter()
            self.on_stages({"lock": marks[1] - marks[0], "plan": marks[2] - marks[1],
                            "log": marks[3] - marks[2], "durable": done - marks[3]})
        return {"version": version, "added": result.added, "removed": result.removed,
                "missing": result.missing}

    def add_nodes(self, features: Any) -> dict[str, Any]:
        rows = living.as_rows(features, "features", self.num_features)
        living.check_count(len(rows), self.cfg.max_update_edges, "nodes")
        t0 = time.perf_counter()
        with self.lock:
            if self.overlay.num_nodes + len(rows) > self.overlay.node_capacity:
                raise living.overlay_full(
                    f"node capacity {self.overlay.node_capacity} reached "
                    f"({self.overlay.num_nodes} nodes; graph.max_new_nodes sets the headroom, "
                    "renewed when the daemon starts on a compacted base)", self.retry_after_s)
            version = self.version + 1
            self.log.write(NodeRecord(version, time.time(), rows))
            ids = self.overlay.add_nodes(len(rows))
            self.appended_rows.append(rows)
            self.version = version
        self._durable(version, "nodes", t0)
        return {"version": version, "node_ids": ids.tolist()}

    def put_features(self, node_ids: Any, features: Any) -> dict[str, int]:
        ids, rows = living.feature_writes(node_ids, features, self.num_features,
                                          self.cfg.max_update_edges)
        t0 = time.perf_counter()
        with self.lock:
            living.check_ids(ids, self.overlay.num_nodes, "node_ids")
            version = self.version + 1
            self.log.write(FeatureRecord(version, time.time(), ids, rows))
            self._remember_rows(ids, rows)
            self.version = version
        self._durable(version, "features", t0)
        return {"version": version}

    def _durable(self, version: int, kind: str, t0: float) -> None:
        """Wait (outside the lock, so concurrent calls share a group commit) until ``version``
        is durable, then acknowledge it."""
        self.log.wait_durable(version)
        with self._ack_lock:
            self.acked = max(self.acked, version)
            self.updates_by_kind[kind] += 1
            self.last_update_s = time.time()
            self.publish()
        if self.on_update is not None:
            self.on_update(kind, time.perf_counter() - t0, version)
        if self.overlay.top >= self.cfg.compact_at_fill * self.overlay.edge_capacity:
            self.request_compaction()

    # ---- compaction --------------------------------------------------------------------------------
    def compact(self) -> dict[str, Any]:
        """Fold every acknowledged update into a new base on disk and drop the log it covers
        (``UpdateLog.write_base``: crash-safe at every step). Updates wait only while the
        overlay's per-node arrays are copied (``Overlay.freeze``); the fold and the write run
        beside them, and serving does not wait at all. The processes that sample keep their overlays
        until they start again, on the new base."""
        with self._compact_lock, intra_op_threads(self.cfg.compact_threads):
            t0 = time.perf_counter()
            with self.lock:  # held only to copy what the fold reads
                version = self.version
                if version == self.base_version or version == self.state.get(slots.COMPACT_VERSION):
                    self.state.set(slots.COMPACT_WANTED, 0)
                    return {"version": version, "compacted": False, "reason": "nothing new"}
                self.log.wait_durable(version)
                frozen = self.overlay.freeze()
                appended = list(self.appended_rows)
                written = dict(self.written_rows)
            try:  # the fold, while updates go on
                indptr, indices = frozen.to_csc()
                touched = frozen.changed_nodes()
            finally:
                with self.lock:
                    self.overlay.thaw()
            if not self._readers_reach(version):
                return {"version": version, "compacted": False,
                        "reason": "a sampling process has not applied the updates up to this "
                                  "version yet; the next compaction retries"}
            arrays = self._base_arrays(indptr.numpy(), indices.numpy(), touched, appended, written)
            self.log.write_base(version, arrays, {"name": self.base.name, "version": version})
            seconds = time.perf_counter() - t0
            self.state.record_compaction(version, seconds)
            self.state.set(slots.NEWEST_BASE, version)  # the samplers move to it; then here
            if self.on_compaction is not None:
                self.on_compaction(seconds)
            log.info("compacted the graph at version %d in %.2f s (%d nodes, %d edges)", version,
                     seconds, indptr.numel() - 1, indices.numel())
            return {"version": version, "compacted": True, "duration_s": round(seconds, 3)}

    def _readers_reach(self, version: int) -> bool:
        """Every process that samples applied ``version`` (``READERS_WAIT_S`` at most)."""
        return readers_reach(self.reader_versions, version, READERS_WAIT_S)

    def _base_arrays(self, indptr: np.ndarray, indices: np.ndarray, touched: np.ndarray,
                     appended: list[np.ndarray], written: dict[int, np.ndarray],
                     ) -> dict[str, np.ndarray]:
        """The new base: the CSC with every list sorted by id again (only lists the overlay
        changed need it), the features with writes and appended rows."""
        indices = indices.copy()
        sort_lists(indptr, indices, touched)
        n = indptr.size - 1
        x = np.empty((n, self.num_features), np.float32)
        x[:self.base.num_nodes] = self.base.x.numpy()
        if appended:
            x[self.base.num_nodes:] = np.concatenate(appended)
        for i, row in written.items():
            x[i] = row
        arrays = {"indptr": indptr, "indices": indices, "x": x}
        if self.base.y is not None:
            y = np.full(n, -1, dtype=self.base.y.numpy().dtype)
            y[:self.base.num_nodes] = self.base.y.numpy()
            arrays["y"] = y
        return arrays

    def maybe_rebase(self) -> bool:
        """Move this writer's overlay to the newest base once every process that samples has
        (``reader_bases``): until then the old, fuller overlay is the one whose room bounds an
        update, since some sampler still applies updates to an overlay like it."""
        newest = self.state.get(slots.NEWEST_BASE)
        if newest <= self.base_version or any(b < newest for b in self.reader_bases()):
            return False
        found = load_base(self.log.directory)
        if found is None or found[0] <= self.base_version:
            return False
        version, arrays, meta = found
        base = living.graph_from_arrays(arrays, meta, self.base.name)
        nxt = GraphWriter(self.cfg, base, version, self.log, self.state, self.retry_after_s,
                          self.caps)
        for _ in range(REBASE_ROUNDS):  # most of the log since the base: beside the updates
            nxt.replay_until(self.acked)
            if self.version - nxt.version <= REBASE_LAG_RECORDS:
                break
        with self.lock:  # the last few records, then the swap
            self.log.wait_durable(self.version)  # every record up to self.version is readable
            nxt.replay_until(self.version)
            self.overlay, self.base = nxt.overlay, nxt.base
            self.appended_rows, self.written_rows = nxt.appended_rows, nxt.written_rows
            self.base_version = version
        log.info("graph writer on the base of version %d (overlay %d of %d entries)", version,
                 self.overlay.top, self.overlay.edge_capacity)
        self.publish()
        return True

    # ---- state -----------------------------------------------------------------------------------
    def publish(self) -> None:
        s, ov = self.state, self.overlay
        s.set(slots.NUM_NODES, ov.num_nodes)
        s.set(slots.NUM_EDGES, ov.num_edges)
        s.set(slots.ENTRIES_USED, ov.top)
        s.set(slots.ENTRIES_CAP, ov.edge_capacity)
        s.set(slots.NODE_CAP, ov.node_capacity)
        s.set(slots.BASE_VERSION, self.base_version)
        s.set(slots.ACKED_AT_S, time.time())
        s.set(slots.ACKED, self.acked)  # last: readers that see it see the counts

    def request_compaction(self, explicit: bool = False) -> None:
        """Ask the background compactor: by fill (at most one per its minimum gap) or, when
        ``explicit`` (an operator's call), at its next check."""
        self.state.want_compaction(explicit)

    def info(self, num_engines: int) -> dict[str, Any]:
        engines = self.state.engines(num_engines)
        compaction = self.state.last_compaction()
        return {
            "version": self.acked, "base_version": self.base_version,
            "num_nodes": self.overlay.num_nodes, "num_edges": self.overlay.num_edges,
            "engines": engines,
            "staleness_s": max((e["staleness_s"] for e in engines), default=0.0),
            "overlay": self.overlay.usage(), "last_compaction": compaction,
        }



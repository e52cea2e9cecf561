"""TypedGraphWriter: the living graph's writer on a typed graph (docs/architecture.md, "Typed
graphs"; docs/decisions/0048-typed-updates.md).

The same contract as ``graph/writer.py``: an update is checked (the relation or node type it
names, ids in those types' ranges, widths, finite values, its size), appended to the update log
and synced per ``graph.fsync``, applied to the writer's copy of the graph (counts and relations,
no feature rows), and acknowledged once durable; the version it returns survives kill -9. The
engine cores follow the log (``engine/core/typed_sync.py``).

Compaction (decision 0059) writes the graph at the acknowledged version as a typed base of the
log's folder (``typed_base.py``) and drops the log it covers, once every engine core has applied
that version; a start loads the newest base and replays only the log after it. Updates wait only
while the relations (never changed in place: an update builds a relation's next CSC) and the
feature rows written since the base are listed; the feature matrices are built and written beside
them. It runs when asked, every ``graph.compact_interval_s`` with updates since, and when the edge
entries changed since the base pass ``graph.compact_at_fill`` of the overlay budget an untyped
graph of the same size would have (``living.capacities``): the replay a start pays stays bounded.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np
import torch

from quiver_serve import errors
from quiver_serve.config import GraphConfig
from quiver_serve.graph import living, typed_base
from quiver_serve.graph import state as slots
from quiver_serve.graph.records import (
    TypedEdgeRecord,
    TypedFeatureRecord,
    TypedNodeRecord,
    TypedRecord,
)
from quiver_serve.graph.state import GraphState, readers_reach
from quiver_serve.graph.typed import TypedGraph
from quiver_serve.graph.typed_living import TypedLiveGraph, check_log_meta
from quiver_serve.graph.update_log import UpdateLog
from quiver_serve.graph.writer import intra_op_threads

log = logging.getLogger(__name__)

#: longest wait of a compaction for the engine cores to apply its version
READERS_WAIT_S = 30.0


def rows_at(base: torch.Tensor, count: int, appended: list[tuple[int, np.ndarray]],
            written: dict[int, tuple[int, np.ndarray]]) -> np.ndarray:
    """A type's ``count`` feature rows: the base's, the appended ones after them, the written
    ones over both."""
    rows = np.empty((count, base.size(1)), np.float32)
    rows[:base.size(0)] = base.numpy()
    at = base.size(0)
    for _, block in appended:
        rows[at:at + len(block)] = block
        at += len(block)
    for i, (_, row) in written.items():
        rows[i] = row
    return rows


class TypedGraphWriter:
    """Validates, logs and acknowledges typed updates; see the module docstring."""

    def __init__(self, cfg: GraphConfig, graph: TypedGraph, update_log: UpdateLog,
                 state: GraphState | None = None, base_version: int = 0) -> None:
        """``graph``: the dataset, or the log's base of ``base_version``
        (``typed_base.typed_graph_at_start``)."""
        self.cfg, self.log, self.base_version = cfg, update_log, base_version
        if base_version == 0:  # the dataset: the graph the log's records were made on
            check_log_meta(update_log.directory,
                           TypedLiveGraph(graph, cfg.add_reverse_edges).describe())
        self.stamp = typed_base.typed_stamp(cfg)
        #: keeps no feature rows: ``graph.x`` stays the base's, the rows since are kept apart
        self.live = TypedLiveGraph(graph, cfg.add_reverse_edges, keep_features=False)
        self.state = state or GraphState()
        self.lock = threading.Lock()  # versions and the graph: one update at a time
        self._ack_lock = threading.Lock()
        self._compact_lock = threading.Lock()
        self.version = self.acked = self.base_version
        #: feature rows since the base, per type: appended [(version, rows)], written
        #: {id: (version, row)}
        self.appended: dict[str, list[tuple[int, np.ndarray]]] = {t: [] for t in graph.x}
        self.written: dict[str, dict[int, tuple[int, np.ndarray]]] = {t: {} for t in graph.x}
        #: edge entries logged since the base, and how many ask for a compaction
        self.changed_entries = 0
        self.compact_entries = int(cfg.compact_at_fill * living.capacities(
            cfg, sum(graph.num_nodes.values()),
            sum(r.num_edges for r in graph.relations.values())).edge_capacity)
        #: versions the engine cores have applied (the owner sets it; none: nobody to wait for)
        self.reader_versions: Any = list
        #: called after each compaction with its seconds
        self.on_compaction: Any = None
        self.updates_by_kind = {"edges": 0, "nodes": 0, "features": 0}
        self.last_update_s = 0.0
        #: called after each acknowledged update: (kind, seconds, record version)
        self.on_update: Any = None

    @property
    def num_nodes(self) -> dict[str, int]:
        """Node count per type of the graph as this writer has it (acknowledged or about to)."""
        return dict(self.live.graph.num_nodes)

    def replay(self) -> int:
        """Apply the log's records (start-up); returns how many."""
        count = 0
        for record in self.log.records_after(self.version):
            self.live.apply(record)  # type: ignore[arg-type]
            self._remember(record)  # type: ignore[arg-type]
            self.version = self.acked = record.version
            count += 1
        self.publish()
        return count

    # ---- the update calls ------------------------------------------------------------------------
    def add_edges(self, add: Any, remove: Any, edge_type: Any = None) -> dict[str, Any]:
        add_arr, rm_arr = living.as_pairs(add, "add"), living.as_pairs(remove, "remove")
        living.check_count(len(add_arr) + len(rm_arr), self.cfg.max_update_edges, "edges")
        et = self.live.edge_type_of(edge_type)
        t0 = time.perf_counter()
        with self.lock:
            self.live.check_edges(et, add_arr, rm_arr)
            done = self._log(self.live.edge_record(self.version + 1, time.time(), et, add_arr,
                                                   rm_arr))
        return self._acknowledge(done, "edges", t0)

    def add_nodes(self, features: Any, node_type: Any = None) -> dict[str, Any]:
        node_type = self.live.node_type_of(node_type)
        rows = self.live.check_rows(node_type, np.asarray(features, dtype=np.float32)
                                    if features is not None else np.zeros((0, 0), np.float32))
        if len(rows) == 0:
            raise errors.ServeError("invalid_features", "no new nodes: give features (one row "
                                    "per node) or, for a type without features, count", 422)
        living.check_count(len(rows), self.cfg.max_update_edges, "nodes")
        t0 = time.perf_counter()
        with self.lock:
            done = self._log(self.live.node_record(self.version + 1, time.time(), node_type,
                                                   rows))
        return self._acknowledge(done, "nodes", t0)

    def put_features(self, node_ids: Any, features: Any, node_type: Any = None,
                     ) -> dict[str, Any]:
        node_type = self.live.node_type_of(node_type)
        width = self.live.widths[node_type]
        if width == 0:
            self.live.check_rows(node_type, np.zeros((1, 1), np.float32))  # names the type
        ids, rows = living.feature_writes(node_ids, features, width, self.cfg.max_update_edges)
        t0 = time.perf_counter()
        with self.lock:
            living.check_ids(ids, self.live.graph.num_nodes[node_type], f"node_ids ({node_type})")
            done = self._log(self.live.feature_record(self.version + 1, time.time(), node_type,
                                                      ids, rows))
        return self._acknowledge(done, "features", t0)

    def _log(self, record: TypedRecord) -> dict[str, Any]:
        """Append ``record`` to the log and apply it here (the lock held): the call's answer."""
        self.log.write(record)
        result = self.live.apply(record)
        self._remember(record)
        self.version = record.version
        return {"version": record.version, **result}

    def _remember(self, record: TypedRecord) -> None:
        """What the next base needs beyond the live graph: feature rows, and edge entries
        changed (the compaction trigger)."""
        if isinstance(record, TypedEdgeRecord):
            self.changed_entries += len(record.add) + len(record.remove)
            return
        node_type = self.live.node_types[int(record.type_key[0])]
        if node_type not in self.appended:
            return  # a type without features
        if isinstance(record, TypedNodeRecord):
            self.appended[node_type].append((record.version, record.features))
        elif isinstance(record, TypedFeatureRecord):
            rows = self.written[node_type]
            for i, row in zip(record.node_ids.tolist(), record.features, strict=True):
                rows[i] = (record.version, row)

    def _acknowledge(self, done: dict[str, Any], kind: str, t0: float) -> dict[str, Any]:
        """Wait (outside the lock, so concurrent calls share a group commit) until the record
        is durable, then acknowledge it."""
        version = int(done["version"])
        self.log.wait_durable(version)
        with self._ack_lock:
            self.acked = max(self.acked, version)
            self.updates_by_kind[kind] += 1
            self.last_update_s = time.time()
            self.publish()
        if self.on_update is not None:
            self.on_update(kind, time.perf_counter() - t0, version)
        if self.changed_entries >= self.compact_entries:
            self.request_compaction()
        return done

    # ---- state -----------------------------------------------------------------------------------
    def publish(self) -> None:
        g, s = self.live.graph, self.state
        s.set(slots.NUM_NODES, sum(g.num_nodes.values()))
        s.set(slots.NUM_EDGES, sum(rel.num_edges for rel in g.relations.values()))
        s.set(slots.ACKED_AT_S, time.time())
        s.set(slots.ACKED, self.acked)  # last: readers that see it see the counts

    def request_compaction(self, explicit: bool = False) -> None:
        """Ask the background compactor: by the entries changed, or at once when ``explicit``."""
        self.state.want_compaction(explicit)

    def maybe_rebase(self) -> bool:
        """Nothing to move: the writer's graph is the live one (the compactor asks each turn)."""
        return False

    # ---- compaction --------------------------------------------------------------------------------
    def compact(self) -> dict[str, Any]:
        """The graph at the acknowledged version as the log's new base; see the module
        docstring."""
        with self._compact_lock, intra_op_threads(self.cfg.compact_threads):
            t0 = time.perf_counter()
            with self.lock:  # held only to list what the base is made of
                version = self.version
                if version == self.base_version:
                    self.state.set(slots.COMPACT_WANTED, 0)
                    return {"version": version, "compacted": False, "reason": "nothing new"}
                self.log.wait_durable(version)
                g = self.live.graph
                name, num_nodes, base_x = g.name, dict(g.num_nodes), dict(g.x)
                relations, labels = dict(g.relations), dict(g.y)
                appended = {t: list(rows) for t, rows in self.appended.items()}
                written = {t: dict(rows) for t, rows in self.written.items()}
                changed = self.changed_entries
            if not self._readers_reach(version):
                return {"version": version, "compacted": False,
                        "reason": "an engine core has not applied the updates up to this version "
                                  "yet; the next compaction retries"}
            x = {t: rows_at(base_x[t], num_nodes[t], appended[t], written[t]) for t in appended}
            graph = TypedGraph(name, num_nodes, {t: torch.from_numpy(r) for t, r in x.items()},
                               relations, labels)
            arrays, meta = typed_base.base_arrays(graph, self.stamp)
            self.log.write_base(version, arrays, meta)
            with self.lock:
                self._forget(version, x, changed)
            seconds = time.perf_counter() - t0
            self.state.record_compaction(version, seconds)
            self.state.set(slots.BASE_VERSION, version)
            if self.on_compaction is not None:
                self.on_compaction(seconds)
            log.info("compacted the typed graph at version %d in %.2f s (%s nodes)", version,
                     seconds, dict(graph.num_nodes))
            return {"version": version, "compacted": True, "duration_s": round(seconds, 3)}

    def _forget(self, version: int, x: dict[str, np.ndarray], changed: int) -> None:
        """The new base in force (the lock held): its rows are the writer's, and what came
        after it is kept."""
        g = self.live.graph
        for t, rows in x.items():
            g.x[t] = torch.from_numpy(rows)
            self.appended[t] = [(v, r) for v, r in self.appended[t] if v > version]
            self.written[t] = {i: (v, r) for i, (v, r) in self.written[t].items() if v > version}
        self.changed_entries -= changed
        self.base_version = version

    def _readers_reach(self, version: int) -> bool:
        """Every engine core applied ``version`` (``READERS_WAIT_S`` at most)."""
        return readers_reach(self.reader_versions, version, READERS_WAIT_S)

    def info(self, num_engines: int) -> dict[str, Any]:
        engines = self.state.engines(num_engines)
        g = self.live.graph
        compaction = self.state.last_compaction()
        return {
            "version": self.acked, "base_version": self.base_version,
            "num_nodes": dict(g.num_nodes),
            "num_edges": {"__".join(et): rel.num_edges for et, rel in g.relations.items()},
            "engines": engines,
            "staleness_s": max((e["staleness_s"] for e in engines), default=0.0),
            "overlay": None, "last_compaction": compaction,
        }

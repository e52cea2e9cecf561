"""TypedGraphWriter: the living graph's writer on a typed graph (docs/architecture.md, "Typed
graphs"; docs/decisions/0048-typed-updates.md).

The same contract as ``graph/writer.py``: an update is checked (the relation or node type it
names, ids in those types' ranges, widths, finite values, its size), appended to the update log
and synced per ``graph.fsync``, applied to the writer's copy of the graph (counts and relations,
no feature rows), and acknowledged once durable; the version it returns survives kill -9. The
engine cores follow the log (``engine/core/typed_sync.py``). The log is never compacted: a start
replays it over the graph loaded from the dataset.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np

from quiver_serve import errors
from quiver_serve.config import GraphConfig
from quiver_serve.graph import living
from quiver_serve.graph import state as slots
from quiver_serve.graph.records import TypedRecord
from quiver_serve.graph.state import GraphState
from quiver_serve.graph.typed import TypedGraph
from quiver_serve.graph.typed_living import TypedLiveGraph, check_log_meta
from quiver_serve.graph.update_log import UpdateLog

log = logging.getLogger(__name__)


def no_compaction() -> errors.ServeError:
    return errors.ServeError("compaction_unavailable", "the update log of a typed graph is not "
                             "compacted; a start replays it over the dataset "
                             '(docs/architecture.md, "Typed graphs")', 501)


class TypedGraphWriter:
    """Validates, logs and acknowledges typed updates; see the module docstring."""

    def __init__(self, cfg: GraphConfig, graph: TypedGraph, update_log: UpdateLog,
                 state: GraphState | None = None) -> None:
        self.cfg, self.log = cfg, update_log
        self.live = TypedLiveGraph(graph, cfg.add_reverse_edges, keep_features=False)
        check_log_meta(update_log.directory, self.live.describe())
        self.state = state or GraphState()
        self.lock = threading.Lock()  # versions and the graph: one update at a time
        self._ack_lock = threading.Lock()
        self.base_version = self.version = self.acked = 0
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
        self.version = record.version
        return {"version": record.version, **result}

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
        return done

    # ---- state -----------------------------------------------------------------------------------
    def publish(self) -> None:
        g, s = self.live.graph, self.state
        s.set(slots.NUM_NODES, sum(g.num_nodes.values()))
        s.set(slots.NUM_EDGES, sum(rel.num_edges for rel in g.relations.values()))
        s.set(slots.ACKED_AT_S, time.time())
        s.set(slots.ACKED, self.acked)  # last: readers that see it see the counts

    def request_compaction(self, explicit: bool = False) -> None:
        raise no_compaction()

    def compact(self) -> dict[str, Any]:
        raise no_compaction()

    def info(self, num_engines: int) -> dict[str, Any]:
        engines = self.state.engines(num_engines)
        g = self.live.graph
        return {
            "version": self.acked, "base_version": self.base_version,
            "num_nodes": dict(g.num_nodes),
            "num_edges": {"__".join(et): rel.num_edges for et, rel in g.relations.items()},
            "engines": engines,
            "staleness_s": max((e["staleness_s"] for e in engines), default=0.0),
            "overlay": None, "last_compaction": None,
        }

"""GraphOwner: the main process's side of the living graph (docs/architecture.md, "The living
graph").

It picks the graph to serve (the newest compacted base in the update-log folder when there is
one), owns the shared counters (``GraphState``) every process reads, opens the update log and
replays it into the writer (read-only when another daemon holds the log), and runs the
compactor: a thread that moves the writer onto a compacted base once every sampling process has,
and compacts when the overlay is ``graph.compact_at_fill`` full, every
``graph.compact_interval_s``, or when asked.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from quiver_serve.config import ServeConfig
from quiver_serve.graph import living
from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.living import LiveGraphArgs
from quiver_serve.graph.state import ACKED, COMPACT_WANTED, NUM_NODES, GraphState
from quiver_serve.graph.typed import TypedGraph
from quiver_serve.graph.typed_base import is_typed
from quiver_serve.graph.typed_writer import TypedGraphWriter
from quiver_serve.graph.writer import GraphWriter

if TYPE_CHECKING:
    from quiver_serve.graph.update_log import UpdateLog

log = logging.getLogger(__name__)

#: background compactions are at least this far apart (an explicit request does not wait)
COMPACT_MIN_GAP_S = 30.0


class GraphOwner:
    """See the module docstring."""

    def __init__(self, cfg: ServeConfig, graph: GraphData, base_version: int,
                 log_dir: str | None, typed_graph: TypedGraph | None = None) -> None:
        #: the typed graph the writer updates (a typed config; loaded at ``open`` when None)
        self.typed_graph = typed_graph
        directory = _log_dir(cfg, graph, log_dir)
        self.graph, base_version = _newest_on_disk(directory, graph, base_version)
        self.cfg = cfg
        self.living = living_graph_args(cfg, self.graph, base_version, directory)
        self.state = GraphState(self.living.state)
        self.writer: GraphWriter | TypedGraphWriter | None = None
        self.read_only_reason: str | None = None
        self._readers: Callable[[], list[tuple[str, int]]] = list
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()
        if self.writer is not None:
            self.writer.log.close()

    def open(self, readers: Callable[[], list[tuple[str, int]]]) -> None:
        """Open the update log and replay it (the acknowledged version is then published);
        ``readers``: (role, index) of the live processes that apply updates."""
        self._readers = readers
        from quiver_serve.engine.procs.typed_engine_proc import config_is_typed

        if config_is_typed(self.cfg):
            self._open_typed()
            return

        g = self.cfg.graph
        update_log = self._open_log()
        if update_log is None:
            return
        writer = GraphWriter(g, self.graph, self.living.base_version, update_log,
                             self.state, self.cfg.server.retry_after_s)
        from quiver_serve.metrics.prometheus import GraphWriterMetrics

        metrics = GraphWriterMetrics()

        def on_update(kind: str, seconds: float, version: int) -> None:
            metrics.on_update(kind, seconds, version)
            ov = writer.overlay
            metrics.on_state(ov.num_nodes, ov.num_edges, ov.top, ov.edge_capacity)

        writer.on_update = on_update
        writer.on_stages = metrics.on_stages
        writer.on_compaction = metrics.on_compaction
        replayed = writer.replay()
        if replayed:
            log.info("update log %s: %d update(s) replayed over base version %d (now version %d)",
                     self.living.log_dir, replayed, self.living.base_version, writer.acked)
        writer.reader_bases = self._reader_bases
        writer.reader_versions = self._reader_versions
        self.writer = writer
        self._compactor = threading.Thread(target=self._compact_when_due, args=(writer,),
                                           name="quiver-compactor", daemon=True)
        self._compactor.start()

    def _open_log(self) -> UpdateLog | None:
        """The update log opened for writing; None (read-only, the log replayed) when another
        daemon holds it."""
        from quiver_serve.graph.update_log import LogLockedError, UpdateLog

        g = self.cfg.graph
        update_log = UpdateLog(Path(self.living.log_dir), g.fsync, g.group_commit_ms)
        try:
            update_log.open()
        except LogLockedError as exc:
            self.read_only_reason = f"graph updates are taken by another daemon ({exc})"
            log.warning("%s; this one serves the graph read-only", self.read_only_reason)
            self._replay_read_only()
            return None
        return update_log

    def _open_typed(self) -> None:
        """The typed writer over the update log, the log replayed (docs/architecture.md, "Typed
        graphs"); read-only when another daemon holds the log."""
        from quiver_serve.graph.typed_base import typed_graph_at_start

        g = self.cfg.graph
        update_log = self._open_log()
        if update_log is None:
            return
        if self.typed_graph is not None:  # the caller's start (``typed_graph_at_start``)
            graph, base_version = self.typed_graph, self.living.base_version
        else:
            graph, base_version = typed_graph_at_start(g, Path(self.living.log_dir))
        self.typed_graph = None  # the writer's copy from here on
        writer = TypedGraphWriter(g, graph, update_log, self.state, base_version)
        from quiver_serve.metrics.prometheus import GraphWriterMetrics

        metrics = GraphWriterMetrics()
        writer.on_update = metrics.on_update  # versions, update counts, durations
        writer.on_compaction = metrics.on_compaction
        replayed = writer.replay()
        if replayed or writer.base_version:
            log.info("update log %s: %d typed update(s) replayed over base version %d (now "
                     "version %d)", self.living.log_dir, replayed, writer.base_version,
                     writer.acked)
        writer.reader_versions = self._reader_versions
        self.writer = writer
        self._compactor = threading.Thread(target=self._compact_when_due, args=(writer,),
                                           name="quiver-compactor", daemon=True)
        self._compactor.start()

    def _compact_when_due(self, writer: GraphWriter | TypedGraphWriter) -> None:
        """Compact when the overlay passed ``graph.compact_at_fill`` (the writer asks) or
        ``graph.compact_interval_s`` after the last compaction with updates since; at most one
        compaction per ``COMPACT_MIN_GAP_S``."""
        g = self.cfg.graph
        last_s = time.monotonic()
        while not self._stop.wait(1.0):
            try:
                writer.maybe_rebase()
            except Exception:  # noqa: BLE001 - the writer keeps its overlay; tried again later
                log.exception("moving the graph writer to the compacted base failed")
            now_s = time.monotonic()
            wanted = self.state.get(COMPACT_WANTED)
            due = g.compact_interval_s > 0 and now_s - last_s >= g.compact_interval_s
            if wanted >= 2 or ((wanted or due) and now_s - last_s >= COMPACT_MIN_GAP_S):
                last_s = now_s
                try:
                    writer.compact()
                except Exception:  # noqa: BLE001 - the log stays whole; the next try may work
                    log.exception("compaction failed; the update log keeps every update")

    def _reader_versions(self) -> list[int]:
        """The version each live engine core and CPU sampler has applied."""
        return [self.state.reader_version(role, i) for role, i in self._readers()]

    def _reader_bases(self) -> list[int]:
        """The base version each live engine core and CPU sampler samples over."""
        return [self.state.reader_base(role, i) for role, i in self._readers()]

    def _replay_read_only(self) -> None:
        from quiver_serve.graph.update_log import LogFollower

        follower = LogFollower(Path(self.living.log_dir), self.living.base_version)
        last = self.living.base_version
        while records := follower.poll(4096):
            last = records[-1].version
        self.state.set(ACKED, last)
        self.state.set(NUM_NODES, self.graph.num_nodes)


def _log_dir(cfg: ServeConfig, graph: GraphData, log_dir: str | None) -> str:
    """The update-log folder: given, configured, else keyed by the graph handed in (its
    content: a caller's graph never replays another graph's log)."""
    if log_dir is not None:
        return log_dir
    if cfg.graph.update_log_dir is not None:
        return str(living.log_dir(cfg.graph))
    return str(living.log_dir_for_graph(graph))


def _newest_on_disk(directory: str, graph: GraphData, base_version: int,
                    ) -> tuple[GraphData, int]:
    """The newest compacted base in ``directory`` when it is newer than ``graph`` (a daemon
    restarted after a compaction serves it; the log before it is gone)."""
    from quiver_serve.graph.update_log import load_base

    found = load_base(Path(directory)) if Path(directory).exists() else None
    if found is None or found[0] <= base_version or is_typed(found[2]):
        return graph, base_version  # a typed base: the typed writer and engine cores load it
    version, arrays, meta = found
    log.info("serving the compacted base of version %d from %s", version, directory)
    # mapped, not copied: every process maps the same files (``living.MappedGraph``)
    return living.graph_from_arrays(arrays, meta, graph.name,
                                    mapped_from=Path(directory)), version


def living_graph_args(cfg: ServeConfig, graph: GraphData, base_version: int,
                      directory: str) -> LiveGraphArgs:
    """Where the graph's update log is, its capacities and the shared counters."""
    state = GraphState()
    state.set(NUM_NODES, graph.num_nodes)
    state.set(ACKED, base_version)
    caps = living.capacities(cfg.graph, graph.num_nodes, graph.num_edges)
    return LiveGraphArgs(directory, base_version, caps, state.tensor)

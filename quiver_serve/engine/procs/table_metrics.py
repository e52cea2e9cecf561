"""The exact table's metrics in an engine core process (docs/architecture.md, "The exact table"):
they follow the table that serves now (a model load swaps a new version's in, its counters start
from 0) and the builds of new versions' tables (each chunk's seconds, the build's progress).
"""

from __future__ import annotations

from collections.abc import Callable

from quiver_serve.engine.core.core import EngineCore
from quiver_serve.engine.core.exact_table import ExactTable
from quiver_serve.metrics.prometheus import TableMetrics


class TableWatch:
    """Called by the engine loop after its replies (now and then): the serving table's counters
    into the metrics, and its state published for ``GET /v1/graph``."""

    def __init__(self, core: EngineCore, index: int) -> None:
        self.core, self.index = core, index
        self.metrics = TableMetrics(index)
        self.table: ExactTable | None = None
        self.failures = 0
        if core.loads is not None:
            core.loads.on_build_step = self.metrics.on_build_step

    def _follow(self, table: ExactTable) -> None:
        first = self.table is None
        self.table, self.failures = table, 0
        if first:
            self.metrics.started(table.counters.build_s, table.nbytes, table.version)
        else:
            self.metrics.follow(table.counters.build_s, table.nbytes, table.version)
        if table.refresher is not None:
            table.refresher.on_round = self.metrics.on_round

    def __call__(self) -> None:
        gate = self.core.quiet
        self.metrics.sync_turns(gate.quiet_turns, gate.waited_turns)
        table = self.core.exact_table
        if table is None:
            return
        if table is not self.table:
            self._follow(table)
        refresher = table.refresher
        self.metrics.sync(table.counters, refresher.backlog_rows if refresher else 0)
        sync = self.core.graph_sync
        if refresher is None or sync is None:
            return
        if sync.state is not None:
            sync.state.publish_table(self.index, table.version,
                                     int(table.stale[:self.core.num_nodes].sum()),
                                     table.counters.last_staleness_s)
        if table.counters.failures > self.failures:
            self.failures = table.counters.failures
            self.metrics.failed()


def table_metrics(core: EngineCore, index: int) -> Callable[[], None] | None:
    """What the loop calls after its replies; None when the core has no exact table."""
    if core.exact_table is None:
        return None
    watch = TableWatch(core, index)
    watch()
    return watch

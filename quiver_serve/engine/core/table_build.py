"""A new model version's exact table, built in the engine loop between steps under a per-step
budget (docs/architecture.md, "Models and versions"; docs/decisions/0040-model-load-duty.md).

The version serves as soon as its model is ready; its exact requests go to the on-the-fly path
until its table is built. :meth:`StepwiseBuild.step` runs between two engine steps and computes
chunks of target nodes (contiguous, layer by layer, as ``ExactTable.build`` does) until the
step's budget (``models.table_build_step_ms``) is spent. Chunks are sized in work units (in-edges
plus rows) by what the one before took: the next has the units that would take ``CHUNK_TARGET``
of the budget at that chunk's rate (at most twice, at least half, the units before; the first
chunk of a build is a small probe), so a chunk's fixed cost does not shrink chunks to nothing.
Another chunk runs in the same step only while its predicted seconds fit what is left. So a
serving step waits behind at most about one budget of table work, and the build takes what the
serving load leaves: every step when the loop is busy, back to back when it is idle.

A chunk is measured to its end on the device (the table's stream is synchronised), so the
seconds recorded (``chunk_s``, the metrics' histogram) are what the loop waited.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from quiver_serve.engine.core.exact_table import MAX_CHUNK_ROWS, ExactTable

#: work units (in-edges + rows) of a build's first chunk, before any cost is measured
PROBE_UNITS = 1024
#: weight of the newest chunk in the measured seconds per unit
COST_EWMA = 0.3
#: share of the step's budget a chunk is sized for (the rest absorbs chunk-to-chunk variance)
CHUNK_TARGET = 0.8
#: chunk seconds kept for the metrics between two reads (older ones are dropped)
MAX_RECORDED = 4096


class StepwiseBuild:
    """One pending exact table, built a budget at a time; see the module docstring."""

    def __init__(self, table: ExactTable, budget_s: float,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if budget_s <= 0:
            raise ValueError(f"table build budget must be > 0 s, got {budget_s}")
        self.table, self.budget_s, self.clock = table, float(budget_s), clock
        self.graph = table.graph_of()  # updates are held: this graph holds for the whole build
        self.num_nodes = int(self.graph.num_nodes)
        nodes = torch.arange(self.num_nodes, device=table.device)
        units = self.graph.in_degree(nodes).cpu().numpy().astype(np.int64) + 1
        #: work units of nodes [0, i) at [i]
        self.cum_units = np.concatenate([[0], np.cumsum(units)])
        self.layer, self.pos = 0, 0
        self.s_per_unit: float | None = None
        self.chunk_units = PROBE_UNITS
        self.chunks_done, self.steps = 0, 0
        self.started_s = clock()
        self.compute_s = 0.0
        #: seconds of each chunk not read yet by the metrics (``take_chunk_s``)
        self.chunk_s: list[float] = []
        #: chunks each step ran (the last few hundred), for the budget's checks
        self.chunks_per_step: list[int] = []
        self.done = self.num_nodes == 0 or not table.layers

    @property
    def total_units(self) -> int:
        return int(self.cum_units[-1]) * len(self.table.layers)

    def progress(self) -> float:
        """Share of the build done, 0..1 (by work units)."""
        total = self.total_units
        if self.done or total == 0:
            return 1.0
        done_units = int(self.cum_units[-1]) * self.layer + int(self.cum_units[self.pos])
        return done_units / total

    def _chunk_end(self) -> int:
        """The end of the next chunk from ``pos``: about ``chunk_units`` of work (one node at
        least, ``MAX_CHUNK_ROWS`` at most)."""
        start = int(self.cum_units[self.pos])
        end = int(np.searchsorted(self.cum_units, start + self.chunk_units, side="right")) - 1
        return min(max(end, self.pos + 1), self.pos + MAX_CHUNK_ROWS, self.num_nodes)

    def predicted_s(self, end: int) -> float:
        units = int(self.cum_units[end] - self.cum_units[self.pos])
        return 0.0 if self.s_per_unit is None else units * self.s_per_unit

    def step(self) -> bool:
        """Chunks until this step's budget is spent (one at least); True once the table is
        built (``ExactTable.finish_build`` done: it may be served)."""
        if self.done:
            return True
        t = self.table
        step_start = self.clock()
        ran = 0
        while True:
            left_s = self.budget_s - (self.clock() - step_start)
            end = self._chunk_end()
            if ran and (left_s <= 0 or self.predicted_s(end) > left_s):
                break
            units = int(self.cum_units[end] - self.cum_units[self.pos])
            t0 = self.clock()
            with t.work_lock, t.on_stream(t.stream):
                targets = torch.arange(self.pos, end, device=t.device)
                t.compute_rows(self.layer, targets, self.graph)
                if t.stream is not None:
                    t.stream.synchronize()
            spent_s = self.clock() - t0
            self._measured(units, spent_s)
            ran += 1
            self.pos = end
            if self.pos >= self.num_nodes:
                self.layer, self.pos = self.layer + 1, 0
                if self.layer >= len(t.layers):
                    break
        self.steps += 1
        self.chunks_per_step = (self.chunks_per_step + [ran])[-256:]
        if self.layer >= len(t.layers):
            t.finish_build(self.graph, self.started_s)
            self.done = True
        return self.done

    def _measured(self, units: int, spent_s: float) -> None:
        per_unit = spent_s / max(units, 1)
        self.s_per_unit = per_unit if self.s_per_unit is None else (
            COST_EWMA * per_unit + (1 - COST_EWMA) * self.s_per_unit)
        scale = min(max(CHUNK_TARGET * self.budget_s / max(spent_s, 1e-9), 0.5), 2.0)
        self.chunk_units = max(int(units * scale), 1)
        self.chunks_done += 1
        self.compute_s += spent_s
        if len(self.chunk_s) < MAX_RECORDED:
            self.chunk_s.append(spent_s)

    def take_chunk_s(self) -> list[float]:
        """The chunk seconds recorded since the last call (for the metrics' histogram)."""
        out, self.chunk_s = self.chunk_s, []
        return out

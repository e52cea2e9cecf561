"""The exact table's refresh thread: recomputes marked rows in the background of serving.

A round takes every row marked so far (``ExactTable.pending``, per layer), clears the marks, and
recomputes those rows layer by layer, in chunks of at most ``exact.refresh_chunk_edges`` in-edges,
on its own CUDA stream. A round's marks and each chunk wait for a quiet engine loop
(``quiet.py``: nothing waiting, sampling or in flight; at most ``exact.quiet_wait_ms``), and the
round pauses after each chunk so that it computes at most ``exact.refresh_duty`` of the time (a
serving batch meets at most the one chunk running when its request came). A layer whose marked
rows exceed ``exact.full_recompute_fraction`` of the nodes is recomputed whole from there on
(contiguous chunks: a full recompute). Rows marked while the round runs stay marked for the next
one. When the round's last chunk has finished on the device, the
last layer's stale rows become exactly those marked since the round began, and the table's version
becomes the version marked when it began.

One chunk at a time holds ``ExactTable.work_lock``, so the engine can swap what chunks read (a
compacted base, a feature re-placement) between two chunks. A failing round is logged, counted,
and every row is marked for a full recompute after a back-off; stale rows are answered on the fly
meanwhile, so a broken refresh costs speed, never correctness.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from quiver_serve.engine.core.quiet import QuietGate, open_gate

if TYPE_CHECKING:
    from quiver_serve.engine.core.exact_table import ExactTable

log = logging.getLogger(__name__)

#: a failed round is retried after this, doubling up to the cap
RETRY_S, RETRY_CAP_S = 1.0, 30.0
#: the thread checks for marks (and for stop) at least this often
IDLE_WAIT_S = 0.1


class Refresher:
    """The refresh thread of one :class:`~quiver_serve.engine.core.exact_table.ExactTable`."""

    def __init__(self, table: ExactTable, gate: QuietGate | None = None) -> None:
        self.table = table
        #: the engine loop's quiet flag: the round's marks and each chunk wait for it
        self.gate = gate if gate is not None else open_gate()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="exact-table-refresh", daemon=True)
        self.backlog_rows = 0
        self.busy = False
        self._last_round_s = 0.0
        #: called after each round with (rows refreshed, staleness s, table version)
        self.on_round: Callable[[int, float, int], None] | None = None

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def idle(self) -> bool:
        """Nothing marked and no round running."""
        return not self.busy and self.table.pending_since_s is None

    def wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.idle():
                return True
            self._wake.set()
            time.sleep(0.005)
        return self.idle()

    # ---- the loop ------------------------------------------------------------------------------
    def _run(self) -> None:
        retry_s = RETRY_S
        while not self._stop.is_set():
            self._wake.wait(IDLE_WAIT_S)
            self._wake.clear()
            if self._stop.is_set() or self.table.pending_since_s is None:
                continue
            gap_s = self.table.cfg.refresh_interval_ms / 1e3 - (time.monotonic()
                                                                - self._last_round_s)
            if gap_s > 0:
                time.sleep(gap_s)  # changes arriving together are refreshed together
            try:
                self.round()
                retry_s = RETRY_S
            except Exception as exc:  # noqa: BLE001 - logged; rows stay stale, served on the fly
                if self._stop.is_set():
                    self.busy = False
                    return
                self.table.counters.failures += 1
                log.exception("exact table refresh failed (%s); every row is recomputed in "
                              "%.0f s, answers come from the on-the-fly path meanwhile",
                              exc, retry_s)
                self._mark_all()  # before busy clears: never idle with the retry still due
                self.busy = False
                self._stop.wait(retry_s)
                retry_s = min(retry_s * 2, RETRY_CAP_S)

    def _mark_all(self) -> None:
        t = self.table
        with t.lock, t.on_stream(t.mark_stream):
            for p in t.pending:
                p.fill_(True)
            if t.mark_stream is not None:
                t.mark_stream.synchronize()
            if t.pending_since_s is None:
                t.pending_since_s = time.time()

    def round(self) -> None:
        """Recompute every row marked so far; see the module docstring."""
        t = self.table
        self.busy = True  # before the marks are taken: never idle with a round due
        self.gate.wait_turn(self._stop)
        self._last_round_s = time.monotonic()
        with t.lock, t.on_stream(t.mark_stream):
            since_s = t.take_pending_since()
            if since_s is None:
                self.busy = False
                return
            t.settle_marks(held=True)  # every mark made so far: the version the round reaches
            sets = [torch.nonzero(p).flatten() for p in t.pending]
            for p in t.pending:
                p.zero_()
            version = t.marked_version
            if t.mark_stream is not None:
                t.mark_stream.synchronize()
        rows = self._recompute(sets)
        with t.lock, t.on_stream(t.mark_stream):
            t.set_stale(t.pending[-1].cpu().numpy().copy())  # pending changes in place
            t.version = version
        staleness_s = max(0.0, time.time() - since_s)
        c = t.counters
        c.rows_refreshed += rows
        c.rounds += 1
        c.last_staleness_s = staleness_s
        self.busy = False
        self.backlog_rows = 0
        if self.on_round is not None:
            self.on_round(rows, staleness_s, version)

    def _yield(self, chunk_s: float) -> None:
        """Leave the device and the interpreter to serving after a chunk, so that a round
        computes at most ``exact.refresh_duty`` of the time (``exact.refresh_duty``)."""
        duty = self.table.cfg.refresh_duty
        if duty < 1.0:
            self._stop.wait(chunk_s * (1.0 - duty) / duty)

    def _recompute(self, sets: list[torch.Tensor]) -> int:
        t = self.table
        num_nodes = t.graph_of().num_nodes
        full = False
        rows = 0
        remaining = sum(int(s.numel()) for s in sets)
        for layer, targets in enumerate(sets):
            if full or targets.numel() > t.cfg.full_recompute_fraction * num_nodes:
                if not full:
                    t.counters.full_recomputes += 1
                full = True
                targets = torch.arange(num_nodes, device=t.device)
            with t.on_stream(t.stream):
                pieces = t.chunks(targets, t.graph_of(), t.cfg.refresh_chunk_edges)
            for chunk in pieces:
                self.gate.wait_turn(self._stop)  # a serving step meets at most this chunk
                started_s = time.perf_counter()
                with t.work_lock, t.on_stream(t.stream):
                    t.compute_rows(layer, chunk, t.graph_of())
                    if t.stream is not None:
                        t.stream.synchronize()
                self._yield(time.perf_counter() - started_s)
                rows += int(chunk.numel())
                remaining -= int(chunk.numel())
                self.backlog_rows = max(remaining, 0)
                if self._stop.is_set():
                    raise RuntimeError("stopped")
        return rows

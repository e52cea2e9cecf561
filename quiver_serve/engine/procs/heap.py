"""Short garbage-collector pauses in the daemon's long-running processes.

CPython's oldest-generation collection walks every tracked container object of the process. After
``import torch, torch_geometric`` and a model build that is ~330 k objects, and one full collection
takes ~60-160 ms. Such a collection runs on its own whenever enough new objects have survived,
so under load an engine core, a CPU sampler or a front-end can stop for ~100 ms, and every request
in flight then misses a 10 ms bound (docs/decisions/0005-gc-freeze.md). The pause histogram below
tells whether collections are behind a run's p99.9 outliers.

:func:`freeze_startup_heap` moves everything alive after start-up into the permanent generation
(``gc.freeze()``, as vLLM's engine core does after its start-up): later collections walk only
objects made since, and a full one takes microseconds to a few milliseconds. The start-up objects
are kept for the process's lifetime, which they are anyway.

:class:`GcPauses` times every collection by generation through ``gc.callbacks``. The callback only
appends to a bounded deque (no lock: a collection can start inside any allocation, including one
made while a metrics lock is held); :meth:`GcPauses.flush` hands the pauses to a sink (the
``quiver_serve_gc_pause_seconds`` histogram) from the process's own periodic code.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

#: pauses kept between flushes (older ones are dropped: the histogram is a sample of them)
MAX_PENDING_PAUSES = 4096


def freeze_startup_heap(role: str, enabled: bool = True) -> int:
    """Collect once, then freeze what is alive; returns the number of frozen objects (0 when
    ``enabled`` is false: the process keeps CPython's default behaviour)."""
    if not enabled:
        return 0
    t0_s = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: froze %d start-up objects in %.0f ms (later collections skip them)",
             role, frozen, (time.perf_counter() - t0_s) * 1e3)
    return frozen


@contextlib.contextmanager
def collections_paused() -> Iterator[None]:
    """No automatic collection inside (``gc.disable()``); one collection after, and the previous
    setting back. For load generators' measurement windows: a benchmark client's own full
    collections (tens of ms in a load process with hundreds of callers, even after its start-up
    heap was frozen) are the harness's pauses, not the daemon's, yet they land in the
    latencies it reports. Cycles made inside wait for the collection at the end; a window of
    seconds makes little of them. Not for the daemon's own processes, which run for days."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        gc.collect()


class GcPauses:
    """Every garbage collection's duration, by generation, buffered for :meth:`flush`."""

    def __init__(self) -> None:
        self._pending: collections.deque[tuple[int, float]] = collections.deque(
            maxlen=MAX_PENDING_PAUSES)
        self._started_s = 0.0
        self._installed = False

    def install(self) -> GcPauses:
        if not self._installed:
            gc.callbacks.append(self._on_gc)
            self._installed = True
        return self

    def close(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._on_gc)
            self._installed = False

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started_s = time.perf_counter()
        elif self._started_s:
            self._pending.append((int(info.get("generation", 2)),
                                  time.perf_counter() - self._started_s))
            self._started_s = 0.0

    def flush(self, sink: Callable[[int, float], None]) -> int:
        """Pass each buffered (generation, seconds) to ``sink``; returns how many."""
        n = 0
        while self._pending:
            try:
                generation, pause_s = self._pending.popleft()
            except IndexError:  # emptied meanwhile (a collection on another thread)
                break
            sink(generation, pause_s)
            n += 1
        return n


class GcWatch:
    """A process's frozen start-up heap and its pause timer (see :func:`start_gc_watch`)."""

    def __init__(self, role: str, freeze: bool) -> None:
        from quiver_serve.metrics.prometheus import gc_pause_sink

        self.frozen_objects = freeze_startup_heap(role, freeze)
        self.pauses = GcPauses().install()
        self._sink = gc_pause_sink(role)

    def flush(self) -> int:
        """Record the pauses since the last flush; call it from the process's periodic code."""
        return self.pauses.flush(self._sink)


def start_gc_watch(role: str, freeze: bool = True) -> GcWatch:
    """Freeze the start-up heap (when ``freeze``) and time later collections into
    ``quiver_serve_gc_pause_seconds{role, generation}``."""
    return GcWatch(role, freeze)

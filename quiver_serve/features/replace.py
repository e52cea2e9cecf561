"""Re-placement on demand, while serving (docs/architecture.md, "Feature store"): the request log
becomes the seed distribution, FAP and the new layout are built in a background thread, and the
engine switches between two batches (``FeatureStore.commit``). Triggered by ``POST
/admin/features/replace`` on the HTTP front-end (the supervisor signals every engine core), or
``kill -USR1`` to one engine core process (its pid: ``GET /v1/workers``)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from quiver_serve.config import ServeConfig
from quiver_serve.features.build import plan_for
from quiver_serve.features.fap import RequestLog
from quiver_serve.features.store import FeatureStore, Layout
from quiver_serve.graph.csc import GraphData

log = logging.getLogger(__name__)

#: a log shorter than this many ids is too thin to learn from: uniform seeds instead
MIN_LOGGED_IDS = 1000


class Replacer:
    """One engine core's re-placement: ``request()`` from any thread, ``poll(core)`` from the
    engine's loop (it commits a finished layout on the serving stream).

    Scores come from ``self.graph`` (its nodes; the store's capacity rows score 0): where the
    graph changes while serving, assign the current one before requesting. Rows written
    (``FeatureStore.write_rows``) while a layout is being built are replayed into it at commit.
    """

    def __init__(self, cfg: ServeConfig, graph: GraphData, store: FeatureStore) -> None:
        self.cfg, self.graph, self.store = cfg, graph, store
        self._thread: threading.Thread | None = None
        self._ready: Layout | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._wanted = threading.Event()
        self.done = 0  # re-placements committed

    def request(self) -> None:
        """Ask for a re-placement (signal-handler safe: only sets a flag)."""
        self._wanted.set()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def poll(self, request_log: RequestLog, stream: torch.cuda.Stream | None = None,
             paused: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
             ) -> None:
        """Start a requested re-placement (seeded by ``request_log``), or commit one that has
        finished: on ``stream`` (the engine's compute stream; None: the current one), inside
        ``paused()`` (no exact-table chunk reads the store meanwhile)."""
        if self._wanted.is_set() and not self.running and self._ready is None:
            self._wanted.clear()
            ids = request_log.snapshot()
            self._thread = threading.Thread(target=self._build, args=(ids,), daemon=True,
                                            name="feature-replacement")
            self._thread.start()
        with self._lock:
            layout, error, self._ready, self._error = self._ready, self._error, None, None
        if error is not None:
            log.error("feature re-placement failed (still serving the old one): %s: %s",
                      type(error).__name__, error)
        if layout is None:
            return
        with paused(), torch.cuda.stream(stream) if stream is not None \
                else contextlib.nullcontext():
            self.store.commit(layout)  # no exact-table chunk reads the store meanwhile
        self.done += 1
        log.info("feature re-placement %d committed: %d rows on the GPU", self.done,
                 layout.placement.num_gpu_rows)

    def _build(self, ids: Any) -> None:
        t0 = time.perf_counter()
        try:
            logged = ids if len(ids) >= MIN_LOGGED_IDS else None
            if logged is None:
                log.info("request log holds %d ids (< %d): re-placing from uniform seeds",
                         len(ids), MIN_LOGGED_IDS)
            graph = self.graph  # read once: the engine thread may assign a newer one
            layout = self.store.build(plan_for(self.cfg, graph, self.store, logged))
        except Exception as exc:  # noqa: BLE001 - reported by poll(); serving goes on
            with self._lock:
                self._error = exc
            return
        log.info("feature re-placement built in %.2f s from %d logged ids",
                 time.perf_counter() - t0, len(ids))
        with self._lock:
            self._ready = layout

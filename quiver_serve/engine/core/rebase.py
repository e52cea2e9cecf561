"""Moving a running engine core onto a compacted base, without pausing it (docs/architecture.md,
"The living graph").

When the writer has written a new base (``GraphState`` slot ``NEWEST_BASE``), :class:`Rebase`
builds beside the serving state, in a thread: the base's CSC over the files' read-only mappings,
new samplers over it (the GPU sampler's copies and adjacency cache on a side stream), and a new
overlay with the log's records after the base replayed up to the version the core serves. At a
step boundary ``GraphSync`` catches the new overlay up to that version (a few records) and swaps
samplers and overlay in one assignment each (``GraphSync``); the old ones are freed with their last batch.
Feature rows, GCN degrees and PSGS entries are already at that version and stay as they are.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from quiver_serve.config import ServeConfig
from quiver_serve.graph import living
from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.living import Capacities
from quiver_serve.graph.overlay import Overlay
from quiver_serve.graph.records import EdgeRecord, NodeRecord, Record
from quiver_serve.graph.update_log import LogFollower, load_base
from quiver_serve.sampling import make_cpu_sampler
from quiver_serve.sampling.base import BaseSampler

log = logging.getLogger(__name__)

#: records left for the switch to apply in the engine loop (the rest are applied beside it)
SWITCH_LAG_RECORDS = 2
#: longest time the new overlay chases the serving version before the switch takes the rest
KEEP_UP_S = 30.0


def apply_structure(overlay: Overlay, record: Record) -> None:
    """The part of a record that changes the graph's structure (edges, node count)."""
    if isinstance(record, EdgeRecord):
        overlay.apply_record(record)
    elif isinstance(record, NodeRecord):
        overlay.add_nodes(int(record.features.shape[0]))


class Rebase:
    """One engine core's next base, built in a thread; see the module docstring."""

    def __init__(self, cfg: ServeConfig, log_dir: Path, caps: Capacities,
                 serving_version: Callable[[], int], device: torch.device, gpu: bool) -> None:
        self.cfg, self.log_dir, self.caps = cfg, log_dir, caps
        #: the version the core serves now (the new overlay catches up to it beside the loop)
        self.serving_version = serving_version
        self.device, self.gpu = device, gpu
        self.version = 0  # the base's, then the overlay's
        self.base_version = 0
        self.graph: GraphData | None = None
        self.overlay: Overlay | None = None
        self.follower: LogFollower | None = None
        self.local: BaseSampler | None = None
        self.gpu_sampler: BaseSampler | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="quiver-rebase", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            self._build()
            self._keep_up()
        except BaseException as exc:  # noqa: BLE001 - reported at the switch; serving goes on
            self.error = exc
        self.seconds = time.perf_counter() - t0
        self.done.set()

    def _build(self) -> None:
        found = load_base(self.log_dir)
        if found is None:
            raise RuntimeError(f"no compacted base in {self.log_dir}")
        version, arrays, meta = found
        # A GPU sampler pins (UVA) or copies the CSC: it needs the arrays in private memory,
        # not a read-only file mapping (which cannot be pinned).
        graph = living.graph_from_arrays(arrays, meta, with_x=False, copy=self.gpu)
        self.graph, self.base_version = graph, version
        self.overlay = Overlay(graph.indptr, graph.indices, self.caps.node_capacity,
                               self.caps.edge_capacity, version)
        self.version = version
        self.follower = LogFollower(self.log_dir, version)
        self.local = make_cpu_sampler(graph.indptr, graph.indices, self.cfg.sampling.implementation)
        if self.gpu:
            from quiver_serve.engine.core.samplers import gpu_sampler_or_none

            side = torch.cuda.Stream(self.device)
            with torch.cuda.stream(side):
                self.gpu_sampler = gpu_sampler_or_none(self.cfg, graph, self.device)
            side.synchronize()
            if self.gpu_sampler is None:  # the old one reads the old base: do not switch
                raise RuntimeError("the GPU sampler could not be built over the new base")

    def _keep_up(self) -> None:
        """Catch the new overlay up to the serving version, beside the loop, until at most
        ``SWITCH_LAG_RECORDS`` are left for the switch (which applies them in the loop)."""
        deadline = time.monotonic() + KEEP_UP_S
        while time.monotonic() < deadline:
            target = self.serving_version()
            if target - self.version <= SWITCH_LAG_RECORDS:
                return
            self.catch_up(target)

    def catch_up(self, version: int) -> None:
        """Apply the log's records to the new overlay up to ``version`` (the serving version)."""
        assert self.follower is not None and self.overlay is not None
        while self.version < version:
            records = self.follower.poll(version - self.version)
            if not records:
                raise RuntimeError(f"update log ends at version {self.version}, before "
                                   f"{version}")
            for record in records:
                apply_structure(self.overlay, record)
                self.version = record.version


__all__ = ["Rebase", "apply_structure"]

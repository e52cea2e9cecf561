"""A typed engine core following the update log (docs/architecture.md, "Typed graphs";
docs/decisions/0048-typed-updates.md).

The engine core's ``TypedGraph`` is changed in place (``graph/typed_living.py``), so its
samplers (reference and C++) and its model read the updated relations, counts and feature rows
at the next batch. Records are read at the start of a step: at least one per step, more while
``graph.apply_budget_ms`` lasts when requests wait, every one read when idle; the version
applied and its staleness are published in the shared ``GraphState``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from quiver_serve.graph.living import LiveGraphArgs
from quiver_serve.graph.log_reader import LogFollower
from quiver_serve.graph.state import GraphState
from quiver_serve.graph.typed_living import TypedLiveGraph

log = logging.getLogger(__name__)

#: records read from the log per poll
POLL_RECORDS = 64


class TypedSync:
    """Applies the log's records to one engine core's typed graph; see the module docstring."""

    def __init__(self, live: LiveGraphArgs, graph: TypedLiveGraph, index: int = 0) -> None:
        self.live, self.index = graph, index
        self.follower = LogFollower(Path(live.log_dir), live.base_version)
        self.state = GraphState(live.state)
        self.version = live.base_version
        self.last_apply_s = 0.0
        self._pending: list = []

    def behind(self) -> bool:
        """Updates are acknowledged that this core has not applied."""
        return self.state.acked > self.version

    def catch_up(self) -> int:
        """Apply every record in the log (start-up, before the model and table are built)."""
        count = 0
        while records := self.follower.poll(4096):
            for record in records:
                self.live.apply(record)  # type: ignore[arg-type]
                self.version = record.version
            count += len(records)
        self.publish(0.0)
        return count

    def step(self, budget_s: float) -> int:
        """Apply at least one new record, more while ``budget_s`` lasts; how many."""
        t0 = time.perf_counter()
        count = 0
        staleness_s = 0.0
        while True:
            if not self._pending:
                self._pending = self.follower.poll(POLL_RECORDS)
                if not self._pending:
                    break
            record = self._pending.pop(0)
            self.live.apply(record)
            self.version = record.version
            staleness_s = max(0.0, time.time() - record.accepted_s)
            count += 1
            if time.perf_counter() - t0 >= budget_s:
                break
        if count:
            self.last_apply_s = time.perf_counter() - t0
            self.publish(staleness_s)
        return count

    def publish(self, staleness_s: float) -> None:
        self.state.publish_engine(self.index, self.version, staleness_s)
        self.state.set_reader_base("engine", self.index, 0)

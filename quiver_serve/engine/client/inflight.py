"""What an engine client holds: each admitted request, and each micro-batch in flight.

Both live only in the client's process; past it a request is a position in a micro-batch.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from quiver_serve.wire import InductiveNodes


class Admitted:
    """One admitted request, alive only in this process. ``rows``: the rows its answer has
    (its ids, then its inductive nodes)."""

    __slots__ = ("request_id", "ids", "exact", "seed", "deadline_s", "future", "loop", "done",
                 "arrived_s", "min_version", "inductive", "rows", "model", "version")

    def __init__(self, request_id: str, ids: np.ndarray, exact: bool, seed: int | None,
                 deadline_s: float, future: Any, loop: asyncio.AbstractEventLoop | None,
                 min_version: int = 0, inductive: InductiveNodes | None = None,
                 model: str = "", version: int = 0) -> None:
        self.request_id, self.ids, self.exact, self.seed = request_id, ids, exact, seed
        self.model, self.version = model, version
        self.deadline_s, self.future, self.loop = deadline_s, future, loop
        self.min_version, self.inductive = min_version, inductive
        self.rows = int(ids.size) + (inductive.count if inductive is not None else 0)
        self.done = False
        self.arrived_s = time.monotonic()

    @property
    def alone(self) -> bool:
        """Travels in a micro-batch of its own (a seeded sample; inductive frames)."""
        return self.seed is not None or self.inductive is not None


@dataclass
class Flight:
    """A micro-batch sent to an engine core and not yet answered."""

    engine: int
    requests: list[Admitted]
    frames: list[Any]
    num_rows: int  # answer rows: its ids and inductive nodes (the load it puts on the engine)
    attempts: int = 1
    sent_s: float = field(default_factory=time.monotonic)
    sent_wall_s: float = field(default_factory=time.time)  # the same, comparable across processes

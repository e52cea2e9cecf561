"""GraphState: the living graph's counters in one small shared-memory array.

The writer publishes what it acknowledged (version, node and edge counts, overlay use, the last
compaction); each engine core publishes the version it serves and its last staleness. Front-ends
and the engine cores read it without a message: one float64 slot per value (exact for integers
below 2**53), written by one owner each, read with at most one version of lag.
"""

from __future__ import annotations

import time
from typing import Any

import torch

#: slots written by the writer
ACKED, NUM_NODES, NUM_EDGES, ENTRIES_USED, ENTRIES_CAP, NODE_CAP = 0, 1, 2, 3, 4, 5
ACKED_AT_S, BASE_VERSION, COMPACTIONS, COMPACT_VERSION, COMPACT_AT_S, COMPACT_S = 6, 7, 8, 9, 10, 11
COMPACT_WANTED, NEWEST_BASE = 12, 13
#: engine i's slots: version served, staleness of its last applied version, when it applied it,
#: the base version it samples over
ENGINE_BASE, ENGINE_SLOTS = 16, 4
MAX_ENGINES = 64
#: CPU sampler j's slots: the base version it samples over, the version it applied
SAMPLER_BASE, SAMPLER_SLOTS = ENGINE_BASE + ENGINE_SLOTS * MAX_ENGINES, 2
MAX_SAMPLERS = 256
#: engine i's exact table (docs/architecture.md, "The exact table"): present (1), the version its
#: rows are exact for, stale rows, the staleness of its last refresh round
TABLE_BASE, TABLE_SLOTS = SAMPLER_BASE + SAMPLER_SLOTS * MAX_SAMPLERS, 4


class GraphState:
    """Shared counters (see module docstring); pass ``tensor`` to spawned children."""

    def __init__(self, tensor: torch.Tensor | None = None) -> None:
        if tensor is None:
            tensor = torch.zeros(TABLE_BASE + TABLE_SLOTS * MAX_ENGINES, dtype=torch.float64)
            tensor.share_memory_()
        self.tensor = tensor
        self._a = tensor.numpy()

    def get(self, slot: int) -> int:
        return int(self._a[slot])

    def set(self, slot: int, value: float) -> None:
        self._a[slot] = value

    @property
    def acked(self) -> int:
        return int(self._a[ACKED])

    @property
    def num_nodes(self) -> int:
        return int(self._a[NUM_NODES])

    def publish_engine(self, index: int, version: int, staleness_s: float) -> None:
        at = ENGINE_BASE + ENGINE_SLOTS * index
        self._a[at + 1] = staleness_s
        self._a[at + 2] = time.time()
        self._a[at] = version  # last: a reader that sees the version sees its staleness

    def publish_table(self, index: int, version: int, stale_rows: int, staleness_s: float) -> None:
        at = TABLE_BASE + TABLE_SLOTS * index
        self._a[at + 1:at + 4] = (version, stale_rows, staleness_s)
        self._a[at] = 1.0

    def table(self, index: int) -> dict[str, Any] | None:
        """Engine ``index``'s exact table as it last published it; None without one."""
        at = TABLE_BASE + TABLE_SLOTS * index
        if not self._a[at]:
            return None
        return {"version": int(self._a[at + 1]), "stale_rows": int(self._a[at + 2]),
                "last_round_staleness_s": round(float(self._a[at + 3]), 6)}

    def engine_version(self, index: int) -> int:
        return int(self._a[ENGINE_BASE + ENGINE_SLOTS * index])

    def set_reader_base(self, role: str, index: int, base_version: int) -> None:
        """The base a reader (``engine`` or ``sampler``) samples over now."""
        self._a[self._base_slot(role, index)] = base_version

    def reader_base(self, role: str, index: int) -> int:
        return int(self._a[self._base_slot(role, index)])

    def set_sampler_version(self, index: int, version: int) -> None:
        self._a[SAMPLER_BASE + SAMPLER_SLOTS * index + 1] = version

    def reader_version(self, role: str, index: int) -> int:
        """The version a reader (``engine`` or ``sampler``) has applied."""
        if role == "engine":
            return self.engine_version(index)
        return int(self._a[SAMPLER_BASE + SAMPLER_SLOTS * index + 1])

    @staticmethod
    def _base_slot(role: str, index: int) -> int:
        if role == "engine":
            return ENGINE_BASE + ENGINE_SLOTS * index + 3
        return SAMPLER_BASE + SAMPLER_SLOTS * index

    def record_compaction(self, version: int, seconds: float) -> None:
        """A compaction wrote the base of ``version`` in ``seconds``."""
        self.set(COMPACTIONS, self.get(COMPACTIONS) + 1)
        self.set(COMPACT_VERSION, version)
        self.set(COMPACT_AT_S, time.time())
        self.set(COMPACT_S, seconds)
        self.set(COMPACT_WANTED, 0)

    def last_compaction(self) -> dict[str, Any] | None:
        """``GET /v1/graph``'s ``last_compaction`` (None before the first)."""
        if not self.get(COMPACTIONS):
            return None
        return {"version": self.get(COMPACT_VERSION), "at_s": float(self._a[COMPACT_AT_S]),
                "duration_s": float(self._a[COMPACT_S]), "count": self.get(COMPACTIONS)}

    def want_compaction(self, explicit: bool) -> None:
        """Ask the background compactor: by fill (at most one per its minimum gap) or, when
        ``explicit`` (an operator's call), at its next check."""
        self.set(COMPACT_WANTED, max(self.get(COMPACT_WANTED), 2 if explicit else 1))

    def engines(self, count: int) -> list[dict[str, Any]]:
        """Per engine core: version visible there, and its staleness now (0 when current)."""
        now, acked = time.time(), self._a[ACKED]
        rows = []
        for i in range(min(count, MAX_ENGINES)):
            at = ENGINE_BASE + ENGINE_SLOTS * i
            version = int(self._a[at])
            behind = version < acked
            stale_s = max(0.0, now - float(self._a[ACKED_AT_S])) if behind else 0.0
            rows.append({"engine": i, "version": version, "staleness_s": round(stale_s, 6),
                         "last_apply_staleness_s": round(float(self._a[at + 1]), 6),
                         "exact_table": self.table(i)})
        return rows


def readers_reach(reader_versions: Any, version: int, wait_s: float) -> bool:
    """Wait (``wait_s`` at most) until every reader (``reader_versions()``: the version each
    live process that applies the log has applied) reached ``version``: the log a reader has
    not read must stay until then."""
    deadline = time.monotonic() + wait_s
    while any(v < version for v in reader_versions()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True

"""Compaction of a partition's log (decision 0063; docs/architecture.md, "The living graph across
partitions").

A partition's primary (replica 0) folds its overlay, the rows written since its base and the
book's growth into a new base in its log folder once the overlay or its node headroom is
``graph.compact_at_fill`` used, or on ``POST /v1/graph/compact``. The base is the daemon's
(``UpdateLog.write_base``: crash-safe, each array keyed by content hash, memory-mapped when read),
so a restarted server maps it and replays only the records after it. The fold reads a frozen copy
of the overlay (``Overlay.freeze``) beside the event loop, so updates and requests go on meanwhile.
The server then moves to the new base (``PartitionServer._move``): a fresh overlay over it with
the records logged since the fold, the lists and own rows placed again, swapped in at once on the
loop. A follower replica moves when its primary's folder names a newer base (looked at once a
second at most) or at once when its overlay cannot take the next record.

The lists the overlay changed are sorted by id in the base, as the daemon's compaction sorts them:
after a compaction, seeded answers equal those of a single-machine daemon that compacted too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from quiver_serve.graph.log_reader import BASE_RE, UpdateLogError, load_base, read_current
from quiver_serve.graph.overlay import Overlay
from quiver_serve.graph.writer import sort_lists
from quiver_serve.partition.book import PartitionBook
from quiver_serve.partition.data import PartitionData, load_book

log = logging.getLogger(__name__)

#: what a partition base's meta names as its kind
BASE_KIND = "quiver-serve partition base"
#: how often a follower replica looks at its primary's folder for a newer base, in seconds
BASE_CHECK_S = 1.0


@dataclass(frozen=True)
class ServingBase:
    """What a partition server serves from: its snapshot (version 0) or its log's newest base.
    Arrays are memory-mapped read-only."""

    version: int
    indptr: np.ndarray  # int64 [owned + 1]
    indices: np.ndarray  # int64 [edges]: source GLOBAL ids
    features: np.ndarray  # [owned, F], the partition's storage dtype
    #: the book's growth up to ``version``, ``(first id, count, owner)`` per call
    entries: tuple[tuple[int, int, int], ...]


def base_in_force(folder: Path) -> int:
    """The version of the base ``folder``'s ``CURRENT`` names (0: none, the snapshot)."""
    name = read_current(Path(folder)) if Path(folder).is_dir() else None
    match = BASE_RE.fullmatch(name) if name is not None else None
    return int(match.group(1)) if match else 0


def serving_base(folder: Path, data: PartitionData) -> ServingBase:
    """The newest base in partition ``data.part``'s log ``folder``, else its snapshot
    ``data``. A base of another partition or partitioning is an error naming the folder."""
    found = load_base(Path(folder)) if Path(folder).is_dir() else None
    if found is None:
        return ServingBase(0, data.indptr, data.indices, data.features, ())
    version, arrays, meta = found
    want = {"kind": BASE_KIND, "part": data.part, "num_parts": data.book.num_parts}
    if {k: meta.get(k) for k in want} != want or arrays["x"].shape[1:] != data.features.shape[1:]:
        raise UpdateLogError(f"{folder}: its base is not one of partition {data.part} of "
                             f"{data.book.num_parts} with {data.features.shape[1]} features "
                             f"(meta: {meta}); was the graph partitioned again? Move the folder")
    entries = tuple((int(a), int(b), int(c)) for a, b, c in arrays["book_entries"].tolist())
    return ServingBase(version, arrays["indptr"], arrays["indices"], arrays["x"], entries)


def grown_book(data_dir: Path, entries: tuple[tuple[int, int, int], ...]) -> PartitionBook:
    """The partitioning's book with ``entries`` (a base's growth) entered again, in order."""
    book = load_book(Path(data_dir))
    for first, count, owner in entries:
        if first != book.num_nodes:
            raise UpdateLogError(f"{data_dir}: a base adds nodes from {first}, the book has "
                                 f"{book.num_nodes}")
        book.add_nodes(count, owner)
    return book


def fold(frozen: Overlay, own_x: np.ndarray, written: dict[int, np.ndarray],
         entries: list[list[int]], id_bound: int) -> dict[str, np.ndarray]:
    """A partition's new base arrays: its lists now (changed ones sorted by id; sources are
    global ids below ``id_bound``), its own rows with the written ones (rows of nodes added
    since the base, past ``own_x``, are among them) and the book's growth."""
    indptr_t, indices_t = frozen.to_csc()
    indptr, indices = indptr_t.numpy(), indices_t.numpy().copy()
    sort_lists(indptr, indices, frozen.changed_nodes(), id_bound=id_bound)
    n = indptr.size - 1
    x = np.zeros((n, *own_x.shape[1:]), own_x.dtype)
    x[:own_x.shape[0]] = own_x
    for row, values in written.items():
        x[row] = values
    return {"indptr": indptr, "indices": indices, "x": x,
            "book_entries": np.asarray(entries, np.int64).reshape(-1, 3)}


def base_meta(part: int, num_parts: int, version: int) -> dict[str, object]:
    return {"kind": BASE_KIND, "part": part, "num_parts": num_parts, "version": version}


@dataclass
class Moves:
    """One server's compactions and moves to a new base: at most one runs at a time (a task on
    the server's event loop); what ``info`` shows of them."""

    running: asyncio.Future[Any] | None = None
    #: when a follower last looked for a newer base (``time.monotonic``)
    checked_s: float = 0.0
    #: a follower's periodic check (``PartitionServer._tick``)
    ticker: asyncio.Future[Any] | None = None
    compactions: int = 0
    moves: int = 0
    failures: int = 0
    last_compaction_s: float = 0.0

    def start(self, work: Coroutine[Any, Any, Any]) -> asyncio.Future[Any]:
        fut = asyncio.ensure_future(work)
        self.running = fut
        fut.add_done_callback(self._done)
        return fut

    def _done(self, fut: asyncio.Future[Any]) -> None:
        self.running = None
        if not fut.cancelled() and fut.exception() is not None:
            self.failures += 1
            log.error("partition compaction or move failed (the server serves on from its "
                      "current base; the next update or check tries again)",
                      exc_info=fut.exception())

    def snapshot(self) -> dict[str, Any]:
        return {"compactions": self.compactions, "moves": self.moves, "failures": self.failures,
                "last_compaction_s": round(self.last_compaction_s, 3),
                "running": self.running is not None}

"""One partition's living graph: the updates its partition server owns, durable in its own log.

A partition holds the in-edge lists of the nodes it owns (rows: local, sources: GLOBAL ids), so an
edge ``u -> v`` belongs to ``v``'s owner and a feature row to its node's owner
(docs/architecture.md, "The living graph across partitions"). Each partition server keeps an
:class:`~quiver_serve.graph.overlay.Overlay` over its CSC, indexed like the CSC (local rows,
global source ids: the overlay never reads a source id, it only stores it), the feature rows
written since the snapshot, and an :class:`~quiver_serve.graph.update_log.UpdateLog` of its
own. As in the daemon's ``GraphWriter``: an update is checked, planned against the overlay (a
call that does not fit is refused with nothing written), appended to the log and synced per
``graph.fsync``, then applied; the version it answers is durable. Records are logged in the
partition's coordinates (edges as ``(global src, local dst)``, feature rows by local row), so a
restarted server replays its log over its snapshot without the book.

New nodes (decision 0052): a ``BookNodesRecord`` enters a call's nodes in the partition book
(global ids, owner) in every partition's log, with their rows in the owner's; a server's book
grows as it applies its log. Replicas (decision 0053): replica 0 writes the log, the others
follow it in the same folder (``follow=True``) and ``catch_up`` before each read they answer.

Replicated hot rows: a partition also maps copies of other partitions' hot rows. A feature write
first makes every holder drop its copy of the written ids (durable in the holder's
``hot_dropped.npy``), then reaches the owner: a holder reads those rows from their owner from
then on, so no copy is ever staler than the owner's acknowledged row.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from quiver_serve import errors
from quiver_serve.config import GraphConfig
from quiver_serve.graph import living
from quiver_serve.graph.base_files import fsync_dir
from quiver_serve.graph.log_reader import LogCompactedError
from quiver_serve.graph.overlay import Overlay, OverlayFull
from quiver_serve.graph.overlay_view import OverlayView
from quiver_serve.graph.records import BookNodesRecord, EdgeRecord, FeatureRecord, Record
from quiver_serve.graph.update_log import LogFollower, UpdateLog, UpdateLogError
from quiver_serve.partition.book import PartitionBook
from quiver_serve.scaleout.partitioned.sampling import as_tensor

#: the file a holder keeps the global ids of the hot copies it dropped in (int64 .npy)
HOT_DROPPED = "hot_dropped.npy"


def partition_full(part: int, detail: str) -> errors.ServeError:
    """A partition's overlay or node headroom is used up until the compaction that the update
    started folds it into a new base (``compaction.py``): 503 with Retry-After; nothing was
    written."""
    return living.overlay_full(f"partition {part}: {detail}", 1)


@dataclass(frozen=True)
class LiveBase:
    """The base a :class:`PartitionLive` starts over: the partition's snapshot (version 0, no
    growth of the book) or a base its log holds (``compaction.py``)."""

    version: int = 0
    #: the book's growth up to ``version``, ``[first id, count, owner]`` per call
    entries: tuple[tuple[int, int, int], ...] = ()
    #: a primary moving to a new base passes its open log (nothing is replayed at start)
    log: UpdateLog | None = None


def log_folder(data_dir: Path, configured: str | None, part: int) -> Path:
    """Partition ``part``'s update-log folder: ``<graph.update_log_dir>/part-<p>`` when set,
    else ``<data_dir>/updates/part-<p>`` beside the partitions."""
    root = Path(configured).expanduser() if configured else Path(data_dir) / "updates"
    return root / f"part-{part}"


class PartitionLive:
    """The overlay, the written rows, the grown book and the update log of one partition (module
    docstring). The partition's primary (replica 0) writes the log; another replica follows it
    (``follow=True``: ``catch_up`` applies what the primary logged since). Not thread-safe: the
    partition server calls it from its event loop only."""

    def __init__(self, directory: Path, gcfg: GraphConfig, part: int, book: PartitionBook,
                 indptr: torch.Tensor, indices: torch.Tensor, num_features: int,
                 follow: bool = False, base: LiveBase | None = None) -> None:
        self.directory, self.cfg, self.part = Path(directory), gcfg, part
        self.book, self.num_features = book, num_features
        self.owner, self.local = as_tensor(book.owner), as_tensor(book.local)
        base = base or LiveBase()
        n_local, edges = int(indptr.numel() - 1), int(indices.numel())
        caps = living.capacities(gcfg, n_local, edges)
        self.overlay = Overlay(indptr, indices, caps.node_capacity, caps.edge_capacity,
                               base.version)
        self.rows_written: dict[int, np.ndarray] = {}  # local row -> float32 [F]
        #: the book's growth since the snapshot: ``[first id, count, owner]`` per call, id order
        self.entries: list[list[int]] = [list(e) for e in base.entries]
        self._index: tuple[torch.Tensor, torch.Tensor] | None = None  # ``written``'s
        #: edges added since the base, (global source, local row) each: the exact table's
        #: out-edges past its base index (``table.py``)
        self._added: list[np.ndarray] = []
        #: records a follower read but could not apply (its overlay full): applied first next
        #: time, or dropped by a move to a newer base (``compaction.py``)
        self._pending: list[Record] = []
        self._behind_base = False  # the next records were compacted away before it read them
        self.log: UpdateLog | None = None
        self.follower: LogFollower | None = None
        #: the version of the base under the overlay: 0 is the partition's snapshot, a larger
        #: one a base its log holds (``compaction.py``)
        self.base_version = self.version = base.version
        if follow:
            self.follower = LogFollower(self.directory, base.version)
        elif base.log is not None:  # a primary moving to a new base: its log, replayed later
            self.log = base.log
        else:
            self.log = UpdateLog(self.directory, gcfg.fsync, gcfg.group_commit_ms)
            self.log.open()
        self.replayed = self.catch_up() if follow else 0 if base.log is not None \
            else self.replay_until(None)

    def replay_until(self, version: int | None) -> int:
        """A primary: apply its log's records after this overlay's version, up to ``version``
        (None: all); how many."""
        assert self.log is not None
        count = 0
        for record in self.log.records_after(self.version):
            if version is not None and record.version > version:
                break
            self._apply(record)
            count += 1
        return count

    def catch_up(self) -> int:
        """A follower: apply every record the primary logged since the last call (one
        ``fstat`` when there is none); how many. A record that does not fit the overlay stops
        it (``stalled``): the follower needs the newer base its primary wrote."""
        if self.follower is None:
            return 0
        try:
            records = self._pending + self.follower.poll()
        except LogCompactedError:  # what comes next was folded into a base: a move reads it
            self._behind_base = True
            return 0
        for i, record in enumerate(records):
            try:
                self._apply(record)
            except OverlayFull:
                self._pending = records[i:]
                return i
        self._pending = []
        return len(records)

    @property
    def stalled(self) -> bool:
        """A follower whose overlay cannot take the next record, or whose next records were
        folded into a base before it read them: a move to the newer base takes them."""
        return bool(self._pending) or self._behind_base

    def wants_compaction(self) -> bool:
        """A primary whose overlay or node headroom is ``graph.compact_at_fill`` used."""
        ov, fill = self.overlay, self.cfg.compact_at_fill
        nodes_room = ov.node_capacity - ov.n_base
        return self.log is not None and (
            ov.top >= fill * ov.edge_capacity
            or (nodes_room > 0 and ov.num_nodes - ov.n_base >= fill * nodes_room))

    def _apply(self, record: Record) -> None:
        if isinstance(record, EdgeRecord):
            self.overlay.apply_record(record)
            self._note_added(record.add)
        elif isinstance(record, FeatureRecord):
            self._remember(record.node_ids, record.features)
        elif isinstance(record, BookNodesRecord):
            self._grow(record)
        self.version = record.version

    def _grow(self, record: BookNodesRecord) -> None:
        """Enter ``record``'s nodes in the book (and, at their owner, in the overlay with their
        rows)."""
        if record.first_id != self.book.num_nodes:
            raise UpdateLogError(f"{self.directory}: version {record.version} adds node "
                                 f"{record.first_id}, the book has {self.book.num_nodes} nodes")
        self.book.add_nodes(record.count, record.owner)
        self.entries.append([record.first_id, record.count, record.owner])
        self.owner, self.local = as_tensor(self.book.owner), as_tensor(self.book.local)
        if record.owner == self.part:
            rows_local = self.overlay.add_nodes(record.count)
            self.overlay.ensure_active()  # samplers read new nodes' (empty) lists through it
            self._remember(rows_local, record.features)

    def _note_added(self, add: np.ndarray) -> None:
        if add.size:
            self._added.append(np.asarray(add, np.int64).reshape(-1, 2))

    def added_edges(self) -> np.ndarray:
        """int64 [a, 2]: every edge added since the base, (global source, local row)."""
        if len(self._added) > 1:
            self._added = [np.concatenate(self._added)]
        return self._added[0] if self._added else np.empty((0, 2), np.int64)

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
        if self.follower is not None:
            self.follower.close()

    def view(self) -> OverlayView | None:
        """What the partition's sampler reads (None until an edge or a node changed)."""
        return self.overlay.view()

    def _remember(self, rows_local: np.ndarray, rows: np.ndarray) -> None:
        self._index = None
        for i, row in zip(rows_local.tolist(), rows, strict=True):
            self.rows_written[int(i)] = np.asarray(row, np.float32)

    def _own_rows(self, ids: np.ndarray, field: str) -> np.ndarray:
        """Local rows of global ``ids``, each one owned here; 400 naming the first that is not."""
        living.check_ids(ids, int(self.owner.numel()), field)
        t = torch.from_numpy(ids)
        mine = self.owner[t] == self.part
        if not bool(mine.all()):
            bad = int(t[~mine][0])
            raise errors.ServeError("not_owned", f"{field}: node {bad} is owned by partition "
                                    f"{int(self.owner[bad])}, not {self.part}", 400)
        return self.local[t].numpy()

    def _writer(self) -> UpdateLog:
        if self.log is None:
            raise errors.ServeError("not_primary", f"partition {self.part}: updates go to the "
                                    "partition's replica 0, which writes its log", 400)
        return self.log

    def add_edges(self, add: object, remove: object) -> dict[str, int]:
        """Edges ``src -> dst`` whose ``dst`` this partition owns: added (a repeat is a second
        copy) and removed (every copy); answers the version they are durable in."""
        log = self._writer()
        add_arr, rm_arr = living.as_pairs(add, "add"), living.as_pairs(remove, "remove")
        living.check_count(len(add_arr) + len(rm_arr), self.cfg.max_update_edges, "edges")
        n = int(self.owner.numel())
        living.check_ids(add_arr[:, 0], n, "add")
        living.check_ids(rm_arr[:, 0], n, "remove")
        add_loc = np.stack([add_arr[:, 0], self._own_rows(add_arr[:, 1], "add")], 1)
        rm_loc = np.stack([rm_arr[:, 0], self._own_rows(rm_arr[:, 1], "remove")], 1)
        version = self.version + 1
        record = EdgeRecord(version, time.time(), add_loc.reshape(-1, 2), rm_loc.reshape(-1, 2))
        try:
            result, _ = self.overlay.apply_edges(
                record.add, record.remove, before_commit=lambda _r, _p: log.write(record))
        except OverlayFull as exc:
            raise partition_full(self.part, str(exc).split(";")[0]) from None
        self.version = version
        self._note_added(record.add)
        log.wait_durable(version)
        return {"version": version, "added": result.added, "removed": result.removed,
                "missing": result.missing}

    def put_features(self, node_ids: object, features: object) -> dict[str, int]:
        """Overwrite the rows of global ``node_ids`` this partition owns."""
        log = self._writer()
        ids, rows = living.feature_writes(node_ids, features, self.num_features,
                                          self.cfg.max_update_edges)
        rows_local = self._own_rows(ids, "node_ids")
        version = self.version + 1
        log.write(FeatureRecord(version, time.time(), rows_local, rows))
        self._remember(rows_local, rows)
        self.version = version
        log.wait_durable(version)
        return {"version": version}

    def add_nodes(self, first_id: int, count: int, owner: int,
                  features: object = None) -> dict[str, int]:
        """``count`` new nodes ``first_id, first_id + 1, ...`` owned by ``owner``: at the owner
        ``features`` are their rows and ``first_id`` must be the book's next id; elsewhere (no
        rows) an entry the book already holds alike is acknowledged again (the ingress
        completing a call it could not finish). 409 ``book_conflict`` naming the book's next
        id otherwise."""
        log = self._writer()
        rows = np.empty((0, self.num_features), np.float32)
        if owner == self.part:
            rows = living.as_rows(features, "features", self.num_features)
            living.check_count(len(rows), self.cfg.max_update_edges, "nodes")
            if len(rows) != count:
                raise errors.ServeError("invalid_features", f"{count} new nodes but "
                                        f"{len(rows)} feature rows", 422)
            if self.overlay.num_nodes + count > self.overlay.node_capacity:
                raise partition_full(self.part, f"node capacity {self.overlay.node_capacity} "
                                     "reached")
        if self._holds(first_id, count, owner):
            return {"version": self.version}
        if first_id != self.book.num_nodes:
            raise errors.ServeError("book_conflict", f"partition {self.part}: new nodes from "
                                    f"{first_id}, the book's next id is {self.book.num_nodes}; "
                                    "retry", 409)
        record = BookNodesRecord(self.version + 1, time.time(), [first_id, count, owner], rows)
        log.write(record)
        self._apply(record)
        log.wait_durable(record.version)
        return {"version": record.version}

    def _holds(self, first_id: int, count: int, owner: int) -> bool:
        """Whether the book holds exactly this entry already (never so at its owner: a second
        call there is a second set of nodes)."""
        return owner != self.part and [first_id, count, owner] in self.entries

    def written(self, rows_local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Which of ``rows_local`` were written since the snapshot (bool mask) and their rows
        (float32 [mask.sum(), F]); a sorted index of the written rows, rebuilt after a write."""
        if not self.rows_written:
            return torch.zeros_like(rows_local, dtype=torch.bool), torch.empty(0, self.num_features)
        if self._index is None or self._index[0].numel() != len(self.rows_written):
            keys = np.fromiter(self.rows_written, np.int64, len(self.rows_written))
            keys.sort()
            rows = np.stack([self.rows_written[int(k)] for k in keys])
            self._index = (torch.from_numpy(keys), torch.from_numpy(rows))
        keys_t, rows_t = self._index
        pos = torch.searchsorted(keys_t, rows_local).clamp_(max=keys_t.numel() - 1)
        mask = keys_t[pos] == rows_local
        return mask, rows_t[pos[mask]]


def load_dropped(directory: Path) -> np.ndarray:
    """The hot copies this partition dropped (global ids, int64; empty when none)."""
    path = Path(directory) / HOT_DROPPED
    if not path.exists():
        return np.empty(0, np.int64)
    return np.load(path, allow_pickle=False).astype(np.int64, copy=False)


def save_dropped(directory: Path, ids: np.ndarray) -> None:
    """``ids`` as the dropped hot copies (a temporary file, synced, renamed into place)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / (HOT_DROPPED + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, np.asarray(ids, np.int64))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / HOT_DROPPED)
    fsync_dir(directory)

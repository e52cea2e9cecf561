"""The partition book (docs/architecture.md, "Partitioning"): which partition owns each global node
id, and the node's row within its owner.

Rows within a partition are its owned nodes in increasing global id (``partition_graph``), then
nodes added later (``add_nodes``) in the order they were added, so ``global_ids`` of a partition
is ``flatnonzero(owner == p)`` until nodes are added. Saved as an ``.npz`` of numbers only
(loaded with ``allow_pickle=False``); a loaded book is checked: every owner in range, every
partition's rows exactly ``0..size-1``.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from quiver_serve.graph.base_files import fsync_dir

#: bad ids named in an error, at most
SHOWN_IDS = 8
#: the book's keys in its .npz file
BOOK_KEYS = ("owner", "local", "num_parts", "method")


class PartitionBookError(ValueError):
    """A partition book that cannot be used (its message names the file or the field)."""


@dataclass(frozen=True, eq=False)
class PartitionBook:
    """Global node id <-> (partition, local row). ``owner`` and ``local`` are views of buffers
    that ``add_nodes`` grows (amortised doubling); no other method changes them."""

    owner: np.ndarray  # int32 [num_nodes]: partition of each global id
    local: np.ndarray  # int64 [num_nodes]: row of the node within its owner
    num_parts: int
    method: str  # "metis" | "hash" | "range"
    _sizes: np.ndarray = field(init=False, repr=False)
    _grow_lock: threading.Lock = field(init=False, repr=False)
    #: buffers ``add_nodes`` owns (None until the first growth): owner and local are their heads
    _buffers: tuple[np.ndarray, np.ndarray] | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        owner = np.ascontiguousarray(self.owner, dtype=np.int32)
        local = np.ascontiguousarray(self.local, dtype=np.int64)
        sizes = check_book(owner, local, self.num_parts)
        object.__setattr__(self, "owner", owner)
        object.__setattr__(self, "local", local)
        object.__setattr__(self, "_sizes", sizes)
        object.__setattr__(self, "_grow_lock", threading.Lock())
        object.__setattr__(self, "_buffers", None)

    @property
    def num_nodes(self) -> int:
        return int(self.owner.shape[0])

    def sizes(self) -> np.ndarray:
        """Nodes owned by each partition (int64 [num_parts]; a copy)."""
        return self._sizes.copy()

    def global_ids(self, part: int) -> np.ndarray:
        """The global ids partition ``part`` owns, in local-row order (int64)."""
        self._check_part(part)
        ids = np.flatnonzero(self.owner == part)
        order = np.argsort(self.local[ids], kind="stable")
        return ids[order].astype(np.int64, copy=False)

    def owners(self, ids: np.ndarray) -> np.ndarray:
        """The partition of every id (int32, one per id); ids outside ``[0, num_nodes)`` raise
        ValueError naming them."""
        ids = self._check_ids(ids)
        return self.owner[ids]

    def locals(self, ids: np.ndarray) -> np.ndarray:
        """The row of every id within its owner (int64, one per id); ids checked as ``owners``."""
        return self.local[self._check_ids(ids)]

    def split(self, ids: np.ndarray) -> list[np.ndarray]:
        """Per partition: the positions into ``ids`` of the ids it owns, in request order
        (int64 arrays; a partition owning none of them gets an empty one)."""
        owner = self.owners(ids)
        order = np.argsort(owner, kind="stable")
        bounds = np.cumsum(np.bincount(owner, minlength=self.num_parts))[:-1]
        return np.split(order.astype(np.int64, copy=False), bounds)

    def add_nodes(self, count: int, part: int) -> np.ndarray:
        """``count`` new global ids (after every existing one), owned by ``part`` at its next
        free rows; returns them (int64). Thread-safe against other ``add_nodes`` calls."""
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
            raise ValueError(f"count must be an integer >= 0, got {count!r}")
        self._check_part(part)
        with self._grow_lock:
            start = self.num_nodes
            bufs = self._buffers
            if bufs is None or bufs[0].shape[0] < start + count:
                capacity = max(start + count, 2 * start, 1024)
                bufs = (np.empty(capacity, np.int32), np.empty(capacity, np.int64))
                bufs[0][:start], bufs[1][:start] = self.owner, self.local
                object.__setattr__(self, "_buffers", bufs)
            owner, local = bufs[0][:start + count], bufs[1][:start + count]
            owner[start:] = part
            local[start:] = self._sizes[part] + np.arange(count, dtype=np.int64)
            self._sizes[part] += count
            object.__setattr__(self, "owner", owner)
            object.__setattr__(self, "local", local)
        return np.arange(start, start + count, dtype=np.int64)

    def save(self, path: Path) -> None:
        """The book as ``path`` (.npz, numbers and one string; written to a temporary file,
        synced, renamed into place, the folder synced)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.savez(f, owner=self.owner, local=self.local,
                     num_parts=np.int64(self.num_parts), method=np.str_(self.method))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)

    @classmethod
    def load(cls, path: Path) -> PartitionBook:
        """A book ``save`` wrote; a missing key, a wrong dtype or an inconsistent book raises
        :class:`PartitionBookError` naming the file."""
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as archive:
                missing = [k for k in BOOK_KEYS if k not in archive.files]
                if missing:
                    raise PartitionBookError(f"{path}: not a partition book (no {missing})")
                owner, local = archive["owner"], archive["local"]
                num_parts, method = int(archive["num_parts"]), str(archive["method"])
        except (OSError, ValueError) as exc:
            if isinstance(exc, PartitionBookError):
                raise
            raise PartitionBookError(f"{path}: cannot read the partition book: {exc}") from exc
        for key, arr in (("owner", owner), ("local", local)):
            if arr.ndim != 1 or arr.dtype.kind not in "iu":
                raise PartitionBookError(f"{path}: {key} must be a 1-D integer array, got "
                                         f"{arr.dtype}{list(arr.shape)}")
        try:
            return cls(owner=owner, local=local, num_parts=num_parts, method=method)
        except ValueError as exc:
            raise PartitionBookError(f"{path}: {exc}") from exc

    def _check_part(self, part: int) -> None:
        if isinstance(part, bool) or not isinstance(part, (int, np.integer)) or \
                not 0 <= part < self.num_parts:
            raise ValueError(f"partition {part!r} is not in [0, {self.num_parts})")

    def _check_ids(self, ids: np.ndarray) -> np.ndarray:
        arr = np.asarray(ids)
        if arr.dtype.kind not in "iu":
            raise ValueError(f"node ids must be integers, got dtype {arr.dtype}")
        arr = arr.reshape(-1).astype(np.int64, copy=False)
        bad = (arr < 0) | (arr >= self.num_nodes)
        if bad.any():
            shown = arr[bad][:SHOWN_IDS].tolist()
            raise ValueError(f"node ids {shown}{' ...' if bad.sum() > SHOWN_IDS else ''} are not "
                             f"in [0, {self.num_nodes}) ({int(bad.sum())} of {arr.size})")
        return arr


def check_book(owner: np.ndarray, local: np.ndarray, num_parts: int) -> np.ndarray:
    """Nodes per partition (int64) of a consistent book; ValueError naming what is wrong."""
    if isinstance(num_parts, bool) or not isinstance(num_parts, (int, np.integer)) or num_parts < 1:
        raise ValueError(f"num_parts must be an integer >= 1, got {num_parts!r}")
    if owner.ndim != 1 or local.shape != owner.shape:
        raise ValueError(f"owner and local must be 1-D of one length, got {list(owner.shape)} "
                         f"and {list(local.shape)}")
    if owner.size and (owner.min() < 0 or owner.max() >= num_parts):
        raise ValueError(f"owner holds partitions outside [0, {num_parts})")
    sizes = np.bincount(owner, minlength=num_parts).astype(np.int64)
    if owner.size:
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        if local.min() < 0 or (local >= sizes[owner]).any():
            raise ValueError("local rows must be in [0, size of their partition)")
        seen = np.bincount(offsets[owner] + local, minlength=owner.size)
        if (seen != 1).any():
            raise ValueError("two nodes share a (partition, local row)")
    return sizes


"""The write-ahead log and base snapshots of the living graph (docs/architecture.md, "The living
graph").

One directory per graph (``default_log_dir``) holds::

    LOCK                          flock'ed by the one writer (its pid inside, for the error text)
    CURRENT                       the name of the base in force, e.g. "base-00000000000000000042"
    base-<version:020d>/          one .npy per array (no pickle) + meta.json: the graph at version
    updates-<first:020d>.log      segments: records (graph/records.py) from version ``first`` on

The graph at the log's last version is the base at ``CURRENT`` plus every record above the base's
version, in order. Records are contiguous: each segment's records run ``first, first + 1, ...``;
every segment but the last ends with a seal naming the next one's first version.

Crash safety (kill -9 of any process at any instant; a machine crash too with fsync "always"):
an append is acknowledged only after its bytes are written (and synced per the policy), so a crash
leaves at most one torn record, at the end of the last segment, never acknowledged; ``open``
truncates it. ``write_base`` makes the new base durable and then switches ``CURRENT`` by an atomic
rename before it deletes anything, so a crash at any step leaves either the old base or the new one
in force, with every record above it still in the segments.

Fault injection: ``_crash_point(name)`` is called at each step of ``write_base`` and ``append``;
it does nothing unless a test sets ``_crash_hook`` (the hook raises to simulate death there).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import numpy as np

from quiver_serve import envs
from quiver_serve.graph.base_files import fsync_dir, write_base_dir, write_synced
from quiver_serve.graph.log_reader import (
    BASE_RE,
    META_NAME,
    LogCompactedError,
    LogFollower,
    LogLockedError,
    UpdateLogError,
    list_segments,
    load_base,
    read_current,
    read_records,
    scan_segment,
    segment_path,
)
from quiver_serve.graph.records import (
    BookNodesRecord,
    EdgeRecord,
    FeatureRecord,
    NodeRecord,
    Record,
    SegmentSeal,
    TypedEdgeRecord,
    TypedFeatureRecord,
    TypedNodeRecord,
    decode,
    encode,
)

__all__ = ["EdgeRecord", "FeatureRecord", "LogCompactedError", "LogFollower", "LogLockedError",
           "NodeRecord", "Record", "UpdateLog", "UpdateLogError", "decode", "default_log_dir",
           "encode", "load_base"]

#: set by tests only: called with each crash point's name (it raises to simulate a crash there)
_crash_hook: Callable[[str], None] | None = None

LOCK_NAME = "LOCK"
CURRENT_NAME = "CURRENT"
_KEY_RE = re.compile(r"[A-Za-z0-9_.-]+")
FsyncPolicy = Literal["always", "group", "none"]


def _crash_point(name: str) -> None:
    if _crash_hook is not None:
        _crash_hook(name)


def default_log_dir(cache_dir: Path | None, graph_key: str) -> Path:
    """``<cache_dir>/updates/<graph_key>``; ``cache_dir`` None means ``$QUIVER_SERVE_CACHE``."""
    if not _KEY_RE.fullmatch(graph_key) or graph_key in (".", ".."):
        raise ValueError(f"graph key {graph_key!r} must be one file name ([A-Za-z0-9_.-]+)")
    root = envs.QUIVER_SERVE_CACHE if cache_dir is None else Path(cache_dir)
    return root / "updates" / graph_key


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:  # a regular file may take a large write in parts
        view = view[os.write(fd, view):]


# ---- base snapshots ---------------------------------------------------------------------------
def _base_name(version: int) -> str:
    return f"base-{version:020d}"


def _point_current(directory: Path, name: str) -> None:
    """``CURRENT`` names ``name``, atomically: a reader sees the old name or the new one."""
    tmp = directory / (CURRENT_NAME + ".tmp")
    write_synced(tmp, (name + "\n").encode())
    _crash_point("current.tmp")
    os.replace(tmp, directory / CURRENT_NAME)
    _crash_point("current.renamed")
    fsync_dir(directory)
    _crash_point("current.synced")


def _take_lock(directory: Path) -> int:
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise LogLockedError(f"update log {directory} is held by another writer (pid {holder}); "
                             f"one daemon per log directory") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _remove_leftovers(directory: Path) -> int | None:
    """Delete what a crash can leave (temp files, base folders ``CURRENT`` does not name) and
    return the version of the base in force."""
    current = read_current(directory)
    if current is not None and not (directory / current / META_NAME).is_file():
        raise UpdateLogError(f"{directory / CURRENT_NAME} names {current}, which is missing")
    removed = False
    for name in os.listdir(directory):
        path = directory / name
        if name.endswith(".tmp"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        elif BASE_RE.fullmatch(name) and name != current:
            shutil.rmtree(path)  # half written, or replaced but not yet deleted
        else:
            continue
        removed = True
    if removed:
        fsync_dir(directory)
    return None if current is None else int(BASE_RE.fullmatch(current).group(1))  # type: ignore[union-attr]


# ---- the writer -------------------------------------------------------------------------------
class UpdateLog:
    """The one writer of a log directory (module docstring); thread-safe.

    ``fsync``: "always" syncs each append before it returns; "group" lets appends that arrive
    within ``group_commit_ms`` of each other share one fsync (each returns once the fsync covering
    its record is done); "none" never syncs: durable against kill -9 (the bytes are in the page
    cache when ``append`` returns) but not against a machine crash; for tests and benchmarks.
    """

    def __init__(self, directory: Path, fsync: FsyncPolicy = "always",
                 group_commit_ms: float = 2.0) -> None:
        if fsync not in ("always", "group", "none"):
            raise ValueError(f"fsync must be 'always', 'group' or 'none', not {fsync!r}")
        self.directory = Path(directory)
        self.fsync = fsync
        self.group_commit_s = max(0.0, group_commit_ms) / 1e3
        self._lock = threading.Lock()  # the file and the versions: one writer at a time
        self._cond = threading.Condition(threading.Lock())  # _durable, _leader, _failed
        self._base_lock = threading.Lock()  # one write_base at a time
        self._lock_fd: int | None = None
        self._fd: int | None = None
        self._segment_first = 1
        self._last = self._durable = 0
        self._base_version: int | None = None
        self._leader = False
        self._failed: BaseException | None = None

    # -- open / close
    def open(self) -> int:
        """Lock the directory, clean up after a crash, verify the segments and truncate a torn
        tail; return the last durable version (0 when the log and base are empty)."""
        if self._lock_fd is not None:
            raise UpdateLogError(f"update log {self.directory} is already open")
        if not self.directory.is_dir():
            self.directory.mkdir(parents=True)
            fsync_dir(self.directory.parent)  # else a machine crash could lose the whole log
        self._lock_fd = _take_lock(self.directory)
        self._failed, self._leader = None, False
        try:
            self._base_version = _remove_leftovers(self.directory)
            self._recover_segments()
        except BaseException:
            self.close()
            raise
        return self._last

    def _recover_segments(self) -> None:
        base = self._base_version or 0
        segments = list_segments(self.directory)
        # Segments wholly at or below the base (a crash came before write_base deleted them).
        while len(segments) > 1 and segments[1][0] - 1 <= base:
            segments.pop(0)[1].unlink()
        if segments and segments[0][0] > base + 1:
            raise UpdateLogError(f"{segments[0][1]}: records {base + 1}..{segments[0][0] - 1} "
                                 f"are missing (the base in force is at version {base})")
        expect = segments[0][0] if segments else base + 1
        end, sealed = 0, None
        for i, (first, path) in enumerate(segments):
            if first != expect or (i and sealed != first):
                raise UpdateLogError(f"{path}: starts at version {first}, but the segment before "
                                     f"ends at {expect - 1} (sealed for {sealed})")
            end, expect, sealed = scan_segment(path, first, is_last=i == len(segments) - 1)
        if segments and os.path.getsize(segments[-1][1]) > end:
            with open(segments[-1][1], "r+b") as f:  # the torn record was never acknowledged
                f.truncate(end)
                os.fsync(f.fileno())
        self._last = self._durable = max(base, expect - 1)
        if segments and expect - 1 < base:  # only after a machine crash with fsync "none"/"group"
            for _, path in segments:  # every record is in the base already
                path.unlink()
            segments, sealed = [], None
        if sealed is not None:  # a crash came between the seal and its successor's creation
            self._start_segment(sealed)
        elif segments:
            self._segment_first = segments[-1][0]
            self._fd = os.open(segments[-1][1], os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        else:
            self._start_segment(base + 1)
        fsync_dir(self.directory)

    def _start_segment(self, first: int) -> None:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        self._fd = os.open(segment_path(self.directory, first), flags, 0o644)
        self._segment_first = first
        fsync_dir(self.directory)

    def close(self) -> None:
        """Release the files and the lock. Writes nothing: closing is as safe as a crash."""
        with self._lock:
            for fd in (self._fd, self._lock_fd):
                if fd is not None:
                    os.close(fd)
            self._fd = self._lock_fd = None

    def __enter__(self) -> UpdateLog:
        if self._lock_fd is None:
            self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def last_version(self) -> int:
        """Version of the last record written (the next append must be this + 1)."""
        return self._last

    @property
    def durable_version(self) -> int:
        """Version of the last acknowledged (durable per the policy) record."""
        return self._durable

    @property
    def base_version(self) -> int | None:
        return self._base_version

    # -- appending
    def append(self, record: Record) -> None:
        """Write ``record`` (version must be ``last_version + 1``) and return once it is durable
        per the fsync policy."""
        if self.fsync == "always":
            with self._lock:
                self._write_locked(record)
                self._sync_locked()
        else:
            self.wait_durable(self.write(record))

    def write(self, record: Record) -> int:
        """First half of ``append``: the record is written (ordered, not yet durable); returns
        its version. For callers that assign versions under their own lock and wait outside it
        (``wait_durable``), so that concurrent updates can share a group commit."""
        with self._lock:
            self._write_locked(record)
        if self.fsync == "none":
            with self._cond:
                self._durable = max(self._durable, record.version)
        return record.version

    def wait_durable(self, version: int) -> None:
        """Return once every record up to ``version`` (already written) is durable."""
        if version > self._last:
            raise ValueError(f"version {version} was not written (last is {self._last})")
        if self.fsync == "always":
            with self._lock:
                if self._durable < version:
                    self._check_usable()
                    self._sync_locked()
        elif self.fsync == "group":
            self._wait_group(version)

    def _check_usable(self) -> None:
        if self._fd is None:
            raise UpdateLogError(f"update log {self.directory} is not open")
        if self._failed is not None:
            raise UpdateLogError(f"update log {self.directory} failed ({self._failed!r}); "
                                 f"reopen it to recover") from self._failed

    def _write_locked(self, record: Record) -> None:
        self._check_usable()
        if not isinstance(record, EdgeRecord | NodeRecord | FeatureRecord | BookNodesRecord
                          | TypedEdgeRecord | TypedNodeRecord | TypedFeatureRecord):
            raise TypeError(f"not an update record: {type(record).__name__}")
        if record.version != self._last + 1:
            raise ValueError(f"record version {record.version} does not follow the log's last "
                             f"version {self._last}: it must be {self._last + 1}")
        data = encode(record)
        _crash_point("append.encoded")
        assert self._fd is not None
        try:
            if _crash_hook is not None:  # tests: a reader or a crash between the two halves
                _write_all(self._fd, data[:len(data) // 2])
                _crash_point("append.torn")
                _write_all(self._fd, data[len(data) // 2:])
            else:
                _write_all(self._fd, data)
            _crash_point("append.written")
        except BaseException as exc:  # the file may end in a partial record: stop here
            self._failed = exc
            raise
        self._last = record.version

    def _sync_locked(self) -> None:
        """fsync the segment (``_lock`` held) and acknowledge everything written."""
        assert self._fd is not None
        try:
            os.fsync(self._fd)
            _crash_point("append.synced")
        except BaseException as exc:  # after a failed fsync the page cache's state is unknown
            self._failed = exc
            raise
        with self._cond:
            self._durable = self._last
            self._cond.notify_all()

    def _wait_group(self, version: int) -> None:
        """Group commit: the first waiter with no leader syncing becomes the leader, sleeps the
        window so that other appenders write behind it, then one fsync acknowledges them all."""
        while True:
            with self._cond:
                while True:
                    if self._durable >= version:
                        return
                    if self._failed is not None:
                        raise UpdateLogError(f"update log {self.directory} failed "
                                             f"({self._failed!r})") from self._failed
                    if not self._leader:
                        self._leader = True
                        break
                    self._cond.wait()
            try:
                time.sleep(self.group_commit_s)
                with self._lock:
                    self._check_usable()
                    self._sync_locked()
            finally:
                with self._cond:
                    self._leader = False
                    self._cond.notify_all()

    # -- reading back
    def records_after(self, version: int) -> Iterator[Record]:
        """Every acknowledged record of version > ``version``, in order, across segments."""
        return read_records(self.directory, version, self._durable)

    def load_base(self) -> tuple[int, dict[str, np.ndarray], dict] | None:
        """The base in force: ``(version, arrays mmap'ed read-only, meta)``, or None."""
        return load_base(self.directory)

    # -- compaction
    def write_base(self, version: int, arrays: dict[str, np.ndarray], meta: dict) -> None:
        """Make ``arrays`` + ``meta`` (the graph at ``version``) the base in force, then drop
        the segments and bases it makes unneeded. Appends may go on meanwhile (other threads):
        only the segment switch holds them up. Records above ``version`` stay in their segment,
        which is kept until a later base covers all of it."""
        self._check_usable()
        with self._base_lock:
            if self._base_version is not None and version <= self._base_version:
                raise ValueError(f"base version {version} must exceed the base in force "
                                 f"({self._base_version})")
            if not 0 <= version <= self._durable:
                raise ValueError(f"base version {version} is not acknowledged (the log's last "
                                 f"durable version is {self._durable})")
            name = _base_name(version)
            write_base_dir(self.directory / name, version, arrays, meta, _crash_point)
            _point_current(self.directory, name)
            self._base_version = version
            self._rotate()
            self._drop_covered(version, keep=name)

    def _rotate(self) -> None:
        """Seal the segment being written and start the next one (none if it has no records:
        it already is a segment started after the last base)."""
        with self._lock:
            self._check_usable()
            if self._last < self._segment_first:
                return
            self._sync_locked()  # every record below the seal is durable before it
            assert self._fd is not None
            try:
                _write_all(self._fd, encode(SegmentSeal(self._last + 1, time.time())))
                os.fsync(self._fd)
                _crash_point("rotate.sealed")
                old = self._fd
                self._start_segment(self._last + 1)
                os.close(old)
                _crash_point("rotate.started")
            except BaseException as exc:
                self._failed = exc
                raise

    def _drop_covered(self, version: int, keep: str) -> None:
        """Delete segments whose records are all <= ``version`` and every base but ``keep``."""
        segments = list_segments(self.directory)
        for (_, path), (next_first, _) in zip(segments, segments[1:], strict=False):
            if next_first - 1 <= version:
                path.unlink()
                _crash_point("drop.segment")
        for entry in sorted(os.listdir(self.directory)):
            if BASE_RE.fullmatch(entry) and entry != keep:
                shutil.rmtree(self.directory / entry)
                _crash_point("drop.base")
        fsync_dir(self.directory)

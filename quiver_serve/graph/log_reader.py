"""Reading the update log (graph/update_log.py has the layout): segment files, the base in force,
and ``LogFollower`` for processes that apply updates the writer acknowledged.

Nothing here writes or locks: any number of readers, in any process, may run beside the one
writer. A reader never returns a record it could not fully verify (crc), so a record the writer is
still writing is simply not there yet.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from quiver_serve.graph.records import (
    HEADER_BYTES,
    MAGIC,
    BaseRecord,
    Record,
    SegmentSeal,
    decode,
    peek,
    record_length,
)

CURRENT_NAME = "CURRENT"
META_NAME = "meta.json"
SEGMENT_RE = re.compile(r"updates-(\d{20})\.log")
BASE_RE = re.compile(r"base-(\d{20})")
#: bytes one read of a segment file fetches; records are decoded out of this window
READ_WINDOW_BYTES = 1 << 20


class UpdateLogError(RuntimeError):
    """The log cannot be used: corrupt, inconsistent, or failed (reopen to recover)."""


class LogLockedError(UpdateLogError):
    """Another writer holds the log directory."""


class LogCompactedError(UpdateLogError):
    """The records a reader asked for were folded into a newer base and deleted: load the base
    (``load_base``) and read from its version."""


def segment_path(directory: Path, first_version: int) -> Path:
    return directory / f"updates-{first_version:020d}.log"


def list_segments(directory: Path) -> list[tuple[int, Path]]:
    """``(first version, path)`` of every segment, oldest first."""
    found = [(int(m.group(1)), directory / m.group(0)) for name in os.listdir(directory)
             if (m := SEGMENT_RE.fullmatch(name))]
    return sorted(found)


#: bytes one read of a segment file fetches; records are decoded out of this window
READ_WINDOW_BYTES = 1 << 20


class SegmentReader:
    """Reads the records of one open segment file in order, from byte ``offset``.

    ``os.pread`` has no shared file position, so the writer's descriptor and readers never disturb
    each other. The window of bytes read is dropped whenever no intact record is found in it: those
    bytes may have been read while a writer was still writing them.
    """

    def __init__(self, fd: int, offset: int = 0) -> None:
        self.fd, self.offset = fd, offset
        self._buf, self._buf_at = b"", offset

    def next(self, size: int, decode_after: int = -1) -> tuple[int, BaseRecord | None] | None:
        """``(version, record)`` of the record at ``offset`` when it lies whole below byte
        ``size``, and move past it. A record of version <= ``decode_after`` is skipped by its
        header (``record`` None, payload not read); a seal is always decoded. None, without
        moving, when no intact record starts at ``offset``."""
        head = self._window(HEADER_BYTES, size)
        total = None if head is None else record_length(*head)
        if head is None or total is None or self.offset + total > size:
            self._buf = b""
            return None
        kind, version = peek(*head)
        if version <= decode_after and kind != SegmentSeal.KIND:
            self.offset += total
            return version, None
        whole = self._window(total, size)
        got = None if whole is None else decode(*whole)
        if got is None:
            self._buf = b""
            return None
        self.offset += total
        return version, got[0]

    def _window(self, n_bytes: int, size: int) -> tuple[bytes, int] | None:
        """``(buffer, index of offset in it)`` holding ``n_bytes`` from ``offset``, or None when
        they are not all below ``size`` (or the file is shorter than that now)."""
        if self.offset + n_bytes > size:
            return None
        start = self.offset - self._buf_at
        if start < 0 or start + n_bytes > len(self._buf):
            want = min(max(n_bytes, READ_WINDOW_BYTES), size - self.offset)
            self._buf, self._buf_at, start = os.pread(self.fd, want, self.offset), self.offset, 0
            if len(self._buf) < n_bytes:
                return None
        return self._buf, start


# ---- the base in force ------------------------------------------------------------------------
def read_current(directory: Path) -> str | None:
    """The base folder ``CURRENT`` names, or None when no base was written."""
    try:
        name = (directory / CURRENT_NAME).read_text().strip()
    except FileNotFoundError:
        return None
    if not BASE_RE.fullmatch(name):
        raise UpdateLogError(f"{directory / CURRENT_NAME} holds {name!r}, not a base's name")
    return name


def _map_piece(path: Path) -> np.ndarray:
    """One array of a base, memory-mapped read-only; a file cut short or not an .npy array is
    refused with its name (a missing one raises FileNotFoundError: a base being replaced)."""
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise
    except (ValueError, OSError) as exc:
        raise UpdateLogError(f"{path} cannot be mapped: {exc} (a damaged base: move the "
                             "update-log folder away to start from the dataset)") from exc


def load_base(directory: Path) -> tuple[int, dict[str, np.ndarray], dict] | None:
    """``(version, arrays memory-mapped read-only, meta)`` of the base in force, or None when no
    base was written. Safe beside the writer: a base replaced between reading ``CURRENT`` and its
    files is read again from the new ``CURRENT``."""
    directory = Path(directory)
    for _ in range(8):  # each retry means a newer base was put in force meanwhile
        name = read_current(directory)
        if name is None:
            return None
        try:
            info = json.loads((directory / name / META_NAME).read_text())
            arrays = {a: _map_piece(directory / name / f"{a}.npy") for a in info["arrays"]}
        except FileNotFoundError:
            continue
        for a, spec in info["arrays"].items():
            if arrays[a].dtype.str != spec["dtype"] or list(arrays[a].shape) != spec["shape"]:
                raise UpdateLogError(f"{directory / name / a}.npy is {arrays[a].dtype}"
                                     f"{list(arrays[a].shape)}, meta.json says {spec}")
        return int(info["version"]), arrays, info["meta"]
    raise UpdateLogError(f"{directory}: CURRENT names a base that keeps disappearing")


# ---- whole segments ---------------------------------------------------------------------------
def _intact_record_after(fd: int, offset: int, size: int) -> int | None:
    """Offset of the first intact record starting after ``offset``, or None (damage at the end)."""
    rest = os.pread(fd, size - offset, offset)
    at = rest.find(MAGIC, 1)
    while at >= 0:
        if decode(rest, at) is not None:
            return offset + at
        at = rest.find(MAGIC, at + 1)
    return None


def scan_segment(path: Path, first: int, is_last: bool) -> tuple[int, int, int | None]:
    """``(end of the last intact record, next version, first version its seal names or None)``
    of a segment whose records must run from ``first``, every record verified. Damage is an error
    naming file and offset, unless it is the torn end of the last segment (nothing intact after
    it: the writer died while writing a record it never acknowledged)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        reader, expect, sealed = SegmentReader(fd), first, None
        while True:
            at = reader.offset
            got = reader.next(size)
            if got is None:
                break
            version, record = got
            if sealed is not None:
                raise UpdateLogError(f"{path}: record at offset {at} follows the segment's seal")
            if version != expect:
                raise UpdateLogError(f"{path}: record at offset {at} has version {version}, "
                                     f"expected {expect}")
            if isinstance(record, SegmentSeal):
                sealed = version
            else:
                expect += 1
        end = reader.offset
        if end < size:
            later = _intact_record_after(fd, end, size) if is_last else None
            if not is_last or later is not None:
                follows = "" if later is None else f" (an intact record follows at {later})"
                raise UpdateLogError(f"{path}: corrupt record at offset {end}{follows}")
        return end, expect, sealed
    finally:
        os.close(fd)


def _open_segment(directory: Path, first: int) -> int | None:
    """Descriptor of segment ``first``; None when it does not exist (yet); LogCompactedError when
    a later segment exists, so this one was deleted by a compaction."""
    try:
        return os.open(segment_path(directory, first), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        if any(f > first for f, _ in list_segments(directory)):
            raise LogCompactedError(f"{segment_path(directory, first)} was compacted away; load "
                                    f"the base and read from its version") from None
        return None


def _first_segment(directory: Path, version: int) -> int | None:
    """First version of the segment holding ``version`` (the last one starting at or before it)."""
    try:
        segments = list_segments(directory)
    except FileNotFoundError:  # the writer has not created the log yet
        return None
    if segments and segments[0][0] > version:
        raise LogCompactedError(f"{directory}: records from version {version} were compacted "
                                f"away (the oldest segment starts at {segments[0][0]}); load the "
                                f"base and read from its version")
    starts = [f for f, _ in segments if f <= version]
    return starts[-1] if starts else None


def read_records(directory: Path, after: int, through: int) -> Iterator[Record]:
    """Every record of version ``after + 1 .. through``, in order, across segments."""
    if after >= through:
        return
    directory, expect = Path(directory), after + 1
    first = _first_segment(directory, expect)
    while first is not None and expect <= through:
        fd = _open_segment(directory, first)
        if fd is None:
            break
        try:
            size, reader, first = os.fstat(fd).st_size, SegmentReader(fd), None
            while expect <= through and (got := reader.next(size, decode_after=after)):
                version, record = got
                if isinstance(record, SegmentSeal):
                    first = version
                    break
                if version >= expect:
                    if version != expect:
                        raise UpdateLogError(f"{directory}: version {version} where {expect} "
                                             f"was expected")
                    expect += 1
                    yield record  # type: ignore[misc]
        finally:
            os.close(fd)
    if expect <= through:
        raise UpdateLogError(f"{directory}: records {expect}..{through} are missing")


# ---- following the writer ---------------------------------------------------------------------
class LogFollower:
    """New records of a log written by another process (or thread), in order, never blocking.

    ``poll`` costs one ``os.fstat`` when nothing is new; it never returns a partial record (a
    record being written fails its checksum and is read again on the next poll). At the end of a
    segment the writer's seal names the next one, so rotation needs no directory listing.
    """

    def __init__(self, directory: Path, after_version: int) -> None:
        self.directory = Path(directory)
        self.next_version = after_version + 1
        self._fd: int | None = None
        self._reader: SegmentReader | None = None
        self._next_segment: int | None = None  # a seal was read; that segment is not open yet

    def poll(self, max_records: int | None = None) -> list[Record]:
        """Every complete record after the last one returned (at most ``max_records``)."""
        out: list[Record] = []
        if (self._reader is None or self._next_segment is not None) and not self._open_next():
            return out
        assert self._reader is not None
        size = os.fstat(self._reader.fd).st_size
        while max_records is None or len(out) < max_records:
            got = self._reader.next(size, decode_after=self.next_version - 1)
            if got is None:
                break
            version, record = got
            if isinstance(record, SegmentSeal):
                self._next_segment = version
                if not self._open_next():
                    break
                size = os.fstat(self._reader.fd).st_size
            elif version >= self.next_version:
                if version != self.next_version:
                    raise UpdateLogError(f"{self.directory}: version {version} where "
                                         f"{self.next_version} was expected")
                self.next_version += 1
                out.append(record)  # type: ignore[arg-type]
        return out

    def _open_next(self) -> bool:
        """Open the segment to read next (the one a seal named, or the one holding the first
        wanted version); False when it does not exist yet."""
        first = self._next_segment
        if first is None and (first := _first_segment(self.directory, self.next_version)) is None:
            return False
        fd = _open_segment(self.directory, first)
        if fd is None:
            return False
        self.close()
        self._fd, self._reader, self._next_segment = fd, SegmentReader(fd), None
        return True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd = self._reader = None

    def __enter__(self) -> LogFollower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

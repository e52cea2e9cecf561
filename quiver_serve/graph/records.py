"""Graph update records and their binary form in the update log (docs/architecture.md, "The living
graph").

A record is one acknowledged update: ``EdgeRecord`` (directed edges added and removed),
``NodeRecord`` (new nodes' feature rows; their ids follow the current node count in order) or
``FeatureRecord`` (feature rows overwritten); on a typed graph ``TypedEdgeRecord``,
``TypedNodeRecord`` and ``TypedFeatureRecord``, the same with the relation's or node type's
position in the graph (``graph/typed_living.py``). ``BookNodesRecord`` is a partitioned graph's:
new nodes entered in the partition book with their global ids and owner, with their rows at the
owner (``scaleout/partitioned/live.py``). ``PlannedEdgeRecord`` is an ``EdgeRecord`` with
the writer's plan of it (the overlay's writes, ``graph/overlay.py`` ``Patch``): a follower whose
overlay is in the writer's state applies the plan instead of planning again. ``SegmentSeal`` is the log's own marker closing a
segment file; readers of the log never see it.

Binary form, every integer little-endian, no pickle (a reader that trusts only its own code can
decode it)::

    offset  size  field
         0     4  magic b"QSUL"
         4     2  format version (FORMAT_VERSION)
         6     1  kind (0 seal, 1 edges, 2 nodes, 3 features, 4 edges with their plan,
                  5 a partitioned graph's new nodes, 6-8 typed edges, nodes, features)
         7     1  reserved, 0
         8     8  record version, u64
        16     8  accepted_s, f64 (wall clock when the update was accepted)
        24     8  payload length in bytes, u64
        32     4  crc32 of bytes 0..32 (the length is trusted only when this matches)
        36     4  crc32 of bytes 0..36 and the payload
        40     -  payload: the kind's arrays in order, each an 8-byte block header (dtype code u8,
                  ndim u8, 6 reserved bytes), ndim u64 dims, the raw data, zero padding to 8 bytes

Every block starts 8-byte aligned. ``decode`` returns None for anything it cannot fully trust
(too short, wrong magic, a checksum mismatch, arrays that do not match the kind's schema).
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

MAGIC = b"QSUL"
#: bump when the layout above changes; a reader refuses a format it does not know
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sHBBQdQ")  # everything the header crc covers
_HEADER = struct.Struct("<4sHBBQdQII")
HEADER_BYTES = _HEADER.size  # 40
_BLOCK = struct.Struct("<BB6x")
_DIM = struct.Struct("<Q")
#: dtype code in an array block; every array is stored little-endian
_DTYPES = {1: np.dtype("<i8"), 2: np.dtype("<f4")}
_CODES = {dt: code for code, dt in _DTYPES.items()}


class BaseRecord:
    """What every entry of the update log is (the records and the segment seal), with bitwise
    equality (the log's guarantee: what is read back is what was written)."""

    version: int
    accepted_s: float
    KIND: ClassVar[int]
    FIELDS: ClassVar[tuple[str, ...]] = ()

    def arrays(self) -> tuple[np.ndarray, ...]:
        return tuple(getattr(self, f) for f in self.FIELDS)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, BaseRecord)
        return (self.version, self.accepted_s) == (other.version, other.accepted_s) and all(
            a.shape == b.shape and a.tobytes() == b.tobytes()
            for a, b in zip(self.arrays(), other.arrays(), strict=True))

    __hash__ = None  # type: ignore[assignment]  # mutable arrays inside

    def _check_version(self) -> None:
        self.version, self.accepted_s = int(self.version), float(self.accepted_s)
        if not 0 <= self.version < 2**63:
            raise ValueError(f"record version {self.version} is outside 0..2**63-1")


def _array(value: Any, dtype: np.dtype, ndim: int, name: str, width: int | None = None
           ) -> np.ndarray:
    """``value`` as a C-contiguous little-endian array of ``dtype``; integers stay integers and
    floats stay floats (a float id or an int feature is a caller's bug, not a cast)."""
    arr = np.asarray(value)
    if arr.size == 0 and width is not None:
        arr = arr.reshape(0, width)  # ``[]`` means no edges
    if arr.size == 0 and arr.ndim == ndim:
        arr = arr.astype(dtype)  # np.asarray([]) is float64: an empty list is fine for any kind
    want_kind = "iu" if dtype.kind == "i" else "f"
    if arr.dtype.kind not in want_kind:
        raise TypeError(f"{name} must be {dtype.name}, got {arr.dtype}")
    if arr.ndim != ndim or (width is not None and arr.shape[1] != width):
        shape = "[n]" if ndim == 1 else f"[n, {width if width is not None else 'F'}]"
        raise ValueError(f"{name} must have shape {shape}, got {list(arr.shape)}")
    return np.ascontiguousarray(arr, dtype=dtype)


@dataclass(eq=False)
class EdgeRecord(BaseRecord):
    """Directed edges ``src -> dst`` added (a repeat is another copy) and removed (every copy)."""

    version: int
    accepted_s: float
    add: np.ndarray  # int64 [a, 2]: (src, dst)
    remove: np.ndarray  # int64 [r, 2]: (src, dst)
    KIND: ClassVar[int] = 1
    FIELDS: ClassVar[tuple[str, ...]] = ("add", "remove")

    def __post_init__(self) -> None:
        self._check_version()
        self.add = _array(self.add, _DTYPES[1], 2, "add", width=2)
        self.remove = _array(self.remove, _DTYPES[1], 2, "remove", width=2)


#: fields of a plan (``PlannedEdgeRecord``), each int64 [n] (``head``: 5 counters)
PLAN_FIELDS = ("head", "nodes", "start", "length", "block", "tail_pos", "tail_val")


@dataclass(eq=False)
class PlannedEdgeRecord(EdgeRecord):
    """An ``EdgeRecord`` with the writer's plan of its overlay writes: ``head`` (base version,
    arena top before, entries allocated, live-entry change, edge change), then per changed node
    its (start, length, block) and the arena entries written (positions, values)."""

    head: np.ndarray = None  # type: ignore[assignment]
    nodes: np.ndarray = None  # type: ignore[assignment]
    start: np.ndarray = None  # type: ignore[assignment]
    length: np.ndarray = None  # type: ignore[assignment]
    block: np.ndarray = None  # type: ignore[assignment]
    tail_pos: np.ndarray = None  # type: ignore[assignment]
    tail_val: np.ndarray = None  # type: ignore[assignment]
    KIND: ClassVar[int] = 4
    FIELDS: ClassVar[tuple[str, ...]] = ("add", "remove", *PLAN_FIELDS)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in PLAN_FIELDS:
            setattr(self, name, _array(getattr(self, name), _DTYPES[1], 1, name))
        n = self.nodes.size
        if self.head.size != 5 or self.start.size != n or self.length.size != n \
                or self.block.size != n or self.tail_pos.size != self.tail_val.size:
            raise ValueError("a plan's arrays do not match: head of 5, (start, length, block) "
                             "per node, one value per arena position")


@dataclass(eq=False)
class NodeRecord(BaseRecord):
    """New nodes, one feature row each; their ids are the node count before, +1, ... in order."""

    version: int
    accepted_s: float
    features: np.ndarray  # float32 [n, F]
    KIND: ClassVar[int] = 2
    FIELDS: ClassVar[tuple[str, ...]] = ("features",)

    def __post_init__(self) -> None:
        self._check_version()
        self.features = _array(self.features, _DTYPES[2], 2, "features")


@dataclass(eq=False)
class FeatureRecord(BaseRecord):
    """Feature rows of existing nodes overwritten: row i of ``features`` goes to ``node_ids[i]``."""

    version: int
    accepted_s: float
    node_ids: np.ndarray  # int64 [n]
    features: np.ndarray  # float32 [n, F]
    KIND: ClassVar[int] = 3
    FIELDS: ClassVar[tuple[str, ...]] = ("node_ids", "features")

    def __post_init__(self) -> None:
        self._check_version()
        self.node_ids = _array(self.node_ids, _DTYPES[1], 1, "node_ids")
        self.features = _array(self.features, _DTYPES[2], 2, "features")
        if len(self.node_ids) != len(self.features):
            raise ValueError(f"{len(self.node_ids)} node_ids but {len(self.features)} feature rows")


def _type_key(value: Any) -> np.ndarray:
    key = _array(value, _DTYPES[1], 1, "type_key")
    if key.size != 1 or int(key[0]) < 0:
        raise ValueError(f"a typed record's type_key is one position >= 0, got {key.tolist()}")
    return key


@dataclass(eq=False)
class TypedEdgeRecord(BaseRecord):
    """``EdgeRecord`` of one relation of a typed graph: ``type_key`` [1] is the relation's
    position in the graph's edge types; ``add``/``remove`` pairs are (source id, destination id)
    in the source and destination types' own ids."""

    version: int
    accepted_s: float
    type_key: np.ndarray  # int64 [1]
    add: np.ndarray  # int64 [a, 2]
    remove: np.ndarray  # int64 [r, 2]
    KIND: ClassVar[int] = 6
    FIELDS: ClassVar[tuple[str, ...]] = ("type_key", "add", "remove")

    def __post_init__(self) -> None:
        self._check_version()
        self.type_key = _type_key(self.type_key)
        self.add = _array(self.add, _DTYPES[1], 2, "add", width=2)
        self.remove = _array(self.remove, _DTYPES[1], 2, "remove", width=2)


@dataclass(eq=False)
class TypedNodeRecord(BaseRecord):
    """New nodes of one node type (``type_key``: its position); ``features`` [n, F], F = 0 for
    a type without features. Their ids follow the type's node count."""

    version: int
    accepted_s: float
    type_key: np.ndarray  # int64 [1]
    features: np.ndarray  # float32 [n, F]
    KIND: ClassVar[int] = 7
    FIELDS: ClassVar[tuple[str, ...]] = ("type_key", "features")

    def __post_init__(self) -> None:
        self._check_version()
        self.type_key = _type_key(self.type_key)
        self.features = _array(self.features, _DTYPES[2], 2, "features")


@dataclass(eq=False)
class TypedFeatureRecord(BaseRecord):
    """Feature rows of one node type's nodes overwritten (``type_key``: the type's position)."""

    version: int
    accepted_s: float
    type_key: np.ndarray  # int64 [1]
    node_ids: np.ndarray  # int64 [n]
    features: np.ndarray  # float32 [n, F]
    KIND: ClassVar[int] = 8
    FIELDS: ClassVar[tuple[str, ...]] = ("type_key", "node_ids", "features")

    def __post_init__(self) -> None:
        self._check_version()
        self.type_key = _type_key(self.type_key)
        self.node_ids = _array(self.node_ids, _DTYPES[1], 1, "node_ids")
        self.features = _array(self.features, _DTYPES[2], 2, "features")
        if len(self.node_ids) != len(self.features):
            raise ValueError(f"{len(self.node_ids)} node_ids but {len(self.features)} feature rows")


@dataclass(eq=False)
class BookNodesRecord(BaseRecord):
    """New nodes of a partitioned graph: ``head`` is (first global id, count, owner partition);
    ``features`` their rows in the owner's log, none ([0, F]) in the other partitions' logs,
    which only learn who owns them."""

    version: int
    accepted_s: float
    head: np.ndarray  # int64 [3]
    features: np.ndarray  # float32 [count or 0, F]
    KIND: ClassVar[int] = 5
    FIELDS: ClassVar[tuple[str, ...]] = ("head", "features")

    def __post_init__(self) -> None:
        self._check_version()
        self.head = _array(self.head, _DTYPES[1], 1, "head")
        self.features = _array(self.features, _DTYPES[2], 2, "features")
        if self.head.size != 3 or self.head.min() < 0 or \
                len(self.features) not in (0, int(self.head[1])):
            raise ValueError("a book record's head is (first id, count, owner), each >= 0, with "
                             "count rows or none")

    @property
    def first_id(self) -> int:
        return int(self.head[0])

    @property
    def count(self) -> int:
        return int(self.head[1])

    @property
    def owner(self) -> int:
        return int(self.head[2])


@dataclass(eq=False)
class SegmentSeal(BaseRecord):
    """Last record of a segment file that is complete: ``version`` is the first version of the
    next segment. Followers read it to move on without listing the directory."""

    version: int
    accepted_s: float
    KIND: ClassVar[int] = 0

    def __post_init__(self) -> None:
        self._check_version()


TypedRecord = TypedEdgeRecord | TypedNodeRecord | TypedFeatureRecord
Record = EdgeRecord | NodeRecord | FeatureRecord | BookNodesRecord | TypedRecord
_KINDS: dict[int, type[BaseRecord]] = {c.KIND: c for c in (
    SegmentSeal, EdgeRecord, NodeRecord, FeatureRecord, PlannedEdgeRecord, BookNodesRecord,
    TypedEdgeRecord, TypedNodeRecord, TypedFeatureRecord)}


def _pad(n_bytes: int) -> int:
    return -n_bytes % 8


def encode(record: BaseRecord) -> bytes:
    """The record's bytes in the log (module docstring)."""
    parts: list[bytes] = []
    for arr in record.arrays():
        parts.append(_BLOCK.pack(_CODES[arr.dtype], arr.ndim))
        parts.extend(_DIM.pack(d) for d in arr.shape)
        data = arr.tobytes()
        parts += [data, b"\0" * _pad(len(data))]
    payload = b"".join(parts)
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, record.KIND, 0, record.version,
                          float(record.accepted_s), len(payload))
    head_crc = zlib.crc32(prefix)
    body = prefix + struct.pack("<I", head_crc)
    return body + struct.pack("<I", zlib.crc32(payload, zlib.crc32(body))) + payload


def record_length(buf: Any, offset: int = 0) -> int | None:
    """Total bytes of the record starting at ``offset`` when its header is complete and intact
    (magic, known format and kind, header crc), else None. The payload is not checked."""
    if len(buf) - offset < HEADER_BYTES:
        return None
    magic, fmt, kind, _, _, _, payload_bytes, head_crc, _ = _HEADER.unpack_from(buf, offset)
    if magic != MAGIC or fmt != FORMAT_VERSION or kind not in _KINDS:
        return None
    if zlib.crc32(memoryview(buf)[offset:offset + _PREFIX.size]) != head_crc:
        return None
    return HEADER_BYTES + payload_bytes


def peek(buf: Any, offset: int = 0) -> tuple[int, int]:
    """``(kind, version)`` of the header at ``offset`` (the caller checked it: record_length)."""
    fields = _HEADER.unpack_from(buf, offset)
    return fields[2], fields[4]


def decode(buf: Any, offset: int = 0) -> tuple[BaseRecord, int] | None:
    """``(record, next_offset)`` for the record at ``offset`` of ``buf`` (bytes, bytearray,
    memoryview or mmap); None when it is incomplete, torn or corrupt. Arrays are copies."""
    total = record_length(buf, offset)
    if total is None or len(buf) - offset < total:
        return None
    view = memoryview(buf)[offset:offset + total]
    _, _, kind, _, version, accepted_s, _, _, crc = _HEADER.unpack_from(view)
    if zlib.crc32(view[HEADER_BYTES:], zlib.crc32(view[:HEADER_BYTES - 4])) != crc:
        return None
    cls = _KINDS[kind]
    arrays = _decode_arrays(view[HEADER_BYTES:], len(cls.FIELDS))
    if arrays is None:
        return None
    try:
        record = cls(version, accepted_s, *arrays)  # type: ignore[call-arg]
    except (TypeError, ValueError):  # a crc-valid record of the wrong shape: not ours
        return None
    return record, offset + total


def _decode_arrays(payload: memoryview, count: int) -> list[np.ndarray] | None:
    """The ``count`` array blocks filling ``payload`` exactly, or None if they do not."""
    arrays, pos = [], 0
    for _ in range(count):
        if len(payload) - pos < _BLOCK.size:
            return None
        code, ndim = _BLOCK.unpack_from(payload, pos)
        pos += _BLOCK.size
        if code not in _DTYPES or not 1 <= ndim <= 2 or len(payload) - pos < 8 * ndim:
            return None
        shape = tuple(_DIM.unpack_from(payload, pos + 8 * i)[0] for i in range(ndim))
        pos += 8 * ndim
        dtype = _DTYPES[code]
        n_bytes = math.prod(shape) * dtype.itemsize
        if n_bytes + _pad(n_bytes) > len(payload) - pos:
            return None
        flat = np.frombuffer(payload, dtype, n_bytes // dtype.itemsize, pos)
        try:
            arrays.append(flat.reshape(shape).copy())
        except (ValueError, OverflowError):  # an empty array with an absurd dimension
            return None
        pos += n_bytes + _pad(n_bytes)
    return arrays if pos == len(payload) else None


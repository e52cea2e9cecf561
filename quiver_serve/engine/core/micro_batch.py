"""A micro-batch as the engine core takes it in, its reply, and the intake checks.

A micro-batch is one front-end tick's requests of one kind, as raw buffers (ids, lengths,
deadlines). The checks here are vectorised and cost nothing per request in the usual case (every
id in range, nothing expired): per-request masks are made only when something is refused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from quiver_serve import errors
from quiver_serve.wire import MicroBatchDone, RequestError

if TYPE_CHECKING:
    from quiver_serve.engine.core.model_slots import ModelSlot


@dataclass
class MicroBatch:
    """One front-end tick's requests of one kind, as they arrived (buffers are NumPy views)."""

    client: bytes
    seq: int
    exact: bool
    seed: int  # NO_SEED unless it is a single seeded request
    ids: np.ndarray  # int64 [n_ids]
    lengths: np.ndarray  # int64 [n_requests]
    deadlines_s: np.ndarray  # float64 [n_requests], time.time() instants
    received_s: float = field(default_factory=time.time)
    #: ids the sending client had outstanding when it sent this (``MicroBatchHeader``)
    outstanding_ids: int = 0
    #: requests refused at intake (ids out of range), None when none was; set by ``EngineCore.add``
    valid: np.ndarray | None = None
    errors: list[RequestError] = field(default_factory=list)
    min_deadline_s: float = 0.0
    #: PSGS draws of its ids (``PsgsTable.draws``), summed for the batch former's sizing
    draws: float = 0.0
    #: the graph version it must see (read-your-writes, docs/architecture.md, "The living graph");
    #: 0: any
    min_version: int = 0
    #: inductive request (it travels alone): new nodes' feature rows float32 [m, F], their
    #: in-neighbour offsets int64 [m + 1] and ids int64 [nnz]; None for plain requests
    new_features: np.ndarray | None = None
    new_offsets: np.ndarray | None = None
    new_neighbors: np.ndarray | None = None
    #: typed graphs: the relations the neighbour words name by index (``wire.RELATION_SHIFT``)
    new_relations: tuple[str, ...] = ()
    #: the model asked for ("": the default) and its version (0: by the traffic split)
    model: str = ""
    version: int = 0
    #: the ``ModelSlot`` it runs on, resolved at intake (``model_slots.py``)
    slot: ModelSlot | None = None
    #: the node type its ids are of (typed graphs, ``typed_core.py``); "": the only type
    node_type: str = ""

    @property
    def num_new_nodes(self) -> int:
        return 0 if self.new_features is None else int(self.new_features.shape[0])

    @property
    def num_ids(self) -> int:
        return int(self.ids.size)

    @property
    def num_requests(self) -> int:
        return int(self.lengths.size)


@dataclass
class Reply:
    """What goes back to one client for one micro-batch."""

    client: bytes
    done: MicroBatchDone
    rows: np.ndarray | None  # float32 [n_ids, dim], or None when every request failed


@dataclass
class Part:
    mb: MicroBatch
    alive: np.ndarray | None  # bool per request; None when every request is alive (the usual case)
    errors: list[RequestError]

    @property
    def num_alive(self) -> int:
        return self.mb.num_requests if self.alive is None else int(self.alive.sum())

    def alive_ids(self) -> np.ndarray:
        if self.alive is None:
            return self.mb.ids
        return self.mb.ids[np.repeat(self.alive, self.mb.lengths)]


def expired_error(index: int) -> RequestError:
    return RequestError(index, *errors.DEADLINE)


def check_ids(mb: MicroBatch, num_nodes: int) -> tuple[np.ndarray | None, list[RequestError]]:
    """Which requests have every id in range (None: all; front-ends validate, this guards every
    other client), and a 400 naming the first bad id of each that does not."""
    ids = mb.ids
    if ids.size == 0:
        return None, []  # no id to be out of range
    if ids.size == 1:
        if 0 <= int(ids[0]) < num_nodes:
            return None, []
    elif int(ids.min()) >= 0 and int(ids.max()) < num_nodes:
        return None, []
    bad = (mb.ids < 0) | (mb.ids >= num_nodes)
    starts = np.concatenate([[0], np.cumsum(mb.lengths)[:-1]]).astype(np.int64)
    per_request = np.add.reduceat(bad.astype(np.int64), starts) > 0
    errs = []
    for i in np.flatnonzero(per_request).tolist():
        chunk = mb.ids[starts[i]:starts[i] + mb.lengths[i]]
        first_bad = int(chunk[(chunk < 0) | (chunk >= num_nodes)][0])
        info = errors.out_of_range(first_bad, num_nodes).info
        errs.append(RequestError(i, info.code, info.message, info.status))
    return ~per_request, errs


def prune(mb: MicroBatch, now_s: float) -> Part:
    """Drop expired requests (and those refused at intake) before any work."""
    if mb.valid is None and mb.min_deadline_s > now_s:
        return Part(mb, None, [])
    valid = mb.valid if mb.valid is not None else np.ones(mb.num_requests, dtype=bool)
    alive = valid & (mb.deadlines_s > now_s)
    errors = list(mb.errors) + [expired_error(i) for i in np.flatnonzero(valid & ~alive).tolist()]
    return Part(mb, alive, errors)


def split_rows(parts: list[Part], rows: np.ndarray) -> list[np.ndarray]:
    """A batch's rows (those of its alive requests, in part order) back per micro-batch: a view
    when every request of the part is alive, else zero rows in the places of those that are
    not."""
    chunks, start, dim = [], 0, int(rows.shape[1])
    for part in parts:
        if part.alive is None:
            chunks.append(rows[start:start + part.mb.num_ids])
            start += part.mb.num_ids
            continue
        alive_pos = np.repeat(part.alive, part.mb.lengths)
        n_alive = int(alive_pos.sum())
        chunk = np.zeros((part.mb.num_ids, dim), np.float32)
        chunk[alive_pos] = rows[start:start + n_alive]
        start += n_alive
        chunks.append(chunk)
    return chunks


def failed_replies(parts: list[Part], code: str, message: str, status: int) -> list[Reply]:
    """One reply per micro-batch of a failed batch: its alive requests get the error, those
    already refused keep theirs."""
    replies = []
    for part in parts:
        alive = range(part.mb.num_requests) if part.alive is None \
            else np.flatnonzero(part.alive).tolist()
        errs = part.errors + [RequestError(i, code, message, status) for i in alive]
        replies.append(Reply(part.mb.client, MicroBatchDone(part.mb.seq, 0, errs), None))
    return replies


def refused_whole(mb: MicroBatch, code: str, message: str, status: int) -> Reply:
    """The reply refusing every request of ``mb`` with one error."""
    errs = [RequestError(i, code, message, status) for i in range(max(mb.num_requests, 1))]
    return Reply(mb.client, MicroBatchDone(mb.seq, 0, errs), None)


def malformed(mb: MicroBatch) -> Reply | None:
    """A 400 when ``mb``'s ids, lengths and deadlines do not agree (a client the front-ends
    did not check), else None."""
    n_req = mb.num_requests
    total = int(mb.lengths[0]) if n_req == 1 else int(mb.lengths.sum())
    if n_req == 0 or total != mb.num_ids or mb.deadlines_s.size != n_req:
        return refused_whole(mb, "invalid_request", "malformed micro-batch: ids, lengths and "
                             "deadlines do not agree", 400)
    return None


def untyped_refusal(mb: MicroBatch, one_type: str) -> Reply | None:
    """On an untyped graph, a 400 for a micro-batch naming a node type other than the graph's
    one type ``one_type`` (or none), else None (docs/architecture.md, "Typed graphs")."""
    if mb.node_type in ("", one_type):
        return None
    return refused_whole(mb, "invalid_node_type", f"unknown node_type {mb.node_type[:128]!r}: this "
                         f"daemon serves an untyped graph (its one type is {one_type!r})", 400)

"""Wire format of the serving path: typed msgspec headers plus raw side buffers, over ZeroMQ.

Every message between a front-end client, an engine core and a CPU sampler is one ZeroMQ
multipart message: frame 0 is a msgpack header (a ``msgspec.Struct`` below), the remaining frames
are raw little-endian buffers (node ids, per-request lengths and deadlines, sampled subgraphs,
embeddings). Nothing is pickled, so a peer can never make this process run code, and a buffer is
never copied into a Python object: receivers view it with ``np.frombuffer``.

One message per micro-batch each way: a client sends the requests of one loop tick as one
:class:`MicroBatchHeader` (+ one frame of ids, lengths, deadlines: :func:`pack_requests`) and gets
one :class:`MicroBatchDone` (+ the embedding rows of every requested position) back. Requests are identified by their position in
the micro-batch; request ids never leave the front-end.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec
import numpy as np
import zmq

from quiver_serve.messages import BatchStats

#: numbers the disconnect monitors of this process (:func:`disconnect_monitor`)
_MONITOR_NUMBERS = itertools.count()


def disconnect_monitor(sock: zmq.Socket) -> zmq.Socket:
    """A PAIR socket that gets an event when ``sock``'s connection drops.

    pyzmq names a monitor's inproc endpoint after the socket's file descriptor. A closed socket's
    monitor stays bound until libzmq's reaper thread gets to it, so a new socket that reuses the
    descriptor first fails with EADDRINUSE (49 times in 20,000 opens on one context). Each monitor
    here has a name of its own: the process id and a number.
    """
    addr = f"inproc://quiver-monitor-{os.getpid()}-{next(_MONITOR_NUMBERS)}"
    return sock.get_monitor_socket(zmq.EVENT_DISCONNECTED, addr=addr)


# ---- addresses: every socket of one daemon, in a private run directory ----------------------------
@dataclass(frozen=True)
class RunAddresses:
    """Where every socket of one daemon lives (a private directory; picklable)."""

    run_dir: str

    def engine(self, i: int) -> str:
        return f"ipc://{self.run_dir}/engine-{i}.sock"

    def sampler(self, j: int) -> str:
        return f"ipc://{self.run_dir}/sampler-{j}.sock"

    @property
    def control(self) -> str:
        return f"ipc://{self.run_dir}/control.sock"

    def engine_admin(self, i: int) -> str:
        """Engine core ``i``'s model calls from the main process (``ModelCall`` / ``ModelReply``)."""
        return f"ipc://{self.run_dir}/engine-{i}-admin.sock"


@dataclass(frozen=True)
class FrontDoorAddresses:
    """The main process's two sockets for its front-ends (a private directory; picklable)."""

    run_dir: str

    @property
    def state(self) -> str:
        return f"ipc://{self.run_dir}/frontdoor-state.sock"

    @property
    def control(self) -> str:
        return f"ipc://{self.run_dir}/frontdoor-control.sock"

    @property
    def graph(self) -> str:
        """The graph writer's calls (``GraphCall`` / ``GraphReply``)."""
        return f"ipc://{self.run_dir}/frontdoor-graph.sock"


#: ``seed`` value of a micro-batch whose requests asked for no seed
NO_SEED = -1


class MicroBatchHeader(msgspec.Struct, array_like=True, frozen=True):
    """Client → engine core. The frame after it holds the ``requests`` requests (``pack_requests``):
    ids int64 [n_ids], lengths int64 [requests] (ids per request, in order), deadlines float64
    [requests] (``time.time()`` instants), back to back; with ``requests`` 0 (an older sender)
    they are three frames. Then, when ``new_nodes`` > 0, the :class:`InductiveNodes` frames
    (``INDUCTIVE_FRAMES``).

    Fields are added at the end only, each with a default, so an older sender still decodes."""

    seq: int  # unique per client; the reply carries it back
    exact: bool
    seed: int  # NO_SEED, or the single seeded request's seed (seeded requests travel alone)
    #: ids this client has admitted and not yet answered (this micro-batch's included), divided
    #: among the engine cores it spreads them over: how many of its callers' ids this engine
    #: should expect, which the engine cannot see between two requests
    outstanding_ids: int = 0
    #: the graph version every request here must see (the largest any of them asked for);
    #: 0: whatever is visible
    min_version: int = 0
    #: inductive rows (``new_nodes`` of one request, which then travels alone): their rows
    #: follow the ids' rows in the reply
    new_nodes: int = 0
    #: the model every request here asks for ("": the default model) and its version (0: the
    #: engine core picks one by the model's traffic split)
    model: str = ""
    version: int = 0
    #: requests in the packed frame after the header (0: ids, lengths, deadlines in 3 frames)
    requests: int = 0
    #: the node type of every request's ids (typed graphs; "": the graph's only type)
    node_type: str = ""
    #: typed inductive nodes: the relations their in-neighbour words name by index
    #: (``InductiveNodes.relations``)
    new_relations: tuple[str, ...] = ()


def pack_requests(ids: list[np.ndarray], deadlines_s: list[float]) -> np.ndarray:
    """One frame for a micro-batch's requests: their int64 ids back to back, then each
    request's id count, then its deadline (float64 bits), all 8-byte words. One frame instead of
    three: a micro-batch costs its sender and the engine core a third less in ZeroMQ."""
    n = len(ids)
    total = int(ids[0].size) if n == 1 else sum(int(a.size) for a in ids)
    body = np.empty(total + 2 * n, np.int64)
    if n == 1:
        body[:total] = ids[0]
    else:
        np.concatenate(ids, out=body[:total])
    body[total:total + n] = [a.size for a in ids]
    body[total + n:].view(np.float64)[:] = deadlines_s
    return body


def unpack_requests(frame: Any, requests: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The engine side of :func:`pack_requests`: read-only views (ids, lengths, deadlines);
    ValueError when the frame is too short for ``requests`` requests."""
    words = view(frame, np.int64)
    n_ids = words.size - 2 * requests
    if requests < 1 or n_ids < 0:
        raise ValueError(f"a frame of {words.size} words cannot hold {requests} requests")
    return (words[:n_ids], words[n_ids:n_ids + requests],
            words[n_ids + requests:].view(np.float64))


#: frames an inductive micro-batch carries after its requests
INDUCTIVE_FRAMES = 3
#: a typed inductive neighbour word: the relation's index from this bit up, the source id below
RELATION_SHIFT = 48


class InductiveNodes(NamedTuple):
    """Nodes embedded as if added with these in-edges, without adding them (docs/architecture.md,
    "The living graph")."""

    features: np.ndarray  # float32 [m, F]
    offsets: np.ndarray  # int64 [m + 1]: node i's in-neighbours are neighbors[offsets[i]:offsets[i+1]]
    neighbors: np.ndarray  # int64 [nnz], ids of existing nodes
    #: typed graphs: the relations (as the request named them) each neighbour word names by
    #: index in its bits from ``RELATION_SHIFT`` up, the source id below (); untyped: ()
    relations: tuple[str, ...] = ()

    @property
    def count(self) -> int:
        return int(self.features.shape[0])

    def frames(self) -> list[np.ndarray]:
        """The three frames, in order (contiguous, little-endian on every supported host)."""
        return [np.ascontiguousarray(self.features, np.float32),
                np.ascontiguousarray(self.offsets, np.int64),
                np.ascontiguousarray(self.neighbors, np.int64)]


def decode_inductive(frames: list[Any], count: int | None = None) -> InductiveNodes:
    """The engine side of :meth:`InductiveNodes.frames`: the last ``INDUCTIVE_FRAMES`` of a
    micro-batch's frames (so the ROUTER's identity frame in front does not matter); ``count``,
    when given, is the header's ``new_nodes``. Zero-copy, read-only views; ValueError when the
    buffers do not agree with each other."""
    if len(frames) < INDUCTIVE_FRAMES:
        raise ValueError(f"an inductive micro-batch ends with {INDUCTIVE_FRAMES} frames, "
                         f"got {len(frames)} frames in all")
    flat, offsets, neighbors = (view(frames[-INDUCTIVE_FRAMES], np.float32),
                                view(frames[-2], np.int64), view(frames[-1], np.int64))
    m = offsets.size - 1
    if m <= 0 or (count is not None and m != count) or flat.size % m:
        raise ValueError(f"{flat.size} feature values and {offsets.size} offsets do not make "
                         f"{count if count is not None else m} rows")
    if offsets[0] != 0 or offsets[-1] != neighbors.size or (np.diff(offsets) < 0).any():
        raise ValueError("neighbour offsets must rise from 0 to the neighbour count")
    return InductiveNodes(flat.reshape(m, -1), offsets, neighbors)


class RequestError(msgspec.Struct, array_like=True, frozen=True):
    """Why request ``index`` of a micro-batch was not served (its rows in the reply are zeros)."""

    index: int
    code: str
    message: str
    status: int


class MicroBatchDone(msgspec.Struct, array_like=True):
    """Engine core → client. Frame after it: float32 [n_ids, dim] rows, one per requested
    position (absent when ``dim`` is 0, i.e. every request failed)."""

    seq: int
    dim: int
    errors: list[RequestError] = []
    #: per-batch stats, on exactly one micro-batch of each batch (so observers count once)
    stats: BatchStats | None = None
    #: ids the engine core holds from all its clients when it sends this (waiting, sampling,
    #: computing): lets each client spread load by what every client sent, not only its own
    engine_ids: int = 0
    #: the model and version that computed the rows ("" and 0 when none did)
    model: str = ""
    version: int = 0


class SampleTask(msgspec.Struct, array_like=True, frozen=True):
    """Engine core → CPU sampler. Frame after it: seeds int64."""

    task_id: int
    fanouts: list[int]
    seed: int


class SampleDone(msgspec.Struct, array_like=True, frozen=True):
    """CPU sampler → engine core. Frames after it: n_id int64, edge_index int32 [2, E],
    seed_index int64 (absent when ``error`` is set)."""

    task_id: int
    num_sampled_nodes: list[int]
    num_sampled_edges: list[int]
    sample_s: float
    error: str | None = None


class Control(msgspec.Struct, array_like=True, frozen=True):
    """Child process → supervisor: ``kind`` is ready, failed or heartbeat."""

    kind: str
    role: str
    index: int
    pid: int
    info: dict[str, Any] = {}


class WorkerInfo(msgspec.Struct, frozen=True):
    """One supervised process, as ``GET /v1/workers`` lists it."""

    role: str
    index: int
    pid: int | None
    alive: bool
    ready: bool
    restarts: int
    #: objects frozen at the end of start-up (``server.gc_freeze``); None before ready or when off
    gc_frozen_objects: int | None = None


class FrontDoorState(msgspec.Struct, frozen=True):
    """Main process → every HTTP front-end process, published ~10 times a second.

    ``engines`` is absent until the engine cores are up: a front-end then answers liveness, and
    503 ``not_ready`` to the rest. It carries what ``EngineEndpoints`` holds (a front-end builds
    its client from it) and the graph's size."""

    engines_ready: bool  # at least one engine core is up
    draining: bool
    workers: list[WorkerInfo]
    engines: dict[str, Any] | None = None
    num_features: int | None = None
    #: the living graph (docs/architecture.md, "The living graph"): acknowledged node count, node
    #: capacity (ids below it may exist by the time a request reaches an engine core) and
    #: acknowledged version; None when the daemon has no graph writer
    num_nodes: int | None = None
    node_capacity: int | None = None
    graph_version: int | None = None
    #: every model and version and its state (``ModelManager.published``); None before start
    models: dict[str, Any] | None = None


# ---- graph calls: front-end process → main process (the graph writer) ------------------------------
#: per op, the dtypes of its array frames, in order
GRAPH_OPS: dict[str, tuple[str, ...]] = {
    "add_edges": ("<i8", "<i8"),  # add [n, 2], remove [k, 2]
    "add_nodes": ("<f4",),  # features [m, F]
    "put_features": ("<i8", "<f4"),  # node_ids [n], features [n, F]
    "info": (),
    "compact": (),
    # the model repository (``ModelManager``): JSON parameters in ``GraphCall.params``
    "model_index": (),
    "model_load": (),
    "model_unload": (),
}


class GraphCall(msgspec.Struct, array_like=True, frozen=True):
    """Front-end → main process. Frames after it: the op's arrays (``GRAPH_OPS``), raw, each of
    the shape listed in ``shapes``; the writer validates their contents."""

    call_id: int  # unique per client; the reply carries it back
    op: str
    shapes: list[list[int]] = []
    #: ``time.time()`` after which the caller no longer waits: not started after it
    deadline_s: float = 0.0
    #: JSON-safe parameters (model calls)
    params: dict[str, Any] = {}


class GraphError(msgspec.Struct, array_like=True, frozen=True):
    code: str
    message: str
    status: int
    retry_after_s: float | None = None


class GraphReply(msgspec.Struct, array_like=True, frozen=True):
    """Main process → front-end: the writer's answer (JSON-safe) or why there is none."""

    call_id: int
    result: dict[str, Any] | None = None
    error: GraphError | None = None


def graph_frames(op: str, arrays: list[np.ndarray]) -> tuple[list[list[int]], list[np.ndarray]]:
    """Shapes and contiguous frames of ``op``'s arrays, in its dtypes."""
    dtypes = GRAPH_OPS[op]
    if len(arrays) != len(dtypes):
        raise ValueError(f"{op} takes {len(dtypes)} arrays, got {len(arrays)}")
    frames = [np.ascontiguousarray(a, dtype=dt) for a, dt in zip(arrays, dtypes, strict=True)]
    return [list(f.shape) for f in frames], frames


def graph_arrays(call: GraphCall, frames: list[Any]) -> list[np.ndarray]:
    """The arrays of a received call (views); ValueError when frames and shapes disagree."""
    dtypes = GRAPH_OPS.get(call.op)
    if dtypes is None:
        raise ValueError(f"unknown graph op {call.op!r}")
    if len(frames) != len(dtypes) or len(call.shapes) != len(dtypes):
        raise ValueError(f"{call.op} takes {len(dtypes)} array frames, got {len(frames)}")
    out = []
    for frame, dt, shape in zip(frames, dtypes, call.shapes, strict=True):
        arr = view(frame, np.dtype(dt))
        if arr.size != int(np.prod(shape, dtype=np.int64)) or min(shape, default=0) < 0:
            raise ValueError(f"{call.op}: a frame of {arr.size} values is not of shape {shape}")
        out.append(arr.reshape(shape))
    return out


# ---- model calls: main process → one engine core (its admin socket) ------------------------------
class ModelCall(msgspec.Struct, array_like=True, frozen=True):
    """``op``: load (``spec``: ``ModelSpec.to_dict()``), activate (``traffic``: version ->
    weight of model ``name``; versions not named take no unpinned requests), unload (``name``,
    ``version``: drained, then released), list."""

    call_id: int
    op: str
    name: str = ""
    version: int = 0
    spec: dict[str, Any] = {}
    traffic: dict[str, float] = {}
    default: str = ""
    timeout_s: float = 0.0


class ModelReply(msgspec.Struct, array_like=True, frozen=True):
    call_id: int
    ok: bool
    result: dict[str, Any] = {}
    error: str = ""


_ENCODER = msgspec.msgpack.Encoder()


def encode(header: msgspec.Struct) -> bytes:
    return _ENCODER.encode(header)


class Decoders:
    """One decoder per header type (msgspec decoders are reusable and not thread-bound)."""

    micro_batch = msgspec.msgpack.Decoder(MicroBatchHeader)
    done = msgspec.msgpack.Decoder(MicroBatchDone)
    task = msgspec.msgpack.Decoder(SampleTask)
    sample_done = msgspec.msgpack.Decoder(SampleDone)
    control = msgspec.msgpack.Decoder(Control)
    front_door = msgspec.msgpack.Decoder(FrontDoorState)
    graph_call = msgspec.msgpack.Decoder(GraphCall)
    graph_reply = msgspec.msgpack.Decoder(GraphReply)
    model_call = msgspec.msgpack.Decoder(ModelCall)
    model_reply = msgspec.msgpack.Decoder(ModelReply)


def view(frame: Any, dtype: Any) -> np.ndarray:
    """A read-only NumPy view of one received frame (zero-copy)."""
    buf = frame.buffer if hasattr(frame, "buffer") else frame
    return np.frombuffer(buf, dtype=dtype)

"""Wire format of the serving path: typed msgspec headers plus raw side buffers, over ZeroMQ.

Every message between a front-end client, an engine core and a CPU sampler is one ZeroMQ
multipart message: frame 0 is a msgpack header (a ``msgspec.Struct`` below), the remaining frames
are raw little-endian buffers (node ids, per-request lengths and deadlines, sampled subgraphs,
embeddings). Nothing is pickled, so a peer can never make this process run code, and a buffer is
never copied into a Python object: receivers view it with ``np.frombuffer``.

One message per micro-batch each way: a client sends the requests of one loop tick as one
:class:`MicroBatchHeader` (+ ids, lengths, deadlines) and gets one :class:`MicroBatchDone` (+ the
embedding rows of every requested position) back. Requests are identified by their position in
the micro-batch; request ids never leave the front-end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from quiver_serve.messages import BatchStats


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


#: ``seed`` value of a micro-batch whose requests asked for no seed
NO_SEED = -1


class MicroBatchHeader(msgspec.Struct, array_like=True, frozen=True):
    """Client → engine core. Frames after it: ids int64 [n_ids], lengths int32 [n_requests]
    (ids per request, in order), deadlines float64 [n_requests] (``time.time()`` instants)."""

    seq: int  # unique per client; the reply carries it back
    exact: bool
    seed: int  # NO_SEED, or the single seeded request's seed (seeded requests travel alone)
    #: ids this client has admitted and not yet answered (this micro-batch's included), divided
    #: among the engine cores it spreads them over: how many of its callers' ids this engine
    #: should expect, which the engine cannot see between two requests
    outstanding_ids: int = 0


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


def view(frame: Any, dtype: Any) -> np.ndarray:
    """A read-only NumPy view of one received frame (zero-copy)."""
    buf = frame.buffer if hasattr(frame, "buffer") else frame
    return np.frombuffer(buf, dtype=dtype)

"""The load generator's gRPC callers (KServe v2 ``GRPCInferenceService``): ``ModelInfer`` and
``ModelStreamInfer``, each over grpc.aio (protocols ``grpc``, ``grpc-stream``: a real gRPC
client's cost and behaviour) and over the lean HTTP/2 client of ``loadtest/h2_client.py``
(``grpc-h2``, ``grpc-stream-h2``: distinct bodies at about h2load's client CPU). Bodies are
serialised once before the run; ``await caller.call(i)`` returns a status of
``loadtest/status.py``. ``loadtest.protocols.make_caller`` picks the caller of a protocol."""

from __future__ import annotations

import asyncio
import collections
import itertools
from typing import Any

import numpy as np

from loadtest.status import OK

#: gRPC unary: TCP connections per load process at most, unless the target names a count
GRPC_MAX_CONNECTIONS = 128


async def once_per_slot(pending: dict[int, asyncio.Future[Any]], k: int, make: Any) -> Any:
    """``await make()`` for slot ``k`` (a connection or stream opened again), one attempt
    shared by every caller that finds the slot broken meanwhile."""
    attempt = pending.get(k)
    if attempt is None:
        attempt = pending[k] = asyncio.ensure_future(make())
        attempt.add_done_callback(lambda _: pending.pop(k, None))
    return await asyncio.shield(attempt)


def unary_connections(target: dict, limit: int) -> int:
    """gRPC unary's TCP connections in one load process: ``target["grpc_connections"]``, else
    one per caller, at most ``GRPC_MAX_CONNECTIONS``."""
    return max(1, min(limit, int(target.get("grpc_connections") or GRPC_MAX_CONNECTIONS)))


class GrpcCaller:
    """KServe v2 ``ModelInfer`` over grpc.aio; requests serialised once, answers read as bytes.
    ``target["grpc_connections"]`` channels (default: one per caller, at most
    ``GRPC_MAX_CONNECTIONS``), each on its own TCP connection, taken in turn: as wrk and h2load
    hold one connection per caller, so that the kernel spreads the callers over the front-end
    processes (one shared connection would load one front-end)."""

    METHOD = "/inference.GRPCInferenceService/ModelInfer"

    def __init__(self, target: dict, reqs: list[np.ndarray], limit: int,
                 exact: bool = False) -> None:
        self.bodies = encode_grpc(target["model"], reqs, exact)
        self.target, self.timeout_s = target["grpc_target"], target["timeout_s"]
        self.num_channels = unary_connections(target, limit)
        self.channels: list[Any] = []
        self.stubs: list[Any] = []
        self.turn = itertools.count()

    async def __aenter__(self) -> GrpcCaller:
        opened = await asyncio.gather(*[open_channel(self.target, self.timeout_s, True)
                                        for _ in range(self.num_channels)],
                                      return_exceptions=True)
        self.channels = [ch for ch in opened if not isinstance(ch, BaseException)]
        failed = [ch for ch in opened if isinstance(ch, BaseException)]
        if failed:
            await asyncio.gather(*[ch.close() for ch in self.channels])
            raise failed[0]
        self.stubs = [ch.unary_unary(self.METHOD) for ch in self.channels]  # bytes in and out
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.gather(*[ch.close() for ch in self.channels])

    async def call(self, i: int) -> str:
        import grpc

        stub = self.stubs[next(self.turn) % len(self.stubs)]
        try:
            await stub(self.bodies[i], timeout=self.timeout_s)
            return OK
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            return "timeout" if code == grpc.StatusCode.DEADLINE_EXCEEDED else f"grpc:{code.name}"


class GrpcH2Caller:
    """KServe v2 ``ModelInfer`` over ``loadtest/h2_client.py`` (protocol ``grpc-h2``): the same
    bodies and connections as :class:`GrpcCaller` (one per caller, at most
    ``GRPC_MAX_CONNECTIONS``) at a fraction of grpc.aio's client CPU. A connection that broke
    is opened again by the next call on it; calls past ``timeout_s`` end as ``"timeout"``."""

    METHOD = GrpcCaller.METHOD

    def __init__(self, target: dict, reqs: list[np.ndarray], limit: int,
                 exact: bool = False) -> None:
        self.bodies = encode_grpc(target["model"], reqs, exact)
        host, _, port = target["grpc_target"].rpartition(":")
        self.host, self.port, self.timeout_s = host, int(port), float(target["timeout_s"])
        self.num_conns = unary_connections(target, limit)
        self.conns: list[Any] = []
        self.turn = itertools.count()
        #: (deadline, connection, its key for the call, the call's future), oldest first
        self.deadlines: collections.deque[tuple[float, Any, Any, asyncio.Future[str]]] = \
            collections.deque()
        self.sweeper: asyncio.Task[None] | None = None
        self.reopening: dict[int, asyncio.Future[Any]] = {}

    async def _connect(self) -> Any:
        from loadtest.h2_client import connect

        return await connect(self.host, self.port, self.METHOD, self.timeout_s)

    async def __aenter__(self) -> GrpcH2Caller:
        opened = await asyncio.gather(*[self._connect() for _ in range(self.num_conns)],
                                      return_exceptions=True)
        self.conns = [c for c in opened if not isinstance(c, BaseException)]
        failed = [c for c in opened if isinstance(c, BaseException)]
        if failed:
            self._close()
            raise failed[0]
        self.sweeper = asyncio.get_running_loop().create_task(self._sweep())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.sweeper is not None:
            self.sweeper.cancel()
        self._close()

    def _close(self) -> None:
        for conn in self.conns:
            if conn.transport is not None:
                conn.transport.close()

    async def call(self, i: int) -> str:
        k = next(self.turn) % len(self.conns)
        conn = self.conns[k]
        if conn.broken is not None:
            try:
                conn = await self._reopen(k)
            except ConnectionError:
                return "conn:ConnectionError"
        key, fut = self._send(conn, i)
        self.deadlines.append((asyncio.get_running_loop().time() + self.timeout_s, conn, key, fut))
        return await fut

    def _send(self, conn: Any, i: int) -> tuple[Any, asyncio.Future[str]]:
        """Request ``i`` on ``conn``: the key ``conn.expire`` takes, and the status's future."""
        return conn.call(self.bodies[i])

    async def _reopen(self, k: int) -> Any:
        """Connection ``k`` again (one attempt shared by its callers)."""
        conn = await once_per_slot(self.reopening, k, self._connect)
        if self.conns[k] is not conn:
            if self.conns[k].transport is not None:
                self.conns[k].transport.close()
            self.conns[k] = conn
        return conn

    async def _sweep(self) -> None:
        """Every 0.1 s: calls past their deadline end as "timeout" (the oldest come first)."""
        loop, deadlines = asyncio.get_running_loop(), self.deadlines
        while True:
            await asyncio.sleep(0.1)
            now = loop.time()
            while deadlines and (deadlines[0][3].done() or deadlines[0][0] <= now):
                _, conn, key, fut = deadlines.popleft()
                if not fut.done():
                    conn.expire(key)


class GrpcH2StreamCaller(GrpcH2Caller):
    """KServe v2 ``ModelStreamInfer`` over ``loadtest/h2_client.py`` (protocol
    ``grpc-stream-h2``): as :class:`GrpcStreamCaller` (this process's requests pipelined over
    ``min(callers, target["grpc_streams"] or 8)`` streams, each on its own connection, taken in
    turn; a stream that ended is opened again by the next request on it) at a fraction of
    grpc.aio's client CPU."""

    METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"

    def __init__(self, target: dict, reqs: list[np.ndarray], limit: int,
                 exact: bool = False) -> None:
        super().__init__(target, reqs, limit, exact)
        self.num_conns = max(1, min(limit, int(target.get("grpc_streams") or 8)))
        self.seq = itertools.count()

    async def _connect(self) -> Any:
        from loadtest.h2_client import H2StreamClient, connect

        return await connect(self.host, self.port, self.METHOD, self.timeout_s, H2StreamClient)

    def _send(self, stream: Any, i: int) -> tuple[Any, asyncio.Future[str]]:
        request_id = str(next(self.seq))
        return request_id, stream.send(request_id, _id_field(request_id) + self.bodies[i])


def encode_grpc(model: str, reqs: list[np.ndarray], exact: bool = False) -> list[bytes]:
    """Serialised ``ModelInferRequest``s (no ``id``: a stream prepends one) of the requests."""
    from quiver_serve.frontend.grpc.proto import message

    req_cls, inp_cls = message("ModelInferRequest"), message("ModelInferRequest.InferInputTensor")
    bodies = []
    for ids in reqs:
        inp = inp_cls(name="node_ids", datatype="INT64", shape=[int(ids.size)])
        msg = req_cls(model_name=model, inputs=[inp],
                      raw_input_contents=[np.ascontiguousarray(ids, "<i8").tobytes()])
        if exact:
            msg.parameters["exact"].bool_param = True
        bodies.append(msg.SerializeToString())
    return bodies


async def open_channel(target: str, timeout_s: float, own_connection: bool = False) -> Any:
    """A connected grpc.aio channel (ConnectionError when not ready in ``timeout_s``);
    ``own_connection``: its own TCP connection, not one shared with this process's other
    channels to the same target (the kernel then spreads them over the front-ends)."""
    import grpc

    options = [("grpc.max_receive_message_length", 64 << 20)]
    if own_connection:
        options.append(("grpc.use_local_subchannel_pool", 1))
    channel = grpc.aio.insecure_channel(target, options=options)
    try:  # connect before the point starts, not inside its window
        await asyncio.wait_for(channel.channel_ready(), timeout=timeout_s)
    except asyncio.TimeoutError:
        await channel.close()
        raise ConnectionError(f"gRPC endpoint {target} not reachable in {timeout_s:g} s") from None
    return channel


class _Stream:
    """One ``ModelStreamInfer`` call on its own connection: a writer task (one write at a time,
    as gRPC allows), a reader task that resolves the waiting requests by ``id``."""

    METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"

    def __init__(self, channel: Any) -> None:
        from quiver_serve.frontend.grpc.proto import message

        self.channel, self.parse = channel, message("ModelStreamInferResponse").FromString
        self.call = channel.stream_stream(self.METHOD)()  # bytes in, bytes out
        self.loop = asyncio.get_running_loop()
        #: request id -> (future of its status, deadline in loop time); deadlines rise in order
        self.waiting: dict[str, tuple[asyncio.Future[str], float]] = {}
        self.out: collections.deque[bytes] = collections.deque()  # at most the callers' count
        self.wake: asyncio.Future[None] | None = None
        self.broken: str | None = None  # the status of every request once the stream ended
        self.tasks = [self.loop.create_task(self._write()), self.loop.create_task(self._read())]

    def send(self, request_id: str, body: bytes, timeout_s: float) -> asyncio.Future[str]:
        fut = self.loop.create_future()
        if self.broken is not None:
            fut.set_result(self.broken)
            return fut
        self.waiting[request_id] = (fut, self.loop.time() + timeout_s)
        self.out.append(body)
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)
        return fut

    async def _write(self) -> None:
        try:
            while True:
                while not self.out:
                    self.wake = self.loop.create_future()
                    await self.wake  # a request to send (or the caller's end cancels this)
                await self.call.write(self.out.popleft())
        except Exception as exc:  # noqa: BLE001 - the stream ended: every waiting request fails
            self._end(f"conn:{type(exc).__name__}")

    async def _read(self) -> None:
        import grpc

        try:
            while True:
                raw = await self.call.read()  # an answer, or EOF (the server ended the stream)
                if raw is grpc.aio.EOF:
                    self._end("conn:EOF")
                    return
                msg = self.parse(raw)
                waiter = self.waiting.pop(msg.infer_response.id, None)
                if waiter is not None and not waiter[0].done():
                    waiter[0].set_result("stream:error" if msg.error_message else OK)
        except grpc.aio.AioRpcError as exc:
            self._end(f"grpc:{exc.code().name}")

    def expire(self, now: float) -> None:
        """Answer "timeout" for requests past their deadline (the oldest come first)."""
        while self.waiting:
            request_id, (fut, deadline) = next(iter(self.waiting.items()))
            if deadline > now:
                return
            del self.waiting[request_id]
            if not fut.done():
                fut.set_result("timeout")

    def _end(self, status: str) -> None:
        self.broken = self.broken or status
        waiting, self.waiting = self.waiting, {}
        for fut, _ in waiting.values():
            if not fut.done():
                fut.set_result(self.broken)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.call.cancel()
        self._end("conn:closed")
        await self.channel.close()


class GrpcStreamCaller:
    """KServe v2 ``ModelStreamInfer``: this process's requests pipelined over
    ``min(concurrency, target["grpc_streams"] or 8)`` bidirectional streams, each on its own
    connection (so the kernel spreads them over the front-end processes), taken in turn. A
    stream that ends (its front-end went away) is opened again by the next request on it."""

    def __init__(self, target: dict, reqs: list[np.ndarray], limit: int,
                 exact: bool = False) -> None:
        self.bodies = encode_grpc(target["model"], reqs, exact)
        self.target, self.timeout_s = target["grpc_target"], target["timeout_s"]
        self.num_streams = max(1, min(limit, int(target.get("grpc_streams") or 8)))
        self.streams: list[_Stream] = []
        self.turn, self.seq = itertools.count(), itertools.count()
        self.sweeper: asyncio.Task[None] | None = None
        self.reopening: dict[int, asyncio.Future[_Stream]] = {}

    async def __aenter__(self) -> GrpcStreamCaller:
        channels = await asyncio.gather(*[open_channel(self.target, self.timeout_s, True)
                                          for _ in range(self.num_streams)])
        self.streams = [_Stream(ch) for ch in channels]
        self.sweeper = asyncio.get_running_loop().create_task(self._sweep())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.sweeper is not None:
            self.sweeper.cancel()
        await asyncio.gather(*[s.close() for s in self.streams], return_exceptions=True)

    async def call(self, i: int) -> str:
        k = next(self.turn) % self.num_streams
        stream = self.streams[k]
        if stream.broken is not None:
            try:
                stream = await self._reopen(k)
            except ConnectionError:
                return "conn:ConnectionError"
        request_id = str(next(self.seq))
        return await stream.send(request_id, _id_field(request_id) + self.bodies[i],
                                 self.timeout_s)

    async def _reopen(self, k: int) -> _Stream:
        """Stream ``k`` again, on a new connection (one attempt shared by its callers)."""
        return await once_per_slot(self.reopening, k, lambda: self._open_again(k))

    async def _open_again(self, k: int) -> _Stream:
        old = self.streams[k]
        self.streams[k] = _Stream(await open_channel(self.target, self.timeout_s, True))
        await old.close()
        return self.streams[k]

    async def _sweep(self) -> None:
        """Deadlines: every 0.1 s the requests past their timeout are answered "timeout"."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(0.1)
            now = loop.time()
            for stream in self.streams:
                stream.expire(now)


def _id_field(request_id: str) -> bytes:
    """``ModelInferRequest.id`` (field 3) on the wire; prepended to a serialised request."""
    from quiver_serve.frontend.grpc.proto import varint

    raw = request_id.encode()
    return b"\x1a" + varint(len(raw)) + raw

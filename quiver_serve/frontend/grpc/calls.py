"""The KServe gRPC endpoint's calls on ``streams.py``'s streams, and ``start()``.

Each stream's ``:path`` picks its call:

* ``ModelInfer`` (:class:`InferCall`) is answered inside the connection's callbacks, as the HTTP
  hot routes are: the request is parsed when its stream ends, submitted to the loop's engine
  client, and the future's done-callback writes the answer (headers, one DATA frame of the
  hand-written ``ModelInferResponse`` whose rows are the engine's array, the trailers) with one
  ``writelines``. No task, no coroutine. A ``grpc-timeout`` shortens the request's deadline
  (``timeout_ms``); a stream the client resets cancels the request in the engine client.
* ``ModelStreamInfer`` (:class:`StreamCall`) runs ``stream_infer.StreamSession`` over the stream:
  the requests are read as the session asks for them, and the stream's window is given back
  only for requests read, so a client that sends faster than it is answered is held by HTTP/2
  flow control.
* every other RPC (:class:`UnaryCall`: health, metadata, the repository's admin calls) runs
  ``service.KServeGrpc``'s coroutine in a task, with a context that has what those use
  (``abort``, ``invocation_metadata``, ``peer``).

Errors are gRPC statuses with the daemon's messages (``status.CODES``); a request that is
not gRPC (no ``application/grpc`` content type, not a POST, an unknown method) is answered
with a status naming what was wrong, never a dropped connection.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from typing import Any

from google.protobuf.message import DecodeError

from quiver_serve import errors
from quiver_serve.frontend.fastpath import Submitted, answer_of, submit_ids
from quiver_serve.frontend.grpc import proto as gp
from quiver_serve.frontend.grpc.server import H2Server
from quiver_serve.frontend.grpc.service import UNARY_ENDPOINT, KServeGrpc, infer_args
from quiver_serve.frontend.grpc.status import GrpcStatus, status_for
from quiver_serve.frontend.grpc.streams import H2Stream
from quiver_serve.frontend.guards import Plane, Tokens, authorize

log = logging.getLogger(__name__)

_PREFIX = f"/{gp.SERVICE}/"
_INFER_REQUEST = gp.message("ModelInferRequest")
#: a streamed call's answers queued beyond the client's windows before its writer waits
STREAM_HIGH_WATER_BYTES = 1 << 20
_TIMEOUT_UNITS_MS = {"H": 3_600_000.0, "M": 60_000.0, "S": 1000.0, "m": 1.0, "u": 1e-3,
                     "n": 1e-6}


class Aborted(Exception):
    """``context.abort(code, message)``: the call ends with that status."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = GrpcStatus(code)
        self.message = message


def status_of(exc: errors.ServeError) -> GrpcStatus:
    return status_for(exc.info.status)


def grpc_timeout_ms(raw: bytes | None) -> float | None:
    """A ``grpc-timeout`` header (``<digits><H|M|S|m|u|n>``) in ms; None when absent or
    malformed (the request's own ``timeout_ms`` then stands)."""
    if not raw or len(raw) > 9:
        return None
    digits, unit = raw[:-1], chr(raw[-1])
    if not digits.isdigit() or unit not in _TIMEOUT_UNITS_MS:
        return None
    return int(digits) * _TIMEOUT_UNITS_MS[unit]


class CallContext:
    """What ``KServeGrpc``'s coroutines and ``StreamSession`` use of a grpc.aio context."""

    def __init__(self, stream: H2Stream) -> None:
        self.stream = stream

    async def abort(self, code: int, details: str) -> None:
        raise Aborted(code, details)

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in self.stream.headers
                if not k.startswith(b":")]

    def peer(self) -> str:
        return self.stream.conn.peer

    async def write(self, data: bytes) -> None:
        """One answer message (``write_many``)."""
        await self.write_many([data])

    async def write_many(self, messages: list[bytes]) -> None:
        """Answer messages in one write; waits while the client's windows hold too much of this
        stream's answers (a stalled client closes the connection, which ends the wait)."""
        stream = self.stream
        if stream.done:
            raise ConnectionError("the stream is closed")
        for data in messages:
            stream.send_message([data], len(data), flush=False)
        stream.conn.flush(stream)
        if stream.out_bytes > STREAM_HIGH_WATER_BYTES:
            await stream.wait_drained()
            if stream.done and stream.out_bytes:
                raise ConnectionError("the stream closed before its answers were sent")


class GrpcFront:
    """The dispatcher: ``on_request(stream)`` -> the stream's call (module docstring)."""

    def __init__(self, state: Any, token: str | None, admin_token: str | None = None) -> None:
        self.state = state
        self.servicer = KServeGrpc(state, token, admin_token)
        self.tokens = Tokens.of(token, admin_token)
        self.observe = getattr(state, "observe_request", None)
        self.tasks: set[asyncio.Task[Any]] = set()

    def on_request(self, stream: H2Stream) -> Any:
        path = (stream.header(b":path") or b"").decode("latin-1")
        content_type = stream.header(b"content-type") or b""
        if stream.header(b":method") != b"POST" or not content_type.startswith(
                b"application/grpc"):
            stream.finish(GrpcStatus.INVALID_ARGUMENT,
                          "a gRPC call is a POST with content-type application/grpc")
            return None
        encoding = stream.header(b"grpc-encoding")
        if encoding not in (None, b"identity"):
            stream.finish(GrpcStatus.UNIMPLEMENTED, f"grpc-encoding {encoding.decode('latin-1')!r}"
                                                    " is not supported (identity only)")
            return None
        method = path[len(_PREFIX):] if path.startswith(_PREFIX) else ""
        if method == "ModelInfer":
            return InferCall(self)
        if method in gp.STREAMS:
            return StreamCall(self, stream, method)
        if method in gp.RPCS:
            return UnaryCall(self, method)
        stream.finish(GrpcStatus.UNIMPLEMENTED, f"unknown method {path!r}")
        return None

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def authorised(self, stream: H2Stream) -> bool:
        """The data plane's token (``guards.authorize``) in the stream's headers."""
        return authorize(Plane.DATA, stream.header(b"authorization") or b"", None,
                         self.tokens) is None


class _UnaryRequest:
    """A unary call's request: the last message read, and how many came (one is right)."""

    __slots__ = ("payload", "count")

    def __init__(self) -> None:
        self.payload: bytes | None = None
        self.count = 0

    def message(self, stream: H2Stream, payload: bytes) -> None:
        stream.return_window(len(payload) + 5)
        self.payload, self.count = payload, self.count + 1


class InferCall(_UnaryRequest):
    """One ``ModelInfer``: parsed when the request ends, answered from the future's callback."""

    __slots__ = ("front", "sub", "req_id", "t0_s")

    def __init__(self, front: GrpcFront) -> None:
        super().__init__()
        self.front = front
        self.sub: Submitted | None = None
        self.req_id = ""
        self.t0_s = time.perf_counter()

    def end(self, stream: H2Stream) -> None:
        if self.count != 1:
            self._refuse(stream, GrpcStatus.INVALID_ARGUMENT, 400,
                         f"ModelInfer takes exactly one request message, got {self.count}")
            return
        if not self.front.authorised(stream):
            self._refuse(stream, GrpcStatus.UNAUTHENTICATED, 401, "missing or wrong bearer token")
            return
        try:
            req = _INFER_REQUEST.FromString(self.payload)
            self.payload = None
            a = infer_args(req)
            timeout_ms, deadline_ms = a.timeout_ms, grpc_timeout_ms(stream.header(b"grpc-timeout"))
            if deadline_ms is not None:
                timeout_ms = deadline_ms if timeout_ms is None else min(timeout_ms, deadline_ms)
            self.req_id = req.id
            self.sub = submit_ids(self.front.state, a.ids, a.exact, a.seed, timeout_ms,
                                  a.min_version, None, a.model, a.version, a.node_type)
        except DecodeError as exc:
            self._refuse(stream, GrpcStatus.INVALID_ARGUMENT, 400,
                         f"not a ModelInferRequest message: {exc}")
            return
        except errors.ServeError as exc:
            self._refuse(stream, status_of(exc), exc.info.status, exc.info.message)
            return
        except Exception as exc:  # noqa: BLE001 - a bug answers INTERNAL with an error id
            info = errors.internal_error(exc, "gRPC ModelInfer", log).info
            self._refuse(stream, GrpcStatus.INTERNAL, info.status, info.message)
            return
        self.sub.future.add_done_callback(functools.partial(self._answered, stream))

    def _answered(self, stream: H2Stream, future: Any) -> None:
        if stream.done:
            return
        try:
            if future.cancelled():
                raise errors.ServeError("cancelled", "request cancelled", 499)
            answer = answer_of(future.result(), self.sub)  # type: ignore[arg-type]
            parts, size = gp.infer_response_parts(answer.model, str(answer.version),
                                                  self.req_id, gp.as_rows(answer.rows))
        except errors.ServeError as exc:
            self._refuse(stream, status_of(exc), exc.info.status, exc.info.message)
            return
        except Exception as exc:  # noqa: BLE001 - as in end()
            info = errors.internal_error(exc, "gRPC ModelInfer", log).info
            self._refuse(stream, GrpcStatus.INTERNAL, info.status, info.message)
            return
        stream.send_message(parts, size, flush=False)
        stream.finish()  # headers, DATA and trailers in one write
        self._observe(200)

    def cancel(self, stream: H2Stream) -> None:
        """The client reset the stream or went away: nobody listens, do not compute it."""
        sub = self.sub
        if sub is not None and not sub.future.done():
            self.front.state.pipeline.cancel(sub.request_id)
            self._observe(499)

    def _refuse(self, stream: H2Stream, code: int, status: int, message: str) -> None:
        stream.finish(code, message)
        self._observe(status)

    def _observe(self, status: int) -> None:
        if self.front.observe is not None:
            self.front.observe(UNARY_ENDPOINT, status, time.perf_counter() - self.t0_s)


class UnaryCall(_UnaryRequest):
    """Any other unary RPC: ``KServeGrpc``'s coroutine in a task once the request is read."""

    __slots__ = ("front", "method", "task")

    def __init__(self, front: GrpcFront, method: str) -> None:
        super().__init__()
        self.front, self.method = front, method
        self.task: asyncio.Task[Any] | None = None

    def end(self, stream: H2Stream) -> None:
        if self.count != 1:
            stream.finish(GrpcStatus.INVALID_ARGUMENT,
                          f"{self.method} takes exactly one request message, got {self.count}")
            return
        self.task = self.front.spawn(self._run(stream))

    async def _run(self, stream: H2Stream) -> None:
        req_type, resp_type = gp.RPCS[self.method]
        try:
            req = gp.message(req_type).FromString(self.payload)
            resp = await getattr(self.front.servicer, self.method)(req, CallContext(stream))
            data = resp.SerializeToString()
        except DecodeError as exc:
            stream.finish(GrpcStatus.INVALID_ARGUMENT, f"not a {req_type} message: {exc}")
            return
        except Aborted as exc:
            stream.finish(exc.code, exc.message)
            return
        except Exception as exc:  # noqa: BLE001 - a bug answers INTERNAL with an error id
            stream.finish(GrpcStatus.INTERNAL, errors.internal_error(exc, f"gRPC {self.method}",
                                                           log).info.message)
            return
        stream.send_message([data], len(data))
        stream.finish()

    def cancel(self, stream: H2Stream) -> None:
        if self.task is not None:
            self.task.cancel()


class StreamCall:
    """``ModelStreamInfer``: ``StreamSession`` reads this stream's requests as it asks."""

    def __init__(self, front: GrpcFront, stream: H2Stream, method: str) -> None:
        self.front, self.method = front, method
        self.queue: deque[bytes] = deque()
        self.ended = False
        self.waiter: asyncio.Future[None] | None = None
        self.task = front.spawn(self._run(stream))

    def message(self, stream: H2Stream, payload: bytes) -> None:
        self.queue.append(payload)  # bounded by the stream's window, given back as read
        self._wake()

    def end(self, stream: H2Stream) -> None:
        self.ended = True
        self._wake()

    def cancel(self, stream: H2Stream) -> None:
        self.task.cancel()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def _requests(self, stream: H2Stream) -> Any:
        req_type = gp.message(gp.STREAMS[self.method][0])
        loop = asyncio.get_running_loop()
        while True:
            while not self.queue:
                if self.ended:
                    return
                self.waiter = loop.create_future()
                await self.waiter
            payload = self.queue.popleft()
            stream.return_window(len(payload) + 5)
            try:
                req = req_type.FromString(payload)
            except DecodeError as exc:
                raise Aborted(GrpcStatus.INVALID_ARGUMENT,
                              f"not a ModelInferRequest message: {exc}") from None
            yield req

    async def _run(self, stream: H2Stream) -> None:
        try:
            await getattr(self.front.servicer, self.method)(self._requests(stream),
                                                            CallContext(stream))
        except Aborted as exc:
            stream.finish(exc.code, exc.message)
            return
        except asyncio.CancelledError:
            stream.finish(GrpcStatus.CANCELLED, "the call was cancelled")
            raise
        except Exception as exc:  # noqa: BLE001 - a bug answers INTERNAL with an error id
            stream.finish(GrpcStatus.INTERNAL, errors.internal_error(exc, f"gRPC {self.method}",
                                                           log).info.message)
            return
        stream.finish()


async def start(state: Any, host: str, port: int, token: str | None,
                admin_token: str | None = None) -> H2Server:
    """The KServe gRPC endpoint on the running loop, bound to ``host:port`` (``SO_REUSEPORT``:
    every front-end process binds it; balance is per connection)."""
    front = GrpcFront(state, token, admin_token)
    metrics = getattr(state, "metrics", None)
    server = H2Server(front.on_request, state.cfg.server.max_body_bytes,
                      state.cfg.server.grpc_limits,
                      None if metrics is None else metrics.on_grpc_cut_off)
    bound = await server.start(host, port)
    log.info("KServe v2 gRPC on %s:%d (ModelInfer, ModelStreamInfer)", host, bound)
    return server

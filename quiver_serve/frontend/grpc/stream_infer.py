"""KServe v2 ``ModelStreamInfer``: many inference requests on one bidirectional gRPC stream.

As Triton has it: a stream of ``ModelInferRequest`` in, a stream of ``ModelStreamInferResponse``
out, one answer per request, each carrying the request's ``id`` (answers come in the order
they finish, not the order asked). A request's failure (ids out of range, an unknown model, too
many ids, the server full) is that answer's ``error_message`` (the unary call's message), with
the request's model, version and id in ``infer_response``; the stream goes on. The bearer token
is checked once, when the stream opens.

One session per stream: the handler's task reads requests and submits each to the event loop's
engine client as soon as it arrives (no task per request: the answer is encoded in the
future's done-callback), and one writer task writes the answers. At most
``MAX_INFLIGHT_PER_STREAM`` requests are read and not yet answered; at that bound reading
stops until an answer is written, so a client that sends faster than it reads is slowed by
gRPC's flow control, not buffered. When the client cancels, or the stream fails, the requests
still pending are cancelled in the pipeline. When the client half-closes, the requests read
are answered (each has its deadline) and the stream ends OK.

Waits: a request's answer is bounded by its deadline; an answer write that makes no progress
for ``WRITE_STALL_S`` (a client that stopped reading) ends the stream; the wait for the
client's next message is the one open wait of any connection (gRPC keepalive ends it for a
peer that is gone, the connection's keepalive PING, ``connection.py``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

from quiver_serve import errors
from quiver_serve.frontend.fastpath import Submitted, answer_of, submit_ids
from quiver_serve.frontend.grpc import proto as gp

log = logging.getLogger(__name__)
#: the request-latency metric's endpoint label of a streamed request
STREAM_ENDPOINT = "grpc ModelStreamInfer"

#: requests read from one stream and not yet answered; reading waits at this bound
MAX_INFLIGHT_PER_STREAM = 1024
#: an answer write blocked this long (the client does not read) ends the stream
WRITE_STALL_S = 60.0
#: how often a stream checks its writer for a stall
STALL_CHECK_S = 5.0


class StreamSession:
    """One ``ModelStreamInfer`` call: ``await StreamSession(...).run(requests)``.

    ``parse(req)`` turns a request into ``service.InferArgs`` (raising ServeError);
    ``state`` is the front-end's ``ServerState`` (its pipeline, views, config)."""

    def __init__(self, state: Any, ctx: Any, parse: Any,
                 max_inflight: int = MAX_INFLIGHT_PER_STREAM,
                 write_stall_s: float = WRITE_STALL_S) -> None:
        self.state, self.ctx, self.parse = state, ctx, parse
        self.max_inflight, self.write_stall_s = max_inflight, write_stall_s
        self.loop = asyncio.get_running_loop()
        #: pipeline request id -> its submission, for the requests not answered yet
        self.pending: dict[str, Submitted] = {}
        #: encoded answers waiting for the writer (at most ``max_inflight``: one per slot)
        self.out: collections.deque[bytes] = collections.deque()
        self.in_flight = 0  # requests read and not yet written
        self.reading_done = False
        self.closed = False
        self.write_since_s: float | None = None  # loop time the current write began
        self._writer_wake: asyncio.Future[None] | None = None
        self._reader_wake: asyncio.Future[None] | None = None
        self._handler: asyncio.Task[Any] | None = None
        self._stall_timer: asyncio.TimerHandle | None = None

    async def run(self, requests: Any) -> None:
        """Read, submit and answer until the client half-closes and every answer is written;
        cancelled (the client went away) or failed, it cancels what is pending."""
        self._handler = asyncio.current_task()
        writer = self.loop.create_task(self._write_loop())
        writer.add_done_callback(self._writer_done)
        self._stall_timer = self.loop.call_later(STALL_CHECK_S, self._check_stall)
        try:
            async for req in requests:
                if self.in_flight >= self.max_inflight:
                    await self._wait_slot()
                self.in_flight += 1
                self._start(req)
            self.reading_done = True
            self._wake_writer()
            await writer  # every request read is answered (each has a deadline)
        finally:
            self._close(writer)

    def _start(self, req: Any) -> None:
        """Check and submit one request; a refusal is its answer at once."""
        rid, model, version = req.id, req.model_name, req.model_version
        t0_s = time.perf_counter()
        try:
            a = self.parse(req)
            sub = submit_ids(self.state, a.ids, a.exact, a.seed, a.timeout_ms, a.min_version,
                             None, a.model, a.version, a.node_type)
        except errors.ServeError as exc:
            self._push(gp.stream_error(exc.info.message, model, version, rid))
            self._observe(exc.info.status, t0_s)
            return
        except Exception as exc:  # noqa: BLE001 - one request's bug must not end the stream
            info = errors.internal_error(exc, "gRPC ModelStreamInfer", log).info
            self._push(gp.stream_error(info.message, model, version, rid))
            self._observe(info.status, t0_s)
            return
        self.pending[sub.request_id] = sub
        sub.future.add_done_callback(
            lambda fut: self._finished(fut, sub, rid, model, version, t0_s))

    def _finished(self, fut: Any, sub: Submitted, rid: str, model: str, version: str,
                  t0_s: float) -> None:
        """The engine answered (or the request failed): encode the answer for the writer."""
        self.pending.pop(sub.request_id, None)
        if self.closed:
            self._observe(499, t0_s)
            return
        status = 200
        try:
            if fut.cancelled():
                raise errors.ServeError("cancelled", "request cancelled", 499)
            answer = answer_of(fut.result(), sub)
            data = gp.stream_response(answer.model, str(answer.version), rid, answer.rows)
        except errors.ServeError as exc:
            status = exc.info.status
            data = gp.stream_error(exc.info.message, model, version, rid)
        except Exception as exc:  # noqa: BLE001 - as in _start
            info = errors.internal_error(exc, "gRPC ModelStreamInfer", log).info
            status = info.status
            data = gp.stream_error(info.message, model, version, rid)
        self._push(data)
        self._observe(status, t0_s)

    def _observe(self, status: int, t0_s: float) -> None:
        """One streamed request in the request-latency metric (when the state keeps one)."""
        observe = getattr(self.state, "observe_request", None)
        if observe is not None:
            observe(STREAM_ENDPOINT, status, time.perf_counter() - t0_s)

    def _push(self, data: bytes) -> None:
        self.out.append(data)
        self._wake_writer()

    async def _write_loop(self) -> None:
        """Write answers as they come (all those waiting at once when the context can:
        ``write_many``); ends once reading is done and nothing is in flight."""
        out, write = self.out, self.ctx.write
        write_many = getattr(self.ctx, "write_many", None)
        while True:
            while not out:
                if self.reading_done and self.in_flight == 0:
                    return
                self._writer_wake = self.loop.create_future()
                await self._writer_wake  # an answer (each request has a deadline) or the end
            self.write_since_s = self.loop.time()
            if write_many is not None:
                batch = list(out)
                out.clear()
                await write_many(batch)
            else:
                batch = [out.popleft()]
                await write(batch[0])
            self.write_since_s = None
            self.in_flight -= len(batch)
            if self._reader_wake is not None and not self._reader_wake.done():
                self._reader_wake.set_result(None)

    async def _wait_slot(self) -> None:
        """Until an answer is written (bounded: a stalled writer ends the stream)."""
        while self.in_flight >= self.max_inflight:
            self._reader_wake = self.loop.create_future()
            await self._reader_wake

    def _wake_writer(self) -> None:
        if self._writer_wake is not None and not self._writer_wake.done():
            self._writer_wake.set_result(None)

    def _writer_done(self, task: asyncio.Task[None]) -> None:
        """A failed write (the client went away) ends the reading too."""
        if task.cancelled() or task.exception() is None or self.closed:
            return
        log.debug("gRPC stream: writing an answer failed: %r", task.exception())
        if self._handler is not None:
            self._handler.cancel()

    def _check_stall(self) -> None:
        """Every STALL_CHECK_S: a write blocked longer than ``write_stall_s`` ends the stream."""
        if self.closed:
            return
        since = self.write_since_s
        if since is not None and self.loop.time() - since > self.write_stall_s:
            log.warning("gRPC stream from %s: an answer waited %.0f s to be written (the client "
                        "does not read); ending the stream", self.ctx.peer(), self.write_stall_s)
            if self._handler is not None:
                self._handler.cancel()
            return
        self._stall_timer = self.loop.call_later(STALL_CHECK_S, self._check_stall)

    def _close(self, writer: asyncio.Task[None]) -> None:
        """Stop writing and cancel in the pipeline every request still pending."""
        self.closed = True
        if self._stall_timer is not None:
            self._stall_timer.cancel()
        writer.cancel()
        pending, self.pending = self.pending, {}
        for request_id in pending:
            self.state.pipeline.cancel(request_id)
        self.out.clear()

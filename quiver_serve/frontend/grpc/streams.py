"""One gRPC call's HTTP/2 stream (:class:`H2Stream`) and what its call is told (:class:`Call`).

``connection.py`` creates a stream per request's HEADERS and hands its messages to the call
(``calls.py``); the call answers through the stream (``send_message``, ``finish``), which
queues what the client's windows do not allow yet and asks the connection to flush.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, Protocol

from quiver_serve.frontend.grpc.frames import (
    MESSAGE_PREFIX,
    OK_TRAILERS,
    RESPONSE_HEADERS,
    status_block,
    window_update,
)


class Call(Protocol):
    """What a stream's call is told (``calls.py`` has the implementations)."""

    def message(self, stream: H2Stream, payload: bytes) -> None: ...

    def end(self, stream: H2Stream) -> None: ...

    def cancel(self, stream: H2Stream) -> None: ...


class H2Stream:
    """One gRPC call's stream: what came in (headers, the bytes of a message not yet whole) and
    what waits to go out (DATA beyond the client's windows, then the trailers). ``conn`` is its
    ``connection.H2Connection``."""

    __slots__ = ("sid", "conn", "headers", "buf", "recv_window", "unreturned", "send_window",
                 "out", "out_bytes", "trailers", "headers_sent", "remote_closed", "done", "call",
                 "drained")

    def __init__(self, sid: int, conn: Any, headers: list[tuple[bytes, bytes]],
                 send_window: int) -> None:
        self.sid, self.conn, self.headers = sid, conn, headers
        self.buf = bytearray()
        self.recv_window = conn.recv_stream_window
        self.unreturned = 0  # bytes taken by the call not yet given back as stream window
        self.send_window = send_window
        self.out: deque[Any] = deque()  # DATA payload parts not yet sent
        self.out_bytes = 0
        self.trailers: bytes | None = None  # sent once ``out`` is empty
        self.headers_sent = False
        self.remote_closed = False
        self.done = False  # trailers sent or stream reset: nothing more goes out
        self.call: Call | None = None
        self.drained: asyncio.Future[None] | None = None

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    # ---- sending (the call's side) -------------------------------------------------------------
    def send_message(self, parts: list[Any], size: int, flush: bool = True) -> None:
        """One gRPC message (``parts``: its bytes, ``size`` long) on this stream; ``flush``
        False: sent with what follows (the trailers of a unary answer, in one write)."""
        if self.done:
            return
        self.out.append(MESSAGE_PREFIX.pack(0, size))
        for part in parts:  # byte lengths: an array or a typed view goes as its bytes
            self.out.append(part if type(part) is bytes else memoryview(part).cast("B"))
        self.out_bytes += size + 5
        if flush:
            self.conn.flush(self)

    def finish(self, code: int = 0, message: str = "") -> None:
        """End the call with ``grpc-status`` ``code`` (trailers, or trailers only)."""
        if self.done or self.trailers is not None:
            return
        block = OK_TRAILERS if code == 0 and not message else status_block(code, message)
        if not self.headers_sent and not self.out:  # trailers-only: one HEADERS frame
            self.headers_sent = True
            block = RESPONSE_HEADERS + block
        self.trailers = block
        self.conn.flush(self)

    async def wait_drained(self) -> None:
        """Until this stream's queued answers are sent (a stall closes the connection, which
        ends the wait too)."""
        while self.out_bytes and not self.done:
            if self.drained is None or self.drained.done():
                self.drained = self.conn.loop.create_future()
            await self.drained

    def wake(self) -> None:
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def return_window(self, nbytes: int) -> None:
        """The call took ``nbytes`` of this stream's data: give them back to the client."""
        self.conn.return_connection_window(nbytes)
        if self.remote_closed or self.done:
            return
        self.unreturned += nbytes
        if self.unreturned >= self.conn.recv_stream_window // 4:
            self.recv_window += self.unreturned
            self.conn.send_raw(window_update(self.sid, self.unreturned))
            self.unreturned = 0

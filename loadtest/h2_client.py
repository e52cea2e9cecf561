"""gRPC calls over a lean HTTP/2 client: the load generator's ``grpc-h2`` (unary) and
``grpc-stream-h2`` (``ModelStreamInfer``) protocols.

grpc.aio costs a Python caller about 0.08-0.15 CPU-ms per unary call, several times what the
server's front-end spends on it, so on the serving machine the client took the cores the daemon
needed; h2load costs 0.02 but posts one body file (every request the same ids, which the engine
merges). This client sends each caller's own request bodies at about h2load's cost: one
``asyncio.Protocol`` per TCP connection, cleartext HTTP/2 with prior knowledge (as gRPC clients
speak it), a request's header block encoded once (never-indexed literals and static entries: no
encoder state), HEADERS and DATA in one write, and per answer a few slices of the received bytes
and a cached HPACK decode (``quiver_serve.frontend.grpc.frames.HeaderCache``).

Per RFC 9113 it answers SETTINGS and PING, follows the server's windows (a request that does not
fit waits for its WINDOW_UPDATE), returns the connection window as answers are read, takes
CONTINUATION and padding, and ends calls on RST_STREAM, GOAWAY (streams past the server's last)
or a lost connection. Statuses are those of ``loadtest/status.py``: ``"200"`` for
``grpc-status: 0``, ``"grpc:<NAME>"`` otherwise, ``"conn:<why>"`` when the connection failed.
"""

from __future__ import annotations

import asyncio
import struct
from collections import deque
from typing import Any

from loadtest.status import OK
from quiver_serve.frontend.grpc.frames import (
    ACK,
    CONTINUATION,
    DATA,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PING,
    PREFACE,
    RST_STREAM,
    S_ENABLE_PUSH,
    S_INITIAL_WINDOW_SIZE,
    S_MAX_FRAME_SIZE,
    SETTINGS,
    WINDOW_UPDATE,
    HeaderCache,
    frame,
    frame_head,
    literal,
    unpad,
)
from quiver_serve.frontend.grpc.status import GrpcStatus

#: gRPC status codes by number (the spec's names)
GRPC_NAMES = tuple(status.name for status in GrpcStatus)
#: what this side grants: a stream's window is never returned, so an answer fits in it (16 MiB;
#: a larger one waits and ends as "timeout"); the connection's is returned once half was read
RECV_WINDOW = 1 << 24
_FRAME = struct.Struct(">IBI")
_SETTING = struct.Struct(">HI")
_U32 = struct.Struct(">I")
_PRIORITY_FLAG, _PADDED = 0x20, 0x8


def request_block(authority: str, path: str) -> bytes:
    """The HPACK block of every call: ``:method POST`` (static 3), ``:scheme http`` (static 6),
    the path and authority as literals, ``content-type: application/grpc``, ``te: trailers``."""
    return (b"\x83\x86" + literal(b":path", path.encode()) + literal(b":authority",
            authority.encode()) + literal(b"content-type", b"application/grpc")
            + literal(b"te", b"trailers"))


def grpc_status(headers: list[tuple[bytes, bytes]]) -> str | None:
    """``"200"`` or ``"grpc:<NAME>"`` from a trailer block (None: no ``grpc-status``)."""
    for name, value in headers:
        if name == b"grpc-status":
            code = int(value) if value.isdigit() else 2
            if code == 0:
                return OK
            return "grpc:" + (GRPC_NAMES[code] if code < len(GRPC_NAMES) else str(code))
    return None


class H2Client(asyncio.Protocol):
    """One HTTP/2 connection's calls (module docstring); ``call(message)`` -> future status."""

    def __init__(self, authority: str, path: str) -> None:
        import hpack

        self.block = request_block(authority, path)
        self.headers = HeaderCache(hpack.Decoder())
        self.loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[None] = self.loop.create_future()
        self.transport: Any = None
        self.calls: dict[int, asyncio.Future[str]] = {}
        self.next_sid = 1
        self.buf = b""
        self.block_sid, self.block_parts, self.block_end = 0, [], False
        self.send_window, self.stream_window, self.max_frame = DEFAULT_WINDOW, DEFAULT_WINDOW, 16_384
        self.waiting: deque[tuple[int, bytes]] = deque()  # sends held by the server's windows
        self.unacked = 0
        self.broken: str | None = None

    # ---- the caller's side ---------------------------------------------------------------------
    def call(self, message: bytes) -> tuple[int, asyncio.Future[str]]:
        """Send one gRPC message (a serialised request) on a new stream: its stream id (0 when
        the connection is broken) and the future of its status."""
        fut = self.loop.create_future()
        if self.broken is not None:
            fut.set_result(self.broken)
            return 0, fut
        sid, self.next_sid = self.next_sid, self.next_sid + 2
        self.calls[sid] = fut
        body = b"\x00" + _U32.pack(len(message)) + message
        if self.waiting or len(body) > min(self.send_window, self.stream_window) \
                or len(body) > self.max_frame:
            self.waiting.append((sid, body))
            self._flush()
        else:
            self._send(sid, body)
        return sid, fut

    def expire(self, sid: int) -> None:
        """A call past its deadline: answered "timeout", its stream reset (RST_STREAM CANCEL:
        the server cancels it)."""
        if self.calls.get(sid) is None:
            return
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(frame(RST_STREAM, 0, sid, _U32.pack(0x8)))
        self._end_call(sid, "timeout")

    def _send(self, sid: int, body: bytes) -> None:
        self.send_window -= len(body)
        self.transport.writelines([frame_head(HEADERS, END_HEADERS, sid, len(self.block)),
                                   self.block, frame_head(DATA, END_STREAM, sid, len(body)),
                                   body])

    def _flush(self) -> None:
        while self.waiting:
            sid, body = self.waiting[0]
            if sid not in self.calls:
                self.waiting.popleft()  # cancelled while it waited
                continue
            if len(body) > self.max_frame:
                self.waiting.popleft()
                self._end_call(sid, "grpc:RESOURCE_EXHAUSTED")  # one DATA frame per message here
                continue
            if len(body) > min(self.send_window, self.stream_window):
                return
            self.waiting.popleft()
            self._send(sid, body)

    def _end_call(self, sid: int, status: str) -> None:
        fut = self.calls.pop(sid, None)
        if fut is not None and not fut.done():
            fut.set_result(status)

    # ---- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        settings = _SETTING.pack(S_ENABLE_PUSH, 0) + _SETTING.pack(S_INITIAL_WINDOW_SIZE,
                                                                    RECV_WINDOW)
        transport.write(PREFACE + frame(SETTINGS, 0, 0, settings)
                        + frame(WINDOW_UPDATE, 0, 0, _U32.pack(RECV_WINDOW - DEFAULT_WINDOW)))

    def connection_lost(self, exc: Exception | None) -> None:
        self._break(f"conn:{type(exc).__name__ if exc else 'closed'}")

    def _break(self, status: str, after_sid: int = 0) -> None:
        self.broken = self.broken or status
        for sid in [s for s in self.calls if s > after_sid]:
            self._end_call(sid, status)
        if not self.ready.done():
            self.ready.set_exception(ConnectionError(status))

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        pos, end = 0, len(buf)
        while end - pos >= 9:
            head, flags, sid = _FRAME.unpack_from(buf, pos)
            length, ftype = head >> 8, head & 0xFF
            if end - pos - 9 < length:
                break
            payload = buf[pos + 9:pos + 9 + length]
            pos += 9 + length
            self._frame(ftype, flags, sid & 0x7FFFFFFF, payload)
        self.buf = buf[pos:]
        if self.unacked >= RECV_WINDOW // 2 and self.transport is not None:
            self.transport.write(frame(WINDOW_UPDATE, 0, 0, _U32.pack(self.unacked)))
            self.unacked = 0

    def _frame(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        if ftype == DATA:
            self.unacked += len(payload)
            self._on_data(sid, flags, payload)
        elif ftype == HEADERS or ftype == CONTINUATION:
            self._header_frame(ftype, flags, sid, payload)
        elif ftype == SETTINGS:
            self._settings(flags, payload)
        elif ftype == WINDOW_UPDATE and len(payload) == 4:
            self._on_window(sid, _U32.unpack(payload)[0] & 0x7FFFFFFF)
        elif ftype == PING and not flags & ACK:
            self.transport.write(frame(PING, ACK, 0, payload))
        elif ftype == RST_STREAM and len(payload) == 4:
            code = _U32.unpack(payload)[0]
            self._end_call(sid, "grpc:UNAVAILABLE" if code == 0x7 else f"conn:RST_STREAM {code}")
        elif ftype == GOAWAY and len(payload) >= 8:
            self._break("conn:GOAWAY", _U32.unpack_from(payload)[0] & 0x7FFFFFFF)

    def _on_data(self, sid: int, flags: int, payload: bytes) -> None:
        """A unary call's answer is read whole at its trailers: only its end matters here."""
        if flags & END_STREAM:
            self._end_call(sid, "grpc:INTERNAL")  # an answer without trailers

    def _on_window(self, sid: int, increment: int) -> None:
        if sid == 0:
            self.send_window += increment
        self._flush()

    def _settings(self, flags: int, payload: bytes) -> None:
        if flags & ACK:
            return
        for k in range(0, len(payload) - 5, 6):
            key, value = _SETTING.unpack_from(payload, k)
            if key == S_INITIAL_WINDOW_SIZE:
                self.stream_window = value  # every stream sends one message: its window is this
            elif key == S_MAX_FRAME_SIZE:
                self.max_frame = value
        self.transport.write(frame(SETTINGS, ACK, 0))
        if not self.ready.done():
            self.ready.set_result(None)
        self._flush()

    def _header_frame(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        if ftype == HEADERS:
            payload = unpad(flags, payload)
            if flags & _PRIORITY_FLAG:
                payload = payload[5:]
            self.block_sid, self.block_parts = sid, [payload]
            self.block_end = bool(flags & END_STREAM)
        else:
            self.block_parts.append(payload)
        if not flags & END_HEADERS:
            return
        headers = self.headers.decode(b"".join(self.block_parts))  # also for a call gone: the table
        if not self.block_end:
            status = dict(headers).get(b":status", b"200")
            if status != b"200":
                self._end_call(self.block_sid, f"http:{status.decode()}")
            return
        self._end_call(self.block_sid, grpc_status(headers) or "grpc:UNKNOWN")


class H2StreamClient(H2Client):
    """One ``ModelStreamInfer`` call on its own connection: ``send(request_id, message)`` writes a
    message (a serialised request carrying ``request_id``) on the one stream and returns the
    future of its status, resolved when the answer with that id comes back (``"stream:error"``
    for one with an ``error_message``). Messages follow both windows of the stream; the answers'
    windows are returned as they are read; the stream's end (trailers, RST_STREAM, GOAWAY, a lost
    connection) ends every request still waiting."""

    def __init__(self, authority: str, path: str) -> None:
        from quiver_serve.frontend.grpc.proto import message

        super().__init__(authority, path)
        self.parse = message("ModelStreamInferResponse").FromString
        self.sid = 0
        self.waiting_ids: dict[str, asyncio.Future[str]] = {}
        self.out: deque[bytes] = deque()
        self.stream_send = 0  # what the stream's window still takes
        self.stream_unacked = 0
        self.rbuf = b""

    def open(self) -> None:
        """Start the stream (HEADERS, no END_STREAM); after ``ready``."""
        self.sid, self.next_sid = self.next_sid, self.next_sid + 2
        self.calls[self.sid] = self.loop.create_future()
        self.stream_send = self.stream_window
        self.transport.write(frame_head(HEADERS, END_HEADERS, self.sid, len(self.block))
                             + self.block)

    def send(self, request_id: str, message: bytes) -> asyncio.Future[str]:
        fut = self.loop.create_future()
        if self.broken is not None:
            fut.set_result(self.broken)
            return fut
        self.waiting_ids[request_id] = fut
        self.out.append(b"\x00" + _U32.pack(len(message)) + message)
        self._flush_stream()
        return fut

    def expire(self, request_id: str) -> None:
        """A request past its deadline: answered "timeout" (its answer, if any, is dropped)."""
        fut = self.waiting_ids.pop(request_id, None)
        if fut is not None and not fut.done():
            fut.set_result("timeout")

    def _flush_stream(self) -> None:
        while self.out:
            body = self.out[0]
            if len(body) > self.max_frame:
                self.out.popleft()
                self._end_call(self.sid, "grpc:RESOURCE_EXHAUSTED")  # one frame per message here
                return
            if len(body) > min(self.send_window, self.stream_send):
                return
            self.out.popleft()
            self.send_window -= len(body)
            self.stream_send -= len(body)
            self.transport.writelines([frame_head(DATA, 0, self.sid, len(body)), body])

    def _on_window(self, sid: int, increment: int) -> None:
        if sid == 0:
            self.send_window += increment
        elif sid == self.sid:
            self.stream_send += increment
        self._flush_stream()

    def _on_data(self, sid: int, flags: int, payload: bytes) -> None:
        if sid != self.sid:
            return
        self.stream_unacked += len(payload)
        if self.stream_unacked >= RECV_WINDOW // 2:
            self.transport.write(frame(WINDOW_UPDATE, 0, sid, _U32.pack(self.stream_unacked)))
            self.stream_unacked = 0
        buf = self.rbuf + payload if self.rbuf else payload
        pos = 0
        while len(buf) - pos >= 5:
            size = _U32.unpack_from(buf, pos + 1)[0]
            if len(buf) - pos - 5 < size:
                break
            answer = self.parse(buf[pos + 5:pos + 5 + size])
            pos += 5 + size
            fut = self.waiting_ids.pop(answer.infer_response.id, None)
            if fut is not None and not fut.done():
                fut.set_result("stream:error" if answer.error_message else OK)
        self.rbuf = buf[pos:]
        if flags & END_STREAM:
            self._end_call(sid, "grpc:INTERNAL")  # a stream ended without trailers

    def _end_call(self, sid: int, status: str) -> None:
        super()._end_call(sid, status)
        if sid == self.sid:  # the stream ended: nothing more will be answered on it
            self._fail_waiting("conn:stream ended" if status == OK else status)

    def _break(self, status: str, after_sid: int = 0) -> None:
        super()._break(status, after_sid)
        if self.sid > after_sid:
            self._fail_waiting(self.broken or status)

    def _fail_waiting(self, status: str) -> None:
        self.broken = self.broken or status
        waiting, self.waiting_ids = self.waiting_ids, {}
        for fut in waiting.values():
            if not fut.done():
                fut.set_result(status)


async def connect(host: str, port: int, path: str, timeout_s: float,
                  kind: type[H2Client] = H2Client) -> H2Client:
    """A connection whose server's SETTINGS arrived (ConnectionError past ``timeout_s``);
    ``kind``: :class:`H2StreamClient` for a stream (opened here)."""
    loop = asyncio.get_running_loop()
    conn: H2Client | None = None
    try:
        _, conn = await asyncio.wait_for(
            loop.create_connection(lambda: kind(f"{host}:{port}", path), host, port),
            timeout_s)
        await asyncio.wait_for(asyncio.shield(conn.ready), timeout_s)
    except (OSError, asyncio.TimeoutError) as exc:
        if conn is not None and conn.transport is not None:
            conn.transport.close()  # connected, but no SETTINGS from the server in time
        raise ConnectionError(f"gRPC endpoint {host}:{port} not reachable: {exc!r}") from None
    if isinstance(conn, H2StreamClient):
        conn.open()
    return conn

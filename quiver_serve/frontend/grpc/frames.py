"""HTTP/2 for gRPC, on the front-end's event loop: frames, HPACK, flow control, streams.

The KServe gRPC endpoint's transport (``grpc_calls.py`` says what each call does). One
:class:`H2Connection` (an ``asyncio.Protocol``) per client connection, cleartext HTTP/2 with prior
knowledge (``h2c``), as gRPC clients speak it. What it does, per RFC 9113:

* frames are cut from the bytes received in one pass; DATA, HEADERS (+ CONTINUATION), SETTINGS,
  PING, WINDOW_UPDATE, RST_STREAM, GOAWAY and PRIORITY are handled, unknown types ignored; every
  malformed frame is a connection error (GOAWAY with its code, then close) or a stream error
  (RST_STREAM), as the RFC assigns them;
* header blocks are decoded with ``hpack`` (the HPACK of the ``h2`` project), also those of
  streams that are ignored, so the decoder's table stays in step; answers use only the static
  table and literals that are never indexed, so no encoder state is kept;
* gRPC messages (a flag byte, a 4-byte length, the message) are cut from a stream's DATA and
  handed to the stream's call; a message over ``max_message_bytes`` ends the call with
  RESOURCE_EXHAUSTED, a compressed one with UNIMPLEMENTED (no compression is offered);
* flow control both ways: the client's windows (connection and stream) are returned only for
  data its calls have taken, so what a connection buffers is bounded by the windows granted; the
  answers are sent within the client's windows and its largest frame size, the rest waits for
  its WINDOW_UPDATE. A connection whose unsent answers pass ``MAX_PENDING_BYTES`` refuses new
  streams (REFUSED_STREAM, which a gRPC client may retry) until they drain; one whose transport
  is full stops reading until it drains;
* waits: a PING goes out after ``KEEPALIVE_S`` with nothing received, and a connection whose
  PING is not answered within ``KEEPALIVE_TIMEOUT_S``, or whose answers make no progress for
  ``WRITE_STALL_S``, is closed (its calls are cancelled). ``close_gracefully`` sends GOAWAY and
  lets the streams already started finish.

A request costs a few slices of the received bytes, one HPACK decode (mostly table hits) and, per
answer, one ``writelines`` of pre-encoded headers, the DATA frame(s) and the trailers.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import deque
from typing import Any, Protocol

log = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL = 0x5, 0x6, 0x7, 0x8
COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x9, 0xB
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS = 0x1, 0x2, 0x3
S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6

MAX_WINDOW = (1 << 31) - 1
DEFAULT_WINDOW = 65_535
MIN_FRAME_BYTES = 16_384
MAX_FRAME_BYTES = (1 << 24) - 1
#: the frame size this side accepts (the RFC's default: clients send at most this)
RECV_FRAME_BYTES = MIN_FRAME_BYTES
#: streams one connection may have open at once (a client's pipelined calls past it wait)
MAX_STREAMS = 1024
#: a request's header block, decoded, at most this large (grpc's own hard limit is 16 KiB)
MAX_HEADER_LIST_BYTES = 16_384
#: a header block's encoded bytes (HEADERS + CONTINUATION) at most this large
MAX_HEADER_BLOCK_BYTES = 65_536
#: answers queued on a connection beyond the client's windows; past this new streams are refused
MAX_PENDING_BYTES = 32 << 20
#: a PING after this long with nothing received; no answer within the timeout closes
KEEPALIVE_S, KEEPALIVE_TIMEOUT_S = 60.0, 20.0
#: answers that make no progress for this long (the client does not read) close the connection
WRITE_STALL_S = 60.0
#: the connection's timer period (keepalive and stall checks)
TICK_S = 5.0

_FRAME = struct.Struct(">IBI")  # length << 8 | type, flags, stream id
_SETTING = struct.Struct(">HI")
_U32 = struct.Struct(">I")
_MSG_PREFIX = struct.Struct(">BI")  # gRPC: compressed flag, message length
_GOAWAY = struct.Struct(">II")


def frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One frame, header and payload."""
    return _FRAME.pack(len(payload) << 8 | ftype, flags, stream_id) + payload


def frame_head(ftype: int, flags: int, stream_id: int, length: int) -> bytes:
    return _FRAME.pack(length << 8 | ftype, flags, stream_id)


# --- HPACK: what this side writes (static table entries and never-indexed literals only) -------

def _hpack_int(value: int, prefix_bits: int, first: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out, value = bytearray([first | limit]), value - limit
    while value >= 128:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: bytes, value: bytes) -> bytes:
    """A header field as a literal without indexing (new name, raw strings)."""
    return b"\x00" + _hpack_int(len(name), 7, 0) + name + _hpack_int(len(value), 7, 0) + value


#: ``:status: 200`` (static index 8) and ``content-type: application/grpc`` (name index 31)
RESPONSE_HEADERS = b"\x88" + _hpack_int(31, 4, 0) + _hpack_int(16, 7, 0) + b"application/grpc"
OK_TRAILERS = literal(b"grpc-status", b"0")


def status_block(code: int, message: str) -> bytes:
    """``grpc-status`` and a percent-encoded ``grpc-message`` (the gRPC spec's encoding)."""
    block = literal(b"grpc-status", str(code).encode())
    if message:
        block += literal(b"grpc-message", percent_encode(message))
    return block


def percent_encode(message: str) -> bytes:
    out = bytearray()
    for byte in message.encode("utf-8"):
        if 0x20 <= byte <= 0x7E and byte != 0x25:
            out.append(byte)
        else:
            out += b"%%%02X" % byte
    return bytes(out)


class HeaderCache:
    """Decoded header blocks by their bytes, for blocks that leave the HPACK table as it was.

    A gRPC client sends the same block for every call once its headers are in the dynamic
    table. A block's decoding depends on the block and the table alone, and the table changes
    only when a block is decoded, so a block that did not change the table decodes to the same
    list again until some block does (the cache's generation counts those)."""

    MAX_ENTRIES = 64

    def __init__(self, decoder: Any) -> None:
        self.decoder, self.table = decoder, decoder.header_table
        self.generation = 0
        self.blocks: dict[bytes, tuple[int, list[tuple[bytes, bytes]]]] = {}

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        hit = self.blocks.get(block)
        if hit is not None and hit[0] == self.generation:
            return hit[1]
        dyn = self.table.dynamic_entries
        first, length, maxsize = (dyn[0] if dyn else None), len(dyn), self.table.maxsize
        try:
            headers = [(bytes(k), bytes(v)) for k, v in self.decoder.decode(block, raw=True)]
        except Exception:
            self.generation += 1  # a block that failed half-way may have changed the table
            self.blocks.clear()
            raise
        if (dyn[0] if dyn else None) is not first or len(dyn) != length \
                or self.table.maxsize != maxsize:
            self.generation += 1  # the table changed: every cached block is stale
            self.blocks.clear()
        else:
            if len(self.blocks) >= self.MAX_ENTRIES:
                self.blocks.clear()
            self.blocks[block] = (self.generation, headers)
        return headers


class H2Error(Exception):
    """A connection error: GOAWAY with ``code``, then close."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def unpad(flags: int, payload: bytes) -> bytes:
    """A DATA or HEADERS payload without its padding (RFC 9113, 6.1)."""
    if not flags & PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise H2Error(PROTOCOL_ERROR, "padding longer than the frame")
    return payload[1:len(payload) - payload[0]]


def peer_string(peername: Any) -> str:
    """gRPC's peer form: ``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``; "" when unknown."""
    if not isinstance(peername, tuple) or len(peername) < 2:
        return ""
    host, port = peername[0], peername[1]
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


class Call(Protocol):
    """What a stream's call is told (``grpc_calls.py`` has the implementations)."""

    def message(self, stream: H2Stream, payload: bytes) -> None: ...

    def end(self, stream: H2Stream) -> None: ...

    def cancel(self, stream: H2Stream) -> None: ...


class H2Stream:
    """One gRPC call's stream: what came in (headers, the bytes of a message not yet whole) and
    what waits to go out (DATA beyond the client's windows, then the trailers). ``conn`` is its
    ``http2_connection.H2Connection``."""

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
        self.out.append(_MSG_PREFIX.pack(0, size))
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
            self.conn.send_raw(frame(WINDOW_UPDATE, 0, self.sid, _U32.pack(self.unreturned)))
            self.unreturned = 0

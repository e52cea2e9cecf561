"""HTTP/2 frames for the gRPC port (RFC 9113): the frame, setting and error-code numbers, the
frames' encodings, the answers' HPACK and the request header blocks' cache.

This is the subpackage's public frame API: ``connection.py`` reads and writes frames with it,
``loadtest/h2_client.py`` and the tests build theirs with it. Nothing here keeps state but
:class:`HeaderCache`. What one connection does with the frames is in ``connection.py``'s
docstring; the per-connection abuse limits in ``limits.py``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# frame types (RFC 9113, 6)
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)
# frame flags
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
# error codes (RFC 9113, 7)
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL = 0x5, 0x6, 0x7, 0x8
COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x9, 0xB
# settings ids (RFC 9113, 6.5.2)
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS = 0x1, 0x2, 0x3
S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6

MAX_WINDOW = (1 << 31) - 1
DEFAULT_WINDOW = 65_535
MIN_FRAME_BYTES = 16_384
MAX_FRAME_BYTES = (1 << 24) - 1
#: the frame size this side accepts (the RFC's default: clients send at most this)
RECV_FRAME_BYTES = MIN_FRAME_BYTES
#: a request's header block, decoded, at most this large (grpc's own hard limit is 16 KiB)
MAX_HEADER_LIST_BYTES = 16_384
#: a header block's encoded bytes (HEADERS + CONTINUATION) at most this large
MAX_HEADER_BLOCK_BYTES = 65_536

#: a frame's 9-byte head: ``length << 8 | type``, flags, stream id (``unpack_from`` to read)
FRAME_HEAD = struct.Struct(">IBI")
#: one SETTINGS entry: id, value
SETTING = struct.Struct(">HI")
#: a 32-bit field (WINDOW_UPDATE's increment, RST_STREAM's code)
U32 = struct.Struct(">I")
#: a gRPC message's prefix: compressed flag, message length
MESSAGE_PREFIX = struct.Struct(">BI")
#: GOAWAY's fixed part: last stream id, error code
GOAWAY_HEAD = struct.Struct(">II")


def frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One frame, head and payload."""
    return FRAME_HEAD.pack(len(payload) << 8 | ftype, flags, stream_id) + payload


def frame_head(ftype: int, flags: int, stream_id: int, length: int) -> bytes:
    """A frame's head alone (its ``length`` bytes of payload follow)."""
    return FRAME_HEAD.pack(length << 8 | ftype, flags, stream_id)


def settings_frame(pairs: Iterable[tuple[int, int]]) -> bytes:
    """SETTINGS with ``(id, value)`` entries."""
    return frame(SETTINGS, 0, 0, b"".join(SETTING.pack(k, v) for k, v in pairs))


def decode_settings(payload: bytes) -> list[tuple[int, int]]:
    """A SETTINGS payload's ``(id, value)`` entries (its length a multiple of 6)."""
    return [SETTING.unpack_from(payload, at) for at in range(0, len(payload) - 5, 6)]


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, U32.pack(increment))


def rst_stream(stream_id: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream_id, U32.pack(code))


def goaway(last_stream_id: int, code: int, debug: bytes = b"") -> bytes:
    """GOAWAY naming the last stream this side processes and why (``debug``: at most 256
    bytes of it are sent)."""
    return frame(GOAWAY, 0, 0, GOAWAY_HEAD.pack(last_stream_id, code) + debug[:256])


def decode_goaway(payload: bytes) -> tuple[int, int, bytes]:
    """A GOAWAY payload's last stream id, error code and debug data."""
    last_sid, code = GOAWAY_HEAD.unpack_from(payload)
    return last_sid & 0x7FFFFFFF, code, payload[8:]


def decode_u32(payload: bytes) -> int:
    """WINDOW_UPDATE's increment or RST_STREAM's code (a 4-byte payload)."""
    return U32.unpack(payload)[0]


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

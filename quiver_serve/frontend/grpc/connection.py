"""One HTTP/2 connection (``H2Connection``, an ``asyncio.Protocol``).

``http2.py`` has the frame constants, the answers' HPACK and the streams; this module reads the
frames off the socket and applies them (module docstring of ``http2.py``: what is handled, the
limits and the waits); ``http2_server.py`` listens and drains.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any

import hpack

from quiver_serve.frontend import http2 as h
from quiver_serve.frontend.http2 import H2Error, H2Stream, frame

log = logging.getLogger(__name__)

#: (stream) -> its call; the call may answer the stream at once (an unknown method, say)
OnRequest = Callable[[H2Stream], Any]


class H2Connection(asyncio.Protocol):
    """A client connection: frames in, calls started, answers out (``http2.py``)."""

    def __init__(self, on_request: OnRequest, max_message_bytes: int,
                 registry: set[H2Connection] | None = None) -> None:
        self.on_request, self.max_message_bytes = on_request, max_message_bytes
        self.registry = registry
        self.recv_stream_window = min(h.MAX_WINDOW, max(1 << 20, max_message_bytes + 1024))
        self.recv_conn_window = min(h.MAX_WINDOW, max(16 << 20, 2 * self.recv_stream_window))
        self.recv_window = h.DEFAULT_WINDOW  # raised when the connection is made
        self.conn_unreturned = 0
        self.send_window = h.DEFAULT_WINDOW
        self.peer_initial_window = h.DEFAULT_WINDOW
        self.peer_max_frame = h.MIN_FRAME_BYTES
        self.headers = h.HeaderCache(hpack.Decoder(max_header_list_size=h.MAX_HEADER_LIST_BYTES))
        self.streams: dict[int, H2Stream] = {}
        self.blocked: dict[int, H2Stream] = {}  # streams with DATA waiting for window
        self.last_sid = 0
        self._buf = b""
        self._preface = False
        self._settings_seen = False
        self._cont: tuple[int, bool, bytearray] | None = None  # a header block being continued
        self.goaway_sent = self.peer_goaway = self.closed = False
        self.write_paused = self.reading_paused = False
        self.stuck_since: float | None = None
        self.ping_at: float | None = None
        self.last_recv = 0.0
        self.transport: Any = None
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self.peer = ""
        self._timer: asyncio.TimerHandle | None = None

    # ---- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:
        self.transport, self.loop = transport, asyncio.get_running_loop()
        self.peer = h.peer_string(transport.get_extra_info("peername"))
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        settings = b"".join(h._SETTING.pack(k, v) for k, v in (
            (h.S_MAX_CONCURRENT_STREAMS, h.MAX_STREAMS),
            (h.S_INITIAL_WINDOW_SIZE, self.recv_stream_window),
            (h.S_MAX_HEADER_LIST_SIZE, h.MAX_HEADER_LIST_BYTES),
            (h.S_ENABLE_PUSH, 0)))
        raise_by = self.recv_conn_window - h.DEFAULT_WINDOW
        self.recv_window = self.recv_conn_window
        transport.write(frame(h.SETTINGS, 0, 0, settings)
                        + frame(h.WINDOW_UPDATE, 0, 0, h._U32.pack(raise_by)))
        self.last_recv = self.loop.time()
        self._timer = self.loop.call_later(h.TICK_S, self._tick)
        if self.registry is not None:
            self.registry.add(self)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self.last_recv = self.loop.time()
        try:
            self._receive(self._buf + data if self._buf else data)
        except H2Error as exc:
            self.fail(exc.code, str(exc))
        except hpack.HPACKError as exc:
            self.fail(h.COMPRESSION_ERROR, f"header block: {exc}")
        except Exception as exc:  # noqa: BLE001 - a bug ends this connection, not the loop
            log.exception("HTTP/2 connection from %s: internal error", self.peer)
            self.fail(h.INTERNAL_ERROR, f"internal error: {type(exc).__name__}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
        streams, self.streams = self.streams, {}
        self.blocked.clear()
        for stream in streams.values():
            self._drop(stream)
        if self.registry is not None:
            self.registry.discard(self)

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.stuck_since is None:
            self.stuck_since = self.loop.time()
        self._update_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        self.stuck_since = None
        self._update_reading()

    # ---- frames in -----------------------------------------------------------------------------
    def _receive(self, data: bytes) -> None:
        pos, n = 0, len(data)
        if not self._preface:
            if n < len(h.PREFACE):
                if not h.PREFACE.startswith(data):
                    raise H2Error(h.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                self._buf = data
                return
            if not data.startswith(h.PREFACE):
                raise H2Error(h.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            self._preface, pos = True, len(h.PREFACE)
        unpack = h._FRAME.unpack_from
        while n - pos >= 9 and not self.closed:
            head, flags, sid = unpack(data, pos)
            length, ftype = head >> 8, head & 0xFF
            if length > h.RECV_FRAME_BYTES:
                raise H2Error(h.FRAME_SIZE_ERROR, f"a frame of {length} bytes")
            end = pos + 9 + length
            if end > n:
                break
            self._frame(ftype, flags, sid & 0x7FFFFFFF, data[pos + 9:end])
            pos = end
        self._buf = data[pos:] if pos < n else b""

    def _frame(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        if self._cont is not None and ftype != h.CONTINUATION:
            raise H2Error(h.PROTOCOL_ERROR, "a header block was interrupted")
        if not self._settings_seen:
            if ftype != h.SETTINGS or flags & h.ACK:
                raise H2Error(h.PROTOCOL_ERROR, "the client's first frame must be SETTINGS")
            self._settings_seen = True
        if ftype == h.DATA:
            self._on_data(flags, sid, payload)
        elif ftype == h.HEADERS:
            self._on_headers(flags, sid, payload)
        elif ftype == h.WINDOW_UPDATE:
            self._on_window_update(sid, payload)
        elif ftype == h.SETTINGS:
            self._on_settings(flags, sid, payload)
        elif ftype == h.PING:
            self._on_ping(flags, sid, payload)
        elif ftype == h.RST_STREAM:
            self._on_rst(sid, payload)
        elif ftype == h.CONTINUATION:
            self._on_continuation(flags, sid, payload)
        elif ftype == h.GOAWAY:
            if sid != 0:
                raise H2Error(h.PROTOCOL_ERROR, "GOAWAY on a stream")
            self.peer_goaway = True
            self._maybe_close()
        elif ftype == h.PRIORITY:
            if sid == 0 or len(payload) != 5:
                raise H2Error(h.PROTOCOL_ERROR, "a malformed PRIORITY frame")
        elif ftype == h.PUSH_PROMISE:
            raise H2Error(h.PROTOCOL_ERROR, "a client may not push")
        # unknown frame types are ignored (RFC 9113, 5.5)

    def _on_data(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise H2Error(h.PROTOCOL_ERROR, "DATA on stream 0")
        length = len(payload)
        self.recv_window -= length
        if self.recv_window < 0:
            raise H2Error(h.FLOW_CONTROL_ERROR, "DATA beyond the connection's window")
        data = h.unpad(flags, payload)
        stream = self.streams.get(sid)
        if stream is None or stream.remote_closed:
            self.return_connection_window(length)
            if stream is None and sid > self.last_sid:
                raise H2Error(h.PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            if stream is not None:
                self.reset(stream, h.STREAM_CLOSED)
            return
        stream.recv_window -= length
        if stream.recv_window < 0:
            self.return_connection_window(length)
            self.reset(stream, h.FLOW_CONTROL_ERROR)
            return
        if length != len(data):
            stream.return_window(length - len(data))
        if data and not stream.done:
            stream.buf += data
            self._cut_messages(stream)
        elif data:  # answered already (an error): the rest of its request is dropped
            stream.return_window(len(data))
        if flags & h.END_STREAM:
            self._end_remote(stream)

    def _cut_messages(self, stream: H2Stream) -> None:
        """Hand each whole gRPC message in the stream's bytes to its call."""
        buf = stream.buf
        while len(buf) >= 5 and not stream.done:
            compressed, size = h._MSG_PREFIX.unpack_from(buf)
            if size > self.max_message_bytes:
                stream.return_window(len(buf))
                buf.clear()
                stream.finish(8, f"request message of {size} bytes exceeds the largest "
                                 f"accepted ({self.max_message_bytes} bytes)")
                return
            if len(buf) < 5 + size:
                return
            payload = bytes(buf[5:5 + size])
            del buf[:5 + size]
            if compressed:
                stream.return_window(size + 5)
                stream.finish(12, "compressed messages are not supported (grpc-encoding "
                                  "identity only)")
                return
            stream.call.message(stream, payload)  # type: ignore[union-attr]

    def _on_headers(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise H2Error(h.PROTOCOL_ERROR, "HEADERS on stream 0")
        payload = h.unpad(flags, payload)
        if flags & h.PRIORITY_FLAG:
            if len(payload) < 5:
                raise H2Error(h.PROTOCOL_ERROR, "HEADERS too short for its priority")
            payload = payload[5:]
        if flags & h.END_HEADERS:
            self._headers_done(sid, bool(flags & h.END_STREAM), payload)
        else:
            self._cont = (sid, bool(flags & h.END_STREAM), bytearray(payload))

    def _on_continuation(self, flags: int, sid: int, payload: bytes) -> None:
        if self._cont is None or self._cont[0] != sid:
            raise H2Error(h.PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
        block = self._cont[2]
        block += payload
        if len(block) > h.MAX_HEADER_BLOCK_BYTES:
            raise H2Error(h.ENHANCE_YOUR_CALM, "a header block over "
                                               f"{h.MAX_HEADER_BLOCK_BYTES} bytes")
        if flags & h.END_HEADERS:
            _, end_stream, _ = self._cont
            self._cont = None
            self._headers_done(sid, end_stream, bytes(block))

    def _headers_done(self, sid: int, end_stream: bool, block: bytes) -> None:
        try:
            headers = self.headers.decode(block)
        except hpack.OversizedHeaderListError:  # mid-block: the table is no longer in step
            raise H2Error(h.ENHANCE_YOUR_CALM, f"request metadata over "
                                               f"{h.MAX_HEADER_LIST_BYTES} bytes") from None
        stream = self.streams.get(sid)
        if stream is not None:  # trailers from the client
            if stream.remote_closed or not end_stream:
                raise H2Error(h.PROTOCOL_ERROR, f"HEADERS on stream {sid} mid-request")
            self._end_remote(stream)
            return
        if sid <= self.last_sid:
            return  # a stream already closed here (reset): nothing more is read of it
        if sid % 2 == 0:
            raise H2Error(h.PROTOCOL_ERROR, f"stream {sid}: a client's streams are odd")
        self.last_sid = sid
        if self.goaway_sent or len(self.streams) >= h.MAX_STREAMS or (
                self.blocked and self.pending_bytes() > h.MAX_PENDING_BYTES):
            self.send_raw(frame(h.RST_STREAM, 0, sid, h._U32.pack(h.REFUSED_STREAM)))
            return
        stream = H2Stream(sid, self, headers, self.peer_initial_window)
        self.streams[sid] = stream
        stream.remote_closed = end_stream  # a request without a body (an answer forgets it)
        stream.call = self.on_request(stream)
        if end_stream and not stream.done and stream.call is not None:
            stream.call.end(stream)

    def _on_window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise H2Error(h.FRAME_SIZE_ERROR, "WINDOW_UPDATE of a wrong size")
        inc = h._U32.unpack(payload)[0] & 0x7FFFFFFF
        if sid == 0:
            if inc == 0:
                raise H2Error(h.PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
            self.send_window += inc
            if self.send_window > h.MAX_WINDOW:
                raise H2Error(h.FLOW_CONTROL_ERROR, "the connection window overflowed")
            for stream in list(self.blocked.values()):
                self.flush(stream)
            return
        stream = self.streams.get(sid)
        if stream is None:
            return
        stream.send_window += inc
        if inc == 0 or stream.send_window > h.MAX_WINDOW:
            self.reset(stream, h.PROTOCOL_ERROR if inc == 0 else h.FLOW_CONTROL_ERROR)
            return
        self.flush(stream)

    def _on_settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid != 0:
            raise H2Error(h.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & h.ACK:
            if payload:
                raise H2Error(h.FRAME_SIZE_ERROR, "a SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise H2Error(h.FRAME_SIZE_ERROR, "SETTINGS of a wrong size")
        grew = False
        for at in range(0, len(payload), 6):
            ident, value = h._SETTING.unpack_from(payload, at)
            if ident == h.S_INITIAL_WINDOW_SIZE:
                if value > h.MAX_WINDOW:
                    raise H2Error(h.FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE too large")
                delta, self.peer_initial_window = value - self.peer_initial_window, value
                for stream in self.streams.values():
                    stream.send_window += delta
                grew = grew or delta > 0
            elif ident == h.S_MAX_FRAME_SIZE:
                if not h.MIN_FRAME_BYTES <= value <= h.MAX_FRAME_BYTES:
                    raise H2Error(h.PROTOCOL_ERROR, "SETTINGS_MAX_FRAME_SIZE out of range")
                self.peer_max_frame = value
            elif ident == h.S_ENABLE_PUSH and value > 1:
                raise H2Error(h.PROTOCOL_ERROR, "SETTINGS_ENABLE_PUSH not 0 or 1")
        self.send_raw(frame(h.SETTINGS, h.ACK, 0))
        if grew:
            for stream in list(self.blocked.values()):
                self.flush(stream)

    def _on_ping(self, flags: int, sid: int, payload: bytes) -> None:
        if sid != 0:
            raise H2Error(h.PROTOCOL_ERROR, "PING on a stream")
        if len(payload) != 8:
            raise H2Error(h.FRAME_SIZE_ERROR, "PING of a wrong size")
        if flags & h.ACK:
            self.ping_at = None
        else:
            self.send_raw(frame(h.PING, h.ACK, 0, payload))

    def _on_rst(self, sid: int, payload: bytes) -> None:
        if sid == 0 or len(payload) != 4:
            raise H2Error(h.PROTOCOL_ERROR if sid == 0 else h.FRAME_SIZE_ERROR,
                          "a malformed RST_STREAM")
        if sid > self.last_sid:
            raise H2Error(h.PROTOCOL_ERROR, f"RST_STREAM on idle stream {sid}")
        stream = self.streams.pop(sid, None)
        if stream is not None:
            self._drop(stream)
            self._maybe_close()

    # ---- streams -------------------------------------------------------------------------------
    def _end_remote(self, stream: H2Stream) -> None:
        stream.remote_closed = True
        if not stream.done and stream.call is not None:
            stream.call.end(stream)
        if stream.done:
            self._forget(stream)

    def _drop(self, stream: H2Stream) -> None:
        """The stream is gone (reset, or the connection lost): its call is cancelled."""
        self.blocked.pop(stream.sid, None)
        stream.out.clear()
        stream.out_bytes = 0
        was_done, stream.done = stream.done, True
        if not was_done and stream.call is not None:
            stream.call.cancel(stream)
        stream.wake()

    def _forget(self, stream: H2Stream) -> None:
        """An answered stream: a request still coming is cut short (RST_STREAM NO_ERROR)."""
        if self.streams.pop(stream.sid, None) is None:
            return
        if not stream.remote_closed and not self.closed:
            self.send_raw(frame(h.RST_STREAM, 0, stream.sid, h._U32.pack(h.NO_ERROR)))
        self._maybe_close()

    def reset(self, stream: H2Stream, code: int) -> None:
        """A stream error: RST_STREAM with ``code``; its call is cancelled."""
        if self.streams.pop(stream.sid, None) is not None and not self.closed:
            self.send_raw(frame(h.RST_STREAM, 0, stream.sid, h._U32.pack(code)))
        self._drop(stream)
        self._maybe_close()

    def _maybe_close(self) -> None:
        if (self.goaway_sent or self.peer_goaway) and not self.streams and not self.closed:
            self.transport.close()

    # ---- frames out ----------------------------------------------------------------------------
    def send_raw(self, data: bytes) -> None:
        if not self.closed and not self.transport.is_closing():
            self.transport.write(data)

    def return_connection_window(self, nbytes: int) -> None:
        self.conn_unreturned += nbytes
        if self.conn_unreturned >= self.recv_conn_window // 4:
            self.recv_window += self.conn_unreturned
            self.send_raw(frame(h.WINDOW_UPDATE, 0, 0, h._U32.pack(self.conn_unreturned)))
            self.conn_unreturned = 0

    def flush(self, stream: H2Stream) -> None:
        """Send what the windows allow of the stream's answer, then its trailers."""
        if stream.done or self.closed or self.transport.is_closing():
            return
        parts: list[Any] = []
        if stream.out:
            if not stream.headers_sent:
                stream.headers_sent = True
                parts.append(frame(h.HEADERS, h.END_HEADERS, stream.sid, h.RESPONSE_HEADERS))
            before = stream.out_bytes
            self._data_frames(stream, parts)
            if stream.out_bytes != before:
                self.stuck_since = None
        if stream.trailers is not None and not stream.out:
            parts.append(frame(h.HEADERS, h.END_HEADERS | h.END_STREAM, stream.sid,
                               stream.trailers))
            stream.done = True
        if parts:
            self.transport.writelines(parts)
        if stream.out:
            self.blocked[stream.sid] = stream
            if self.stuck_since is None:
                self.stuck_since = self.loop.time()
        else:
            self.blocked.pop(stream.sid, None)
            stream.wake()
        self._update_reading()
        if stream.done:
            self._forget(stream)

    def _data_frames(self, stream: H2Stream, parts: list[Any]) -> None:
        out = stream.out
        while out:
            allowed = min(self.send_window, stream.send_window, self.peer_max_frame)
            if allowed <= 0:
                return
            size, pieces = 0, []
            while out and size < allowed:
                piece = out[0]
                room = allowed - size
                if len(piece) <= room:
                    pieces.append(out.popleft())
                    size += len(piece)
                else:
                    pieces.append(piece[:room])
                    out[0] = piece[room:]
                    size = allowed
            parts.append(h.frame_head(h.DATA, 0, stream.sid, size))
            parts.extend(pieces)
            self.send_window -= size
            stream.send_window -= size
            stream.out_bytes -= size

    def pending_bytes(self) -> int:
        """DATA queued beyond the client's windows, all streams."""
        return sum(stream.out_bytes for stream in self.blocked.values())

    def _update_reading(self) -> None:
        """Reading stops while the transport is full (the client does not read its socket);
        answers held by the client's windows do not stop it (its WINDOW_UPDATE must get in)."""
        pause = self.write_paused
        if pause != self.reading_paused and not self.closed:
            self.reading_paused = pause
            (self.transport.pause_reading if pause else self.transport.resume_reading)()

    def fail(self, code: int, message: str) -> None:
        """A connection error: GOAWAY naming it, then close."""
        log.debug("HTTP/2 connection from %s ended: %s (code %d)", self.peer, message, code)
        if not self.closed:
            self.transport.write(frame(h.GOAWAY, 0, 0, h._GOAWAY.pack(self.last_sid, code)
                                       + message.encode()[:256]))
            self.goaway_sent = True
            self.transport.close()
            self.closed = True

    def close_gracefully(self) -> None:
        """GOAWAY: no new streams; the connection closes once those started are answered."""
        if not self.goaway_sent and not self.closed:
            self.goaway_sent = True
            self.send_raw(frame(h.GOAWAY, 0, 0, h._GOAWAY.pack(self.last_sid, h.NO_ERROR)))
        self._maybe_close()

    def _tick(self) -> None:
        """Keepalive and stall checks, every ``TICK_S``."""
        if self.closed:
            return
        now = self.loop.time()
        if self.ping_at is not None and now - self.ping_at > h.KEEPALIVE_TIMEOUT_S:
            log.info("HTTP/2 connection from %s: no PING answer in %.0f s; closing",
                     self.peer, h.KEEPALIVE_TIMEOUT_S)
            self.transport.abort()
            return
        if not self.blocked and not self.write_paused:
            self.stuck_since = None  # nothing waits to go out (a blocked stream was reset)
        elif self.stuck_since is not None and now - self.stuck_since > h.WRITE_STALL_S:
            log.warning("HTTP/2 connection from %s: answers waited %.0f s to be sent (the "
                        "client does not read); closing", self.peer, h.WRITE_STALL_S)
            self.transport.abort()
            return
        if self.ping_at is None and now - self.last_recv > h.KEEPALIVE_S:
            self.ping_at = now
            self.send_raw(frame(h.PING, 0, 0, b"qsalive!"))
        self._timer = self.loop.call_later(h.TICK_S, self._tick)

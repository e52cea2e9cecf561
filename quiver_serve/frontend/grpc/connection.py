"""One HTTP/2 connection of the gRPC port (``H2Connection``, an ``asyncio.Protocol``): frames
in, streams and their calls started, and the limits that end a connection.

Cleartext HTTP/2 with prior knowledge (``h2c``), as gRPC clients speak it. What it does, per
RFC 9113:

* frames are cut from the bytes received in one pass; DATA, HEADERS (+ CONTINUATION), SETTINGS,
  PING, WINDOW_UPDATE, RST_STREAM, GOAWAY and PRIORITY are handled, unknown types ignored; every
  malformed frame is a connection error (GOAWAY with its code, then close) or a stream error
  (RST_STREAM), as the RFC assigns them;
* header blocks are decoded with ``hpack`` (the HPACK of the ``h2`` project), also those of
  streams that are ignored, so the decoder's table stays in step (``frames.HeaderCache``);
* gRPC messages (a flag byte, a 4-byte length, the message) are cut from a stream's DATA and
  handed to the stream's call (``calls.py``); a message over ``max_message_bytes`` ends the call
  with RESOURCE_EXHAUSTED, a compressed one with UNIMPLEMENTED (no compression is offered);
* flow control both ways: the client's windows (connection and stream) are returned only for
  data its calls have taken, so what a connection buffers is bounded by the windows granted;
  the answers go out within the client's windows (``sending.py``). A connection whose unsent
  answers pass ``MAX_PENDING_BYTES`` refuses new streams (REFUSED_STREAM, which a gRPC client
  may retry) until they drain; one whose transport is full stops reading until it drains;
* abuse limits (``limits.py``, ``server.grpc_limits``): streams open at once, resets, control
  frames, empty frames and CONTINUATIONs per block are counted; past a limit the connection
  gets GOAWAY ENHANCE_YOUR_CALM and is closed at once (``cut_off``): one WARNING line, and
  ``quiver_serve_grpc_connections_closed_total{reason}`` counts it;
* waits: a PING goes out after ``KEEPALIVE_S`` with nothing received, and a connection whose
  PING is not answered within ``KEEPALIVE_TIMEOUT_S``, or whose answers make no progress for
  ``WRITE_STALL_S``, is closed (its calls are cancelled). ``close_gracefully`` sends GOAWAY and
  lets the streams already started finish.

A request costs a few slices of the received bytes, one HPACK decode (mostly table hits) and,
per answer, one ``writelines`` of pre-encoded headers, the DATA frame(s) and the trailers.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any

import hpack

from quiver_serve.frontend.grpc import frames as f
from quiver_serve.frontend.grpc.frames import H2Error, frame
from quiver_serve.frontend.grpc.limits import Abuse, FrameCounters
from quiver_serve.frontend.grpc.sending import H2Sender
from quiver_serve.frontend.grpc.status import GrpcStatus
from quiver_serve.frontend.grpc.streams import H2Stream

log = logging.getLogger(__name__)

#: (stream) -> its call; the call may answer the stream at once (an unknown method, say)
OnRequest = Callable[[H2Stream], Any]
#: (reason, peer, what it did) of a connection cut off for abuse (``limits.REASONS``)
OnCutOff = Callable[[str, str, str], None]

#: answers queued on a connection beyond the client's windows; past this new streams are refused
MAX_PENDING_BYTES = 32 << 20
#: a PING after this long with nothing received; no answer within the timeout closes
KEEPALIVE_S, KEEPALIVE_TIMEOUT_S = 60.0, 20.0
#: answers that make no progress for this long (the client does not read) close the connection
WRITE_STALL_S = 60.0
#: the connection's timer period (keepalive and stall checks)
TICK_S = 5.0


class H2Connection(H2Sender):
    """A client connection: frames in, calls started (module docstring); answers go out
    through :class:`sending.H2Sender`. ``limits`` is a ``config.GrpcLimitsConfig``."""

    def __init__(self, on_request: OnRequest, max_message_bytes: int, limits: Any,
                 registry: set[H2Connection] | None = None,
                 on_cut_off: OnCutOff | None = None) -> None:
        super().__init__()
        self.on_request, self.max_message_bytes = on_request, max_message_bytes
        self.limits, self.registry, self.on_cut_off = limits, registry, on_cut_off
        self.recv_stream_window = min(f.MAX_WINDOW, max(1 << 20, max_message_bytes + 1024))
        self.recv_conn_window = min(f.MAX_WINDOW, max(16 << 20, 2 * self.recv_stream_window))
        self.peer_initial_window = f.DEFAULT_WINDOW
        self.headers = f.HeaderCache(hpack.Decoder(max_header_list_size=f.MAX_HEADER_LIST_BYTES))
        self.streams: dict[int, H2Stream] = {}
        self.last_sid = 0
        self._buf = b""
        self._preface = False
        self._settings_seen = False
        # a header block being continued: stream id, END_STREAM, bytes, CONTINUATIONs so far
        self._cont: tuple[int, bool, bytearray, int] | None = None
        self._ending: list[H2Stream] = []  # requests ended in this read, their calls not told
        self.goaway_sent = self.peer_goaway = False
        self.ping_at: float | None = None
        self.last_recv = 0.0
        self.peer = ""
        self._timer: Any = None

    # ---- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:
        self.transport, self.loop = transport, asyncio.get_running_loop()
        self.peer = f.peer_string(transport.get_extra_info("peername"))
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        raise_by = self.recv_conn_window - f.DEFAULT_WINDOW
        self.recv_window = self.recv_conn_window
        transport.write(f.settings_frame((
            (f.S_MAX_CONCURRENT_STREAMS, self.limits.max_concurrent_streams),
            (f.S_INITIAL_WINDOW_SIZE, self.recv_stream_window),
            (f.S_MAX_HEADER_LIST_SIZE, f.MAX_HEADER_LIST_BYTES),
            (f.S_ENABLE_PUSH, 0))) + f.window_update(0, raise_by))
        self.last_recv = self.loop.time()
        self.counters = FrameCounters(self.limits, self.last_recv)
        self._timer = self.loop.call_later(TICK_S, self._tick)
        if self.registry is not None:
            self.registry.add(self)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self.last_recv = self.loop.time()
        self.counters.roll(self.last_recv)
        try:
            self._receive(self._buf + data if self._buf else data)
            self._end_calls()
        except Abuse as exc:
            self.cut_off(exc)
        except H2Error as exc:
            self.fail(exc.code, str(exc))
        except hpack.HPACKError as exc:
            self.fail(f.COMPRESSION_ERROR, f"header block: {exc}")
        except Exception as exc:  # noqa: BLE001 - a bug ends this connection, not the loop
            log.exception("HTTP/2 connection from %s: internal error", self.peer)
            self.fail(f.INTERNAL_ERROR, f"internal error: {type(exc).__name__}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
        streams, self.streams = self.streams, {}
        self.blocked.clear()
        self._ending.clear()
        for stream in streams.values():
            self._drop(stream)
        if self.registry is not None:
            self.registry.discard(self)

    # ---- frames in -----------------------------------------------------------------------------
    def _receive(self, data: bytes) -> None:
        pos, n = 0, len(data)
        if not self._preface:
            if n < len(f.PREFACE):
                if not f.PREFACE.startswith(data):
                    raise H2Error(f.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                self._buf = data
                return
            if not data.startswith(f.PREFACE):
                raise H2Error(f.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            self._preface, pos = True, len(f.PREFACE)
        unpack = f.FRAME_HEAD.unpack_from
        while n - pos >= 9 and not self.closed:
            head, flags, sid = unpack(data, pos)
            length, ftype = head >> 8, head & 0xFF
            if length > f.RECV_FRAME_BYTES:
                raise H2Error(f.FRAME_SIZE_ERROR, f"a frame of {length} bytes")
            end = pos + 9 + length
            if end > n:
                break
            self._frame(ftype, flags, sid & 0x7FFFFFFF, data[pos + 9:end])
            pos = end
        self._buf = data[pos:] if pos < n else b""

    def _frame(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        if self._cont is not None and ftype != f.CONTINUATION:
            raise H2Error(f.PROTOCOL_ERROR, "a header block was interrupted")
        if not self._settings_seen:
            if ftype != f.SETTINGS or flags & f.ACK:
                raise H2Error(f.PROTOCOL_ERROR, "the client's first frame must be SETTINGS")
            self._settings_seen = True
        if ftype == f.DATA:
            self._on_data(flags, sid, payload)
        elif ftype == f.HEADERS:
            self._on_headers(flags, sid, payload)
        elif ftype == f.WINDOW_UPDATE:
            self._on_window_update(sid, payload)
        elif ftype == f.SETTINGS:
            self._on_settings(flags, sid, payload)
        elif ftype == f.PING:
            self._on_ping(flags, sid, payload)
        elif ftype == f.RST_STREAM:
            self._on_rst(sid, payload)
        elif ftype == f.CONTINUATION:
            self._on_continuation(flags, sid, payload)
        elif ftype == f.GOAWAY:
            if sid != 0:
                raise H2Error(f.PROTOCOL_ERROR, "GOAWAY on a stream")
            self.peer_goaway = True
            self._maybe_close()
        elif ftype == f.PRIORITY:
            if sid == 0 or len(payload) != 5:
                raise H2Error(f.PROTOCOL_ERROR, "a malformed PRIORITY frame")
            self.counters.priority()
        elif ftype == f.PUSH_PROMISE:
            raise H2Error(f.PROTOCOL_ERROR, "a client may not push")
        else:  # unknown frame types are ignored (RFC 9113, 5.5), and counted
            self.counters.empty_frame()

    def _on_data(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise H2Error(f.PROTOCOL_ERROR, "DATA on stream 0")
        length = len(payload)
        if not length and not flags & f.END_STREAM:
            self.counters.empty_frame()
        self.recv_window -= length
        if self.recv_window < 0:
            raise H2Error(f.FLOW_CONTROL_ERROR, "DATA beyond the connection's window")
        data = f.unpad(flags, payload)
        stream = self.streams.get(sid)
        if stream is None or stream.remote_closed:
            self.return_connection_window(length)
            if stream is None and sid > self.last_sid:
                raise H2Error(f.PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            if stream is not None:
                self.reset(stream, f.STREAM_CLOSED)
            return
        stream.recv_window -= length
        if stream.recv_window < 0:
            self.return_connection_window(length)
            self.reset(stream, f.FLOW_CONTROL_ERROR)
            return
        if length != len(data):
            stream.return_window(length - len(data))
        if data and not stream.done:
            stream.buf += data
            self._cut_messages(stream)
        elif data:  # answered already (an error): the rest of its request is dropped
            stream.return_window(len(data))
        if flags & f.END_STREAM:
            self._end_remote(stream)

    def _cut_messages(self, stream: H2Stream) -> None:
        """Hand each whole gRPC message in the stream's bytes to its call."""
        buf = stream.buf
        while len(buf) >= 5 and not stream.done:
            compressed, size = f.MESSAGE_PREFIX.unpack_from(buf)
            if size > self.max_message_bytes:
                stream.return_window(len(buf))
                buf.clear()
                stream.finish(GrpcStatus.RESOURCE_EXHAUSTED,
                              f"request message of {size} bytes exceeds the largest accepted "
                              f"({self.max_message_bytes} bytes)")
                return
            if len(buf) < 5 + size:
                return
            payload = bytes(buf[5:5 + size])
            del buf[:5 + size]
            if compressed:
                stream.return_window(size + 5)
                stream.finish(GrpcStatus.UNIMPLEMENTED, "compressed messages are not supported "
                                                        "(grpc-encoding identity only)")
                return
            stream.call.message(stream, payload)  # type: ignore[union-attr]

    def _on_headers(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise H2Error(f.PROTOCOL_ERROR, "HEADERS on stream 0")
        payload = f.unpad(flags, payload)
        if flags & f.PRIORITY_FLAG:
            if len(payload) < 5:
                raise H2Error(f.PROTOCOL_ERROR, "HEADERS too short for its priority")
            payload = payload[5:]
        if flags & f.END_HEADERS:
            self._headers_done(sid, bool(flags & f.END_STREAM), payload)
        else:
            self._cont = (sid, bool(flags & f.END_STREAM), bytearray(payload), 0)

    def _on_continuation(self, flags: int, sid: int, payload: bytes) -> None:
        if self._cont is None or self._cont[0] != sid:
            raise H2Error(f.PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
        _, end_stream, block, count = self._cont
        self.counters.continuation(count + 1)
        if not payload and not flags & f.END_HEADERS:
            self.counters.empty_frame()
        block += payload
        if len(block) > f.MAX_HEADER_BLOCK_BYTES:
            raise H2Error(f.ENHANCE_YOUR_CALM, "a header block over "
                                               f"{f.MAX_HEADER_BLOCK_BYTES} bytes")
        if flags & f.END_HEADERS:
            self._cont = None
            self._headers_done(sid, end_stream, bytes(block))
        else:
            self._cont = (sid, end_stream, block, count + 1)

    def _headers_done(self, sid: int, end_stream: bool, block: bytes) -> None:
        try:
            headers = self.headers.decode(block)
        except hpack.OversizedHeaderListError:  # mid-block: the table is no longer in step
            raise H2Error(f.ENHANCE_YOUR_CALM, f"request metadata over "
                                               f"{f.MAX_HEADER_LIST_BYTES} bytes") from None
        stream = self.streams.get(sid)
        if stream is not None:  # trailers from the client
            if stream.remote_closed or not end_stream:
                raise H2Error(f.PROTOCOL_ERROR, f"HEADERS on stream {sid} mid-request")
            self._end_remote(stream)
            return
        if sid <= self.last_sid:
            return  # a stream already closed here (reset): nothing more is read of it
        if sid % 2 == 0:
            raise H2Error(f.PROTOCOL_ERROR, f"stream {sid}: a client's streams are odd")
        self.last_sid = sid
        self.counters.stream_opened()
        if self.goaway_sent or len(self.streams) >= self.limits.max_concurrent_streams or (
                self.blocked and self.pending_bytes() > MAX_PENDING_BYTES):
            self.send_control(f.rst_stream(sid, f.REFUSED_STREAM))
            return
        stream = H2Stream(sid, self, headers, self.peer_initial_window)
        self.streams[sid] = stream
        stream.remote_closed = end_stream  # a request without a body (an answer forgets it)
        stream.call = self.on_request(stream)
        if end_stream and not stream.done and stream.call is not None:
            self._ending.append(stream)

    def _on_window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise H2Error(f.FRAME_SIZE_ERROR, "WINDOW_UPDATE of a wrong size")
        self.counters.window_update()
        inc = f.decode_u32(payload) & 0x7FFFFFFF
        if sid == 0:
            if inc == 0:
                raise H2Error(f.PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
            self.send_window += inc
            if self.send_window > f.MAX_WINDOW:
                raise H2Error(f.FLOW_CONTROL_ERROR, "the connection window overflowed")
            for stream in list(self.blocked.values()):
                self.flush(stream)
            return
        stream = self.streams.get(sid)
        if stream is None:
            return
        stream.send_window += inc
        if inc == 0 or stream.send_window > f.MAX_WINDOW:
            self.reset(stream, f.PROTOCOL_ERROR if inc == 0 else f.FLOW_CONTROL_ERROR)
            return
        self.flush(stream)

    def _on_settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid != 0:
            raise H2Error(f.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & f.ACK:
            if payload:
                raise H2Error(f.FRAME_SIZE_ERROR, "a SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise H2Error(f.FRAME_SIZE_ERROR, "SETTINGS of a wrong size")
        self.counters.settings_frame()
        grew = False
        for ident, value in f.decode_settings(payload):
            if ident == f.S_INITIAL_WINDOW_SIZE:
                if value > f.MAX_WINDOW:
                    raise H2Error(f.FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE too large")
                delta, self.peer_initial_window = value - self.peer_initial_window, value
                for stream in self.streams.values():
                    stream.send_window += delta
                grew = grew or delta > 0
            elif ident == f.S_MAX_FRAME_SIZE:
                if not f.MIN_FRAME_BYTES <= value <= f.MAX_FRAME_BYTES:
                    raise H2Error(f.PROTOCOL_ERROR, "SETTINGS_MAX_FRAME_SIZE out of range")
                self.peer_max_frame = value
            elif ident == f.S_ENABLE_PUSH and value > 1:
                raise H2Error(f.PROTOCOL_ERROR, "SETTINGS_ENABLE_PUSH not 0 or 1")
        self.send_control(frame(f.SETTINGS, f.ACK, 0))
        if grew:
            for stream in list(self.blocked.values()):
                self.flush(stream)

    def _on_ping(self, flags: int, sid: int, payload: bytes) -> None:
        if sid != 0:
            raise H2Error(f.PROTOCOL_ERROR, "PING on a stream")
        if len(payload) != 8:
            raise H2Error(f.FRAME_SIZE_ERROR, "PING of a wrong size")
        if flags & f.ACK:
            self.ping_at = None
        else:
            self.counters.ping()
            self.send_control(frame(f.PING, f.ACK, 0, payload))

    def _on_rst(self, sid: int, payload: bytes) -> None:
        if sid == 0 or len(payload) != 4:
            raise H2Error(f.PROTOCOL_ERROR if sid == 0 else f.FRAME_SIZE_ERROR,
                          "a malformed RST_STREAM")
        if sid > self.last_sid:
            raise H2Error(f.PROTOCOL_ERROR, f"RST_STREAM on idle stream {sid}")
        stream = self.streams.pop(sid, None)
        if stream is not None:
            early = not stream.done
            self._drop(stream)  # the call is cancelled before its batch leaves (decision 0036)
            self.counters.reset(early)
            self._maybe_close()
        else:
            self.counters.reset(False)

    # ---- streams -------------------------------------------------------------------------------
    def _end_remote(self, stream: H2Stream) -> None:
        stream.remote_closed = True
        if not stream.done and stream.call is not None:
            self._ending.append(stream)
        elif stream.done:
            self.forget(stream)

    def _end_calls(self) -> None:
        """Tell the calls whose request ended in this read, in order, once the whole read is
        applied: a call the client reset in the same read never starts (no parse, no engine
        work: the rapid reset's calls, decision 0036)."""
        ending, self._ending = self._ending, []
        for stream in ending:
            if not stream.done and not self.closed:
                stream.call.end(stream)  # type: ignore[union-attr]
                if stream.done:
                    self.forget(stream)

    def _drop(self, stream: H2Stream) -> None:
        """The stream is gone (reset, or the connection lost): its call is cancelled."""
        self.blocked.pop(stream.sid, None)
        stream.out.clear()
        stream.out_bytes = 0
        was_done, stream.done = stream.done, True
        if not was_done and stream.call is not None:
            stream.call.cancel(stream)
        stream.wake()

    def forget(self, stream: H2Stream) -> None:
        """An answered stream: a request still coming is cut short (RST_STREAM NO_ERROR)."""
        if self.streams.pop(stream.sid, None) is None:
            return
        if not stream.remote_closed and not self.closed:
            self.send_raw(f.rst_stream(stream.sid, f.NO_ERROR))
        self._maybe_close()

    def reset(self, stream: H2Stream, code: int) -> None:
        """A stream error: RST_STREAM with ``code``; its call is cancelled."""
        if self.streams.pop(stream.sid, None) is not None and not self.closed:
            self.send_raw(f.rst_stream(stream.sid, code))
        self._drop(stream)
        self._maybe_close()

    def _maybe_close(self) -> None:
        if (self.goaway_sent or self.peer_goaway) and not self.streams and not self.closed:
            self.transport.close()

    # ---- the end -------------------------------------------------------------------------------
    def fail(self, code: int, message: str) -> None:
        """A connection error: GOAWAY naming it, then close at once (a peer that does not read
        its GOAWAY is not waited for)."""
        log.debug("HTTP/2 connection from %s ended: %s (code %d)", self.peer, message, code)
        if not self.closed:
            self.transport.write(f.goaway(self.last_sid, code, message.encode()))
            self.goaway_sent = True
            if self.write_paused:
                self.transport.abort()
            else:
                self.transport.close()
            self.closed = True

    def cut_off(self, exc: Abuse) -> None:
        """A limit passed (``limits.py``): GOAWAY ENHANCE_YOUR_CALM and close; ``on_cut_off``
        logs it and counts it (``server.H2Server``), else one WARNING line here."""
        detail = f"{exc}; {self.counters.summary(self.loop.time())}"
        if self.on_cut_off is not None:
            self.on_cut_off(exc.reason, self.peer or "unknown peer", detail)
        else:
            log.warning("gRPC connection from %s cut off (%s): %s", self.peer or "unknown peer",
                        exc.reason, detail)
        self.fail(exc.code, str(exc))

    def close_gracefully(self) -> None:
        """GOAWAY: no new streams; the connection closes once those started are answered."""
        if not self.goaway_sent and not self.closed:
            self.goaway_sent = True
            self.send_raw(f.goaway(self.last_sid, f.NO_ERROR))
        self._maybe_close()

    def _tick(self) -> None:
        """Keepalive and stall checks, every ``TICK_S``."""
        if self.closed:
            return
        now = self.loop.time()
        if self.ping_at is not None and now - self.ping_at > KEEPALIVE_TIMEOUT_S:
            log.info("HTTP/2 connection from %s: no PING answer in %.0f s; closing",
                     self.peer, KEEPALIVE_TIMEOUT_S)
            self.transport.abort()
            return
        if not self.blocked and not self.write_paused:
            self.stuck_since = None  # nothing waits to go out (a blocked stream was reset)
        elif self.stuck_since is not None and now - self.stuck_since > WRITE_STALL_S:
            log.warning("HTTP/2 connection from %s: answers waited %.0f s to be sent (the "
                        "client does not read); closing", self.peer, WRITE_STALL_S)
            self.transport.abort()
            return
        if self.ping_at is None and now - self.last_recv > KEEPALIVE_S:
            self.ping_at = now
            self.send_raw(frame(f.PING, 0, 0, b"qsalive!"))
        self._timer = self.loop.call_later(TICK_S, self._tick)

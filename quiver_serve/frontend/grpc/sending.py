"""The sending half of one HTTP/2 connection (:class:`H2Sender`, the base of
``connection.H2Connection``): answers within the client's windows and frame size, the
connection window given back, reading paused while the transport is full.

The answers are sent within the client's windows (connection and stream) and its largest frame
size; the rest waits in its stream for the client's WINDOW_UPDATE (``blocked``). Control frames
(ACKs, refusals) written while the transport is full are counted (``limits.FrameCounters``):
a client that sends PINGs and reads nothing is cut off, not buffered for.
"""

from __future__ import annotations

import asyncio
from typing import Any

from quiver_serve.frontend.grpc.frames import (
    DATA,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    MIN_FRAME_BYTES,
    RESPONSE_HEADERS,
    frame,
    frame_head,
    window_update,
)
from quiver_serve.frontend.grpc.limits import FrameCounters
from quiver_serve.frontend.grpc.streams import H2Stream


class H2Sender(asyncio.Protocol):
    """Frames out (module docstring); ``connection.H2Connection`` reads."""

    def __init__(self) -> None:
        self.transport: Any = None
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self.closed = False
        self.send_window = DEFAULT_WINDOW
        self.peer_max_frame = MIN_FRAME_BYTES
        self.recv_window = DEFAULT_WINDOW  # raised when the connection is made
        self.recv_conn_window = DEFAULT_WINDOW
        self.conn_unreturned = 0
        self.blocked: dict[int, H2Stream] = {}  # streams with DATA waiting for window
        self.write_paused = self.reading_paused = False
        self.stuck_since: float | None = None
        self.counters: FrameCounters = None  # type: ignore[assignment]  # set on connect

    def forget(self, stream: H2Stream) -> None:
        """An answered stream leaves the connection (``H2Connection`` says how)."""
        raise NotImplementedError

    # ---- asyncio.Protocol: the transport's buffer ------------------------------------------------
    def pause_writing(self) -> None:
        self.write_paused = True
        if self.stuck_since is None:
            self.stuck_since = self.loop.time()
        self.update_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        self.stuck_since = None
        self.counters.transport_drained()
        self.update_reading()

    def update_reading(self) -> None:
        """Reading stops while the transport is full (the client does not read its socket);
        answers held by the client's windows do not stop it (its WINDOW_UPDATE must get in)."""
        pause = self.write_paused
        if pause != self.reading_paused and not self.closed:
            self.reading_paused = pause
            (self.transport.pause_reading if pause else self.transport.resume_reading)()

    # ---- frames out ------------------------------------------------------------------------------
    def send_raw(self, data: bytes) -> None:
        if not self.closed and not self.transport.is_closing():
            self.transport.write(data)

    def send_control(self, data: bytes) -> None:
        """An ACK or a refusal: counted when the transport is full (``limits.Abuse`` past
        ``max_queued_acks``)."""
        if self.write_paused:
            self.counters.ack_queued()
        self.send_raw(data)

    def return_connection_window(self, nbytes: int) -> None:
        self.conn_unreturned += nbytes
        if self.conn_unreturned >= self.recv_conn_window // 4:
            self.recv_window += self.conn_unreturned
            self.send_raw(window_update(0, self.conn_unreturned))
            self.conn_unreturned = 0

    def flush(self, stream: H2Stream) -> None:
        """Send what the windows allow of the stream's answer, then its trailers."""
        if stream.done or self.closed or self.transport.is_closing():
            return
        parts: list[Any] = []
        if stream.out:
            if not stream.headers_sent:
                stream.headers_sent = True
                parts.append(frame(HEADERS, END_HEADERS, stream.sid, RESPONSE_HEADERS))
            before = stream.out_bytes
            self._data_frames(stream, parts)
            if stream.out_bytes != before:
                self.stuck_since = None
        if stream.trailers is not None and not stream.out:
            parts.append(frame(HEADERS, END_HEADERS | END_STREAM, stream.sid, stream.trailers))
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
        self.update_reading()
        if stream.done:
            self.forget(stream)

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
            parts.append(frame_head(DATA, 0, stream.sid, size))
            parts.extend(pieces)
            self.send_window -= size
            stream.send_window -= size
            stream.out_bytes -= size
            self.counters.data_frame_sent()

    def pending_bytes(self) -> int:
        """DATA queued beyond the client's windows, all streams."""
        return sum(stream.out_bytes for stream in self.blocked.values())

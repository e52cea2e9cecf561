"""The gRPC port's listening socket and its connections (``connection.H2Connection``), and the
log line and metric of each connection cut off for abuse (``limits.py``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from quiver_serve.frontend.grpc.connection import H2Connection, OnRequest

log = logging.getLogger(__name__)

#: WARNING lines of connections cut off, at most this many per second per process (an attacker
#: that reconnects must not flood the log too); the next line says how many were left out
CUT_OFF_LINES_PER_S = 10


class H2Server:
    """The listening socket and its connections; ``stop(grace)`` drains them. ``limits`` is a
    ``config.GrpcLimitsConfig``; ``count_cut_off(reason)`` is told of each connection ended for
    passing one (the metric)."""

    def __init__(self, on_request: OnRequest, max_message_bytes: int, limits: Any,
                 count_cut_off: Callable[[str], None] | None = None) -> None:
        self.on_request, self.max_message_bytes = on_request, max_message_bytes
        self.limits, self.count_cut_off = limits, count_cut_off
        self.connections: set[H2Connection] = set()
        self.server: asyncio.AbstractServer | None = None
        self.port = 0
        self.cut_off_total = 0
        self._log_second, self._lines, self._left_out = 0, 0, 0

    def on_cut_off(self, reason: str, peer: str, detail: str) -> None:
        """A connection passed a limit: counted (``count_cut_off``: the metric) and logged,
        one WARNING line each up to ``CUT_OFF_LINES_PER_S``."""
        self.cut_off_total += 1
        if self.count_cut_off is not None:
            self.count_cut_off(reason)
        second = int(time.monotonic())
        if second != self._log_second:
            self._log_second, self._lines = second, 0
        if self._lines >= CUT_OFF_LINES_PER_S:
            self._left_out += 1
            return
        self._lines += 1
        more = f" ({self._left_out} more cut off before this, not logged)" if self._left_out \
            else ""
        self._left_out = 0
        log.warning("gRPC connection from %s cut off (%s): %s%s", peer, reason, detail, more)

    async def start(self, host: str, port: int, backlog: int = 4096) -> int:
        """Listen on ``host:port`` (``SO_REUSEPORT``: every front-end binds it); the port."""
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(
            lambda: H2Connection(self.on_request, self.max_message_bytes, self.limits,
                                 self.connections, self.on_cut_off),
            host, port, reuse_port=True, backlog=backlog)
        await self.server.start_serving()  # listening before the front-end says it is ready
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self, grace: float | None = None) -> None:
        """Stop listening; GOAWAY to every connection; after ``grace`` seconds (None: at
        once) the connections still open are closed and their calls cancelled."""
        if self.server is not None:
            self.server.close()
        for conn in list(self.connections):
            conn.close_gracefully()
        if grace:
            deadline = asyncio.get_running_loop().time() + grace
            while self.connections and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.abort()
        await asyncio.sleep(0)

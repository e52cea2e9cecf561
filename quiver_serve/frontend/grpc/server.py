"""The gRPC port's listening socket and its connections (``connection.H2Connection``)."""

from __future__ import annotations

import asyncio
from typing import Any

from quiver_serve.frontend.grpc.connection import H2Connection, OnCutOff, OnRequest


class H2Server:
    """The listening socket and its connections; ``stop(grace)`` drains them. ``limits`` is a
    ``config.GrpcLimitsConfig``; ``on_cut_off(reason, peer)`` is told of each connection ended
    for passing one (the metric)."""

    def __init__(self, on_request: OnRequest, max_message_bytes: int, limits: Any,
                 on_cut_off: OnCutOff | None = None) -> None:
        self.on_request, self.max_message_bytes = on_request, max_message_bytes
        self.limits, self.on_cut_off = limits, on_cut_off
        self.connections: set[H2Connection] = set()
        self.server: asyncio.AbstractServer | None = None
        self.port = 0

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

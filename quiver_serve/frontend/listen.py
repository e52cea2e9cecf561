"""Listening sockets shared by several front-end processes, and uvicorn with a graceful drain.

Several front-ends serve one port with ``SO_REUSEPORT``: each process binds and listens on its own
socket, and the kernel spreads new connections over the listening sockets by a hash of the
connection's addresses (so a keep-alive connection stays with one process). A process that dies
takes only its own connections with it, including those the kernel had queued for it but it had
not accepted yet; the kernel sends new connections to the others at once.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

import uvicorn

log = logging.getLogger(__name__)

LISTEN_BACKLOG = 2048


def _family(host: str, port: int) -> socket.AddressFamily:
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    return info[0][0]


def check_port_free(host: str, port: int) -> int:
    """Bind ``host:port`` without ``SO_REUSEPORT`` and let go: fails (OSError) if anything holds
    the port, even another daemon's ``SO_REUSEPORT`` group, which a reuse-port bind would quietly
    join (``SO_REUSEADDR`` only passes over connections in TIME_WAIT, as uvicorn's own bind
    does). Returns the port (a free one when ``port`` is 0)."""
    with socket.socket(_family(host, port), socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        return int(s.getsockname()[1])


def reuseport_socket(host: str, port: int, listen: bool) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEPORT`` (listening if ``listen``).

    Unlistened, it only holds the port for its group: the kernel gives connections to listening
    sockets only, and nobody outside the group can take the port while a front-end restarts."""
    sock = socket.socket(_family(host, port), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        if listen:
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def uvicorn_speedups() -> dict[str, str]:
    """uvicorn's ``loop`` and ``http`` named outright: uvloop and httptools where they import
    (both are dependencies), else asyncio and h11 with a warning. uvicorn's ``auto`` picks the
    same but quietly, and a machine without uvloop (a GPU box fed wheels by hand) then pays for
    the asyncio loop on every request without saying so."""
    import importlib.util

    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    if (loop, http) != ("uvloop", "httptools"):
        log.warning("uvicorn runs on %s + %s (uvloop / httptools not installed): each request "
                    "costs more CPU", loop, http)
    return {"loop": loop, "http": http}


def uvicorn_options(app: Any) -> dict[str, Any]:
    """``uvicorn_speedups()``, with the hot routes answered in the HTTP protocol itself
    (``frontend/hot_protocol.py``) when httptools imports (else the app's ASGI adapter answers
    them, with the same functions: ``frontend/fastpath.py``)."""
    options: dict[str, Any] = dict(uvicorn_speedups())
    if options["http"] == "httptools":
        from quiver_serve.frontend.hot_protocol import hot_protocol

        state = app.state.qs
        options["http"] = hot_protocol(state, state.tokens, state.cfg.server.max_body_bytes)
    return options


class DrainingServer(uvicorn.Server):
    """uvicorn whose first SIGTERM/SIGINT (or :meth:`drain`) drains: readiness 503, new requests
    503, admitted ones finish (bounded by ``drain_timeout_s``), then it exits 0. A second signal
    stops at once."""

    def __init__(self, config: uvicorn.Config, pipeline: Any, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.pipeline = pipeline
        self.drain_timeout_s = drain_timeout_s
        self.draining = False
        self.loop: Any = None
        self._lock = threading.Lock()

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        import asyncio

        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.draining:  # a second signal: stop now
            super().handle_exit(sig, frame)
        else:
            self.drain(f"signal {sig}")
        # uvicorn re-raises the signal after shutdown; a requested stop is a clean exit (0).
        self._captured_signals.clear()

    def drain(self, why: str) -> None:
        with self._lock:
            if self.draining:
                return
            self.draining = True
        log.info("%s: draining (up to %.0f s)", why, self.drain_timeout_s)
        threading.Thread(target=self._drain, name="quiver-drain", daemon=True).start()

    def _drain(self) -> None:
        self.pipeline.begin_drain()
        self.pipeline.wait_drained(self.drain_timeout_s)
        self.should_exit = True

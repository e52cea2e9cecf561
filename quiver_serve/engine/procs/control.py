"""The control line between children and the supervisor: a child's ``Reporter`` (ready, failed,
heartbeat) and the supervisor's reader of those messages, over one PULL socket at
``RunAddresses.control`` (``wire.py``)."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import zmq

from quiver_serve.wire import Control, Decoders, RunAddresses, encode

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
#: how long a child that failed to start lives on after saying so: its "failed" message leaves
#: the socket's queue (the supervisor names it when it gives up on the child), then it exits
FAILED_LINGER_S = 0.5


def bind_fresh(sock: zmq.Socket, address: str) -> None:
    """Bind an IPC address, first removing the file a killed predecessor left behind."""
    path = Path(address.removeprefix("ipc://"))
    path.unlink(missing_ok=True)
    sock.bind(address)


class Reporter:
    """A child's line to the supervisor (never blocks: the supervisor may be gone)."""

    def __init__(self, ctx: zmq.Context, addrs: RunAddresses, role: str, index: int) -> None:
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 500)
        self.sock.setsockopt(zmq.SNDHWM, 64)
        self.sock.connect(addrs.control)
        self.role, self.index = role, index
        self._last_beat = 0.0

    def send(self, kind: str, **info: Any) -> None:
        try:
            self.sock.send(encode(Control(kind, self.role, self.index, os.getpid(), info)),
                           zmq.NOBLOCK)
        except zmq.Again:
            pass

    def heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_beat >= HEARTBEAT_S:
            self._last_beat = now
            self.send("heartbeat")


def exit_failed(reporter: Reporter, exc: BaseException) -> NoReturn:
    """A child's start-up failed: report ``failed`` with the error, log the traceback, exit 1.

    The exit skips the interpreter's shutdown (torch's finalisers take 1-2 s on a small box, and
    the supervisor waits for the death to restart the child); the message is delivered first."""
    reporter.send("failed", message=f"{type(exc).__name__}: {exc}")
    log.error("%s %d failed to start", reporter.role, reporter.index, exc_info=exc)
    # closes every socket of the context, waiting (at most the linger) until the message is out
    reporter.sock.context.destroy(linger=int(FAILED_LINGER_S * 1000))
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(1)


def control_messages(sock: zmq.Socket, timeout_ms: int) -> Iterator[Control]:
    """Every readable control message waiting on the supervisor's PULL socket (after up to
    ``timeout_ms`` for the first); an unreadable one is logged and skipped, never fatal."""
    if not sock.poll(timeout_ms):
        return
    while True:
        try:
            raw = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        try:
            yield Decoders.control.decode(raw)
        except Exception:  # noqa: BLE001 - a stray or truncated message
            log.error("unreadable control message (%d bytes) ignored", len(raw))

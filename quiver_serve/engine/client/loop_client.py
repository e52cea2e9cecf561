"""LoopClient: an EngineClient driven by one asyncio event loop instead of an IO thread.

A coroutine caller of the thread-driven client pays two thread hand-offs per request: the
submit wakes the IO thread (a pipe write, a scheduler wake, the GIL), and the reply comes back
through ``call_soon_threadsafe`` (the loop's self-pipe, another wake). In a front-end process
the IO thread also competes with the event loop for the GIL under load. Here the loop owns
the ZeroMQ sockets: a request submitted during one loop iteration is sent at the end of it
(``call_soon``: every request of that iteration goes in one micro-batch, the same per-tick
batching as the IO thread's), replies are read by reader callbacks on the sockets' file
descriptors and resolve their futures directly, and deadlines (and held requests, with
``batching.adaptive: false``) are swept by one timer armed for the earliest.

ZeroMQ's ``FD`` is edge-triggered: it signals that the socket's events may have changed, and a
send or receive can consume that signal; and a socket signals a message only after a read found
it empty (asking for ``EVENTS`` counts). So every socket is asked once when the client starts,
each callback reads until the socket is empty, and after any send the sockets' ``EVENTS`` are
checked again. (A monitor socket never asked would not report its engine core's death.)

Every method but ``stop()`` runs on the loop's thread; ``submit()`` (sync futures) is refused
from other threads. Everything else (spreading over engine cores, retry after an engine core
dies, 503 and 504 answers) is the base class's, unchanged.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

import zmq

from quiver_serve.engine.client.client import EngineClient, EngineEndpoints
from quiver_serve.messages import EmbedResult
from quiver_serve.metrics.observer import PipelineObserver
from quiver_serve.wire import InductiveNodes

log = logging.getLogger(__name__)

_GAUGE_S = 0.5
_STOP_WAIT_S = 2.0


class LoopClient(EngineClient):
    """An :class:`EngineClient` whose IO runs on the event loop it was created on."""

    def __init__(self, endpoints: EngineEndpoints, observer: PipelineObserver | None = None,
                 name: str = "client", loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._flush_handle: asyncio.Handle | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at_s = 0.0
        self._last_gauge_s = 0.0
        self._closed = False
        super().__init__(endpoints, observer, name)

    # ---- driving -------------------------------------------------------------------------------
    def _start_io(self, name: str) -> None:
        self._home_loop = self._loop
        self._open_sockets()
        for e, (sock, mon) in enumerate(zip(self._socks, self._monitors, strict=True)):
            self._loop.add_reader(sock.getsockopt(zmq.FD), self._on_readable, e)
            self._loop.add_reader(mon.getsockopt(zmq.FD), self._on_monitor_readable, e)
            # Arm both: a socket signals its FD only after a read found it empty (asking for
            # EVENTS counts); a socket never asked would not signal its first message.
            sock.getsockopt(zmq.EVENTS)
            mon.getsockopt(zmq.EVENTS)

    def _on_home_thread(self) -> bool:
        return threading.get_ident() == self._loop_thread

    def submit(self, node_ids: Any, exact: bool = False, seed: int | None = None,
               deadline_s: float | None = None, request_id: str | None = None,
               min_version: int = 0, inductive: InductiveNodes | None = None,
               model: str = "", version: int = 0) -> Future[EmbedResult]:
        if not self._on_home_thread():
            raise RuntimeError("a LoopClient takes requests only on its event loop's thread")
        return super().submit(node_ids, exact, seed, deadline_s, request_id, min_version,
                              inductive, model, version)

    def _wake(self) -> None:
        """Send at the end of this loop iteration, with whatever else it submits."""
        if self._flush_handle is None and not self._closed:
            self._flush_handle = self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_handle = None
        if self._closed:
            return
        self._send_new()
        self._after_io()

    def _on_readable(self, engine: int) -> None:
        if not self._closed:
            self._receive(engine, self._socks[engine])
            self._after_io()

    def _on_monitor_readable(self, engine: int) -> None:
        if not self._closed and self._monitors[engine].getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._on_monitor(engine)
            self._after_io()

    def _after_io(self) -> None:
        """Read what a send may have hidden from the edge-triggered FDs, answer expired
        requests, and arm the timer for the next deadline (or held request)."""
        for e, sock in enumerate(self._socks):
            if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._receive(e, sock)
        now_s = time.time()
        self._sweep(now_s)
        self._arm_timer(now_s)
        mono = time.monotonic()
        if mono - self._last_gauge_s > _GAUGE_S:
            self._last_gauge_s = mono
            self.observer.on_pending(self._pending)

    def _arm_timer(self, now_s: float) -> None:
        deadlines = self._deadlines
        while deadlines and deadlines[0][2].done:  # answered: no deadline to keep
            heapq.heappop(deadlines)
        due = [deadlines[0][0]] if deadlines else []
        if self._held:
            due.append(now_s + self._held[0].arrived_s + self.endpoints.hold_s - time.monotonic())
        if not due:
            return
        at_s = min(due)
        if self._timer is not None:
            if self._timer_at_s <= at_s:
                return
            self._timer.cancel()
        self._timer_at_s = at_s
        self._timer = self._loop.call_later(max(at_s - now_s, 0.0) + 1e-4, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._flush()

    # ---- stopping ------------------------------------------------------------------------------
    def _stop_io(self, timeout_s: float) -> None:
        """Close the sockets on the loop's thread (or here, if that loop no longer runs)."""
        if self._on_home_thread() or not self._loop.is_running():
            self._close_io()
            return
        done = threading.Event()

        def close() -> None:
            self._close_io()
            done.set()

        try:
            self._loop.call_soon_threadsafe(close)
        except RuntimeError:  # the loop closed meanwhile
            self._close_io()
            return
        if not done.wait(min(timeout_s, _STOP_WAIT_S)):
            log.warning("loop client: its event loop did not close the sockets in time")

    def _close_io(self) -> None:
        if self._closed:
            return
        self._closed = True
        for handle in (self._flush_handle, self._timer):
            if handle is not None:
                handle.cancel()
        for s in self._socks + self._monitors:
            try:
                if not self._loop.is_closed():
                    self._loop.remove_reader(s.getsockopt(zmq.FD))
            except (zmq.ZMQError, ValueError, RuntimeError):
                pass
            s.close(linger=0)


def connect_async(endpoints: EngineEndpoints, observer: PipelineObserver | None = None,
                  name: str = "client") -> LoopClient:
    """A client of a running daemon's engine cores driven by the running event loop (call it
    from a coroutine; use its ``submit_async`` there)."""
    return LoopClient(endpoints, observer, name, asyncio.get_running_loop())

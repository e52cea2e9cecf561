"""EngineClient: the front-end side of the serving path, usable in any process.

Requests cost O(1) small Python work here (validation, a future, an append); everything past this
module is per micro-batch. One IO thread owns the ZeroMQ sockets (sockets are not thread-safe):
each loop tick it takes every request submitted since the last tick, groups them into micro-batches
(``sending.py``: sampled / exact; a seeded request travels alone so its sample is reproducible,
and so does an inductive one, whose ``new_nodes`` frames follow the usual ones), sends each to the
engine core with the least outstanding work, reads every reply that arrived, then resolves their
futures, and answers expired requests with 504. ``submit`` gives a ``concurrent.futures.Future``;
``submit_async`` an ``asyncio.Future`` resolved on its own loop, one ``call_soon_threadsafe`` per
reply; ``call`` blocks the calling thread on a :class:`~.inflight.Waiter` (``Pipeline.embed``).
Blocked callers answered in one tick are woken in turn (``inflight.wake_in_turn``), and their next
requests wake the IO thread only once all are back, or a quiet moment says no more are coming
(``returns.py``), so each round of them leaves as one micro-batch.

When an engine core's connection drops (kill -9, a sticky CUDA error), the micro-batches it held
are sent again once (embedding is idempotent; ZeroMQ delivers them when the supervisor has
restarted it, or to another engine core) and answered 503 if that copy is lost too.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from quiver_serve import errors
from quiver_serve.engine.client.inflight import Admitted, Flight, Waiter, wake_in_turn
from quiver_serve.engine.client.returns import ReturnGate
from quiver_serve.engine.client.sending import MicroBatchSender
from quiver_serve.messages import EmbedResult, ErrorInfo
from quiver_serve.metrics.observer import PipelineObserver
from quiver_serve.wire import (
    Decoders,
    InductiveNodes,
    MicroBatchDone,
    RunAddresses,
    disconnect_monitor,
)

log = logging.getLogger(__name__)

_MAX_SLEEP_S = 0.05
_RETRIES = 1
#: a blocking call gives up this long after its deadline (the client answers by the deadline)
_WAIT_MARGIN_S = 5.0
#: a chain of waiters woken in turn that has not reached its end by then is woken directly
_CHAIN_CHECK_S = 0.05


@dataclass(frozen=True)
class EngineEndpoints:
    """How a client in any process reaches one daemon's engine cores (picklable)."""

    addrs: RunAddresses
    num_engines: int
    num_nodes: int
    dim: int
    max_request_nodes: int
    max_batch_nodes: int
    max_pending_requests: int
    request_timeout_s: float
    overload_status: int = 503
    #: 0: a micro-batch leaves every loop tick (adaptive); else requests are held until the oldest
    #: waited this long or ``max_batch_nodes`` ids are held (``batching.adaptive: false``)
    hold_s: float = 0.0


class EngineClient(MicroBatchSender):
    """Submit requests, get futures; see the module docstring. Thread-safe ``submit``."""

    def __init__(self, endpoints: EngineEndpoints, observer: PipelineObserver | None = None,
                 name: str = "client") -> None:
        self.endpoints = endpoints
        self.observer = observer or PipelineObserver()
        self._inbox: deque[Admitted] = deque()
        self._held: list[Admitted] = []
        self._held_ids = 0
        self._lock = threading.Lock()
        self._pending = 0
        self._pending_ids = 0  # ids of admitted, unanswered requests (told to the engines)
        self._ids = itertools.count()
        self._seq = itertools.count()
        self._flights: dict[int, Flight] = {}
        self._by_id: dict[str, Admitted] = {}
        self._load = [0] * endpoints.num_engines
        #: per engine core: micro-batches sent to it and answered by it (observability)
        self.sent = [0] * endpoints.num_engines
        self.answered = [0] * endpoints.num_engines
        #: per engine core: (ids other clients have there, when it said so)
        self._others = [(0, 0.0)] * endpoints.num_engines
        self._next_engine = os.getpid() % endpoints.num_engines  # clients start apart
        self._deadlines: list[tuple[float, int, Admitted]] = []
        self._tie = itertools.count()
        self._stopping = threading.Event()
        self._sleeping = False
        #: when answered blocking callers' next requests wake the IO thread (``returns.py``)
        self._gate = ReturnGate()
        #: while the IO thread reads replies: the answers it sets once every reply is read
        self._deferred: list[tuple[Any, EmbedResult]] | None = None
        self._chains: deque[tuple[float, list[Waiter]]] = deque()  # (started, waiters)
        self._callers = threading.local()  # per blocking thread: when it last got its answer
        self._io_ident = 0
        #: the event loop that drives this client (``LoopClient``); None: the IO thread does
        self._home_loop: asyncio.AbstractEventLoop | None = None
        self._socks: list[zmq.Socket] = []
        self._monitors: list[zmq.Socket] = []
        self._start_io(name)

    def _start_io(self, name: str) -> None:
        """Start what drives the sockets: here an IO thread (``LoopClient``: an event loop)."""
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._thread = threading.Thread(target=self._run, name=f"quiver-{name}-io", daemon=True)
        self._thread.start()

    # ---- submitting (any thread) ---------------------------------------------------------------
    @property
    def pending_count(self) -> int:
        return self._pending

    @property
    def rows_in_flight(self) -> list[int]:
        """Per engine core: rows this client has sent it and not had answered yet."""
        return list(self._load)

    def submit(self, node_ids: Any, exact: bool = False, seed: int | None = None,
               deadline_s: float | None = None, request_id: str | None = None,
               min_version: int = 0, inductive: InductiveNodes | None = None,
               model: str = "", version: int = 0, node_type: str = "") -> Future[EmbedResult]:
        """Admit one request (ids already validated by the caller, or checked by the engine).
        ``min_version``: the graph version it must see; ``inductive``: nodes embedded as if
        added (their rows follow the ids' rows); ``model`` ("": the default) and ``version``
        (0: the model's traffic split picks); ``node_type``: the type of the ids (typed
        graphs; "": the only type)."""
        fut: Future[EmbedResult] = Future()
        self._admit(node_ids, exact, seed, deadline_s, request_id, fut, None, min_version,
                    inductive, model, version).node_type = node_type
        return fut

    def call(self, node_ids: Any, exact: bool = False, seed: int | None = None,
             deadline_s: float | None = None, request_id: str | None = None,
             min_version: int = 0, inductive: InductiveNodes | None = None,
             model: str = "", version: int = 0, wait_s: float | None = None,
             node_type: str = "") -> EmbedResult:
        """``submit`` for a thread that blocks on the answer (``Pipeline.embed``): a
        :class:`Waiter` instead of a future. A thread that asked again within the gate's quiet
        time of its last answer is expected to do so again (``returns.py``). The client answers
        by the deadline; should it not (its IO thread gone), the request is forgotten after
        ``wait_s`` (default: 5 s past the deadline) and answered 504."""
        if self._home_loop is not None:
            raise RuntimeError("a LoopClient's thread must not block on it: use submit_async")
        caller = self._callers
        waiter = Waiter(time.monotonic() - getattr(caller, "answered_s", -1e9) < self._gate.quiet_s)
        req = self._admit(node_ids, exact, seed, deadline_s, request_id, waiter, None,
                          min_version, inductive, model, version, node_type=node_type)
        if wait_s is None:
            wait_s = req.deadline_s - time.time() + _WAIT_MARGIN_S
        result = waiter.wait(wait_s)
        caller.answered_s = time.monotonic()
        if result is None:
            self._resolve([(req, EmbedResult(req.request_id, error=errors.deadline().info))])
            result = waiter.wait(_WAIT_MARGIN_S)  # set now, or by the IO thread meanwhile
        if result is None:
            raise errors.deadline()
        return result

    def submit_async(self, node_ids: Any, exact: bool = False, seed: int | None = None,
                     deadline_s: float | None = None, request_id: str | None = None,
                     min_version: int = 0, inductive: InductiveNodes | None = None,
                     model: str = "", version: int = 0,
                     numpy_rows: bool = False,
                     node_type: str = "") -> asyncio.Future[EmbedResult]:
        """The same from a coroutine: the returned future resolves on the running loop.
        ``numpy_rows``: the answer's rows as ``EmbedResult.rows``, a read-only NumPy view of
        the engine's reply (no copy, no tensor; what a front-end writes out)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[EmbedResult] = loop.create_future()
        self._admit(node_ids, exact, seed, deadline_s, request_id, fut, loop, min_version,
                    inductive, model, version, numpy_rows, node_type)
        return fut

    def _admit(self, node_ids: Any, exact: bool, seed: int | None, deadline_s: float | None,
               request_id: str | None, fut: Any, loop: asyncio.AbstractEventLoop | None,
               min_version: int = 0, inductive: InductiveNodes | None = None,
               model: str = "", version: int = 0, numpy_rows: bool = False,
               node_type: str = "") -> Admitted:
        if self._stopping.is_set():
            raise errors.unavailable("shutting_down", "the server is shutting down")
        ids = np.ascontiguousarray(np.asarray(node_ids, dtype=np.int64).reshape(-1))
        ep = self.endpoints
        with self._lock:
            if self._pending >= ep.max_pending_requests:
                self.observer.on_rejected("pending_full")
                raise errors.overloaded("too many requests in flight; retry later", ep.overload_status)
            self._pending += 1
        if deadline_s is None:
            deadline_s = time.time() + ep.request_timeout_s
        rid = request_id if request_id is not None else f"c{next(self._ids)}"
        if rid in self._by_id:
            with self._lock:
                self._pending -= 1
            raise errors.ServeError("duplicate_request_id",
                                    f"request_id {rid!r} is already in flight", 409)
        req = Admitted(rid, ids, exact, seed, deadline_s, fut, loop, min_version, inductive,
                       model, version, numpy_rows)
        req.node_type = node_type
        with self._lock:
            self._pending_ids += req.rows
        self._by_id[rid] = req
        self._inbox.append(req)
        self._wake()
        return req

    def _wake(self) -> None:
        """New requests wait in the inbox: wake the IO thread if it sleeps in its poll (and
        is not waiting for more answered callers to come back: ``returns.py``)."""
        if self._sleeping and self._gate.wake_now(len(self._inbox)):
            self._sleeping = False
            os.write(self._wake_w, b"x")

    def cancel(self, request_id: str) -> bool:
        """Forget a request nobody waits for (it is not computed unless already sent)."""
        req = self._by_id.get(request_id)
        if req is None or req.done:
            return False
        self.observer.on_rejected("client_disconnected")
        self._resolve([(req, EmbedResult(req.request_id, error=ErrorInfo(
            "cancelled", "request cancelled", 499)))])
        return True

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the IO; requests still pending are answered 503."""
        self._stopping.set()
        self._stop_io(timeout_s)
        left = [r for f in self._flights.values() for r in f.requests] + list(self._inbox) \
            + self._held
        self._flights.clear()
        self._inbox.clear()
        err = errors.unavailable("shutting_down", "the server is shutting down").info
        self._resolve([(r, EmbedResult(r.request_id, error=err)) for r in left if not r.done])

    def _stop_io(self, timeout_s: float) -> None:
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=timeout_s)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    # ---- the IO thread ---------------------------------------------------------------------------
    def _open_sockets(self) -> None:
        """One DEALER per engine core, and a monitor that says when its connection drops."""
        ctx = zmq.Context.instance()
        for e in range(self.endpoints.num_engines):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            mon = disconnect_monitor(sock)
            sock.connect(self.endpoints.addrs.engine(e))
            self._socks.append(sock)
            self._monitors.append(mon)

    def _run(self) -> None:
        self._io_ident = threading.get_ident()
        self._open_sockets()
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        for sock, mon in zip(self._socks, self._monitors, strict=True):
            poller.register(sock, zmq.POLLIN)
            poller.register(mon, zmq.POLLIN)
        try:
            self._loop(poller)
        except Exception:  # noqa: BLE001 - logged; stop() answers what is left
            log.exception("client IO thread failed")
        finally:
            for s in self._socks + self._monitors:
                s.close(linger=0)

    def _loop(self, poller: zmq.Poller) -> None:
        last_gauge = 0.0
        while not self._stopping.is_set():
            self._sleeping = True
            events = dict(poller.poll(self._poll_ms()))
            self._sleeping = False
            if events.get(self._wake_r):
                _drain_pipe(self._wake_r)
            # requests that wait for answered callers to come back stay in the inbox
            if self._gate.release(len(self._inbox), time.monotonic()) or not self._inbox:
                self._send_new()
            self._deferred = []
            try:
                for e, sock in enumerate(self._socks):
                    if events.get(sock):
                        self._receive(e, sock)
                    if events.get(self._monitors[e]):
                        self._on_monitor(e)
            finally:
                self._set_deferred()
            self._sweep(time.time())
            now = time.monotonic()
            self._check_chains(now)
            if now - last_gauge > 0.5:
                last_gauge = now
                self.observer.on_pending(self._pending)

    def _poll_ms(self) -> int:
        """0 when requests are due to leave; else until the next deadline of a request not
        yet answered, a held request's due time, or the gate's next look (``returns.py``)."""
        now_s = time.monotonic()
        gate_s = self._gate.wait_s(now_s)
        if self._inbox and (gate_s is None or self._gate.wake_now(len(self._inbox))):
            return 0
        wait_s = _MAX_SLEEP_S
        deadlines = self._deadlines
        while deadlines and deadlines[0][2].done:  # answered: no deadline to wake for
            heapq.heappop(deadlines)
        if deadlines:
            wait_s = min(wait_s, deadlines[0][0] - time.time())
        if self._held:
            wait_s = min(wait_s, self._held[0].arrived_s + self.endpoints.hold_s - now_s)
        wait_ms = max(0, int(wait_s * 1000) + 1)
        return wait_ms if gate_s is None else min(wait_ms, math.ceil(gate_s * 1000))

    def _receive(self, engine: int, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                done = Decoders.done.decode(frames[0].buffer)
            except Exception as exc:  # noqa: BLE001 - cannot tell whose: logged loudly
                log.error("engine %d sent an unreadable reply (%s); its requests time out", engine, exc)
                continue
            self._on_done(done, frames)

    def _on_done(self, done: MicroBatchDone, frames: list[Any]) -> None:
        flight = self._flights.pop(done.seq, None)
        if done.stats is not None:
            self.observer.on_batch(done.stats)
            if flight is not None and done.stats.replied_s:
                self.observer.on_transport(flight.sent_wall_s, done.stats.received_s,
                                           done.stats.replied_s, time.time())
        if flight is None:
            self.observer.on_late_result()  # answered already (a retried copy came back first)
            return
        now_s = time.time()
        self.observer.on_round_trip(flight.sent_wall_s, now_s)
        first = flight.requests[0]
        failed_n = len(done.errors) if done.dim else len(flight.requests)
        self.observer.on_model_answers(
            done.model or first.model or "default", str(done.version or first.version or ""),
            len(flight.requests) - failed_n, failed_n, now_s - flight.sent_wall_s)
        self._load[flight.engine] -= flight.num_rows
        self.answered[flight.engine] += 1
        self._others[flight.engine] = (max(done.engine_ids - self._load[flight.engine], 0),
                                       time.monotonic())
        self._resolve(flight.answers(done, frames))

    def _on_monitor(self, engine: int) -> None:
        while True:
            try:
                event = recv_monitor_message(self._monitors[engine], zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._recover(engine)

    def _recover(self, engine: int) -> None:
        """The engine core went away: send its micro-batches again once, else answer 503."""
        lost = [(seq, f) for seq, f in self._flights.items() if f.engine == engine]
        if not lost:
            return
        log.warning("engine %d went away holding %d micro-batch(es); resending", engine, len(lost))
        self.observer.on_rejected("engine_lost")
        failed = []
        for seq, flight in lost:
            self._load[engine] -= flight.num_rows
            if flight.attempts > _RETRIES:
                del self._flights[seq]
                failed += flight.requests
                continue
            flight.attempts += 1
            target = self._pick(self._estimated_load())
            flight.engine = target
            self._load[target] += flight.num_rows
            self._socks[target].send_multipart(flight.frames, copy=False)
        err = ErrorInfo("worker_died", "the engine core died twice while serving it", 503)
        self._resolve([(r, EmbedResult(r.request_id, error=err)) for r in failed])

    def _sweep(self, now_s: float) -> None:
        expired = []
        while self._deadlines and self._deadlines[0][0] <= now_s:
            req = heapq.heappop(self._deadlines)[2]
            if not req.done:
                expired.append(req)
        if expired:
            err = errors.deadline().info
            for _ in expired:
                self.observer.on_rejected("deadline")
            self._resolve([(r, EmbedResult(r.request_id, error=err)) for r in expired])

    def _resolve(self, results: list[tuple[Admitted, EmbedResult]]) -> None:
        """Hand results to their futures: sync ones here (the IO thread, while it reads
        replies, sets them once every reply is read: one wave of woken callers, none of them
        taking the GIL from the reading), asyncio ones on their loop (batched)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Any, EmbedResult]]] = {}
        mine = []
        with self._lock:  # cancel() resolves from other threads
            for req, result in results:
                if not req.done:
                    req.done = True
                    mine.append((req, result))
                    self._pending_ids -= req.rows
            self._pending -= len(mine)
        deferred = self._deferred if threading.get_ident() == self._io_ident else None
        for req, result in mine:
            self._by_id.pop(req.request_id, None)
            if req.loop is None:
                if deferred is not None:
                    deferred.append((req.future, result))
                elif not req.future.done():
                    req.future.set_result(result)
            else:
                by_loop.setdefault(req.loop, []).append((req.future, result))
        for loop, items in by_loop.items():
            if loop is self._home_loop and self._on_home_thread():
                _set_all(items)  # this loop drives the client: no hand-off
                continue
            try:
                loop.call_soon_threadsafe(_set_all, items)
            except RuntimeError:  # that loop is closed: nobody waits
                pass

    def _set_deferred(self) -> None:
        """The IO thread has read every reply: wake their callers (blocked ones in turn)."""
        deferred, self._deferred = self._deferred, None
        waiters, results = [], []
        for fut, result in deferred or ():
            if type(fut) is Waiter:
                waiters.append(fut)
                results.append(result)
            elif not fut.done():
                fut.set_result(result)
        if waiters:
            now_s = time.monotonic()
            # before any of them can submit again
            self._gate.answered(sum(w.returns for w in waiters), now_s)
            self._chains.append((now_s, waiters))
            wake_in_turn(waiters, results)

    def _check_chains(self, now_s: float) -> None:
        """Wake directly the waiters of a chain started ``_CHAIN_CHECK_S`` ago that are still
        asleep (a caller that left its wait on an exception wakes nobody)."""
        while self._chains and now_s - self._chains[0][0] > _CHAIN_CHECK_S:
            for waiter in self._chains.popleft()[1]:
                if not waiter.woken:
                    waiter.wake()

    def _on_home_thread(self) -> bool:
        return False


def _set_all(items: list[tuple[asyncio.Future[EmbedResult], EmbedResult]]) -> None:
    for fut, result in items:
        if not fut.done():
            fut.set_result(result)


def _drain_pipe(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass

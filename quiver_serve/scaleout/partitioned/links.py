"""How one partition server's call reaches another: a Ray actor call, or the project's wire.

* ``RayLink``: ``handle.<method>.remote(ids, ...)``; NumPy arrays travel through Ray's object
  store (pickled headers, the arrays out of band).
* ``WireLink``: ZeroMQ as between the daemon's processes (decision 0001): each partition server
  binds a ROUTER socket on its node (``WireService``), a caller keeps one DEALER socket per peer
  and matches answers to calls by a call number; frame 0 is a msgpack header, the arrays are raw
  little-endian frames sent without copies and viewed with ``np.frombuffer`` (nothing is
  unpickled). Ray still finds the peer: its address is asked of the actor once and asked again
  after a failure (a restarted server binds a new port).

Which one serves is ``partitioned.transport`` (decision 0045 has the numbers).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from quiver_serve.wire import disconnect_monitor

#: (method, args) the wire carries: sample_hop(ids, k, hop, base), rows(ids),
#: table_rows(ids, layer) and table_mark(ids, layer, every, lists) between partition servers;
#: embed(ids, exact, seed, timeout_s) from the ingress
METHODS = ("sample_hop", "rows", "table_rows", "table_mark", "embed")
#: the calls of peers: local work that never waits on another server, so they alone take the
#: answering slots (an embed waits on peers; it is bounded by the server's own admission)
PEER_METHODS = ("sample_hop", "rows", "table_rows")


#: contexts of services and links not closed yet: held here so that one is never destroyed by
#: the garbage collector (pyzmq's ``Context.__del__`` terminates it, which can block for ever
#: in the thread that happens to collect it, the event loop's)
_OPEN_CONTEXTS: set[Any] = set()


def own_context() -> Any:
    """A ZeroMQ asyncio context of one service or link, not the process-wide instance: in a
    test process that had run other links and Ray, sockets of the shared instance stopped
    reaching a live peer that a fresh context reached (a hang seen in CI; cause not found).
    Released by the owner's ``close`` (``release_context``)."""
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    _OPEN_CONTEXTS.add(ctx)
    return ctx


def release_context(ctx: Any) -> None:
    """Close every socket of ``ctx`` and terminate it."""
    _OPEN_CONTEXTS.discard(ctx)
    ctx.destroy(linger=0)


class LinkError(ConnectionError):
    """The peer did not answer: gone, restarting, or unreachable."""


class RayLink:
    """Calls through Ray (``handle_of(part, replica)`` gives the actor handle)."""

    def __init__(self, handle_of: Callable[[int, int], Any]) -> None:
        self.handle_of = handle_of

    async def call(self, part: int, replica: int, method: str, ids: np.ndarray,
                   *args: int) -> Any:
        return await getattr(self.handle_of(part, replica), method).remote(ids, *args)

    def forget(self, part: int, replica: int) -> None:
        """Nothing cached beyond the handle (``handle_of``'s own cache is dropped by Peers)."""

    def close(self) -> None:
        """Nothing to release (Ray owns the connections)."""


class WireService:
    """A partition server's side of the wire: answers ``METHODS`` on a ROUTER socket. ``answer``
    may return an awaitable (work it runs beside the loop); each call is answered in its own
    task, the next call read meanwhile, up to ``MAX_ANSWERING`` peer calls at once."""

    #: peer calls answered at once; the next waits for one of them (the bound of this queue)
    MAX_ANSWERING = 64

    def __init__(self, answer: Callable[[str, np.ndarray, list[Any]], Any]) -> None:
        self.answer = answer
        self.address: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._slots = asyncio.Semaphore(self.MAX_ANSWERING)
        self._ctx: Any = None

    def start(self, host: str) -> str:
        """Bind on ``host`` (a free port) and serve from the running loop; the address."""
        if self.address is None:
            import zmq

            self._ctx = own_context()
            sock = self._ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            port = sock.bind_to_random_port(f"tcp://{host}")
            self.address = f"tcp://{host}:{port}"
            self._task = asyncio.ensure_future(self._serve(sock))
        return self.address

    def close(self) -> None:
        """Stop answering and release the socket and its context."""
        if self._task is not None and not self._task.get_loop().is_closed():
            self._task.cancel()
        if self._ctx is not None:
            release_context(self._ctx)
        self._task = self._ctx = None

    async def _serve(self, sock: Any) -> None:
        while True:
            ident, head, *frames = await sock.recv_multipart(copy=False)
            call_id, method, args = msgspec.msgpack.decode(head.bytes)
            slot = method in PEER_METHODS
            if slot:
                await self._slots.acquire()
            asyncio.ensure_future(self._reply(sock, ident, (call_id, method, args), frames, slot))

    async def _reply(self, sock: Any, ident: Any, head: tuple[int, str, list[Any]],
                     frames: list[Any], slot: bool) -> None:
        try:
            call_id, method, args = head
            ids = np.frombuffer(frames[0].buffer, dtype=np.int64)
            try:
                out = self.answer(method, ids, args) if method in METHODS else \
                    {"code": "unknown_method", "message": method, "status": 400}
                if inspect.isawaitable(out):
                    out = await out
            except Exception as exc:  # noqa: BLE001 - the caller hears it, the loop goes on
                out = {"code": "internal", "message": type(exc).__name__, "status": 500}
            if isinstance(out, dict):
                await sock.send_multipart([ident, msgspec.msgpack.encode([call_id, out, []])])
                return
            arrays = [np.ascontiguousarray(a) for a in (out if isinstance(out, tuple) else (out,))]
            shapes = [[a.dtype.str, list(a.shape)] for a in arrays]
            await sock.send_multipart([ident, msgspec.msgpack.encode([call_id, None, shapes]),
                                       *arrays], copy=False)
        finally:
            if slot:
                self._slots.release()


class WireLink:
    """Calls over the wire; ``address_of(part, replica)`` asks the peer's address (awaitable)."""

    def __init__(self, address_of: Callable[[int, int], Any]) -> None:
        self.address_of = address_of
        self._peers: dict[tuple[int, int], _Dealer] = {}
        self._ctx: Any = None

    async def call(self, part: int, replica: int, method: str, ids: np.ndarray,
                   *args: Any) -> Any:
        key = (part, replica)
        peer = self._peers.get(key)
        if peer is not None and peer.dropped:  # the peer went away: ask where it is now
            self.forget(part, replica)
            peer = None
        if peer is None:
            address = await self.address_of(part, replica)
            if self._ctx is None:
                self._ctx = own_context()
            peer = _Dealer(self._ctx, address)
            self._peers[key] = peer
        return await peer.call(method, np.ascontiguousarray(ids, np.int64), list(args))

    def forget(self, part: int, replica: int) -> None:
        """Drop the socket of a peer that failed: its address is asked again next time."""
        peer = self._peers.pop((part, replica), None)
        if peer is not None:
            peer.close()

    def close(self) -> None:
        """Drop every peer's socket and the link's context (calls waiting hear LinkError)."""
        for key in list(self._peers):
            self.forget(*key)
        if self._ctx is not None:
            release_context(self._ctx)
            self._ctx = None

    def moved(self, part: int, replica: int, address: str | None) -> bool:
        """Forget the peer's socket when its address is no longer ``address`` (a restarted
        server binds a new port; None: it has none now), keeping the calls on a socket that
        still reaches it; whether it was forgotten."""
        peer = self._peers.get((part, replica))
        if peer is None or peer.address == address:
            return False
        self.forget(part, replica)
        return True


class _Dealer:
    """One DEALER socket to one peer, calls matched to answers by number."""

    def __init__(self, ctx: Any, address: str) -> None:
        import zmq

        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.address = address
        #: the connection dropped (the peer died or restarted): the link asks its address again
        self.dropped = False
        self.waiting: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count()
        self._reader = asyncio.ensure_future(self._read())
        self._watcher = asyncio.ensure_future(
            self._watch(disconnect_monitor(self.sock)))

    async def call(self, method: str, ids: np.ndarray, args: list[Any]) -> Any:
        call_id = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.waiting[call_id] = fut
        try:
            await self.sock.send_multipart([msgspec.msgpack.encode([call_id, method, args]),
                                            ids], copy=False)
            return await fut
        finally:
            self.waiting.pop(call_id, None)

    async def _read(self) -> None:
        try:
            while True:
                head, *frames = await self.sock.recv_multipart(copy=False)
                call_id, error, shapes = msgspec.msgpack.decode(head.bytes)
                fut = self.waiting.get(call_id)
                if fut is None or fut.done():
                    continue
                if error is not None:
                    fut.set_result(error)
                    continue
                arrays = [np.frombuffer(f.buffer, dtype=np.dtype(dt)).reshape(shape)
                          for f, (dt, shape) in zip(frames, shapes, strict=True)]
                fut.set_result(arrays[0] if len(arrays) == 1 else tuple(arrays))
        except Exception as exc:  # noqa: BLE001 - the socket closed: every waiter hears it
            for fut in self.waiting.values():
                if not fut.done():
                    fut.set_exception(LinkError(str(exc)))

    async def _watch(self, monitor: Any) -> None:
        """Every waiting call hears LinkError as soon as the connection drops (a killed peer's
        socket is closed by its kernel), not only at its timeout."""
        try:
            while True:
                await monitor.recv_multipart()
                self.dropped = True
                self._fail("the connection to the peer dropped")
        except Exception:  # noqa: BLE001 - closed with the socket
            return
        finally:
            monitor.close(0)

    def _fail(self, reason: str) -> None:
        for fut in self.waiting.values():
            if not fut.done():
                fut.set_exception(LinkError(reason))

    def close(self) -> None:
        if not self._reader.get_loop().is_closed():  # else its tasks and waiters are gone
            self._reader.cancel()
            self._watcher.cancel()
            self._fail("the peer's socket was closed")
        self.sock.close(0)

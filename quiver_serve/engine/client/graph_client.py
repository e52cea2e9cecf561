"""The graph API the HTTP routes use (``pipeline.graph_ops``), in-process or from a front-end.

Both implementations have the same coroutines: ``add_edges(add, remove)``,
``add_nodes(features)``, ``put_features(node_ids, features)``, ``info()`` and ``compact()``,
each returning the writer's answer as a dict or raising ``errors.ServeError`` with the writer's
status (a 503 from a full overlay carries ``retry_after_s``). Arrays are NumPy (the routes
convert bodies once); the writer validates their contents.

* :class:`LocalGraph`: the process that holds the writer (``Pipeline``). A call runs on the
  bounded worker pool of ``engine/procs/graph_service.WriterCalls``, so an update's sync never
  blocks the event loop.
* :class:`RemoteGraph`: a front-end process (``RemotePipeline``). One :class:`GraphClient` per
  event loop (a ZeroMQ asyncio DEALER to the main process's ``GraphService``): futures by call
  id, a timeout on every wait (504; the update may still land: ``GET /v1/graph`` shows the
  version), at most ``MAX_IN_FLIGHT`` calls at once (503), and a fresh socket after a socket
  error (ZeroMQ itself reconnects an IPC peer that comes back).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from quiver_serve import errors
from quiver_serve.engine.procs.graph_service import WriterCalls, typed_params
from quiver_serve.wire import Decoders, GraphCall, GraphReply, encode, graph_frames

log = logging.getLogger(__name__)

#: a graph call waits at least this long (an update waits for its sync; a compaction may start)
MIN_GRAPH_TIMEOUT_S = 10.0
#: calls one front-end event loop has in flight at once (more: 503)
MAX_IN_FLIGHT = 64


def graph_timeout_s(request_timeout_s: float) -> float:
    """How long a graph call waits: the request deadline, but never less than the minimum."""
    return max(request_timeout_s, MIN_GRAPH_TIMEOUT_S)


def model_timeout_s(cfg: Any) -> float:
    """How long a model call waits: a load in every engine core, then the old versions' drain."""
    return float(cfg.models.load_timeout_s + cfg.models.unload_drain_s + MIN_GRAPH_TIMEOUT_S)


def timed_out(op: str, timeout_s: float) -> errors.ServeError:
    return errors.ServeError(
        "graph_timeout", f"graph {op}: the graph writer did not answer within {timeout_s:.1f} s; "
        "the update may still be applied (GET /v1/graph shows the version)", 504)


class _GraphOps:
    """The five coroutines, over ``_call(op, arrays)``."""

    async def add_edges(self, add: Any, remove: Any, edge_type: Any = None) -> dict[str, Any]:
        return await self._call("add_edges", [add, remove], typed_params(edge_type=edge_type))

    async def add_nodes(self, features: Any, node_type: Any = None) -> dict[str, Any]:
        return await self._call("add_nodes", [features], typed_params(node_type=node_type))

    async def put_features(self, node_ids: Any, features: Any,
                           node_type: Any = None) -> dict[str, Any]:
        return await self._call("put_features", [node_ids, features],
                                typed_params(node_type=node_type))

    async def info(self) -> dict[str, Any]:
        return await self._call("info", [])

    async def compact(self) -> dict[str, Any]:
        return await self._call("compact", [])

    async def _call(self, op: str, arrays: list[Any],
                    params: dict[str, Any] | None = None) -> dict[str, Any]:
        raise NotImplementedError


class ModelOps:
    """The model repository's calls (``pipeline.model_ops``): ``await call(op, params)`` with
    op ``index`` / ``load`` / ``unload`` (``engine/procs/model_manager.py``), over the same
    channel as the graph calls."""

    def __init__(self, channel: _GraphOps) -> None:
        self.channel = channel

    async def call(self, op: str, params: dict[str, Any]) -> dict[str, Any]:
        return await self.channel._call(f"model_{op}", [], params)


class LocalGraph(_GraphOps):
    """The writer of this process; ``calls()`` returns its :class:`WriterCalls` or raises
    (503 while starting, 501 when the daemon has no writer)."""

    def __init__(self, calls: Callable[[], WriterCalls], timeout_s: float) -> None:
        self.calls, self.timeout_s = calls, timeout_s

    async def _call(self, op: str, arrays: list[Any],
                    params: dict[str, Any] | None = None) -> dict[str, Any]:
        calls = self.calls()
        if op == "info":  # counters only: never queued behind an update's sync
            return calls.run("info", [])
        future = calls.submit(op, arrays, time.time() + self.timeout_s, params)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except TimeoutError:
            raise timed_out(op, self.timeout_s) from None


class GraphClient:
    """One event loop's calls to the main process's ``GraphService``; see the module docstring."""

    def __init__(self, address: str, timeout_s: float, max_in_flight: int = MAX_IN_FLIGHT) -> None:
        self.address, self.timeout_s, self.max_in_flight = address, timeout_s, max_in_flight
        self._ctx = zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._waiting: dict[int, asyncio.Future[GraphReply]] = {}
        self._ids = itertools.count()

    async def call(self, op: str, arrays: list[Any],
                   params: dict[str, Any] | None = None) -> dict[str, Any]:
        """The writer's answer to one call, or a ServeError (the writer's, 503, or 504)."""
        if len(self._waiting) >= self.max_in_flight:
            raise errors.overloaded(f"{len(self._waiting)} graph calls are in flight; retry later")
        try:
            shapes, frames = graph_frames(op, arrays)
        except (TypeError, ValueError, OverflowError) as exc:
            raise errors.ServeError("invalid_request", f"graph {op}: {exc}", 422) from None
        call_id = next(self._ids)
        waiter: asyncio.Future[GraphReply] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = waiter
        head = GraphCall(call_id, op, shapes, time.time() + self.timeout_s, params or {})
        try:
            await self._socket().send_multipart([encode(head), *frames], zmq.NOBLOCK, copy=False)
            reply = await asyncio.wait_for(waiter, self.timeout_s)
        except zmq.Again:
            raise errors.overloaded("the graph writer's queue is full; retry later") from None
        except zmq.ZMQError as exc:
            self._waiting.pop(call_id, None)  # answered here, not by the reset
            self._reset(f"send failed: {exc}")
            raise errors.unavailable("graph_unreachable", "the graph writer cannot be reached; "
                                     "retry later") from None
        except TimeoutError:
            raise timed_out(op, self.timeout_s) from None
        finally:
            self._waiting.pop(call_id, None)
        return answer(reply)

    def _socket(self) -> zmq.asyncio.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self.max_in_flight * 2)
            sock.connect(self.address)
            self._sock = sock
            self._reader = asyncio.get_running_loop().create_task(self._read(sock))
        return self._sock

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        try:
            while True:
                frames = await sock.recv_multipart()
                try:
                    reply = Decoders.graph_reply.decode(frames[0])
                except Exception as exc:  # noqa: BLE001 - cannot tell whose: that call times out
                    log.error("graph client: unreadable reply dropped: %s", exc)
                    continue
                waiter = self._waiting.get(reply.call_id)
                if waiter is not None and not waiter.done():
                    waiter.set_result(reply)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the socket broke: a fresh one next call
            if sock is self._sock:
                self._reset(f"receive failed: {exc}")

    def _reset(self, why: str) -> None:
        """Drop the socket (the next call makes a new one); the calls waiting on it get 503."""
        log.warning("graph client: %s; reconnecting on the next call", why)
        sock, self._sock = self._sock, None
        if self._reader is not None and self._reader is not asyncio.current_task():
            self._reader.cancel()
        self._reader = None
        if sock is not None:
            sock.close(linger=0)
        for waiter in self._waiting.values():
            if not waiter.done():
                waiter.set_exception(errors.unavailable(
                    "graph_unreachable", "the connection to the graph writer broke; retry"))

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._sock is not None:
            self._sock.close(linger=0)
        self._sock = self._reader = None


def answer(reply: GraphReply) -> dict[str, Any]:
    """The result of a reply, or its error raised as the writer raised it."""
    if reply.error is not None:
        e = reply.error
        exc = errors.ServeError(e.code, e.message, e.status)
        if e.retry_after_s is not None:
            exc.retry_after_s = e.retry_after_s  # type: ignore[attr-defined]
        raise exc
    return reply.result or {}


class RemoteGraph(_GraphOps):
    """The graph API of a front-end process: one :class:`GraphClient` per event loop.

    ``check()`` raises while calls cannot be made (503 starting, 501 no writer); ``on_result``
    sees every answer (the pipeline follows the node count of its own node additions)."""

    def __init__(self, address: str, timeout_s: float, check: Callable[[], None],
                 on_result: Callable[[str, dict[str, Any]], None]) -> None:
        self.address, self.timeout_s = address, timeout_s
        self.check, self.on_result = check, on_result
        self._clients: dict[asyncio.AbstractEventLoop, GraphClient] = {}

    async def _call(self, op: str, arrays: list[Any],
                    params: dict[str, Any] | None = None) -> dict[str, Any]:
        self.check()
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            for old in [lp for lp in self._clients if lp.is_closed()]:
                self._clients.pop(old)  # its sockets went with its loop's tasks
            client = self._clients[loop] = GraphClient(self.address, self.timeout_s)
        result = await client.call(op, arrays, params)
        self.on_result(op, result)
        return result

    def close(self) -> None:
        for client in self._clients.values():
            try:
                client.close()
            except Exception:  # noqa: BLE001 - stopping: nothing to save
                pass
        self._clients.clear()


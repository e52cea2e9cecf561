"""The graph writer's calls, by name, bounded; and the main process's service of them.

The writer (``graph/writer.py``) lives in the main process beside the supervisor. Two callers:

* :class:`WriterCalls`: the operations by name (``wire.GRAPH_OPS``), each run on a small pool of
  worker threads (an update waits for its sync, which must not block an event loop or the
  socket thread; with ``graph.fsync: group`` concurrent calls share a sync), at most
  ``max_queued`` admitted at once (more: 503 at once, never an unbounded queue), a call whose
  caller's deadline passed before it started answered 504 without touching the writer. The
  in-process ``Pipeline`` uses it directly.
* :class:`GraphService`: one ROUTER socket at ``FrontDoorAddresses.graph`` that the front-end
  processes' ``GraphClient``\\ s call (``wire.GraphCall`` + raw array frames), answered with
  ``wire.GraphReply``; one thread owns the socket, worker threads hand their answers back through
  an outbox and a wake pipe.

Errors keep the writer's wording and status; an unexpected exception is a 500 naming an error id
(the traceback goes to the log, not to the client).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import zmq

from quiver_serve import errors
from quiver_serve.engine.procs.control import bind_fresh
from quiver_serve.graph.typed import HOMOGENEOUS_NODE_TYPE, HOMOGENEOUS_RELATION
from quiver_serve.graph.typed_writer import TypedGraphWriter
from quiver_serve.wire import (
    Decoders,
    GraphError,
    GraphReply,
    encode,
    graph_arrays,
)

log = logging.getLogger(__name__)

#: calls admitted at once (running or waiting for a worker); more are refused 503
MAX_QUEUED_CALLS = 64
#: worker threads: enough for group commit to share a sync, few enough to stay out of the way
WORKER_THREADS = 4
_POLL_MS = 100


def retry_after_of(exc: errors.ServeError) -> float | None:
    """The writer's ``Retry-After`` hint on a refusal (set on 503 ``overlay_full``)."""
    value = getattr(exc, "retry_after_s", None)
    return None if value is None else float(value)


def plain(value: Any) -> Any:
    """``value`` with NumPy scalars and arrays as Python numbers and lists (msgpack and JSON
    encode those; the writer's counts may be NumPy integers)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def typed_params(edge_type: Any = None, node_type: Any = None) -> dict[str, Any]:
    """An update call's type parameters (``GraphCall.params``): those given."""
    params: dict[str, Any] = {}
    if edge_type is not None:
        params["edge_type"] = [str(t) for t in edge_type] \
            if isinstance(edge_type, list | tuple) else str(edge_type)
    if node_type is not None:
        params["node_type"] = str(node_type)
    return params


ONE_RELATION = [HOMOGENEOUS_NODE_TYPE, HOMOGENEOUS_RELATION, HOMOGENEOUS_NODE_TYPE]


def type_args(writer: Any, op: str, params: dict[str, Any]) -> dict[str, Any]:
    """The writer's type arguments of an update call: a typed writer takes ``edge_type`` /
    ``node_type``; an untyped graph takes none or its one type (``node``, ``node-to-node``),
    another is a 400 naming what it has."""
    key = "edge_type" if op == "add_edges" else "node_type"
    value = params.get(key)
    if isinstance(writer, TypedGraphWriter):
        return {key: value}
    one = ONE_RELATION if key == "edge_type" else HOMOGENEOUS_NODE_TYPE
    if value not in (None, "", one, "__".join(ONE_RELATION)):
        shown = [str(v)[:64] for v in value[:3]] if isinstance(value, list) else str(value)[:128]
        raise errors.ServeError(f"invalid_{key}", f"unknown {key} {shown!r}: this "
                                f"daemon serves an untyped graph (its one {key.replace('_', ' ')} "
                                f"is {one}); leave {key} out", 400)
    return {}


def unavailable(reason: str | None = None) -> errors.ServeError:
    """Graph updates are off in this daemon (no writer; ``reason`` says why)."""
    return errors.ServeError("graph_updates_unavailable",
                             reason or "this daemon has no graph writer (graph updates are off)",
                             501)


class UpdateLog:
    """Admin calls that changed the graph, logged as one summary line per ``every_s`` (an
    update stream makes hundreds of calls a second); a compaction is logged on its own."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self._lock = threading.Lock()
        self._since_s = time.monotonic()
        self._counts: dict[str, int] = {}
        self._version = 0

    def record(self, op: str, result: dict[str, Any]) -> None:
        if op == "compact":
            log.info("admin: graph compaction requested at version %s", result.get("version"))
            return
        changed = {"add_edges": ("added", "removed", "missing"), "add_nodes": ("node_ids",),
                   "put_features": ()}.get(op)
        if changed is None:
            return
        with self._lock:
            self._counts[op + " calls"] = self._counts.get(op + " calls", 0) + 1
            for key in changed:
                value = result.get(key, 0)
                n = len(value) if isinstance(value, list) else int(value or 0)
                self._counts[key] = self._counts.get(key, 0) + n
            self._version = max(self._version, int(result.get("version") or 0))
            now = time.monotonic()
            if now - self._since_s < self.every_s:
                return
            counts, self._counts = self._counts, {}
            span_s, self._since_s = now - self._since_s, now
        log.info("admin: graph updates in the last %.0f s: %s; acknowledged version %d", span_s,
                 ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), self._version)


class WriterCalls:
    """The writer's operations by name, bounded; see the module docstring."""

    def __init__(self, writer: Any, num_engines: int, max_queued: int = MAX_QUEUED_CALLS,
                 workers: int = WORKER_THREADS, models: Any = None,
                 read_only_reason: str | None = None) -> None:
        self.writer, self.num_engines, self.max_queued = writer, num_engines, max_queued
        #: the model repository's calls (``model_manager.ModelManager``); None: none
        self.models, self.read_only_reason = models, read_only_reason
        self.update_log = UpdateLog()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="quiver-graph")
        self._lock = threading.Lock()
        self.queued = 0

    def run(self, op: str, arrays: list[Any], deadline_s: float = 0.0,
            params: dict[str, Any] | None = None) -> dict[str, Any]:
        """One call, in this thread: the writer's (or the model manager's) answer, or a
        ServeError."""
        if deadline_s and time.time() > deadline_s:
            raise errors.ServeError("deadline_exceeded", f"{op}: the caller stopped "
                                    "waiting before it started; nothing was changed", 504)
        writer = self.writer
        params = params or {}
        try:
            if op.startswith("model_"):
                if self.models is None:
                    raise errors.ServeError("model_repository_unavailable",
                                            "this daemon has no model manager", 400)
                result = self.models.call(op, params)
            elif writer is None:
                raise unavailable(self.read_only_reason)
            elif op == "add_edges":
                result = writer.add_edges(arrays[0], arrays[1], **type_args(writer, op, params))
            elif op == "add_nodes":
                result = writer.add_nodes(arrays[0], **type_args(writer, op, params))
            elif op == "put_features":
                result = writer.put_features(arrays[0], arrays[1],
                                             **type_args(writer, op, params))
            elif op == "info":
                result = writer.info(self.num_engines)
            elif op == "compact":
                result = _compact(writer)
            else:
                raise errors.ServeError("invalid_request", f"unknown graph op {op!r}", 400)
        except errors.ServeError:
            raise
        except Exception as exc:  # noqa: BLE001 - a 500 with an error id; the traceback is logged
            raise errors.internal_error(exc, f"graph {op}", log) from None
        result = plain(result)
        self.update_log.record(op, result)
        return result  # type: ignore[no-any-return]

    def submit(self, op: str, arrays: list[Any], deadline_s: float = 0.0,
               params: dict[str, Any] | None = None) -> Future[dict[str, Any]]:
        """``run`` on a worker thread; 503 at once when ``max_queued`` calls are admitted."""
        with self._lock:
            if self.queued >= self.max_queued:
                raise errors.overloaded(f"{self.queued} graph calls are in progress; retry later")
            self.queued += 1
        try:
            future = self._pool.submit(self.run, op, arrays, deadline_s, params)
        except RuntimeError:  # the pool is shut down: the daemon is stopping
            self._release(None)
            raise errors.unavailable("shutting_down", "the server is shutting down") from None
        future.add_done_callback(self._release)
        return future

    def _release(self, _: Any) -> None:
        with self._lock:
            self.queued -= 1

    def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _compact(writer: Any) -> dict[str, Any]:
    """Ask for a compaction: the supervisor's compactor runs it within a second, in the
    background (a Reddit-scale fold takes longer than a call may wait); ``GET /v1/graph``'s
    ``last_compaction`` says when it is done."""
    writer.request_compaction(explicit=True)
    version = getattr(writer, "acked", getattr(writer, "version", 0))
    return {"version": int(version), "compacted": False, "requested": True}


def _error_of(exc: BaseException) -> GraphError:
    if isinstance(exc, errors.ServeError):
        info = exc.info
        return GraphError(info.code, info.message, info.status, retry_after_of(exc))
    err = errors.internal_error(exc, "graph call", log).info
    return GraphError(err.code, err.message, err.status)


class GraphService:
    """The writer's calls for the front-end processes; see the module docstring."""

    def __init__(self, writer: Any, address: str, num_engines: int,
                 max_queued: int = MAX_QUEUED_CALLS, models: Any = None,
                 read_only_reason: str | None = None) -> None:
        self.calls = WriterCalls(writer, num_engines, max_queued, models=models,
                                 read_only_reason=read_only_reason)
        self.address = address
        self._outbox: deque[tuple[bytes, GraphReply]] = deque()
        self._outbox_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._thread: threading.Thread | None = None

    def start(self) -> GraphService:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        bind_fresh(sock, self.address)
        self._thread = threading.Thread(target=self._serve, args=(sock,), name="quiver-graph-service",
                                        daemon=True)
        self._thread.start()
        return self

    def _serve(self, sock: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(_POLL_MS))
                if events.get(sock):
                    self._take_calls(sock)
                if events.get(self._wake_r):
                    os.read(self._wake_r, 4096)
                self._send_replies(sock)
        finally:
            sock.close(linger=0)

    def _take_calls(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident = frames[0].bytes
            try:
                call = Decoders.graph_call.decode(frames[1].buffer)
            except Exception as exc:  # noqa: BLE001 - no call id to answer: logged, dropped
                log.error("graph service: unreadable call dropped: %s", exc)
                continue
            try:
                arrays = graph_arrays(call, frames[2:])
                future = self.calls.submit(call.op, arrays, call.deadline_s, call.params)
            except ValueError as exc:
                self._reply(ident, GraphReply(call.call_id, error=GraphError(
                    "invalid_request", f"graph {call.op}: {exc}", 400)))
                continue
            except errors.ServeError as exc:
                self._reply(ident, GraphReply(call.call_id, error=_error_of(exc)))
                continue
            future.add_done_callback(lambda f, i=ident, c=call.call_id: self._done(i, c, f))

    def _done(self, ident: bytes, call_id: int, future: Future[dict[str, Any]]) -> None:
        try:
            reply = GraphReply(call_id, result=future.result())
        except BaseException as exc:  # noqa: BLE001 - every call is answered
            reply = GraphReply(call_id, error=_error_of(exc))
        self._reply(ident, reply)

    def _reply(self, ident: bytes, reply: GraphReply) -> None:
        with self._outbox_lock:
            self._outbox.append((ident, reply))
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):  # the pipe is full: the socket thread wakes anyway
            pass

    def _send_replies(self, sock: zmq.Socket) -> None:
        while True:
            with self._outbox_lock:
                if not self._outbox:
                    return
                ident, reply = self._outbox.popleft()
            try:
                sock.send_multipart([ident, encode(reply)], zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # the front-end went away: nobody to answer
                log.debug("graph reply to %s dropped: %s", ident.hex(), exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self.calls.stop()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._ctx.term()

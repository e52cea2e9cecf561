"""The hot routes answered inside the HTTP protocol: no ASGI cycle, no task, no middleware.

uvicorn's httptools protocol, extended (docs/decisions/0029-front-door-hot-path.md,
0037-one-answering-path.md). Every ``POST /v1/embed`` or
``POST /v2/models/{name}[/versions/{v}]/infer`` is handled by parser callbacks on the event loop:
``guards.authorize`` and the body limit when the headers are complete; the body collected, then
parsed and submitted to the loop's engine client with ``fastpath.py``'s functions once complete;
and a done-callback on the request's future writes the whole answer with one ``writelines`` (a
``.npy`` or KServe binary answer's rows as a view of the reply buffer). A request costs a few
callbacks and no coroutine.

This path answers every such request itself:

* ``Expect: 100-continue``: ``100 Continue`` once the request may be answered (authorized, its
  declared size within the limit, its turn come), then the final answer;
* a request pipelined behind one not answered yet waits in uvicorn's own queue of the connection
  (hot and ASGI requests alike) and is answered in order;
* a percent-encoded path is decoded first (as Starlette routes it); a root path does not change
  which route a path names;
* past uvicorn's concurrency limit (``limit_concurrency``): the daemon's overload refusal (503, or
  ``server.overload_status``, with ``Retry-After``), and the connection closed;
* a connection that goes away cancels its request (499 in the latency metric).

Every other request goes to uvicorn's own code and the ASGI app.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from quiver_serve import errors
from quiver_serve.frontend.fastpath import (
    HotTarget,
    Work,
    decode_path,
    failure_parts,
    hot_target,
    ok_parts,
    start,
)
from quiver_serve.frontend.guards import (
    Plane,
    Tokens,
    authorize,
    body_too_large,
    reject_parts,
)

log = logging.getLogger(__name__)

_POST = b"POST"
_CONNECTION_CLOSE = b"connection: close\r\n"
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_UNMATCHED = "unmatched"  # the metric's endpoint label of a request refused before its route

Refused = tuple[int, list[tuple[bytes, bytes]], bytes]


class _NoEvent:
    """uvicorn's ``connection_lost`` sets the current cycle's ``message_event``."""

    @staticmethod
    def set() -> None:
        return None


_NO_EVENT = _NoEvent()


class HotCycle:
    """One hot request on a connection, in the shape uvicorn's protocol code reads
    (``response_complete``, ``disconnected``, ``keep_alive``, ``message_event``)."""

    __slots__ = ("target", "parts", "size_bytes", "accept", "header_length", "keep_alive",
                 "expect_continue", "refused", "body_done", "turn", "response_complete",
                 "disconnected", "message_event", "t0_s", "work")

    def __init__(self, target: HotTarget, keep_alive: bool, expect_continue: bool) -> None:
        self.target = target
        self.parts: list[bytes] = []
        self.size_bytes = 0
        self.accept: str | None = None
        self.header_length: str | None = None
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue
        #: the refusal to answer when its turn comes (authorization, size, concurrency)
        self.refused: tuple[Refused, str] | None = None
        self.body_done = False  # the whole body has arrived
        self.turn = False  # every request before it on the connection is answered
        self.response_complete = False
        self.disconnected = False
        self.message_event = _NO_EVENT
        self.t0_s = time.perf_counter()
        self.work: Work | None = None


class HotHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, answering the hot routes itself (module docstring).
    ``state`` (the app's ``ServerState``) and ``tokens`` are set on the subclass
    :func:`hot_protocol` makes."""

    state: Any
    tokens = Tokens(None, None)
    max_body_bytes = 0
    #: this connection's hot request in its turn and not answered yet (None: none)
    hot: HotCycle | None = None

    # ---- parser callbacks ----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        """What the parser callbacks fill; the ASGI scope is built only for a request that
        goes to the app (``_to_app``)."""
        self.url = b""
        self.expect_100_continue = False
        self.headers = []

    def _to_app(self) -> None:
        """uvicorn's own handling, with the scope its ``on_message_begin`` would have built."""
        url, headers, expect = self.url, self.headers, self.expect_100_continue
        super().on_message_begin()
        self.url, self.headers, self.expect_100_continue = url, headers, expect
        self.scope["headers"] = headers
        super().on_headers_complete()

    def on_headers_complete(self) -> None:
        cycle = self._hot_cycle()
        if cycle is None:
            self._to_app()
            return
        cycle.refused = self._guard(cycle)
        previous, self.cycle = self.cycle, cycle  # type: ignore[assignment]
        if previous is None or previous.response_complete:
            self._take_turn(cycle)
        else:  # pipelined: it takes its turn from uvicorn's queue (``on_response_complete``)
            self.flow.pause_reading()
            self.pipeline.appendleft((cycle, None))  # type: ignore[arg-type]

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if not isinstance(cycle, HotCycle):
            super().on_body(body)
            return
        if cycle.response_complete or cycle.refused is not None:
            return
        cycle.parts.append(body)
        cycle.size_bytes += len(body)
        if cycle.size_bytes > self.max_body_bytes:  # a chunked body past the limit
            cycle.keep_alive = False
            cycle.parts = []
            cycle.refused = (body_too_large(cycle.target.path, self.max_body_bytes), _UNMATCHED)
            if cycle.turn:
                self._refuse(cycle)

    def on_message_complete(self) -> None:
        cycle = self.cycle
        if not isinstance(cycle, HotCycle):
            super().on_message_complete()
            return
        cycle.body_done = True
        if cycle.turn and not cycle.response_complete and cycle.refused is None:
            self._dispatch(cycle)

    def on_response_complete(self) -> None:
        """uvicorn's, but a hot request next in the connection's queue of pipelined requests
        takes its turn here (uvicorn would start an ASGI task for it)."""
        queue = self.pipeline
        if queue and isinstance(queue[-1][0], HotCycle) and not self.transport.is_closing():
            self.server_state.total_requests += 1
            self.flow.resume_reading()
            cycle, _ = queue.pop()
            self._take_turn(cycle)
            return
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        cycle = self.hot
        if cycle is not None and not cycle.response_complete and not cycle.disconnected:
            cycle.disconnected = True
            if cycle.work is not None:  # nobody listens: do not compute it
                self.state.pipeline.cancel(cycle.work.sub.request_id)
            self.state.observe_request(cycle.target.template, 499,
                                       time.perf_counter() - cycle.t0_s)
        super().connection_lost(exc)

    # ---- which requests are hot, and may they be served ----------------------------------------
    def _hot_cycle(self) -> HotCycle | None:
        """A cycle for a hot request, else None (the app's)."""
        parser = self.parser
        if parser.get_method() != _POST or parser.should_upgrade():
            return None
        try:
            target = hot_target(decode_path(httptools.parse_url(self.url).path))
        except (httptools.HttpParserInvalidURLError, UnicodeDecodeError):
            return None  # uvicorn's own code answers it
        if target is None:
            return None
        keep_alive = parser.get_http_version() != "1.0" and parser.should_keep_alive()
        return HotCycle(target, keep_alive, self.expect_100_continue)

    def _guard(self, cycle: HotCycle) -> tuple[Refused, str] | None:
        """The refusal of a request that may not be served, with its metric label; also reads
        the headers the route needs. In the guards' order: past the concurrency limit,
        :func:`authorize`, then a declared body size over the limit."""
        given, length = b"", None
        for key, value in self.headers:  # the last of a repeated header counts, as in Guards
            if key == b"authorization":
                given = value
            elif key == b"content-length":
                length = value
            elif key == b"accept" and cycle.accept is None:
                cycle.accept = value.decode("latin-1")
            elif key == b"inference-header-content-length" and cycle.header_length is None:
                cycle.header_length = value.decode("latin-1")
        path = cycle.target.path
        limit = self.limit_concurrency
        if limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit):
            cycle.keep_alive = False
            s = self.state.cfg.server
            exc = errors.overloaded("this front-end is at its connection limit; retry later",
                                    s.overload_status)
            status, headers, body, _ = failure_parts(self.state, exc, "", path)
            return (status, headers, body), cycle.target.template
        declared = int(length) if length is not None and length.isdigit() else None
        too_large = declared is not None and declared > self.max_body_bytes
        if too_large:  # its body is not read: the connection is closed after the refusal
            cycle.keep_alive = False
        refused = authorize(Plane.DATA, given, self.client, self.tokens)
        if refused is not None:
            return reject_parts(*refused, path, refused.headers), _UNMATCHED
        if too_large:
            return body_too_large(path, self.max_body_bytes, declared), _UNMATCHED
        return None

    # ---- serving -------------------------------------------------------------------------------
    def _take_turn(self, cycle: HotCycle) -> None:
        """Every request before ``cycle`` is answered: refuse it, or ask for its body (``100
        Continue``), or serve it once the body is complete."""
        cycle.turn = True
        self.hot = cycle
        if cycle.refused is not None:
            if cycle.expect_continue and not cycle.body_done:
                cycle.keep_alive = False  # the client may never send the body it announced
            self._refuse(cycle)
            return
        if cycle.expect_continue and not cycle.body_done:
            self.transport.write(_CONTINUE)
        self.flow.resume_reading()
        if cycle.body_done:
            self._dispatch(cycle)

    def _refuse(self, cycle: HotCycle) -> None:
        (status, headers, body), endpoint = cycle.refused  # type: ignore[misc]
        self._write(cycle, status, headers, [body], endpoint)

    def _dispatch(self, cycle: HotCycle) -> None:
        """Parse and submit; the answer is written by ``_on_result`` when the future is done."""
        body = cycle.parts[0] if len(cycle.parts) == 1 else b"".join(cycle.parts)
        cycle.parts = []
        try:
            cycle.work = start(self.state, cycle.target, body, cycle.header_length)
        except Exception as exc:  # noqa: BLE001 - answered as every route answers it
            self._fail(cycle, exc)
            return
        cycle.work.sub.future.add_done_callback(functools.partial(self._on_result, cycle))

    def _on_result(self, cycle: HotCycle, future: Any) -> None:
        if cycle.disconnected or cycle.response_complete:
            return
        try:
            headers, parts = ok_parts(cycle.work, future.result(), cycle.accept)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - answered as every route answers it
            self._fail(cycle, exc)
            return
        self._write(cycle, 200, headers, parts, cycle.target.template)

    def _fail(self, cycle: HotCycle, exc: Exception) -> None:
        path = cycle.target.path
        status, headers, body, close = failure_parts(self.state, exc, f"POST {path}", path)
        if close:
            cycle.keep_alive = False
        self._write(cycle, status, headers, [body], cycle.target.template)

    def _write(self, cycle: HotCycle, status: int, headers: list[tuple[bytes, bytes]],
               parts: list[Any], endpoint: str) -> None:
        """The whole response in one ``writelines``; then the cycle is complete, the metric
        observed, and uvicorn's keep-alive (or the next pipelined request) takes over."""
        cycle.response_complete = True
        if self.hot is cycle:
            self.hot = None
        if cycle.disconnected or self.transport.is_closing():
            return
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += (name, b": ", value, b"\r\n")
        for name, value in headers:
            head += (name, b": ", value, b"\r\n")
        if not cycle.keep_alive:
            head.append(_CONNECTION_CLOSE)
        head.append(b"\r\n")
        transport = self.transport
        transport.writelines([b"".join(head), *parts])
        self.state.observe_request(endpoint, status, time.perf_counter() - cycle.t0_s)
        if not cycle.keep_alive:
            transport.close()
        self.on_response_complete()


def hot_protocol(state: Any, tokens: Tokens, max_body_bytes: int) -> type[HotHttpProtocol]:
    """The protocol class for uvicorn's ``http`` option, bound to one app's state."""
    return type("BoundHotHttpProtocol", (HotHttpProtocol,), {
        "state": state, "tokens": tokens, "max_body_bytes": max_body_bytes})

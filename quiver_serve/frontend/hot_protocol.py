"""The hot routes answered inside the HTTP protocol: no ASGI cycle, no task, no middleware.

uvicorn's httptools protocol, extended (``server.fast_routes`` with httptools installed). A
``POST /v1/embed`` or ``POST /v2/models/{name}[/versions/{v}]/infer`` is handled by parser
callbacks on the event loop: the guards' checks run when the headers are complete, the body is
collected, parsed (``bodies.py``, ``kserve.py``) and submitted to the loop's engine client when it
is complete, and a done-callback on the request's future writes the whole answer with one
``writelines`` (status line and headers, then the rows: a ``.npy`` or KServe binary answer's
rows go out as a view of the reply buffer, not a copy). A request costs a few callbacks and no
coroutine; uvicorn's per-request task, ASGI messages, header validation and the disconnect
watcher are not on this path. A connection that goes away cancels its request.

Every other request, and a hot one that needs what only the ASGI path has (``Expect:
100-continue``, a request pipelined behind one not answered yet, a root path, a percent-encoded
path, uvicorn's concurrency limit), goes to uvicorn's own code and the ASGI app, whose raw-ASGI
layer (``fastpath.HotRoutes``) gives the same answers. Status codes, headers (uvicorn's ``date``
and ``server`` first, then the route's, in the same order) and bodies are those of the ASGI
path byte for byte, and the request-latency metric gets the same (endpoint, status) labels.
"""

from __future__ import annotations

import functools
import hmac
import logging
import time
from typing import Any

import httptools
import numpy as np
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from quiver_serve import errors
from quiver_serve.frontend import kserve
from quiver_serve.frontend.bodies import npy_header, parse_embed
from quiver_serve.frontend.fastpath import (
    EMBED_PATH,
    INFER_TEMPLATE,
    VERSIONED_INFER_TEMPLATE,
    Answer,
    Submitted,
    answer_of,
    infer_target,
    infer_version,
    submit_ids,
)
from quiver_serve.frontend.guards import OPEN_PATHS, reject_parts
from quiver_serve.frontend.responses import (
    JSON_MEDIA_TYPE,
    NPY_MEDIA_TYPE,
    embed_answer,
    wants_npy,
)

log = logging.getLogger(__name__)

_POST = b"POST"
_CONNECTION_CLOSE = b"connection: close\r\n"
_JSON = JSON_MEDIA_TYPE.encode("latin-1")
_NPY = NPY_MEDIA_TYPE.encode("latin-1")
_UNMATCHED = "unmatched"  # the metric's endpoint label of a request the guards refused
_MODEL_NAME, _MODEL_VERSION = b"x-model-name", b"x-model-version"


class _NoEvent:
    """uvicorn's ``connection_lost`` sets the current cycle's ``message_event``."""

    @staticmethod
    def set() -> None:
        return None


_NO_EVENT = _NoEvent()


class HotCycle:
    """One hot request on a connection, in the shape uvicorn's protocol code reads
    (``response_complete``, ``disconnected``, ``keep_alive``, ``message_event``)."""

    __slots__ = ("template", "path", "name", "version_raw", "parts", "size_bytes", "accept",
                 "header_length", "keep_alive", "response_complete", "disconnected",
                 "message_event", "t0_s", "sub", "infer")

    def __init__(self, template: str, path: str, name: str, version_raw: str | None,
                 keep_alive: bool) -> None:
        self.template, self.path = template, path
        self.name, self.version_raw = name, version_raw
        self.parts: list[bytes] = []
        self.size_bytes = 0
        self.accept: str | None = None
        self.header_length: str | None = None
        self.keep_alive = keep_alive
        self.response_complete = False
        self.disconnected = False
        self.message_event = _NO_EVENT
        self.t0_s = time.perf_counter()
        self.sub: Submitted | None = None
        self.infer: kserve.InferRequest | None = None


class HotHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, answering the hot routes itself (module docstring).
    ``state`` (the app's ``ServerState``) is set on the subclass ``hot_protocol`` makes."""

    state: Any
    #: this connection's hot request not yet answered (None: none)
    hot: HotCycle | None = None
    expected_auth: bytes | None = None
    max_body_bytes = 0
    #: hot requests this protocol class answered (tests check the ASGI app was not entered)
    answered = 0

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
        self.cycle = self.hot = cycle  # type: ignore[assignment]
        refused = self._guard(cycle)
        if refused is not None:
            status, headers, body = refused
            self._write(cycle, status, headers, [body], _UNMATCHED)

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if not isinstance(cycle, HotCycle):
            super().on_body(body)
            return
        if cycle.response_complete:
            return
        cycle.parts.append(body)
        cycle.size_bytes += len(body)
        if cycle.size_bytes > self.max_body_bytes:  # a chunked body past the limit
            cycle.keep_alive = False
            status, headers, out = reject_parts(
                413, "body_too_large", f"request body exceeds {self.max_body_bytes} bytes",
                cycle.path)
            self._write(cycle, status, headers, [out], _UNMATCHED)

    def on_message_complete(self) -> None:
        cycle = self.cycle
        if not isinstance(cycle, HotCycle):
            super().on_message_complete()
            return
        if not cycle.response_complete:
            self._dispatch(cycle)

    def connection_lost(self, exc: Exception | None) -> None:
        cycle = self.hot  # the current cycle, or one a pipelined request queued behind
        if cycle is not None and not cycle.response_complete and not cycle.disconnected:
            cycle.disconnected = True
            if cycle.sub is not None:  # nobody listens: do not compute it
                self.state.pipeline.cancel(cycle.sub.request_id)
            self.state.observe_request(cycle.template, 499, time.perf_counter() - cycle.t0_s)
        super().connection_lost(exc)

    # ---- which requests are hot ----------------------------------------------------------------
    def _hot_cycle(self) -> HotCycle | None:
        """A cycle for a hot request this protocol can answer itself, else None."""
        parser = self.parser
        if parser.get_method() != _POST or self.expect_100_continue or self.root_path:
            return None
        if self.cycle is not None and not self.cycle.response_complete:
            return None  # pipelined behind an unanswered request: uvicorn queues it
        if self.limit_concurrency is not None or parser.should_upgrade():
            return None
        raw_path = httptools.parse_url(self.url).path
        if b"%" in raw_path:
            return None
        path = raw_path.decode("ascii")
        keep_alive = parser.get_http_version() != "1.0" and parser.should_keep_alive()
        if path == EMBED_PATH:
            return HotCycle(EMBED_PATH, path, "", None, keep_alive)
        target = infer_target(path)
        if target is None:
            return None
        name, version = target
        template = INFER_TEMPLATE if version is None else VERSIONED_INFER_TEMPLATE
        return HotCycle(template, path, name, version, keep_alive)

    def _guard(self, cycle: HotCycle) -> tuple[int, list[tuple[bytes, bytes]], bytes] | None:
        """The guards' refusals (``guards.py``), in their order: the bearer token, then a
        declared body size over the limit. Also reads the headers the route needs."""
        given, length = b"", None
        for key, value in self.headers:
            if key == b"authorization":
                given = value
            elif key == b"content-length":
                length = value
            elif key == b"accept" and cycle.accept is None:
                cycle.accept = value.decode("latin-1")
            elif key == b"inference-header-content-length" and cycle.header_length is None:
                cycle.header_length = value.decode("latin-1")
        expected = self.expected_auth
        if expected is not None and cycle.path not in OPEN_PATHS \
                and not hmac.compare_digest(given, expected):
            return reject_parts(401, "unauthorized", "missing or wrong bearer token", cycle.path,
                                [(b"www-authenticate", b"Bearer")])
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return reject_parts(413, "body_too_large", f"request body of {int(length)} bytes "
                                f"exceeds {self.max_body_bytes}", cycle.path)
        return None

    # ---- serving -------------------------------------------------------------------------------
    def _dispatch(self, cycle: HotCycle) -> None:
        """Parse and submit; the answer is written by ``_on_result`` when the future is done."""
        body = cycle.parts[0] if len(cycle.parts) == 1 else b"".join(cycle.parts)
        cycle.parts = []
        state = self.state
        HotHttpProtocol.answered += 1
        try:
            if cycle.template == EMBED_PATH:
                args = parse_embed(body, state.cfg.server.max_request_nodes)
                new = None if args.new_features is None else (args.new_features,
                                                              args.new_neighbors or [])
                cycle.sub = submit_ids(state, args.node_ids, args.exact, args.seed,
                                       args.timeout_ms, args.min_version, new, args.model,
                                       args.version)
            else:
                pinned = infer_version(cycle.version_raw)
                req = cycle.infer = kserve.parse_infer(body, cycle.header_length)
                cycle.sub = submit_ids(state, req.node_ids, req.exact, req.seed, req.timeout_ms,
                                       req.min_version, None, cycle.name, pinned)
        except Exception as exc:  # noqa: BLE001 - answered as the ASGI path answers it
            self._fail(cycle, exc)
            return
        cycle.sub.future.add_done_callback(functools.partial(self._on_result, cycle))

    def _on_result(self, cycle: HotCycle, future: Any) -> None:
        if cycle.disconnected or cycle.response_complete:
            return
        try:
            answer = answer_of(future.result(), cycle.sub)  # type: ignore[arg-type]
            headers, parts = self._answer(cycle, answer)
        except Exception as exc:  # noqa: BLE001 - answered as the ASGI path answers it
            self._fail(cycle, exc)
            return
        self._write(cycle, 200, headers, parts, cycle.template)

    def _answer(self, cycle: HotCycle, answer: Answer) -> tuple[list[tuple[bytes, bytes]],
                                                                list[Any]]:
        """Headers and body parts of a 200, as the routes order them."""
        if cycle.infer is not None:
            parts, named = kserve.infer_response_parts(answer.model, answer.version, cycle.infer,
                                                       answer.rows)
            headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in named.items()]
            headers.append(_length(parts))
            return headers, parts
        if wants_npy(cycle.accept):
            rows = np.ascontiguousarray(answer.rows, dtype="<f4")
            parts = [npy_header(rows.shape), rows.reshape(-1).view(np.uint8)]
            return [(_MODEL_NAME, answer.model.encode("latin-1")),
                    (_MODEL_VERSION, str(answer.version).encode("latin-1")),
                    _length(parts), (b"content-type", _NPY)], parts
        body, _ = embed_answer(answer.model, answer.rows, None, answer.version)
        return [_length([body]), (b"content-type", _JSON)], [body]

    def _fail(self, cycle: HotCycle, exc: Exception) -> None:
        """A refusal as the FastAPI handlers word it; anything else a 500 with an error id,
        and the connection closed (as uvicorn closes it after an application error)."""
        if not isinstance(exc, errors.ServeError):
            info = errors.internal_error(exc, f"POST {cycle.path}", log).info
            exc = errors.ServeError(info.code, info.message, info.status)
            cycle.keep_alive = False
        response = self.state.error(exc, cycle.path)
        self._write(cycle, response.status_code, list(response.raw_headers), [response.body],
                    cycle.template)

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


def _length(parts: list[Any]) -> tuple[bytes, bytes]:
    return b"content-length", str(sum(len(p) for p in parts)).encode("latin-1")


def hot_protocol(state: Any, token: str | None, max_body_bytes: int) -> type[HotHttpProtocol]:
    """The protocol class for uvicorn's ``http`` option, bound to one app's state."""
    return type("BoundHotHttpProtocol", (HotHttpProtocol,), {
        "state": state, "expected_auth": f"Bearer {token}".encode() if token else None,
        "max_body_bytes": max_body_bytes})

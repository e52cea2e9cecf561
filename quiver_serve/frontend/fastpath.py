"""The hot routes in plain ASGI, answered in front of FastAPI.

``POST /v1/embed``, ``POST /v2/models/{name}/infer`` and
``POST /v2/models/{name}/versions/{version}/infer`` are answered here: read the body off
``receive``, parse it with the same code as before (``frontend/bodies.py``, ``frontend/kserve.py``),
submit to the event loop's engine client, and ``send()`` the answer's bytes. FastAPI's routing,
its request object, its exception middleware and its response classes are not on this path;
every other request (docs, OpenAPI, metadata, health, metrics, admin, a hot path with another
method) goes on to FastAPI, whose route definitions of the hot routes stay as the documented
schema (and answer when ``server.fast_routes`` is off).

The answers are the routes' answers byte for byte: the same status codes, error bodies (the
error path builds the very ``JSONResponse`` the FastAPI exception handlers build), headers in
the same order, and the same route template in ``scope["route"]``, so the request-latency
metric keeps its ``endpoint`` label. The guards (bearer token, body size) and the timing sit
outside this layer and see both paths alike.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, NamedTuple

import numpy as np

from quiver_serve import errors
from quiver_serve.engine.client.checks import (
    check_ids_at_door,
    check_min_version,
    check_rows,
    inductive_nodes,
)
from quiver_serve.frontend import kserve
from quiver_serve.frontend.bodies import EmbedArgs, parse_embed
from quiver_serve.frontend.model_view import parse_version
from quiver_serve.frontend.responses import (
    JSON_MEDIA_TYPE,
    NPY_MEDIA_TYPE,
    embed_answer,
    error_response,
    model_headers,
)
from quiver_serve.messages import EmbedResult

log = logging.getLogger(__name__)

EMBED_PATH = "/v1/embed"
INFER_TEMPLATE = "/v2/models/{name}/infer"
VERSIONED_INFER_TEMPLATE = "/v2/models/{name}/versions/{version}/infer"
HOT_TEMPLATES = (EMBED_PATH, INFER_TEMPLATE, VERSIONED_INFER_TEMPLATE)
_INFER_HEAD, _INFER_TAIL = "/v2/models/", "/infer"
_ACCEPT = b"accept"
_HEADER_LENGTH = kserve.HEADER_LENGTH.encode("latin-1")
_JSON = JSON_MEDIA_TYPE.encode("latin-1")
_NPY = NPY_MEDIA_TYPE.encode("latin-1")


class ClientGone(Exception):
    """The client went away while its request body was still coming."""


async def read_body(receive: Any) -> bytes:
    """The whole request body (the guards have bounded its size already)."""
    message = await receive()
    if message["type"] != "http.request":
        raise ClientGone
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        return body
    parts = [body]
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientGone
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


async def _wait_disconnect(receive: Any) -> None:
    """Returns when the client goes away (the body is already read, so only that can arrive)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _result_or_disconnect(state: Any, receive: Any, request_id: str,
                                result_f: Any) -> EmbedResult:
    """The result, or (the client went away first) the request cancelled and a 499. One waiter
    future woken by either side's done-callback: what ``asyncio.wait(FIRST_COMPLETED)`` does,
    without its sets and bookkeeping (~4 us a request on the dev box)."""
    loop = asyncio.get_running_loop()
    watch = loop.create_task(_wait_disconnect(receive))
    waiter = loop.create_future()

    def wake(_: Any) -> None:
        if not waiter.done():
            waiter.set_result(None)

    result_f.add_done_callback(wake)
    watch.add_done_callback(wake)
    try:
        await waiter
    finally:
        result_f.remove_done_callback(wake)
        watch.remove_done_callback(wake)
        watch.cancel()
    if result_f.done():
        return result_f.result()  # type: ignore[no-any-return]
    state.pipeline.cancel(request_id)  # nobody listens: do not compute it
    raise errors.ServeError("client_disconnected", "client went away", 499)


class Answer(NamedTuple):
    """Rows served, and the model version that computed them."""

    rows: np.ndarray  # float32 [n, dim]
    model: str
    version: int


class Submitted(NamedTuple):
    """A request handed to the engine client: its id (to cancel it), the future of its
    ``EmbedResult``, and the model it asked for ("" and 0: the default, the split's pick)."""

    request_id: str
    future: Any
    model: str
    version: int
    default_model: str


def submit_ids(state: Any, ids: np.ndarray, exact: bool, seed: int | None,
               timeout_ms: float | None, min_version: int = 0,
               new_nodes: tuple[list[Any], list[Any]] | None = None,
               model: str = "", version: int = 0) -> Submitted:
    """Check (NumPy) and submit on the running event loop's client; a ServeError with the
    right status when the request is refused. ``new_nodes``: the inductive nodes' feature
    rows and in-neighbour lists, unchecked; their rows follow the ids' rows. ``model`` ("":
    the default) and ``version`` (0: the traffic split's pick) say which model answers."""
    limit = state.cfg.server.max_request_nodes
    num_new = len(new_nodes[0]) if new_nodes else 0
    if ids.size + num_new > limit:
        if num_new:
            check_rows(int(ids.size), num_new, limit)
        raise errors.too_large(int(ids.size), limit)
    pipeline = state.pipeline
    if not pipeline.ready:
        raise pipeline.refusal()
    num_nodes, capacity = pipeline.num_nodes, pipeline.node_capacity
    check_ids_at_door(ids, num_nodes, capacity)
    check_min_version(min_version)
    view = state.views.current(cached=True)
    target_model, target_version = view.submit_target(model, version)
    inductive = None if not num_new else inductive_nodes(
        new_nodes[0], new_nodes[1], pipeline.num_features or 0, num_nodes, capacity)  # type: ignore[index]
    timeout_s = None if timeout_ms is None else timeout_ms / 1000.0
    request_id, future = pipeline.submit_ids_async(ids, exact, seed, timeout_s, min_version,
                                                   inductive, target_model, target_version)
    return Submitted(request_id, future, model, version, view.default)


def answer_of(result: EmbedResult, sub: Submitted) -> Answer:
    """The rows of a finished request, or its refusal as a ServeError."""
    if result.error is not None:
        raise errors.ServeError.from_info(result.error)
    rows = result.rows if result.rows is not None else result.embeddings.numpy()  # type: ignore[union-attr]
    return Answer(rows, result.model or sub.model or sub.default_model,
                  result.version or sub.version or 1)


async def serve_ids(state: Any, receive: Any, ids: np.ndarray, exact: bool, seed: int | None,
                    timeout_ms: float | None, min_version: int = 0,
                    new_nodes: tuple[list[Any], list[Any]] | None = None,
                    model: str = "", version: int = 0) -> Answer:
    """``submit_ids``, then the answer. ``receive`` is the ASGI request's (a disconnect
    cancels the request); None for gRPC, whose channel's own cancellation ends the call."""
    sub = submit_ids(state, ids, exact, seed, timeout_ms, min_version, new_nodes, model, version)
    if receive is None:
        result = await sub.future
    else:
        result = await _result_or_disconnect(state, receive, sub.request_id, sub.future)
    return answer_of(result, sub)


async def serve_embed(state: Any, receive: Any, body: EmbedArgs) -> Answer:
    """``serve_ids`` of one parsed ``/v1/embed`` body."""
    new = None if body.new_features is None else (body.new_features, body.new_neighbors or [])
    return await serve_ids(state, receive, body.node_ids, body.exact, body.seed, body.timeout_ms,
                           body.min_version, new, body.model, body.version)


def embed_response_parts(answer: Answer, accept: str | None) -> tuple[bytes, str,
                                                                      dict[str, str] | None]:
    """Body, media type and extra headers of a ``/v1/embed`` answer."""
    body, media_type = embed_answer(answer.model, answer.rows, accept, answer.version)
    return body, media_type, model_headers(media_type, answer.model, answer.version)


def header(scope: Any, name: bytes) -> str | None:
    """The first value of header ``name`` (lower case), as Starlette's ``headers.get`` reads it."""
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


def infer_target(path: str) -> tuple[str, str | None] | None:
    """``(name, None)`` when ``path`` is ``/v2/models/{name}/infer``, ``(name, version)`` when
    it is ``/v2/models/{name}/versions/{version}/infer`` (Starlette's ``[^/]+`` per part), else
    None."""
    if not (path.startswith(_INFER_HEAD) and path.endswith(_INFER_TAIL)):
        return None
    parts = path[len(_INFER_HEAD):-len(_INFER_TAIL)].split("/")
    if len(parts) == 1 and parts[0]:
        return parts[0], None
    if len(parts) == 3 and parts[1] == "versions" and parts[0] and parts[2]:
        return parts[0], parts[2]
    return None


def infer_version(raw: str | None) -> int:
    """The version of a versioned infer path (0: none named); a 400 when it is no version."""
    return 0 if raw is None else parse_version(raw)


def _length(body: bytes) -> tuple[bytes, bytes]:
    return b"content-length", str(len(body)).encode("latin-1")


async def _respond(send: Any, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    """A 200: the headers in the order Starlette's ``Response`` lists them (``media_type``
    alone: length, type; a ``headers`` mapping: its items, then the length)."""
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class HotRoutes:
    """ASGI: the hot routes answered here, every other request passed on to ``app``."""

    def __init__(self, app: Any, state: Any, routes: dict[str, Any]) -> None:
        self.app, self.state = app, state
        self.embed_route = routes[EMBED_PATH]  # FastAPI's route objects: the metric's label
        self.infer_route = routes[INFER_TEMPLATE]
        self.versioned_infer_route = routes[VERSIONED_INFER_TEMPLATE]
        #: requests this layer answered (tests check that the hot routes bypass FastAPI)
        self.answered = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            path = scope["path"]
            if path == EMBED_PATH:
                scope["route"] = self.embed_route
                await self._answer(self._embed(scope, receive, send), scope, receive, send)
                return
            target = infer_target(path)
            if target is not None:
                name, version = target
                if version is None:
                    scope["route"], scope["path_params"] = self.infer_route, {"name": name}
                else:
                    scope["route"] = self.versioned_infer_route
                    scope["path_params"] = {"name": name, "version": version}
                await self._answer(self._infer(name, version, scope, receive, send), scope,
                                   receive, send)
                return
        await self.app(scope, receive, send)

    async def _answer(self, work: Any, scope: Any, receive: Any, send: Any) -> None:
        """Run one route's coroutine; a failure is answered as the FastAPI handlers answer it."""
        self.answered += 1
        path = scope["path"]
        try:
            await work
        except errors.ServeError as exc:
            await self.state.error(exc, path)(scope, receive, send)
        except ClientGone:
            exc = errors.ServeError("client_disconnected", "client went away", 499)
            await self.state.error(exc, path)(scope, receive, send)
        except Exception as exc:
            # As Starlette's ServerErrorMiddleware: the 500 body, then the exception goes on to
            # the server (which logs it and closes the connection).
            info = errors.internal_error(exc, f"POST {path}", log).info
            await error_response(info.status, info.code, info.message, path=path)(
                scope, receive, send)
            raise

    async def _embed(self, scope: Any, receive: Any, send: Any) -> None:
        state = self.state
        body = parse_embed(await read_body(receive), state.cfg.server.max_request_nodes)
        answer = await serve_embed(state, receive, body)
        body_bytes, media_type, extra = embed_response_parts(answer, header(scope, _ACCEPT))
        content_type = _NPY if media_type == NPY_MEDIA_TYPE else _JSON
        raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in (extra or {}).items()]
        await _respond(send, body_bytes, [*raw, _length(body_bytes),
                                          (b"content-type", content_type)])

    async def _infer(self, name: str, version: str | None, scope: Any, receive: Any,
                     send: Any) -> None:
        state = self.state
        pinned = infer_version(version)
        req = kserve.parse_infer(await read_body(receive), header(scope, _HEADER_LENGTH))
        answer = await serve_ids(state, receive, req.node_ids, req.exact, req.seed,
                                 req.timeout_ms, req.min_version, None, name, pinned)
        body, headers = kserve.infer_response(answer.model, answer.version, req, answer.rows)
        raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        raw.append(_length(body))
        await _respond(send, body, raw)

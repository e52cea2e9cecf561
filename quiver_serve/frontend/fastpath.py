"""The hot routes, written once: which request is one, its parse and submit, its answer's bytes.

``POST /v1/embed``, ``POST /v2/models/{name}/infer`` and
``POST /v2/models/{name}/versions/{version}/infer`` (docs/architecture.md, "Front-ends";
docs/decisions/0037-one-answering-path.md). The functions here know no transport:

* :func:`hot_target`: the route a (decoded) path names, or None;
* :func:`start`: parse the body (``bodies.py``, ``kserve.py``), check it and submit it to the
  event loop's engine client (:func:`submit_ids`, also gRPC's);
* :func:`ok_parts`: the headers and body parts of a 200 (a ``.npy`` or KServe binary answer's rows
  are a view of the reply buffer, not a copy);
* :func:`failure_parts`: a refusal as every route words it (``responses.py``), or a 500 naming an
  error id.

The daemon answers these routes inside its HTTP protocol (``hot_protocol.py``). An ASGI server
without it (uvicorn on h11, an in-process ASGI client) reaches :class:`HotRoutes`, a thin ASGI
adapter in front of FastAPI that calls the same functions; FastAPI only documents the routes
(``app.py``).
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from typing import Any, NamedTuple

import numpy as np

from quiver_serve import errors
from quiver_serve.engine.client.checks import (
    check_ids_at_door,
    check_min_version,
    check_rows,
    check_typed_request,
    inductive_nodes,
    names_a_type,
    typed_inductive_nodes,
)
from quiver_serve.frontend import kserve
from quiver_serve.frontend.bodies import npy_header, parse_embed
from quiver_serve.frontend.model_view import parse_version
from quiver_serve.frontend.responses import (
    JSON_MEDIA_TYPE,
    NPY_MEDIA_TYPE,
    embed_answer,
    wants_npy,
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
_MODEL_NAME, _MODEL_VERSION, _NODE_TYPE = b"x-model-name", b"x-model-version", b"x-node-type"

Headers = list[tuple[bytes, bytes]]


class HotTarget(NamedTuple):
    """A hot request's route: its template (the latency metric's ``endpoint`` label), the
    decoded path (its error body's protocol), and the infer route's model name and version."""

    template: str
    path: str
    name: str = ""
    version_raw: str | None = None


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
    #: the node type asked for (typed graphs; "": none named)
    node_type: str = ""


class Work(NamedTuple):
    """A hot request submitted: what :func:`ok_parts` needs to answer it."""

    sub: Submitted
    infer: kserve.InferRequest | None  # None: ``/v1/embed``


def decode_path(raw_path: bytes) -> str:
    """The request path as Starlette routes it: ASCII, percent-encoding decoded."""
    path = raw_path.decode("ascii")
    return urllib.parse.unquote(path) if "%" in path else path


def hot_target(path: str) -> HotTarget | None:
    """The hot route ``path`` (decoded) names, else None. Infer paths match as Starlette's
    ``[^/]+`` per part: ``/v2/models/{name}/infer``, ``/v2/models/{name}/versions/{v}/infer``."""
    if path == EMBED_PATH:
        return HotTarget(EMBED_PATH, path)
    if not (path.startswith(_INFER_HEAD) and path.endswith(_INFER_TAIL)):
        return None
    parts = path[len(_INFER_HEAD):-len(_INFER_TAIL)].split("/")
    if len(parts) == 1 and parts[0]:
        return HotTarget(INFER_TEMPLATE, path, parts[0])
    if len(parts) == 3 and parts[1] == "versions" and parts[0] and parts[2]:
        return HotTarget(VERSIONED_INFER_TEMPLATE, path, parts[0], parts[2])
    return None


def infer_version(raw: str | None) -> int:
    """The version of a versioned infer path (0: none named); a 400 when it is no version."""
    return 0 if raw is None else parse_version(raw)


def submit_ids(state: Any, ids: np.ndarray, exact: bool, seed: int | None,
               timeout_ms: float | None, min_version: int = 0,
               new_nodes: tuple[list[Any], list[Any]] | None = None,
               model: str = "", version: int = 0, node_type: str = "") -> Submitted:
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
    node_types = getattr(pipeline, "node_types", None)
    typed = names_a_type(node_type, node_types)  # docs/architecture.md, "Typed graphs"
    if typed:
        if hasattr(pipeline, "node_types"):  # else the engine core checks type and ids
            check_typed_request(ids, node_type, node_types, limit, num_new)
    else:
        check_ids_at_door(ids, num_nodes, capacity)
    check_min_version(min_version)
    view = state.views.current(cached=True)
    target_model, target_version = view.submit_target(model, version)
    if not num_new:
        inductive = None
    elif typed:  # the engine core checks the type's width, the relations and id ranges
        inductive = typed_inductive_nodes(new_nodes[0], new_nodes[1])  # type: ignore[index]
    else:
        inductive = inductive_nodes(new_nodes[0], new_nodes[1], pipeline.num_features or 0,  # type: ignore[index]
                                    num_nodes, capacity)
    timeout_s = None if timeout_ms is None else timeout_ms / 1000.0
    request_id, future = pipeline.submit_ids_async(ids, exact, seed, timeout_s, min_version,
                                                   inductive, target_model, target_version,
                                                   node_type)
    return Submitted(request_id, future, model, version, view.default, node_type)


def answer_of(result: EmbedResult, sub: Submitted) -> Answer:
    """The rows of a finished request, or its refusal as a ServeError."""
    if result.error is not None:
        raise errors.ServeError.from_info(result.error)
    rows = result.rows if result.rows is not None else result.embeddings.numpy()  # type: ignore[union-attr]
    return Answer(rows, result.model or sub.model or sub.default_model,
                  result.version or sub.version or 1)


def start(state: Any, target: HotTarget, body: bytes, header_length: str | None) -> Work:
    """Parse, check and submit one hot request (a ServeError when it is refused)."""
    if target.template == EMBED_PATH:
        a = parse_embed(body, state.cfg.server.max_request_nodes)
        new = None if a.new_features is None else (a.new_features, a.new_neighbors or [])
        return Work(submit_ids(state, a.node_ids, a.exact, a.seed, a.timeout_ms, a.min_version,
                               new, a.model, a.version, a.node_type), None)
    pinned = infer_version(target.version_raw)
    req = kserve.parse_infer(body, header_length)
    return Work(submit_ids(state, req.node_ids, req.exact, req.seed, req.timeout_ms,
                           req.min_version, None, target.name, pinned, req.node_type), req)


def ok_parts(work: Work, result: EmbedResult, accept: str | None) -> tuple[Headers, list[Any]]:
    """Headers and body parts of the 200 answering ``result`` (a ServeError when it is a
    refusal). ``/v1/embed``: JSON, or ``.npy`` when ``accept`` asks for it (the model and
    version in ``x-model-name`` / ``x-model-version``, a typed request's type in
    ``x-node-type``); infer: KServe JSON or binary."""
    answer = answer_of(result, work.sub)
    if work.infer is not None:
        parts, named = kserve.infer_response_parts(answer.model, answer.version, work.infer,
                                                   answer.rows)
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in named.items()]
        headers.append(content_length(parts))
        return headers, parts
    if wants_npy(accept):
        rows = np.ascontiguousarray(answer.rows, dtype="<f4")
        parts = [npy_header(rows.shape), rows.reshape(-1).view(np.uint8)]
        headers = [(_MODEL_NAME, answer.model.encode("latin-1")),
                   (_MODEL_VERSION, str(answer.version).encode("latin-1")),
                   content_length(parts), (b"content-type", _NPY)]
        if work.sub.node_type:  # typed graphs: the answer names the type asked for
            headers.append((_NODE_TYPE, work.sub.node_type.encode("latin-1")))
        return headers, parts
    body, _ = embed_answer(answer.model, answer.rows, None, answer.version, work.sub.node_type)
    return [content_length([body]), (b"content-type", _JSON)], [body]


def failure_parts(state: Any, exc: BaseException, where: str,
                  path: str) -> tuple[int, Headers, bytes, bool]:
    """Status, headers and body answering ``exc``, and whether to close the connection: a
    refusal (``errors.ServeError``) as every route words it; anything else a 500 naming an
    error id (the traceback logged under it), and the connection closed."""
    close = not isinstance(exc, errors.ServeError)
    if close:
        info = errors.internal_error(exc, where, log).info
        exc = errors.ServeError(info.code, info.message, info.status)
    response = state.error(exc, path)
    return response.status_code, list(response.raw_headers), bytes(response.body), close


def content_length(parts: list[Any]) -> tuple[bytes, bytes]:
    return b"content-length", str(sum(len(p) for p in parts)).encode("latin-1")


def header(scope: Any, name: bytes) -> str | None:
    """The first value of header ``name`` (lower case), as Starlette's ``headers.get`` reads it."""
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


# ---- the ASGI adapter ----------------------------------------------------------------------------
class ClientGone(Exception):
    """The client went away while its request body was still coming."""


async def read_body(receive: Any) -> bytes:
    """The whole request body (the guards have bounded its size already)."""
    parts: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientGone
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)


async def _result_or_gone(state: Any, receive: Any, sub: Submitted) -> EmbedResult:
    """The result, or (the client went away first) the request cancelled and ClientGone."""
    loop = asyncio.get_running_loop()

    async def gone() -> None:  # the body is read: only a disconnect can arrive
        while (await receive())["type"] != "http.disconnect":
            pass

    watch = loop.create_task(gone())
    try:
        await asyncio.wait((sub.future, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if sub.future.done():
        return sub.future.result()  # type: ignore[no-any-return]
    state.pipeline.cancel(sub.request_id)  # nobody listens: do not compute it
    raise ClientGone


class HotRoutes:
    """ASGI: the hot routes answered with this module's functions, every other request passed
    on to ``app``. ``routes``: the documented route object of each template, set as
    ``scope["route"]`` so the latency metric gets the template as its ``endpoint``."""

    def __init__(self, app: Any, state: Any, routes: dict[str, Any]) -> None:
        self.app, self.state, self.routes = app, state, routes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        target = hot_target(scope["path"]) if scope["type"] == "http" else None
        if target is None:
            await self.app(scope, receive, send)
            return
        scope["route"] = self.routes[target.template]
        if scope["method"] != "POST":
            refusal = errors.ServeError("method_not_allowed",
                                        f"{target.template} answers POST only", 405)
            status, headers, body, _ = failure_parts(self.state, refusal, "", target.path)
            await _send(send, status, [*headers, (b"allow", b"POST")], [body])
            return
        try:
            work = start(self.state, target, await read_body(receive),
                         header(scope, _HEADER_LENGTH))
            result = await _result_or_gone(self.state, receive, work.sub)
            headers, parts = ok_parts(work, result, header(scope, _ACCEPT))
        except ClientGone:
            gone = errors.ServeError("client_disconnected", "client went away", 499)
            status, headers, body, _ = failure_parts(self.state, gone, "", target.path)
            await _send(send, status, headers, [body])
            return
        except Exception as exc:  # noqa: BLE001 - answered as every route answers it
            status, headers, body, close = failure_parts(self.state, exc, f"POST {target.path}",
                                                         target.path)
            await _send(send, status, headers + ([(b"connection", b"close")] if close else []),
                        [body])
            return
        await _send(send, 200, headers, parts)


async def _send(send: Any, status: int, headers: Headers, parts: list[Any]) -> None:
    body = parts[0] if len(parts) == 1 else b"".join(parts)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": bytes(body)})

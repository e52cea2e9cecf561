"""The HTTP front-end's app: FastAPI serves the docs (OpenAPI at ``/docs``, the hot routes
included), KServe v2 metadata and health, the graph and repository (admin) routes, ``/v1/workers``
and ``/metrics``; the hot routes (``/v1/embed``, KServe infer) are answered by ``fastpath.py``'s
functions, in the HTTP protocol (``hot_protocol.py``). It owns the Prometheus registry."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from quiver_serve import errors
from quiver_serve.config import ServeConfig
from quiver_serve.engine.client.pipeline import Pipeline
from quiver_serve.frontend import graph_routes, kserve, model_routes, repository_routes
from quiver_serve.frontend.bodies import validation_message
from quiver_serve.frontend.fastpath import (
    EMBED_PATH,
    INFER_TEMPLATE,
    VERSIONED_INFER_TEMPLATE,
    HotRoutes,
)
from quiver_serve.frontend.guards import Guards, Tokens, resolve_admin_token, resolve_token
from quiver_serve.frontend.model_routes import server_not_ready
from quiver_serve.frontend.model_view import Views
from quiver_serve.frontend.responses import (
    NPY_MEDIA_TYPE,
    error_response,
    serve_error_response,
)
from quiver_serve.frontend.schemas import (
    EmbedBody,
    EmbedResponse,
    ErrorBody,
    InferBody,
    InferResponse,
)
from quiver_serve.metrics.prometheus import Metrics

log = logging.getLogger(__name__)

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 404, 413, 422, 429, 503, 504)
}
_ADMIN_ERRORS: dict[int | str, dict[str, Any]] = {403: {"model": ErrorBody}, **_ERRORS}


class ServerState:
    """What the routes share: config, pipeline, metrics, and the start-up outcome.

    ``pipeline`` is a :class:`Pipeline` (one front-end, in the main process) or a
    ``frontend_proc.RemotePipeline`` (one front-end process of several); both are
    :class:`~quiver_serve.engine.facade.ClientFacade`."""

    def __init__(self, cfg: ServeConfig, pipeline: Any, metrics: Metrics) -> None:
        self.cfg = cfg
        self.pipeline = pipeline
        self.metrics = metrics
        #: the tokens that open the data and admin planes (``guards.authorize``)
        self.tokens = Tokens.from_config(cfg.server)
        #: the models served, as the routes see them (``frontend/model_view.py``)
        self.views = Views(cfg, pipeline)
        self.start_error: BaseException | None = None
        self.on_fatal: Callable[[BaseException], None] | None = None
        #: run once the pipeline has started (the daemon's main process freezes its heap there)
        self.on_started: Callable[[], Callable[[], int] | None] | None = None
        #: this process's GC-pause flush, called on each /metrics scrape
        self.flush_gc: Callable[[], int] = lambda: 0
        self._durations: dict[tuple[str, int], Any] = {}  # bound (endpoint, status) children

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        """One answered request in the latency metric (``endpoint``: the route template)."""
        child = self._durations.get((endpoint, status))
        if child is None:
            child = self._durations.setdefault(
                (endpoint, status), self.metrics.request_duration.labels(endpoint, str(status)))
        child.observe(seconds)

    def start_pipeline(self) -> None:
        try:
            self.pipeline.start()
            if self.on_started is not None:
                self.flush_gc = self.on_started() or self.flush_gc
        except BaseException as exc:  # noqa: BLE001 - surfaced through on_fatal and readiness
            log.exception("start-up failed")
            self.start_error = exc
            if self.on_fatal is not None:
                self.on_fatal(exc)

    def error(self, exc: errors.ServeError, path: str = "") -> JSONResponse:
        return serve_error_response(exc, self.cfg.server.retry_after_s, path)


def create_app(cfg: ServeConfig, pipeline: Any = None) -> FastAPI:
    """The app; the pipeline starts in a background thread so liveness answers during start-up."""
    metrics = Metrics()
    pipeline = pipeline or Pipeline(cfg, observer=metrics)
    pipeline.observer = metrics
    state = ServerState(cfg, pipeline, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        threading.Thread(target=state.start_pipeline, name="quiver-start", daemon=True).start()
        grpc = await _start_grpc(state)
        yield
        if grpc is not None:
            await grpc.stop(grace=cfg.server.drain_timeout_s)
        await asyncio.get_running_loop().run_in_executor(None, pipeline.stop)

    app = FastAPI(title="quiver-serve", version="0.1.0", lifespan=lifespan,
                  description="Node embeddings from a PyG model over a sampled graph.")
    app.state.qs = state
    _install_error_handlers(app)
    hot_routes = _hot_route_docs()
    _install_timing(app, state, hot_routes, state.tokens, cfg.server.max_body_bytes)
    _document(app, list(hot_routes.values()))
    _add_operations_routes(app, state)
    graph_routes.add_graph_routes(app, state, _ADMIN_ERRORS)
    _add_kserve_routes(app, state)
    model_routes.add_model_routes(app, state)
    repository_routes.add_repository_routes(app, state, _ADMIN_ERRORS)
    return app


async def _start_grpc(state: ServerState) -> Any:
    """The KServe v2 gRPC endpoint on this loop when ``server.grpc_port`` is set, else None."""
    s = state.cfg.server
    if s.grpc_port is None:
        return None
    from quiver_serve.frontend.grpc import calls

    return await calls.start(state, s.host, s.grpc_port, resolve_token(s.auth_token),
                                   resolve_admin_token(s.admin_token))


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, "invalid_request", validation_message(list(exc.errors())),
                              path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, "http_error", str(exc.detail), path=request.url.path)

    @app.exception_handler(errors.ServeError)
    async def _serve(request: Request, exc: errors.ServeError) -> JSONResponse:
        return request.app.state.qs.error(exc, request.url.path)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        info = errors.internal_error(exc, f"{request.method} {request.url.path}", log).info
        return error_response(info.status, info.code, info.message, path=request.url.path)


def _install_timing(app: FastAPI, state: ServerState, hot_routes: dict[str, APIRoute],
                   tokens: Tokens, max_body_bytes: int) -> None:
    """Request latency by route template and status, as plain ASGI (no per-request task hop);
    the guards (``authorize``, body size) sit inside it so refusals are timed and counted too,
    and the hot routes' ASGI adapter (``frontend/fastpath.py``) inside them, in front of FastAPI.
    The daemon answers the hot routes in its HTTP protocol (``hot_protocol.py``); the adapter
    answers them, with the same functions, for an ASGI server without that protocol."""
    inner = app.build_middleware_stack
    observe = state.observe_request

    def build() -> Any:
        asgi = Guards(HotRoutes(inner(), state, hot_routes), tokens, max_body_bytes)

        async def timed(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                await asgi(scope, receive, send)
                return
            t0 = time.perf_counter()
            status = [500]

            async def send_status(message: Any) -> None:
                if message["type"] == "http.response.start":
                    status[0] = message["status"]
                await send(message)

            try:
                await asgi(scope, receive, send_status)
            finally:
                observe(getattr(scope.get("route"), "path", "unmatched"), status[0],
                        time.perf_counter() - t0)

        return timed

    app.build_middleware_stack = build  # type: ignore[method-assign]


def _hot_route_docs() -> dict[str, APIRoute]:
    """The hot routes as FastAPI documents them (bodies, answers, errors), by template. They
    are not in the app's router: ``hot_protocol.py`` (or the ASGI adapter) answers them; these
    objects are their OpenAPI entries and the latency metric's ``endpoint`` label."""
    embed_body = {"required": True, "content": {"application/json": {
        "schema": EmbedBody.model_json_schema(ref_template="#/components/schemas/{model}")}}}
    infer_body = {"requestBody": {"required": True, "content": {
        "application/json": {"schema": InferBody.model_json_schema()},
        kserve.OCTET_STREAM: {"schema": {"type": "string", "format": "binary"}}}}}

    def embed() -> None:
        """Embeddings for node ids: one row per requested position, then one per new node."""

    def infer(name: str) -> None:
        """KServe v2 inference on a model; its traffic split picks the version."""

    def infer_pinned(name: str, version: str) -> None:
        """KServe v2 inference on one version of a model."""

    routes = [
        APIRoute(EMBED_PATH, embed, methods=["POST"], response_model=EmbedResponse,
                 responses={**_ERRORS, 200: {"content": {NPY_MEDIA_TYPE: {}}}},
                 openapi_extra={"requestBody": embed_body},
                 summary="Embeddings for node ids (JSON, or .npy with Accept: "
                         "application/x-npy)"),
        APIRoute(INFER_TEMPLATE, infer, methods=["POST"], response_model=InferResponse,
                 responses=_ERRORS, openapi_extra=infer_body,
                 summary="KServe v2 inference: input node_ids INT64 [n] -> output embeddings "
                         "FP32 [n, dim]; JSON or the binary tensor extension; the model's "
                         "traffic split picks the version"),
        APIRoute(VERSIONED_INFER_TEMPLATE, infer_pinned, methods=["POST"],
                 response_model=InferResponse, responses=_ERRORS, openapi_extra=infer_body,
                 summary="KServe v2 inference on one version of the model"),
    ]
    return {route.path: route for route in routes}


def _document(app: FastAPI, extra: list[APIRoute]) -> None:
    """``/openapi.json`` (and ``/docs``) describe the app's routes and ``extra``."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = get_openapi(
                title=app.title, version=app.version, openapi_version=app.openapi_version,
                description=app.description, routes=[*app.routes, *extra])
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_operations_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/workers", summary="Worker processes (front-ends included): role, index, pid, "
                                    "alive, ready, restarts; and the front-end that answered")
    async def workers() -> dict[str, Any]:
        rows = state.pipeline.workers()
        me = {"index": getattr(state.pipeline, "index", 0), "pid": os.getpid()}
        if not any(w["role"] == "frontend" for w in rows):  # the one front-end, in this process
            rows = [{"role": "frontend", **me, "alive": True, "ready": state.pipeline.ready,
                     "restarts": 0}, *rows]
        return {"workers": rows, "frontend": me, "pending_requests": state.pipeline.pending_count}

    @app.post("/admin/features/replace", status_code=202, responses=_ADMIN_ERRORS,
              summary="Re-place feature rows from the requests served so far (engines keep "
                      "serving); admin: server.admin_token, or loopback clients when none is set")
    async def replace_features() -> dict[str, Any]:
        supervisor = getattr(state.pipeline, "supervisor", None)
        if supervisor is None:
            raise errors.ServeError("not_ready", "no engine cores to re-place", 503)
        asked = supervisor.replace_features()
        log.info("admin: feature re-placement asked of %d engine core(s)", asked)
        return {"engines_asked": asked}

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics() -> Response:
        state.flush_gc()
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _add_kserve_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/v2/health/live", summary="Liveness")
    async def live() -> dict[str, bool]:
        return {"live": True}

    @app.get("/v2/health/ready", summary="Readiness: 503 until graph and model are loaded, and when draining",
             responses={503: {"model": ErrorBody}})
    async def ready() -> Response:
        return server_not_ready(state) or JSONResponse({"ready": True})

    @app.get("/v2", summary="KServe v2 server metadata")
    async def server_metadata() -> dict[str, Any]:
        return kserve.SERVER_METADATA

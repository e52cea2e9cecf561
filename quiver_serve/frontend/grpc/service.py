"""KServe v2 over gRPC (``inference.GRPCInferenceService``): what each RPC answers.

Same semantics as the HTTP routes: one input ``node_ids`` (INT64 [n]) as ``raw_input_contents`` or
``contents.int64_contents``; one output ``embeddings`` (FP32 [n, dim]) as ``raw_output_contents``;
request parameters ``exact``, ``seed``, ``timeout_ms``, ``min_version`` (the graph version the
answer must see) and ``node_type`` (typed graphs); ``model_version`` pins a version (empty: the model's traffic split), and the
answer names the version that computed it; ``ModelReady`` and ``ModelMetadata`` take a version
too. The daemon's errors are mapped to gRPC status codes (``status.CODES``) with the same
messages. Off unless ``server.grpc_port`` is set; same bind address and bearer token as HTTP.

``ModelStreamInfer`` (``stream_infer.py``) takes the same requests on one bidirectional stream,
many in flight at once. ``ModelInfer`` itself is answered inside the connection's callbacks
(``calls.InferCall``, with ``infer_args`` below); the HTTP/2 transport is ``connection.py``. Every
front-end process binds the gRPC port (``SO_REUSEPORT``), so gRPC scales with
``server.http_workers`` as HTTP does, per connection; the largest request accepted is
``server.max_body_bytes``, as over HTTP.

The model-repository RPCs (``RepositoryIndex``, ``RepositoryModelLoad``,
``RepositoryModelUnload``; ``repository_routes.py`` does the work for both protocols) are admin
calls, guarded as the HTTP admin routes are: the admin token in the ``authorization`` metadata
(``Bearer <token>``; the data-plane token is PERMISSION_DENIED), or, with no admin token set,
loopback peers only.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple
from urllib.parse import unquote

import numpy as np

from quiver_serve import errors
from quiver_serve.frontend import repository_routes
from quiver_serve.frontend.grpc import proto as gp
from quiver_serve.frontend.grpc.status import CODES, status_for
from quiver_serve.frontend.grpc.stream_infer import StreamSession
from quiver_serve.frontend.guards import Plane, Tokens, authorize
from quiver_serve.frontend.kserve import SERVER_METADATA
from quiver_serve.frontend.model_view import parse_version, unready

log = logging.getLogger(__name__)

#: the request-latency metric's endpoint label of unary gRPC inference
UNARY_ENDPOINT = "grpc ModelInfer"
_LIVE = gp.message("ServerLiveResponse")
_READY = gp.message("ServerReadyResponse")
_MODEL_READY = gp.message("ModelReadyResponse")


class InferArgs(NamedTuple):
    """A ``ModelInferRequest`` checked and read: what ``fastpath.submit_ids`` takes."""

    ids: np.ndarray
    exact: bool
    seed: int | None
    timeout_ms: float | None
    min_version: int
    model: str
    version: int  # 0: the model's traffic split
    #: typed graphs: the ``node_type`` parameter ("": the graph's only type)
    node_type: str = ""


def _bad(message: str) -> errors.ServeError:
    return errors.ServeError("invalid_request", message, 400)


async def _abort(ctx: Any, exc: errors.ServeError) -> None:
    await ctx.abort(status_for(exc.info.status), exc.info.message)


def _version(raw: str) -> int | None:
    """A request's ``version`` field: None when empty (any version), else a positive int."""
    return parse_version(raw) if raw else None


def peer_address(peer: str) -> tuple[str, int] | None:
    """``(host, port)`` of a gRPC peer string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``, its
    URL-quoted form), None for anything else (a Unix socket)."""
    kind, _, rest = unquote(peer).partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = rest.rpartition(":")
    return host.strip("[]"), int(port) if port.isdigit() else 0


class KServeGrpc:
    """The servicer: each RPC is an ``async def (request, context)``."""

    def __init__(self, state: Any, token: str | None,
                 admin_token: str | None = None) -> None:
        self.state = state
        self.tokens = Tokens.of(token, admin_token)

    async def ServerLive(self, req: Any, ctx: Any) -> Any:  # noqa: N802 - the RPC's name
        return _LIVE(live=True)

    async def ServerReady(self, req: Any, ctx: Any) -> Any:  # noqa: N802
        await self._auth(ctx)
        return _READY(ready=unready(self.state) is None)  # as GET /v2/health/ready

    async def ModelReady(self, req: Any, ctx: Any) -> Any:  # noqa: N802
        """As Triton answers it: ready false (not an error) for a model not loaded."""
        await self._auth(ctx)
        try:
            version = _version(req.version)
        except errors.ServeError as exc:
            await _abort(ctx, exc)
        view = self.state.views.current()
        ready = req.name in view.names and view.is_ready(req.name, version)
        return _MODEL_READY(ready=self._ready() and ready)

    async def ServerMetadata(self, req: Any, ctx: Any) -> Any:  # noqa: N802
        await self._auth(ctx)
        return gp.message("ServerMetadataResponse")(**SERVER_METADATA)

    async def ModelMetadata(self, req: Any, ctx: Any) -> Any:  # noqa: N802
        await self._auth(ctx)
        try:
            meta = self.state.views.current().metadata(req.name, _version(req.version))
        except errors.ServeError as exc:
            await _abort(ctx, exc)
        return gp.message("ModelMetadataResponse")(
            name=meta["name"], versions=meta["versions"], platform=meta["platform"],
            inputs=meta["inputs"], outputs=meta["outputs"])

    async def ModelStreamInfer(self, requests: Any, ctx: Any) -> None:  # noqa: N802
        """Many requests on one stream (``stream_infer.py``); the token is checked once."""
        await self._auth(ctx)
        await StreamSession(self.state, ctx, infer_args).run(requests)

    async def RepositoryIndex(self, req: Any, ctx: Any) -> Any:  # noqa: N802
        who = await self._admin(ctx)
        try:
            rows = await repository_routes.repository_index(self.state, req.ready, who)
        except errors.ServeError as exc:
            await _abort(ctx, exc)
        return gp.message("RepositoryIndexResponse")(models=rows)

    async def RepositoryModelLoad(self, req: Any, ctx: Any) -> Any:  # noqa: N802
        await self._repository_call(repository_routes.load_model, req, ctx)
        return gp.message("RepositoryModelLoadResponse")()

    async def RepositoryModelUnload(self, req: Any, ctx: Any) -> Any:  # noqa: N802
        await self._repository_call(repository_routes.unload_model, req, ctx)
        return gp.message("RepositoryModelUnloadResponse")()

    async def _repository_call(self, call: Any, req: Any, ctx: Any) -> None:
        """A load or unload (admin): ``call(state, name, params, who)``, its error as a status."""
        who = await self._admin(ctx)
        try:
            await call(self.state, req.model_name, _repository_params(req.parameters), who)
        except errors.ServeError as exc:
            await _abort(ctx, exc)

    def _ready(self) -> bool:
        return bool(self.state.pipeline.ready and self.state.pipeline.engines_ready)

    async def _auth(self, ctx: Any) -> None:
        """The data plane's token (``guards.authorize``), from the call's metadata."""
        refused = authorize(Plane.DATA, _metadata(ctx, "authorization").encode(), None,
                            self.tokens)
        if refused is not None:
            await ctx.abort(CODES[refused.status], refused.message)

    async def _admin(self, ctx: Any) -> str:
        """The admin guard of HTTP (``guards.authorize``) on gRPC metadata and the peer;
        returns the peer, for the log."""
        peer = ctx.peer() or ""
        address = peer_address(peer)
        refused = authorize(Plane.ADMIN, _metadata(ctx, "authorization").encode(), address,
                            self.tokens)
        if refused is not None:
            log.warning("admin call %s from %s refused: %s", refused.code, peer or "unknown peer",
                        refused.message)
            await ctx.abort(CODES[refused.status], refused.message)
        return f"{address[0]}:{address[1]}" if address else peer or "unknown peer"


def _metadata(ctx: Any, key: str) -> str:
    """The first value of the call's metadata ``key`` (lower case), "" when absent."""
    for item in ctx.invocation_metadata() or ():
        if item[0] == key:
            return str(item[1])
    return ""


def infer_args(req: Any) -> InferArgs:
    """A ``ModelInferRequest``'s ids, parameters, model and version; ServeError (400) naming
    what is wrong with it."""
    ids = _node_ids(req)
    exact, seed, timeout_ms, min_version, node_type = False, None, None, 0, ""
    p = req.parameters
    if p:
        exact = p["exact"].bool_param if "exact" in p else False
        seed = p["seed"].int64_param if "seed" in p else None
        timeout_ms = _number(p["timeout_ms"]) if "timeout_ms" in p else None
        min_version = _integer(p["min_version"], "min_version") if "min_version" in p else 0
        node_type = p["node_type"].string_param if "node_type" in p else ""
    for out in req.outputs:
        if out.name != gp.OUTPUT_NAME:
            raise _bad(f"unknown output {out.name!r}; this model has 'embeddings'")
    return InferArgs(ids, exact, seed, timeout_ms, min_version, req.model_name,
                     _version(req.model_version) or 0, node_type)


def _repository_params(params: Any) -> dict[str, Any]:
    """A repository request's ``map<string, ModelRepositoryParameter>`` as plain values."""
    out: dict[str, Any] = {}
    for key, p in params.items():
        which = p.WhichOneof("parameter_choice")
        out[key] = getattr(p, which) if which else None
    return out


def _number(p: Any) -> float:
    return float(getattr(p, p.WhichOneof("parameter_choice") or "double_param"))


def _integer(p: Any, name: str) -> int:
    which = p.WhichOneof("parameter_choice")
    value = getattr(p, which) if which else 0
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise _bad(f"parameter {name} must be an integer, got {value!r}")
    return int(value)


def _node_ids(req: Any) -> np.ndarray:
    if len(req.inputs) != 1:
        raise _bad(f"one input (node_ids) expected, got {len(req.inputs)}")
    t = req.inputs[0]
    if t.name != "node_ids" or t.datatype.upper() != "INT64" or len(t.shape) != 1 \
            or t.shape[0] < 1:
        raise _bad(f"input must be node_ids INT64 [n >= 1], got {t.name} {t.datatype} "
                   f"{list(t.shape)}")
    n = t.shape[0]
    if req.raw_input_contents:
        raw = req.raw_input_contents[0]
        if len(raw) != n * 8:
            raise _bad(f"node_ids raw contents hold {len(raw)} bytes; INT64 [{n}] needs {n * 8}")
        return np.frombuffer(raw, dtype="<i8").astype(np.int64, copy=False)
    ids = np.asarray(t.contents.int64_contents, dtype=np.int64)
    if ids.size != n:
        raise _bad(f"node_ids has {ids.size} int64_contents for shape [{n}]")
    return ids

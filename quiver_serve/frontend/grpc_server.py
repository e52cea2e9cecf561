"""KServe v2 over gRPC (``inference.GRPCInferenceService``) on the HTTP front-end's event loop.

Same semantics as the HTTP routes: one input ``node_ids`` (INT64 [n]) as ``raw_input_contents`` or
``contents.int64_contents``; one output ``embeddings`` (FP32 [n, dim]) as ``raw_output_contents``;
request parameters ``exact``, ``seed``, ``timeout_ms``, ``min_version`` (the graph version the
answer must see); the daemon's errors mapped to gRPC status
codes with the same messages. Off unless ``server.grpc_port`` is set; same bind address and bearer
token as HTTP.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import numpy as np

from quiver_serve import errors
from quiver_serve.frontend import grpc_proto as gp
from quiver_serve.frontend.kserve import SERVER_METADATA

log = logging.getLogger(__name__)

#: daemon status -> gRPC status code
CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
         404: grpc.StatusCode.NOT_FOUND, 409: grpc.StatusCode.ALREADY_EXISTS,
         413: grpc.StatusCode.INVALID_ARGUMENT, 422: grpc.StatusCode.INVALID_ARGUMENT,
         429: grpc.StatusCode.RESOURCE_EXHAUSTED, 499: grpc.StatusCode.CANCELLED,
         503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}

#: (node ids, exact, seed, timeout_ms, min_version) -> embeddings [n, dim]; raises
#: errors.ServeError
ServeFn = Callable[[np.ndarray, bool, "int | None", "float | None", int], Awaitable[Any]]


def _bad(message: str) -> errors.ServeError:
    return errors.ServeError("invalid_request", message, 400)


class KServeGrpc:
    """The servicer: each RPC is an ``async def (request, context)``."""

    def __init__(self, state: Any, serve: ServeFn, token: str | None) -> None:
        self.state, self.serve = state, serve
        self.expected = f"Bearer {token}" if token else None

    async def ServerLive(self, req: Any, ctx: Any) -> Any:  # noqa: N802 - the RPC's name
        return gp.message("ServerLiveResponse")(live=True)

    async def ServerReady(self, req: Any, ctx: Any) -> Any:  # noqa: N802
        await self._auth(ctx)
        return gp.message("ServerReadyResponse")(ready=self._ready())

    async def ModelReady(self, req: Any, ctx: Any) -> Any:  # noqa: N802
        await self._auth(ctx)
        await self._model(req.name, ctx)
        return gp.message("ModelReadyResponse")(ready=self._ready())

    async def ServerMetadata(self, req: Any, ctx: Any) -> Any:  # noqa: N802
        await self._auth(ctx)
        return gp.message("ServerMetadataResponse")(**SERVER_METADATA)

    async def ModelMetadata(self, req: Any, ctx: Any) -> Any:  # noqa: N802
        await self._auth(ctx)
        await self._model(req.name, ctx)
        dim = self.state.pipeline.out_dim or -1
        return gp.message("ModelMetadataResponse")(
            name=req.name, versions=["1"], platform="pytorch_geometric",
            inputs=[{"name": "node_ids", "datatype": "INT64", "shape": [-1]}],
            outputs=[{"name": "embeddings", "datatype": "FP32", "shape": [-1, dim]}])

    async def ModelInfer(self, req: Any, ctx: Any) -> Any:  # noqa: N802
        await self._auth(ctx)
        await self._model(req.model_name, ctx)
        try:
            ids = _node_ids(req)
            p = req.parameters
            exact = p["exact"].bool_param if "exact" in p else False
            seed = p["seed"].int64_param if "seed" in p else None
            timeout_ms = _number(p["timeout_ms"]) if "timeout_ms" in p else None
            min_version = _integer(p["min_version"], "min_version") if "min_version" in p else 0
            for out in req.outputs:
                if out.name != "embeddings":
                    raise _bad(f"unknown output {out.name!r}; this model has 'embeddings'")
            emb = (await self.serve(ids, exact, seed, timeout_ms, min_version)).numpy()
        except errors.ServeError as exc:
            await ctx.abort(CODES.get(exc.info.status, grpc.StatusCode.INTERNAL), exc.info.message)
        rows = np.ascontiguousarray(emb, dtype="<f4")
        return gp.message("ModelInferResponse")(
            model_name=req.model_name, model_version="1", id=req.id,
            outputs=[{"name": "embeddings", "datatype": "FP32", "shape": list(rows.shape)}],
            raw_output_contents=[rows.tobytes()])

    def _ready(self) -> bool:
        return bool(self.state.pipeline.ready and self.state.pipeline.engines_ready)

    async def _auth(self, ctx: Any) -> None:
        if self.expected is None:
            return
        given = dict(ctx.invocation_metadata() or ()).get("authorization", "")
        if not hmac.compare_digest(given.encode(), self.expected.encode()):
            await ctx.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    async def _model(self, name: str, ctx: Any) -> None:
        served = self.state.cfg.model.name
        if name != served:
            await ctx.abort(grpc.StatusCode.NOT_FOUND,
                            f"no model named {name!r}; this server serves {served!r}")


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


async def start(state: Any, serve: ServeFn, host: str, port: int,
                token: str | None) -> grpc.aio.Server:
    """A grpc.aio server on the running loop, bound to ``host:port``."""
    servicer = KServeGrpc(state, serve, token)
    handlers = {
        rpc: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, rpc), request_deserializer=gp.message(req).FromString,
            response_serializer=gp.message(resp).SerializeToString)
        for rpc, (req, resp) in gp.RPCS.items()}
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(gp.SERVICE, handlers),))
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"gRPC: cannot bind {host}:{port}")
    await server.start()
    log.info("KServe v2 gRPC on %s:%d", host, bound)
    return server

"""The living graph over HTTP (docs/architecture.md, "The living graph"): updates, the graph's
state, compaction.

``POST /v1/graph/edges``, ``POST /v1/graph/nodes``, ``PUT /v1/graph/features`` and
``POST /v1/graph/compact`` are admin routes (``guards.py``); ``GET /v1/graph`` only reads and
is data-plane. Each is one call of ``pipeline.graph_ops`` (the writer in this process, or in the
main process through ``GraphClient``), answered with the writer's dict or its refusal (its
status; a 503 from a full overlay carries ``Retry-After``).

Bodies are decoded by msgspec into typed lists in one C pass and become NumPy arrays in one call
each: a 10k-edge body costs no per-element Python validation. What msgspec refuses is decoded
again by the pydantic models (``schemas.py``, also the OpenAPI schema) to word the 422; they
also accept what strict JSON cannot carry (``NaN``, ``Infinity``, a float beyond float64),
which the writer then refuses with a 400 naming the row. The writer checks what needs the
graph: ids in range, the feature width, finite values, the update's size.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from quiver_serve import errors
from quiver_serve.frontend.bodies import validation_message
from quiver_serve.frontend.schemas import (
    GraphEdgesBody,
    GraphEdgesResponse,
    GraphFeaturesBody,
    GraphNodesBody,
    GraphNodesResponse,
    GraphVersionResponse,
)

GRAPH_PATH = "/v1/graph"
_ADMIN = " (admin: server.admin_token, or loopback clients when none is set)"


class _Edges(msgspec.Struct, forbid_unknown_fields=True):
    add: list[tuple[int, int]] = []
    remove: list[tuple[int, int]] = []
    edge_type: tuple[str, str, str] | None = None


class _Nodes(msgspec.Struct, forbid_unknown_fields=True):
    features: list[list[float]] | None = None
    node_type: str | None = None
    count: int | None = None


class _Features(msgspec.Struct, forbid_unknown_fields=True):
    node_ids: list[int]
    features: list[list[float]]
    node_type: str | None = None


_DECODERS = {cls: msgspec.json.Decoder(cls) for cls in (_Edges, _Nodes, _Features)}


def decode(raw: bytes, fast: type, model: type[BaseModel]) -> Any:
    """The body as ``fast`` (msgspec), else as ``model`` (pydantic), else a 422 naming the
    problems."""
    try:
        return _DECODERS[fast].decode(raw)
    except msgspec.DecodeError:
        pass
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise errors.ServeError("invalid_request", validation_message(exc.errors()), 422) from None


def int_array(values: list[Any], field: str, shape: tuple[int, ...]) -> np.ndarray:
    """int64 ``shape`` (``-1`` for the count) from lists of ints; a 400 names an id past int64."""
    try:
        return np.array(values, dtype=np.int64).reshape(shape)
    except OverflowError:
        flat = np.array(values, dtype=object).reshape(-1)
        bad = min(flat) if min(flat) < 0 else max(flat)
        raise errors.invalid(f"{field}: node id {bad} is out of range (beyond int64)") from None


def float_rows(rows: list[list[float]], field: str, width: int | None) -> np.ndarray:
    """float32 [n, F] from lists of numbers; rows of unequal length get a 422 naming one."""
    if not rows:
        return np.empty((0, width or 0), np.float32)  # the writer words the refusal
    lengths = {len(r) for r in rows}
    if len(lengths) > 1:
        want = width if width in lengths else len(rows[0])
        i = next(i for i, r in enumerate(rows) if len(r) != want)
        raise errors.ServeError("invalid_features", f"{field} row {i} has {len(rows[i])} values; "
                                f"this graph's features have {width or want}", 422)
    # values beyond float32 become inf here: the writer refuses them as it refuses inf
    with np.errstate(over="ignore"):
        return np.array(rows, dtype=np.float32).reshape(len(rows), -1)


def edges_args(raw: bytes) -> tuple[np.ndarray, np.ndarray, Any]:
    """(add, remove, edge_type or None)."""
    body = decode(raw, _Edges, GraphEdgesBody)
    edge_type = None if body.edge_type is None else list(body.edge_type)
    return (int_array(body.add, "add", (-1, 2)), int_array(body.remove, "remove", (-1, 2)),
            edge_type)


def nodes_args(raw: bytes, width: int | None,
               max_rows: int) -> tuple[np.ndarray, str | None]:
    """(feature rows, node_type or None); on a typed graph the writer checks the width, and a
    type without features takes ``count`` (rows of no values), at most ``max_rows``
    (``graph.max_update_edges``, checked here before anything is allocated)."""
    body = decode(raw, _Nodes, GraphNodesBody)
    if body.node_type is not None:
        width = None
    if body.count is not None:
        if body.features is not None or body.count < 1:
            raise errors.ServeError("invalid_request", "give features (one row per new node) "
                                    "or count (a type without features) >= 1, not both", 422)
        if body.count > max_rows:
            raise errors.ServeError("too_many_updates", f"{body.count} nodes in one call; the "
                                    f"limit is {max_rows} (graph.max_update_edges)", 413)
        return np.zeros((body.count, 0), np.float32), body.node_type
    if body.features is None:
        raise errors.ServeError("invalid_request", "features is required (one row per new "
                                "node; count for a type without features)", 422)
    return float_rows(body.features, "features", width), body.node_type


def features_args(raw: bytes, width: int | None) -> tuple[np.ndarray, np.ndarray, str | None]:
    """(node_ids, rows, node_type or None)."""
    body = decode(raw, _Features, GraphFeaturesBody)
    width = None if body.node_type is not None else width
    return (int_array(body.node_ids, "node_ids", (-1,)),
            float_rows(body.features, "features", width), body.node_type)


def _json(result: dict[str, Any], status: int = 200) -> Response:
    return Response(orjson.dumps(result, option=orjson.OPT_SERIALIZE_NUMPY), status_code=status,
                    media_type="application/json")


def _body_doc(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _graph_ops(state: Any) -> Any:
    pipeline = state.pipeline
    if not pipeline.ready:
        raise pipeline.refusal()
    return pipeline.graph_ops


def add_graph_routes(app: FastAPI, state: Any, responses: dict[int | str, Any]) -> None:
    """Register the routes on ``app``; ``responses``: the error bodies to document."""

    @app.post(GRAPH_PATH + "/edges", response_model=GraphEdgesResponse, responses=responses,
              openapi_extra=_body_doc(GraphEdgesBody),
              summary="Add and remove directed edges src -> dst (of edge_type on a typed "
                      "graph)" + _ADMIN)
    async def edges(request: Request) -> Response:
        add, remove, edge_type = edges_args(await request.body())
        return _json(await _graph_ops(state).add_edges(add, remove, edge_type))

    @app.post(GRAPH_PATH + "/nodes", response_model=GraphNodesResponse, responses=responses,
              openapi_extra=_body_doc(GraphNodesBody),
              summary="Append nodes with their feature rows (ids follow the node count)" + _ADMIN)
    async def nodes(request: Request) -> Response:
        rows, node_type = nodes_args(await request.body(), state.pipeline.num_features,
                                     state.cfg.graph.max_update_edges)
        return _json(await _graph_ops(state).add_nodes(rows, node_type))

    @app.put(GRAPH_PATH + "/features", response_model=GraphVersionResponse, responses=responses,
             openapi_extra=_body_doc(GraphFeaturesBody),
             summary="Overwrite the feature rows of existing nodes" + _ADMIN)
    async def features(request: Request) -> Response:
        ids, rows, node_type = features_args(await request.body(), state.pipeline.num_features)
        return _json(await _graph_ops(state).put_features(ids, rows, node_type))

    @app.get(GRAPH_PATH, responses=responses,
             summary="The graph: versions acknowledged and visible per engine core, sizes, "
                     "overlay use, staleness, last compaction")
    async def info() -> Response:
        return _json(await _graph_ops(state).info())

    @app.post(GRAPH_PATH + "/compact", status_code=202, response_model=GraphVersionResponse,
              responses={200: {"model": GraphVersionResponse}, **responses},
              summary="Fold the updates into a new base: 200 when done, 202 when it goes on in "
                      "the background" + _ADMIN)
    async def compact() -> Response:
        result = await _graph_ops(state).compact()
        return _json(result, 200 if result.get("compacted") else 202)

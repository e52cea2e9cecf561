"""Request and response bodies of the HTTP API (they are also the OpenAPI schema at /docs)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

from quiver_serve.engine.client.checks import MAX_VERSION
from quiver_serve.errors import MAX_SEED

#: a JSON number (an int is a float here; NaN and Infinity parse, then are refused with a 400)
Number = Annotated[float, Field(strict=True)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NewNode(_Body):
    """A node embedded as if it were added with these in-edges (it is not added)."""

    features: list[Number] = Field(..., description="its feature row (the graph's feature width; "
                                   "on a typed graph the request's node_type's, [] for a type "
                                   "without features)")
    in_neighbors: list[StrictInt] | dict[str, list[StrictInt]] = Field(
        [], description="ids of existing nodes with an edge into it (repeats are repeated "
        "edges); on a typed graph a map from each relation into its type (\"src__rel__dst\", or "
        "rel when one relation of that name enters the type) to source ids in their own type")


class EmbedBody(_Body):
    """``POST /v1/embed``."""

    node_ids: list[StrictInt] = Field(
        [], description="node ids; repeats allowed; may be omitted or empty when new_nodes are "
        "given")
    exact: StrictBool = Field(False, description="sample every neighbour: equals the full-graph output")
    seed: StrictInt | None = Field(None, ge=0, le=MAX_VERSION, description="sampling seed for a reproducible answer")
    timeout_ms: float | None = Field(
        None, gt=0, description="deadline for this request; may only shorten the server's default"
    )
    min_version: StrictInt = Field(
        0, ge=0, le=MAX_VERSION, description="graph version the answer must see (a version an update returned): "
        "waits, within the deadline, until it is visible (else 504)")
    new_nodes: list[NewNode] | None = Field(
        None, description="inductive: nodes embedded as if added with these in-edges, without "
        "adding them; their rows follow the node_ids rows")
    model: str = Field("", description="the model to ask (GET /v2/repository/index lists them); "
                       "empty: the server's default model")
    version: StrictInt | str | None = Field(
        None, description="pin a version of the model (an integer, or a string of digits); "
        "null: the model's traffic split picks one")
    node_type: str = Field("", max_length=128, description="typed graphs: the node type of "
                           "node_ids (GET /v2/health/ready's engine lists them); empty: the "
                           "graph's only type")

    @field_validator("version")
    @classmethod
    def _positive_version(cls, value: int | str | None) -> int | str | None:
        if value is not None and not (str(value).isascii() and str(value).isdigit()
                                      and 1 <= int(value) <= MAX_VERSION):
            raise ValueError("must be a positive integer, or a string of its digits")
        return value

    @model_validator(mode="after")
    def _something_to_embed(self) -> EmbedBody:
        if not self.node_ids and not self.new_nodes:
            raise ValueError("node_ids: Field required (it may be omitted or empty only when "
                             "new_nodes are given)")
        return self


class EmbedResponse(BaseModel):
    model: str = Field(..., description="the model that computed the rows")
    model_version: str = Field(..., description="its version")
    dim: int
    embeddings: list[list[float]]
    node_type: str | None = Field(None, description="typed graphs: the node type asked for")


class ErrorDetail(BaseModel):
    code: str
    message: str


class ErrorBody(BaseModel):
    error: ErrorDetail


class TensorInput(_Body):
    """KServe v2 input tensor."""

    name: str
    datatype: str
    shape: list[StrictInt]
    data: list[Any] | None = Field(None, description="values; absent when sent as binary data")
    parameters: dict[str, Any] | None = Field(
        None, description="binary tensor extension: binary_data_size (bytes after the JSON header)")


class InferParameters(_Body):
    exact: StrictBool = False
    seed: StrictInt | None = Field(None, ge=0, le=MAX_SEED)
    timeout_ms: float | None = Field(None, gt=0)
    min_version: StrictInt | None = Field(
        None, ge=0, le=MAX_VERSION, description="graph version the answer must see (else 504 at the deadline)")
    node_type: str = Field("", max_length=128, description="typed graphs: the node type of "
                           "node_ids; empty: the graph's only type")


class InferBody(_Body):
    """KServe v2 ``POST /v2/models/{name}/infer``: one input ``node_ids``, INT64, shape [n]."""

    id: str | None = None
    inputs: list[TensorInput] = Field(..., min_length=1, max_length=1)
    outputs: list[dict[str, Any]] | None = None
    parameters: InferParameters | None = None


class TensorOutput(BaseModel):
    name: Literal["embeddings"] = "embeddings"
    datatype: Literal["FP32"] = "FP32"
    shape: list[int]
    data: list[float]


class InferResponse(BaseModel):
    model_name: str
    model_version: str | None = None
    id: str | None = None
    outputs: list[TensorOutput]


# ---- the living graph (docs/architecture.md, "The living graph"): admin routes, but GET /v1/graph
Pair = Annotated[list[StrictInt], Field(min_length=2, max_length=2)]


class GraphEdgesBody(_Body):
    """``POST /v1/graph/edges``: directed edges src -> dst."""

    add: list[Pair] = Field([], description="[[src, dst], ...] to add (a repeat is a second copy)")
    remove: list[Pair] = Field([], description="[[src, dst], ...] to remove (every copy)")
    edge_type: list[str] | None = Field(
        None, min_length=3, max_length=3, description="typed graph: the relation [src, rel, dst] "
        "(ids are the source and destination types' own); optional when it has one")


class GraphEdgesResponse(BaseModel):
    version: int = Field(..., description="the graph version this update is durable in")
    edge_type: list[str] | None = Field(None, description="typed graph: the relation updated")
    added: int
    removed: int = Field(..., description="edge copies removed")
    missing: int = Field(..., description="removals that named no existing edge")


class GraphNodesBody(_Body):
    """``POST /v1/graph/nodes``: append nodes with their feature rows."""

    features: list[list[Number]] | None = Field(None, min_length=1,
                                                description="one row per new node")
    node_type: str | None = Field(None, description="typed graph: the new nodes' type (their "
                                  "ids follow its count)")
    count: int | None = Field(None, ge=1, description="typed graph: how many new nodes of a "
                              "type without features (no rows then)")


class GraphNodesResponse(BaseModel):
    version: int
    node_type: str | None = Field(None, description="typed graph: the new nodes' type")
    node_ids: list[int] = Field(..., description="the new nodes' ids, consecutive, in row order")


class GraphFeaturesBody(_Body):
    """``PUT /v1/graph/features``: overwrite feature rows."""

    node_ids: list[StrictInt] = Field(..., min_length=1)
    features: list[list[Number]] = Field(..., min_length=1, description="one row per node id")
    node_type: str | None = Field(None, description="typed graph: the nodes' type")


class GraphVersionResponse(BaseModel):
    version: int

"""Request and response bodies of the HTTP API (they are also the OpenAPI schema at /docs)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from quiver_serve.errors import MAX_SEED


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EmbedBody(_Body):
    """``POST /v1/embed``."""

    node_ids: list[StrictInt] = Field(..., min_length=1, description="node ids; repeats allowed")
    exact: StrictBool = Field(False, description="sample every neighbour: equals the full-graph output")
    seed: StrictInt | None = Field(None, ge=0, le=MAX_SEED, description="sampling seed for a reproducible answer")
    timeout_ms: float | None = Field(
        None, gt=0, description="deadline for this request; may only shorten the server's default"
    )


class EmbedResponse(BaseModel):
    model: str
    dim: int
    embeddings: list[list[float]]


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

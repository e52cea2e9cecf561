"""KServe v2 over HTTP as KServe and Triton define it: error bodies, and the binary tensor extension.

* Errors on ``/v2`` routes are ``{"error": "<message>"}`` (the status codes are the daemon's);
  ``/v1`` keeps ``{"error": {"code", "message"}}``.
* An infer body is JSON, or (binary tensor extension) a JSON header of
  ``Inference-Header-Content-Length`` bytes followed by the raw tensors in input order, each input
  saying its size in ``parameters.binary_data_size``. A missing Content-Type is taken as JSON.
* Request parameters: ``exact``, ``seed``, ``timeout_ms`` (or Triton's ``timeout`` in
  microseconds), ``min_version`` (the graph version the answer must see) and ``node_type``
  (typed graphs: the type of ``node_ids``). Inductive requests
  (``new_nodes``) are JSON-only, on ``POST /v1/embed``.
* Outputs come back as JSON ``data`` or, when asked (``outputs[i].parameters.binary_data`` or the
  request's ``parameters.binary_data_output``), as raw little-endian bytes after the JSON header,
  with ``parameters.binary_data_size`` and the ``Inference-Header-Content-Length`` header.

The parsing is NumPy on buffers: no Python loop over ids or floats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from pydantic import ValidationError

from quiver_serve import errors
from quiver_serve.frontend.schemas import InferBody

HEADER_LENGTH = "inference-header-content-length"
OCTET_STREAM = "application/octet-stream"
SERVER_METADATA = {"name": "quiver-serve", "version": "0.1.0",
                   "extensions": ["binary_tensor_data"]}
#: request parameters Triton clients send that mean nothing to a stateless model: accepted
IGNORED_PARAMETERS = {"sequence_id", "sequence_start", "sequence_end", "priority"}


def is_kserve(path: str) -> bool:
    return path == "/v2" or path.startswith("/v2/")


def error_payload(path: str, code: str, message: str) -> dict[str, Any]:
    """The error body of ``path``'s protocol."""
    return {"error": message} if is_kserve(path) else {"error": {"code": code, "message": message}}


def _bad(message: str, status: int = 400) -> errors.ServeError:
    return errors.ServeError("invalid_request", message, status)


@dataclass
class InferRequest:
    body: InferBody
    node_ids: np.ndarray  # int64 [n]
    binary_output: bool
    exact: bool
    seed: int | None
    timeout_ms: float | None
    min_version: int = 0
    #: the ``node_type`` parameter (typed graphs; "": the only type)
    node_type: str = ""


def parse_infer(raw: bytes, header_length: str | None) -> InferRequest:
    """One infer request from the raw body (JSON, or JSON header + binary tensors)."""
    json_part, tail = raw, b""
    if header_length is not None:
        if not header_length.isdigit() or int(header_length) > len(raw):
            raise _bad(f"Inference-Header-Content-Length {header_length!r} is not a length within "
                       f"the {len(raw)}-byte body")
        json_part, tail = raw[:int(header_length)], raw[int(header_length):]
    try:
        obj = orjson.loads(json_part)
    except orjson.JSONDecodeError as exc:
        raise _bad(f"malformed JSON body: {exc}", 422) from None
    params = dict(obj.get("parameters") or {}) if isinstance(obj, dict) else {}
    binary_all = bool(params.pop("binary_data_output", False))
    timeout_us = params.pop("timeout", None)
    for key in IGNORED_PARAMETERS:
        params.pop(key, None)
    if isinstance(obj, dict) and "parameters" in obj:
        obj["parameters"] = params or None
    try:
        body = InferBody.model_validate(obj)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ())) or "body"
        raise _bad(f"{where}: {err.get('msg', 'invalid')}", 422) from None
    p = body.parameters
    timeout_ms = p.timeout_ms if p else None
    if timeout_ms is None and isinstance(timeout_us, int | float) and timeout_us > 0:
        timeout_ms = timeout_us / 1000.0  # Triton's request timeout is in microseconds
    return InferRequest(body, _node_ids(body, tail), _binary_output(body, binary_all),
                        p.exact if p else False, p.seed if p else None, timeout_ms,
                        (p.min_version or 0) if p else 0, p.node_type if p else "")


def _node_ids(body: InferBody, tail: bytes) -> np.ndarray:
    tensor = body.inputs[0]
    if tensor.name != "node_ids":
        raise _bad(f"input must be named 'node_ids', got {tensor.name!r}", 422)
    if tensor.datatype.upper() != "INT64":
        raise _bad(f"node_ids must be INT64, got {tensor.datatype}", 422)
    if len(tensor.shape) != 1 or tensor.shape[0] < 1:
        raise _bad(f"node_ids must have shape [n] with n >= 1, got {tensor.shape}", 422)
    n = tensor.shape[0]
    tparams = tensor.parameters or {}
    if any(k.startswith("shared_memory") for k in tparams):
        raise _bad("shared-memory tensors are not supported; send data or binary data")
    size = tparams.get("binary_data_size")
    if size is not None:
        if tensor.data is not None:
            raise _bad("node_ids has both data and binary_data_size")
        if not isinstance(size, int) or size != n * 8 or len(tail) < size:
            raise _bad(f"node_ids binary_data_size {size!r} must be {n * 8} (INT64 [{n}]) and "
                       f"present after the JSON header ({len(tail)} bytes are)")
        return np.frombuffer(tail[:size], dtype="<i8").astype(np.int64, copy=False)
    if tensor.data is None:
        raise _bad("node_ids has neither data nor parameters.binary_data_size", 422)
    try:
        ids = np.asarray(tensor.data).reshape(-1)
    except ValueError:
        raise _bad("node_ids data must be a list of integers", 422) from None
    if ids.dtype.kind not in "iu" or ids.size != n:
        raise _bad(f"node_ids data must be {n} integers (shape {tensor.shape}), got "
                   f"{ids.size} values of type {ids.dtype}", 422)
    return ids.astype(np.int64, copy=False)


def _binary_output(body: InferBody, binary_all: bool) -> bool:
    binary = binary_all
    for out in body.outputs or []:
        if out.get("name") != "embeddings":
            raise _bad(f"unknown output {out.get('name')!r}; this model has 'embeddings'")
        oparams = out.get("parameters") or {}
        if set(oparams) - {"binary_data"}:
            raise _bad(f"output parameters {sorted(set(oparams) - {'binary_data'})} are not "
                       "supported (only binary_data)")
        binary = bool(oparams.get("binary_data", binary_all))
    return binary


def infer_response(model: str, version: int, req: InferRequest,
                   emb: np.ndarray) -> tuple[bytes, dict[str, str]]:
    """Body and headers of the answer: JSON, or JSON header + raw float32 rows; ``model`` and
    ``version`` name the model version that computed them."""
    parts, headers = infer_response_parts(model, version, req, emb)
    return b"".join(parts), headers


def infer_response_parts(model: str, version: int, req: InferRequest,
                         emb: np.ndarray) -> tuple[list[Any], dict[str, str]]:
    """``infer_response`` as the parts to write one after another: a binary answer's rows are
    a view of ``emb`` (no copy when it is float32 and C-ordered already)."""
    rows = np.ascontiguousarray(emb, dtype="<f4")
    out: dict[str, Any] = {"name": "embeddings", "datatype": "FP32", "shape": list(rows.shape)}
    head: dict[str, Any] = {"model_name": model, "model_version": str(version), "outputs": [out]}
    if req.body.id is not None:
        head["id"] = req.body.id
    if req.node_type:
        head["parameters"] = {"node_type": req.node_type}
    if not req.binary_output:
        out["data"] = rows.reshape(-1)
        return [orjson.dumps(head, option=orjson.OPT_SERIALIZE_NUMPY)], \
            {"content-type": "application/json"}
    out["parameters"] = {"binary_data_size": rows.nbytes}
    header = orjson.dumps(head)
    return [header, rows.reshape(-1).view(np.uint8)], {
        "content-type": OCTET_STREAM, "inference-header-content-length": str(len(header))}

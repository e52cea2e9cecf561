"""The daemon's answers, written once for every front-end (FastAPI routes, the hot routes'
functions in ``fastpath.py``, the Ray Serve ingress): the error body of each protocol and the
``/v1/embed`` answer."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import orjson
from fastapi.responses import JSONResponse

from quiver_serve import errors
from quiver_serve.frontend import kserve
from quiver_serve.frontend.bodies import npy_bytes

NPY_MEDIA_TYPE = "application/x-npy"
JSON_MEDIA_TYPE = "application/json"


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None,
                   path: str = "") -> JSONResponse:
    """The error body of the route's protocol (``/v2``: KServe's ``{"error": "<message>"}``;
    else ``{"error": {"code", "message"}}``)."""
    return JSONResponse(kserve.error_payload(path, code, message), status_code=status,
                        headers=headers)


def retry_headers(status: int, retry_after_s: int) -> dict[str, str] | None:
    """``Retry-After`` on the statuses a client should retry (503, 429)."""
    return {"Retry-After": str(retry_after_s)} if status in (503, 429) else None


def serve_error_response(exc: errors.ServeError, retry_after_s: int, path: str = "") -> JSONResponse:
    """A refusal (``errors.ServeError``) as the route's protocol words it; ``Retry-After`` is
    the error's own ``retry_after_s`` when it has one (the graph writer's), else the server's."""
    info = exc.info
    own = getattr(exc, "retry_after_s", None)
    if own is not None:
        retry_after_s = max(int(math.ceil(own)), 0)
    return error_response(info.status, info.code, info.message,
                          retry_headers(info.status, retry_after_s), path)


def wants_npy(accept: str | None) -> bool:
    return accept is not None and NPY_MEDIA_TYPE in accept


def embed_answer(model_name: str, emb: np.ndarray, accept: str | None,
                 version: int = 1, node_type: str = "") -> tuple[bytes, str]:
    """The ``/v1/embed`` answer: body and media type (``.npy`` when the client accepts it, else
    ``{"model", "model_version", "dim", "embeddings"}`` as JSON, NumPy rows serialised without
    ``tolist()``). ``model_name`` and ``version``: the model version that computed the rows."""
    if wants_npy(accept):
        return npy_bytes(emb), NPY_MEDIA_TYPE
    payload: dict[str, Any] = {"model": model_name, "model_version": str(version),
                               "dim": emb.shape[1], "embeddings": emb}
    if node_type:  # typed graphs: the answer names the type asked for
        payload["node_type"] = node_type
    return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY), JSON_MEDIA_TYPE

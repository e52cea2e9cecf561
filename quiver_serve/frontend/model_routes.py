"""KServe v2 model routes, per model and per version (docs/architecture.md, "Outside contracts" and
"Models and versions").

* ``GET /v2/models/{name}`` and ``GET /v2/models/{name}/versions/{version}``: metadata (the
  ready versions, platform, inputs and outputs, and how to rebuild the model in plain PyG); a
  version that is not loaded is a 404.
* ``GET /v2/models/{name}/ready`` and ``.../versions/{version}/ready``: as Triton answers them,
  200 when ready and 400 when not; 404 for an unknown model, and the server's own 503 while it
  is not ready.

``POST /v2/models/{name}/infer`` (the traffic split picks the version) and
``POST /v2/models/{name}/versions/{version}/infer`` (pinned) are the hot routes, answered by
``fastpath.py`` (``app.py`` documents them); the answer names the version that computed it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from quiver_serve.frontend.model_view import parse_version, unready
from quiver_serve.frontend.responses import error_response
from quiver_serve.frontend.schemas import ErrorBody

_MODELS = "/v2/models"


def server_not_ready(state: Any, models: bool = True) -> JSONResponse | None:
    """The 503 answering a readiness probe while the server is not ready (``unready``), else
    None; ``models``: also while no model version is ready to serve."""
    refusal = unready(state, models)
    if refusal is None:
        return None
    return error_response(503, refusal.info.code, refusal.info.message,
                          {"Retry-After": str(state.cfg.server.retry_after_s)}, "/v2/health")


def readiness(state: Any, name: str, version: int | None) -> Response:
    """200 when ``name`` (``version``, or any version) is ready; 400 naming its state when not."""
    view = state.views.current()
    view.model(name)  # 404 for an unknown model, before the server's own readiness
    refused = server_not_ready(state, models=False)  # this model's own state is said below
    if refused is not None:
        return refused
    if not view.is_ready(name, version):
        return error_response(400, "model_not_ready", view.not_ready_message(name, version),
                              path=_MODELS)
    return JSONResponse({"ready": True})


def add_model_routes(app: FastAPI, state: Any) -> None:
    """Register the routes on ``app``."""
    not_found = {404: {"model": ErrorBody}}
    ready_doc = {400: {"model": ErrorBody}, 404: {"model": ErrorBody}, 503: {"model": ErrorBody}}

    @app.get(_MODELS + "/{name}", responses=not_found,
             summary="Model metadata: ready versions, and how to rebuild it in plain PyG")
    async def metadata(name: str) -> dict[str, Any]:
        return state.views.current().metadata(name)  # type: ignore[no-any-return]

    @app.get(_MODELS + "/{name}/versions/{version}", responses={400: {"model": ErrorBody},
                                                                **not_found},
             summary="Metadata of one version (404 when it is not loaded)")
    async def version_metadata(name: str, version: str) -> dict[str, Any]:
        return state.views.current().metadata(name, parse_version(version))  # type: ignore[no-any-return]

    @app.get(_MODELS + "/{name}/ready", responses=ready_doc,
             summary="Model readiness: 200 when a version is ready, 400 when none is")
    async def model_ready(name: str) -> Response:
        return readiness(state, name, None)

    @app.get(_MODELS + "/{name}/versions/{version}/ready", responses=ready_doc,
             summary="Version readiness: 200 when ready, 400 when not (or not loaded)")
    async def version_ready(name: str, version: str) -> Response:
        return readiness(state, name, parse_version(version))

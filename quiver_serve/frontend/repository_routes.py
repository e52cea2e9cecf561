"""The KServe v2 / Triton model-repository extension over HTTP, and the operations its gRPC twins
share (docs/architecture.md, "Models and versions").

* ``POST /v2/repository/index`` (body optional, ``{"ready": bool}``): one row per model version,
  ``{"name", "version", "state", "reason"}`` (``version`` a string, absent for a model with
  none), as ``tritonclient``'s ``get_model_repository_index`` reads it.
* ``POST /v2/repository/models/{name}/load`` (optional ``{"parameters": {"config": "<json>"}}``,
  whose ``version_policy`` and ``traffic`` override the model's config.yaml): 200 ``{}`` once
  the versions are built in every engine core; a failed load answers the cause and the old
  versions keep serving.
* ``POST /v2/repository/models/{name}/unload`` (optional ``{"parameters": {"unload_dependents":
  bool}}``, accepted: a model here has no dependents): 200 ``{}`` once drained.

They are admin routes (``guards.py``). Model files come only from the operator's repository: a
load's ``file:`` parameters are refused, and a model name must be a folder name
(``[A-Za-z0-9_.-]+``, not starting with '.') before anything is asked. Each operation is one call
of ``pipeline.model_ops`` (the model manager of the main process) and is logged with who asked,
what, and what came of it. A load or unload answers once this front-end's view of the models
shows its outcome, so readiness asked right after it agrees.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from quiver_serve import errors
from quiver_serve.frontend.model_view import READY, check_model_name

log = logging.getLogger(__name__)

REPOSITORY = "/v2/repository"
#: longest a load or unload waits for the published model state to show its outcome
VIEW_WAIT_S = 2.0
_CONFIG_KEYS = ("version_policy", "traffic")


def _bad(message: str, code: str = "invalid_request", status: int = 400) -> errors.ServeError:
    return errors.ServeError(code, message, status)


def _model_ops(state: Any, required: bool) -> Any:
    """The pipeline's model manager (None when it has none and ``required`` is False)."""
    pipeline = state.pipeline
    if not pipeline.ready:
        raise pipeline.refusal()
    ops = getattr(pipeline, "model_ops", None)
    if ops is None and required:
        raise errors.ServeError("model_repository_unavailable",
                                "this daemon has no model manager (models are not loadable)", 501)
    return ops


def index_row(row: dict[str, Any]) -> dict[str, Any]:
    """A manager's index row as the protocol writes it (the version a string, or absent)."""
    out: dict[str, Any] = {"name": row["name"]}
    if row.get("version") is not None:
        out["version"] = str(row["version"])
    out["state"] = row.get("state") or ""
    out["reason"] = row.get("reason") or ""
    return out


def load_config(params: dict[str, Any]) -> dict[str, Any] | None:
    """The ``config`` a load's parameters carry (a JSON object, as text or as an object), or
    None; a 400 for model files or any other parameter."""
    for key in params:
        if key.startswith("file:"):
            raise _bad(f"load parameter {key!r} refused: model files come only from the model "
                       "repository on the server", "model_files_refused")
        if key != "config":
            raise _bad(f"unknown load parameter {key!r} (only 'config' is taken)")
    raw = params.get("config")
    if raw is None:
        return None
    config = raw
    if isinstance(raw, str | bytes):
        try:
            config = json.loads(raw)
        except ValueError as exc:
            raise _bad(f"load parameter config is not JSON: {exc}", "invalid_model_config") \
                from None
    if not isinstance(config, dict):
        raise _bad(f"load parameter config must be a JSON object with {' and '.join(_CONFIG_KEYS)}"
                   f", got {type(config).__name__}", "invalid_model_config")
    return config


def check_unload_params(params: dict[str, Any]) -> None:
    for key, value in params.items():
        if key != "unload_dependents":
            raise _bad(f"unknown unload parameter {key!r} (only 'unload_dependents' is taken)")
        if not isinstance(value, bool):
            raise _bad(f"unload parameter unload_dependents must be a bool, got {value!r}")


def _states(result: dict[str, Any]) -> dict[str, str]:
    return {v: str(row.get("state")) for v, row in (result.get("versions") or {}).items()}


async def repository_index(state: Any, ready: bool, who: str) -> list[dict[str, Any]]:
    """The repository index (``ready``: ready versions only)."""
    ops = _model_ops(state, required=False)
    if ops is None:  # no manager: the one configured model
        rows = state.views.current().index_rows(ready)
    else:
        rows = (await ops.call("index", {"ready": ready}))["models"]
    log.info("model repository index (ready %s) by %s: %d rows", ready, who, len(rows))
    return [index_row(r) for r in rows]


async def load_model(state: Any, name: str, params: dict[str, Any], who: str) -> dict[str, Any]:
    """Load (or reload) ``name`` per its config.yaml and the request's config."""
    check_model_name(name)
    config = load_config(params)
    ops = _model_ops(state, required=True)
    what = f"model load {name} (config {json.dumps(config) if config else 'none'})"
    try:
        result: dict[str, Any] = await ops.call("load", {"name": name, "config": config})
    except errors.ServeError as exc:
        log.warning("%s by %s refused (%d %s): %s", what, who, exc.info.status, exc.info.code,
                    exc.info.message)
        raise
    log.info("%s by %s -> versions %s, traffic %s", what, who, _states(result),
             result.get("traffic"))
    await await_view(state, name, result)
    return result


async def unload_model(state: Any, name: str, params: dict[str, Any],
                       who: str) -> dict[str, Any]:
    """Unload every version of ``name`` (they drain first)."""
    check_model_name(name)
    check_unload_params(params)
    ops = _model_ops(state, required=True)
    try:
        result: dict[str, Any] = await ops.call("unload", {"name": name})
    except errors.ServeError as exc:
        log.warning("model unload %s by %s refused (%d %s): %s", name, who, exc.info.status,
                    exc.info.code, exc.info.message)
        raise
    log.info("model unload %s by %s -> versions %s", name, who, _states(result))
    await await_view(state, name, result)
    return result


async def await_view(state: Any, name: str, result: dict[str, Any],
                     timeout_s: float = VIEW_WAIT_S) -> bool:
    """Wait (bounded) until this front-end's published view has the READY versions ``result``
    says ``name`` has; True when it does (or nothing is published to wait for)."""
    want = {v for v, s in _states(result).items() if s == READY}
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while True:
        view = state.views.current()
        if not view.published:
            return True
        entry = (view.state.get("models") or {}).get(name) or {}
        have = {v for v, row in (entry.get("versions") or {}).items()
                if row.get("state") == READY}
        if have == want:
            return True
        if loop.time() >= end:
            log.warning("model %s: the published state still shows ready versions %s, not %s",
                        name, sorted(have), sorted(want))
            return False
        await asyncio.sleep(0.01)


def _object(raw: bytes, allowed: set[str]) -> dict[str, Any]:
    """An optional JSON object body with only ``allowed`` keys (empty body: ``{}``)."""
    if not raw.strip():
        return {}
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _bad(f"malformed JSON body: {exc}", status=422) from None
    if not isinstance(obj, dict):
        raise _bad(f"the body must be a JSON object, got {type(obj).__name__}", status=422)
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise _bad(f"unknown field(s) {unknown}; this route takes {sorted(allowed)}", status=422)
    return obj


def _parameters(raw: bytes) -> dict[str, Any]:
    params = _object(raw, {"parameters"}).get("parameters") or {}
    if not isinstance(params, dict):
        raise _bad("parameters must be a JSON object", status=422)
    return params


def who(request: Request) -> str:
    client = request.client
    return f"{client.host}:{client.port}" if client else "unknown peer"


def _json(payload: Any) -> Response:
    return Response(orjson.dumps(payload), media_type="application/json")


_ADMIN = " (admin: server.admin_token, or loopback clients when none is set)"


def add_repository_routes(app: FastAPI, state: Any, responses: dict[int | str, Any]) -> None:
    """Register the routes on ``app``; ``responses``: the error bodies to document."""

    @app.post(REPOSITORY + "/index", responses=responses,
              summary="Model repository index: every model version, its state and why" + _ADMIN)
    async def index(request: Request) -> Response:
        ready = _object(await request.body(), {"ready"}).get("ready", False)
        if not isinstance(ready, bool):
            raise _bad(f"ready must be a bool, got {ready!r}", status=422)
        return _json(await repository_index(state, ready, who(request)))

    @app.post(REPOSITORY + "/models/{name}/load", responses=responses,
              summary="Load or reload a model from the repository (parameters.config: JSON "
                      "with version_policy and traffic)" + _ADMIN)
    async def load(name: str, request: Request) -> Response:
        check_model_name(name)
        await load_model(state, name, _parameters(await request.body()), who(request))
        return _json({})

    @app.post(REPOSITORY + "/models/{name}/unload", responses=responses,
              summary="Unload every version of a model (drained first)" + _ADMIN)
    async def unload(name: str, request: Request) -> Response:
        check_model_name(name)
        await unload_model(state, name, _parameters(await request.body()), who(request))
        return _json({})

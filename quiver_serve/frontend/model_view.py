"""The models a front-end serves, as its routes see them (docs/architecture.md, "Models and
versions").

:class:`ModelView` is one look at ``pipeline.models_state``, the state the engine side publishes
about ten times a second::

    {"default": name, "models": {name: {"platform", "class", "kwargs", "num_layers", "fanouts",
                                        "versions": {"1": {"state", "reason", "dim", "traffic",
                                                           "state_dict"}}}}}

Until that state exists (the engine cores are not up, or a pipeline that publishes none) the view
is the ``model:`` config section as version 1 of ``model.name``. The routes stay thin: names
resolve here (404 naming the models served), versions are parsed here (400), and the KServe
metadata, readiness and repository-index rows are built here.

Requests are not checked against a published view: the engine cores answer an unknown model or
version themselves (the view may be ~100 ms behind a load). Only the config view, whose engine
knows a single model, is checked at the door (:meth:`ModelView.submit_target`).
"""

from __future__ import annotations

import re
import time
from typing import Any

from quiver_serve import errors
from quiver_serve.config import ServeConfig
from quiver_serve.models.served import model_metadata

PLATFORM = "pytorch_geometric"
READY = "READY"
#: a model name in a URL: what a repository folder may be called (no '/', no leading '.')
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
#: a version in a URL or a body: a positive integer that fits int64
_MAX_VERSION = 2**63 - 1


def check_model_name(name: str) -> str:
    """``name`` when it can name a repository model, else a 400 (before any lookup)."""
    if not _NAME.fullmatch(name) or name.startswith("."):
        raise errors.ServeError(
            "invalid_model_name", f"invalid model name {name!r}: use letters, digits, '_', '.' "
            "and '-', not starting with '.'", 400)
    return name


def parse_version(raw: Any) -> int:
    """A version from a URL, a body or a gRPC field (an int, or a string of digits) >= 1."""
    text = raw if isinstance(raw, str) else None
    value = int(text) if text is not None and text.isascii() and text.isdigit() else raw
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_VERSION:
        raise errors.ServeError("invalid_model_version",
                                f"invalid model version {raw!r}: a positive integer", 400)
    return value


def _version_key(version: str) -> tuple[int, str]:
    return (int(version), version) if version.isdigit() else (_MAX_VERSION, version)


#: how long a front-end answers from one view of the models before it looks again
VIEW_TTL_S = 0.05


class ModelView:
    """The published models (or the config's one model): names, versions, readiness, metadata."""

    def __init__(self, state: dict[str, Any], published: bool,
                 num_features: int | None = None) -> None:
        self.state = state
        #: True when ``state`` came from the engine side (requests name models there)
        self.published = published
        self.num_features = num_features

    @property
    def default(self) -> str:
        return str(self.state.get("default") or next(iter(self.names), ""))

    @property
    def names(self) -> list[str]:
        return list(self.state.get("models") or {})

    def model(self, name: str) -> dict[str, Any]:
        """The entry of ``name``; a 404 naming the models served when there is none."""
        entry = (self.state.get("models") or {}).get(name)
        if entry is None:
            served = ", ".join(repr(n) for n in self.names) or "no model"
            raise errors.ServeError("model_not_found",
                                    f"no model named {name!r}; this server serves {served}", 404)
        return entry  # type: ignore[no-any-return]

    def versions(self, name: str) -> dict[str, dict[str, Any]]:
        return dict(sorted((self.model(name).get("versions") or {}).items(),
                           key=lambda kv: _version_key(kv[0])))

    def ready_versions(self, name: str) -> list[str]:
        return [v for v, row in self.versions(name).items() if row.get("state") == READY]

    def version(self, name: str, version: int) -> dict[str, Any]:
        """The row of a READY ``version`` of ``name``; 404 when it is not loaded (or not ready)."""
        row = self.versions(name).get(str(version))
        if row is None or row.get("state") != READY:
            raise errors.ServeError("model_version_not_found", self.not_ready_message(
                name, version), 404)
        return row

    def is_ready(self, name: str, version: int | None = None) -> bool:
        """A READY version of ``name`` (``version``, or any); raises 404 for an unknown model."""
        ready = self.ready_versions(name)
        return bool(ready) if version is None else str(version) in ready

    def not_ready_message(self, name: str, version: int | None = None) -> str:
        rows = self.versions(name)
        if version is None:
            states = ", ".join(f"{v}: {r.get('state')}" for v, r in rows.items()) or "none loaded"
            return f"model {name!r} has no ready version (versions {states})"
        row = rows.get(str(version))
        if row is None:
            loaded = ", ".join(rows) or "none"
            return f"model {name!r} has no version {version} loaded (versions: {loaded})"
        reason = f": {row['reason']}" if row.get("reason") else ""
        return f"model {name!r} version {version} is {row.get('state')}{reason}"

    def dim(self, name: str, version: int | None = None) -> int:
        """The width of the rows ``version`` answers (any ready version's when they agree)."""
        rows = [self.version(name, version)] if version is not None else [
            self.versions(name)[v] for v in self.ready_versions(name)]
        dims = {int(r["dim"]) for r in rows if r.get("dim")}
        return dims.pop() if len(dims) == 1 else -1

    def metadata(self, name: str, version: int | None = None) -> dict[str, Any]:
        """KServe v2 model metadata, with how to rebuild the model in plain PyG
        (``parameters``); for a ``version``, that version's (404 when it is not loaded)."""
        entry = self.model(name)
        ready = self.ready_versions(name)
        if version is not None:
            row, shown = self.version(name, version), [str(version)]
        else:  # the newest ready version describes the model
            row, shown = (self.versions(name)[ready[-1]] if ready else {}), ready
        kwargs = dict(entry.get("kwargs") or {})
        in_channels = entry.get("in_channels") or self.num_features
        if in_channels and "in_channels" not in kwargs:
            kwargs["in_channels"] = in_channels
        return {
            "name": name, "versions": shown,
            "platform": entry.get("platform") or PLATFORM,
            "inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [-1]}],
            "outputs": [{"name": "embeddings", "datatype": "FP32",
                         "shape": [-1, self.dim(name, version)]}],
            "parameters": {
                "pyg_model": {"class": entry.get("class"), "kwargs": kwargs},
                "state_dict": row.get("state_dict"),
                "num_layers": entry.get("num_layers"), "fanouts": entry.get("fanouts"),
                "traffic": {v: self.versions(name)[v].get("traffic") for v in ready}},
        }

    def index_rows(self, ready_only: bool = False) -> list[dict[str, Any]]:
        """Repository-index rows (name, version, state, reason) of the models in this view."""
        return [{"name": name, "version": int(v), "state": row.get("state", ""),
                 "reason": row.get("reason", "")}
                for name in self.names for v, row in self.versions(name).items()
                if not ready_only or row.get("state") == READY]

    def submit_target(self, model: str, version: int) -> tuple[str, int]:
        """The ``model`` and ``version`` to submit a request with. A published view passes
        them on (the engine cores answer unknown ones); the config view checks them here, as
        its engine serves one model, version 1, whatever a request names."""
        if self.published:
            return model, version
        if model:
            self.model(model)
        if version:
            self.version(model or self.default, version)
        return "", 0


def unready(state: Any, models: bool = True) -> errors.ServeError | None:
    """Why the server is not ready, the same for HTTP and gRPC readiness: starting up (or its
    start failed), draining, no engine core ready, or (``models``) no model version ready to
    serve, since every model is unloaded or loading; None when it is ready."""
    pipeline = state.pipeline
    if not pipeline.ready or not pipeline.engines_ready:
        refusal = pipeline.refusal() if not pipeline.ready else errors.unavailable(
            "engines_not_ready", "no engine core is ready (restarting after a failure)")
        if state.start_error:
            return errors.unavailable(refusal.info.code, "start-up failed")
        return refusal
    if models:
        view = state.views.current()
        if not any(view.ready_versions(name) for name in view.names):
            return errors.unavailable("no_model_ready", "no model version is ready to serve "
                                      "(every model is unloaded or loading; load one through "
                                      "/v2/repository/models/{name}/load)")
    return None


class Views:
    """The current :class:`ModelView` of one front-end: its pipeline's published state, else
    (kept until the pipeline's sizes change) its config's ``model:`` section."""

    def __init__(self, cfg: ServeConfig, pipeline: Any) -> None:
        self.cfg, self.pipeline = cfg, pipeline
        self._config: tuple[tuple[Any, Any], ModelView] | None = None
        self._view: ModelView | None = None
        self._fresh_until_s = 0.0

    def current(self, cached: bool = False) -> ModelView:
        """The models as this front-end sees them; ``cached`` (the hot routes): the view of
        at most ``VIEW_TTL_S`` ago, so a request costs no rebuild (the main process publishes
        its state about ten times a second)."""
        now_s = time.monotonic()
        view = self._view
        if view is not None and cached and now_s < self._fresh_until_s:
            return view
        pipeline = self.pipeline
        published = getattr(pipeline, "models_state", None)
        if published:
            if view is None or view.state is not published:
                view = ModelView(published, True, pipeline.num_features)
        else:
            key = (pipeline.out_dim, pipeline.num_features)
            if self._config is None or self._config[0] != key:
                self._config = (key, ModelView(config_state(self.cfg, *key), False, key[1]))
            view = self._config[1]
        self._view, self._fresh_until_s = view, now_s + VIEW_TTL_S
        return view


def config_state(cfg: ServeConfig, out_dim: int | None,
                 num_features: int | None) -> dict[str, Any]:
    """The ``model:`` config section in the published state's shape (version 1, ready)."""
    model = cfg.model
    meta = model_metadata(model, num_features or model.kwargs.get("in_channels", -1))
    dim = out_dim or model.kwargs.get("out_channels", -1)
    return {"default": model.name, "models": {model.name: {
        "platform": PLATFORM, "class": meta["pyg_model"]["class"],
        "kwargs": meta["pyg_model"]["kwargs"], "num_layers": model.num_layers,
        "fanouts": list(cfg.sampling.fanouts),
        "versions": {"1": {"state": READY, "reason": "", "dim": dim, "traffic": 1.0,
                           "state_dict": meta["state_dict"]}}}}}

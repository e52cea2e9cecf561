"""Every environment variable quiver-serve reads, typed, in one place (vLLM's ``envs.py`` style).

Read one as ``envs.QUIVER_SERVE_CACHE``: each read parses ``os.environ`` at that moment (no value
is cached at import), so a variable exported before a child is spawned, or set by a test's
``monkeypatch.setenv``, is what the reader sees. ``read(name, environ)`` parses the same
variable from another mapping (``ServeConfig.load(environ=...)``). The table is also the
reference: ``describe()`` lists name, type, default and doc of each.

This module imports nothing from quiver_serve (rank 0 of tests/test_layers.py): every layer may
read it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what ``envs.<name>`` returns, for type checkers
    QUIVER_SERVE_CONFIG: str | None
    QUIVER_SERVE_TOKEN: str | None
    QUIVER_SERVE_ADMIN_TOKEN: str | None
    QUIVER_SERVE_CACHE: Path
    QUIVER_SERVE_GRAPH_STATE: Path
    QUIVER_SERVE_DISABLE_CPP: bool
    PROMETHEUS_MULTIPROC_DIR: str | None
    CXX: str

#: ``QUIVER_SERVE__<SECTION>__<KEY>=<YAML value>`` sets one config field (``config_overrides``)
OVERRIDE_PREFIX = "QUIVER_SERVE__"


@dataclass(frozen=True)
class EnvVar:
    """One variable: its type (as text, for the reference), its parser and what it does."""

    type: str
    default: str
    doc: str
    parse: Callable[[str | None], Any]


def _text_or_none(raw: str | None) -> str | None:
    return raw or None  # set but empty means unset (a shell's ``X= cmd``)


def _flag(raw: str | None) -> bool:
    return raw not in (None, "", "0")


def _cache_root(raw: str | None) -> Path:
    return Path(raw) if raw else Path.home() / ".cache" / "quiver_serve"


def _graph_state_root(raw: str | None) -> Path:
    return Path(raw).expanduser() if raw else _cache_root(os.environ.get("QUIVER_SERVE_CACHE")) / "graphs"


def _compiler(raw: str | None) -> str:
    return raw or "c++"


VARIABLES: dict[str, EnvVar] = {
    "QUIVER_SERVE_CONFIG": EnvVar(
        "str | None", "unset", "the YAML config ``quiver-serve`` (``python server.py``) loads when "
        "--config is not given (else the embedded default, quiver_serve/defaults/default.yaml)",
        _text_or_none),
    "QUIVER_SERVE_TOKEN": EnvVar(
        "str | None", "unset", "bearer token every endpoint but liveness requires; wins over "
        "server.auth_token (keeps the secret out of YAML)", _text_or_none),
    "QUIVER_SERVE_CACHE": EnvVar(
        "Path", "~/.cache/quiver_serve", "root of the on-disk caches: the C++ sampler's build "
        "(ext/), PSGS tables (psgs/) and cost-model calibrations (costs/)", _cache_root),
    "QUIVER_SERVE_ADMIN_TOKEN": EnvVar(
        "str | None", "unset", "bearer token of the admin routes (graph updates, compaction, "
        "feature re-placement); wins over server.admin_token", _text_or_none),
    "QUIVER_SERVE_GRAPH_STATE": EnvVar(
        "Path", "$QUIVER_SERVE_CACHE/graphs", "root of the default update-log folders (one per "
        "graph: its write-ahead log and compacted bases) when graph.update_log_dir is null",
        _graph_state_root),
    "QUIVER_SERVE_DISABLE_CPP": EnvVar(
        "bool", "0", "any value but empty or 0: never build or load the C++ CPU sampler; the "
        "pure-torch reference serves (same output)", _flag),
    "PROMETHEUS_MULTIPROC_DIR": EnvVar(
        "str | None", "unset", "prometheus_client's multiprocess directory; unset: the daemon "
        "makes one and exports it to every child it spawns", _text_or_none),
    "CXX": EnvVar(
        "str", "c++", "the C++ compiler the CPU sampler's first-use build runs", _compiler),
}


def read(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """Variable ``name`` parsed from ``environ`` (default: this process's environment now)."""
    env = os.environ if environ is None else environ
    return VARIABLES[name].parse(env.get(name))


def config_overrides(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every ``QUIVER_SERVE__<SECTION>__<KEY>`` variable, by name (raw YAML text)."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if k.startswith(OVERRIDE_PREFIX)}


def describe() -> str:
    """The reference: one markdown row per variable (name, type, default, doc)."""
    rows = ["| variable | type | default | description |", "|---|---|---|---|"]
    rows += [f"| `{n}` | `{v.type}` | `{v.default}` | {v.doc} |" for n, v in VARIABLES.items()]
    rows.append(f"| `{OVERRIDE_PREFIX}<SECTION>__<KEY>` | YAML | unset | sets one config field, "
                f"e.g. `{OVERRIDE_PREFIX}SERVER__PORT=8080` |")
    return "\n".join(rows)


def __getattr__(name: str) -> Any:
    if name in VARIABLES:
        return read(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *VARIABLES])

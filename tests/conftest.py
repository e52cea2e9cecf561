"""Shared fixtures: Cora, small configs, and a real server process on a free port.

The daemon harness is ``loadtest/harness.py`` (shared with the benches and drills):
``ServerProcess`` is its ``Daemon``, ``free_port`` its own."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from loadtest.harness import Daemon, config_yaml, free_port
from quiver_serve.config import DEFAULTS_DIR, ServeConfig
from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.datasets import load_planetoid_raw

# Update logs of the daemons and pipelines tests start go to a folder of this session, never to
# the user's (a graph updated by hand must not change what tests serve); tests that update a
# graph give each daemon its own graph.update_log_dir.
os.environ.setdefault("QUIVER_SERVE_GRAPH_STATE", tempfile.mkdtemp(prefix="quiver-graph-state-"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cora() -> GraphData:
    return load_planetoid_raw(DEFAULTS_DIR / "planetoid" / "cora" / "raw", "cora")


def small_config(**overrides: object) -> ServeConfig:
    """The default config with test-friendly limits; ``section__field=value`` overrides."""
    cfg = ServeConfig.default()
    cfg.server.start_timeout_s = 120.0
    cfg.server.http_workers = 1  # the same process layout on every machine (tests of several: test_frontends)
    # each daemon its own update log: updates one test makes (the schema fuzzer's included)
    # never reach another test's graph
    cfg.graph.update_log_dir = tempfile.mkdtemp(prefix="quiver-log-")
    for key, value in overrides.items():
        section, field = key.split("__")
        setattr(getattr(cfg, section), field, value)
    return cfg


_IMPORT_S: list[float] = []


def restart_bound_s(base_s: float = 5.0, assumed_import_s: float = 2.0) -> float:
    """How soon a killed worker must be serving again when its restart may be a fresh spawn (a
    server in another process, whose standby the test cannot see warm up): ``base_s`` (5 s),
    which assumed ~2 s for the new process to import torch and PyG, plus whatever this machine
    takes beyond that: 5.9-6.2 s on one 2-core box (torch 2.3 s, PyG's import of
    ``torch._dynamo`` 2.1 s under ``-X importtime``). Measured once per test session. Where the
    test can wait for the warm standby (``wait_standby_warm``) it asserts the plain 5 s."""
    if not _IMPORT_S:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch, torch_geometric"], check=True,
                       timeout=120)
        _IMPORT_S.append(time.perf_counter() - t0)
    return base_s + max(0.0, _IMPORT_S[0] - assumed_import_s)


def wait_standby_warm(pipeline: object, timeout_s: float = 90.0) -> None:
    """Until the daemon's warm standby (``engine/procs/standby.py``) has done its imports: a kill
    before that is served by a process still importing, as slow as a fresh spawn."""
    standby = pipeline.supervisor.standby  # type: ignore[attr-defined]
    end = time.monotonic() + timeout_s
    while standby.size and standby.warm() < 1:
        assert time.monotonic() < end, "the standby process never finished its imports"
        time.sleep(0.05)


#: ``python server.py`` in its own process group, killed whole at the end (the shared harness)
ServerProcess = Daemon


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The embedded default config served by the real daemon."""
    tmp = tmp_path_factory.mktemp("server")
    cfg = small_config()
    cfg.server.max_request_nodes = 512
    path = tmp / "config.yaml"
    path.write_text(_to_yaml(cfg))
    srv = ServerProcess(path, free_port(), tmp / "server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _to_yaml(cfg: ServeConfig) -> str:
    return config_yaml(cfg)


def start_server(tmp: Path, env: dict[str, str] | None = None,
                 **overrides: object) -> tuple[ServerProcess, ServeConfig]:
    """The real daemon on a free port with ``small_config(**overrides)`` (not yet ready);
    ``env``: extra environment of the daemon only (this process keeps its own)."""
    cfg = small_config(**overrides)
    path = tmp / "config.yaml"
    path.write_text(_to_yaml(cfg))
    return ServerProcess(path, free_port(), tmp / "server.log", env=env), cfg

"""Shared fixtures: Cora, small configs, and a real server process on a free port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from quiver_serve.config import REPO_ROOT, ServeConfig, resolve_path
from quiver_serve.engine.process import stop_process_group
from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.datasets import load_planetoid_raw


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cora() -> GraphData:
    return load_planetoid_raw(resolve_path("data/planetoid/cora/raw"), "cora")


def small_config(**overrides: object) -> ServeConfig:
    """The default config with test-friendly limits; ``section__field=value`` overrides."""
    cfg = ServeConfig.default()
    cfg.server.start_timeout_s = 120.0
    cfg.server.http_workers = 1  # the same process layout on every machine (tests of several: test_frontends)
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
    """Until the daemon's warm standby (``engine/standby.py``) has done its imports: a kill
    before that is served by a process still importing, as slow as a fresh spawn."""
    standby = pipeline.supervisor.standby  # type: ignore[attr-defined]
    end = time.monotonic() + timeout_s
    while standby.size and standby.warm() < 1:
        assert time.monotonic() < end, "the standby process never finished its imports"
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """``python server.py`` in its own process group, killed whole at the end."""

    def __init__(self, config_path: Path, port: int, log_path: Path) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO_ROOT / "server.py"), "--config", str(config_path),
             "--port", str(port)],
            cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def wait_ready(self, timeout_s: float = 180.0, headers: dict[str, str] | None = None) -> None:
        """Until /v2/health/ready answers 200 (``headers``: e.g. the bearer token it needs)."""
        import httpx

        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log()}")
            try:
                if httpx.get(self.url + "/v2/health/ready", headers=headers,
                             timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready in {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def group_pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-g", str(self.proc.pid)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def stop(self) -> None:
        stop_process_group(self.proc, grace_s=15)
        self._log.close()


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
    import yaml

    return yaml.safe_dump(cfg.model_dump(mode="json"))


def start_server(tmp: Path, env: dict[str, str] | None = None,
                 **overrides: object) -> tuple[ServerProcess, ServeConfig]:
    """The real daemon on a free port with ``small_config(**overrides)``; ``env`` is set only
    while it is spawned (the server inherits it, this process keeps its own)."""
    cfg = small_config(**overrides)
    path = tmp / "config.yaml"
    path.write_text(_to_yaml(cfg))
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        srv = ServerProcess(path, free_port(), tmp / "server.log")
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return srv, cfg

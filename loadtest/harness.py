"""The one daemon harness: ``server.py`` (or another server script) as a subprocess in its own
process group, on a free loopback port, with a config file and ``section.key`` overrides.

Used by the tests (``tests/conftest.py``), the benches (``bench/``) and the drills
(``loadtest/faults.py``, ``loadtest/soak.py``)::

    with Daemon(config_path, overrides={"server.http_workers": 2}) as d:   # ready on entry
        httpx.post(d.url + "/v1/embed", json={"node_ids": [1]})
    # stopped on exit: SIGTERM (the daemon drains), then SIGKILL to the whole group

The log goes to a file (``log_path``, else a temporary one that is kept); ``log()`` is its tail,
and a daemon that dies or is not ready in time raises with that tail. Imports nothing heavy (no
torch): the drills run it beside the daemon on small boxes.

The benches build a graph once (:func:`save_graph`), write the config of each daemon they start
over it (:func:`serve_config`), and start the PyG-style baseline the same way
(:func:`baseline_daemon`: ``bench/frontdoor/baseline_server.py``). A :class:`Session` holds a
run's scratch folder and stops what it started, whatever ends the run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
READY_PATH = "/v2/health/ready"
ENV_PREFIX = "QUIVER_SERVE__"  # the daemon's environment overrides: QUIVER_SERVE__SECTION__KEY
POLL_S = 0.2


def free_port() -> int:
    """A TCP port free on loopback now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config_yaml(cfg: Any) -> str:
    """A ``ServeConfig`` (or a plain dict) as the YAML ``server.py --config`` reads."""
    import yaml

    data = cfg.model_dump(mode="json") if hasattr(cfg, "model_dump") else dict(cfg)
    return yaml.safe_dump(data)


def override_env(overrides: Mapping[str, object] | None) -> dict[str, str]:
    """``{"server.http_workers": 2}`` -> ``{"QUIVER_SERVE__SERVER__HTTP_WORKERS": "2"}``."""
    out = {}
    for key, value in (overrides or {}).items():
        section, _, field = key.partition(".")
        if not field:
            raise ValueError(f"override {key!r}: expected section.key")
        text = json.dumps(value) if isinstance(value, (list, dict, bool)) or value is None \
            else str(value)
        out[f"{ENV_PREFIX}{section.upper()}__{field.upper()}"] = text
    return out


def child_env(env: Mapping[str, str | None] | None, cwd: Path) -> dict[str, str]:
    """This process's environment for the daemon: ``env`` on top (None unsets a variable), the
    checkout first on PYTHONPATH, and no inherited PROMETHEUS_MULTIPROC_DIR (each daemon makes
    its own) unless ``env`` names one."""
    out = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    for key, value in (env or {}).items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(cwd), out.get("PYTHONPATH")]))
    return out


class Daemon:
    """One server subprocess in its own process group, killed whole by ``stop()``.

    ``command``: what follows the interpreter (default ``server.py``; e.g. ``("-m",
    "bench.frontdoor.baseline_server")``); ``--config`` (when given) and ``--port`` are added,
    then ``args``. ``cwd``: the checkout it runs from (another one: an A/B of two versions).
    ``ready_path``: the route that answers 200 once it serves; None for a server that speaks no
    HTTP/1.1 (a bare gRPC endpoint): ready once its port accepts a connection.
    """

    def __init__(self, config_path: Path | str | None = None, port: int | None = None,
                 log_path: Path | str | None = None, *, command: Sequence[str] = ("server.py",),
                 args: Sequence[str] = (), env: Mapping[str, str | None] | None = None,
                 overrides: Mapping[str, object] | None = None, cwd: Path | str = REPO_ROOT,
                 name: str = "quiver-serve", grace_s: float = 15.0,
                 ready_timeout_s: float = 180.0, python: str = sys.executable,
                 ready_path: str | None = READY_PATH) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name, self.grace_s, self.ready_timeout_s = name, grace_s, ready_timeout_s
        self.ready_path = ready_path
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="quiver-daemon-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        argv = [python, *command]
        if config_path is not None:
            argv += ["--config", str(config_path)]
        argv += ["--port", str(self.port), *args]
        self.argv = argv
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            argv, cwd=cwd, env=child_env({**override_env(overrides), **(env or {})}, Path(cwd)),
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout_s: float | None = None,
                   headers: Mapping[str, str] | None = None) -> float:
        """Until ``ready_path`` answers 200 (``headers``: e.g. the bearer token it needs) or,
        without one, the port accepts a connection; returns the seconds from start. Raises with
        the log's tail if the process exits or the deadline passes."""
        timeout_s = self.ready_timeout_s if timeout_s is None else timeout_s
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.log()}")
            if self._ready(headers):
                return time.monotonic() - self.started_at
            time.sleep(POLL_S)
        raise TimeoutError(f"{self.name} not ready in {timeout_s:.0f} s:\n{self.log()}")

    def _ready(self, headers: Mapping[str, str] | None) -> bool:
        if self.ready_path is None:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1.0).close()
                return True
            except OSError:
                return False
        req = urllib.request.Request(self.url + self.ready_path, headers=dict(headers or {}))
        try:
            with urllib.request.urlopen(req, timeout=1.0) as r:  # noqa: S310 - loopback
                return r.status == 200
        except (OSError, urllib.error.HTTPError):
            return False

    def get_json(self, path: str, timeout_s: float = 10.0,
                 headers: Mapping[str, str] | None = None) -> Any:
        """GET ``path`` (e.g. ``/v1/workers``) and decode its JSON answer."""
        req = urllib.request.Request(self.url + path, headers=dict(headers or {}))
        with urllib.request.urlopen(req, timeout=timeout_s) as r:  # noqa: S310 - loopback
            return json.loads(r.read())

    def log(self, n_chars: int = 4000) -> str:
        """The last ``n_chars`` of the daemon's log."""
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-n_chars:]

    def group_pids(self) -> list[int]:
        """Every live process of the daemon's group (itself and its children)."""
        out = subprocess.run(["pgrep", "-g", str(self.proc.pid)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM (the daemon drains), then SIGKILL to the whole group after ``grace_s``."""
        grace_s = self.grace_s if grace_s is None else grace_s
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(timeout=10)
        if not self._log.closed:
            self._log.close()

    def __enter__(self) -> Daemon:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_daemon(cfg: Any, folder: Path | str, **kwargs: Any) -> Daemon:
    """``cfg`` (a ``ServeConfig`` or dict) written to ``folder/config.yaml``, served by a
    ``Daemon`` logging to ``folder/server.log`` (not yet ready: ``wait_ready`` or ``with``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(config_yaml(cfg))
    kwargs.setdefault("log_path", folder / "server.log")
    return Daemon(path, **kwargs)


def save_graph(cfg: Any, folder: Path) -> tuple[Any, Path]:
    """The graph of ``cfg`` built once and saved as an uncompressed ``folder/graph.npz``
    (indptr, indices, x) that every daemon of a run loads (no generation per start)."""
    import numpy as np

    from quiver_serve.graph.datasets import load_graph

    t0 = time.perf_counter()
    graph = load_graph(cfg.graph)
    path = Path(folder) / "graph.npz"
    np.savez(path, indptr=graph.indptr.numpy(), indices=graph.indices.numpy(), x=graph.x.numpy())
    print(f"graph: {graph.describe()}; built and saved in {time.perf_counter() - t0:.1f} s "
          f"({path.stat().st_size / 2**20:,.0f} MiB)", flush=True)
    return graph, path


def saved_graph_facts(cfg: Any, folder: Path) -> tuple[Path, dict[str, Any]]:
    """:func:`save_graph`, keeping only what load and updater processes need of the graph
    (the daemons load their own copies from the .npz)."""
    graph, npz = save_graph(cfg, folder)
    facts = {"num_nodes": graph.num_nodes, "indptr": graph.indptr.numpy().copy(),
             "model": cfg.model.name, "graph": graph.describe()}
    return npz, facts


def serve_config(cfg: Any, npz: Path, folder: Path, name: str = "serve",
                 fields: Mapping[str, object] | None = None) -> Path:
    """``folder/<name>.yaml``: ``cfg`` (a ``ServeConfig``) with the saved ``npz`` as its graph
    and ``fields`` set (``{"server.grpc_port": 8001, "sampling.route": "gpu"}``)."""
    c = cfg.model_copy(deep=True)
    c.graph.format, c.graph.path = "npz", str(npz)
    for key, value in (fields or {}).items():
        section, _, field = key.partition(".")
        setattr(getattr(c, section), field, value)
    path = Path(folder) / f"{name}.yaml"
    path.write_text(config_yaml(c))
    return path


def baseline_daemon(config_path: Path | str, folder: Path, **kwargs: Any) -> Daemon:
    """The PyG-style baseline server (``bench/frontdoor/baseline_server.py``) on the graph,
    fanouts and model of ``config_path``, as a :class:`Daemon` (same ``/v1/embed`` contract,
    same readiness route)."""
    kwargs.setdefault("name", "baseline")
    return Daemon(config_path, log_path=Path(folder) / "baseline.log",
                  command=("-m", "bench.frontdoor.baseline_server"), **kwargs)


class Session:
    """One bench run: a scratch folder, the parts it starts (daemons, load pools: each stopped or
    closed at the end, last first) and how it ended. A daemon that dies, a start that times out
    or SIGTERM (``SystemExit``) ends the run early but not the bench: it is named in ``skipped``,
    ``code`` becomes 1, and what was measured is still written by the caller::

        with Session("qs-updates-") as s:
            daemon = s.own(Daemon(...))
            ...
        write the result (s.skipped, s.code)
    """

    def __init__(self, prefix: str) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix=prefix))
        self.t0 = time.perf_counter()
        self.parts: list[Any] = []
        self.skipped: list[str] = []
        self.code = 0

    def own(self, part: Any) -> Any:
        """``part`` (with ``stop()`` or ``close()``) is ended with the session."""
        self.parts.append(part)
        return part

    def serve(self, config_path: Path, *, smoke: bool, ready_timeout_s: float,
              grace_s: float = 8.0, args: tuple[str, ...] = ()) -> Daemon:
        """The bench's daemon on ``config_path``, its log in the session's folder, owned by the
        session; ``smoke``: the pure-torch sampler (no C++ build in a smoke's time)."""
        env = {"QUIVER_SERVE_DISABLE_CPP": "1"} if smoke else None
        return self.own(Daemon(config_path, log_path=self.folder / "server.log", env=env,
                               args=list(args), grace_s=grace_s,
                               ready_timeout_s=ready_timeout_s))

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> bool:
        cut = isinstance(exc, (RuntimeError, TimeoutError, SystemExit))
        if cut:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self.skipped.append(f"cut short: {first}")
            print(f"FAILED: {exc}", flush=True)
            self.code = 1
        for part in reversed(self.parts):
            if isinstance(part, Daemon):
                part.stop()
                if self.code:
                    print(f"{part.name} log (tail):\n{part.log(3000)}", flush=True)
            else:
                part.close()
        shutil.rmtree(self.folder, ignore_errors=True)
        return cut

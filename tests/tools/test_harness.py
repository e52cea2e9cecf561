"""The bench harness's own parts (``loadtest/harness.py``, ``loadtest/results.py``): a server
that speaks no HTTP/1.1 is ready once its port accepts; a failed start or a server lost mid-run is
named and the run goes on; a session stops what it started; every result file carries where and
how it was made."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from loadtest.harness import Daemon, Session
from loadtest.results import Budget, run_meta, write_result

#: a server with no HTTP: it listens on --port after a short delay, then sleeps
TCP_SERVER = ("import socket, sys, time; time.sleep(0.3); s = socket.socket(); "
              "s.bind(('127.0.0.1', int(sys.argv[sys.argv.index('--port') + 1]))); s.listen(); "
              "time.sleep(60)")


def tcp_server(**kwargs: object) -> Daemon:
    return Daemon(command=("-c", TCP_SERVER), ready_path=None, grace_s=1.0, **kwargs)


def test_a_server_without_http_is_ready_once_its_port_accepts() -> None:
    with tcp_server(ready_timeout_s=20.0) as srv:
        assert srv.alive()
        pid = srv.pid
    assert not srv.alive()
    with pytest.raises(ProcessLookupError):  # the whole group is gone
        os.kill(pid, 0)


def test_a_failed_start_is_named_and_the_run_goes_on() -> None:
    budget = Budget(60.0)
    dead = Daemon(command=("-c", "import sys; print('no graph here'); sys.exit(3)"),
                  name="broken server", grace_s=1.0, ready_timeout_s=20.0)
    with budget.serving(dead, "route x") as ready_s:
        assert ready_s is None
    assert len(budget.skipped) == 1 and budget.skipped[0].startswith("route x: broken server "
                                                                     "exited (3)")
    assert not dead.alive()


def test_a_server_lost_mid_run_is_named_and_stopped() -> None:
    budget = Budget(60.0)
    srv = tcp_server(ready_timeout_s=20.0)
    with budget.serving(srv, "sweep") as ready_s:
        assert ready_s is not None and ready_s > 0
        raise TimeoutError("no answer in 10 s")
    assert budget.skipped == ["sweep: TimeoutError: no answer in 10 s"]
    assert not srv.alive()


def test_budget_skips_what_does_not_fit() -> None:
    budget = Budget(10.0, t0=time.perf_counter() - 8.0)
    assert budget.afford("short step", 1.0)
    assert not budget.afford("long step", 5.0)
    assert budget.skipped[0].startswith("long step (needs ~5 s,")


class Pool:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def close(self) -> None:
        self.log.append(self.name)


def test_a_session_stops_its_parts_last_first_and_keeps_why_it_ended() -> None:
    closed: list[str] = []
    s = Session("qs-test-")
    with s:
        srv = s.own(tcp_server(ready_timeout_s=20.0))
        srv.wait_ready()
        s.own(Pool(closed, "load"))
        s.own(Pool(closed, "updaters"))
        raise RuntimeError("engine core died\nits traceback")
    assert closed == ["updaters", "load"] and not srv.alive()
    assert s.skipped == ["cut short: engine core died"] and s.code == 1
    assert not s.folder.exists()
    with pytest.raises(ValueError), Session("qs-test-") as other:  # not a cut: it propagates
        raise ValueError("a bug")
    assert other.code == 0 and not other.folder.exists()


def test_every_result_names_machine_commit_command_and_date(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [str(Path("bench/graph/updates.py").resolve()), "--smoke",
                                      "--out", str(tmp_path / "u.json")])
    args = argparse.Namespace(machine="h200", config="configs/bench_reddit.yaml",
                              sets=["server.http_workers=2"])
    folder = tmp_path / "run"
    result = {"meta": run_meta(args, protocol="http-npy", args=vars(args)),
              "p99_ms": np.float32(2.5), "levels": (np.int64(1), 4),
              "log": f"{folder}/server.log", "latencies_ms": np.zeros(3)}
    path = write_result(tmp_path / "out" / "u.json", result, folder)
    back = json.loads(path.read_text())
    meta = back["meta"]
    assert meta["machine"] == "h200" and meta["protocol"] == "http-npy"
    assert meta["args"]["sets"] == ["server.http_workers=2"]  # the arguments, whole
    assert meta["command"] == "python -m bench.graph.updates --smoke --out u.json"
    assert meta["git_head"] and meta["date"].endswith("Z")
    assert meta["config"] == "configs/bench_reddit.yaml"
    assert meta["sets"] == ["server.http_workers=2"]
    assert back["p99_ms"] == 2.5 and back["levels"] == [1, 4]
    assert back["log"] == "<run folder>/server.log" and "latencies_ms" not in back


def test_each_daemon_config_serves_the_saved_graph_with_its_own_fields(tmp_path: Path) -> None:
    from loadtest.harness import serve_config
    from quiver_serve.config import ServeConfig

    cfg = ServeConfig.default()
    npz = tmp_path / "graph.npz"
    path = serve_config(cfg, npz, tmp_path, "serve_gpu", {"sampling.route": "gpu",
                                                          "server.grpc_port": 8123})
    back = ServeConfig.from_yaml(path)
    assert (back.graph.format, Path(back.graph.path)) == ("npz", npz)
    assert (back.sampling.route, back.server.grpc_port) == ("gpu", 8123)
    assert cfg.sampling.route == "auto" and cfg.graph.format != "npz"  # the original unchanged

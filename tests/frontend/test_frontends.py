"""Several HTTP front-end processes on one port (``server.http_workers: 2``), against the real daemon.

Both serve (fresh connections reach both pids); ``/metrics`` from either sums the request counts
of both; the guards answer the same from both; a front-end killed with -9 under load is
restarted and serves within 5 s while connections to the other never fail (clients whose
connection was on the killed process see a connection error for the request in flight on it,
nothing else); SIGTERM drains both and every process exits.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import ServerProcess, free_port, restart_bound_s, start_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
TOKEN = "front-door-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def start(tmp: Path, env: dict[str, str] | None = None, **overrides: object) -> ServerProcess:
    srv, cfg = start_server(tmp, env, server__http_workers=2, **overrides)
    srv.grpc_port = cfg.server.grpc_port  # type: ignore[attr-defined]
    return srv


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start(tmp_path_factory.mktemp("door"), env={"QUIVER_SERVE_TOKEN": TOKEN},
                server__grpc_port=free_port(), server__max_body_bytes=4096)
    try:
        srv.wait_ready(headers=AUTH)
        yield srv
    finally:
        srv.stop()


def frontends(srv: ServerProcess) -> dict[int, int]:
    """index -> pid of every front-end, as the daemon lists them (retried: a new connection
    made while a killed front-end's socket is being torn down is reset)."""
    for _ in range(20):
        try:
            rows = httpx.get(srv.url + "/v1/workers", headers=AUTH).json()["workers"]
            return {w["index"]: w["pid"] for w in rows if w["role"] == "frontend"}
        except httpx.TransportError:
            time.sleep(0.05)
    raise AssertionError("no front-end answers")


def on_fresh_connection(srv: ServerProcess, path: str = "/v1/embed",
                        body: object = None, headers: dict[str, str] | None = None
                        ) -> tuple[int, httpx.Response]:
    """(pid of the front-end that got this new connection, the response of one request on it)."""
    with httpx.Client(base_url=srv.url, timeout=30) as client:
        pid = client.get("/v1/workers", headers=AUTH).json()["frontend"]["pid"]
        h = AUTH if headers is None else headers
        r = client.post(path, json=body, headers=h) if body is not None else client.get(path, headers=h)
        return pid, r


def test_two_frontends_serve_one_port(door: ServerProcess) -> None:
    pids = frontends(door)
    assert len(pids) == 2 and len(set(pids.values())) == 2
    served: Counter[int] = Counter()
    for i in range(30):
        pid, r = on_fresh_connection(door, body={"node_ids": [i, 2707 - i]})
        assert r.status_code == 200, r.text
        assert len(r.json()["embeddings"]) == 2
        served[pid] += 1
    assert set(served) == set(pids.values()), served  # the kernel spread connections over both


def test_metrics_sum_over_frontends(door: ServerProcess) -> None:
    def count() -> float:
        text = httpx.get(door.url + "/metrics", headers=AUTH).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("quiver_serve_request_duration_seconds_count")
                   and 'endpoint="/v1/embed"' in line and 'status="200"' in line)

    before = count()
    served: Counter[int] = Counter()
    for i in range(20):
        pid, r = on_fresh_connection(door, body={"node_ids": [i]})
        assert r.status_code == 200
        served[pid] += 1
    assert len(served) == 2, served
    for _ in range(4):  # whichever front-end answers /metrics shows the sum over both
        assert count() == before + 20


def test_guards_answer_the_same_from_every_frontend(door: ServerProcess) -> None:
    seen: dict[int, set[tuple[int, int, int]]] = {}
    for _ in range(16):
        pid, unauth = on_fresh_connection(door, body={"node_ids": [1]}, headers={})
        with httpx.Client(base_url=door.url, headers=AUTH, timeout=30) as client:
            pid2 = client.get("/v1/workers").json()["frontend"]["pid"]
            big = client.post("/v1/embed", json={"node_ids": list(range(1500))})
            bad = client.post("/v1/embed", json={"node_ids": [99999]})
        seen.setdefault(pid, set()).add((unauth.status_code, 0, 0))
        seen.setdefault(pid2, set()).add((0, big.status_code, bad.status_code))
        assert "99999" in bad.json()["error"]["message"]
    assert len(seen) == 2
    for answers in seen.values():
        assert answers <= {(401, 0, 0), (0, 413, 400)}, seen


def test_grpc_on_every_frontend(door: ServerProcess) -> None:
    grpcclient = pytest.importorskip("tritonclient.grpc")
    client = grpcclient.InferenceServerClient(url=f"127.0.0.1:{door.grpc_port}")  # type: ignore[attr-defined]
    ids = grpcclient.InferInput("node_ids", [3], "INT64")
    ids.set_data_from_numpy(np.array([0, 1, 2707]))
    out = client.infer("cora-graphsage", [ids], headers={"authorization": AUTH["Authorization"]}
                       ).as_numpy("embeddings")
    assert out.shape == (3, 64)
    client.close()


class LoadThread(threading.Thread):
    """One keep-alive client sending requests back to back; records which front-end pid each
    request's connection belonged to and how it ended."""

    def __init__(self, srv: ServerProcess, stop: threading.Event, seed: int) -> None:
        super().__init__(daemon=True)
        self.srv, self.stop, self.seed = srv, stop, seed
        self.results: list[tuple[int, str]] = []  # (pid of the connection, "200" or error type)

    def run(self) -> None:
        rng = np.random.default_rng(self.seed)
        client = httpx.Client(base_url=self.srv.url, headers=AUTH, timeout=30)
        pid = None
        while not self.stop.is_set():
            try:
                if pid is None:  # a new connection: learn whose it is
                    pid = client.get("/v1/workers").json()["frontend"]["pid"]
                r = client.post("/v1/embed", json={"node_ids": rng.integers(0, 2708, 8).tolist()})
                self.results.append((pid, str(r.status_code)))
            except httpx.TransportError as exc:
                self.results.append((pid or -1, type(exc).__name__))
                client.close()
                client = httpx.Client(base_url=self.srv.url, headers=AUTH, timeout=30)
                pid = None
        client.close()


def test_kill9_frontend_under_load(door: ServerProcess) -> None:
    before = frontends(door)
    stop = threading.Event()
    threads = [LoadThread(door, stop, seed) for seed in range(8)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    victim_index = 0
    victim, survivor = before[victim_index], before[1 - victim_index]
    os.kill(victim, signal.SIGKILL)
    t_kill = time.monotonic()
    restarted_s = served_s = None
    while time.monotonic() - t_kill < 30 and served_s is None:
        now = frontends(door)
        if restarted_s is None and now[victim_index] != victim:
            restarted_s = time.monotonic() - t_kill
        if restarted_s is not None:
            try:
                pid, r = on_fresh_connection(door, body={"node_ids": [3]})
            except httpx.TransportError:
                continue
            if pid == now[victim_index] and r.status_code == 200:
                served_s = time.monotonic() - t_kill
        time.sleep(0.05)
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    results = [r for t in threads for r in t.results]
    bound_s = restart_bound_s()
    assert served_s is not None and served_s <= bound_s, \
        (restarted_s, served_s, bound_s, door.log())
    on_survivor = [status for pid, status in results if pid == survivor]
    assert on_survivor and set(on_survivor) == {"200"}, Counter(on_survivor)
    failed = [(pid, status) for pid, status in results if status != "200"]
    # only requests in flight on a connection to the killed front-end failed (-1: a connection
    # the kernel had queued for it, not yet accepted), with a connection error: no 5xx, nothing
    # on the survivor
    assert all(pid in (victim, -1) and status in ("RemoteProtocolError", "ReadError", "ConnectError",
                                            "WriteError") for pid, status in failed), failed
    assert len(failed) <= 2 * len(threads)  # about one per client: its next request reconnects
    m = httpx.get(door.url + "/metrics", headers=AUTH).text
    assert 'quiver_serve_worker_restarts_total{role="frontend"} 1.0' in m


def test_sigterm_drains_every_frontend(tmp_path: Path) -> None:
    # Requests wait 1.5 s in the client's batcher, so they are in flight when SIGTERM arrives.
    srv = start(tmp_path, batching__adaptive=False, batching__max_delay_ms=1500.0,
                server__drain_timeout_s=10.0)
    try:
        srv.wait_ready()
        pids = srv.group_pids()
        with ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(on_fresh_connection, srv, "/v1/embed", {"node_ids": [i]})
                       for i in range(12)]
            time.sleep(0.7)
            srv.proc.send_signal(signal.SIGTERM)
            time.sleep(0.4)
            ready = httpx.get(srv.url + "/v2/health/ready")
            refused = httpx.post(srv.url + "/v1/embed", json={"node_ids": [1]})
            done = [f.result() for f in futures]
        assert len({pid for pid, _ in done}) == 2  # requests were in flight on both
        assert [r.status_code for _, r in done] == [200] * 12
        assert ready.status_code == 503 and ready.headers["retry-after"] == "1"
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert srv.proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 5
        while srv.group_pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert srv.group_pids() == [], srv.log()
        assert len(pids) >= 5  # main, two front-ends, a sampler, an engine core
    finally:
        srv.stop()


def test_front_door_stops_when_its_watch_thread_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The watch thread supervises every front-end and publishes the engines' state: if it dies
    of an error the daemon must not hang half-alive (never ready); ``run()`` sees ``watch_failed``
    and exits 1. Found when a new field of the worker rows broke the state message."""
    from quiver_serve.config import ServeConfig
    from quiver_serve.frontend.frontdoor import FrontDoor

    cfg = ServeConfig()
    cfg.server.port = free_port()
    door = FrontDoor(cfg, 1)
    try:
        def broken(self: FrontDoor) -> object:
            raise TypeError("Unexpected keyword argument")

        monkeypatch.setattr(FrontDoor, "_state", broken)
        door._watch()  # returns instead of raising out of the thread
        assert door.watch_failed
    finally:
        door.stop(timeout_s=1.0)

"""Admission control, auth, body limits and graceful drain, against the real daemon."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import ServerProcess, start_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
TOKEN = "s3cret-token"


def start(tmp: Path, env: dict[str, str] | None = None, **overrides: object) -> ServerProcess:
    srv, _ = start_server(tmp, env, **overrides)
    return srv


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start(tmp_path_factory.mktemp("guarded"), env={"QUIVER_SERVE_TOKEN": TOKEN},
                server__max_body_bytes=2048, server__max_pending_requests=4,
                server__overload_status=429)
    try:
        srv.wait_ready(headers=AUTH)
        yield srv
    finally:
        srv.stop()


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_token_required_everywhere_but_liveness(guarded: ServerProcess) -> None:
    assert httpx.get(guarded.url + "/v2/health/live").status_code == 200
    for path in ("/v2/health/ready", "/metrics", "/v2/models/cora-graphsage", "/docs"):
        r = httpx.get(guarded.url + path)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", path
    r = httpx.post(guarded.url + "/v1/embed", json={"node_ids": [1]})
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    bad = httpx.post(guarded.url + "/v1/embed", json={"node_ids": [1]},
                     headers={"Authorization": "Bearer wrong"})
    assert bad.status_code == 401
    ok = httpx.post(guarded.url + "/v1/embed", json={"node_ids": [1]}, headers=AUTH)
    assert ok.status_code == 200


def test_body_size_limit(guarded: ServerProcess) -> None:
    big = {"node_ids": list(range(1000))}  # ~4.9 kB of JSON > 2048
    r = httpx.post(guarded.url + "/v1/embed", json=big, headers=AUTH)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it streams
        yield b'{"node_ids": ['
        for i in range(1000):
            yield f"{i},".encode()
        yield b"0]}"

    r = httpx.post(guarded.url + "/v1/embed", content=chunks(),
                   headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413


def test_overload_answers_every_request_200_or_429(guarded: ServerProcess) -> None:
    with httpx.Client(base_url=guarded.url, headers=AUTH, timeout=30,
                      limits=httpx.Limits(max_connections=64)) as client:
        def one(i: int) -> tuple[int, str | None]:
            r = client.post("/v1/embed", json={"node_ids": [i % 2708, (i * 7) % 2708], "exact": True})
            return r.status_code, r.headers.get("retry-after")

        with ThreadPoolExecutor(64) as pool:
            results = list(pool.map(one, range(400)))
    statuses = Counter(s for s, _ in results)
    assert set(statuses) <= {200, 429}, statuses
    assert statuses[200] > 0 and statuses[429] > 0, statuses  # overload really happened
    assert all(ra == "1" for s, ra in results if s == 429)
    assert sum(statuses.values()) == 400  # none lost
    metrics = httpx.get(guarded.url + "/metrics", headers=AUTH).text
    assert 'quiver_serve_requests_rejected_total{reason="pending_full"}' in metrics


def test_sigterm_drains_in_flight_requests(tmp_path: Path) -> None:
    # Requests wait 1.5 s in the batcher, so they are in flight when SIGTERM arrives.
    srv = start(tmp_path, batching__adaptive=False, batching__max_delay_ms=1500.0,
                server__drain_timeout_s=10.0)
    try:
        srv.wait_ready()
        pids = srv.group_pids()
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(httpx.post, srv.url + "/v1/embed", json={"node_ids": [i]}, timeout=30)
                       for i in range(8)]
            time.sleep(0.5)
            srv.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            ready = httpx.get(srv.url + "/v2/health/ready")
            refused = httpx.post(srv.url + "/v1/embed", json={"node_ids": [1]})
            statuses = [f.result().status_code for f in futures]
        assert ready.status_code == 503 and ready.headers["retry-after"] == "1"
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert statuses == [200] * 8
        assert srv.proc.wait(timeout=15) == 0
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), srv.log()
    finally:
        srv.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _metric(text: str, prefix: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(prefix))


def test_client_disconnect_is_not_computed_and_deadline_is_504(tmp_path: Path) -> None:
    # Batches close only after 800 ms, so a client that gives up at 200 ms is gone before work.
    srv = start(tmp_path, batching__adaptive=False, batching__max_delay_ms=800.0)
    try:
        srv.wait_ready()
        m0 = httpx.get(srv.url + "/metrics").text
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/embed", json={"node_ids": [5]}, timeout=0.2)
        late = httpx.post(srv.url + "/v1/embed", json={"node_ids": [6], "timeout_ms": 100}, timeout=10)
        assert late.status_code == 504 and late.json()["error"]["code"] == "deadline_exceeded"
        time.sleep(1.5)
        m1 = httpx.get(srv.url + "/metrics").text
        cancelled = 'quiver_serve_requests_rejected_total{reason="client_disconnected"}'
        assert _metric(m1, cancelled) - _metric(m0, cancelled) == 1
        assert _metric(m1, 'quiver_serve_requests_rejected_total{reason="deadline"}') >= 1
        # neither request reached a sampler or the model
        assert _metric(m1, "quiver_serve_route_total") == _metric(m0, "quiver_serve_route_total")
        ok = httpx.post(srv.url + "/v1/embed", json={"node_ids": [7]}, timeout=10)
        assert ok.status_code == 200
    finally:
        srv.stop()

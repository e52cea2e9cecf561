"""Admission control, auth, body limits and graceful drain, against the real daemon.

Authorization (``guards.authorize``) is tested for every plane (open, data, admin) on every
protocol: the HTTP protocol's hot routes, the ASGI guards of the app's routes, and gRPC (unary
RPCs, ``ModelInfer``, the repository's admin RPCs): no token, a wrong token, the right one, the
other plane's token, and loopback against a remote client where the admin plane has no token."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from quiver_serve import errors
from quiver_serve.frontend.grpc import proto as gp
from quiver_serve.frontend.grpc.calls import Aborted
from quiver_serve.frontend.grpc.service import KServeGrpc
from quiver_serve.frontend.guards import Guards, Plane, Tokens, authorize, plane_of
from tests.conftest import ServerProcess, free_port, start_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
TOKEN = "s3cret-token"


def start(tmp: Path, env: dict[str, str] | None = None, **overrides: object) -> ServerProcess:
    srv, _ = start_server(tmp, env, **overrides)
    return srv


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    grpc_port = free_port()
    srv = start(tmp_path_factory.mktemp("guarded"), env={"QUIVER_SERVE_TOKEN": TOKEN,
                                                          "QUIVER_SERVE_ADMIN_TOKEN": ADMIN},
                server__max_body_bytes=2048, server__max_pending_requests=4,
                server__overload_status=429, server__grpc_port=grpc_port)
    srv.grpc_port = grpc_port  # type: ignore[attr-defined]
    try:
        srv.wait_ready(headers=AUTH)
        yield srv
    finally:
        srv.stop()


AUTH = {"Authorization": f"Bearer {TOKEN}"}
ADMIN = "adm1n-token"
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}


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


# ---- authorize: every plane on every protocol ----------------------------------------------------
LOCAL, REMOTE = ("127.0.0.1", 40000), ("10.1.2.3", 40000)


@pytest.mark.parametrize("tokens", [Tokens.of("d", "a"), Tokens.of("d", None),
                                    Tokens.of(None, "a"), Tokens.of(None, None)])
@pytest.mark.parametrize("client", [LOCAL, REMOTE, None])
def test_authorize_decides_each_plane(tokens: Tokens, client: Any) -> None:
    data, admin, wrong = b"Bearer d", b"Bearer a", b"Bearer nope"
    for given in (b"", wrong, data, admin):
        assert authorize(Plane.OPEN, given, client, tokens) is None
        refused = authorize(Plane.DATA, given, client, tokens)
        if tokens.data is None or given == data:
            assert refused is None
        else:
            assert (refused.status, refused.code) == (401, "unauthorized")  # type: ignore[union-attr]
            assert refused.headers == [(b"www-authenticate", b"Bearer")]  # type: ignore[union-attr]
        refused = authorize(Plane.ADMIN, given, client, tokens)
        if tokens.admin is not None:
            want = None if given == admin else 403 if tokens.data and given == data else 401
        else:  # no admin token: loopback clients only, whatever they send
            want = None if client == LOCAL else 403
        assert (refused.status if refused else None) == want, (given, client, tokens)


def test_each_path_has_its_plane() -> None:
    assert plane_of("/v2/health/live") is Plane.OPEN
    for path in ("/v1/embed", "/v2/models/m/infer", "/v1/graph", "/metrics", "/docs", "/v2"):
        assert plane_of(path) is Plane.DATA, path
    for path in ("/admin/features/replace", "/v1/graph/edges", "/v2/repository/index",
                 "/v2/repository/models/m/load"):
        assert plane_of(path) is Plane.ADMIN, path


def test_every_plane_over_http(guarded: ServerProcess) -> None:
    """The hot route (answered in the HTTP protocol), an app route (the ASGI guards) and an
    admin route, with no token, a wrong one, the other plane's, and the right one."""
    url, wrong = guarded.url, {"Authorization": "Bearer nope"}
    body = {"node_ids": [1]}
    for headers, want in (({}, 401), (wrong, 401), (ADMIN_AUTH, 401), (AUTH, 200)):
        r = httpx.post(url + "/v1/embed", json=body, headers=headers)
        assert r.status_code == want, ("hot route", headers, r.text)
        r = httpx.get(url + "/v2/models/cora-graphsage", headers=headers)
        assert r.status_code == want, ("app route", headers, r.text)
    for headers, want in (({}, 401), (wrong, 401), (AUTH, 403), (ADMIN_AUTH, 200)):
        r = httpx.post(url + "/v2/repository/index", json={}, headers=headers)
        assert r.status_code == want, ("admin route", headers, r.text)
    assert httpx.get(url + "/v2/health/live").status_code == 200


def test_every_plane_over_grpc(guarded: ServerProcess) -> None:
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(url=f"127.0.0.1:{guarded.grpc_port}")  # type: ignore[attr-defined]
    ids = grpcclient.InferInput("node_ids", [1], "INT64")
    ids.set_data_from_numpy(np.array([3]))
    data = {"authorization": f"Bearer {TOKEN}"}
    admin = {"authorization": f"Bearer {ADMIN}"}
    wrong = {"authorization": "Bearer nope"}

    def status(call: Any, *args: Any, **kwargs: Any) -> str:
        try:
            call(*args, **kwargs)
        except InferenceServerException as exc:
            return str(exc.status())
        return "OK"

    try:
        assert status(client.is_server_live) == "OK"
        for headers, want in (({}, "UNAUTHENTICATED"), (wrong, "UNAUTHENTICATED"),
                              (admin, "UNAUTHENTICATED"), (data, "OK")):
            assert want in status(client.is_server_ready, headers=headers), headers
            assert want in status(client.infer, "cora-graphsage", [ids], headers=headers), \
                headers
        for headers, want in (({}, "UNAUTHENTICATED"), (wrong, "UNAUTHENTICATED"),
                              (data, "PERMISSION_DENIED"), (admin, "OK")):
            assert want in status(client.get_model_repository_index, headers=headers), headers
    finally:
        client.close()


def test_without_an_admin_token_admin_calls_answer_loopback_clients_only() -> None:
    """HTTP (the ASGI guards) and gRPC (the servicer), with the data token set and no admin
    token: a loopback client passes without a token, a remote one is refused 403 even with
    the data token."""
    tokens = Tokens.of(TOKEN, None)

    async def http(client: Any, headers: list[tuple[bytes, bytes]]) -> int:
        sent: list[Any] = []

        async def app(scope: Any, receive: Any, send: Any) -> None:
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        async def send(message: Any) -> None:
            sent.append(message)

        async def receive() -> Any:
            return {"type": "http.request", "body": b"{}", "more_body": False}

        scope = {"type": "http", "method": "POST", "path": "/v1/graph/compact", "client": client,
                 "headers": [(b"content-length", b"2"), *headers]}
        await Guards(app, tokens, 1024)(scope, receive, send)
        return int(sent[0]["status"])

    data_header = [(b"authorization", f"Bearer {TOKEN}".encode())]
    assert asyncio.run(http(LOCAL, [])) == 204
    assert asyncio.run(http(("::1", 1), [])) == 204
    assert asyncio.run(http(REMOTE, [])) == 403
    assert asyncio.run(http(REMOTE, data_header)) == 403

    class Context:
        """A gRPC call's context as the servicer reads it: peer, metadata, abort."""

        def __init__(self, peer: str, metadata: list[tuple[str, str]]) -> None:
            self._peer, self._metadata = peer, metadata

        def peer(self) -> str:
            return self._peer

        def invocation_metadata(self) -> list[tuple[str, str]]:
            return self._metadata

        async def abort(self, code: int, details: str) -> None:
            raise Aborted(code, details)

    class Starting:
        """A pipeline still starting: a call the guard lets through is answered 503
        (UNAVAILABLE) by the repository index; one it refuses never gets there."""

        ready = False

        @staticmethod
        def refusal() -> errors.ServeError:
            return errors.unavailable("starting", "the server is starting")

    class State:
        pipeline = Starting()

    servicer = KServeGrpc(State(), TOKEN, None)
    index_request = gp.message("RepositoryIndexRequest")(ready=False)

    async def grpc(peer: str, metadata: list[tuple[str, str]]) -> str:
        try:
            await servicer.RepositoryIndex(index_request, Context(peer, metadata))
        except Aborted as exc:
            return exc.code.name
        return "OK"

    assert asyncio.run(grpc("ipv4:127.0.0.1:5000", [])) == "UNAVAILABLE"  # let through
    assert asyncio.run(grpc("ipv6:[::1]:5000", [])) == "UNAVAILABLE"
    assert asyncio.run(grpc("ipv4:10.1.2.3:5000", [])) == "PERMISSION_DENIED"
    assert asyncio.run(grpc("ipv4:10.1.2.3:5000",
                            [("authorization", f"Bearer {TOKEN}")])) == "PERMISSION_DENIED"

"""The hot routes answered inside the HTTP protocol (``frontend/hot_protocol.py``).

One in-process pipeline (Cora) and one app with a bearer token. Raw HTTP/1.1 bytes are fed to
the daemon's protocol over a fake transport; the ASGI app it is given records every request that
reaches it, so each test can check that the hot routes were answered by the protocol alone, in
every case it must handle: plain requests, refusals, chunked bodies, ``Expect: 100-continue``,
requests pipelined behind one not answered yet (answered in order, mixed with the app's routes),
percent-encoded paths, a root path, uvicorn's concurrency limit, HTTP/1.0, and a client that
goes away before its answer (the request is cancelled, nothing is written).
"""

from __future__ import annotations

import asyncio
import io
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import orjson
import pytest
import uvicorn
from uvicorn.server import ServerState

from quiver_serve.engine.client.pipeline import Pipeline
from quiver_serve.frontend.app import create_app
from quiver_serve.frontend.listen import uvicorn_options
from tests.conftest import small_config

pytestmark = pytest.mark.e2e

TOKEN = "hot-protocol-token"
MAX_BODY_BYTES = 4096
INFER = "/v2/models/cora-graphsage/infer"
DIM = 64


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    cfg = small_config(server__max_request_nodes=256, server__max_body_bytes=MAX_BODY_BYTES,
                       server__auth_token=TOKEN, server__start_timeout_s=400.0)
    pipeline = Pipeline(cfg)
    application = create_app(cfg, pipeline)
    pipeline.start()
    try:
        yield application
    finally:
        pipeline.stop(drain_timeout_s=0.0)


class Transport:
    """Collects what a protocol writes; ``closed`` once it closes the connection."""

    def __init__(self, peer: str = "127.0.0.1") -> None:
        self.data = bytearray()
        self.closed = False
        self.peer = peer

    def write(self, data: Any) -> None:
        self.data += bytes(data)

    def writelines(self, parts: list[Any]) -> None:
        for part in parts:
            self.data += bytes(part)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": (self.peer, 50000)}.get(
            name, default)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        return None

    def resume_reading(self) -> None:
        return None


class Recorder:
    """The ASGI app, recording the path of every request that reaches it."""

    def __init__(self, app: Any) -> None:
        self.app, self.paths = app, []  # type: ignore[var-annotated]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.paths.append(scope["path"])
        await self.app(scope, receive, send)


def request(path: str, body: bytes, *headers: str, method: str = "POST",
            version: str = "1.1", auth: bool = True, chunked: bool = False) -> bytes:
    lines = [f"{method} {path} HTTP/{version}", "host: test"]
    if auth:
        lines.append(f"authorization: Bearer {TOKEN}")
    lines += headers
    if chunked:
        lines.append("transfer-encoding: chunked")
        half = len(body) // 2
        payload = b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n"
                           for p in (body[:half], body[half:]) if p) + b"0\r\n\r\n"
    else:
        lines.append(f"content-length: {len(body)}")
        payload = body
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


def embed(ids: list[int], *headers: str, path: str = "/v1/embed", **kw: Any) -> bytes:
    return request(path, orjson.dumps({"node_ids": ids, "exact": True}),
                   "content-type: application/json", *headers, **kw)


def binary_infer(ids: list[int], path: str = INFER) -> bytes:
    raw = np.asarray(ids, dtype="<i8").tobytes()
    head = orjson.dumps({"inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [len(ids)],
                                     "parameters": {"binary_data_size": len(raw)}}],
                         "parameters": {"binary_data_output": True, "exact": True}})
    return request(path, head + raw, "content-type: application/octet-stream",
                   f"inference-header-content-length: {len(head)}")


class Conn:
    """One connection to a fresh protocol instance of the daemon's class."""

    def __init__(self, app: Any, peer: str = "127.0.0.1", **config: Any) -> None:
        self.recorder = Recorder(app)
        options = uvicorn_options(app)
        self.config = uvicorn.Config(self.recorder, **options, **config)
        self.config.load()
        self.transport = Transport(peer)
        self.server_state = ServerState()
        self.proto = self.config.http_protocol_class(self.config, self.server_state, {},
                                                     asyncio.get_running_loop())
        self.proto.connection_made(self.transport)  # type: ignore[arg-type]

    def feed(self, wire: bytes) -> None:
        self.proto.data_received(wire)

    async def answers(self, count: int) -> list[Response]:
        """The first ``count`` responses, once all are whole."""
        for _ in range(1000):
            got = parse(bytes(self.transport.data))
            if len(got) >= count:
                return got[:count]
            await asyncio.sleep(0.01)
        raise AssertionError(f"{count} answers not written: {bytes(self.transport.data)[:400]!r}")

    def lose(self) -> None:
        self.transport.closed = True
        self.proto.connection_lost(None)


class Response:
    def __init__(self, status: int, headers: dict[bytes, bytes], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    def json(self) -> Any:
        return orjson.loads(self.body)


def parse(data: bytes) -> list[Response]:
    """The whole responses in ``data`` (by content-length), 1xx answers included."""
    out, pos = [], 0
    while True:
        end = data.find(b"\r\n\r\n", pos)
        if end < 0:
            return out
        lines = data[pos:end].split(b"\r\n")
        status = int(lines[0].split(b" ")[1])
        headers = dict(line.split(b": ", 1) for line in lines[1:])
        size = int(headers.get(b"content-length", b"0"))
        if end + 4 + size > len(data):
            return out
        out.append(Response(status, headers, data[end + 4:end + 4 + size]))
        pos = end + 4 + size


def exchange(app: Any, wire: bytes, count: int = 1, **config: Any) -> tuple[list[Response], Conn]:
    async def go() -> tuple[list[Response], Conn]:
        conn = Conn(app, **config)
        conn.feed(wire)
        return await conn.answers(count), conn

    return asyncio.run(go())


def kserve_rows(r: Response) -> np.ndarray:
    head = int(r.headers[b"inference-header-content-length"])
    return np.frombuffer(r.body[head:], dtype="<f4").reshape(-1, DIM)


#: name -> (request bytes, status)
CASES = {
    "embed json": (embed([0, 1, 2707]), 200),
    "embed npy": (embed([3, 3], "accept: application/x-npy"), 200),
    "kserve binary": (binary_infer([5, 6, 7]), 200),
    "kserve json": (request(INFER, orjson.dumps({"inputs": [{
        "name": "node_ids", "datatype": "INT64", "shape": [2], "data": [8, 9]}], "id": "r1"}),
        "content-type: application/json"), 200),
    "versioned infer": (binary_infer([1], "/v2/models/cora-graphsage/versions/1/infer"), 200),
    "no token": (embed([1], auth=False), 401),
    "wrong token": (embed([1], "authorization: Bearer nope", auth=False), 401),
    "declared body too large": (request("/v1/embed", b"{" + b" " * MAX_BODY_BYTES + b"}",
                                        "content-type: application/json"), 413),
    "bad JSON": (request("/v1/embed", b'{"node_ids": [1,', "content-type: application/json"),
                 422),
    "id out of range": (embed([2708]), 400),
    "too many ids": (embed(list(range(300))), 413),
    "unknown model": (request("/v2/models/nope/infer", orjson.dumps({"inputs": [
        {"name": "node_ids", "datatype": "INT64", "shape": [1], "data": [1]}]})), 404),
    "bad version": (request("/v2/models/cora-graphsage/versions/x/infer", b"{}"), 400),
    "chunked body": (embed([4, 5], chunked=True), 200),
    "percent-encoded embed path": (embed([6], path="/v1/%65mbed"), 200),
    "percent-encoded model name": (binary_infer([6], "/v2/models/cora%2Dgraphsage/infer"), 200),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_protocol_answers_each_hot_case_itself(app: Any, name: str) -> None:
    wire, status = CASES[name]
    (r,), conn = exchange(app, wire)
    assert r.status == status, (name, r.body[:300])
    assert conn.recorder.paths == [], "a hot route reached the ASGI app"
    if status == 401:
        assert r.headers[b"www-authenticate"] == b"Bearer"
        assert r.json()["error"]["code"] == "unauthorized"
    if status == 200 and b"npy" in wire:
        assert r.headers[b"content-type"] == b"application/x-npy"
        assert np.load(io.BytesIO(r.body)).shape == (2, DIM)
    elif status == 200 and b"octet-stream" in wire:
        assert r.headers[b"content-type"] == b"application/octet-stream"
        assert kserve_rows(r).shape[0] >= 1
    elif status >= 400 and b"/v2/" in wire.split(b"\r\n")[0]:
        assert isinstance(r.json()["error"], str)  # KServe's error body
    elif status >= 400:
        assert set(r.json()["error"]) == {"code", "message"}


def test_answers_carry_the_rows_asked_for(app: Any) -> None:
    (j,), _ = exchange(app, embed([3, 3, 2707]))
    rows = np.asarray(j.json()["embeddings"], dtype=np.float32)
    assert rows.shape == (3, DIM) and np.array_equal(rows[0], rows[1])
    (b,), _ = exchange(app, binary_infer([3, 3, 2707]))
    assert np.array_equal(kserve_rows(b), rows)
    (n,), _ = exchange(app, embed([2707], "accept: application/x-npy"))
    assert np.array_equal(np.load(io.BytesIO(n.body))[0], rows[2])
    assert (n.headers[b"x-model-name"], n.headers[b"x-model-version"]) == \
        (b"cora-graphsage", b"1")


def test_pipelined_requests_are_answered_in_order(app: Any) -> None:
    wire = embed([1]) + binary_infer([2, 3]) + embed([4], "accept: application/x-npy") + \
        embed([2708])
    answers, conn = exchange(app, wire, 4)
    assert [r.status for r in answers] == [200, 200, 200, 400]
    assert len(answers[0].json()["embeddings"]) == 1
    assert kserve_rows(answers[1]).shape == (2, DIM)
    assert np.load(io.BytesIO(answers[2].body)).shape == (1, DIM)
    assert conn.recorder.paths == []


def test_pipelining_mixes_hot_requests_and_the_apps_routes_in_order(app: Any) -> None:
    wire = embed([4]) + request("/v2", b"", method="GET") + embed([5, 6]) + \
        request("/v2/models/cora-graphsage", b"", method="GET") + binary_infer([7])
    answers, conn = exchange(app, wire, 5)
    assert [r.status for r in answers] == [200] * 5
    assert len(answers[0].json()["embeddings"]) == 1
    assert answers[1].json()["name"] == "quiver-serve"
    assert len(answers[2].json()["embeddings"]) == 2
    assert answers[3].json()["name"] == "cora-graphsage"
    assert kserve_rows(answers[4]).shape == (1, DIM)
    assert conn.recorder.paths == ["/v2", "/v2/models/cora-graphsage"]


def test_expect_100_continue_is_answered_by_the_protocol(app: Any) -> None:
    whole = embed([7], "expect: 100-continue")
    head, body = whole.split(b"\r\n\r\n", 1)

    async def go() -> tuple[bytes, bytes, list[Response], Conn]:
        conn = Conn(app)
        conn.feed(head + b"\r\n\r\n")
        await asyncio.sleep(0.05)
        before_body = bytes(conn.transport.data)
        conn.feed(body)
        answers = await conn.answers(2)
        return before_body, bytes(conn.transport.data), answers, conn

    before_body, data, answers, conn = asyncio.run(go())
    assert before_body == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert [r.status for r in answers] == [100, 200]
    assert conn.recorder.paths == [] and not conn.transport.closed


def test_expect_100_continue_refused_gets_no_continue_and_closes(app: Any) -> None:
    whole = embed([7], "expect: 100-continue", auth=False)
    head = whole.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n"
    (r,), conn = exchange(app, head)
    assert r.status == 401 and b"100 Continue" not in conn.transport.data
    assert conn.transport.closed


def test_a_root_path_does_not_change_the_route(app: Any) -> None:
    (r,), conn = exchange(app, embed([8]), root_path="/api")
    assert r.status == 200 and conn.recorder.paths == []


def test_past_the_concurrency_limit_the_daemons_overload_refusal(app: Any) -> None:
    (r,), conn = exchange(app, embed([9]), limit_concurrency=1)
    assert r.status == 503 and r.json()["error"]["code"] == "overloaded"
    assert r.headers[b"retry-after"] == b"1" and r.headers[b"connection"] == b"close"
    assert conn.transport.closed and conn.recorder.paths == []


def test_a_declared_body_over_the_limit_is_413_and_closes(app: Any) -> None:
    (r,), conn = exchange(app, CASES["declared body too large"][0])
    assert r.status == 413 and r.json()["error"]["code"] == "body_too_large"
    assert conn.transport.closed


def test_a_chunked_body_over_the_limit_is_413_and_closes(app: Any) -> None:
    wire = request("/v1/embed", b'{"node_ids": [1], "pad": "' + b"x" * MAX_BODY_BYTES + b'"}',
                   "content-type: application/json", chunked=True)
    (r,), conn = exchange(app, wire)
    assert r.status == 413 and r.json()["error"]["code"] == "body_too_large"
    assert conn.transport.closed


def test_http_1_0_closes_and_keep_alive_does_not(app: Any) -> None:
    (old,), old_conn = exchange(app, embed([6], version="1.0"))
    (new,), new_conn = exchange(app, embed([6]))
    assert old_conn.transport.closed and old.headers[b"connection"] == b"close"
    assert not new_conn.transport.closed and b"connection" not in new.headers


def test_another_method_on_a_hot_path_is_405(app: Any) -> None:
    (r,), conn = exchange(app, request("/v1/embed", b"", method="GET"))
    assert r.status == 405 and r.headers[b"allow"] == b"POST"
    assert r.json()["error"]["code"] == "method_not_allowed"


def latency_count(app: Any, endpoint: str, status: str) -> float:
    for metric in app.state.qs.metrics.request_duration.collect():
        for s in metric.samples:
            if s.name.endswith("request_duration_seconds_count") and \
                    s.labels == {"endpoint": endpoint, "status": status}:
                return float(s.value)
    return 0.0


def test_the_latency_metric_gets_route_templates(app: Any) -> None:
    cases = [(embed([1]), "/v1/embed", "200"),
             (binary_infer([1], "/v2/models/cora-graphsage/versions/1/infer"),
              "/v2/models/{name}/versions/{version}/infer", "200"),
             (CASES["unknown model"][0], "/v2/models/{name}/infer", "404"),
             (CASES["no token"][0], "unmatched", "401")]
    for wire, endpoint, status in cases:
        before = latency_count(app, endpoint, status)
        exchange(app, wire)
        assert latency_count(app, endpoint, status) == before + 1, (endpoint, status)


def slow_embed() -> bytes:
    return request("/v1/embed", orjson.dumps({"node_ids": list(range(200)), "exact": True}),
                   "content-type: application/json")


def test_a_client_gone_before_its_answer_cancels_the_request(app: Any) -> None:
    pipeline = app.state.qs.pipeline
    before = latency_count(app, "/v1/embed", "499")

    async def go() -> tuple[bytes, int]:
        conn = Conn(app)
        conn.feed(slow_embed())
        conn.lose()
        await asyncio.sleep(0.5)
        return bytes(conn.transport.data), pipeline.pending_count

    data, pending = asyncio.run(go())
    assert data == b""  # nothing written to a closed connection
    assert pending == 0  # cancelled, not left in flight
    # counted as 499 (at least once: the latency metric is the process's, and a request another
    # test of the process cancelled may be counted in the same half second)
    assert latency_count(app, "/v1/embed", "499") >= before + 1


def test_a_client_gone_with_requests_pipelined_behind_cancels_the_first(app: Any) -> None:
    pipeline = app.state.qs.pipeline

    async def go() -> tuple[bytes, int]:
        conn = Conn(app)
        conn.feed(slow_embed() + request("/v2", b"", method="GET") + embed([1]))
        conn.lose()
        await asyncio.sleep(0.5)
        return bytes(conn.transport.data), pipeline.pending_count

    data, pending = asyncio.run(go())
    assert data == b"", "an answer was written after the client went away"
    assert pending == 0


def test_the_asgi_adapter_answers_with_the_same_functions(app: Any) -> None:
    """uvicorn's own httptools protocol (no hot protocol) hands hot requests to the app, whose
    ASGI adapter answers them with ``fastpath.py``'s functions: the same bodies."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    async def plain(wire: bytes, count: int) -> list[Response]:
        config = uvicorn.Config(app)
        config.load()
        transport = Transport()
        proto = HttpToolsProtocol(config, ServerState(), {}, asyncio.get_running_loop())
        proto.connection_made(transport)  # type: ignore[arg-type]
        proto.data_received(wire)
        for _ in range(1000):
            got = parse(bytes(transport.data))
            if len(got) >= count:
                return got
            await asyncio.sleep(0.01)
        raise AssertionError(bytes(transport.data)[:300])

    for name in ("embed json", "kserve binary", "bad JSON", "unknown model", "no token"):
        wire, status = CASES[name]
        (hot,), _ = exchange(app, wire)
        (asgi,) = asyncio.run(plain(wire, 1))
        assert (hot.status, hot.body) == (asgi.status, asgi.body) == (status, hot.body), name
        strip = re.compile(rb"^(date|server)$")
        assert {k: v for k, v in hot.headers.items() if not strip.match(k)} == \
            {k: v for k, v in asgi.headers.items() if not strip.match(k)}, name

"""The hot routes through the real daemon (``server.py``, uvicorn on httptools with the daemon's
protocol, a bearer token): each case's status and body over real HTTP on one keep-alive
connection, the request-latency metric's (endpoint, status) counts in ``/metrics``, and what
only a real socket shows: ``Expect: 100-continue`` and pipelined requests answered in order.
The in-process tests of every error class are tests/frontend/test_fastpath.py and
test_hot_protocol.py.
"""

from __future__ import annotations

import io
import re
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from quiver_serve.frontend.listen import uvicorn_speedups
from tests.conftest import ServerProcess, start_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
TOKEN = "fast-e2e-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
JSON = {"content-type": "application/json", **AUTH}
INFER = "/v2/models/cora-graphsage/infer"
DIM = 64


def _kserve(ids: list, datatype: str = "INT64", exact: bool = False) -> bytes:
    body: dict[str, Any] = {"inputs": [{"name": "node_ids", "datatype": datatype,
                                        "shape": [len(ids)], "data": ids}]}
    if exact:
        body["parameters"] = {"exact": True}
    return orjson.dumps(body)


def _binary(ids: list[int]) -> tuple[bytes, dict[str, str]]:
    raw = np.asarray(ids, dtype="<i8").tobytes()
    head = orjson.dumps({"inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [len(ids)],
                                     "parameters": {"binary_data_size": len(raw)}}],
                         "parameters": {"binary_data_output": True, "exact": True}})
    return head + raw, {"inference-header-content-length": str(len(head)),
                        "content-type": "application/octet-stream", **AUTH}


#: (name, path, body, headers, expected status)
CASES: list[tuple[str, str, bytes, dict[str, str], int]] = [
    ("embed json", "/v1/embed", b'{"node_ids": [3, 3, 2707], "exact": true}', JSON, 200),
    ("embed npy", "/v1/embed", b'{"node_ids": [5], "exact": true}',
     {**JSON, "accept": "application/x-npy"}, 200),
    ("infer json", INFER, _kserve([0, 9], exact=True), JSON, 200),
    ("infer binary", INFER, *_binary([11, 12, 11]), 200),
    ("infer without content-type", INFER, _kserve([7], exact=True), AUTH, 200),
    ("embed bad JSON", "/v1/embed", b'{"node_ids": [1,', JSON, 422),
    ("embed float id", "/v1/embed", b'{"node_ids": [1.5]}', JSON, 422),
    ("embed nothing to embed", "/v1/embed", b'{"exact": true}', JSON, 422),
    ("embed id out of range", "/v1/embed", b'{"node_ids": [2708]}', JSON, 400),
    ("embed negative id", "/v1/embed", b'{"node_ids": [4, -1]}', JSON, 400),
    ("embed too many ids", "/v1/embed", orjson.dumps({"node_ids": list(range(40))}), JSON, 413),
    ("embed no token", "/v1/embed", b'{"node_ids": [1]}', {"content-type": "application/json"},
     401),
    ("infer wrong dtype", INFER, _kserve([1, 2], "FP32"), JSON, 422),
    ("infer id out of range", INFER, _kserve([99999]), JSON, 400),
    ("infer unknown model", "/v2/models/nope/infer", _kserve([1]), JSON, 404),
    ("infer wrong token", INFER, _kserve([1]), {"authorization": "Bearer nope"}, 401),
    ("embed body too large", "/v1/embed", orjson.dumps({"node_ids": list(range(700))}), JSON,
     413),  # last: the daemon closes the connection after it
]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv, _ = start_server(tmp_path_factory.mktemp("hot"), {"QUIVER_SERVE_TOKEN": TOKEN},
                          server__max_request_nodes=32, server__max_body_bytes=2048)
    try:
        srv.wait_ready(240.0, headers=AUTH)
        yield srv
    finally:
        srv.stop()


def _durations(srv: ServerProcess) -> dict[tuple[str, str], float]:
    text = httpx.get(srv.url + "/metrics", headers=AUTH).text
    out = {}
    for labels, value in re.findall(
            r'^quiver_serve_request_duration_seconds_count\{(.*)\} (\S+)$', text, re.M):
        kv = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        out[(kv.get("endpoint", ""), kv.get("status", ""))] = float(value)
    return out


def test_each_case_over_real_http_and_its_metric_labels(daemon: ServerProcess) -> None:
    before = _durations(daemon)
    with httpx.Client(base_url=daemon.url, timeout=30) as client:  # one keep-alive connection
        answers = [client.post(path, content=body, headers=headers)
                   for _name, path, body, headers, _status in CASES]
    for case, r in zip(CASES, answers, strict=True):
        assert r.status_code == case[4], (case[0], r.text[:300])
        assert r.headers["server"] == "uvicorn" and "date" in r.headers
        if r.status_code >= 400:
            error = r.json()["error"]
            assert isinstance(error, str) if case[1].startswith("/v2") else \
                set(error) == {"code", "message"}, case[0]
    json_rows = np.asarray(answers[0].json()["embeddings"], dtype=np.float32)
    assert json_rows.shape == (3, DIM)
    assert np.load(io.BytesIO(answers[1].content)).shape == (1, DIM)
    assert answers[7].json()["error"]["message"].startswith("node_ids: Field required")
    assert answers[-1].headers["connection"] == "close"
    after = _durations(daemon)
    counts = {k: v - before.get(k, 0.0) for k, v in after.items()
              if v > before.get(k, 0.0) and k[0] != "/metrics"}
    assert counts == {("/v1/embed", "200"): 2, ("/v2/models/{name}/infer", "200"): 3,
                      ("/v1/embed", "422"): 3, ("/v1/embed", "400"): 2, ("/v1/embed", "413"): 1,
                      ("/v2/models/{name}/infer", "422"): 1, ("/v2/models/{name}/infer", "400"): 1,
                      ("/v2/models/{name}/infer", "404"): 1, ("unmatched", "401"): 2,
                      ("unmatched", "413"): 1}


def _read(sock: socket.socket, data: bytes, count: int) -> bytes:
    """Read until ``data`` holds ``count`` whole responses (by content-length; 1xx have none)."""
    while len(re.findall(rb"HTTP/1\.1 \d+ ", data)) < count or not _whole(data, count):
        chunk = sock.recv(65536)
        assert chunk, data[:400]
        data += chunk
    return data


def _whole(data: bytes, count: int) -> bool:
    pos = 0
    for _ in range(count):
        end = data.find(b"\r\n\r\n", pos)
        if end < 0:
            return False
        size = re.search(rb"content-length: (\d+)", data[pos:end])
        pos = end + 4 + (int(size.group(1)) if size else 0)
    return pos <= len(data)


def _port(srv: ServerProcess) -> int:
    return int(srv.url.rsplit(":", 1)[1])


def _post(path: str, body: bytes, *extra: str) -> bytes:
    head = [f"POST {path} HTTP/1.1", "host: t", f"authorization: Bearer {TOKEN}",
            "content-type: application/json", f"content-length: {len(body)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def test_expect_100_continue_over_a_real_socket(daemon: ServerProcess) -> None:
    body = b'{"node_ids": [1, 2], "exact": true}'
    wire = _post("/v1/embed", body, "expect: 100-continue")
    head = wire[:-len(body)]
    with socket.create_connection(("127.0.0.1", _port(daemon)), timeout=30) as sock:
        sock.sendall(head)
        assert _read(sock, b"", 1) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        data = _read(sock, b"", 1)
    assert data.startswith(b"HTTP/1.1 200 OK\r\n")


def test_pipelined_requests_over_a_real_socket_are_answered_in_order(
        daemon: ServerProcess) -> None:
    wire = _post("/v1/embed", b'{"node_ids": [1]}') + \
        b"GET /v2 HTTP/1.1\r\nhost: t\r\nauthorization: Bearer " + TOKEN.encode() + b"\r\n\r\n" + \
        _post("/v1/embed", b'{"node_ids": [2708]}') + _post("/v1/embed", b'{"node_ids": [2, 3]}')
    with socket.create_connection(("127.0.0.1", _port(daemon)), timeout=30) as sock:
        sock.sendall(wire)
        data = _read(sock, b"", 4)
    statuses = re.findall(rb"HTTP/1\.1 (\d+) ", data)
    assert statuses == [b"200", b"200", b"400", b"200"]
    # each answer in its request's place (an embedding's digits may hold "2708" too, so each
    # answer is looked at alone)
    answers = re.split(rb"(?=HTTP/1\.1 \d+ )", data)[1:]
    assert b'"embeddings"' in answers[0] and b'"quiver-serve"' in answers[1]
    assert b"2708" in answers[2].split(b"\r\n\r\n", 1)[1] and b'"embeddings"' in answers[3]


def test_openapi_json_describes_the_hot_routes(daemon: ServerProcess) -> None:
    paths = httpx.get(daemon.url + "/openapi.json", headers=AUTH).json()["paths"]
    assert "post" in paths["/v1/embed"] and "post" in paths["/v2/models/{name}/infer"]
    assert "post" in paths["/v2/models/{name}/versions/{version}/infer"]


def test_uvicorn_runs_on_uvloop_and_httptools_where_installed() -> None:
    pytest.importorskip("uvloop")
    pytest.importorskip("httptools")
    assert uvicorn_speedups() == {"loop": "uvloop", "http": "httptools"}

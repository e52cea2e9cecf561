"""The hot routes' raw-ASGI layer through the real daemon: two ``server.py`` processes, one with
``server.fast_routes`` on and one with it off (both with a bearer token), get the same requests
over real HTTP (uvicorn, httptools); status, headers (all but Date) and body bytes must be equal,
and so must the request-latency metric's (endpoint, status) counts. The in-process differential
test of every error class is tests/frontend/test_fastpath.py; this one covers what only the daemon has:
uvicorn's own framing, the guards, the timing layer and /metrics, and the uvicorn options.
"""

from __future__ import annotations

import re
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
    ("embed id out of range", "/v1/embed", b'{"node_ids": [2708]}', JSON, 400),
    ("embed negative id", "/v1/embed", b'{"node_ids": [4, -1]}', JSON, 400),
    ("embed too many ids", "/v1/embed", orjson.dumps({"node_ids": list(range(40))}), JSON, 413),
    ("embed body too large", "/v1/embed", orjson.dumps({"node_ids": list(range(700))}), JSON,
     413),
    ("embed no token", "/v1/embed", b'{"node_ids": [1]}', {"content-type": "application/json"},
     401),
    ("infer wrong dtype", INFER, _kserve([1, 2], "FP32"), JSON, 422),
    ("infer id out of range", INFER, _kserve([99999]), JSON, 400),
    ("infer unknown model", "/v2/models/nope/infer", _kserve([1]), JSON, 404),
    ("infer wrong token", INFER, _kserve([1]), {"authorization": "Bearer nope"}, 401),
]


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[bool, ServerProcess]]:
    servers: dict[bool, ServerProcess] = {}
    try:
        for fast in (True, False):  # both start at once; then wait for both
            servers[fast], _ = start_server(
                tmp_path_factory.mktemp(f"fast{fast}"), {"QUIVER_SERVE_TOKEN": TOKEN},
                server__fast_routes=fast, server__max_request_nodes=32,
                server__max_body_bytes=2048)
        for srv in servers.values():
            srv.wait_ready(240.0, headers=AUTH)
        yield servers
    finally:
        for srv in servers.values():
            srv.stop()


def _durations(srv: ServerProcess) -> dict[tuple[str, str], float]:
    text = httpx.get(srv.url + "/metrics", headers=AUTH).text
    out = {}
    for labels, value in re.findall(
            r'^quiver_serve_request_duration_seconds_count\{(.*)\} (\S+)$', text, re.M):
        kv = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        out[(kv.get("endpoint", ""), kv.get("status", ""))] = float(value)
    return out


def test_daemons_with_and_without_the_fast_layer_answer_alike(
        daemons: dict[bool, ServerProcess]) -> None:
    answers: dict[bool, list[tuple]] = {}
    counts: dict[bool, dict[tuple[str, str], float]] = {}
    for fast, srv in daemons.items():
        before = _durations(srv)
        with httpx.Client(base_url=srv.url, timeout=30) as client:  # one keep-alive connection
            answers[fast] = []
            for _name, path, body, headers, _status in CASES:
                r = client.post(path, content=body, headers=headers)
                answers[fast].append((r.status_code, [h for h in r.headers.raw
                                                      if h[0].lower() != b"date"], r.content))
        after = _durations(srv)
        counts[fast] = {k: v - before.get(k, 0.0) for k, v in after.items()
                        if v > before.get(k, 0.0) and k[0] != "/metrics"}
    for case, got, want in zip(CASES, answers[True], answers[False], strict=True):
        assert got[0] == case[4], (case[0], got)
        assert got == want, case[0]  # exact mode: the same embeddings, to the byte
    assert counts[True] == counts[False]
    assert counts[True][("/v1/embed", "200")] == 2
    assert counts[True][("/v2/models/{name}/infer", "404")] == 1


def test_uvicorn_runs_on_uvloop_and_httptools_where_installed() -> None:
    pytest.importorskip("uvloop")
    pytest.importorskip("httptools")
    assert uvicorn_speedups() == {"loop": "uvloop", "http": "httptools"}

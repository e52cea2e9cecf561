"""The hot routes' raw-ASGI layer (``frontend/fastpath.py``) against FastAPI's own routes.

One in-process pipeline (Cora, the default model) serves two apps: one with ``server.fast_routes``
on, one with it off. Every case is sent to both as raw ASGI; status, header list (names, values,
order) and body bytes must be equal, the fast app must have answered the hot routes without
entering FastAPI's router (Starlette sets ``scope["endpoint"]`` when it routes), and requests
that are not the hot routes must still reach FastAPI.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import orjson
import pytest

from quiver_serve.engine.client.pipeline import Pipeline
from quiver_serve.frontend.app import create_app
from tests.conftest import small_config

pytestmark = pytest.mark.e2e

MODEL = "cora-graphsage"
INFER = f"/v2/models/{MODEL}/infer"
JSON = {"content-type": "application/json"}
MAX_BODY_BYTES = 8192


@pytest.fixture(scope="module")
def apps() -> Iterator[tuple[Any, Any, Pipeline]]:
    cfg = small_config(server__max_request_nodes=512, server__max_body_bytes=MAX_BODY_BYTES,
                       server__start_timeout_s=400.0)
    slow_cfg = cfg.model_copy(deep=True)
    slow_cfg.server.fast_routes = False
    pipeline = Pipeline(cfg)
    slow = create_app(slow_cfg, pipeline)
    fast = create_app(cfg, pipeline)  # the pipeline reports to the last app's metrics
    pipeline.start()
    try:
        yield fast, slow, pipeline
    finally:
        pipeline.stop(drain_timeout_s=0.0)


async def call(app: Any, method: str, path: str, body: bytes = b"",
               headers: dict[str, str] | None = None, gone_after_body: bool = False,
               gone_before_body: bool = False) -> dict[str, Any]:
    """One request as uvicorn hands it to the app: what was sent back, and the scope after."""
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    if "content-length" not in (headers or {}):
        raw.append((b"content-length", str(len(body)).encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "headers": raw, "client": ("127.0.0.1", 50000),
             "server": ("127.0.0.1", 8000), "state": {}}
    first = ({"type": "http.request", "body": body[:3], "more_body": True} if gone_before_body
             else {"type": "http.request", "body": body, "more_body": False})
    pending = [first]
    answered = asyncio.Event()
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        if not (gone_after_body or gone_before_body):
            await asyncio.wait_for(answered.wait(), timeout=30)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            answered.set()

    await asyncio.wait_for(app(scope, receive, send), timeout=30)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body_out = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return {"status": start["status"], "headers": [tuple(h) for h in start["headers"]],
            "body": body_out, "scope": scope}


def embed(body: Any, **headers: str) -> tuple[str, str, bytes, dict[str, str]]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return "POST", "/v1/embed", raw, {**JSON, **headers}


def infer_json(inputs: list[dict[str, Any]], path: str = INFER, **extra: Any) -> tuple:
    return "POST", path, orjson.dumps({"inputs": inputs, **extra}), dict(JSON)


def infer_binary(ids: list[int], size: int | None = None, head_len: str | None = None) -> tuple:
    data = np.asarray(ids, dtype="<i8").tobytes()
    head = orjson.dumps({"inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [len(ids)],
                                     "parameters": {"binary_data_size": size or len(data)}}],
                         "parameters": {"binary_data_output": True, "exact": True}})
    return "POST", INFER, head + data, {"content-type": "application/octet-stream",
                                        "inference-header-content-length": head_len or str(len(head))}


def ids_tensor(data: Any, datatype: str = "INT64", shape: list[int] | None = None) -> dict:
    n = len(data) if isinstance(data, list) else 1
    return {"name": "node_ids", "datatype": datatype, "shape": shape or [n], "data": data}


HOT_CASES = {
    "embed_json": embed({"node_ids": [0, 1, 2707, 1], "exact": True}),
    "embed_npy": embed({"node_ids": [3, 3], "exact": True}, accept="application/x-npy"),
    "embed_seeded": embed({"node_ids": [5, 6], "seed": 7}),
    "embed_bad_json": embed(b'{"node_ids": [1,'),
    "embed_float_id": embed({"node_ids": [1.5]}),
    "embed_string_id": embed({"node_ids": ["3"]}),
    "embed_bool_id": embed({"node_ids": [True]}),
    "embed_no_ids": embed({"node_ids": []}),
    "embed_unknown_field": embed({"nodes": [1]}),
    "embed_negative_seed": embed({"node_ids": [1], "seed": -1}),
    "embed_zero_timeout": embed({"node_ids": [1], "timeout_ms": 0}),
    "embed_id_too_big": embed({"node_ids": [2708]}),
    "embed_id_negative": embed({"node_ids": [-1]}),
    "embed_id_beyond_int64": embed({"node_ids": [2**70]}),
    "embed_too_many_ids": embed({"node_ids": list(range(513))}),
    "embed_body_too_large": embed({"node_ids": [1] * 5000}),
    "embed_empty_body": embed(b""),
    "embed_deadline_passed": embed({"node_ids": [1], "timeout_ms": 0.001}),
    "infer_json": infer_json([ids_tensor([4, 5])], id="x1", parameters={"exact": True}),
    "infer_no_content_type": ("POST", INFER, orjson.dumps(
        {"inputs": [ids_tensor([4, 5])], "parameters": {"exact": True}}), {}),
    "infer_binary": infer_binary([7, 8, 9]),
    "infer_unknown_model": infer_json([ids_tensor([4])], path="/v2/models/nope/infer"),
    "infer_wrong_dtype": infer_json([ids_tensor([1.0], datatype="FP32")]),
    "infer_wrong_name": infer_json([{**ids_tensor([1]), "name": "x"}]),
    "infer_id_out_of_range": infer_json([ids_tensor([2708])]),
    "infer_bad_json": ("POST", INFER, b'{"inputs": [', dict(JSON)),
    "infer_bad_header_length": infer_binary([1], head_len="99999"),
    "infer_binary_size_mismatch": infer_binary([1, 2], size=8),
    "infer_unknown_output": infer_json([ids_tensor([1])], outputs=[{"name": "logits"}]),
    "infer_too_many_ids": infer_json([ids_tensor(list(range(513)))]),
    "infer_deadline_passed": infer_json([ids_tensor([1])], parameters={"timeout_ms": 0.001}),
    "embed_model_and_version": embed({"node_ids": [2, 3], "exact": True, "model": MODEL,
                                      "version": "1"}),
    "embed_npy_named": embed({"node_ids": [3], "exact": True, "version": 1},
                             accept="application/x-npy"),
    "embed_unknown_model": embed({"node_ids": [1], "model": "nope"}),
    "embed_version_not_loaded": embed({"node_ids": [1], "version": 2}),
    "embed_bad_version": embed({"node_ids": [1], "version": "v1"}),
    "infer_versioned": infer_json([ids_tensor([1])], path=f"/v2/models/{MODEL}/versions/1/infer",
                                  parameters={"exact": True}),
    "infer_version_not_loaded": infer_json([ids_tensor([1])],
                                           path=f"/v2/models/{MODEL}/versions/2/infer"),
    "infer_bad_version": infer_json([ids_tensor([1])], path=f"/v2/models/{MODEL}/versions/x/infer"),
    "infer_versioned_unknown_model": infer_json([ids_tensor([1])],
                                                path="/v2/models/nope/versions/1/infer"),
}
OTHER_CASES = {  # not the hot routes: FastAPI answers them in both apps
    "embed_get": ("GET", "/v1/embed", b"", {}),
    "embed_trailing_slash": embed({"node_ids": [1]})[:1] + ("/v1/embed/",) + embed({"node_ids": [1]})[2:],
    "infer_empty_name": infer_json([ids_tensor([1])], path="/v2/models//infer"),
    "infer_empty_version": infer_json([ids_tensor([1])], path=f"/v2/models/{MODEL}/versions//infer"),
    "infer_versions_no_version": infer_json([ids_tensor([1])],
                                            path=f"/v2/models/{MODEL}/versions/infer"),
    "model_metadata": ("GET", f"/v2/models/{MODEL}", b"", {}),
    "version_metadata": ("GET", f"/v2/models/{MODEL}/versions/1", b"", {}),
    "version_ready": ("GET", f"/v2/models/{MODEL}/versions/1/ready", b"", {}),
    "server_metadata": ("GET", "/v2", b"", {}),
}


def both(apps: tuple[Any, Any, Pipeline], case: tuple) -> tuple[dict, dict]:
    fast, slow, _ = apps
    method, path, body, headers = case

    async def run() -> tuple[dict, dict]:
        return (await call(fast, method, path, body, headers),
                await call(slow, method, path, body, headers))

    return asyncio.run(run())


@pytest.mark.parametrize("name", sorted(HOT_CASES))
def test_hot_route_answers_are_fastapis_byte_for_byte(apps: tuple, name: str) -> None:
    fast_app = apps[0]
    both(apps, OTHER_CASES["server_metadata"])  # the middleware stack is built on a first call
    before = fast_app.state.hot_routes.answered
    got, want = both(apps, HOT_CASES[name])
    assert (got["status"], got["headers"], got["body"]) == \
        (want["status"], want["headers"], want["body"]), name
    if len(HOT_CASES[name][2]) > MAX_BODY_BYTES:  # the guards answer before either layer
        assert want["status"] == 413
        return
    assert "endpoint" in want["scope"]  # FastAPI's router routed the slow app's request
    assert "endpoint" not in got["scope"], "the fast app's request went through FastAPI's router"
    assert fast_app.state.hot_routes.answered == before + 1


def test_hot_routes_cover_every_error_class(apps: tuple) -> None:
    """Not vacuous: the cases above reach 200, 400, 404, 413 and 422 on both routes."""
    statuses: dict[str, set[int]] = {"/v1": set(), "/v2": set()}
    for case in HOT_CASES.values():
        got, _ = both(apps, case)
        statuses[case[1][:3]].add(got["status"])
    assert statuses["/v1"] >= {200, 400, 413, 422, 504}, statuses
    assert statuses["/v2"] >= {200, 400, 404, 413, 422, 504}, statuses


def test_kserve_errors_are_kserve_bodies_and_v1_errors_ours(apps: tuple) -> None:
    got, _ = both(apps, HOT_CASES["infer_unknown_model"])
    assert got["status"] == 404 and set(orjson.loads(got["body"])) == {"error"}
    assert isinstance(orjson.loads(got["body"])["error"], str)
    got, _ = both(apps, HOT_CASES["embed_float_id"])
    assert got["status"] == 422 and set(orjson.loads(got["body"])["error"]) == {"code", "message"}
    got, _ = both(apps, HOT_CASES["infer_binary"])
    headers = dict(got["headers"])
    assert got["status"] == 200 and headers[b"content-type"] == b"application/octet-stream"
    head = int(headers[b"inference-header-content-length"])
    assert np.frombuffer(got["body"][head:], dtype="<f4").size == 3 * 64


@pytest.mark.parametrize("name", sorted(OTHER_CASES))
def test_other_requests_reach_fastapi(apps: tuple, name: str) -> None:
    fast_app = apps[0]
    before = fast_app.state.hot_routes.answered
    got, want = both(apps, OTHER_CASES[name])
    assert (got["status"], got["headers"], got["body"]) == \
        (want["status"], want["headers"], want["body"]), name
    assert fast_app.state.hot_routes.answered == before


def test_disconnect_while_waiting_cancels_as_before(apps: tuple, monkeypatch: Any) -> None:
    """The client goes away after sending the body, before its answer: 499 in both, and the
    request cancelled in the pipeline (not computed for nobody). The answer a caller awaits is
    held back until the test ends, so "before its answer" holds however fast the engine is."""
    fast, slow, pipeline = apps
    submit, cancel = pipeline.submit_ids_async, pipeline.cancel
    held: list[tuple[str, Any]] = []
    cancelled: list[str] = []

    def held_submit(*args: Any, **kwargs: Any) -> tuple[str, Any]:
        request_id, _answer = submit(*args, **kwargs)
        gate = asyncio.get_running_loop().create_future()
        held.append((request_id, gate))
        return request_id, gate

    def spy_cancel(request_id: str, *args: Any) -> bool:
        cancelled.append(request_id)
        return bool(cancel(request_id, *args))

    monkeypatch.setattr(pipeline, "submit_ids_async", held_submit)
    monkeypatch.setattr(pipeline, "cancel", spy_cancel)
    method, path, body, headers = embed({"node_ids": list(range(400)), "exact": True})

    async def run() -> tuple[dict, dict]:
        try:
            return (await call(fast, method, path, body, headers, gone_after_body=True),
                    await call(slow, method, path, body, headers, gone_after_body=True))
        finally:
            for _, gate in held:
                gate.cancel()

    got, want = asyncio.run(run())
    assert got["status"] == want["status"] == 499
    assert got["body"] == want["body"]
    assert orjson.loads(got["body"])["error"]["code"] == "client_disconnected"
    assert cancelled == [request_id for request_id, _ in held] and len(cancelled) == 2


def test_disconnect_mid_body_is_499_not_an_internal_error(apps: tuple) -> None:
    """FastAPI's route turns Starlette's ClientDisconnect into a logged 500; the fast layer
    answers (nobody) 499 client_disconnected, as for a disconnect after the body."""
    method, path, body, headers = embed({"node_ids": [1, 2, 3]})
    got = asyncio.run(call(apps[0], method, path, body, headers, gone_before_body=True))
    assert got["status"] == 499
    assert orjson.loads(got["body"])["error"]["code"] == "client_disconnected"


def test_latency_metric_keeps_the_route_templates(apps: tuple) -> None:
    fast = apps[0]

    def count(endpoint: str, status: str) -> float:
        # this app's own histogram: two apps in one process share the multiprocess files
        for metric in fast.state.qs.metrics.request_duration.collect():
            for s in metric.samples:
                if s.name.endswith("request_duration_seconds_count") and \
                        s.labels == {"endpoint": endpoint, "status": status}:
                    return s.value
        return 0.0

    cases = [(HOT_CASES["embed_json"], "/v1/embed", "200"),
             (HOT_CASES["infer_unknown_model"], "/v2/models/{name}/infer", "404"),
             (HOT_CASES["infer_versioned"], "/v2/models/{name}/versions/{version}/infer", "200")]
    for case, endpoint, status in cases:
        before = count(endpoint, status)
        method, path, body, headers = case
        asyncio.run(call(fast, method, path, body, headers))
        assert count(endpoint, status) == before + 1, (endpoint, status)


def test_answers_name_the_model_version(apps: tuple) -> None:
    """JSON answers name the model and version in the body; .npy answers in headers."""
    got, _ = both(apps, HOT_CASES["embed_model_and_version"])
    body = orjson.loads(got["body"])
    assert (body["model"], body["model_version"], body["dim"]) == (MODEL, "1", 64)
    got, _ = both(apps, HOT_CASES["embed_npy_named"])
    headers = dict(got["headers"])
    assert (headers[b"x-model-name"], headers[b"x-model-version"]) == (MODEL.encode(), b"1")
    got, _ = both(apps, HOT_CASES["infer_versioned"])
    assert orjson.loads(got["body"])["model_version"] == "1"
    for name, status in [("embed_unknown_model", 404), ("embed_version_not_loaded", 404),
                         ("infer_version_not_loaded", 404), ("infer_bad_version", 400),
                         ("infer_versioned_unknown_model", 404)]:
        got, _ = both(apps, HOT_CASES[name])
        assert got["status"] == status, (name, got["body"])


def test_openapi_still_documents_the_hot_routes(apps: tuple) -> None:
    paths = apps[0].openapi()["paths"]
    assert "post" in paths["/v1/embed"] and "post" in paths["/v2/models/{name}/infer"]
    assert "post" in paths["/v2/models/{name}/versions/{version}/infer"]
    body = paths["/v2/models/{name}/infer"]["post"]["requestBody"]["content"]
    assert set(body) == {"application/json", "application/octet-stream"}


def test_draining_refusals_are_the_same(apps: tuple) -> None:
    """Last test of the module (it drains the pipeline): 503 with Retry-After from both."""
    apps[2].begin_drain()
    for name in ("embed_json", "infer_binary"):
        got, want = both(apps, HOT_CASES[name])
        assert got["status"] == want["status"] == 503, name
        assert (got["headers"], got["body"]) == (want["headers"], want["body"]), name
        assert (b"retry-after", b"1") in got["headers"], got["headers"]

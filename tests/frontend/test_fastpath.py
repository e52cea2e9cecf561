"""The hot routes' answers (``frontend/fastpath.py``), through the app's ASGI adapter.

One in-process pipeline (Cora, the default model) and one app. Every case is sent as raw ASGI,
as an ASGI server without the daemon's HTTP protocol hands it over: the status, the headers the
answer needs and the body are checked against what a client depends on, and FastAPI's router
must not have been entered for a hot route (Starlette sets ``scope["endpoint"]`` when it routes;
FastAPI only documents these routes). The protocol's own cases are tests/frontend/test_hot_protocol.py.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import orjson
import pytest

from quiver_serve import errors
from quiver_serve.config import ServerConfig
from quiver_serve.engine.client.pipeline import Pipeline
from quiver_serve.frontend.app import create_app
from tests.conftest import small_config

pytestmark = pytest.mark.e2e

MODEL = "cora-graphsage"
INFER = f"/v2/models/{MODEL}/infer"
JSON = {"content-type": "application/json"}
MAX_BODY_BYTES = 32768
DIM = 64


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Any, Pipeline]]:
    cfg = small_config(server__max_request_nodes=512, server__max_body_bytes=MAX_BODY_BYTES,
                       server__start_timeout_s=400.0)
    pipeline = Pipeline(cfg)
    app = create_app(cfg, pipeline)
    pipeline.start()
    try:
        yield app, pipeline
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
    return {"status": start["status"], "headers": dict(start["headers"]), "body": body_out,
            "scope": scope}


def run(app: Any, case: tuple, **kw: Any) -> dict[str, Any]:
    method, path, body, headers = case
    return asyncio.run(call(app, method, path, body, headers, **kw))


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


def new_node(neighbors: list[int]) -> dict[str, Any]:
    return {"features": [0.0] * 1433, "in_neighbors": neighbors}


#: name -> (request, status, error code of a /v1 refusal or None)
CASES: dict[str, tuple[tuple, int, str | None]] = {
    "embed_json": (embed({"node_ids": [0, 1, 2707, 1], "exact": True}), 200, None),
    "embed_npy": (embed({"node_ids": [3, 3], "exact": True}, accept="application/x-npy"), 200,
                  None),
    "embed_seeded": (embed({"node_ids": [5, 6], "seed": 7}), 200, None),
    "embed_new_nodes_alone": (embed({"new_nodes": [new_node([1, 2])], "exact": True}), 200,
                              None),
    "embed_ids_and_new_nodes": (embed({"node_ids": [4], "new_nodes": [new_node([4])]}), 200,
                                None),
    "embed_nothing": (embed({}), 422, "invalid_request"),
    "embed_no_ids": (embed({"node_ids": []}), 422, "invalid_request"),
    "embed_bad_json": (embed(b'{"node_ids": [1,'), 422, "invalid_request"),
    "embed_float_id": (embed({"node_ids": [1.5]}), 422, "invalid_request"),
    "embed_string_id": (embed({"node_ids": ["3"]}), 422, "invalid_request"),
    "embed_bool_id": (embed({"node_ids": [True]}), 422, "invalid_request"),
    "embed_unknown_field": (embed({"nodes": [1]}), 422, "invalid_request"),
    "embed_negative_seed": (embed({"node_ids": [1], "seed": -1}), 422, "invalid_request"),
    "embed_zero_timeout": (embed({"node_ids": [1], "timeout_ms": 0}), 422, "invalid_request"),
    "embed_id_too_big": (embed({"node_ids": [2708]}), 400, "invalid_node_ids"),
    "embed_id_negative": (embed({"node_ids": [-1]}), 400, "invalid_node_ids"),
    "embed_id_beyond_int64": (embed({"node_ids": [2**70]}), 400, "invalid_node_ids"),
    "embed_too_many_ids": (embed({"node_ids": list(range(513))}), 413, "too_many_nodes"),
    "embed_body_too_large": (embed({"node_ids": [1] * 20000}), 413, "body_too_large"),
    "embed_empty_body": (embed(b""), 422, "invalid_request"),
    "embed_deadline_passed": (embed({"node_ids": [1], "timeout_ms": 0.001}), 504, None),
    "embed_unknown_model": (embed({"node_ids": [1], "model": "nope"}), 404, None),
    "embed_version_not_loaded": (embed({"node_ids": [1], "version": 2}), 404, None),
    "embed_bad_version": (embed({"node_ids": [1], "version": "v1"}), 422, "invalid_request"),
    "infer_json": (infer_json([ids_tensor([4, 5])], id="x1", parameters={"exact": True}), 200,
                   None),
    "infer_no_content_type": (("POST", INFER, orjson.dumps(
        {"inputs": [ids_tensor([4, 5])], "parameters": {"exact": True}}), {}), 200, None),
    "infer_binary": (infer_binary([7, 8, 9]), 200, None),
    "infer_versioned": (infer_json([ids_tensor([1])], path=f"/v2/models/{MODEL}/versions/1/infer",
                                   parameters={"exact": True}), 200, None),
    "infer_unknown_model": (infer_json([ids_tensor([4])], path="/v2/models/nope/infer"), 404,
                            None),
    "infer_wrong_dtype": (infer_json([ids_tensor([1.0], datatype="FP32")]), 422, None),
    "infer_wrong_name": (infer_json([{**ids_tensor([1]), "name": "x"}]), 422, None),
    "infer_id_out_of_range": (infer_json([ids_tensor([2708])]), 400, None),
    "infer_bad_json": (("POST", INFER, b'{"inputs": [', dict(JSON)), 422, None),
    "infer_bad_header_length": (infer_binary([1], head_len="99999"), 400, None),
    "infer_binary_size_mismatch": (infer_binary([1, 2], size=8), 400, None),
    "infer_unknown_output": (infer_json([ids_tensor([1])], outputs=[{"name": "logits"}]), 400,
                             None),
    "infer_too_many_ids": (infer_json([ids_tensor(list(range(513)))]), 413, None),
    "infer_deadline_passed": (infer_json([ids_tensor([1])], parameters={"timeout_ms": 0.001}),
                              504, None),
    "infer_version_not_loaded": (infer_json([ids_tensor([1])],
                                            path=f"/v2/models/{MODEL}/versions/2/infer"), 404,
                                 None),
    "infer_bad_version": (infer_json([ids_tensor([1])],
                                     path=f"/v2/models/{MODEL}/versions/x/infer"), 400, None),
    "infer_versioned_unknown_model": (infer_json([ids_tensor([1])],
                                                 path="/v2/models/nope/versions/1/infer"), 404,
                                      None),
}


def error_of(got: dict[str, Any], path: str) -> str:
    """The refusal's message, checking the body is the route's protocol's error body."""
    body = orjson.loads(got["body"])
    assert got["headers"][b"content-type"] == b"application/json"
    if path.startswith("/v2"):
        assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"]
        return str(body["error"])
    assert set(body["error"]) == {"code", "message"} and body["error"]["message"]
    return str(body["error"]["code"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_hot_case_gets_its_status_and_body(served: tuple, name: str) -> None:
    app = served[0]
    case, status, code = CASES[name]
    got = run(app, case)
    assert got["status"] == status, (name, got["body"][:300])
    assert int(got["headers"][b"content-length"]) == len(got["body"])
    if status != 200:
        message = error_of(got, case[1])
        if code is not None:
            assert message == code, (name, got["body"])
    if status != 413 or code != "body_too_large":  # the guards answer that one, before routing
        assert "endpoint" not in got["scope"], "a hot route went through FastAPI's router"


def test_refusals_name_what_was_wrong(served: tuple) -> None:
    app = served[0]
    got = orjson.loads(run(app, CASES["embed_nothing"][0])["body"])
    assert got["error"]["message"].startswith("node_ids: Field required")
    got = orjson.loads(run(app, CASES["embed_id_too_big"][0])["body"])
    assert "2708" in got["error"]["message"]
    got = orjson.loads(run(app, CASES["infer_unknown_model"][0])["body"])
    assert "nope" in got["error"]


def test_json_npy_and_binary_answers_carry_the_same_rows(served: tuple) -> None:
    app = served[0]
    ids = [3, 3, 2707]
    as_json = orjson.loads(run(app, embed({"node_ids": ids, "exact": True}))["body"])
    rows = np.asarray(as_json["embeddings"], dtype=np.float32)
    assert (as_json["model"], as_json["model_version"], as_json["dim"]) == (MODEL, "1", DIM)
    assert rows.shape == (3, DIM) and np.array_equal(rows[0], rows[1])
    npy = run(app, embed({"node_ids": ids, "exact": True}, accept="application/x-npy"))
    assert npy["headers"][b"content-type"] == b"application/x-npy"
    assert (npy["headers"][b"x-model-name"], npy["headers"][b"x-model-version"]) == \
        (MODEL.encode(), b"1")
    assert np.array_equal(np.load(io.BytesIO(npy["body"])), rows)
    binary = run(app, infer_binary(ids))
    assert binary["headers"][b"content-type"] == b"application/octet-stream"
    head = int(binary["headers"][b"inference-header-content-length"])
    meta = orjson.loads(binary["body"][:head])
    assert meta["outputs"][0]["shape"] == [3, DIM] and meta["model_name"] == MODEL
    assert np.array_equal(np.frombuffer(binary["body"][head:], "<f4").reshape(3, DIM), rows)


def test_new_nodes_alone_get_one_row_each(served: tuple) -> None:
    app = served[0]
    body = orjson.loads(run(app, embed({"new_nodes": [new_node([1]), new_node([2, 3])],
                                        "exact": True}))["body"])
    assert np.asarray(body["embeddings"]).shape == (2, DIM)
    both_ways = orjson.loads(run(app, embed({"node_ids": [], "new_nodes": [new_node([1])],
                                             "exact": True}))["body"])
    assert np.allclose(both_ways["embeddings"][0], body["embeddings"][0], atol=1e-5)


def test_the_queue_api_takes_new_nodes_without_node_ids(served: tuple) -> None:
    pipeline = served[1]
    rows = pipeline.embed(new_nodes=[new_node([1, 2])], exact=True)
    assert tuple(rows.shape) == (1, DIM)
    rows_async = asyncio.run(pipeline.embed_async(new_nodes=[new_node([1, 2])], exact=True))
    assert np.allclose(rows_async.numpy(), rows.numpy(), atol=1e-5)
    with pytest.raises(errors.ServeError) as refused:
        pipeline.embed()
    assert refused.value.info.status == 400 and "node_ids" in refused.value.info.message


def test_other_methods_and_paths(served: tuple) -> None:
    """A hot path with another method is 405 naming the method it takes; a path that is not
    a hot route goes on to FastAPI."""
    app = served[0]
    got = run(app, ("GET", "/v1/embed", b"", {}))
    assert got["status"] == 405 and got["headers"][b"allow"] == b"POST"
    assert error_of(got, "/v1/embed") == "method_not_allowed"
    got = run(app, ("GET", INFER, b"", {}))
    assert got["status"] == 405 and "POST" in error_of(got, INFER)
    for path in ("/v1/embed/", "/v2/models//infer", f"/v2/models/{MODEL}/versions//infer"):
        got = run(app, ("POST", path, b"{}", dict(JSON)))
        assert got["status"] == 404 and "endpoint" not in got["scope"], path
    for path in (f"/v2/models/{MODEL}", f"/v2/models/{MODEL}/versions/1", "/v2"):
        got = run(app, ("GET", path, b"", {}))
        assert got["status"] == 200 and "endpoint" in got["scope"], path


def test_disconnect_while_waiting_cancels_the_request(served: tuple, monkeypatch: Any) -> None:
    """The client goes away after sending the body, before its answer: 499 (to nobody), and the
    request cancelled in the pipeline (not computed for nobody). The answer is held back until
    the test ends, so "before its answer" holds however fast the engine is."""
    app, pipeline = served
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

    async def go() -> dict:
        try:
            return await call(app, method, path, body, headers, gone_after_body=True)
        finally:
            for _, gate in held:
                gate.cancel()

    got = asyncio.run(go())
    assert got["status"] == 499
    assert orjson.loads(got["body"])["error"]["code"] == "client_disconnected"
    assert cancelled == [request_id for request_id, _ in held] and len(cancelled) == 1


def test_disconnect_mid_body_is_499_not_an_internal_error(served: tuple) -> None:
    got = run(served[0], embed({"node_ids": [1, 2, 3]}), gone_before_body=True)
    assert got["status"] == 499
    assert orjson.loads(got["body"])["error"]["code"] == "client_disconnected"


def latency_count(app: Any, endpoint: str, status: str) -> float:
    for metric in app.state.qs.metrics.request_duration.collect():
        for s in metric.samples:
            if s.name.endswith("request_duration_seconds_count") and \
                    s.labels == {"endpoint": endpoint, "status": status}:
                return float(s.value)
    return 0.0


def test_latency_metric_labels_are_the_route_templates(served: tuple) -> None:
    app = served[0]
    cases = [(CASES["embed_json"][0], "/v1/embed", "200"),
             (CASES["infer_unknown_model"][0], "/v2/models/{name}/infer", "404"),
             (CASES["infer_versioned"][0], "/v2/models/{name}/versions/{version}/infer", "200"),
             (CASES["embed_body_too_large"][0], "unmatched", "413")]
    for case, endpoint, status in cases:
        before = latency_count(app, endpoint, status)
        run(app, case)
        assert latency_count(app, endpoint, status) == before + 1, (endpoint, status)


def test_openapi_documents_the_hot_routes(served: tuple) -> None:
    paths = served[0].openapi()["paths"]
    embed_doc = paths["/v1/embed"]["post"]
    schema = embed_doc["requestBody"]["content"]["application/json"]["schema"]
    assert "node_ids" in schema["properties"] and "node_ids" not in schema.get("required", [])
    assert "application/x-npy" in embed_doc["responses"]["200"]["content"]
    for template in ("/v2/models/{name}/infer", "/v2/models/{name}/versions/{version}/infer"):
        body = paths[template]["post"]["requestBody"]["content"]
        assert set(body) == {"application/json", "application/octet-stream"}
        assert {"404", "422", "503"} <= set(paths[template]["post"]["responses"])


def test_an_old_config_with_fast_routes_is_accepted_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="quiver_serve.config"):
        server = ServerConfig.model_validate({"fast_routes": False, "port": 8123})
    assert server.port == 8123 and not hasattr(server, "fast_routes")
    assert any("server.fast_routes is deprecated and ignored" in r.message
               for r in caplog.records)


def test_draining_refuses_with_retry_after(served: tuple) -> None:
    """Last test of the module (it drains the pipeline): 503 with Retry-After."""
    app, pipeline = served
    pipeline.begin_drain()
    for name in ("embed_json", "infer_binary"):
        got = run(app, CASES[name][0])
        assert got["status"] == 503, name
        assert got["headers"][b"retry-after"] == b"1", got["headers"]

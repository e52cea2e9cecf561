"""KServe v2 with real clients: Triton's ``tritonclient`` (http and grpc) against the real server.

Liveness, readiness, server and model metadata, inference with JSON and binary tensors (the
answer equals ``/v1/embed``'s), errors raised by the client with our message (KServe's
``{"error": "<message>"}``; gRPC status codes), the binary extension's edge cases over raw HTTP,
and the gRPC messages' wire format against tritonclient's compiled proto.
"""

from __future__ import annotations

import json
import re

import httpx
import numpy as np
import pytest

from tests.conftest import ServerProcess, _to_yaml, free_port, small_config

MODEL = "cora-graphsage"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """The real daemon with its gRPC endpoint on (``server.grpc_port``)."""
    tmp = tmp_path_factory.mktemp("kserve")
    cfg = small_config()
    cfg.server.grpc_port = free_port()
    path = tmp / "config.yaml"
    path.write_text(_to_yaml(cfg))
    srv = ServerProcess(path, free_port(), tmp / "server.log")
    srv.grpc_port = cfg.server.grpc_port  # type: ignore[attr-defined]
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def triton(server: ServerProcess):  # noqa: ANN201 - tritonclient's type
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url=server.url.removeprefix("http://"))
    yield client
    client.close()


def _infer(client, ids: list[int], binary_in: bool, binary_out: bool,  # noqa: ANN001
           exact: bool = True) -> np.ndarray:
    import tritonclient.http as httpclient

    node_ids = httpclient.InferInput("node_ids", [len(ids)], "INT64")
    node_ids.set_data_from_numpy(np.asarray(ids, dtype=np.int64), binary_data=binary_in)
    out = httpclient.InferRequestedOutput("embeddings", binary_data=binary_out)
    result = client.infer(MODEL, [node_ids], outputs=[out], parameters={"exact": exact})
    return result.as_numpy("embeddings")


def test_tritonclient_health_and_metadata(triton) -> None:  # noqa: ANN001
    assert triton.is_server_live() and triton.is_server_ready()
    assert triton.is_model_ready(MODEL)
    meta = triton.get_server_metadata()
    assert meta["name"] == "quiver-serve" and "binary_tensor_data" in meta["extensions"]
    model = triton.get_model_metadata(MODEL)
    assert model["inputs"][0]["name"] == "node_ids" and model["outputs"][0]["datatype"] == "FP32"


@pytest.mark.parametrize(("binary_in", "binary_out"), [(False, False), (True, True),
                                                       (True, False), (False, True)])
def test_tritonclient_infer_json_and_binary(triton, server: ServerProcess,  # noqa: ANN001
                                            binary_in: bool, binary_out: bool) -> None:
    ids = [4, 5, 2707, 4]
    got = _infer(triton, ids, binary_in, binary_out)
    direct = httpx.post(server.url + "/v1/embed", json={"node_ids": ids, "exact": True}).json()
    assert got.shape == (4, 64) and got.dtype == np.float32
    np.testing.assert_allclose(got, np.array(direct["embeddings"], dtype=np.float32), atol=1e-6)


def test_tritonclient_sees_our_error_message(triton) -> None:  # noqa: ANN001
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match="node id 99999 is out of range"):
        _infer(triton, [1, 99999], True, True)
    with pytest.raises(InferenceServerException, match="no model named"):
        triton.get_model_metadata("nope")


def _raw(server: ServerProcess, header: dict, tail: bytes, length: int | None = None,
         content_type: str | None = "application/octet-stream") -> httpx.Response:
    head = json.dumps(header).encode()
    headers = {"Inference-Header-Content-Length": str(len(head) if length is None else length)}
    if content_type:
        headers["Content-Type"] = content_type
    return httpx.post(f"{server.url}/v2/models/{MODEL}/infer", content=head + tail,
                      headers=headers)


def test_binary_extension_edge_cases(server: ServerProcess) -> None:
    ids = np.array([1, 2, 3], dtype="<i8")
    good = {"inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [3],
                        "parameters": {"binary_data_size": 24}}],
            "outputs": [{"name": "embeddings", "parameters": {"binary_data": True}}]}
    r = _raw(server, good, ids.tobytes())
    assert r.status_code == 200, r.text
    n = int(r.headers["inference-header-content-length"])
    head = json.loads(r.content[:n])
    assert head["outputs"][0]["parameters"]["binary_data_size"] == 3 * 64 * 4
    assert np.frombuffer(r.content[n:], dtype="<f4").shape == (3 * 64,)
    short = _raw(server, good, ids.tobytes()[:16])  # fewer bytes than binary_data_size
    assert short.status_code == 400 and "binary_data_size" in short.json()["error"]
    wrong = json.loads(json.dumps(good))
    wrong["inputs"][0]["parameters"]["binary_data_size"] = 16
    assert _raw(server, wrong, ids.tobytes()).status_code == 400
    fp32 = json.loads(json.dumps(good))
    fp32["inputs"][0]["datatype"] = "FP32"
    r = _raw(server, fp32, ids.tobytes())
    assert r.status_code == 422 and r.json() == {"error": "node_ids must be INT64, got FP32"}
    assert _raw(server, good, ids.tobytes(), length=10**6).status_code == 400
    other = dict(good, outputs=[{"name": "logits"}])
    assert "unknown output" in _raw(server, other, ids.tobytes()).json()["error"]


def test_kserve_json_without_content_type_and_v2_errors(server: ServerProcess) -> None:
    body = {"inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [2], "data": [1, 2]}]}
    r = httpx.post(f"{server.url}/v2/models/{MODEL}/infer", content=json.dumps(body).encode())
    assert r.status_code == 200 and r.json()["outputs"][0]["shape"] == [2, 64]
    bad = httpx.post(f"{server.url}/v2/models/{MODEL}/infer", content=b'{"inputs": [')
    assert bad.status_code == 422 and isinstance(bad.json()["error"], str)
    missing = httpx.get(f"{server.url}/v2/models/nope")
    assert missing.status_code == 404 and isinstance(missing.json()["error"], str)
    v1 = httpx.post(f"{server.url}/v1/embed", json={"node_ids": [10**6]})
    assert v1.status_code == 400 and v1.json()["error"]["code"] == "invalid_node_ids"


@pytest.fixture(scope="module")
def triton_grpc(server: ServerProcess):  # noqa: ANN201
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url=f"127.0.0.1:{server.grpc_port}")
    yield client
    client.close()


def test_tritonclient_grpc(triton_grpc, server: ServerProcess) -> None:  # noqa: ANN001
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    assert triton_grpc.is_server_live() and triton_grpc.is_server_ready()
    assert triton_grpc.is_model_ready(MODEL)
    assert triton_grpc.get_server_metadata().name == "quiver-serve"
    meta = triton_grpc.get_model_metadata(MODEL)
    assert meta.inputs[0].name == "node_ids" and list(meta.outputs[0].shape) == [-1, 64]
    ids = np.array([4, 5, 2707, 4], dtype=np.int64)
    node_ids = grpcclient.InferInput("node_ids", [4], "INT64")
    node_ids.set_data_from_numpy(ids)
    result = triton_grpc.infer(MODEL, [node_ids], parameters={"exact": True}, request_id="u1",
                               outputs=[grpcclient.InferRequestedOutput("embeddings")])
    response = result.get_response()  # written by hand (grpc/proto.py, infer_response)
    assert (response.id, response.model_name, response.model_version) == ("u1", MODEL, "1")
    direct = httpx.post(server.url + "/v1/embed", json={"node_ids": ids.tolist(), "exact": True})
    np.testing.assert_allclose(result.as_numpy("embeddings"),
                               np.array(direct.json()["embeddings"], dtype=np.float32), atol=1e-6)
    bad = grpcclient.InferInput("node_ids", [2], "INT64")
    bad.set_data_from_numpy(np.array([1, 99999], dtype=np.int64))
    with pytest.raises(InferenceServerException, match="node id 99999 is out of range") as err:
        triton_grpc.infer(MODEL, [bad])
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException, match="no model named") as err:
        triton_grpc.get_model_metadata("nope")
    assert err.value.status() == "StatusCode.NOT_FOUND"
    metrics = httpx.get(server.url + "/metrics").text  # gRPC inference is timed as HTTP is
    for status in ("200", "400"):
        assert re.search(r'quiver_serve_request_duration_seconds_count\{endpoint="grpc '
                         rf'ModelInfer",status="{status}"\}} [1-9]', metrics), status


def test_grpc_messages_match_the_published_proto() -> None:
    """Every message and field (number, type, label) equals tritonclient's compiled proto."""
    from tritonclient.grpc import service_pb2

    from quiver_serve.frontend.grpc import proto as gp

    for name in gp.MESSAGES:
        ours = gp.message(name).DESCRIPTOR
        theirs = service_pb2.DESCRIPTOR.message_types_by_name[name.split(".")[0]]
        for part in name.split(".")[1:]:
            theirs = theirs.nested_types_by_name[part]
        for f in ours.fields:
            t = theirs.fields_by_name[f.name]
            assert (f.number, f.type, f.label) == (t.number, t.type, t.label), f"{name}.{f.name}"
            if f.message_type is not None:
                assert f.message_type.name == t.message_type.name, f"{name}.{f.name}"
    service = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    ours = gp.FILE.services_by_name["GRPCInferenceService"]
    for rpc, (req, resp) in {**gp.RPCS, **gp.STREAMS}.items():
        m, o = service.methods_by_name[rpc], ours.methods_by_name[rpc]
        assert (m.input_type.name, m.output_type.name) == (req, resp)
        assert (o.client_streaming, o.server_streaming) == (m.client_streaming,
                                                            m.server_streaming), rpc
    assert set(gp.STREAMS) == {"ModelStreamInfer"}

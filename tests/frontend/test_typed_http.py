"""The real daemon on the typed Cora (configs/cora_typed.yaml) over HTTP, KServe v2 and gRPC:
``node_type`` names the type of the ids, answers name it, exact rows equal the library's
layer-wise rows, seeded rows the typed sample for that seed, and a wrong type is a 400 naming
the graph's types."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from quiver_serve.sampling.typed import TypedReferenceSampler
from tests.conftest import ServerProcess, _to_yaml, free_port
from tests.engine.test_typed_daemon import typed_config, typed_library

MODEL = "cora-typed-sage"


@pytest.fixture(scope="module")
def library():
    return typed_library()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("typed")
    cfg = typed_config()
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


def test_embed_names_the_type_and_equals_the_library(server: ServerProcess, library) -> None:
    graph, served, full, cfg = library
    r = httpx.post(server.url + "/v1/embed",
                   json={"node_type": "word", "node_ids": [3, 1432], "exact": True}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["node_type"] == "word" and body["dim"] == 64
    np.testing.assert_allclose(body["embeddings"], full["word"][[3, 1432]].numpy(), atol=1e-5)
    ids = [8, 80, 800]
    r = httpx.post(server.url + "/v1/embed",
                   json={"node_type": "paper", "node_ids": ids, "seed": 5}, timeout=60)
    assert r.status_code == 200, r.text
    out = TypedReferenceSampler(graph).sample("paper", torch.tensor(ids), cfg.sampling.fanouts,
                                              seed=5)
    np.testing.assert_allclose(r.json()["embeddings"], served(out).numpy(), atol=1e-5)
    r = httpx.post(server.url + "/v1/embed", headers={"accept": "application/x-npy"},
                   json={"node_type": "paper", "node_ids": ids, "seed": 5}, timeout=60)
    assert r.status_code == 200 and r.headers["x-node-type"] == "paper", r.headers
    np.testing.assert_allclose(np.load(io.BytesIO(r.content)), served(out).numpy(), atol=1e-5)


def test_a_wrong_type_is_a_400_naming_the_types(server: ServerProcess) -> None:
    r = httpx.post(server.url + "/v1/embed", json={"node_type": "author", "node_ids": [1]})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "'author'" in message and "'paper'" in message and "'word'" in message
    r = httpx.post(server.url + "/v1/embed", json={"node_ids": [1]})
    assert r.status_code == 400 and "node_type is required" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/embed", json={"node_type": "word", "node_ids": [2000]})
    assert r.status_code == 400 and "0..1432" in r.json()["error"]["message"]


def test_kserve_and_grpc_take_a_node_type_parameter(server: ServerProcess, library) -> None:
    import tritonclient.grpc as grpcclient

    _, _, full, _ = library
    ids = [0, 7, 2707]
    body = {"inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [3], "data": ids}],
            "parameters": {"exact": True, "node_type": "paper"}}
    r = httpx.post(f"{server.url}/v2/models/{MODEL}/infer", json=body, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["parameters"] == {"node_type": "paper"}
    rows = np.array(answer["outputs"][0]["data"], np.float32).reshape(3, -1)
    np.testing.assert_allclose(rows, full["paper"][ids].numpy(), atol=1e-5)
    body["parameters"]["node_type"] = "venue"
    r = httpx.post(f"{server.url}/v2/models/{MODEL}/infer", json=body, timeout=60)
    assert r.status_code == 400 and "'venue'" in r.json()["error"]
    client = grpcclient.InferenceServerClient(url=f"127.0.0.1:{server.grpc_port}")
    try:
        node_ids = grpcclient.InferInput("node_ids", [2], "INT64")
        node_ids.set_data_from_numpy(np.array([5, 6], np.int64))
        result = client.infer(MODEL, [node_ids],
                              parameters={"exact": True, "node_type": "word"})
        np.testing.assert_allclose(result.as_numpy("embeddings"), full["word"][[5, 6]].numpy(),
                                   atol=1e-5)
    finally:
        client.close()


def test_typed_updates_without_a_type_are_named(server: ServerProcess) -> None:
    r = httpx.post(server.url + "/v1/graph/edges", json={"add": [[0, 1]]})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "['paper', 'has_word', 'word']" in message, message
    r = httpx.post(server.url + "/v1/graph/nodes", json={"features": [[0.0] * 1433]})
    assert r.status_code == 400 and "node_type is required" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/graph/compact")  # taken (decision 0059); nothing new here
    assert r.status_code == 202 and r.json()["version"] == 0, r.text
    ok = httpx.post(server.url + "/v1/embed", json={"node_type": "paper", "node_ids": [1]})
    assert ok.status_code == 200  # serving goes on


def test_front_ends_in_their_own_processes_serve_typed_requests(
        tmp_path: Path, library) -> None:
    """With several HTTP workers the front-ends do not know the types: the engine cores check
    them, with the same 400s."""
    _, _, full, _ = library
    cfg = typed_config()
    cfg.server.http_workers = 2
    path = tmp_path / "config.yaml"
    path.write_text(_to_yaml(cfg))
    srv = ServerProcess(path, free_port(), tmp_path / "server.log")
    try:
        srv.wait_ready()
        r = httpx.post(srv.url + "/v1/embed",
                       json={"node_type": "word", "node_ids": [9], "exact": True}, timeout=60)
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json()["embeddings"], full["word"][[9]].numpy(), atol=1e-5)
        r = httpx.post(srv.url + "/v1/embed", json={"node_type": "author", "node_ids": [1]})
        assert r.status_code == 400 and "'author'" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/embed", json={"node_type": "word", "node_ids": [1433]})
        assert r.status_code == 400 and "0..1432" in r.json()["error"]["message"]
        # a new word through a front-end's graph client, then read at its version
        r = httpx.post(srv.url + "/v1/graph/nodes", json={"node_type": "word", "count": 1})
        assert r.status_code == 200, r.text
        assert r.json()["node_ids"] == [1433] and r.json()["node_type"] == "word"
        r = httpx.post(srv.url + "/v1/graph/edges", json={
            "edge_type": ["paper", "has_word", "word"], "add": [[9, 1433]]})
        assert r.status_code == 200 and r.json()["version"] == 2, r.text
        r = httpx.post(srv.url + "/v1/embed", json={
            "node_type": "word", "node_ids": [1433], "min_version": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["node_type"] == "word", r.text
    finally:
        srv.stop()


def test_new_nodes_of_a_type_are_embedded_as_if_added(server: ServerProcess, library) -> None:
    """A typed inductive request: a new paper with in-neighbours per relation (its reverses
    derived as an update's) answers PyG's full-graph rows of the graph with it added; a relation
    that does not enter the type is a 400, a wrong width a 422, both named."""
    from tests.engine.core.test_typed_inductive import added
    from tests.models.test_typed_models import full_graph

    graph, served, _, _ = library
    feats = [0.0] * graph.feature_width("paper")
    feats[3] = feats[40] = 1.0
    new = [({"cites": [3, 5], "word__rev_has_word__paper": [0, 17]}, feats)]
    body = {"node_type": "paper", "node_ids": [3], "exact": True,
            "new_nodes": [{"features": f, "in_neighbors": n} for n, f in new]}
    r = httpx.post(server.url + "/v1/embed", json=body, timeout=60)
    assert r.status_code == 200, r.text
    other, first = added(graph, "paper", new)
    want = full_graph(served, other)["paper"][[3, *first]]
    np.testing.assert_allclose(r.json()["embeddings"], want.numpy(), atol=1e-5)
    body["new_nodes"][0]["in_neighbors"] = {"writes": [1]}
    r = httpx.post(server.url + "/v1/embed", json=body, timeout=60)
    assert r.status_code == 400 and "paper__cites__paper" in r.json()["error"]["message"]
    body["new_nodes"] = [{"features": [1.0], "in_neighbors": {"cites": [1]}}]
    r = httpx.post(server.url + "/v1/embed", json=body, timeout=60)
    assert r.status_code == 422, r.text

"""The living graph over HTTP (docs/architecture.md, "The living graph" and "Admin plane"): graph
routes, admin guard, min_version, new_nodes.

Two real daemons on free ports, each with its own update log in a temporary folder:
``local`` (one front-end in the main process, next to the writer; a data-plane token and an
admin token) and ``remote`` (``server.http_workers: 2``: the routes run in front-end processes
and reach the writer through the main process's graph service; no tokens, so admin routes
answer loopback clients only). Every contract test runs on both.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from quiver_serve.frontend.guards import Plane, Tokens, authorize
from tests.conftest import ServerProcess, free_port, start_server

pytestmark = [pytest.mark.e2e]

DATA_TOKEN, ADMIN_TOKEN = "data-plane-token", "admin-token"
NUM_FEATURES = 1433  # Cora
MAX_UPDATE_EDGES = 64
MAX_NEW_NODES = 16
MAX_BODY_BYTES = 256 * 1024
REQUEST_TIMEOUT_S = 2.0


@dataclass
class Door:
    srv: ServerProcess
    data: dict[str, str]  # headers of a data-plane call
    admin: dict[str, str]  # headers of an admin call
    grpc_port: int = 0

    def post(self, path: str, body: object = None, admin: bool = True, **kw: object) -> httpx.Response:
        headers = {**(self.admin if admin else self.data), **kw.pop("headers", {})}  # type: ignore[dict-item]
        return httpx.post(self.srv.url + path, json=body, headers=headers, timeout=30, **kw)  # type: ignore[arg-type]

    def raw(self, method: str, path: str, content: bytes, admin: bool = True) -> httpx.Response:
        headers = {**(self.admin if admin else self.data), "content-type": "application/json"}
        return httpx.request(method, self.srv.url + path, content=content, headers=headers,
                             timeout=30)

    def info(self) -> dict:  # type: ignore[type-arg]
        r = httpx.get(self.srv.url + "/v1/graph", headers=self.data, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]


def _start(tmp: Path, workers: int, env: dict[str, str]) -> tuple[ServerProcess, int]:
    grpc_port = free_port()
    srv, _ = start_server(
        tmp, env, server__http_workers=workers, server__request_timeout_s=REQUEST_TIMEOUT_S,
        server__grpc_port=grpc_port,
        server__max_body_bytes=MAX_BODY_BYTES, server__max_request_nodes=64,
        server__admin_token="config-admin-token" if env else None,
        graph__update_log_dir=str(tmp / "graph-log"), graph__max_update_edges=MAX_UPDATE_EDGES,
        graph__max_new_nodes=MAX_NEW_NODES)
    return srv, grpc_port


@pytest.fixture(scope="module")
def doors(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Door]]:
    """Both daemons, started together (their start-ups overlap)."""
    env = {"QUIVER_SERVE_TOKEN": DATA_TOKEN, "QUIVER_SERVE_ADMIN_TOKEN": ADMIN_TOKEN}
    local, local_grpc = _start(tmp_path_factory.mktemp("graph-local"), 1, env)
    remote, remote_grpc = _start(tmp_path_factory.mktemp("graph-remote"), 2, {})
    try:
        data = {"Authorization": f"Bearer {DATA_TOKEN}"}
        local.wait_ready(headers=data)
        remote.wait_ready()
        yield {"local": Door(local, data, {"Authorization": f"Bearer {ADMIN_TOKEN}"}, local_grpc),
               "remote": Door(remote, {}, {}, remote_grpc)}
    finally:
        local.stop()
        remote.stop()


@pytest.fixture(params=["local", "remote"])
def door(request: pytest.FixtureRequest, doors: dict[str, Door]) -> Door:
    return doors[request.param]


def zeros(n: int, width: int = NUM_FEATURES) -> list[list[float]]:
    return [[0.0] * width for _ in range(n)]


def error_of(r: httpx.Response) -> dict[str, str]:
    err = r.json()["error"]
    assert set(err) == {"code", "message"}, err
    return err  # type: ignore[no-any-return]


# ---- the routes' answers ------------------------------------------------------------------------
def test_each_route_answers_its_documented_fields(door: Door) -> None:
    before = door.info()
    assert {"version", "num_nodes", "num_edges", "engines", "staleness_s"} <= set(before)
    r = door.post("/v1/graph/edges", {"add": [[0, 1], [0, 1], [2, 3]]})
    assert r.status_code == 200, r.text
    added = r.json()
    assert set(added) == {"version", "added", "removed", "missing"}
    assert added["version"] == before["version"] + 1 and added["added"] == 3
    r = door.post("/v1/graph/edges", {"remove": [[0, 1], [5, 2707]]})
    assert r.status_code == 200, r.text
    assert (r.json()["removed"], r.json()["missing"]) == (2, 1)  # every copy; one never existed
    assert door.post("/v1/graph/edges", {}).status_code == 200  # both absent: an empty update
    r = door.post("/v1/graph/nodes", {"features": zeros(1)})
    assert r.status_code == 200, r.text
    node = r.json()["node_ids"][0]
    assert node >= before["num_nodes"]
    r = httpx.put(door.srv.url + "/v1/graph/features", headers=door.admin, timeout=30,
                  json={"node_ids": [node, 7], "features": zeros(2)})
    assert r.status_code == 200 and set(r.json()) == {"version"}, r.text
    after = door.info()
    assert after["version"] == r.json()["version"] and after["num_nodes"] >= node + 1
    r = door.post("/v1/graph/compact")
    assert r.status_code in (200, 202) and r.json()["version"] >= after["version"], r.text


@pytest.mark.parametrize("path,body,status,needle", [
    ("/v1/graph/edges", {"add": [[0, 10**6]]}, 400, "1000000"),
    ("/v1/graph/edges", {"remove": [[-3, 1]]}, 400, "-3"),
    ("/v1/graph/edges", {"add": [[0, 2**70]]}, 400, str(2**70)),
    ("/v1/graph/edges", {"add": [[0, 1, 2]]}, 422, "add"),
    ("/v1/graph/edges", {"add": [[0, 1.5]]}, 422, "add"),
    ("/v1/graph/edges", {"edges": [[0, 1]]}, 422, "edges"),
    ("/v1/graph/edges", {"add": [[0, 1]] * (MAX_UPDATE_EDGES + 1)}, 413,
     str(MAX_UPDATE_EDGES)),
    ("/v1/graph/nodes", {"features": zeros(1, 5)}, 422, f"{NUM_FEATURES}"),
    ("/v1/graph/nodes", {"features": [[0.0] * NUM_FEATURES, [0.0] * 3]}, 422, "row 1"),
    ("/v1/graph/nodes", {"features": []}, 422, "features"),
    ("/v1/graph/nodes", {"features": [["a"] * NUM_FEATURES]}, 422, "features"),
    # a count is bounded before anything is allocated (a fuzzer's 2**61 once answered 500)
    ("/v1/graph/nodes", {"count": 2**61}, 413, str(MAX_UPDATE_EDGES)),
    ("/v1/graph/nodes", {"count": 2, "features": zeros(2, NUM_FEATURES)}, 422, "not both"),
    ("/v1/graph/nodes", {"count": 1}, 422, f"{NUM_FEATURES}"),
])
def test_bad_updates_get_a_named_4xx_and_change_nothing(door: Door, path: str, body: object,
                                                        status: int, needle: str) -> None:
    version = door.info()["version"]
    r = door.post(path, body)
    assert r.status_code == status, r.text
    assert needle in error_of(r)["message"]
    assert door.info()["version"] == version


def test_non_finite_features_are_400(door: Door) -> None:
    version = door.info()["version"]
    row = [0.0] * NUM_FEATURES
    row[3] = float("nan")
    body = json.dumps({"features": [[0.0] * NUM_FEATURES, row]}).encode()  # NaN: not strict JSON
    r = door.raw("POST", "/v1/graph/nodes", body)
    assert r.status_code == 400 and "row 1" in error_of(r)["message"], r.text
    body = json.dumps({"node_ids": [4], "features": [[float("inf")] * NUM_FEATURES]}).encode()
    r = door.raw("PUT", "/v1/graph/features", body)
    assert r.status_code == 400 and "infinite" in error_of(r)["message"], r.text
    r = door.raw("PUT", "/v1/graph/features", body.replace(b"Infinity", b"1e999"))
    assert r.status_code == 400, r.text  # beyond float64: inf too
    assert door.info()["version"] == version


def test_oversized_body_is_413(door: Door) -> None:
    r = door.raw("POST", "/v1/graph/edges", b'{"add": [' + b"[1, 2], " * 40_000 + b"[1, 2]]}")
    assert r.status_code == 413 and error_of(r)["code"] == "body_too_large"


def test_full_node_capacity_is_503_with_retry_after(door: Door) -> None:
    r = door.post("/v1/graph/nodes", {"features": zeros(MAX_NEW_NODES + 1)})
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"].isdigit() and error_of(r)["code"] == "overlay_full"


# ---- the admin guard ----------------------------------------------------------------------------
def test_admin_token_opens_admin_routes_and_the_data_token_does_not(doors: dict[str, Door]) -> None:
    door = doors["local"]
    url = door.srv.url
    for path in ("/v1/graph/edges", "/v1/graph/compact", "/admin/features/replace"):
        assert httpx.post(url + path, json={}).status_code == 401, path
        r = httpx.post(url + path, json={}, headers=door.data)
        assert r.status_code == 403 and error_of(r)["code"] == "forbidden", path
        r = httpx.post(url + path, json={}, headers={"Authorization": "Bearer config-admin-token"})
        assert r.status_code == 401, path  # the environment's admin token wins over the config's
    assert door.post("/v1/graph/edges", {}).status_code == 200
    assert httpx.get(url + "/v1/graph", headers=door.data).status_code == 200  # data plane
    assert httpx.get(url + "/v1/graph", headers=door.admin).status_code == 401
    assert door.post("/v1/embed", {"node_ids": [1]}, admin=False).status_code == 200


def test_without_an_admin_token_only_loopback_clients_pass() -> None:
    none_set, data_only = Tokens(None, None), Tokens(b"Bearer x", None)
    for client in (("127.0.0.1", 5000), ("::1", 5000), ("::ffff:127.0.0.1", 5000)):
        assert authorize(Plane.ADMIN, b"", client, none_set) is None, client
    for client in (("10.1.2.3", 5000), ("192.168.0.7", 1), ("2001:db8::1", 1), None,
                   ("testclient", 50000)):
        refused = authorize(Plane.ADMIN, b"Bearer x", client, data_only)
        assert refused is not None and refused.status == 403, client  # the data token: no use
    admin = Tokens(None, b"Bearer admin")
    assert authorize(Plane.ADMIN, b"Bearer admin", ("10.1.2.3", 1), admin) is None  # any client
    assert authorize(Plane.ADMIN, b"", ("127.0.0.1", 1), admin).status == 401  # type: ignore[union-attr]


# ---- min_version and new nodes on /v1/embed -----------------------------------------------------
def test_min_version_waits_until_the_deadline_and_a_current_one_answers(door: Door) -> None:
    version = door.info()["version"]
    r = door.post("/v1/embed", {"node_ids": [1, 2], "min_version": version}, admin=False)
    assert r.status_code == 200 and len(r.json()["embeddings"]) == 2, r.text
    t0 = time.monotonic()
    r = door.post("/v1/embed", {"node_ids": [1], "min_version": version + 1000}, admin=False)
    waited_s = time.monotonic() - t0
    assert r.status_code == 504, r.text
    assert REQUEST_TIMEOUT_S - 0.2 < waited_s < REQUEST_TIMEOUT_S + 2.0, waited_s
    infer = {"inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [1], "data": [3]}],
             "parameters": {"min_version": version}}
    r = door.post("/v2/models/cora-graphsage/infer", infer, admin=False)
    assert r.status_code == 200, r.text
    r = door.post("/v1/embed", {"node_ids": [1], "min_version": -1}, admin=False)
    assert r.status_code == 422 and "min_version" in error_of(r)["message"]


def test_min_version_over_grpc(door: Door) -> None:
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    version = door.info()["version"]
    client = grpcclient.InferenceServerClient(url=f"127.0.0.1:{door.grpc_port}")
    ids = grpcclient.InferInput("node_ids", [2], "INT64")
    ids.set_data_from_numpy(np.array([0, 1]))
    headers = {k.lower(): v for k, v in door.data.items()}
    try:
        out = client.infer("cora-graphsage", [ids], headers=headers,
                           parameters={"min_version": version}).as_numpy("embeddings")
        assert out.shape == (2, 64)
        with pytest.raises(InferenceServerException, match="deadline"):
            client.infer("cora-graphsage", [ids], headers=headers,
                         parameters={"min_version": version + 1000})
    finally:
        client.close()


def test_added_nodes_get_consecutive_ids_and_are_served_after_the_ack(door: Door) -> None:
    r = door.post("/v1/graph/nodes", {"features": [[0.5] * NUM_FEATURES, [0.25] * NUM_FEATURES]})
    assert r.status_code == 200, r.text
    ack = r.json()
    first = ack["node_ids"][0]
    assert ack["node_ids"] == [first, first + 1]
    for _ in range(4):  # fresh connections: with two front-ends, either may answer
        r = door.post("/v1/embed", {"node_ids": ack["node_ids"], "min_version": ack["version"],
                                    "exact": True}, admin=False)
        assert r.status_code == 200 and len(r.json()["embeddings"]) == 2, r.text
    r = door.post("/v1/embed", {"node_ids": [10**7]}, admin=False)  # past the capacity: the door
    assert r.status_code == 400 and "10000000" in error_of(r)["message"]
    unborn = 2708 + MAX_NEW_NODES - 1  # below the capacity, never added: the engine core refuses
    r = door.post("/v1/embed", {"node_ids": [unborn]}, admin=False)
    assert r.status_code == 400 and str(unborn) in error_of(r)["message"], r.text


def new_node(rng: np.random.Generator, neighbors: list[int]) -> dict[str, object]:
    return {"features": rng.random(NUM_FEATURES).round(3).tolist(), "in_neighbors": neighbors}


def test_inductive_rows_follow_the_id_rows(door: Door) -> None:
    rng = np.random.default_rng(0)
    body = {"node_ids": [0, 1, 2], "new_nodes": [new_node(rng, [0, 5]), new_node(rng, [])]}
    r = door.post("/v1/embed", body, admin=False)
    assert r.status_code == 200 and len(r.json()["embeddings"]) == 5, r.text
    r = door.post("/v1/embed", {"node_ids": [], "new_nodes": [new_node(rng, [3])]}, admin=False)
    assert r.status_code == 200 and len(r.json()["embeddings"]) == 1, r.text


@pytest.mark.parametrize("ids,new_nodes,status,needle", [
    ([0], [{"features": [0.0] * NUM_FEATURES}, {"features": [0.0] * 7}], 422, "new_nodes[1]"),
    ([0], [{"features": [0.0] * NUM_FEATURES, "in_neighbors": [1, 10**7]}], 400, "10000000"),
    ([0], [{"features": [0.0] * NUM_FEATURES, "in_neighbors": [-2]}], 400, "-2"),
    ([0], [{"features": [0.0] * NUM_FEATURES, "neighbors": [1]}], 422, "neighbors"),
    (list(range(60)), [{"features": [0.0] * NUM_FEATURES}] * 5, 413, "65 rows"),
    ([], [], 422, "node_ids"),
])
def test_inductive_input_is_checked_at_the_door(door: Door, ids: list[int], new_nodes: object,
                                                status: int, needle: str) -> None:
    r = door.post("/v1/embed", {"node_ids": ids, "new_nodes": new_nodes}, admin=False)
    assert r.status_code == status, r.text
    assert needle in error_of(r)["message"]


def test_inductive_nan_feature_is_400(door: Door) -> None:
    features = [0.0] * NUM_FEATURES
    features[9] = float("nan")
    body = json.dumps({"node_ids": [1], "new_nodes": [{"features": [0.0] * NUM_FEATURES},
                                                      {"features": features}]}).encode()
    r = door.raw("POST", "/v1/embed", body, admin=False)
    assert r.status_code == 400 and "new_nodes[1]" in error_of(r)["message"], r.text


def test_an_inductive_row_equals_the_row_of_the_node_once_added(door: Door) -> None:
    """Exact mode: embedding a node as if added with in-edges from 5 and 633 gives the row the
    node has once it is added with those edges (PyG equality is the engine's own test)."""
    rng = np.random.default_rng(1)
    node = new_node(rng, [5, 633])
    r = door.post("/v1/embed", {"node_ids": [], "new_nodes": [node], "exact": True}, admin=False)
    assert r.status_code == 200, r.text
    inductive = np.array(r.json()["embeddings"][0])
    added = door.post("/v1/graph/nodes", {"features": [node["features"]]}).json()
    v = added["node_ids"][0]
    ack = door.post("/v1/graph/edges", {"add": [[5, v], [633, v]]}).json()
    r = door.post("/v1/embed", {"node_ids": [v], "exact": True, "min_version": ack["version"]},
                  admin=False)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(np.array(r.json()["embeddings"][0]), inductive, atol=1e-5,
                               rtol=1e-5)

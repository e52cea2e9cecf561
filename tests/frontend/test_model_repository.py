"""The model repository over KServe v2 / Triton's repository extension (docs/architecture.md,
"Models and versions"), driven by
``tritonclient`` (http and grpc) unchanged.

Two servers, one per part, each started once for the module:

* ``door``: the real app (HTTP on uvicorn, gRPC on its loop) in a thread of this process, in
  front of a fake engine side (:class:`FakePipeline`): a model manager with the manager's
  contract (index / load / unload, errors with their statuses) and rows that say which version
  computed them. It checks the front door alone: routes, parsing, the admin guard, error
  mapping, the answers' model and version, over both protocols.
* ``daemon``: the real daemon with a repository in a temporary folder (model ``sage``: Cora's
  GraphSAGE, version 1 = quiver_serve/defaults/cora_graphsage.pt, version 2 = the same weights with the last
  layer scaled by 2, so its exact rows are twice version 1's). It checks the whole path.

Both have a data-plane token and an admin token; repository calls carry the admin token.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from quiver_serve import errors
from quiver_serve.config import DEFAULTS_DIR
from quiver_serve.messages import EmbedResult
from tests.conftest import ServerProcess, free_port, small_config, start_server

DATA_TOKEN, ADMIN_TOKEN = "data-plane-token", "admin-token"
DATA = {"authorization": f"Bearer {DATA_TOKEN}"}
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
NUM_NODES, DIM = 50, 4


# ---- the fake engine side ------------------------------------------------------------------------
class FakeManager:
    """The model manager's contract over a fake repository: ``sage`` has versions 1 and 2 on
    disk (3 is broken), ``gcn`` has version 1; ``sage`` v1 and v2 are loaded at start."""

    ON_DISK = {"sage": [1, 2, 3], "gcn": [1]}
    BROKEN = {("sage", 3): "version 3: model.pt holds non-finite weights (convs.1.lin_l.weight)"}

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.reset()

    def reset(self) -> None:
        self.loaded: dict[str, dict[int, str]] = {"sage": {1: "READY", 2: "READY"}, "gcn": {}}
        self.traffic: dict[str, dict[int, float]] = {"sage": {1: 0.5, 2: 0.5}, "gcn": {}}

    async def call(self, op: str, params: dict[str, Any]) -> dict[str, Any]:
        self.calls.append((op, params))
        if op == "index":
            rows = [{"name": n, "version": v, "state": self.loaded[n].get(v, "UNAVAILABLE"),
                     "reason": "" if v in self.loaded[n] else "unloaded"}
                    for n, versions in self.ON_DISK.items() for v in versions]
            return {"models": [r for r in rows if not params["ready"] or r["state"] == "READY"]}
        name = params["name"]
        if name not in self.ON_DISK:
            raise errors.ServeError("model_not_found", f"no model {name!r} in the repository", 404)
        return self._load(name, params["config"]) if op == "load" else self._unload(name)

    def _load(self, name: str, config: dict[str, Any] | None) -> dict[str, Any]:
        config = config or {}
        if set(config) - {"version_policy", "traffic"}:
            raise errors.ServeError("invalid_model_config", f"config keys {sorted(config)}: only "
                                    "version_policy and traffic", 400)
        wanted = config.get("version_policy", {}).get("specific", self.ON_DISK[name][:2])
        for v in wanted:
            if (name, v) in self.BROKEN:
                raise errors.ServeError("model_load_failed", f"model {name!r} load failed: "
                                        f"{self.BROKEN[(name, v)]}", 400)
        self.loaded[name] = {v: "READY" for v in wanted}
        self.traffic[name] = {v: 1.0 / len(wanted) for v in wanted}
        return self._result(name)

    def _unload(self, name: str) -> dict[str, Any]:
        self.loaded[name], self.traffic[name] = {}, {}
        return self._result(name)

    def _result(self, name: str) -> dict[str, Any]:
        return {"name": name, "traffic": {str(v): w for v, w in self.traffic[name].items()},
                "versions": {str(v): {"state": s, "reason": ""}
                             for v, s in self.loaded[name].items()}}

    def state(self) -> dict[str, Any]:
        return {"default": "sage", "models": {name: {
            "platform": "pytorch_geometric", "class": "GraphSAGE",
            "kwargs": {"hidden_channels": 8, "num_layers": 2, "out_channels": DIM},
            "num_layers": 2, "fanouts": [5, 5],
            "versions": {str(v): {"state": s, "reason": "", "dim": DIM,
                                  "traffic": self.traffic[name].get(v, 0.0),
                                  "state_dict": f"{name}/{v}/model.pt"}
                         for v, s in self.loaded[name].items()}}
            for name in self.ON_DISK}}


def fake_rows(ids: np.ndarray, version: int) -> np.ndarray:
    """What the fake engine answers: row i of version v is (id + 1) * v in every column."""
    return np.repeat((ids.astype(np.float32)[:, None] + 1) * version, DIM, axis=1)


class FakePipeline:
    """What the app needs from a pipeline (``ClientFacade`` and the model interface)."""

    def __init__(self) -> None:
        self.manager = FakeManager()
        self.model_ops = self.manager
        self.ready = self.engines_ready = True
        self.num_nodes = self.node_capacity = NUM_NODES
        self.num_features, self.out_dim = 8, DIM
        self.pending_count = 0
        self.observer: Any = None
        self.submitted: list[tuple[str, int]] = []

    @property
    def models_state(self) -> dict[str, Any]:
        return self.manager.state()

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def refusal(self) -> errors.ServeError:
        return errors.unavailable("not_ready", "the server is starting up")

    def workers(self) -> list[dict[str, Any]]:
        return []

    def cancel(self, request_id: str, reason: str = "") -> bool:
        return False

    def submit_ids_async(self, ids: np.ndarray, exact: bool, seed: int | None,
                         timeout_s: float | None, min_version: int = 0, inductive: Any = None,
                         model: str = "", version: int = 0,
                         node_type: str = "") -> tuple[str, Any]:
        self.submitted.append((model, version))
        future = asyncio.get_running_loop().create_future()
        future.set_result(self._result(ids, model or "sage", version))
        return "r", future

    def _result(self, ids: np.ndarray, model: str, version: int) -> EmbedResult:
        loaded = self.manager.loaded.get(model)
        if loaded is None:
            return EmbedResult("r", error=errors.ServeError(
                "model_not_found", f"no model named {model!r}", 404).info)
        if not loaded:
            return EmbedResult("r", error=errors.ServeError(
                "model_not_found", f"model {model!r} has no version loaded", 404).info)
        version = version or max(loaded)
        if version not in loaded:
            return EmbedResult("r", error=errors.ServeError(
                "model_version_not_found", f"model {model!r} version {version} is not loaded",
                404).info)
        return EmbedResult("r", torch.from_numpy(fake_rows(ids, version)), model=model,
                           version=version)


class Door:
    """The app on uvicorn in a thread of this process (its gRPC server on the same loop)."""

    def __init__(self, pipeline: FakePipeline) -> None:
        import uvicorn

        from quiver_serve.frontend.app import create_app

        cfg = small_config(server__auth_token=DATA_TOKEN, server__admin_token=ADMIN_TOKEN,
                           server__grpc_port=free_port())
        self.pipeline, self.grpc_port = pipeline, cfg.server.grpc_port
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(cfg, pipeline), host="127.0.0.1",
                                                    port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Door:
        self.thread.start()
        end = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < end and self.thread.is_alive(), "the app did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def door() -> Iterator[Door]:
    with Door(FakePipeline()) as d:
        yield d


@pytest.fixture
def fresh(door: Door) -> Iterator[Door]:
    """The door with the fake manager's start state back (sage 1 and 2 loaded) after the test."""
    yield door
    door.pipeline.manager.reset()


def http_client(url: str) -> Any:
    import tritonclient.http as httpclient

    return httpclient.InferenceServerClient(url=url.removeprefix("http://"))


def grpc_client(port: int) -> Any:
    import tritonclient.grpc as grpcclient

    return grpcclient.InferenceServerClient(url=f"127.0.0.1:{port}")


def infer_http(client: Any, model: str, ids: list[int], version: str = "",
               headers: dict[str, str] | None = None) -> Any:
    import tritonclient.http as httpclient

    inp = httpclient.InferInput("node_ids", [len(ids)], "INT64")
    inp.set_data_from_numpy(np.asarray(ids, dtype=np.int64), binary_data=True)
    # a copy: tritonclient.http adds Inference-Header-Content-Length to the dict it is given
    return client.infer(model, [inp], model_version=version, headers=dict(headers or {}),
                        parameters={"exact": True})


def infer_grpc(client: Any, model: str, ids: list[int], version: str = "",
               headers: dict[str, str] | None = None) -> Any:
    import tritonclient.grpc as grpcclient

    inp = grpcclient.InferInput("node_ids", [len(ids)], "INT64")
    inp.set_data_from_numpy(np.asarray(ids, dtype=np.int64))
    return client.infer(model, [inp], model_version=version, headers=headers,
                        parameters={"exact": True})


# ---- the front door, over a fake engine side -----------------------------------------------------
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_index_load_unload_with_tritonclient(fresh: Door, protocol: str) -> None:
    client = http_client(fresh.url) if protocol == "http" else grpc_client(fresh.grpc_port)
    index = client.get_model_repository_index(headers=ADMIN)
    rows = index if protocol == "http" else [
        {"name": m.name, "version": m.version, "state": m.state, "reason": m.reason}
        for m in index.models]
    assert {(r["name"], r["version"], r["state"]) for r in rows} == {
        ("sage", "1", "READY"), ("sage", "2", "READY"), ("sage", "3", "UNAVAILABLE"),
        ("gcn", "1", "UNAVAILABLE")}
    assert not client.is_model_ready("gcn", headers=DATA)
    client.load_model("gcn", headers=ADMIN)
    assert client.is_model_ready("gcn", headers=DATA)
    assert client.is_model_ready("gcn", "1", headers=DATA)
    client.unload_model("sage", headers=ADMIN)
    assert not client.is_model_ready("sage", headers=DATA)
    assert not client.is_model_ready("sage", "1", headers=DATA)
    assert [op for op, _ in fresh.pipeline.manager.calls[-3:]] == ["index", "load", "unload"]
    client.close()


def test_index_ready_only_and_row_shape(door: Door) -> None:
    r = httpx.post(door.url + "/v2/repository/index", json={"ready": True}, headers=ADMIN)
    assert r.status_code == 200, r.text
    assert r.json() == [{"name": "sage", "version": "1", "state": "READY", "reason": ""},
                        {"name": "sage", "version": "2", "state": "READY", "reason": ""}]
    assert httpx.post(door.url + "/v2/repository/index", json={"ready": 1},
                      headers=ADMIN).status_code == 422
    assert httpx.post(door.url + "/v2/repository/index", json={"x": 1},
                      headers=ADMIN).status_code == 422


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_pinned_infer_answers_that_version_and_names_it(door: Door, protocol: str) -> None:
    ids = [0, 3, 7]
    if protocol == "http":
        client, infer = http_client(door.url), infer_http
    else:
        client, infer = grpc_client(door.grpc_port), infer_grpc
    for version in ("1", "2"):
        result = infer(client, "sage", ids, version, headers=DATA)
        np.testing.assert_array_equal(result.as_numpy("embeddings"),
                                      fake_rows(np.array(ids), int(version)))
        response = result.get_response()
        got = response["model_version"] if protocol == "http" else response.model_version
        assert got == version
    unpinned = infer(client, "sage", ids, headers=DATA).get_response()
    assert (unpinned["model_name"], unpinned["model_version"]) == ("sage", "2") \
        if protocol == "http" else (unpinned.model_name, unpinned.model_version) == ("sage", "2")
    client.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_metadata_per_version(door: Door, protocol: str) -> None:
    client = http_client(door.url) if protocol == "http" else grpc_client(door.grpc_port)
    meta = client.get_model_metadata("sage", headers=DATA, **(
        {} if protocol == "http" else {"as_json": True}))
    assert meta["versions"] == ["1", "2"] and meta["platform"] == "pytorch_geometric"
    one = client.get_model_metadata("sage", "2", headers=DATA, **(
        {} if protocol == "http" else {"as_json": True}))
    assert one["versions"] == ["2"]
    if protocol == "http":
        assert one["parameters"]["state_dict"] == "sage/2/model.pt"
        assert one["parameters"]["pyg_model"]["kwargs"]["in_channels"] == 8
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match="no version 5"):
        client.get_model_metadata("sage", "5", headers=DATA)
    client.close()


def test_v1_embed_names_and_pins_versions(door: Door) -> None:
    url = door.url + "/v1/embed"
    r = httpx.post(url, json={"node_ids": [1, 2], "model": "sage", "version": "1"}, headers=DATA)
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["model"], body["model_version"], body["dim"]) == ("sage", "1", DIM)
    np.testing.assert_array_equal(np.array(body["embeddings"]), fake_rows(np.array([1, 2]), 1))
    npy = httpx.post(url, json={"node_ids": [1], "version": 2}, headers={
        **DATA, "accept": "application/x-npy"})
    assert (npy.headers["x-model-name"], npy.headers["x-model-version"]) == ("sage", "2")
    assert door.pipeline.submitted[-1] == ("", 2)  # no model named: the engine's default
    missing = httpx.post(url, json={"node_ids": [1], "model": "sage", "version": 9}, headers=DATA)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_version_not_found"


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_failed_load_names_the_cause_and_old_versions_serve(fresh: Door, protocol: str) -> None:
    from tritonclient.utils import InferenceServerException

    client = http_client(fresh.url) if protocol == "http" else grpc_client(fresh.grpc_port)
    infer = infer_http if protocol == "http" else infer_grpc
    config = json.dumps({"version_policy": {"specific": [2, 3]}})
    with pytest.raises(InferenceServerException, match="version 3: model.pt holds non-finite"):
        client.load_model("sage", config=config, headers=ADMIN)
    with pytest.raises(InferenceServerException, match="only version_policy and traffic"):
        client.load_model("sage", config=json.dumps({"class": "os:system"}), headers=ADMIN)
    with pytest.raises(InferenceServerException, match="not JSON"):
        client.load_model("sage", config="{", headers=ADMIN)
    result = infer(client, "sage", [4], "2", headers=DATA)
    np.testing.assert_array_equal(result.as_numpy("embeddings"), fake_rows(np.array([4]), 2))
    assert client.is_model_ready("sage", "2", headers=DATA)
    client.close()


def test_model_files_are_refused(door: Door) -> None:
    """Model files come only from the repository: a ``file:`` parameter is a 400 (gRPC
    ``INVALID_ARGUMENT``) and the manager is never asked."""
    from tritonclient.utils import InferenceServerException

    before = len(door.pipeline.manager.calls)
    r = httpx.post(door.url + "/v2/repository/models/sage/load", headers=ADMIN, json={
        "parameters": {"config": "{}", "file:1/model.pt": "AAAA"}})
    assert r.status_code == 400 and "come only from the model repository" in r.json()["error"]
    client = grpc_client(door.grpc_port)
    with pytest.raises(InferenceServerException, match="come only from") as err:
        client.load_model("sage", config="{}", files={"file:1/model.pt": b"x"}, headers=ADMIN)
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    client.close()
    assert len(door.pipeline.manager.calls) == before


def test_data_plane_token_cannot_call_the_repository(door: Door) -> None:
    from tritonclient.utils import InferenceServerException

    for path, body in [("index", {}), ("models/gcn/load", {}), ("models/sage/unload", {})]:
        r = httpx.post(f"{door.url}/v2/repository/{path}", json=body, headers=DATA)
        assert r.status_code == 403 and "data-plane token" in r.json()["error"], path
        assert httpx.post(f"{door.url}/v2/repository/{path}", json=body).status_code == 401
    client = grpc_client(door.grpc_port)
    for call in (lambda h: client.get_model_repository_index(headers=h),
                 lambda h: client.load_model("gcn", headers=h),
                 lambda h: client.unload_model("sage", headers=h)):
        with pytest.raises(InferenceServerException, match="data-plane token") as err:
            call(DATA)
        assert err.value.status() == "StatusCode.PERMISSION_DENIED"
        with pytest.raises(InferenceServerException) as err:
            call({})
        assert err.value.status() == "StatusCode.UNAUTHENTICATED"
    client.close()
    assert door.pipeline.manager.loaded["sage"]  # nothing was unloaded


def test_unknown_model_and_bad_names(door: Door) -> None:
    from tritonclient.utils import InferenceServerException

    r = httpx.post(door.url + "/v2/repository/models/nope/load", headers=ADMIN)
    assert r.status_code == 404 and "nope" in r.json()["error"]
    for bad in (".hidden", "a%20b", "x%00", "%2e%2e"):
        r = httpx.post(f"{door.url}/v2/repository/models/{bad}/load", headers=ADMIN)
        assert r.status_code == 400 and "invalid model name" in r.json()["error"], bad
    assert httpx.get(door.url + "/v2/models/nope", headers=DATA).status_code == 404
    assert httpx.get(door.url + "/v2/models/nope/ready", headers=DATA).status_code == 404
    assert httpx.get(door.url + "/v2/models/sage/versions/x", headers=DATA).status_code == 400
    assert httpx.get(door.url + "/v2/models/sage/versions/0/ready", headers=DATA).status_code == 400
    client = grpc_client(door.grpc_port)
    with pytest.raises(InferenceServerException) as err:
        client.load_model("..", headers=ADMIN)
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException) as err:
        client.unload_model("nope", headers=ADMIN)
    assert err.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException, match="no model named 'nope'") as err:
        client.get_model_metadata("nope", headers=DATA)
    assert err.value.status() == "StatusCode.NOT_FOUND"
    assert not client.is_model_ready("nope", headers=DATA)  # as Triton: not ready, no error
    client.close()


def test_admin_calls_are_logged_with_who_and_what(fresh: Door,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="quiver_serve.frontend.repository_routes")
    config = {"version_policy": {"specific": [1]}}
    r = httpx.post(fresh.url + "/v2/repository/models/sage/load", headers=ADMIN,
                   json={"parameters": {"config": json.dumps(config)}})
    assert r.status_code == 200 and r.json() == {}
    line = next(m for m in caplog.messages if m.startswith("model load sage"))
    assert json.dumps(config) in line and "127.0.0.1:" in line and "{'1': 'READY'}" in line


class FakeContext:
    """A grpc.aio servicer context: the peer, the metadata, and an abort that raises."""

    def __init__(self, peer: str, authorization: str | None = None) -> None:
        self._peer = peer
        self._metadata = (("authorization", authorization),) if authorization else ()

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    async def abort(self, code: Any, message: str) -> None:
        raise PermissionError(code, message)


@pytest.mark.parametrize(("admin_token", "peer", "authorization", "refused"), [
    (None, "ipv4:127.0.0.1:5000", None, None),  # no admin token: loopback peers only
    (None, "ipv6:%5B::1%5D:5000", f"Bearer {DATA_TOKEN}", None),
    (None, "ipv4:10.0.0.7:5000", None, "PERMISSION_DENIED"),
    (None, "unix:x.sock", None, "PERMISSION_DENIED"),
    (ADMIN_TOKEN, "ipv4:10.0.0.7:5000", f"Bearer {ADMIN_TOKEN}", None),
    (ADMIN_TOKEN, "ipv4:127.0.0.1:5000", f"Bearer {DATA_TOKEN}", "PERMISSION_DENIED"),
    (ADMIN_TOKEN, "ipv4:127.0.0.1:5000", None, "UNAUTHENTICATED"),
])
def test_grpc_admin_guard_mirrors_http(admin_token: str | None, peer: str,
                                       authorization: str | None, refused: str | None) -> None:
    from quiver_serve.frontend.grpc.service import KServeGrpc

    servicer = KServeGrpc(None, DATA_TOKEN, admin_token)  # type: ignore[arg-type]
    ctx = FakeContext(peer, authorization)
    if refused is None:
        assert asyncio.run(servicer._admin(ctx)) in ("127.0.0.1:5000", "::1:5000",
                                                     "10.0.0.7:5000")
        return
    with pytest.raises(PermissionError) as err:
        asyncio.run(servicer._admin(ctx))
    assert err.value.args[0].name == refused


def test_grpc_peer_addresses() -> None:
    from quiver_serve.frontend.grpc.service import peer_address
    from quiver_serve.frontend.guards import is_loopback

    assert peer_address("ipv4:127.0.0.1:5000") == ("127.0.0.1", 5000)
    assert peer_address("ipv6:%5B::1%5D:5000") == ("::1", 5000)
    assert peer_address("ipv6:[::ffff:10.0.0.1]:7") == ("::ffff:10.0.0.1", 7)
    assert peer_address("unix:x.sock") is None
    assert is_loopback(peer_address("ipv6:[::1]:1")) and not is_loopback(
        peer_address("ipv4:10.1.2.3:4"))


# ---- the whole path: the real daemon with a repository --------------------------------------------
def write_repository(root: Path) -> Path:
    """``sage``: Cora's GraphSAGE; version 1 the shipped weights, version 2 its last layer x2."""
    model = root / "sage"
    (model / "1").mkdir(parents=True)
    (model / "2").mkdir()
    (model / "config.yaml").write_text(
        "class: GraphSAGE\n"
        "kwargs: {hidden_channels: 128, num_layers: 2, out_channels: 64}\n"
        "version_policy: {specific: [1, 2]}\n")
    shutil.copy(DEFAULTS_DIR / "cora_graphsage.pt", model / "1" / "model.pt")
    state = torch.load(model / "1" / "model.pt", weights_only=True)
    torch.save({k: v * 2 if k.startswith("convs.1.") else v for k, v in state.items()},
               model / "2" / "model.pt")
    return root


@pytest.fixture(scope="module", params=[1, 2], ids=["one-frontend", "two-frontends"])
def daemon(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One front-end in the main process (``Pipeline``), then two front-end processes
    (``RemotePipeline``: model calls and the published model state cross processes)."""
    tmp = tmp_path_factory.mktemp("repository")
    repo = write_repository(tmp / "models")
    srv, cfg = start_server(tmp, server__auth_token=DATA_TOKEN, server__admin_token=ADMIN_TOKEN,
                            server__grpc_port=free_port(), models__repository=str(repo),
                            server__http_workers=request.param)
    srv.grpc_port = cfg.server.grpc_port  # type: ignore[attr-defined]
    srv.repository = repo  # type: ignore[attr-defined]
    try:
        srv.wait_ready(headers=DATA)
        yield srv
    finally:
        srv.stop()


def ready_soon(client: Any, version: str, want: bool = True) -> bool:
    """``sage`` ``version``'s readiness once it is ``want`` (up to 1 s): a load answers once the
    front-end that took it shows the outcome; another front-end process follows the published
    state within ~0.1 s, and a client's next connection may reach that one."""
    end = time.monotonic() + 1.0
    while client.is_model_ready("sage", version, headers=DATA) != want:
        if time.monotonic() > end:
            return not want
        time.sleep(0.02)
    return want


def exact_rows(srv: ServerProcess, ids: list[int], version: int) -> np.ndarray:
    r = httpx.post(srv.url + "/v1/embed", headers=DATA, timeout=30,
                   json={"node_ids": ids, "exact": True, "model": "sage", "version": version})
    assert r.status_code == 200, r.text
    assert (r.json()["model"], r.json()["model_version"]) == ("sage", str(version))
    return np.array(r.json()["embeddings"], dtype=np.float32)


@pytest.mark.e2e
def test_daemon_serves_both_versions(daemon: ServerProcess) -> None:
    ids = [0, 1, 2707]
    one, two = exact_rows(daemon, ids, 1), exact_rows(daemon, ids, 2)
    np.testing.assert_allclose(two, 2 * one, rtol=1e-5, atol=1e-5)
    for client, infer in ((http_client(daemon.url), infer_http),
                          (grpc_client(daemon.grpc_port), infer_grpc)):  # type: ignore[attr-defined]
        for version, want in (("1", one), ("2", two)):
            result = infer(client, "sage", ids, version, headers=DATA)
            np.testing.assert_allclose(result.as_numpy("embeddings"), want, atol=1e-5)
            assert ready_soon(client, version)
        meta = client.get_model_metadata("sage", "2", headers=DATA)
        assert list(meta["versions"] if isinstance(meta, dict) else meta.versions) == ["2"]
        client.close()
    metrics = httpx.get(daemon.url + "/metrics", headers=DATA, timeout=10).text
    for version in ("1", "2"):  # requests counted per model and version that served them
        assert f'quiver_serve_model_requests_total{{model="sage",outcome="ok",version="{version}"}}' \
            in metrics, version
    assert 'quiver_serve_model_batch_round_trip_seconds_count{model="sage",version="2"}' in metrics


@pytest.mark.e2e
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_daemon_index_unload_and_load(daemon: ServerProcess, protocol: str) -> None:
    client = http_client(daemon.url) if protocol == "http" else grpc_client(daemon.grpc_port)  # type: ignore[attr-defined]
    index = client.get_model_repository_index(headers=ADMIN)
    rows = index if protocol == "http" else [
        {"name": m.name, "version": m.version, "state": m.state} for m in index.models]
    assert {(r["name"], r.get("version"), r["state"]) for r in rows} >= {
        ("sage", "1", "READY"), ("sage", "2", "READY")}
    client.unload_model("sage", headers=ADMIN)
    assert not ready_soon(client, "1", want=False)
    assert server_ready_soon(daemon, want=False), "ready while no model serves"
    assert ready_within(lambda: client.is_server_ready(headers=DATA), want=False)
    r = httpx.get(daemon.url + "/v2/health/ready", headers=DATA, timeout=10)
    assert r.status_code == 503 and "no model version is ready" in r.json()["error"], r.text
    assert r.headers["retry-after"]
    client.load_model("sage", headers=ADMIN)
    assert ready_soon(client, "1") and ready_soon(client, "2")
    assert server_ready_soon(daemon) and ready_within(lambda: client.is_server_ready(headers=DATA))
    client.close()


def ready_within(probe: Any, want: bool = True) -> bool:
    """True once ``probe()`` answers ``want`` (up to 1 s: see :func:`ready_soon`), else False."""
    end = time.monotonic() + 1.0
    while bool(probe()) != want:
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def server_ready_soon(srv: ServerProcess, want: bool = True) -> bool:
    """True once ``/v2/health/ready`` answers 200 (``want``) or not (up to 1 s)."""
    return ready_within(lambda: httpx.get(srv.url + "/v2/health/ready", headers=DATA,
                                          timeout=10).status_code == 200, want)


@pytest.mark.e2e
def test_daemon_failed_load_keeps_version_2(daemon: ServerProcess, tmp_path: Path) -> None:
    from tritonclient.utils import InferenceServerException

    repo = daemon.repository  # type: ignore[attr-defined]
    (repo / "sage" / "3").mkdir(exist_ok=True)
    state = torch.load(repo / "sage" / "1" / "model.pt", weights_only=True)
    torch.save({k: torch.full_like(v, float("nan")) for k, v in state.items()},
               repo / "sage" / "3" / "model.pt")
    want = exact_rows(daemon, [5, 6], 2)
    for client in (http_client(daemon.url), grpc_client(daemon.grpc_port)):  # type: ignore[attr-defined]
        config = json.dumps({"version_policy": {"specific": [2, 3]}})
        with pytest.raises(InferenceServerException, match="3") as err:
            client.load_model("sage", config=config, headers=ADMIN)
        assert re.search("nan|finite", str(err.value), re.IGNORECASE), str(err.value)
        np.testing.assert_allclose(exact_rows(daemon, [5, 6], 2), want, atol=1e-6)
        assert ready_soon(client, "2")
        client.close()


@pytest.mark.e2e
def test_daemon_guards_and_errors(daemon: ServerProcess) -> None:
    r = httpx.post(daemon.url + "/v2/repository/index", headers=DATA)
    assert r.status_code == 403
    r = httpx.post(daemon.url + "/v2/repository/models/nope/load", headers=ADMIN, timeout=30)
    assert r.status_code == 404, r.text
    r = httpx.post(daemon.url + "/v2/repository/models/.x/load", headers=ADMIN)
    assert r.status_code == 400
    r = httpx.post(daemon.url + "/v1/embed", headers=DATA, json={"node_ids": [1], "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"

"""Typed updates through the daemon (docs/architecture.md, "Typed graphs"): on a random typed
graph saved in the test (papers, authors, fields without features; reverse relations), edge
adds and removals per relation, typed new nodes and feature writes over HTTP (a real server on
a free port) and through the queue API; exact answers equal PyG's full-graph
``model(x_dict, edge_index_dict)[type][ids]`` of the updated graph for to_hetero(GraphSAGE) and
RGCN, and still do after a compaction, kill -9 and a restart on the same folders; bad updates
are 4xx naming what was wrong."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from quiver_serve.config import ServeConfig
from quiver_serve.engine.client.pipeline import Pipeline
from quiver_serve.graph.typed_load import load_typed_graph
from quiver_serve.models.spec import ModelSpec
from quiver_serve.models.typed_served import TypedServedModel, build_typed_model
from tests.conftest import ServerProcess, _to_yaml, free_port
from tests.graph.typed_updates_model import CITES, HAS, WRITES, UpdateModel, random_papers

TOL = 1e-5
SAGE = ("GraphSAGE", {"hidden_channels": 16, "num_layers": 2, "out_channels": 8},
        {"aggr": "sum"})
RGCN = ("quiver_serve.models.typed_zoo:RGCN",
        {"hidden_channels": 16, "out_channels": 8, "num_bases": 2}, None)


def typed_setup(tmp: Path, model: tuple, seed: int = 11,
                ) -> tuple[ServeConfig, TypedServedModel, UpdateModel]:
    """The graph saved as a ``HeteroData`` file, a config serving it with ``model`` (weights
    made here and saved), the served model (the reference's weights) and the update model."""
    data = random_papers(seed)
    torch.save(data, tmp / "papers.pt")
    cfg = ServeConfig.default()
    cfg.graph.format, cfg.graph.path, cfg.graph.name = "pyg", str(tmp / "papers.pt"), "papers"
    cfg.graph.add_reverse_edges = True
    cfg.graph.update_log_dir = str(tmp / "log")
    pyg_class, kwargs, to_hetero = model
    cfg.model.name, cfg.model.pyg_class, cfg.model.kwargs = "papers-model", pyg_class, kwargs
    cfg.model.to_hetero, cfg.model.featureless_value = to_hetero, 1.0
    cfg.model.weights = None  # random weights here, saved below for the daemon
    cfg.sampling.fanouts = [3, 2]
    cfg.server.start_timeout_s = 180.0
    cfg.server.http_workers = 1
    served = build_typed_model(ModelSpec.from_config(cfg.model), load_typed_graph(cfg.graph))
    torch.save(served.model.state_dict(), tmp / "weights.pt")
    cfg.model.weights = str(tmp / "weights.pt")
    return cfg, served, UpdateModel(data)


def pyg_rows(served: TypedServedModel, model: UpdateModel) -> dict[str, torch.Tensor]:
    """PyG's forward of the model on the whole updated graph (``ToUndirected`` of the lists)."""
    graph = model.served()
    x = {t: graph.x[t] if t in graph.x else torch.ones(n, 1) for t, n in graph.num_nodes.items()}
    with torch.no_grad():
        return served.model(x, graph.edge_index_dict())


def an_edge(model: UpdateModel, et: tuple, i: int) -> list[int]:
    return model.data[et].edge_index[:, i].tolist()


def updates(model: UpdateModel) -> list[tuple[str, dict]]:
    """(route, body) of a stream touching every kind of update; ``model`` follows it."""
    rng = np.random.default_rng(5)
    new_papers = rng.standard_normal((2, 6)).astype(np.float32)
    author_rows = rng.standard_normal((2, 4)).astype(np.float32)
    stream = [
        ("edges", {"edge_type": list(WRITES), "add": [[0, 59], [34, 0], [34, 0]],
                   "remove": [an_edge(model, WRITES, 3), [1, 1]]}),
        ("edges", {"edge_type": list(CITES), "add": [[1, 2], [2, 1], [7, 7]],
                   "remove": [an_edge(model, CITES, 0)]}),
        ("edges", {"edge_type": list(HAS), "remove": [an_edge(model, HAS, 5)]}),
        ("nodes", {"node_type": "paper", "features": new_papers.tolist()}),
        ("nodes", {"node_type": "field", "count": 1}),
        ("edges", {"edge_type": list(WRITES), "add": [[3, 60], [4, 61]]}),
        ("edges", {"edge_type": list(CITES), "add": [[60, 5], [61, 60]]}),
        ("features", {"node_type": "author", "node_ids": [0, 1],
                      "features": author_rows.tolist()}),
    ]
    for route, body in stream:
        follow(model, route, body)
    return stream


def follow(model: UpdateModel, route: str, body: dict) -> None:
    if route == "edges":
        et = tuple(body["edge_type"])
        model.add(et, np.asarray(body.get("add", []), np.int64).reshape(-1, 2))
        model.remove(et, np.asarray(body.get("remove", []), np.int64).reshape(-1, 2))
    elif route == "nodes":
        rows = np.asarray(body.get("features", np.zeros((body.get("count", 0), 0))), np.float32)
        model.add_nodes(body["node_type"], rows)
    else:
        model.put_features(body["node_type"], body["node_ids"],
                           np.asarray(body["features"], np.float32))


def assert_exact(embed: Callable[[str, list[int]], np.ndarray], want: dict[str, torch.Tensor],
                 ) -> None:
    for node_type in ("paper", "author", "field"):
        ids = list(range(want[node_type].size(0)))
        np.testing.assert_allclose(embed(node_type, ids), want[node_type].numpy(), atol=TOL,
                                   rtol=0, err_msg=node_type)


def start(path: Path, tmp: Path, name: str) -> ServerProcess:
    srv = ServerProcess(path, free_port(), tmp / f"{name}.log")
    try:
        srv.wait_ready()
    except BaseException:
        srv.stop()
        raise
    return srv


def compact(url: str, version: int) -> None:
    """``POST /v1/graph/compact``, then wait until ``GET /v1/graph`` shows the base."""
    r = httpx.post(url + "/v1/graph/compact", timeout=60)
    assert r.status_code in (200, 202), r.text
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        info = httpx.get(url + "/v1/graph", timeout=30).json()
        if info["base_version"] == version:
            assert info["last_compaction"]["version"] == version
            return
        time.sleep(0.2)
    raise AssertionError(f"no compaction at version {version}: {info}")


def test_http_updates_are_exact_and_survive_a_compaction_and_kill_9(tmp_path: Path) -> None:
    """The updates, a compaction half way (decision 0059: the log before it is dropped), the
    rest; exact answers equal PyG's, and again after kill -9 and a start from the base."""
    cfg, served, model = typed_setup(tmp_path, SAGE)
    path = tmp_path / "config.yaml"
    path.write_text(_to_yaml(cfg))
    srv = start(path, tmp_path, "first")
    try:
        version = 0
        for route, body in updates(model):
            call = httpx.put if route == "features" else httpx.post
            r = call(f"{srv.url}/v1/graph/{route}", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["version"] == version + 1
            version += 1
            if version == 5:
                compact(srv.url, 5)
        assert r.json()["version"] == 8
        assert_bad_updates_named(srv.url)

        def embed(node_type: str, ids: list[int]) -> np.ndarray:
            r = httpx.post(srv.url + "/v1/embed", json={
                "node_type": node_type, "node_ids": ids, "exact": True, "min_version": version},
                timeout=60)
            assert r.status_code == 200, r.text
            return np.asarray(r.json()["embeddings"], np.float32)

        want = pyg_rows(served, model)
        assert want["paper"].size(0) == 62 and want["field"].size(0) == 9
        assert_exact(embed, want)
        os.killpg(srv.pid, signal.SIGKILL)  # the whole daemon, no drain
    finally:
        srv.stop(grace_s=0)
    srv = start(path, tmp_path, "again")
    try:
        info = httpx.get(srv.url + "/v1/graph", timeout=30).json()
        assert info["version"] == 8 and info["base_version"] == 5
        assert "3 typed update(s) replayed over base version 5" in srv.log(200_000)
        assert info["num_nodes"] == {"paper": 62, "author": 35, "field": 9}
        assert_exact(embed, want)  # served from the exact table built over the replayed log
    finally:
        srv.stop()


def assert_bad_updates_named(url: str) -> None:
    def post(route: str, body: dict, method: str = "post") -> httpx.Response:
        return httpx.request(method.upper(), f"{url}/v1/graph/{route}", json=body, timeout=30)

    r = post("edges", {"edge_type": ["paper", "likes", "paper"], "add": [[0, 1]]})
    assert r.status_code == 400 and "['author', 'writes', 'paper']" in r.text, r.text
    r = post("edges", {"add": [[0, 1]]})
    assert r.status_code == 400 and "edge_type is required" in r.text, r.text
    r = post("edges", {"edge_type": list(WRITES), "add": [[0, 62]]})
    assert r.status_code == 400 and "62" in r.text and "paper" in r.text, r.text
    r = post("nodes", {"node_type": "paper", "features": [[0.5] * 5]})
    assert r.status_code == 422 and "5 values" in r.text and "6" in r.text, r.text
    r = post("nodes", {"node_type": "field", "features": [[0.5]]})
    assert r.status_code == 422 and "'field' has no features" in r.text, r.text
    r = post("features", {"node_type": "author", "node_ids": [35], "features": [[0.0] * 4]},
             "put")
    assert r.status_code == 400 and "35" in r.text, r.text
    r = post("nodes", {"node_type": "venue", "count": 1})
    assert r.status_code == 400 and "venue" in r.text and "paper" in r.text, r.text


def test_queue_api_updates_are_exact_for_rgcn_and_after_a_restart(tmp_path: Path) -> None:
    cfg, served, model = typed_setup(tmp_path, RGCN, seed=12)
    pipe = Pipeline(cfg).start()
    try:
        last = 0
        for route, body in updates(model):
            if route == "edges":
                got = pipe.add_edges(body.get("add"), body.get("remove"), body["edge_type"])
            elif route == "nodes":
                got = pipe.add_nodes(body.get("features"), body["node_type"], body.get("count"))
            else:
                got = pipe.put_features(body["node_ids"], body["features"], body["node_type"])
            last = got["version"]
        assert pipe.node_types == {"paper": 62, "author": 35, "field": 9}

        def embed(node_type: str, ids: list[int]) -> np.ndarray:
            return pipe.embed(ids, exact=True, node_type=node_type, min_version=last).numpy()

        want = pyg_rows(served, model)
        assert_exact(embed, want)
        with pytest.raises(Exception) as info:
            pipe.add_edges([[0, 1]], None, ["field", "rev_has", "paper"])
        assert "reverse of ['paper', 'has', 'field']" in str(info.value)
    finally:
        pipe.stop()
    pipe = Pipeline(cfg).start()
    try:
        assert pipe.graph_version == last
        assert_exact(lambda t, ids: pipe.embed(ids, exact=True, node_type=t).numpy(), want)
    finally:
        pipe.stop()

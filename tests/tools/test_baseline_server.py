"""bench/frontdoor/baseline_server.py: the /v1/embed contract, and with every neighbour taken
(fanouts -1) the same answer as the served PyG model on the full graph (same class, weights,
semantics)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from quiver_serve.config import ServeConfig

baseline_server = pytest.importorskip("bench.frontdoor.baseline_server")


def can_pyg() -> bool:
    import torch_geometric.typing as t

    return bool(t.WITH_PYG_LIB or t.WITH_TORCH_SPARSE)


@pytest.fixture(scope="module", params=["reference", "pyg"])
def exact_client(request: pytest.FixtureRequest):  # noqa: ANN201 - a TestClient
    if request.param == "pyg" and not can_pyg():
        pytest.skip("PyG's NeighborSampler needs pyg-lib or torch-sparse")
    from fastapi.testclient import TestClient

    cfg = ServeConfig.default()
    cfg.sampling.fanouts = [-1, -1]
    base = baseline_server.Baseline(cfg, request.param, "cpu")
    return TestClient(baseline_server.make_app(base, 64)), base, cfg


def test_exact_answer_equals_the_model_on_the_full_graph(exact_client) -> None:  # noqa: ANN001
    from quiver_serve.graph.datasets import load_graph
    from quiver_serve.models.served import build_model

    client, base, cfg = exact_client
    g = load_graph(cfg.graph)
    model = build_model(cfg.model, g.num_features)
    with torch.no_grad():
        full = model(g.x, g.edge_index())
    ids = [0, 1, 2707, 1, 633]
    r = client.post("/v1/embed", json={"node_ids": ids})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "cora-graphsage" and body["dim"] == 64
    torch.testing.assert_close(torch.tensor(body["embeddings"]), full[ids], atol=1e-4, rtol=1e-4)
    r = client.post("/v1/embed", json={"node_ids": ids}, headers={"Accept": "application/x-npy"})
    assert r.headers["content-type"] == "application/x-npy"
    arr = np.load(io.BytesIO(r.content), allow_pickle=False)
    np.testing.assert_allclose(arr, full[ids].numpy(), atol=1e-4)
    assert client.get("/v1/baseline").json()["sampler"] == base.sampler.name


@pytest.mark.parametrize("body,status,needle", [
    ({"node_ids": [2708]}, 400, "0..2707"),
    ({"node_ids": [-1]}, 400, "-1"),
    ({"node_ids": []}, 422, "node_ids"),
    ({"node_ids": "x"}, 422, "node_ids"),
    ({"node_ids": list(range(65))}, 413, "64"),
])
def test_bad_input_gets_named_4xx(exact_client, body: object, status: int, needle: str) -> None:  # noqa: ANN001
    client = exact_client[0]
    r = client.post("/v1/embed", json=body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]

"""Model control on a daemon without a model repository (the embedded default): its one model
is fixed at start-up, so load and unload are both refused with the reason, and it keeps serving
(docs/architecture.md, "Models and versions")."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import ServerProcess

pytestmark = pytest.mark.e2e

MODEL = "cora-graphsage"


@pytest.mark.parametrize("op", ["unload", "load", "unload"])
def test_load_and_unload_are_refused_and_the_model_keeps_serving(server: ServerProcess,
                                                                  op: str) -> None:
    r = httpx.post(f"{server.url}/v2/repository/models/{MODEL}/{op}", timeout=30)
    assert r.status_code == 400, r.text
    message = r.json()["error"]
    assert f"model {op} refused" in message and "models.repository" in message, message
    assert httpx.get(server.url + "/v2/health/ready", timeout=10).status_code == 200
    r = httpx.post(server.url + "/v1/embed", json={"node_ids": [0, 2707]}, timeout=30)
    assert r.status_code == 200 and len(r.json()["embeddings"]) == 2, r.text
    index = httpx.post(server.url + "/v2/repository/index", timeout=10).json()
    assert index == [{"name": MODEL, "version": "1", "state": "READY", "reason": ""}]

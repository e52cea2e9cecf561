"""The real daemon on a free port: contracts of docs/architecture.md, "Outside contracts", over
HTTP."""

from __future__ import annotations

import io
import shutil
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from torch_geometric.datasets import Planetoid
from torch_geometric.nn import models as pyg_models

from quiver_serve.config import DEFAULTS_DIR, PACKAGE_DIR
from tests.conftest import ServerProcess

pytestmark = pytest.mark.e2e


def post(server: ServerProcess, path: str, body: object = None, **kw: object) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30, **kw)  # type: ignore[arg-type]


def test_ready_and_embed_three_rows(server: ServerProcess) -> None:
    assert httpx.get(server.url + "/v2/health/live").status_code == 200
    assert httpx.get(server.url + "/v2/health/ready").status_code == 200
    r = post(server, "/v1/embed", {"node_ids": [0, 1, 2707]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "cora-graphsage" and body["dim"] == 64
    assert len(body["embeddings"]) == 3 and all(len(row) == 64 for row in body["embeddings"])


def test_exact_mode_equals_plain_pyg_rebuilt_from_metadata(server: ServerProcess, tmp_path: Path) -> None:
    meta = httpx.get(server.url + "/v2/models/cora-graphsage").json()["parameters"]
    model = getattr(pyg_models, meta["pyg_model"]["class"])(**meta["pyg_model"]["kwargs"])
    # state_dict: a file of the package, from the folder that holds it (docs/config.md, "Paths")
    model.load_state_dict(torch.load(PACKAGE_DIR.parent / meta["state_dict"], weights_only=True))
    shutil.copytree(DEFAULTS_DIR / "planetoid/cora/raw", tmp_path / "Cora" / "raw")
    data = Planetoid(str(tmp_path), "Cora")[0]
    with torch.no_grad():
        full = model.eval()(data.x, data.edge_index)
    ids = [0, 1, 2707, 1, 633, 0, 1862]
    r = post(server, "/v1/embed", {"node_ids": ids, "exact": True})
    assert r.status_code == 200, r.text
    got = torch.tensor(r.json()["embeddings"])
    torch.testing.assert_close(got, full[ids], atol=1e-4, rtol=1e-4)


def test_npy_response(server: ServerProcess) -> None:
    r = post(server, "/v1/embed", {"node_ids": [3, 3], "exact": True},
             headers={"Accept": "application/x-npy"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-npy"
    arr = np.load(io.BytesIO(r.content), allow_pickle=False)
    assert arr.shape == (2, 64) and arr.dtype == np.float32 and (arr[0] == arr[1]).all()


@pytest.mark.parametrize("body,status,needle", [
    ({"node_ids": [-1]}, 400, "-1"),
    ({"node_ids": [2708]}, 400, "0..2707"),
    ({"node_ids": [2**70]}, 400, str(2**70)),
    ({"node_ids": [1.5]}, 422, "node_ids"),
    ({"node_ids": ["3"]}, 422, "node_ids"),
    ({"node_ids": [True]}, 422, "node_ids"),
    ({"node_ids": []}, 422, "node_ids"),
    ({"node_ids": 5}, 422, "node_ids"),
    ({"nodes": [1]}, 422, "nodes"),
    ({"node_ids": [1], "seed": -1}, 422, "seed"),
    ({"node_ids": list(range(513))}, 413, "512"),
])
def test_bad_input_gets_named_4xx(server: ServerProcess, body: object, status: int, needle: str) -> None:
    r = post(server, "/v1/embed", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"code", "message"} and needle in err["message"]


def test_malformed_json_is_422(server: ServerProcess) -> None:
    r = httpx.post(server.url + "/v1/embed", content=b'{"node_ids": [1,',
                   headers={"content-type": "application/json"})
    assert r.status_code == 422 and "JSON" in r.json()["error"]["message"]


def test_kserve_metadata_and_infer(server: ServerProcess) -> None:
    meta = httpx.get(server.url + "/v2/models/cora-graphsage").json()
    assert meta["inputs"][0] == {"name": "node_ids", "datatype": "INT64", "shape": [-1]}
    assert meta["outputs"][0]["shape"] == [-1, 64]
    assert meta["parameters"]["state_dict"] == "quiver_serve/defaults/cora_graphsage.pt"
    assert httpx.get(server.url + "/v2/models/nope").status_code == 404
    body = {"id": "x1", "inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [2], "data": [4, 5]}],
            "parameters": {"exact": True}}
    r = post(server, "/v2/models/cora-graphsage/infer", body)
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert out["shape"] == [2, 64] and len(out["data"]) == 128 and r.json()["id"] == "x1"
    direct = post(server, "/v1/embed", {"node_ids": [4, 5], "exact": True}).json()["embeddings"]
    assert np.allclose(np.array(out["data"]).reshape(2, 64), np.array(direct), atol=1e-6)
    bad = dict(body, inputs=[{"name": "node_ids", "datatype": "FP32", "shape": [1], "data": [1.0]}])
    assert post(server, "/v2/models/cora-graphsage/infer", bad).status_code == 422


def test_metrics_count_requests(server: ServerProcess) -> None:
    def count() -> float:
        text = httpx.get(server.url + "/metrics").text
        total = 0.0
        for line in text.splitlines():
            if line.startswith("quiver_serve_request_duration_seconds_count") and 'endpoint="/v1/embed"' in line:
                total += float(line.rsplit(" ", 1)[1])
        return total

    before = count()
    for i in range(5):
        assert post(server, "/v1/embed", {"node_ids": [i]}).status_code == 200
    assert count() == before + 5
    text = httpx.get(server.url + "/metrics").text
    for name in ("quiver_serve_route_total", "quiver_serve_batch_nodes_bucket",
                 "quiver_serve_sample_duration_seconds_bucket", "quiver_serve_pending_requests"):
        assert name in text
    trips = {d: 0.0 for d in ("to_engine", "to_client")}
    for line in text.splitlines():
        if line.startswith("quiver_serve_transport_seconds_count"):
            trips[line.split('direction="')[1].split('"')[0]] += float(line.rsplit(" ", 1)[1])
    assert trips["to_engine"] >= 5 and trips["to_client"] >= 5, trips  # each micro-batch's trip


def test_daemon_processes_freeze_their_startup_heap(server: ServerProcess) -> None:
    """Engine cores and samplers freeze what they hold after start-up (no ~100 ms full
    collections under load) and time their collections into quiver_serve_gc_pause_seconds."""
    workers = httpx.get(server.url + "/v1/workers").json()["workers"]
    frozen = {(w["role"], w["index"]): w.get("gc_frozen_objects") for w in workers
              if w["role"] in ("engine", "sampler")}
    assert frozen and all(n is not None and n > 50_000 for n in frozen.values()), frozen
    for _ in range(5):
        post(server, "/v1/embed", {"node_ids": [1, 2, 3]})
    text = httpx.get(server.url + "/metrics").text
    assert 'quiver_serve_gc_pause_seconds_count{generation="2",role="engine 0"}' in text
    assert 'role="main"' in text  # the main process (front-end and supervisor) too


def test_feature_replacement_while_serving(server: ServerProcess) -> None:
    """POST /admin/features/replace: every engine core rebuilds its placement in the background
    (SIGUSR1) and serves the same rows meanwhile; no process restarts; rows are counted."""
    ids = {"node_ids": [5, 6, 2707], "exact": True}
    before = np.array(post(server, "/v1/embed", ids).json()["embeddings"])
    r = post(server, "/admin/features/replace")
    assert r.status_code == 202 and r.json()["engines_asked"] >= 1, r.text
    for _ in range(10):
        got = np.array(post(server, "/v1/embed", ids).json()["embeddings"])
        np.testing.assert_allclose(got, before, rtol=1e-5, atol=1e-5)
        time.sleep(0.05)
    workers = httpx.get(server.url + "/v1/workers").json()["workers"]
    assert all(w["alive"] and w["restarts"] == 0 for w in workers), workers
    text = httpx.get(server.url + "/metrics").text
    assert "quiver_serve_feature_cache_misses_total" in text  # a CPU box: every row from host


def test_sigterm_stops_every_process(server: ServerProcess) -> None:
    """Last test of the module: the daemon and all its workers exit within 10 s."""
    pids = server.group_pids()
    assert len(pids) >= 3  # front-end, sampler, inference worker
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(timeout=15)
    while server.group_pids() and time.monotonic() - t0 < 10:
        time.sleep(0.1)
    assert server.group_pids() == [], server.log()
    assert server.proc.returncode == 0
    assert time.monotonic() - t0 < 10

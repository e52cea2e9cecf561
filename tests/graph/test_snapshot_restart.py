"""A start is a map, end to end (quiver_serve/graph/snapshot.py): the real daemon's first start
on a dataset writes its snapshot; after kill -9 of the whole daemon, a start on the same folders
maps the snapshot instead of loading the dataset, replays the log after it, has every
acknowledged update, and its exact answers equal PyG's full-graph output."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from quiver_serve.graph.csc import GraphData
from quiver_serve.models.served import build_model
from tests.conftest import ServerProcess, free_port, start_server

ADDED = [[0, 5], [17, 5], [2700, 33], [9, 2707], [1500, 1501], [4, 4]]


def exact_rows(http: httpx.Client, num_nodes: int, version: int) -> torch.Tensor:
    rows = []
    for at in range(0, num_nodes, 512):
        ids = list(range(at, min(at + 512, num_nodes)))
        r = http.post("/v1/embed", json={"node_ids": ids, "exact": True, "min_version": version})
        assert r.status_code == 200, r.text
        rows.append(torch.tensor(r.json()["embeddings"]))
    return torch.cat(rows)


@pytest.mark.e2e
def test_kill_9_then_a_start_maps_the_snapshot_with_every_acknowledged_update(
        cora: GraphData, tmp_path: Path) -> None:
    npz = tmp_path / "cora.npz"
    np.savez(npz, indptr=cora.indptr.numpy(), indices=cora.indices.numpy(), x=cora.x.numpy())
    srv, cfg = start_server(tmp_path, {"QUIVER_SERVE_DISABLE_CPP": "1"}, graph__format="npz",
                            graph__path=str(npz), graph__update_log_dir=str(tmp_path / "log"),
                            model__weights=None)
    acked = []
    with srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        for pair in ADDED:  # one call per edge: each acknowledged on its own
            r = http.post("/v1/graph/edges", json={"add": [pair]})
            assert r.status_code == 200, r.text
            acked.append(r.json()["version"])
        before = http.get("/v1/graph").json()
        os.killpg(srv.proc.pid, signal.SIGKILL)  # no clean shutdown of any process
        srv.stop(grace_s=0)
    assert "graph snapshot written" in (tmp_path / "server.log").read_text()
    again = ServerProcess(tmp_path / "config.yaml", free_port(), tmp_path / "server2.log",
                          env={"QUIVER_SERVE_DISABLE_CPP": "1"})
    with again, httpx.Client(base_url=again.url, timeout=30) as http:
        after = http.get("/v1/graph").json()
        got = exact_rows(http, cora.num_nodes, acked[-1])
    log_text = (tmp_path / "server2.log").read_text()
    assert "graph mapped from the base of version 0" in log_text
    assert "loading graph" not in log_text  # the dataset was not read again
    assert after["version"] >= acked[-1] and after["num_edges"] == before["num_edges"]
    assert after["num_edges"] == cora.num_edges + len(ADDED)
    edge_index = torch.cat([cora.edge_index(), torch.tensor(ADDED).T], dim=1)
    with torch.no_grad():
        want = build_model(cfg.model, cora.num_features).eval()(cora.x, edge_index)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

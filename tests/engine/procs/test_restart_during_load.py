"""An engine core killed (kill -9) while a model load is in progress, in the real daemon: the load
call answers at once for the dead core instead of timing out, the restarted core is brought to the
model manager's plan (the new version) before the daemon reports ready again, and then serves the
new version's exact rows (docs/architecture.md, "Models and versions"; decision 0040).
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from torch_geometric.nn import models as pyg_models

from quiver_serve.config import DEFAULTS_DIR
from quiver_serve.graph.csc import GraphData
from tests.conftest import start_server

pytestmark = pytest.mark.e2e
ADMIN_TOKEN = "admin-token"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
IDS = [0, 5, 1200, 2707]
KWARGS = {"hidden_channels": 128, "num_layers": 2, "out_channels": 64}


def _v2_state() -> dict:
    state = torch.load(DEFAULTS_DIR / "cora_graphsage.pt", weights_only=True)
    return {k: v * 2 if k.startswith("convs.1.") else v for k, v in state.items()}


def _engine_pid(url: str) -> int | None:
    rows = httpx.get(url + "/v1/workers", timeout=10).json()
    rows = rows.get("workers", rows) if isinstance(rows, dict) else rows
    pids = [r["pid"] for r in rows if r["role"] == "engine" and r["alive"]]
    return pids[0] if pids else None


def _state_of(url: str, version: int) -> str | None:
    rows = httpx.post(url + "/v2/repository/index", headers=ADMIN, json={}, timeout=10).json()
    return next((r["state"] for r in rows if r["name"] == "sage"
                 and r.get("version") == str(version)), None)


def test_a_core_killed_during_a_load_reconciles_before_it_is_ready(
        cora: GraphData, tmp_path: Path) -> None:
    repo = tmp_path / "models"
    (repo / "sage" / "1").mkdir(parents=True)
    (repo / "sage" / "config.yaml").write_text(
        "class: GraphSAGE\nkwargs: {hidden_channels: 128, num_layers: 2, out_channels: 64}\n"
        "version_policy: {latest: 1}\n")
    shutil.copy(DEFAULTS_DIR / "cora_graphsage.pt", repo / "sage" / "1" / "model.pt")
    srv, _ = start_server(tmp_path, server__admin_token=ADMIN_TOKEN, models__repository=str(repo),
                          exact__materialize="off")
    try:
        srv.wait_ready()
        url = srv.url
        victim = _engine_pid(url)
        (repo / "sage" / "2").mkdir()
        torch.save(_v2_state(), repo / "sage" / "2" / "model.pt")
        answer: list[httpx.Response] = []
        loader = threading.Thread(target=lambda: answer.append(httpx.post(
            url + "/v2/repository/models/sage/load", headers=ADMIN, timeout=200)))
        started = time.monotonic()
        loader.start()
        while _state_of(url, 2) != "LOADING" and time.monotonic() - started < 30:
            time.sleep(0.005)
        os.kill(victim, signal.SIGKILL)
        killed_s = time.monotonic()
        ready_at, first = None, None
        while time.monotonic() - killed_s < 120:
            up = httpx.get(url + "/v2/health/ready", timeout=10).status_code == 200
            if up and _engine_pid(url) not in (None, victim):
                ready_at = time.monotonic()  # the first moment the daemon says ready again:
                first = httpx.post(url + "/v1/embed", timeout=30,  # the plan serves now
                                   json={"node_ids": IDS, "exact": True})
                break
            time.sleep(0.01)
        loader.join(120)
        assert answer and answer[0].status_code == 200, answer and answer[0].text
        assert ready_at is not None, "the daemon never reported ready after the kill"
        assert first is not None and first.status_code == 200, first and first.text
        assert first.json()["model_version"] == "2"  # not the start-up plan's version 1
        model = pyg_models.GraphSAGE(cora.num_features, **KWARGS).eval()
        model.load_state_dict(_v2_state())
        with torch.no_grad():
            want = model(cora.x, cora.edge_index())[IDS].numpy()
        np.testing.assert_allclose(np.array(first.json()["embeddings"], np.float32), want,
                                   atol=1e-4, rtol=1e-4)
        pinned_v1 = httpx.post(url + "/v1/embed", timeout=30,
                               json={"node_ids": IDS, "model": "sage", "version": 1})
        assert pinned_v1.status_code in (400, 404), pinned_v1.text  # unloaded by the policy
        assert _state_of(url, 2) == "READY" and _state_of(url, 1) == "UNAVAILABLE"
    finally:
        srv.stop()

"""Scale-out: the in-process engine (``LocalEngine``) and Ray Serve replicas of it.

The Ray test starts a real local Ray instance on loopback with two engine replicas behind Ray's
HTTP proxy, checks ``/v1/embed`` (exact mode equals PyG's full-graph output, which the daemon's
exact mode equals too: tests/engine/client/test_pipeline.py), the error contract, and kills one replica with
SIGKILL under load: every request must still be answered 200 (the ingress retries once).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import numpy as np
import pytest
import torch

from quiver_serve.engine.client.local import LocalEngine
from quiver_serve.errors import ServeError
from quiver_serve.graph.csc import GraphData
from quiver_serve.models.served import build_model
from tests.conftest import free_port, small_config


@pytest.fixture(scope="module")
def full_graph_output(cora: GraphData) -> torch.Tensor:
    model = build_model(small_config().model, cora.num_features)
    with torch.no_grad():
        return model(cora.x, cora.edge_index())


def test_local_engine_exact_mode_and_errors(cora: GraphData,
                                            full_graph_output: torch.Tensor) -> None:
    engine = LocalEngine(small_config(sampling__num_cpu_workers=0), cora)
    try:
        ids = np.array([0, 5, 2707, 5])
        got = engine.embed(ids, exact=True)
        torch.testing.assert_close(torch.from_numpy(got), full_graph_output[ids],
                                   atol=1e-4, rtol=1e-4)
        seeded = [engine.embed(np.arange(40), seed=7) for _ in range(2)]
        np.testing.assert_array_equal(seeded[0], seeded[1])
        with pytest.raises(ServeError) as err:
            engine.embed(np.array([1, 99999]))
        assert err.value.info.status == 400 and "99999" in err.value.info.message
        with pytest.raises(ServeError) as err:
            engine.embed(np.array([1]), timeout_s=-1.0)  # already expired
        assert err.value.info.status == 504
    finally:
        engine.stop()
    with pytest.raises(ServeError):
        engine.embed(np.array([1]))  # stopped: 503, not a hang


def _load(url: str, stop: threading.Event, codes: list[int]) -> None:
    with httpx.Client(timeout=60.0) as client:
        i = 0
        while not stop.is_set():
            i += 1
            r = client.post(url, json={"node_ids": [i % 2708, (7 * i) % 2708]})
            codes.append(r.status_code)


def _replica_pids(handle: object, want: int, timeout_s: float = 60.0) -> set[int]:
    pids: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while len(pids) < want and time.monotonic() < deadline:
        pids.add(handle.pid.remote().result())  # type: ignore[attr-defined]
    return pids


@pytest.mark.slow
@pytest.mark.e2e
def test_ray_serve_two_replicas_exact_errors_and_a_killed_replica(
        cora: GraphData, full_graph_output: torch.Tensor) -> None:
    import ray
    from ray import serve

    from quiver_serve.scaleout.ray_serve import build_app

    ray.init(address="local", num_cpus=4, num_gpus=0, include_dashboard=False,
             _node_ip_address="127.0.0.1",
             object_store_memory=200 << 20, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        cfg = small_config(sampling__num_cpu_workers=0)
        serve.run(build_app(cfg, cora, num_replicas=2, gpus_per_replica=0), name="qs",
                  route_prefix="/")
        url = f"http://127.0.0.1:{port}/v1/embed"
        ids = [0, 5, 2707, 5]
        r = httpx.post(url, json={"node_ids": ids, "exact": True}, timeout=60.0)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["dim"] == 64 and body["model"] == cfg.model.name
        torch.testing.assert_close(torch.tensor(body["embeddings"]), full_graph_output[ids],
                                   atol=1e-4, rtol=1e-4)
        bad = httpx.post(url, json={"node_ids": [1, 99999]}, timeout=60.0)
        assert bad.status_code == 400 and "99999" in bad.json()["error"]["message"]
        malformed = httpx.post(url, json={"node_ids": "x"}, timeout=60.0)
        assert malformed.status_code == 422 and malformed.json()["error"]["code"]

        handle = serve.get_deployment_handle("engine", app_name="qs")
        pids = _replica_pids(handle, 2)
        assert len(pids) == 2
        stop, codes = threading.Event(), []
        load = [threading.Thread(target=_load, args=(url, stop, codes)) for _ in range(4)]
        for t in load:
            t.start()
        time.sleep(2.0)
        os.kill(min(pids), signal.SIGKILL)
        time.sleep(4.0)
        stop.set()
        for t in load:
            t.join(60)
        assert len(codes) > 20 and set(codes) == {200}, f"statuses {sorted(set(codes))}"
        after = _replica_pids(handle, 2, timeout_s=90.0)  # Serve replaced the killed replica
        assert len(after) == 2 and min(pids) not in after
    finally:
        serve.shutdown()
        ray.shutdown()

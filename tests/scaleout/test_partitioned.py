"""A graph partitioned across partition servers on a local Ray cluster (``ray.cluster_utils``,
three nodes) answers as one machine does.

The graph is made here (three dense blocks joined by a few edges, features drawn at random): the
repository holds no copy of it. Its partitions are written by ``quiver_serve.partition`` and
mapped by the partition servers; the ingress is the real Ray Serve application on a free port.

* 2 partitions (calls between servers over the wire, and as Ray calls) and 3 (over the wire,
  with a transport delay injected): seeded answers equal the
  single-machine engine's (``LocalEngine``, <= 1e-5), exact answers equal PyG's full-graph
  output; the KServe route, ``/v1/graph``, ``/metrics`` and the error contract.
* A partition server killed (SIGKILL) under load: requests needing it are answered 503 with
  Retry-After, never a wrong row; ids whose neighbourhood it does not hold keep being served;
  Ray restarts it from its folder and its ids are answered again within 30 s.
* With two replicas per partition, one killed under load: every request is answered 200 with
  the right rows (the other replica takes over), and Ray brings the killed one back.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import numpy as np
import pytest
import torch

pytest.importorskip("ray.serve")

from quiver_serve.config import ServeConfig  # noqa: E402
from quiver_serve.engine.client.local import LocalEngine  # noqa: E402
from quiver_serve.graph.csc import GraphData  # noqa: E402
from quiver_serve.models.served import build_model  # noqa: E402
from quiver_serve.partition.data import load_book, partition_graph, save_partitions  # noqa: E402
from tests.conftest import free_port, small_config  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

BLOCKS, BLOCK_NODES, FEATURES = 3, 300, 24


def block_graph(seed: int = 3) -> GraphData:
    """Three blocks of 300 nodes, ~6 in-edges each inside the block, 12 edges between blocks."""
    rng = np.random.default_rng(seed)
    n = BLOCKS * BLOCK_NODES
    dst = rng.integers(0, n, 6 * n)
    src = (dst // BLOCK_NODES) * BLOCK_NODES + rng.integers(0, BLOCK_NODES, dst.size)
    cross_dst, cross_src = rng.integers(0, n, 12), rng.integers(0, n, 12)
    pairs = np.unique(np.stack([np.concatenate([dst, cross_dst]),
                                np.concatenate([src, cross_src])], 1), axis=0)
    indptr = np.zeros(n + 1, np.int64)
    np.add.at(indptr, pairs[:, 0] + 1, 1)
    x = torch.from_numpy(rng.standard_normal((n, FEATURES)).astype(np.float32))
    return GraphData("blocks", torch.from_numpy(np.cumsum(indptr)),
                     torch.from_numpy(pairs[:, 1].copy()), x)


def config(**overrides: Any) -> ServeConfig:
    settings: dict[str, Any] = {
        "sampling__num_cpu_workers": 0, "model__weights": None, "exact__materialize": "off",
        "server__request_timeout_s": 5.0, "partitioned__remote_timeout_s": 1.0,
        "partitioned__down_s": 0.5}
    return small_config(**{**settings, **overrides})


@pytest.fixture(scope="module")
def graph() -> GraphData:
    return block_graph()


@pytest.fixture(scope="module")
def engine(graph: GraphData) -> Iterator[LocalEngine]:
    """The single machine's answers: one engine core over the whole graph."""
    eng = LocalEngine(config(), graph)
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def full_graph_output(graph: GraphData) -> torch.Tensor:
    model = build_model(config().model, graph.num_features)
    with torch.no_grad():
        return model(graph.x, graph.edge_index())


@pytest.fixture(scope="module")
def cluster() -> Iterator[int]:
    """A three-node Ray cluster with Serve's proxy on a free port (the port is yielded)."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "include_dashboard": False, "object_store_memory": 100 << 20})
    for _ in range(2):
        c.add_node(num_cpus=2, object_store_memory=100 << 20)
    ray.init(address=c.address, log_to_driver=False)
    port = free_port()
    # one proxy, on the head: the cluster's nodes share this host and port, and a proxy Serve
    # starts or drains on another node as replicas move resets the connections it took
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    try:
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()
        c.shutdown()


def partitions(graph: GraphData, parts: int, tmp: Path) -> Path:
    book, datas, stats = partition_graph(graph, parts, "metis", hot_budget_bytes=40 * FEATURES * 4,
                                         fap_fanouts=config().sampling.fanouts)
    out = tmp / f"parts{parts}"
    save_partitions(out, book, datas, stats, graph.name)
    return out


class Served:
    """One partitioned deployment behind the ingress: its URL and its servers."""

    def __init__(self, cfg: ServeConfig, data_dir: Path, name: str, port: int,
                 replicas: int = 1) -> None:
        from ray import serve

        from quiver_serve.scaleout.partitioned import deploy
        from quiver_serve.scaleout.ray_start import Reservations

        self.deployment = deploy.start_servers(cfg, data_dir, replicas,
                                               Reservations(0.5, 0, 0.2), 120)
        serve.run(deploy.ingress_app(cfg, self.deployment, 0.2), name=name, route_prefix="/")
        self.url, self.name = f"http://127.0.0.1:{port}", name
        self.client = httpx.Client(timeout=30.0)

    def embed(self, ids: list[int], **body: Any) -> httpx.Response:
        return self.client.post(self.url + "/v1/embed", json={"node_ids": ids, **body})

    def close(self) -> None:
        from ray import serve

        self.client.close()
        serve.delete(self.name)
        self.deployment.kill()


def rows(r: httpx.Response) -> np.ndarray:
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["embeddings"], dtype=np.float32)


def check_answers(served: Served, engine: LocalEngine, full: torch.Tensor, n: int) -> None:
    """Seeded answers equal the engine's, exact answers PyG's full graph, across owners."""
    rng = np.random.default_rng(5)
    for seed in (0, 7, 2**40 + 1):
        ids = rng.integers(0, n, 12).tolist() + [0, n - 1, 0]
        np.testing.assert_allclose(rows(served.embed(ids, seed=seed)),
                                   engine.embed(np.array(ids), seed=seed), atol=1e-5, rtol=0)
    ids = [0, n - 1, 5, 450, 5, 899, 301]
    exact = rows(served.embed(ids, exact=True))
    np.testing.assert_allclose(exact, full[ids].numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(exact, engine.embed(np.array(ids), exact=True), atol=1e-5, rtol=0)


@pytest.mark.parametrize("transport", ["wire", "ray"])
def test_two_partitions_answer_as_one_machine(cluster: int, graph: GraphData, engine: LocalEngine,
                                              full_graph_output: torch.Tensor, transport: str,
                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    cfg = config(partitioned__transport=transport)
    served = Served(cfg, partitions(graph, 2, tmp_path_factory.mktemp("p2")), f"p2{transport}",
                    cluster)
    try:
        check_answers(served, engine, full_graph_output, graph.num_nodes)
        ids = [3, 600, 3]
        infer = served.client.post(served.url + f"/v2/models/{cfg.model.name}/infer", json={
            "inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [3], "data": ids}],
            "parameters": {"seed": 11}})
        assert infer.status_code == 200, infer.text
        out = infer.json()["outputs"][0]
        np.testing.assert_allclose(np.asarray(out["data"], np.float32).reshape(out["shape"]),
                                   engine.embed(np.array(ids), seed=11), atol=1e-5, rtol=0)
        bad = served.embed([1, 99999])
        assert bad.status_code == 400 and "99999" in bad.json()["error"]["message"]
        assert served.embed("x").status_code == 422  # type: ignore[arg-type]
        living = served.embed([1], min_version=3)
        assert living.status_code == 400 and living.json()["error"]["code"] == "invalid_min_version"
        check_new_nodes(served, graph)
        listed = served.client.get(served.url + "/v1/graph").json()
        assert listed["num_parts"] == 2 and listed["num_nodes"] == graph.num_nodes
        assert sum(p["servers"][0]["nodes"] for p in listed["partitions"]) == graph.num_nodes
        assert {p["servers"][0]["transport"] for p in listed["partitions"]} == {transport}
        metrics = served.client.get(served.url + "/metrics").text
        assert 'quiver_serve_partition_remote_calls_total{hop="1"' in metrics
        assert "quiver_serve_partition_hot_hit_ratio" in metrics
        assert served.client.get(served.url + "/v2/health/ready").status_code == 200
    finally:
        served.close()


def with_nodes(graph: GraphData, features: np.ndarray, lists: list[list[int]]) -> GraphData:
    """``graph`` with nodes ``n, n + 1, ...`` added (these rows and in-lists)."""
    indptr = torch.cat([graph.indptr, graph.indptr[-1] + torch.cumsum(
        torch.tensor([len(x) for x in lists]), 0)])
    indices = torch.cat([graph.indices, torch.tensor([u for x in lists for u in x],
                                                     dtype=torch.int64)])
    return GraphData("with-nodes", indptr, indices, torch.cat([graph.x,
                                                               torch.from_numpy(features)]))


def check_new_nodes(served: Served, graph: GraphData) -> None:
    """A request's own new nodes over HTTP: exact rows equal PyG's full-graph output on the
    graph with them added; their rows follow the ids'; bad ones refused, naming them."""
    rng = np.random.default_rng(12)
    rows = rng.standard_normal((2, graph.num_features)).round(3).astype(np.float32)
    lists = [[4, 601, 4], [899]]
    bigger = with_nodes(graph, rows, lists)
    model = build_model(config().model, graph.num_features)
    with torch.no_grad():
        full = model(bigger.x, bigger.edge_index()).numpy()
    new = [{"features": r.tolist(), "in_neighbors": x} for r, x in zip(rows, lists, strict=True)]
    got = served.client.post(served.url + "/v1/embed", json={
        "node_ids": [3, 700], "new_nodes": new, "exact": True})
    assert got.status_code == 200, got.text
    np.testing.assert_allclose(np.asarray(got.json()["embeddings"], np.float32),
                               full[[3, 700, graph.num_nodes, graph.num_nodes + 1]], atol=1e-4,
                               rtol=0)
    only = served.client.post(served.url + "/v1/embed", json={"new_nodes": new[:1],
                                                               "exact": True})
    assert only.status_code == 200, only.text
    np.testing.assert_allclose(np.asarray(only.json()["embeddings"], np.float32),
                               full[[graph.num_nodes]], atol=1e-4, rtol=0)
    for bad, status, named in (
            ([{"features": [1.0], "in_neighbors": [1]}], 422, "features"),
            ([{"features": rows[0].tolist(), "in_neighbors": [1, 99999]}], 400, "99999"),
            ([{"features": rows[0].tolist(), "in_neighbors": {"cites": [1]}}], 422, "typed")):
        r = served.client.post(served.url + "/v1/embed", json={"node_ids": [1],
                                                                "new_nodes": bad})
        assert r.status_code == status and named in r.json()["error"]["message"], r.text


def hop_closure(graph: GraphData, ids: np.ndarray, hops: int) -> np.ndarray:
    """Every node within ``hops`` in-hops of ``ids`` (and ``ids``)."""
    seen = set(ids.tolist())
    frontier = list(seen)
    for _ in range(hops):
        nxt = []
        for v in frontier:
            for u in graph.indices[graph.indptr[v]:graph.indptr[v + 1]].tolist():
                if u not in seen:
                    seen.add(u)
                    nxt.append(u)
        frontier = nxt
    return np.fromiter(seen, np.int64)


def test_three_partitions_with_a_slow_network_and_a_killed_server(
        cluster: int, graph: GraphData, engine: LocalEngine, full_graph_output: torch.Tensor,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    data_dir = partitions(graph, 3, tmp_path_factory.mktemp("p3"))
    served = Served(config(partitioned__transport_delay_ms=3.0), data_dir, "p3", cluster)
    try:
        check_answers(served, engine, full_graph_output, graph.num_nodes)
        metrics = served.client.get(served.url + "/metrics").text.splitlines()
        # every remote call waited the injected 3 ms: none is in the buckets up to 2 ms
        fast = [line for line in metrics if line.startswith(
            "quiver_serve_partition_remote_call_seconds_bucket") and 'le="0.002"' in line]
        assert fast and all(line.endswith(" 0.0") for line in fast), fast
        killed_under_load(served, engine, graph, data_dir)
    finally:
        served.close()


class Answer(NamedTuple):
    at_s: float  # monotonic time it came
    status: int
    node: int
    ok: bool  # 200: the right rows; else: Retry-After given
    took_s: float


def killed_under_load(served: Served, engine: LocalEngine, graph: GraphData,
                      data_dir: Path) -> None:
    book = load_book(data_dir)
    victim = 2
    fanout_hops = len(config().sampling.fanouts)
    safe = [v for v in range(graph.num_nodes) if book.owner[v] != victim and not (
        book.owner[hop_closure(graph, np.array([v]), fanout_hops)] == victim).any()]
    needy = [v for v in range(graph.num_nodes) if book.owner[v] == victim][:40]
    assert len(safe) >= 10, "the block graph should leave ids that never reach the victim"
    expected = {v: engine.embed(np.array([v]), seed=v) for v in safe[:20] + needy}
    listed = served.client.get(served.url + "/v1/graph").json()
    pid = listed["partitions"][victim]["servers"][0]["pid"]
    stop, seen = threading.Event(), list[Answer]()
    load = [threading.Thread(target=_load, args=(served.url, group, expected, stop, seen))
            for group in (safe[:20], needy)]  # each its own client: a slow one blocks no other
    for t in load:
        t.start()
    time.sleep(1.0)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    back_s = None
    while time.monotonic() - killed_at < 30.0 and back_s is None:
        time.sleep(0.5)
        recent = [a for a in seen if a.at_s > killed_at]
        if any(a.status == 503 for a in recent) and any(
                a.status == 200 and book.owner[a.node] == victim and a.at_s > killed_at + 1.0
                for a in recent):
            back_s = time.monotonic() - killed_at
    time.sleep(0.5)
    stop.set()
    for t in load:
        t.join(30)
    after = [a for a in seen if a.at_s > killed_at]
    codes = {a.status for a in after}
    assert codes <= {200, 503}, f"statuses {sorted(codes)}"
    # never a hang: the request's deadline (5 s) and the ingress's margin bound every answer
    assert max(a.took_s for a in seen) < 8.0, "a request waited past its deadline"
    assert all(a.ok for a in seen if a.status == 200), "a wrong answer was served"
    assert all(a.ok for a in after if a.status == 503), "503 without Retry-After"
    assert any(a.status == 503 for a in after), "no request needed the killed server"
    safe_during = [a.status for a in after if a.node in safe and a.at_s < killed_at + 3.0]
    assert safe_during and set(safe_during) == {200}, "ids not needing it were refused"
    assert back_s is not None, "the killed partition's ids were not answered within 30 s"


def _load(url: str, ids: list[int], expected: dict[int, np.ndarray], stop: threading.Event,
          seen: list[Answer]) -> None:
    """Seeded single-id requests in a loop, each answer recorded."""
    with httpx.Client(timeout=30.0) as client:
        i = 0
        while not stop.is_set():
            v = ids[i % len(ids)]
            i += 1
            t0 = time.monotonic()
            r = client.post(url + "/v1/embed", json={"node_ids": [v], "seed": v})
            if r.status_code == 200:
                ok = bool(np.allclose(np.asarray(r.json()["embeddings"], np.float32),
                                      expected[v], atol=1e-5, rtol=0))
            else:
                ok = r.headers.get("retry-after") is not None
            seen.append(Answer(time.monotonic(), r.status_code, v, ok, time.monotonic() - t0))


def test_a_second_replica_takes_over_a_killed_one(
        cluster: int, graph: GraphData, engine: LocalEngine,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    served = Served(config(), partitions(graph, 2, tmp_path_factory.mktemp("r2")), "r2",
                    cluster, replicas=2)
    try:
        ids = list(range(0, graph.num_nodes, 37))
        expected = {v: engine.embed(np.array([v]), seed=v) for v in ids}
        before = served.client.get(served.url + "/v1/graph").json()["partitions"][1]["servers"]
        stop, seen = threading.Event(), list[Answer]()
        load = [threading.Thread(target=_load, args=(served.url, ids[i::2], expected, stop, seen))
                for i in range(2)]
        for t in load:
            t.start()
        time.sleep(1.0)
        os.kill(before[0]["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        back = False
        while not back and time.monotonic() - killed_at < 30.0:
            time.sleep(1.0)
            now = served.client.get(served.url + "/v1/graph").json()["partitions"][1]["servers"]
            back = not now[0]["down"] and now[0]["pid"] not in (None, before[0]["pid"])
        stop.set()
        for t in load:
            t.join(30)
        after = [a for a in seen if a.at_s > killed_at]
        assert after and {a.status for a in seen} == {200}, \
            f"statuses {sorted({a.status for a in seen})}"
        assert all(a.ok for a in seen), "a wrong answer was served"
        assert back, "Ray did not bring the killed replica back within 30 s"
    finally:
        served.close()

"""New nodes across partitions and replicas that follow their partition's log, on a local Ray
cluster (``ray.cluster_utils``, three nodes; the graph is made in the test).

* ``POST /v1/graph/nodes`` hands out the ids one machine's daemon would (the node count, +1, ...),
  at the least-loaded partition; edges into, out of and between new nodes across partitions and
  rows of new nodes are written; seeded answers equal ``LocalEngine`` over the grown whole
  graph and exact answers PyG's full-graph output over it. The owner of new nodes and the
  ingress killed (SIGKILL): both come back knowing every acknowledged node from the logs, and
  the next call's ids follow on; a call logged at its owner only is completed by the next.
* Two replicas per partition: every replica answers exactly as PyG after updates, a replica
  honours ``min_version`` at once (its follower reads the log before it answers), a version
  never reached is a 504 naming the partition, and a replica killed while updates go on comes
  back from its snapshot and the log with the primary's version and its answers.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("ray.serve")

from quiver_serve.engine.client.local import LocalEngine  # noqa: E402
from quiver_serve.graph.csc import GraphData  # noqa: E402
from quiver_serve.models.served import build_model  # noqa: E402
from quiver_serve.partition.data import load_book, load_partition  # noqa: E402
from tests.scaleout import test_partitioned as harness  # noqa: E402
from tests.scaleout.test_partitioned import FEATURES, Served, config, partitions, rows  # noqa: E402

#: the harness's fixtures: a three-node Ray cluster with Serve (its port), the block graph
cluster, graph = harness.cluster, harness.graph

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def grown(base: GraphData, new_rows: list[list[float]], add: list[list[int]],
          written: dict[int, list[float]]) -> GraphData:
    """``base`` with nodes appended (rows ``new_rows``), then edges added (each in-list: the base
    list, then the added sources in the order they came) and rows overwritten."""
    n = base.num_nodes + len(new_rows)
    lists = [base.indices[base.indptr[v]:base.indptr[v + 1]].tolist()
             for v in range(base.num_nodes)] + [[] for _ in new_rows]
    for src, dst in add:
        lists[dst].append(src)
    indptr = np.cumsum([0] + [len(nbrs) for nbrs in lists])
    x = torch.cat([base.x, torch.tensor(new_rows, dtype=torch.float32).reshape(-1, FEATURES)])
    for v, row in written.items():
        x[v] = torch.tensor(row)
    assert x.shape[0] == n
    return GraphData("blocks-grown", torch.from_numpy(indptr.astype(np.int64)),
                     torch.tensor([u for nbrs in lists for u in nbrs], dtype=torch.int64), x)


def full_output(g: GraphData) -> np.ndarray:
    model = build_model(config().model, g.num_features)
    with torch.no_grad():
        return model(g.x, g.edge_index()).numpy()


def merge(token: dict[str, int], answer: dict[str, Any]) -> dict[str, int]:
    out = dict(token)
    for p, v in answer["versions"].items():
        out[p] = max(out.get(p, 0), v)
    return out


def check_grown(served: Served, g: GraphData, token: dict[str, int], new_ids: list[int]) -> None:
    """Seeded answers (new ids among them, first and later) equal the engine's over ``g``;
    exact answers of every node PyG's full-graph output."""
    engine = LocalEngine(config(), g)
    try:
        rng = np.random.default_rng(9)
        for seed, first in ((1, new_ids[0]), (23, 3), (5, new_ids[-1])):
            ids = [first, *rng.integers(0, g.num_nodes, 10).tolist(), *new_ids]
            got = rows(served.embed(ids, seed=seed, min_version=token))
            np.testing.assert_allclose(got, engine.embed(np.array(ids), seed=seed), atol=1e-5,
                                       rtol=0)
        exact = rows(served.embed(list(range(g.num_nodes)), exact=True, min_version=token))
        np.testing.assert_allclose(exact, full_output(g), atol=1e-4, rtol=1e-4)
    finally:
        engine.stop()


def post(served: Served, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = served.client.post(served.url + path, json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def routed(served: Served) -> None:
    """Until Serve's proxy routes to the application (its route table follows a deployment
    after a moment, more so after another application at the same prefix was deleted)."""
    deadline = time.monotonic() + 30.0
    while served.client.get(served.url + "/v2/health/ready").status_code != 200:
        assert time.monotonic() < deadline, "the ingress was not routed to within 30 s"
        time.sleep(0.2)


def wait_back(served: Served, part: int, replica: int, old_pid: int) -> None:
    """Until partition ``part``'s replica answers again from a new process."""
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        time.sleep(0.5)
        r = served.client.get(served.url + "/v1/graph")
        if r.status_code != 200:
            continue
        now = r.json()["partitions"][part]["servers"][replica]
        if not now["down"] and now["pid"] not in (None, old_pid):
            return
    pytest.fail(f"partition {part} replica {replica} was not back within 60 s")


class Written:
    """What a test wrote so far through the ingress, and the token of it all."""

    def __init__(self, base: GraphData) -> None:
        self.base = base
        self.rows: list[list[float]] = []
        self.add: list[list[int]] = []
        self.written: dict[int, list[float]] = {}
        self.token: dict[str, int] = {}

    def graph(self) -> GraphData:
        return grown(self.base, self.rows, self.add, self.written)

    def nodes(self, served: Served, new_rows: list[list[float]]) -> list[int]:
        answer = post(served, "/v1/graph/nodes", {"features": new_rows})
        assert set(answer["versions"]) == {"0", "1"}  # every partition logged them
        self.rows += new_rows
        self.token = merge(self.token, answer)
        ids: list[int] = answer["node_ids"]
        return ids

    def edges(self, served: Served, add: list[list[int]]) -> None:
        answer = post(served, "/v1/graph/edges", {"add": add})
        assert answer["added"] == len(add)
        self.add += add
        self.token = merge(self.token, answer)

    def features(self, served: Served, ids: list[int], new_rows: list[list[float]]) -> None:
        put = served.client.put(served.url + "/v1/graph/features",
                                json={"node_ids": ids, "features": new_rows})
        assert put.status_code == 200, put.text
        self.written.update(zip(ids, new_rows, strict=True))
        self.token = merge(self.token, put.json())


def draw(rng: np.random.Generator, count: int) -> list[list[float]]:
    out: list[list[float]] = rng.standard_normal((count, FEATURES)).round(3).tolist()
    return out


def write_across(served: Served, w: Written, data_dir: Any, owner: int,
                 rng: np.random.Generator) -> None:
    """Two node calls, edges into, out of and between new nodes across both partitions, rows
    of a new node and of a replicated hot node; then the answers are one machine's."""
    n, book = w.base.num_nodes, load_book(data_dir)
    assert w.nodes(served, draw(rng, 3)) == [n, n + 1, n + 2]
    assert w.nodes(served, draw(rng, 2)) == [n + 3, n + 4]
    old = [int(book.global_ids(0)[5]), int(book.global_ids(1)[7])]
    w.edges(served, [[n, old[0]], [n, old[1]], [old[0], n + 1], [old[1], n + 3], [n + 3, n],
                     [n + 4, n + 4], [n + 1, n + 3], [old[1], n]])
    w.features(served, [n + 2, int(load_partition(data_dir, owner).hot_ids[0]), n], draw(rng, 3))
    check_grown(served, w.graph(), w.token, list(range(n, n + 5)))
    listed = served.client.get(served.url + "/v1/graph").json()
    assert listed["num_nodes"] == n + 5
    assert [s["servers"][0]["graph_nodes"] for s in listed["partitions"]] == [n + 5] * 2


def kill_owner_and_ingress(served: Served, w: Written, owner: int) -> None:
    """The owner of the first new nodes and the ingress SIGKILLed: both back from the logs."""
    n = w.base.num_nodes
    listed = served.client.get(served.url + "/v1/graph").json()
    victim = listed["partitions"][owner]["servers"][0]["pid"]
    os.kill(victim, signal.SIGKILL)
    os.kill(listed["ingress_pid"], signal.SIGKILL)
    wait_back(served, owner, 0, victim)
    # its peers find its new address after a failed call (decision 0045): every partition
    # asks every other once
    deadline = time.monotonic() + 60.0
    while served.embed(list(range(n + 5)), exact=True, min_version=w.token).status_code != 200:
        assert time.monotonic() < deadline, "the new nodes were not answered again"
        time.sleep(0.5)
    again = served.client.get(served.url + "/v1/graph").json()
    assert again["ingress_pid"] != listed["ingress_pid"] and again["num_nodes"] == n + 5
    check_grown(served, w.graph(), w.token, list(range(n, n + 5)))


def test_new_nodes_across_partitions_answer_as_one_machine(
        cluster: int, graph: GraphData, tmp_path_factory: pytest.TempPathFactory) -> None:
    import ray

    data_dir = partitions(graph, 2, tmp_path_factory.mktemp("nodes2"))
    owner = int(np.argmin(load_book(data_dir).sizes()))  # the least-loaded takes the first ones
    n, rng, w = graph.num_nodes, np.random.default_rng(11), Written(graph)
    served = Served(config(), data_dir, "nodes2", cluster)
    try:
        routed(served)
        write_across(served, w, data_dir, owner, rng)
        kill_owner_and_ingress(served, w, owner)
        assert w.nodes(served, draw(rng, 1)) == [n + 5]  # the ids follow on
        w.edges(served, [[n + 5, n], [n, n + 5]])
        check_grown(served, w.graph(), w.token, [n, n + 5])

        # a call the ingress could not finish: logged at its owner only (as when the other
        # partition is lost after the owner answered); the next call completes it first
        half_rows = draw(rng, 1)
        half = ray.get(served.deployment.servers[1][0].update.remote(
            "nodes", [n + 6, 1, 1], half_rows))
        assert "code" not in half, half
        w.rows += half_rows
        assert w.nodes(served, draw(rng, 1)) == [n + 7]
        listed = served.client.get(served.url + "/v1/graph").json()
        assert [s["servers"][0]["graph_nodes"] for s in listed["partitions"]] == [n + 8] * 2
        check_grown(served, w.graph(), w.token, [n + 6, n + 7])
    finally:
        served.close()


def replicas_agree(served: Served, w: Written) -> None:
    """Every replica of every partition, once at the token's versions, draws and computes as
    the others: exact answers PyG's, seeded answers identical."""
    import ray

    servers, n = served.deployment.servers, w.base.num_nodes
    full, all_ids = full_output(w.graph()), np.arange(w.graph().num_nodes)
    for p in (0, 1):
        for r in (0, 1):
            want = w.token[str(p)]
            assert ray.get(servers[p][r].wait_version.remote(want, 5.0)) >= want
            got = ray.get(servers[p][r].embed.remote(all_ids, True, None, 20.0))
            np.testing.assert_allclose(got, full, atol=1e-4, rtol=1e-4)
    seeded = [ray.get(servers[p][r].embed.remote(np.array([n, 3, n + 1]), False, 7, 20.0))
              for p in (0, 1) for r in (0, 1)]
    for other in seeded[1:]:
        np.testing.assert_array_equal(other, seeded[0])


def kill_replica_under_updates(served: Served, w: Written, book: Any) -> None:
    """Replica 1 of partition 1 SIGKILLed while single-edge updates go on: back from its
    snapshot and the log with the primary's version and answers over the final graph."""
    import ray

    servers, n = served.deployment.servers, w.base.num_nodes
    listed = served.client.get(served.url + "/v1/graph").json()
    victim = listed["partitions"][1]["servers"][1]["pid"]
    acked: list[list[int]] = []
    refused: list[str] = []
    stop = threading.Event()

    def updates() -> None:
        local = np.random.default_rng(13)
        while not stop.is_set() and len(acked) < 400:
            pair = [int(local.integers(0, n + 2)), int(book.global_ids(1)[local.integers(0, 50)])]
            r = served.client.post(served.url + "/v1/graph/edges", json={"add": [pair]})
            if r.status_code != 200:
                refused.append(r.text)
                return
            acked.append(pair)

    writer = threading.Thread(target=updates)
    writer.start()
    time.sleep(0.3)
    os.kill(victim, signal.SIGKILL)
    before_back = len(acked)
    wait_back(served, 1, 1, victim)  # updates go on while it restarts
    stop.set()
    writer.join(60.0)
    assert not refused and len(acked) > before_back > 0, refused
    versions = [ray.get(servers[1][r].wait_version.remote(0, 1.0)) for r in (0, 1)]
    assert versions[0] == versions[1] == w.token["1"] + len(acked)
    w.add += acked
    got = ray.get(servers[1][1].embed.remote(np.arange(w.graph().num_nodes), True, None, 20.0))
    np.testing.assert_allclose(got, full_output(w.graph()), atol=1e-4, rtol=1e-4)


def test_replicas_follow_their_partitions_log(
        cluster: int, graph: GraphData, tmp_path_factory: pytest.TempPathFactory) -> None:
    data_dir = partitions(graph, 2, tmp_path_factory.mktemp("rep2"))
    book = load_book(data_dir)
    n, rng, w = graph.num_nodes, np.random.default_rng(12), Written(graph)
    served = Served(config(), data_dir, "rep2", cluster, replicas=2)
    try:
        routed(served)
        assert w.nodes(served, draw(rng, 2)) == [n, n + 1]
        old = [int(book.global_ids(0)[2]), int(book.global_ids(1)[4])]
        w.edges(served, [[n, old[0]], [old[1], n], [n + 1, old[1]], [old[0], n + 1]])
        replicas_agree(served, w)

        # min_version on a replica: an update, then at once reads with its token
        w.edges(served, [[n + 1, n], [old[1], old[0]]])
        engine = LocalEngine(config(), w.graph())
        try:
            want = engine.embed(np.array([n, old[0]]), seed=3)
            for _ in range(4):  # the ingress and the peers go round the replicas
                got = rows(served.embed([n, old[0]], seed=3, min_version=w.token))
                np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
        finally:
            engine.stop()
        late = served.embed([1], min_version={"1": w.token["1"] + 1000}, timeout_ms=300)
        assert late.status_code == 504 and "partition 1" in late.json()["error"]["message"]
        kill_replica_under_updates(served, w, book)
    finally:
        served.close()

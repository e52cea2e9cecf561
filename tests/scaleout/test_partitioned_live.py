"""The living graph across partitions on a local Ray cluster (``ray.cluster_utils``): updates go
to the partitions that own them, answer a version token ``min_version`` takes, and the answers
on the updated graph equal one machine's on that graph.

* Edges added and removed across two partitions, feature rows written (replicated hot copies
  among them): seeded answers equal ``LocalEngine`` over the updated whole graph, exact answers
  PyG's full-graph output over it.
* ``POST /v1/graph/compact`` folds every partition's updates into a base of its log (lists
  sorted by id, as the daemon's compaction leaves them); answers then equal one machine's on the
  sorted graph.
* A partition server killed (SIGKILL) after acknowledged updates: Ray restarts it, it maps its
  log's base and the answers are still those of the updated graph.
* The contract: a numeric or unknown-partition ``min_version`` is a 400 naming it, a version
  never reached a 504 within the request's deadline, bad ids a 400, new nodes of the wrong width
  a 422.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

pytest.importorskip("ray.serve")

from quiver_serve.engine.client.local import LocalEngine  # noqa: E402
from quiver_serve.graph.csc import GraphData  # noqa: E402
from quiver_serve.models.served import build_model  # noqa: E402
from quiver_serve.partition.data import load_book, load_partition  # noqa: E402
from tests.scaleout import test_partitioned as harness  # noqa: E402
from tests.scaleout.test_partitioned import Served, config, partitions, rows  # noqa: E402

#: the harness's fixtures: a three-node Ray cluster with Serve (its port), the block graph
cluster, graph = harness.cluster, harness.graph

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def updated(base: GraphData, add: list[list[int]], remove: list[list[int]],
            written: dict[int, list[float]]) -> GraphData:
    """``base`` after the updates, each list as the overlay keeps it: the base list without
    every copy of a removed pair, then the added sources in the order they came."""
    n = base.num_nodes
    lists = [base.indices[base.indptr[v]:base.indptr[v + 1]].tolist() for v in range(n)]
    for src, dst in remove:
        lists[dst] = [u for u in lists[dst] if u != src]
    for src, dst in add:
        lists[dst].append(src)
    indptr = np.cumsum([0] + [len(nbrs) for nbrs in lists])
    x = base.x.clone()
    for v, row in written.items():
        x[v] = torch.tensor(row)
    return GraphData("blocks-updated", torch.from_numpy(indptr.astype(np.int64)),
                     torch.tensor([u for nbrs in lists for u in nbrs], dtype=torch.int64), x)


def sorted_lists(graph: GraphData) -> GraphData:
    """``graph`` with every in-list sorted by id (what a compaction makes of it)."""
    indices = graph.indices.clone()
    for v in range(graph.num_nodes):
        lo, hi = int(graph.indptr[v]), int(graph.indptr[v + 1])
        indices[lo:hi] = torch.sort(indices[lo:hi]).values
    return GraphData(graph.name, graph.indptr, indices, graph.x)


def check_updated(served: Served, new: GraphData, token: dict[str, int]) -> None:
    engine = LocalEngine(config(), new)
    try:
        rng = np.random.default_rng(9)
        for seed in (1, 23):
            ids = rng.integers(0, new.num_nodes, 16).tolist()
            got = rows(served.embed(ids, seed=seed, min_version=token))
            np.testing.assert_allclose(got, engine.embed(np.array(ids), seed=seed), atol=1e-5,
                                       rtol=0)
        model = build_model(config().model, new.num_features)
        with torch.no_grad():
            full = model(new.x, new.edge_index())
        ids = list(range(new.num_nodes))
        exact = rows(served.embed(ids, exact=True, min_version=token))
        np.testing.assert_allclose(exact, full.numpy(), atol=1e-4, rtol=1e-4)
    finally:
        engine.stop()


def test_updates_across_partitions_survive_a_killed_server(
        cluster: int, graph: GraphData, tmp_path_factory: pytest.TempPathFactory) -> None:
    data_dir = partitions(graph, 2, tmp_path_factory.mktemp("live2"))
    book = load_book(data_dir)
    served = Served(config(), data_dir, "live2", cluster)
    try:
        rng = np.random.default_rng(4)
        add = rng.integers(0, graph.num_nodes, (12, 2)).tolist() + [[5, 5], [5, 5]]
        dst = int(book.global_ids(1)[3])
        remove = [[int(graph.indices[graph.indptr[dst]]), dst]]
        post = served.client.post(served.url + "/v1/graph/edges",
                                  json={"add": add, "remove": remove})
        assert post.status_code == 200, post.text
        answer = post.json()
        assert answer["added"] == len(add) and answer["removed"] >= 1
        assert set(answer["versions"]) == {"0", "1"}
        # rows of nodes replicated as hot copies on the other partition, and one that is not
        hot = [int(load_partition(data_dir, p).hot_ids[0]) for p in (0, 1)]
        ids = hot + [7]
        features = rng.standard_normal((len(ids), graph.num_features)).round(3).tolist()
        put = served.client.put(served.url + "/v1/graph/features",
                                json={"node_ids": ids, "features": features})
        assert put.status_code == 200, put.text
        token = {**answer["versions"]}
        for p, v in put.json()["versions"].items():
            token[p] = max(token.get(p, 0), v)
        new = updated(graph, add, remove, dict(zip(ids, features, strict=True)))
        check_updated(served, new, token)

        contract(served, token)

        # a compaction of every partition's log: its lists sorted by id, as the daemon's
        compacted = served.client.post(served.url + "/v1/graph/compact")
        assert compacted.status_code == 200, compacted.text
        answers = compacted.json()["partitions"]
        assert {p: a["version"] for p, a in answers.items()} == token
        assert all(a["compacted"] for a in answers.values())
        new = sorted_lists(new)
        check_updated(served, new, token)

        pid = served.client.get(served.url + "/v1/graph").json()["partitions"][1]["servers"][0]
        os.kill(pid["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            time.sleep(0.5)
            now = served.client.get(served.url + "/v1/graph").json()["partitions"][1]["servers"]
            if not now[0]["down"] and now[0]["pid"] not in (None, pid["pid"]):
                break
        else:
            pytest.fail("the killed partition server was not back within 60 s")
        # its peers find its new address after a failed call or two (test_partitioned.py)
        probe = [int(book.global_ids(0)[0]), int(book.global_ids(1)[0])]
        while served.embed(probe, seed=1, min_version=token).status_code != 200:
            assert time.monotonic() < deadline + 30.0, "its ids were not answered again"
            time.sleep(0.5)
        listed = served.client.get(served.url + "/v1/graph").json()["partitions"]
        assert [p["servers"][0]["version"] for p in listed] == [token["0"], token["1"]]
        assert [p["servers"][0]["base_version"] for p in listed] == [token["0"], token["1"]]
        check_updated(served, new, token)
    finally:
        served.close()


def contract(served: Served, token: dict[str, int]) -> None:
    def code(r: object) -> tuple[int, str]:
        return r.status_code, r.json()["error"]["code"]  # type: ignore[attr-defined]

    assert code(served.embed([1], min_version=3)) == (400, "invalid_min_version")
    bad = served.embed([1], min_version={"7": 1})
    assert code(bad) == (400, "invalid_min_version") and "'7'" in bad.json()["error"]["message"]
    t0 = time.monotonic()
    late = served.embed([1], min_version={"0": token["0"] + 1000}, timeout_ms=300)
    assert code(late) == (504, "deadline_exceeded") and time.monotonic() - t0 < 3.0
    edges = served.client.post(served.url + "/v1/graph/edges", json={"add": [[1, 99999]]})
    assert code(edges) == (400, "invalid_node_ids") and "99999" in edges.text
    nodes = served.client.post(served.url + "/v1/graph/nodes", json={"features": [[0.0]]})
    assert code(nodes) == (422, "invalid_features") and "24" in nodes.text
    mismatch = served.client.put(served.url + "/v1/graph/features",
                                 json={"node_ids": [1, 2], "features": [[0.0] * 24]})
    assert code(mismatch)[0] == 422

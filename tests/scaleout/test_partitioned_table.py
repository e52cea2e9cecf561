"""The exact table across partitions on a local Ray cluster (decision 0065): every server's
table becomes fresh, exact requests through the ingress are answered from it and equal PyG's
full-graph output, and after edge and feature updates across partitions (marked by the ingress
before it answers) an exact answer equals PyG's output over the updated graph at once and again
once the tables are fresh; the table's metrics move. A server SIGKILLed while a write's marks
cannot reach it comes back with a fresh table and exact answers."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

pytest.importorskip("ray.serve")

from quiver_serve.graph.csc import GraphData  # noqa: E402
from quiver_serve.models.served import build_model  # noqa: E402
from quiver_serve.partition.data import load_book, load_partition  # noqa: E402
from tests.scaleout import test_partitioned as harness  # noqa: E402
from tests.scaleout.test_partitioned import Served, config, partitions, rows  # noqa: E402
from tests.scaleout.test_partitioned_live import updated  # noqa: E402

cluster, graph = harness.cluster, harness.graph

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def tables(served: Served) -> list[dict]:
    listed = served.client.get(served.url + "/v1/graph").json()["partitions"]
    return [s["table"] for p in listed for s in p["servers"]]


def wait_fresh(served: Served, timeout_s: float = 90.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        now = tables(served)
        if all(t is not None and t["stale_rows"] == 0 for t in now):
            return now
        assert time.monotonic() < deadline, f"the tables were not fresh within {timeout_s} s: {now}"
        time.sleep(0.3)


def full_output(g: GraphData) -> np.ndarray:
    model = build_model(config().model, g.num_features)
    with torch.no_grad():
        return model(g.x, g.edge_index()).numpy()


def test_exact_answers_from_the_tables_stay_exact_after_updates(
        cluster: int, graph: GraphData, tmp_path_factory: pytest.TempPathFactory) -> None:
    data_dir = partitions(graph, 2, tmp_path_factory.mktemp("table2"))
    book = load_book(data_dir)
    served = Served(config(exact__materialize="on"), data_dir, "table2", cluster)
    try:
        before = wait_fresh(served)
        every = list(range(graph.num_nodes))
        np.testing.assert_allclose(rows(served.embed(every, exact=True)), full_output(graph),
                                   atol=1e-5, rtol=0)
        after = tables(served)
        assert all(a["rows_from_table"] >= b["rows_from_table"] + a["rows"]
                   for a, b in zip(after, before, strict=True)), after

        rng = np.random.default_rng(11)
        add = rng.integers(0, graph.num_nodes, (16, 2)).tolist()
        dst = int(book.global_ids(1)[4])
        remove = [[int(graph.indices[graph.indptr[dst]]), dst]]
        post = served.client.post(served.url + "/v1/graph/edges",
                                  json={"add": add, "remove": remove})
        assert post.status_code == 200, post.text
        token = dict(post.json()["versions"])
        ids = [int(load_partition(data_dir, 0).hot_ids[0]), int(book.global_ids(1)[0]), 3]
        features = rng.standard_normal((len(ids), graph.num_features)).round(3).tolist()
        put = served.client.put(served.url + "/v1/graph/features",
                                json={"node_ids": ids, "features": features})
        assert put.status_code == 200, put.text
        for p, v in put.json()["versions"].items():
            token[p] = max(token.get(p, 0), v)
        new = full_output(updated(graph, add, remove, dict(zip(ids, features, strict=True))))
        np.testing.assert_allclose(rows(served.embed(every, exact=True, min_version=token)), new,
                                   atol=1e-5, rtol=0)
        fresh = wait_fresh(served)
        assert all(t["marks"] >= 2 for t in fresh), fresh
        np.testing.assert_allclose(rows(served.embed(every, exact=True, min_version=token)), new,
                                   atol=1e-5, rtol=0)
        final = tables(served)
        assert all(f["rows_from_table"] >= t["rows_from_table"] + t["rows"]
                   for f, t in zip(final, fresh, strict=True)), final
        text = served.client.get(served.url + "/metrics").text
        assert "quiver_serve_partition_exact_table_rows_served_total" in text
        assert 'quiver_serve_partition_exact_table_stale_rows{partition="1",replica="0"} 0.0' \
            in text

        # partition 1's server SIGKILLed: edges into partition 0, whose marks cannot reach it,
        # are answered (it restarts with a stale table; nothing is restarted on its account),
        # and once it is back and fresh the answers are exact over every update
        victim = served.client.get(served.url + "/v1/graph").json()["partitions"][1][
            "servers"][0]["pid"]
        os.kill(victim, signal.SIGKILL)
        more = [[int(book.global_ids(1)[2]), int(book.global_ids(0)[1])],
                [int(book.global_ids(0)[3]), int(book.global_ids(0)[1])]]
        post = served.client.post(served.url + "/v1/graph/edges", json={"add": more})
        assert post.status_code == 200, post.text
        token["0"] = max(token["0"], post.json()["versions"]["0"])
        written = dict(zip(ids, features, strict=True))
        new = full_output(updated(graph, add + more, remove, written))
        deadline = time.monotonic() + 90.0
        while True:
            now = served.client.get(served.url + "/v1/graph").json()["partitions"][1]["servers"]
            if not now[0]["down"] and now[0]["pid"] not in (None, victim):
                break
            assert time.monotonic() < deadline, "the killed server was not back within 90 s"
            time.sleep(0.5)
        wait_fresh(served)
        deadline = time.monotonic() + 60.0
        while (r := served.embed(every, exact=True, min_version=token)).status_code != 200:
            assert time.monotonic() < deadline, r.text  # its peers find its new address
            time.sleep(0.5)
        np.testing.assert_allclose(rows(r), new, atol=1e-5, rtol=0)
        assert all(t["restarted"] == 0 for t in tables(served))
    finally:
        served.close()

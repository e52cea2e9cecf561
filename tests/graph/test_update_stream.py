"""The replayable update stream (``quiver_serve/graph/stream.py``): replaying every op with the plain
reference from the base gives the stream's final graph; removals hit present edges (except the
explicit missing probes); the base keeps ~(1 - f) of the edges; a seed gives one stream."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.datasets import load_planetoid_raw
from quiver_serve.graph.stream import (
    OPS,
    StreamMix,
    apply_reference,
    hold_out,
    request_of,
    sorted_columns,
)
from quiver_serve.paths import DEFAULTS_DIR

CORA_RAW = DEFAULTS_DIR / "planetoid" / "cora" / "raw"
#: every kind of op often, on a small graph
BUSY = StreamMix(edges_per_call=16, remove_ratio=0.5, nodes_every=2, nodes_per_call=3,
                 new_node_edge_share=0.25, features_every=3, features_per_call=5, missing_every=4)


@pytest.fixture(scope="module")
def cora() -> GraphData:
    return load_planetoid_raw(CORA_RAW, "cora")


def multigraph(seed: int = 0, nodes: int = 40, edges: int = 300) -> GraphData:
    """A small random graph with duplicate columns and self loops."""
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, nodes, (2, edges), generator=g)
    loops = torch.arange(0, nodes, 5).repeat(2, 1)  # v -> v, every fifth node
    dups = ei[:, :60]  # second copies of the first 60 columns
    ei = torch.cat([ei, loops, loops[:, :3], dups], dim=1)
    x = torch.randn(nodes, 6, generator=g)
    return GraphData.from_edge_index(ei, x, "multi")


def replay(base: GraphData, ops: list[dict]) -> tuple[torch.Tensor, torch.Tensor, list[dict]]:
    ei, x, results = base.edge_index(), base.x, []
    for op in ops:
        ei, x, res = apply_reference(ei, x, op)
        results.append(res)
    return ei, x, results


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replaying_every_op_on_the_base_gives_the_final_graph(seed: int) -> None:
    base, stream = hold_out(multigraph(seed), 0.4, seed, BUSY)
    ei, x, results = replay(base, stream.ops)
    assert torch.equal(sorted_columns(ei), sorted_columns(stream.final_edge_index()))
    assert torch.equal(x, stream.final_x())
    assert x.size(0) == stream.final_num_nodes() > base.num_nodes
    assert results == stream.expected
    assert {op["op"] for op in stream.ops} == set(OPS)


def test_removals_hit_present_edges_unless_the_op_is_a_missing_probe() -> None:
    base, stream = hold_out(multigraph(3), 0.5, 3, BUSY)
    _, _, results = replay(base, stream.ops)
    assert stream.probes
    for i, (op, res) in enumerate(zip(stream.ops, results, strict=True)):
        if op["op"] != "edges":
            continue
        if i in stream.probes:
            assert res["missing"] == len(op["remove"]) > 0 and not op["add"]
        else:
            assert res["missing"] == 0
            # every copy of a removed pair goes: at least one per distinct pair
            assert res["removed"] >= len({tuple(p) for p in op["remove"]})
    assert stream.counts()["pairs_removed"] > 0


def test_duplicates_and_self_loops_are_a_multiset() -> None:
    """A repeated add is a second copy; a remove deletes every copy; a self loop is an edge."""
    ei = torch.tensor([[0, 0, 1, 2, 2], [1, 1, 2, 2, 2]])  # (0,1) twice, (2,2) twice
    x = torch.zeros(3, 2)
    ei2, _, res = apply_reference(ei, x, {"op": "edges", "add": [[0, 1], [2, 2]],
                                          "remove": [[0, 1], [2, 2], [1, 0], [0, 1]]})
    # both duplicate remove rows of a present pair count as found; (1, 0) is missing
    assert res == {"added": 2, "removed": 4, "missing": 1}
    assert sorted_columns(ei2).tolist() == [[0, 1, 2], [1, 2, 2]]  # removals first, then adds
    base, stream = hold_out(multigraph(4), 0.3, 4, BUSY)
    final = sorted_columns(stream.final_edge_index())
    keys = final[1] * 1000 + final[0]
    assert keys.unique().numel() < keys.numel()  # duplicates survive as copies
    assert int((final[0] == final[1]).sum()) > 0  # self loops survive


@pytest.mark.parametrize("fraction", [0.1, 0.5])
def test_the_base_keeps_one_minus_fraction_and_the_stream_inserts_the_rest(
        cora: GraphData, fraction: float) -> None:
    base, stream = hold_out(cora, fraction, 0)
    assert base.num_edges == cora.num_edges - round(fraction * cora.num_edges)
    assert base.num_nodes == cora.num_nodes and torch.equal(base.x, cora.x)
    whole = torch.cat([base.edge_index(), torch.from_numpy(stream.held)], dim=1)
    assert torch.equal(sorted_columns(whole), sorted_columns(cora.edge_index()))
    inserted = Counter(tuple(p) for op in stream.ops if op["op"] == "edges" for p in op["add"])
    held = Counter(map(tuple, stream.held.T.tolist()))
    assert held and not held - inserted  # every held-out copy is inserted again


def test_a_seed_gives_one_stream(cora: GraphData) -> None:
    _, a = hold_out(cora, 0.1, 7)
    _, b = hold_out(cora, 0.1, 7)
    _, c = hold_out(cora, 0.1, 8)
    assert a.ops == b.ops and a.expected == b.expected
    assert torch.equal(a.final_edge_index(), b.final_edge_index())
    assert a.ops != c.ops


def test_batches_change_the_call_size_and_keep_the_final_graph_exact(cora: GraphData) -> None:
    base, stream = hold_out(cora, 0.1, 0)
    small = stream.batches(64)
    assert small.base is stream.base and small.batches(64).ops == small.ops
    edge_ops = [op for op in small.ops if op["op"] == "edges"]
    assert len(edge_ops) >= stream.held.shape[1] // 64
    ei, x, results = replay(base, small.ops)
    assert torch.equal(sorted_columns(ei), sorted_columns(small.final_edge_index()))
    assert torch.equal(x, small.final_x()) and results == small.expected


def test_new_nodes_get_ids_in_order_and_edges_only_after_they_exist() -> None:
    base, stream = hold_out(multigraph(5), 0.5, 5, BUSY)
    n = base.num_nodes
    for op, exp in zip(stream.ops, stream.expected, strict=True):
        if op["op"] == "nodes":
            assert exp["node_ids"] == list(range(n, n + len(op["features"])))
            n += len(op["features"])
        elif op["op"] == "edges":
            ids = [v for p in op["add"] + op["remove"] for v in p]
            assert max(ids, default=0) < n  # never an edge to a node not yet appended
        else:
            assert max(op["node_ids"]) < n and len(op["node_ids"]) == len(op["features"])
    assert any(v >= base.num_nodes for op in stream.ops if op["op"] == "edges"
               for p in op["add"] for v in p)


def test_ops_are_http_bodies() -> None:
    _, stream = hold_out(multigraph(6), 0.3, 6, BUSY)
    seen = set()
    for op in stream.ops:
        method, path, body = request_of(op)
        seen.add((method, path, tuple(sorted(body))))
        assert "op" not in body
    assert seen == {("POST", "/v1/graph/edges", ("add", "remove")),
                    ("POST", "/v1/graph/nodes", ("features",)),
                    ("PUT", "/v1/graph/features", ("features", "node_ids"))}


@pytest.mark.parametrize("op", [
    {"op": "edges", "add": [[0, 99]]},  # id out of range
    {"op": "edges", "add": [[0, 1, 2]]},  # not a pair
    {"op": "nodes", "features": [[1.0]]},  # wrong width
    {"op": "nodes", "features": []},
    {"op": "features", "node_ids": [0], "features": [[float("nan"), 0.0]]},
    {"op": "features", "node_ids": [0, 1], "features": [[0.0, 0.0]]},
    {"op": "grow"},
])
def test_reference_refuses_what_the_daemon_answers_with_a_4xx(op: dict) -> None:
    with pytest.raises(ValueError):
        apply_reference(torch.tensor([[0], [1]]), torch.zeros(3, 2), op)


@pytest.mark.e2e
def test_the_daemon_answers_every_op_as_the_stream_expects(cora: GraphData, tmp_path: Path) -> None:
    """A stream replayed over HTTP against the real daemon serving its base: each answer equals
    the reference's (version aside, rising by one per op), and the graph's sizes at the end are
    the stream's final graph's."""
    import httpx
    import numpy as np

    from tests.conftest import start_server

    mix = StreamMix(edges_per_call=50, nodes_every=2, features_every=2, missing_every=3)
    base, stream = hold_out(cora, 0.02, 11, mix)
    assert {op["op"] for op in stream.ops} == set(OPS) and stream.probes
    npz = tmp_path / "base.npz"
    np.savez(npz, indptr=base.indptr.numpy(), indices=base.indices.numpy(), x=base.x.numpy())
    srv, _ = start_server(tmp_path, {"QUIVER_SERVE_DISABLE_CPP": "1"}, graph__format="npz",
                          graph__path=str(npz), graph__update_log_dir=str(tmp_path / "log"))
    with srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        version = http.get("/v1/graph").json()["version"]
        for op, expected in zip(stream.ops, stream.expected, strict=True):
            method, path, body = request_of(op)
            r = http.request(method, path, json=body)
            assert r.status_code == 200, (op["op"], r.text)
            answer = r.json()
            assert answer.pop("version") == version + 1
            version += 1
            assert answer == expected, op["op"]
        info = http.get("/v1/graph").json()
    assert info["version"] == version
    assert info["num_nodes"] == stream.final_num_nodes()
    assert info["num_edges"] == stream.final_edge_index().size(1)

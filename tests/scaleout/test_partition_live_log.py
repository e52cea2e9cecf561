"""One partition's living graph without Ray (``scaleout/partitioned/live.py``): updates are
checked against what the partition owns, durable in its log, and replayed by a new server over
the same snapshot; the ingress's token and splitting refuse bad input naming it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from quiver_serve import errors
from quiver_serve.config import GraphConfig
from quiver_serve.partition.data import load_partition
from quiver_serve.scaleout.partitioned.live import PartitionLive
from quiver_serve.scaleout.partitioned.live_routes import parse_token, split_edges, split_rows
from quiver_serve.scaleout.partitioned.sampling import LocalGraph, as_tensor, local_hop
from tests.scaleout.test_partitioned import block_graph, partitions


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return partitions(block_graph(), 2, tmp_path_factory.mktemp("parts"))


def open_live(data_dir: Path, log: Path) -> tuple[PartitionLive, LocalGraph]:
    data = load_partition(data_dir, 1)
    graph = LocalGraph(1, as_tensor(data.book.owner), as_tensor(data.book.local),
                       as_tensor(data.indptr), as_tensor(data.indices))
    live = PartitionLive(log, GraphConfig(fsync="always"), 1, graph.owner, graph.local,
                         graph.indptr, graph.indices, int(data.features.shape[1]))
    graph.overlay = live.view()
    return live, graph


def test_updates_are_replayed_by_a_new_server(data_dir: Path, tmp_path: Path) -> None:
    book = load_partition(data_dir, 1).book
    mine, theirs = book.global_ids(1), book.global_ids(0)
    v = int(mine[4])
    live, graph = open_live(data_dir, tmp_path / "log")
    before = local_hop(graph, torch.tensor([v]), -1, 0, 0)[0].tolist()
    out = live.add_edges([[int(theirs[0]), v], [v, v]], [[before[0], v]])
    assert out == {"version": 1, "added": 2, "removed": 1, "missing": 0}
    assert live.put_features([v], [[0.5] * live.num_features]) == {"version": 2}
    with pytest.raises(errors.ServeError, match=f"node {int(theirs[1])} is owned by partition 0"):
        live.add_edges([[v, int(theirs[1])]], [])
    with pytest.raises(errors.ServeError, match="out of range"):
        live.add_edges([[10**6, v]], [])
    graph.overlay = live.view()
    after = local_hop(graph, torch.tensor([v]), -1, 0, 0)[0].tolist()
    assert after == [u for u in before if u != before[0]] + [int(theirs[0]), v]
    live.close()

    again, graph2 = open_live(data_dir, tmp_path / "log")
    assert (again.version, again.replayed) == (2, 2)
    assert local_hop(graph2, torch.tensor([v]), -1, 0, 0)[0].tolist() == after
    mask, rows = again.written(torch.tensor([int(book.locals(np.array([v]))[0]), 0]))
    assert mask.tolist() == [True, False] and rows[0].tolist() == [0.5] * again.num_features
    again.close()


def test_the_ingress_refuses_bad_tokens_and_ids(data_dir: Path) -> None:
    book = load_partition(data_dir, 0).book
    assert parse_token(0, 2) == {} and parse_token({"1": 4}, 2) == {1: 4}
    for bad, named in ((5, "single number"), ({"2": 1}, "'2'"), ({"x": 1}, "'x'"),
                       ({"0": -1}, "-1")):
        with pytest.raises(errors.ServeError, match=named):
            parse_token(bad, 2)  # type: ignore[arg-type]
    a, b = int(book.global_ids(0)[0]), int(book.global_ids(1)[0])
    split = split_edges(book, [[a, b], [b, a]], [[b, b]])
    assert sorted(split) == [0, 1]
    assert split[1][0].tolist() == [[a, b]] and split[1][1].tolist() == [[b, b]]
    with pytest.raises(errors.ServeError, match="900"):
        split_edges(book, [[a, 900]], [])
    with pytest.raises(errors.ServeError, match="2 node_ids but 1"):
        split_rows(book, [a, b], [[0.0]])

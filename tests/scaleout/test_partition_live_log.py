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
from quiver_serve.graph.records import BookNodesRecord, decode, encode
from quiver_serve.partition.data import load_partition
from quiver_serve.scaleout.partitioned.live import PartitionLive
from quiver_serve.scaleout.partitioned.live_routes import (
    adopt,
    choose_owner,
    merge_growth,
    parse_token,
    split_edges,
    split_rows,
)
from quiver_serve.scaleout.partitioned.sampling import LocalGraph, as_tensor, local_hop
from tests.scaleout.test_partitioned import block_graph, partitions


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return partitions(block_graph(), 2, tmp_path_factory.mktemp("parts"))


def open_live(data_dir: Path, log: Path, part: int = 1,
              follow: bool = False) -> tuple[PartitionLive, LocalGraph]:
    data = load_partition(data_dir, part)
    graph = LocalGraph(part, as_tensor(data.book.owner), as_tensor(data.book.local),
                       as_tensor(data.indptr), as_tensor(data.indices))
    live = PartitionLive(log, GraphConfig(fsync="always"), part, data.book, graph.indptr,
                         graph.indices, int(data.features.shape[1]), follow=follow)
    show(live, graph)
    return live, graph


def show(live: PartitionLive, graph: LocalGraph) -> None:
    """What the partition server does after an update or a catch-up (``_refresh``)."""
    graph.owner, graph.local, graph.overlay = live.owner, live.local, live.view()


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


def test_new_nodes_grow_the_book_and_a_follower_applies_them(data_dir: Path,
                                                             tmp_path: Path) -> None:
    """Nodes added at their owner (rows) and at another partition (the book only), edges into
    and out of them, read back by a follower of each log and by a server that replays it."""
    log1, log0 = tmp_path / "p1", tmp_path / "p0"
    owner_live, owner_graph = open_live(data_dir, log1, 1)
    other_live, other_graph = open_live(data_dir, log0, 0)
    follower, follower_graph = open_live(data_dir, log1, 1, follow=True)
    n, width = owner_live.book.num_nodes, owner_live.num_features
    rows = [[0.25] * width, [-1.0] * width]
    assert owner_live.add_nodes(n, 2, 1, rows) == {"version": 1}
    assert other_live.add_nodes(n, 2, 1) == {"version": 1}
    assert other_live.add_nodes(n, 2, 1) == {"version": 1}  # completing a call: no new record
    with pytest.raises(errors.ServeError, match=f"next id is {n + 2}"):
        owner_live.add_nodes(n, 2, 1, rows)
    with pytest.raises(errors.ServeError, match="2 new nodes but 1 feature rows"):
        owner_live.add_nodes(n + 2, 2, 1, rows[:1])
    theirs = int(load_partition(data_dir, 0).global_ids[0])
    assert owner_live.add_edges([[theirs, n], [n, n + 1]], [])["version"] == 2
    assert other_live.add_edges([[n + 1, theirs]], [])["version"] == 2
    show(owner_live, owner_graph)
    show(other_live, other_graph)
    assert local_hop(owner_graph, torch.tensor([n, n + 1]), -1, 0, 0)[0].tolist() == [theirs, n]
    assert local_hop(other_graph, torch.tensor([theirs]), -1, 0, 0)[0].tolist()[-1] == n + 1
    assert follower.version == 0 and follower.catch_up() == 2 and follower.version == 2
    show(follower, follower_graph)
    assert local_hop(follower_graph, torch.tensor([n + 1]), -1, 0, 0)[0].tolist() == [n]
    mask, got = follower.written(torch.from_numpy(follower.book.locals(np.array([n, n + 1]))))
    assert mask.tolist() == [True, True] and got.tolist() == rows
    with pytest.raises(errors.ServeError, match="replica 0"):
        follower.add_edges([[n, n]], [])
    assert follower.entries == owner_live.entries == other_live.entries == [[n, 2, 1]]
    for live in (owner_live, other_live, follower):
        live.close()
    again, graph = open_live(data_dir, log1, 1)
    assert (again.version, again.book.num_nodes, again.entries) == (2, n + 2, [[n, 2, 1]])
    assert local_hop(graph, torch.tensor([n + 1]), -1, 0, 0)[0].tolist() == [n]
    again.close()


def test_the_ingress_places_new_nodes_and_merges_the_growth(data_dir: Path) -> None:
    book = load_partition(data_dir, 0).book
    sizes = book.sizes()
    assert choose_owner(book) == int(np.argmin(sizes))
    n = book.num_nodes
    grown = [[n, 3, 1], [n + 3, 1, 0]]
    assert merge_growth([grown[:1], grown, []]) == grown
    with pytest.raises(errors.ServeError, match="disagree"):
        merge_growth([[[n, 2, 1]], grown])
    adopt(book, grown)
    adopt(book, grown)  # entries it holds are skipped
    assert book.num_nodes == n + 4 and book.owners(np.arange(n, n + 4)).tolist() == [1, 1, 1, 0]
    with pytest.raises(errors.ServeError, match="book_conflict|from"):
        adopt(book, [[n + 9, 1, 0]])


def test_a_book_record_round_trips_and_a_bad_one_is_refused() -> None:
    rows = np.arange(6, dtype=np.float32).reshape(2, 3)
    record = BookNodesRecord(4, 1.5, [900, 2, 1], rows)
    back, end = decode(encode(record))
    assert back == record and end == len(encode(record))
    assert (back.first_id, back.count, back.owner) == (900, 2, 1)
    assert BookNodesRecord(5, 1.5, [900, 2, 1], np.empty((0, 3), np.float32)).count == 2
    for head, feats in (([900, 2], rows), ([900, 3, 1], rows), ([-1, 2, 1], rows)):
        with pytest.raises(ValueError, match="first id, count, owner"):
            BookNodesRecord(4, 1.5, head, feats)


def test_a_full_partition_says_so_and_a_larger_headroom_takes_the_update(
        data_dir: Path, tmp_path: Path) -> None:
    """Once a partition's overlay is full an update is refused 503 ``overlay_full`` with
    Retry-After (the compaction its server starts frees room: test_partition_compaction.py),
    nothing is written, and a server restarted with a larger ``graph.overlay_capacity_edges``
    replays the log and takes the update."""
    book = load_partition(data_dir, 1).book
    mine, theirs = book.global_ids(1), book.global_ids(0)
    data = load_partition(data_dir, 1)

    def start(capacity: int) -> PartitionLive:
        return PartitionLive(tmp_path / "log", GraphConfig(fsync="always",
                                                           overlay_capacity_edges=capacity),
                             1, load_partition(data_dir, 1).book, as_tensor(data.indptr),
                             as_tensor(data.indices), int(data.features.shape[1]))

    live = start(1024)
    pairs = [[int(theirs[i % theirs.size]), int(mine[i % mine.size])] for i in range(50)]
    for _ in range(200):  # until the overlay is full
        try:
            live.add_edges(pairs, [])
        except errors.ServeError as refused:
            exc, info = refused, refused.info
            break
    else:
        raise AssertionError("the overlay never filled")
    assert info.status == 503 and info.code == "overlay_full", info
    assert "partition 1" in info.message and "retry after compaction" in info.message
    assert getattr(exc, "retry_after_s", None) == 1
    acked = live.version
    assert live.replay_until(None) == 0 and live.version == acked, "nothing was written"
    live.close()
    live = start(1 << 16)  # the operator's remedy
    assert live.replayed == acked and live.add_edges(pairs, [])["version"] == acked + 1
    live.close()

"""Typed updates on a typed graph (graph/typed_living.py, typed_splice.py, typed_writer.py): a
random stream of edge adds and removals, new nodes and feature writes leaves the graph PyG's
``ToUndirected`` makes of the updated lists; records survive the log; the writer refuses bad
updates by name; the reference and C++ samplers stay bit-identical on the updated graph."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from quiver_serve import errors
from quiver_serve.config import GraphConfig
from quiver_serve.graph.records import decode, encode
from quiver_serve.graph.typed import TypedGraph, add_reverse_edges
from quiver_serve.graph.typed_living import TypedLiveGraph, check_log_meta
from quiver_serve.graph.typed_writer import TypedGraphWriter
from quiver_serve.graph.update_log import UpdateLog
from quiver_serve.sampling.typed import TypedCppSampler, TypedReferenceSampler
from tests.graph.typed_updates_model import (
    CITES,
    HAS,
    WRITES,
    UpdateModel,
    assert_same_graph,
    random_papers,
)


def served_graph(seed: int = 0) -> TypedGraph:
    return add_reverse_edges(TypedGraph.from_hetero_data(random_papers(seed), "papers"))


def random_stream(live: TypedLiveGraph, model: UpdateModel, steps: int, seed: int) -> None:
    """Random updates applied through records (encoded and decoded, as the log carries them)
    to ``live`` and the plain way to ``model``."""
    rng = np.random.default_rng(seed)
    g = live.graph
    for version in range(1, steps + 1):
        kind = rng.choice(["writes", "cites", "has", "nodes", "features"])
        if kind in ("writes", "cites"):
            et = WRITES if kind == "writes" else CITES
            n_src, n_dst = g.num_nodes[et[0]], g.num_nodes[et[2]]
            add = np.stack([rng.integers(0, n_src, 6), rng.integers(0, n_dst, 6)], 1)
            add = np.concatenate([add, add[:1]])  # a repeat: a second copy
            existing = g.relations[et].edge_index().t().numpy()
            remove = np.concatenate([existing[rng.integers(0, len(existing), 3)], [[0, 0]]])
            record = live.edge_record(version, 0.0, et, add, remove)
            model.add(et, add)
            model.remove(et, remove)
        elif kind == "has":
            existing = g.relations[HAS].edge_index().t().numpy()
            remove = existing[rng.integers(0, len(existing), 2)]
            record = live.edge_record(version, 0.0, HAS, np.zeros((0, 2), np.int64), remove)
            model.remove(HAS, remove)
        elif kind == "nodes":
            node_type = str(rng.choice(["paper", "field"]))
            width = live.widths[node_type]
            rows = rng.standard_normal((2, width)).astype(np.float32)
            record = live.node_record(version, 0.0, node_type, rows)
            model.add_nodes(node_type, rows)
        else:
            ids = rng.integers(0, g.num_nodes["author"], 3)
            ids = np.unique(ids)
            rows = rng.standard_normal((len(ids), 4)).astype(np.float32)
            record = live.feature_record(version, 0.0, "author", ids, rows)
            model.put_features("author", ids.tolist(), rows)
        again, _ = decode(encode(record))
        assert again == record
        live.apply(again)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_random_stream_is_pyg_to_undirected_of_the_updated_lists(seed: int) -> None:
    live = TypedLiveGraph(served_graph(seed), add_reverse_edges=True)
    model = UpdateModel(random_papers(seed))
    random_stream(live, model, 40, seed)
    assert_same_graph(live.graph, model.served())


def test_within_a_type_an_update_is_both_directions_once() -> None:
    live = TypedLiveGraph(served_graph(), add_reverse_edges=True)
    cites = live.graph.relations[CITES]
    pairs = set(map(tuple, cites.edge_index().t().tolist()))
    u, v = next((a, b) for a in range(60) for b in range(60)
                if a != b and (a, b) not in pairs and (b, a) not in pairs)
    done = live.apply_edges(CITES, torch.tensor([[u, v], [u, v], [v, u]]),
                            torch.zeros((0, 2), dtype=torch.int64))
    assert done["added"] == 2  # (u, v) and (v, u), once each
    done = live.apply_edges(CITES, torch.zeros((0, 2), dtype=torch.int64), torch.tensor([[v, u]]))
    assert done["removed"] == 2 and done["missing"] == 0
    assert set(map(tuple, live.graph.relations[CITES].edge_index().t().tolist())) == pairs


def test_samplers_stay_bit_identical_after_updates() -> None:
    live = TypedLiveGraph(served_graph(3), add_reverse_edges=True)
    random_stream(live, UpdateModel(random_papers(3)), 30, 3)
    ref, cpp = TypedReferenceSampler(live.graph), TypedCppSampler(live.graph)
    seeds = torch.tensor([0, 5, live.graph.num_nodes["paper"] - 1])
    for seed in (1, 2, 3):
        a = ref.sample("paper", seeds, [3, 2], seed)
        b = cpp.sample("paper", seeds, [3, 2], seed)
        assert a.node.keys() == b.node.keys()
        for t in a.node:
            assert torch.equal(a.node[t], b.node[t]), t
        for et in a.edge_index:
            assert torch.equal(a.edge_index[et], b.edge_index[et]), et
            assert torch.equal(a.e_id[et], b.e_id[et]), et


def writer(tmp_path: Path, graph: TypedGraph | None = None) -> TypedGraphWriter:
    """A writer over the log in ``tmp_path``, on its newest typed base when it has one."""
    from quiver_serve.graph.typed_base import newest_base

    log = UpdateLog(tmp_path / "log", "none")
    log.open()
    cfg = GraphConfig(add_reverse_edges=True, max_update_edges=100)
    start, version = newest_base(tmp_path / "log", graph or served_graph())
    return TypedGraphWriter(cfg, start, log, base_version=version)


def status_and_message(call) -> tuple[int, str]:  # noqa: ANN001
    with pytest.raises(errors.ServeError) as info:
        call()
    return info.value.info.status, info.value.info.message


def test_bad_updates_are_refused_by_name(tmp_path: Path) -> None:
    w = writer(tmp_path)
    status, msg = status_and_message(lambda: w.add_edges([[0, 1]], None, ["paper", "x", "y"]))
    assert status == 400 and "['author', 'writes', 'paper']" in msg
    status, msg = status_and_message(lambda: w.add_edges([[0, 1]], None))
    assert status == 400 and "edge_type is required" in msg
    status, msg = status_and_message(lambda: w.add_edges([[0, 1]], None,
                                                         ["paper", "rev_writes", "author"]))
    assert status == 400 and "reverse of ['author', 'writes', 'paper']" in msg
    status, msg = status_and_message(lambda: w.add_edges([[35, 0]], None, list(WRITES)))
    assert status == 400 and "35" in msg and "author" in msg
    status, msg = status_and_message(lambda: w.add_edges([[0, 1]], None, list(HAS)))
    assert status == 422 and "edge features" in msg
    status, msg = status_and_message(lambda: w.add_nodes([[1.0] * 5], "paper"))
    assert status == 422 and "5 values" in msg and "6" in msg
    status, msg = status_and_message(lambda: w.add_nodes([[1.0]], "field"))
    assert status == 422 and "'field' has no features" in msg
    status, msg = status_and_message(lambda: w.put_features([0], [[1.0]], "field"))
    assert status == 422 and "'field' has no features" in msg
    status, msg = status_and_message(lambda: w.put_features([60], [[0.0] * 6], "paper"))
    assert status == 400 and "60" in msg
    status, msg = status_and_message(lambda: w.add_nodes([[0.0] * 6], "venue"))
    assert status == 400 and "venue" in msg and "paper" in msg
    assert w.acked == 0  # nothing was written


def test_the_writer_replays_its_log_and_refuses_another_graphs(tmp_path: Path) -> None:
    w = writer(tmp_path)
    assert w.add_edges([[0, 59]], [[1, 1]], list(WRITES))["version"] == 1
    assert w.add_nodes(np.zeros((2, 0), np.float32), "field")["node_ids"] == [8, 9]
    assert w.put_features([9], [[1.0] * 4], "author")["version"] == 3
    counts = w.num_nodes
    w.log.close()
    again = writer(tmp_path)
    assert again.replay() == 3 and again.acked == 3 and again.num_nodes == counts
    again.log.close()
    with pytest.raises(errors.ServeError) as info:
        check_log_meta(tmp_path / "log", TypedLiveGraph(served_graph(5), True).describe())
    assert "another typed graph" in info.value.info.message


def typed_round(w: TypedGraphWriter, model: UpdateModel, rng: np.random.Generator) -> None:
    """One update of each kind through ``w``, the same the plain way on ``model``."""
    n = w.num_nodes
    adds = {WRITES: np.stack([rng.integers(0, n["author"], 4), rng.integers(0, n["paper"], 4)], 1),
            CITES: np.stack([rng.integers(0, n["paper"], 3), rng.integers(0, n["paper"], 3)], 1)}
    for et, add in adds.items():
        ei = model.data[et].edge_index
        remove = ei[:, rng.integers(0, ei.size(1), 2)].t().numpy()
        w.add_edges(add, remove, list(et))
        model.remove(et, remove)
        model.add(et, add)
    rows = rng.standard_normal((2, 6)).astype(np.float32)
    w.add_nodes(rows, "paper")
    model.add_nodes("paper", rows)
    w.add_nodes(np.zeros((1, 0), np.float32), "field")
    model.add_nodes("field", np.zeros((1, 0), np.float32))
    ids = [int(rng.integers(0, w.num_nodes["paper"])), w.num_nodes["paper"] - 1]
    rows = rng.standard_normal((2, 6)).astype(np.float32)
    w.put_features(ids, rows, "paper")
    model.put_features("paper", ids, rows)


def test_a_compacted_log_starts_from_its_base_and_replays_only_the_rest(tmp_path: Path) -> None:
    """Compaction writes the graph at the acknowledged version as the log's base (decision
    0059) and drops the records it covers; a start loads the dataset's description, the newest
    base and only the records after it, and gets the graph of the whole stream (features
    included), again after a second compaction on the restarted writer."""
    from quiver_serve.graph.log_reader import LogCompactedError
    from quiver_serve.graph.typed_base import newest_base
    from quiver_serve.graph.update_log import LogFollower

    rng = np.random.default_rng(3)
    model = UpdateModel(random_papers(0))
    w = writer(tmp_path)
    for _ in range(2):
        typed_round(w, model, rng)
    assert w.compact() == {"version": 10, "compacted": True,
                           "duration_s": pytest.approx(0, abs=30)}
    assert w.compact()["compacted"] is False  # nothing new
    typed_round(w, model, rng)
    w.log.close()

    def started() -> TypedGraph:  # what an engine core does
        graph, base = newest_base(tmp_path / "log", served_graph())
        live = TypedLiveGraph(graph, True)
        follower = LogFollower(tmp_path / "log", base)
        while records := follower.poll(64):
            for record in records:
                live.apply(record)  # type: ignore[arg-type]
        return live.graph

    assert_same_graph(started(), model.served())
    again = writer(tmp_path)
    assert again.base_version == 10 and again.replay() == 5 and again.acked == 15
    assert again.num_nodes == model.served().num_nodes
    typed_round(again, model, rng)
    assert again.compact()["version"] == 20 and again.changed_entries == 0
    again.log.close()
    graph, base = newest_base(tmp_path / "log", served_graph())
    assert base == 20
    assert_same_graph(graph, model.served())
    with pytest.raises(LogCompactedError):  # the records before it are gone
        LogFollower(tmp_path / "log", 0).poll(64)
    assert_same_graph(started(), model.served())


def test_a_compaction_waits_for_the_engine_cores(tmp_path: Path) -> None:
    """The log an engine core has not read stays: a compaction whose version a reader has not
    applied within the wait writes nothing."""
    from quiver_serve.graph import typed_writer

    w = writer(tmp_path)
    typed_round(w, UpdateModel(random_papers(0)), np.random.default_rng(1))
    w.reader_versions = lambda: [w.acked, 0]
    typed_writer.READERS_WAIT_S = 0.05
    try:
        result = w.compact()
    finally:
        typed_writer.READERS_WAIT_S = 30.0
    assert result["compacted"] is False and "engine core" in result["reason"]
    assert w.base_version == 0 and not list((tmp_path / "log").glob("base-*"))


def test_a_typed_start_is_a_map_of_its_newest_base(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The first start writes the dataset as the base of version 0; later starts load the
    newest typed base without the dataset (decision 0059); a source changed since is refused."""
    from quiver_serve.graph import typed_load
    from quiver_serve.graph.typed_base import typed_graph_at_start
    from quiver_serve.graph.update_log import LogFollower

    torch.save(random_papers(0), tmp_path / "papers.pt")
    cfg = GraphConfig(format="pyg", path=str(tmp_path / "papers.pt"), name="papers",
                      add_reverse_edges=True)
    first, version = typed_graph_at_start(cfg, tmp_path / "log", write_snapshot=True)
    assert version == 0 and list((tmp_path / "log").glob("base-*"))
    log = UpdateLog(tmp_path / "log", "none")
    log.open()
    w = TypedGraphWriter(cfg, first, log)
    model = UpdateModel(random_papers(0))
    typed_round(w, model, np.random.default_rng(4))
    assert w.compact()["version"] == 5
    typed_round(w, model, np.random.default_rng(5))
    log.close()

    def no_dataset(_cfg: GraphConfig) -> TypedGraph:
        raise AssertionError("the dataset was loaded")

    monkeypatch.setattr(typed_load, "load_typed_graph", no_dataset)
    graph, version = typed_graph_at_start(cfg, tmp_path / "log")
    assert version == 5
    live = TypedLiveGraph(graph, True)
    for record in LogFollower(tmp_path / "log", 5).poll(64):
        live.apply(record)  # type: ignore[arg-type]
    assert_same_graph(live.graph, model.served())
    cfg.add_reverse_edges = False  # another graph from the same file
    with pytest.raises(errors.ServeError) as info:
        typed_graph_at_start(cfg, tmp_path / "log")
    assert info.value.info.code == "dataset_changed"


@pytest.mark.parametrize("crash_at", ["base.mkdir", "base.array", "base.meta", "base.synced",
                                      "current.renamed", "rotate.sealed", "drop.segment",
                                      "drop.base"])
def test_a_crash_anywhere_in_a_typed_compaction_keeps_every_acknowledged_update(
        tmp_path: Path, crash_at: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A typed compaction killed at any of its steps (``update_log._crash_hook``): the restarted
    writer, and an engine core's start, have every acknowledged update; the next compaction
    works."""
    from quiver_serve.graph import update_log
    from quiver_serve.graph.typed_base import newest_base
    from quiver_serve.graph.update_log import LogFollower

    class Crash(Exception):
        pass

    def hook(name: str) -> None:
        if name == crash_at:
            raise Crash(name)

    rng = np.random.default_rng(7)
    model = UpdateModel(random_papers(0))
    w = writer(tmp_path)
    typed_round(w, model, rng)
    w.compact()  # a base in force before the one that crashes
    typed_round(w, model, rng)
    monkeypatch.setattr(update_log, "_crash_hook", hook)
    with pytest.raises(Crash):
        w.compact()
    monkeypatch.setattr(update_log, "_crash_hook", None)
    w.log.close()
    again = writer(tmp_path)  # the daemon restarted
    again.replay()
    assert again.acked == 10 and again.num_nodes == model.served().num_nodes
    typed_round(again, model, rng)
    assert again.compact()["compacted"]
    again.log.close()
    graph, base = newest_base(tmp_path / "log", served_graph())
    live = TypedLiveGraph(graph, True)
    for record in LogFollower(tmp_path / "log", base).poll(64):
        live.apply(record)  # type: ignore[arg-type]
    assert base == 15
    assert_same_graph(live.graph, model.served())

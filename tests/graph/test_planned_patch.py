"""The writer's plan of an edge update, logged beside it and applied by followers without
planning (docs/architecture.md, "The living graph"): a follower that applies the plans reaches
the same overlay, bit for bit, as one that plans each record itself."""

from __future__ import annotations

import numpy as np
import pytest

from quiver_serve.graph.overlay import Overlay, plan_record, planned_patch
from quiver_serve.graph.records import EdgeRecord, PlannedEdgeRecord, decode, encode
from tests.graph.test_overlay import overlay_lists, random_graph


def _state(ov: Overlay) -> tuple:
    view = ov.view()
    assert view is not None
    top = ov.top
    return (ov.top, ov.live_entries, ov.num_edges, ov.num_nodes, view.start.numpy().tobytes(),
            view.length.numpy().tobytes(), view.tail.numpy()[:top].tobytes())


def _updates(rng: np.random.Generator, ov: Overlay, steps: int) -> list[tuple]:
    """Random edge calls: additions, removals of base and of added edges, misses."""
    out = []
    for _ in range(steps):
        n = ov.num_nodes
        add = rng.integers(0, n, (int(rng.integers(0, 40)), 2))
        lists = overlay_lists(ov)
        present = [(u, d) for d, lst in enumerate(lists) for u in lst]
        take = rng.integers(0, len(present), int(rng.integers(0, 8))) if present else []
        remove = np.array([present[i] for i in take] + [[int(rng.integers(0, n)), 1]],
                          np.int64).reshape(-1, 2)
        out.append((add, remove))
        ov.apply_edges(add, remove)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_followers_applying_the_writers_plans_equal_followers_that_plan(seed: int) -> None:
    rng = np.random.default_rng(seed)
    g = random_graph(rng, 50, 300)
    writer = Overlay(g.indptr, g.indices, 60, 50_000, base_version=7)
    planner = Overlay(g.indptr, g.indices, 60, 50_000, base_version=7)
    applier = Overlay(g.indptr, g.indices, 60, 50_000, base_version=7)
    scratch = Overlay(g.indptr, g.indices, 60, 50_000, base_version=7)
    for version, (add, remove) in enumerate(_updates(rng, scratch, 30), start=1):
        logged: list[PlannedEdgeRecord] = []
        record = EdgeRecord(version, 0.0, add, remove)
        writer.apply_edges(add, remove, before_commit=lambda _r, p, logged=logged, record=record:
                           logged.append(plan_record(record, p)))
        read, _ = decode(encode(logged[0]))  # what a follower reads back from the log
        assert isinstance(read, PlannedEdgeRecord) and read == logged[0]
        planner.apply_edges(read.add, read.remove)
        patch = planned_patch(read, applier.num_nodes)
        assert patch is not None and applier.fits(patch)
        assert applier.apply_record(read) is not None
        assert _state(applier) == _state(planner) == _state(writer)
    assert overlay_lists(applier) == overlay_lists(planner)


def test_a_plan_applies_only_to_an_overlay_in_the_writers_state() -> None:
    rng = np.random.default_rng(0)
    g = random_graph(rng, 30, 100)
    writer = Overlay(g.indptr, g.indices, 40, 10_000, base_version=3)
    logged: list[PlannedEdgeRecord] = []
    record = EdgeRecord(1, 0.0, np.array([[1, 2], [3, 2]]), np.empty((0, 2), np.int64))
    writer.apply_edges(record.add, record.remove,
                       before_commit=lambda _r, p: logged.append(plan_record(record, p)))
    patch = planned_patch(logged[0], 30)
    assert patch is not None
    other_base = Overlay(g.indptr, g.indices, 40, 10_000, base_version=4)
    unknown = Overlay(g.indptr, g.indices, 40, 10_000)
    moved = Overlay(g.indptr, g.indices, 40, 10_000, base_version=3)
    moved.apply_edges(np.array([[5, 6]]), np.empty((0, 2), np.int64))  # its arena top moved
    for ov in (other_base, unknown, moved):
        assert not ov.fits(patch)
        before = overlay_lists(ov)
        ov.apply_record(logged[0])  # planned here instead: the same edges either way
        assert sorted(overlay_lists(ov)[2]) == sorted(before[2] + [1, 3])
    assert planned_patch(record, 30) is None  # a record without a plan


def test_a_plan_with_arrays_that_do_not_match_is_refused() -> None:
    z = np.empty(0, np.int64)
    with pytest.raises(ValueError, match="plan's arrays"):
        PlannedEdgeRecord(1, 0.0, np.empty((0, 2), np.int64), np.empty((0, 2), np.int64),
                          np.zeros(4, np.int64), np.array([1]), np.array([0]), np.array([1]),
                          np.array([8]), z, z)


def test_a_frozen_copy_keeps_its_versions_lists_while_updates_go_on() -> None:
    rng = np.random.default_rng(3)
    g = random_graph(rng, 40, 200)
    ov = Overlay(g.indptr, g.indices, 50, 50_000, base_version=0)
    _updates(rng, ov, 10)  # tails exist: later removals would rewrite them in place
    expected = overlay_lists(ov)
    frozen = ov.freeze()
    _updates(rng, ov, 20)  # removals of added edges among them
    assert overlay_lists(frozen) == expected
    ov.thaw()
    assert ov.frozen == 0


def test_compaction_folds_outside_the_writers_lock(tmp_path, monkeypatch) -> None:
    """An update call completes while a compaction is folding the graph."""
    import threading

    import torch

    from quiver_serve.config import GraphConfig
    from quiver_serve.graph.csc import GraphData
    from quiver_serve.graph.update_log import UpdateLog
    from quiver_serve.graph.writer import GraphWriter

    base = GraphData.from_edge_index(torch.randint(0, 50, (2, 300)), torch.zeros(50, 2), "g")
    log = UpdateLog(tmp_path)
    log.open()
    writer = GraphWriter(GraphConfig(), base, 0, log)
    writer.reader_versions = lambda: [writer.version]
    writer.add_edges([[1, 2], [3, 2]], [])
    folding, release = threading.Event(), threading.Event()
    real = Overlay.to_csc

    def slow_fold(self: Overlay):  # the fold of a large graph, made long on purpose
        folding.set()
        assert release.wait(10)
        return real(self)

    monkeypatch.setattr(Overlay, "to_csc", slow_fold)
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(writer.compact()))
    t.start()
    assert folding.wait(10)
    got = writer.add_edges([[4, 2]], [[1, 2]])  # would wait for the fold if the lock were held
    assert got["version"] == 2 and got["removed"] == 1
    release.set()
    t.join(10)
    assert result["compacted"] and result["version"] == 1  # the base holds version 1 exactly


def test_a_compaction_runs_torch_on_its_own_thread_budget(tmp_path, monkeypatch) -> None:
    """The fold, sort and write run on ``graph.compact_threads`` intra-op threads (background
    work beside serving); the process's own setting comes back after."""
    import torch

    from quiver_serve.config import GraphConfig
    from quiver_serve.graph import writer as writer_mod
    from quiver_serve.graph.csc import GraphData
    from quiver_serve.graph.update_log import UpdateLog
    from quiver_serve.graph.writer import GraphWriter

    base = GraphData.from_edge_index(torch.randint(0, 50, (2, 300)), torch.zeros(50, 2), "g")
    log = UpdateLog(tmp_path)
    log.open()
    writer = GraphWriter(GraphConfig(compact_threads=1), base, 0, log)
    writer.reader_versions = lambda: [writer.version]
    writer.add_edges([[1, 2], [3, 2]], [[base.indices[0].item(), 0]])
    seen: list[int] = []
    real = writer_mod.sort_lists

    def sort_watched(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(writer_mod, "sort_lists", sort_watched)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert writer.compact()["compacted"]
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)

"""The exact table (docs/architecture.md, "The exact table"), driven in-process: one engine core
following a real update log.

After every update of a held-out stream (edge adds and removes, new nodes, feature writes) on
graphs with self loops, duplicate edges and isolated nodes, every table row equals PyG's
``model(x, edge_index)`` on the graph of that version, for GraphSAGE, GCN and GAT; an exact
request answered while rows are stale equals the same model too (on-the-fly path); marks follow
out-edges far enough and no further than they must; the refresh thread survives a failure.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from quiver_serve.config import ServeConfig
from quiver_serve.engine.core.build import build_core
from quiver_serve.engine.core.core import EngineCore
from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.living import LiveGraphArgs
from quiver_serve.graph.stream import StreamMix, apply_reference, hold_out
from quiver_serve.graph.update_log import UpdateLog
from quiver_serve.graph.writer import GraphWriter
from quiver_serve.models.served import build_model
from tests.engine.core.test_engine_core import mb, run

NUM_NODES, NUM_FEATURES = 150, 6
MODELS = [
    ("GraphSAGE", {}),
    ("GraphSAGE", {"aggr": "sum", "num_layers": 3}),
    ("GCN", {}),
    ("GCN", {"add_self_loops": False}),
    ("GAT", {"heads": 2}),
]


def awkward_graph(seed: int) -> GraphData:
    """Self loops, duplicate edges and isolated nodes (ids NUM_NODES - 5 and up get no edge)."""
    g = torch.Generator().manual_seed(seed)
    edges = torch.randint(0, NUM_NODES - 5, (2, 900), generator=g)
    loops = torch.arange(0, 25).expand(2, -1)
    edge_index = torch.cat([edges, loops, edges[:, :60]], dim=1)
    return GraphData.from_edge_index(edge_index, torch.randn(NUM_NODES, NUM_FEATURES, generator=g),
                                     "awkward")


def table_cfg(tmp: Path, cls: str, kwargs: dict, device: str = "cpu") -> ServeConfig:
    cfg = ServeConfig.default()
    cfg.graph.update_log_dir = str(tmp / "log")
    cfg.graph.max_new_nodes = 64
    cfg.model.pyg_class = cls  # type: ignore[assignment]
    cfg.model.weights = None
    cfg.model.kwargs = {"hidden_channels": 16, "num_layers": 2, "out_channels": 8, **kwargs}
    cfg.sampling.fanouts = [3] * cfg.model.num_layers
    cfg.sampling.calibration = "off"
    cfg.inference.device = device  # type: ignore[assignment]
    cfg.exact.materialize = "on"
    cfg.exact.chunk_edges = 1024  # several chunks per layer, so chunking is exercised
    cfg.exact.refresh_interval_ms = 0.0
    return cfg


class Harness:
    """A writer with its update log and one engine core following it (no processes)."""

    def __init__(self, tmp: Path, cfg: ServeConfig, base: GraphData) -> None:
        directory = tmp / "log"
        directory.mkdir(parents=True, exist_ok=True)
        log = UpdateLog(directory)
        log.open()
        self.writer = GraphWriter(cfg.graph, base, 0, log)
        live = LiveGraphArgs(str(directory), 0, self.writer.caps, self.writer.state.tensor)
        self.core: EngineCore = build_core(cfg, base, 0, None, progress=False, live=live)
        self.table = self.core.exact_table
        assert self.table is not None and self.table.ready

    def apply(self, op: dict) -> int:
        if op["op"] == "edges":
            got = self.writer.add_edges(op.get("add", []), op.get("remove", []))
        elif op["op"] == "nodes":
            got = self.writer.add_nodes(op["features"])
        else:
            got = self.writer.put_features(op["node_ids"], op["features"])
        return int(got["version"])

    def follow(self, version: int) -> None:
        """Step the core until it serves ``version``."""
        end = time.monotonic() + 30
        while self.core.graph_sync.version < version:
            self.core.step()
            assert time.monotonic() < end, "the engine core never applied the update"

    def settle(self) -> None:
        assert self.table.refresher.wait_idle(30), "the refresh never finished"

    def close(self) -> None:
        self.table.stop()


def pyg_rows(cfg: ServeConfig, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
    model = build_model(cfg.model, NUM_FEATURES).eval()
    with torch.no_grad():
        return model(x, edge_index)


def check_each_version(h: Harness, cfg: ServeConfig, edge_index: torch.Tensor, x: torch.Tensor,
                       ops: list[dict]) -> tuple[np.ndarray, torch.Tensor]:
    """Apply ``ops`` one by one; after each, an exact request for every node (stale rows on the
    fly, the rest from the table) and, once the refresh settles, every table row equal PyG's
    output on that version. Returns the last ids and PyG rows."""
    for op in ops:
        edge_index, x, _ = apply_reference(edge_index, x, op)
        version = h.apply(op)
        h.follow(version)
        want = pyg_rows(cfg, x, edge_index)
        ids = np.arange(x.size(0))
        got = run(h.core, mb(version, [ids.tolist()], exact=True))[version].rows
        np.testing.assert_allclose(got, want.numpy(), atol=1e-5, rtol=1e-5)
        h.settle()
        assert h.table.version == version
        assert not h.table.stale[:x.size(0)].any()
        torch.testing.assert_close(h.table.layers[-1][:x.size(0)].cpu(), want,
                                   atol=1e-5, rtol=1e-5)
    return ids, want


@pytest.mark.parametrize(("cls", "kwargs"), MODELS)
def test_every_row_equals_pyg_after_every_update(tmp_path: Path, cls: str, kwargs: dict) -> None:
    base, stream = hold_out(awkward_graph(3), 0.3, seed=4,
                            mix=StreamMix(edges_per_call=30, nodes_every=3, features_every=2))
    cfg = table_cfg(tmp_path, cls, kwargs)
    h = Harness(tmp_path, cfg, base)
    try:
        edge_index, x = base.edge_index(), base.x.clone()
        torch.testing.assert_close(h.table.layers[-1][:base.num_nodes],
                                   pyg_rows(cfg, x, edge_index), atol=1e-5, rtol=1e-5)
        check_each_version(h, cfg, edge_index, x, list(stream)[:12])
        assert h.table.counters.rows_refreshed > 0
    finally:
        h.close()


def test_clean_requests_come_from_the_table_and_stale_ones_on_the_fly(tmp_path: Path) -> None:
    base = awkward_graph(5)
    cfg = table_cfg(tmp_path, "GraphSAGE", {})
    h = Harness(tmp_path, cfg, base)
    try:
        h.table.refresher.stop()  # nothing is refreshed: marks stay
        before = h.table.counters.from_table
        run(h.core, mb(1, [[0, 1, 2]], exact=True))
        assert h.table.counters.from_table == before + 1
        # an isolated node gets one in-edge from node 140 (also isolated: no out-edges)
        version = h.apply({"op": "edges", "add": [[NUM_NODES - 2, NUM_NODES - 1]]})
        h.follow(version)
        stale = np.flatnonzero(h.table.stale[:NUM_NODES])
        assert stale.tolist() == [NUM_NODES - 1]  # its own row; it has no out-neighbour
        on_the_fly = h.table.counters.on_the_fly
        run(h.core, mb(2, [[NUM_NODES - 1, 0]], exact=True))
        assert h.table.counters.on_the_fly == on_the_fly + 1
    finally:
        h.close()


@pytest.mark.parametrize(("cls", "kwargs"), MODELS)
def test_table_answers_equal_the_on_the_fly_path(tmp_path: Path, cls: str, kwargs: dict) -> None:
    base = awkward_graph(7)
    cfg = table_cfg(tmp_path, cls, kwargs)
    cfg.exact.stale_rows = "on_the_fly"
    h = Harness(tmp_path, cfg, base)
    try:
        ids = [[int(i) for i in np.random.default_rng(0).integers(0, NUM_NODES, 40)], [0, 0, 149]]
        from_table = run(h.core, mb(1, ids, exact=True))[1].rows
        h.table.refresher.stop()
        h.table.stale[:] = True  # every row stale: the on-the-fly path answers
        on_the_fly = run(h.core, mb(2, ids, exact=True))[2].rows
        assert h.table.counters.on_the_fly == 2
        np.testing.assert_allclose(from_table, on_the_fly, atol=1e-5, rtol=1e-5)
    finally:
        h.close()


def marked_after(tmp_path: Path, cls: str, op: dict) -> Harness:
    """A chain 0 -> 1 -> 2 -> 3 (and isolated nodes up to 9), no refresh, after ``op``."""
    chain = torch.tensor([[0, 1, 2], [1, 2, 3]])
    base = GraphData.from_edge_index(chain, torch.randn(10, NUM_FEATURES), "chain")
    h = Harness(tmp_path, table_cfg(tmp_path, cls, {}), base)
    h.table.refresher.stop()
    h.follow(h.apply(op))
    return h


def test_marks_reach_out_neighbours_up_to_the_model_depth(tmp_path: Path) -> None:
    """A chain a -> b -> c -> d: writing a's features changes a, b at layer 1 and a, b, c at
    layer 2 (two layers), never d."""
    n = 10
    h = marked_after(tmp_path, "GraphSAGE", {"op": "features", "node_ids": [0],
                                             "features": [[1.0] * NUM_FEATURES]})
    try:
        assert torch.nonzero(h.table.pending[0]).flatten().tolist() == [0, 1]
        assert torch.nonzero(h.table.pending[1]).flatten().tolist() == [0, 1, 2]
        assert np.flatnonzero(h.table.stale[:n]).tolist() == [0, 1, 2]
    finally:
        h.close()


def test_gcn_marks_the_out_neighbours_of_a_node_whose_degree_changed(tmp_path: Path) -> None:
    """GCN weighs edge u -> w by u's degree: an edge into b changes b's out-neighbour c at
    layer 1 already (SAGE would change only b there)."""
    h = marked_after(tmp_path, "GCN", {"op": "edges", "add": [[5, 1]]})
    try:
        assert torch.nonzero(h.table.pending[0]).flatten().tolist() == [1, 2]
        assert torch.nonzero(h.table.pending[1]).flatten().tolist() == [1, 2, 3]
    finally:
        h.close()


def test_a_row_is_not_servable_while_another_thread_settles_its_mark(tmp_path: Path,
                                                                      monkeypatch) -> None:
    """A settle on the refresh thread takes the marks before it writes ``stale``: a request
    checking the rows meanwhile waits for it, and does not read the old rows as clean."""
    cfg = table_cfg(tmp_path, "GraphSAGE", {})
    h = Harness(tmp_path, cfg, awkward_graph(3))
    try:
        h.table.refresher.stop()  # no round: this test settles by hand
        entered, release = threading.Event(), threading.Event()
        reach = h.table.out_index.reach

        def slow_reach(mask: torch.Tensor) -> torch.Tensor:
            entered.set()
            release.wait(10)
            return reach(mask)

        monkeypatch.setattr(h.table.out_index, "reach", slow_reach)
        marking = threading.Thread(target=h.table.mark, args=(
            np.empty(0, np.int64), np.array([7]), None, 1, time.time()))
        marking.start()
        assert entered.wait(10)
        answer: list[bool] = []
        checking = threading.Thread(target=lambda: answer.append(h.table.servable(np.array([7]))))
        checking.start()
        checking.join(0.3)
        assert checking.is_alive() and not answer, "read the stale mask before the settle ended"
        release.set()
        marking.join(10)
        checking.join(10)
        assert answer == [False]
    finally:
        release.set()
        h.close()


def test_a_failed_round_is_retried_as_a_full_recompute(tmp_path: Path, monkeypatch) -> None:
    from quiver_serve.engine.core import table_refresh

    monkeypatch.setattr(table_refresh, "RETRY_S", 0.05)
    base = awkward_graph(6)
    cfg = table_cfg(tmp_path, "GraphSAGE", {})
    h = Harness(tmp_path, cfg, base)
    try:
        calls = {"n": 0}
        real = h.table.compute_rows

        def flaky(*args: object) -> None:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected")
            real(*args)  # type: ignore[arg-type]

        h.table.compute_rows = flaky  # type: ignore[method-assign]
        refresher = h.table.refresher
        mark_all, idle_at_mark = refresher._mark_all, []

        def watched_mark_all() -> None:  # the refresher must not look idle before the retry
            idle_at_mark.append(refresher.idle())
            mark_all()

        refresher._mark_all = watched_mark_all  # type: ignore[method-assign]
        version = h.apply({"op": "features", "node_ids": [3], "features": [[2.0] * NUM_FEATURES]})
        h.follow(version)
        h.settle()
        assert idle_at_mark == [False], "a failed round looked idle before its rows were marked"
        assert h.table.counters.failures == 1
        assert h.table.counters.full_recomputes >= 1
        assert h.table.version == version and not h.table.stale[:NUM_NODES].any()
        x = base.x.clone()
        x[3] = 2.0
        torch.testing.assert_close(h.table.layers[-1][:NUM_NODES],
                                   pyg_rows(cfg, x, base.edge_index()), atol=1e-5, rtol=1e-5)
    finally:
        h.close()


def test_auto_builds_the_table_only_within_its_budget(tmp_path: Path) -> None:
    from quiver_serve.engine.core.exact_table import placement

    cfg = table_cfg(tmp_path, "GraphSAGE", {}).exact
    cfg.materialize = "auto"
    cfg.host_bytes = 1000
    assert placement(cfg, torch.device("cpu"), 999) == "host"
    assert placement(cfg, torch.device("cpu"), 1001) is None
    cfg.materialize = "on"
    assert placement(cfg, torch.device("cpu"), 1001) == "host"
    cfg.materialize = "off"
    assert placement(cfg, torch.device("cpu"), 1) is None


def test_wait_policy_answers_stale_rows_from_the_table_after_the_round(tmp_path: Path) -> None:
    """``exact.stale_rows: wait``: a request naming stale rows waits for the refresh round (no
    on-the-fly work), updates acknowledged meanwhile are applied only after the round, and the
    answer equals PyG's on the version served."""
    base = awkward_graph(8)
    cfg = table_cfg(tmp_path, "GraphSAGE", {})
    cfg.exact.stale_rows = "wait"
    h = Harness(tmp_path, cfg, base)
    try:
        gate = threading.Event()
        real = h.table.compute_rows

        def slow(*args: object) -> None:
            gate.wait(30)  # the round holds until the test lets it go
            real(*args)  # type: ignore[arg-type]

        h.table.compute_rows = slow  # type: ignore[method-assign]
        first = {"op": "edges", "add": [[0, 7], [3, 7]]}
        v1 = h.apply(first)
        h.follow(v1)
        end = time.monotonic() + 10
        while not h.table.refresher.busy:
            assert time.monotonic() < end, "no refresh round started"
            time.sleep(0.005)
        v2 = h.apply({"op": "features", "node_ids": [7], "features": [[3.0] * NUM_FEATURES]})
        ids = list(range(NUM_NODES))
        assert h.core.add(mb(1, [ids], exact=True)) is None
        for _ in range(20):  # the round runs: no answer, and the engine holds v2 back
            assert not h.core.step()
        assert h.core.graph_sync.version == v1 and v2 == v1 + 1
        gate.set()
        replies: list = []
        end = time.monotonic() + 30
        while not replies:
            replies = h.core.step()
            assert time.monotonic() < end, "the waiting request was never answered"
        # exact for the version served when it was answered: v1 if it was answered as the
        # round ended, v2 if the engine applied v2 first (then a second round covered it)
        edge_index, x, _ = apply_reference(base.edge_index(), base.x.clone(), first)
        at_v1 = pyg_rows(cfg, x, edge_index).numpy()
        edge_index, x, _ = apply_reference(edge_index, x, {
            "op": "features", "node_ids": [7], "features": [[3.0] * NUM_FEATURES]})
        at_v2 = pyg_rows(cfg, x, edge_index).numpy()
        got = replies[0].rows
        assert np.allclose(got, at_v1, atol=1e-5, rtol=1e-5) or \
            np.allclose(got, at_v2, atol=1e-5, rtol=1e-5), "not exact for v1 nor for v2"
        assert h.table.counters.on_the_fly == 0
        h.follow(v2)  # applied once the round is over
    finally:
        h.close()


def test_auto_policy_waits_only_while_a_full_recompute_is_due(tmp_path: Path) -> None:
    """``exact.stale_rows: auto``: a few stale rows are computed on the fly; more stale rows
    than ``exact.full_recompute_fraction`` make requests wait for the round instead."""
    h = Harness(tmp_path, table_cfg(tmp_path, "GraphSAGE", {}), awkward_graph(9))
    try:
        assert h.table.cfg.stale_rows == "auto"
        h.table.refresher.stop()
        few = np.zeros(h.table.capacity, dtype=bool)
        few[:5] = True
        h.table.set_stale(few)
        assert not h.table.waits()
        run(h.core, mb(1, [[0, 1]], exact=True))
        assert h.table.counters.on_the_fly == 1
        h.table.set_stale(np.ones(h.table.capacity, dtype=bool))
        assert h.table.waits()
        assert h.core.add(mb(2, [[0, 1]], exact=True)) is None
        for _ in range(10):
            assert not h.core.step()  # waiting: no on-the-fly work
        assert h.table.counters.on_the_fly == 1
        h.table.set_stale(np.zeros(h.table.capacity, dtype=bool))  # the round ended
        assert h.core.step()[0].done.seq == 2
        assert h.table.counters.from_table >= 2
    finally:
        h.close()

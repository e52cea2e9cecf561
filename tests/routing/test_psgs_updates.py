"""PSGS on a living graph (docs/architecture.md, "The living graph"): a table sized to a node
capacity answers for every id below it, and ``update_nodes`` gives changed and appended nodes
finite, positive sizes that follow their new in-degree (close to what a rebuilt table measures)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quiver_serve.graph.csc import GraphData
from quiver_serve.routing import psgs
from quiver_serve.sampling import make_cpu_sampler

FANOUTS = [10, 5]
EXTRA = 40  # capacity beyond the graph's nodes


def table_for(graph: GraphData, capacity: int | None = None, rounds: int = 4) -> psgs.PsgsTable:
    return psgs.load_or_build(graph.indptr, graph.indices, FANOUTS, rounds=rounds,
                              device="cpu", progress=False, use_cache=False, capacity=capacity)


def with_appended(graph: GraphData, in_edges: list[np.ndarray]) -> GraphData:
    """``graph`` with nodes appended, node ``n + i`` getting in-edges from ``in_edges[i]``."""
    n = graph.num_nodes
    old = graph.edge_index()
    new = [torch.stack([torch.from_numpy(src), torch.full((src.size,), n + i)])
           for i, src in enumerate(in_edges)]
    x = torch.zeros(n + len(in_edges), graph.num_features)
    return GraphData.from_edge_index(torch.cat([old, *new], dim=1), x, "appended")


def test_every_id_below_the_capacity_is_answered(cora: GraphData) -> None:
    n = cora.num_nodes
    table = table_for(cora, capacity=n + EXTRA)
    assert table.num_nodes == n and table.capacity == n + EXTRA
    last = np.array([n + EXTRA - 1])
    assert table.estimate(last) == 1.0 and table.draws(last) == 0.0  # isolated until added
    ids = np.arange(n + EXTRA, dtype=np.int64)
    for answer in (table.estimate(ids), table.draws(ids), table.union_of(table.draws(ids), 64),
                   table.quiver_sum(ids)):
        assert np.isfinite(answer) and answer > 0
    # capacity entries change nothing for the nodes that exist
    plain = table_for(cora)
    seeds = np.random.default_rng(0).integers(0, n, 300)
    assert table.estimate(seeds) == pytest.approx(plain.estimate(seeds), rel=1e-4)
    alpha, error = psgs.calibrate_union(table, make_cpu_sampler(cora.indptr, cora.indices),
                                        sizes=(48,), batches_per_size=1)
    assert alpha > 0 and error >= 0  # seeds drawn below n only


def test_updates_give_new_nodes_finite_positive_sizes(cora: GraphData) -> None:
    n = cora.num_nodes
    table = table_for(cora, capacity=n + EXTRA)
    new = np.arange(n, n + EXTRA)
    degree = np.arange(EXTRA) % 25  # below, at and above fanouts[0]
    table.update_nodes(new, degree)
    assert table.num_nodes == n + EXTRA
    sizes = np.array([table.estimate(np.array([v])) for v in new])
    assert np.isfinite(sizes).all() and (sizes >= 1).all()
    assert (sizes[degree == 0] == 1).all() and (sizes[degree > 0] > 1).all()
    hop1 = np.minimum(degree, FANOUTS[0])
    assert (np.diff(sizes[np.argsort(hop1, kind="stable")]) >= -1e-4).all()  # grows with it
    assert sizes[degree == 24][0] == pytest.approx(sizes[degree == 10][0])  # saturated
    batch = np.concatenate([new, np.arange(100)])
    assert np.isfinite(table.estimate(batch)) and table.estimate(batch) > 0
    assert table.quiver_sum(new) > 0 and np.isfinite(table.union_of(table.draws(new), EXTRA))
    with pytest.raises(IndexError):
        table.update_nodes(np.array([n + EXTRA]), np.array([3]))
    with pytest.raises(ValueError, match="degrees"):
        table.update_nodes(np.array([1, 2]), np.array([3]))


def test_a_node_whose_degree_doubled_grows(cora: GraphData) -> None:
    table = table_for(cora, capacity=cora.num_nodes + EXTRA)
    degree = cora.degree().numpy()
    v = int(np.flatnonzero((degree >= 2) & (degree <= FANOUTS[0] // 2))[0])
    before = table.estimate(np.array([v]))
    table.update_nodes(torch.tensor([v]), torch.tensor([2 * int(degree[v])]))
    after = table.estimate(np.array([v]))
    assert np.isfinite(after) and after > before
    assert table.draws(np.array([v])) == pytest.approx(2 * (before - 1), rel=1e-5)


def test_approximation_is_near_the_rebuilt_table(cora: GraphData) -> None:
    """Appended nodes with random in-neighbours: the approximation against the sizes a table
    rebuilt on the new graph measures (mean relative error 0.17 measured)."""
    rng = np.random.default_rng(1)
    degree = rng.integers(1, 15, 30)
    in_edges = [rng.integers(0, cora.num_nodes, d) for d in degree]
    table = table_for(cora, capacity=cora.num_nodes + 30)
    new = np.arange(cora.num_nodes, cora.num_nodes + 30)
    table.update_nodes(new, degree)
    rebuilt = table_for(with_appended(cora, in_edges), rounds=8)
    got, want = table.mean_size[new], rebuilt.mean_size[new]
    assert float(np.mean(np.abs(got - want) / want)) < 0.35  # 0.17 measured


def test_a_table_without_degrees_still_updates() -> None:
    """Built from sizes alone (no ``first_hop``): every update uses the table's mean branch."""
    mean_size = np.array([1.0, 11.0, 21.0, 31.0], np.float32)
    table = psgs.PsgsTable("k", [5, 5], mean_size, np.rint(mean_size).astype(np.int32),
                           np.array([3.0, 1.0, 0.0, 2.0]))
    assert table.first_hop is None and table.branch == pytest.approx(4.0)  # mean 20 / 5
    table = table.with_capacity(6)
    table.update_nodes(np.array([4, 1]), np.array([2, 10]))
    assert table.estimate(np.array([4])) == pytest.approx(9.0)  # 1 + 2 x 4
    assert table.estimate(np.array([1])) == pytest.approx(21.0)  # 1 + 5 x 4
    assert table.estimate(np.array([5])) == 1.0 and table.num_nodes == 5


def test_a_start_reuses_the_exponent_fitted_for_the_same_table(cora: GraphData, tmp_path,
                                                               monkeypatch, caplog) -> None:
    """The popularity exponent is fitted once per graph and fanouts, then read back: a restart
    on a large graph does not spend a pass over every node per candidate again."""
    import logging

    from quiver_serve.config import ServeConfig
    from quiver_serve.engine.core.calibrate import Calibration

    monkeypatch.setenv("QUIVER_SERVE_CACHE", str(tmp_path))
    cfg = ServeConfig.default()
    sampler = make_cpu_sampler(cora.indptr, cora.indices)
    fanouts = cfg.sampling.fanouts
    with caplog.at_level(logging.INFO):
        first = Calibration(cfg, cora, "auto", progress=False).psgs_table(
            fanouts, torch.device("cpu"), sampler, capacity=cora.num_nodes + 10)
        assert "measured batches" in caplog.text
        caplog.clear()
        again = Calibration(cfg, cora, "auto", progress=False).psgs_table(
            fanouts, torch.device("cpu"), sampler, capacity=cora.num_nodes + 10)
    assert "fitted before" in caplog.text and "measured batches" not in caplog.text
    assert again.alpha == first.alpha and again.capacity == cora.num_nodes + 10
    seeds = np.arange(0, cora.num_nodes, 7)
    assert again.estimate(seeds) == pytest.approx(first.estimate(seeds), rel=1e-6)
    forced = Calibration(cfg, cora, "startup", progress=False)
    with caplog.at_level(logging.INFO):
        forced.psgs_table(fanouts, torch.device("cpu"), sampler)
    assert "measured batches" in caplog.text  # startup: fitted again

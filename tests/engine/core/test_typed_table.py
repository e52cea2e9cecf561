"""The typed exact table kept through updates (engine/core/typed_table.py): after edge additions
and removals (on a relation within a type, between types and its reverse), new nodes and feature
writes, every layer of every refreshed row equals a fresh layer-wise run on the updated graph,
and the final rows equal PyG's full-graph forward; only what the changes reach is recomputed;
while the refresh is behind, exact answers of stale rows are computed on the fly and equal."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from quiver_serve.config import ServeConfig
from quiver_serve.engine.core.typed_core import build_typed_core
from quiver_serve.engine.core.typed_table import TypedExactTable
from quiver_serve.graph.typed_living import TypedLiveGraph
from quiver_serve.graph.typed_load import load_typed_graph
from quiver_serve.models.typed_layerwise import TypedLayerwise
from quiver_serve.models.typed_served import build_typed_model
from tests.engine.core.test_typed_core import CONFIG, _answer, _mb, follow_a_log
from tests.models.test_typed_models import TYPED_MODELS, full_graph, shop_graph, spec

TOL = 1e-5
#: (model, whether its relations carry edge features: then edges are only removed)
MODELS = [("to_hetero_sage_sum", False), ("to_hetero_sage_mean", False), ("rgcn", False),
          ("hgt", False), ("hetero_conv", False), ("to_hetero_gat_edges", True)]


def served_on(name: str, edge_features: bool, seed: int):  # noqa: ANN201
    graph = shop_graph(seed=seed, edge_dim=3 if edge_features else None)
    pyg_class, kwargs, to_hetero = TYPED_MODELS[name]
    torch.manual_seed(0)
    return build_typed_model(spec(pyg_class, kwargs, to_hetero), graph), graph


def apply(live: TypedLiveGraph, records: list) -> None:  # noqa: ANN001
    for record in records:
        live.apply(record)


def updates(live: TypedLiveGraph, graph, edge_features: bool) -> list:  # noqa: ANN001
    """Records changing the graph every way a typed update can."""
    knows, buys = ("user", "knows", "user"), ("user", "buys", "item")
    some_know = graph.relations[knows]
    first_known = int(some_know.indices[int(some_know.indptr[3])]) \
        if int(some_know.indptr[4]) > int(some_know.indptr[3]) else 0
    bought = graph.relations[buys]
    dst = int(torch.nonzero(bought.degree()).flatten()[0])
    src = int(bought.indices[int(bought.indptr[dst])])
    no = np.zeros((0, 2), np.int64)
    records = [live.edge_record(1, 0.0, knows, no, np.array([[first_known, 3]])),
               live.edge_record(2, 0.0, buys, no, np.array([[src, dst]]))]
    if not edge_features:
        records += [live.edge_record(3, 0.0, knows, np.array([[5, 7], [8, 7]]), no),
                    live.edge_record(4, 0.0, buys, np.array([[9, 40], [10, 2]]), no),
                    live.node_record(5, 0.0, "user", np.ones((2, 6), np.float32)),
                    live.edge_record(6, 0.0, buys, np.array([[57, 1], [58, 0]]), no)]
    records.append(live.feature_record(7, 0.0, "shop", np.array([2]),
                                       np.full((1, 3), 0.5, np.float32)))
    return records


@pytest.mark.parametrize("reverse", [True, False], ids=["reverse-csc", "scan"])
@pytest.mark.parametrize(("name", "edge_features"), MODELS)
def test_refreshed_layers_equal_a_fresh_run_and_pyg(name: str, edge_features: bool,
                                                    reverse: bool) -> None:
    served, graph = served_on(name, edge_features, seed=len(name))
    table = TypedExactTable(TypedLayerwise(served), chunk_edges=40, chunk_nodes=7)
    live = TypedLiveGraph(graph, add_reverse_edges=True)
    live.watch_changes()
    if reverse:
        table.follow_reverse(live)
    for record in updates(live, graph, edge_features):
        live.apply(record)
        assert table.mark(live.take_changes()) > 0
        table.refresh(0.0)  # one chunk: records arrive while the refresh is behind
    while table.stale_count():
        table.refresh(float("inf"))
    fresh = TypedLayerwise(served).run_layers(chunk_nodes=50)
    for i, layer in enumerate(fresh):
        got = table.layer(i)
        assert set(got) == set(layer)
        for t, rows in layer.items():
            torch.testing.assert_close(got[t], rows, rtol=0, atol=TOL)
    want = full_graph(served, graph)
    for t in table.types():
        torch.testing.assert_close(table.layer(-1)[t], want[t], rtol=0, atol=TOL)


def test_only_what_a_change_reaches_is_recomputed() -> None:
    served, graph = served_on("to_hetero_sage_sum", False, seed=3)
    table = TypedExactTable(TypedLayerwise(served))
    live = TypedLiveGraph(graph, add_reverse_edges=True)
    live.watch_changes()
    table.follow_reverse(live)
    live.apply(live.feature_record(1, 0.0, "shop", np.array([4]), np.zeros((1, 3), np.float32)))
    table.mark(live.take_changes())
    # layer 1: shop 4 and the items it reaches along rev_sold_by (those sold by it: its in-list
    # in sold_by); layer 2 adds their out-neighbours
    sold = graph.relations[("item", "sold_by", "shop")]
    items = torch.unique(sold.indices[int(sold.indptr[4]):int(sold.indptr[5])])
    assert items.numel() and table.pending[0] == {"user": 0, "item": items.numel(), "shop": 1}
    total = sum(graph.num_nodes.values()) * table.num_layers
    done = table.refresh(float("inf"))
    assert 0 < done < total / 2 and table.stale_count() == 0
    torch.testing.assert_close(table.layer(-1)["item"], full_graph(served, graph)["item"],
                               rtol=0, atol=TOL)


def test_the_core_keeps_its_table_through_logged_updates(tmp_path: Path) -> None:
    """The typed core following a real log keeps its table: while the refresh is behind, exact
    answers of stale rows are computed on the fly; once it is done they come from the table;
    both equal a fresh layer-wise run of the updated graph."""
    cfg = ServeConfig.from_yaml(CONFIG)
    graph = load_typed_graph(cfg.graph)
    core = build_typed_core(cfg, graph)
    core.settings.apply_budget_s = core.settings.idle_refresh_s = 0.0  # one chunk per step
    core.table.chunk_edges = 2000
    writer, log = follow_a_log(core, cfg, graph, tmp_path)
    core.step()  # the core starts watching the graph it built its table on
    writer.add_edges([[7, 3], [7, 9]], [[int(graph.relations[("paper", "cites", "paper")]
                                            .indices[0]), 0]], ["paper", "cites", "paper"])
    writer.add_nodes(np.zeros((1, 0), np.float32), "word")
    writer.add_edges([[3, 1433]], None, ["paper", "has_word", "word"])
    writer.put_features([9], np.ones((1, graph.feature_width("paper")), np.float32), "paper")
    deadline = time.time() + 30
    while core.sync.version < 4 and time.time() < deadline:
        core.step()
    assert core.sync.version == 4 and core.refreshing()
    full = TypedLayerwise(core.served).run(chunk_nodes=500)
    ids = [0, 3, 7, 9, 2000]
    behind = _answer(core, _mb(1, ids, "paper", exact=True))
    np.testing.assert_allclose(behind.rows, full["paper"][ids].numpy(), rtol=0, atol=TOL)
    while core.refreshing() and time.time() < deadline:
        core.step()
    assert core.table is not None and not core.refreshing()
    assert 0 < core.table.rows_refreshed < sum(graph.num_nodes.values()) * 2
    for node_type, some in (("paper", ids), ("word", [0, 1433])):
        reply = _answer(core, _mb(2, some, node_type, exact=True))
        np.testing.assert_allclose(reply.rows, full[node_type][some].numpy(), rtol=0, atol=TOL)
        assert bool(core.table.clean(node_type, torch.tensor(some)).all())
    log.close()


def test_a_chunk_is_sized_to_the_steps_budget() -> None:
    """At the measured in-edges per second a chunk fits what is left of the budget (4,096
    in-edges at least), ``chunk_edges`` and ``chunk_nodes`` at most, one target at least."""
    table = TypedExactTable.__new__(TypedExactTable)
    table.chunk_edges, table.chunk_nodes, table.edges_per_s = 1 << 20, 16384, 1e6
    ends = torch.arange(1, 1_000_001) * 10  # every target 10 in-edges (with itself)
    assert table.chunk_end(ends, 0, float("inf")) == 16384
    assert table.chunk_end(ends, 0, 0.01) == 1000
    assert table.chunk_end(ends, 5, 0.0) == 5 + 409
    heavy = torch.cumsum(torch.tensor([5_000_000, 1]), 0)
    assert table.chunk_end(heavy, 0, 0.0) == 1 and table.chunk_end(heavy, 1, 0.0) == 2

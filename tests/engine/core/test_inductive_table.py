"""Exact inductive requests from the exact table (``engine/core/inductive_table.py``), driven
in-process: one engine core following a real update log.

Rows of a request's own new nodes (and of its ids) equal PyG's ``model(x, edge_index)`` on the
graph with the nodes added, for models the table serves layer by layer (GraphSAGE with 2 and 3
layers, GAT): from the table while the in-neighbours' rows are clean, on the fly once an update
left one of them pending, and on the fly for a GCN (its norm reads degrees by id). Nothing of
the graph changes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from quiver_serve.engine.core.micro_batch import MicroBatch
from tests.engine.core.test_engine_core import mb, run
from tests.engine.core.test_exact_table import (
    NUM_FEATURES,
    NUM_NODES,
    Harness,
    awkward_graph,
    pyg_rows,
    table_cfg,
)

MODELS = [
    ("GraphSAGE", {}, True),
    ("GraphSAGE", {"aggr": "sum", "num_layers": 3}, True),
    ("GAT", {"heads": 2}, True),
    ("GCN", {}, False),
]


def inductive(seq: int, ids: list[int], features: np.ndarray,
              lists: list[list[int]]) -> MicroBatch:
    m = mb(seq, [ids], exact=True)
    m.new_features = features.astype(np.float32)
    m.new_offsets = np.cumsum([0] + [len(x) for x in lists]).astype(np.int64)
    m.new_neighbors = np.array([u for x in lists for u in x], np.int64)
    return m


def with_nodes(edge_index: torch.Tensor, x: torch.Tensor, features: np.ndarray,
               lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.size(0)
    added = torch.tensor([[u, n + i] for i, nbrs in enumerate(lists) for u in nbrs],
                         dtype=torch.int64).reshape(-1, 2).t()
    return torch.cat([edge_index, added], 1), torch.cat([x, torch.from_numpy(features)])


@pytest.mark.parametrize(("cls", "kwargs", "from_table"), MODELS)
def test_new_nodes_rows_equal_pyg_on_the_graph_with_them(tmp_path: Path, cls: str, kwargs: dict,
                                                        from_table: bool) -> None:
    base = awkward_graph(11)
    cfg = table_cfg(tmp_path, cls, kwargs)
    h = Harness(tmp_path, cfg, base)
    rng = np.random.default_rng(3)
    features = rng.standard_normal((3, NUM_FEATURES)).astype(np.float32)
    # a hub's in-neighbours, a repeated edge and a self loop's node, none, an isolated node
    lists = [[0, 1, 2, 3, 1, 24], [], [NUM_NODES - 1]]
    ids = [5, 0, 5]
    try:
        h.table.refresher.stop()  # rows stay pending once marked
        edge_index, x = with_nodes(base.edge_index(), base.x, features, lists)
        want = pyg_rows(cfg, x, edge_index).numpy()[ids + [NUM_NODES, NUM_NODES + 1,
                                                             NUM_NODES + 2]]
        before = h.table.counters.from_table
        got = run(h.core, inductive(1, ids, features, lists))[1]
        assert not got.done.errors, got.done.errors
        np.testing.assert_allclose(got.rows, want, atol=1e-5, rtol=1e-5)
        assert h.table.counters.from_table == before + int(from_table)
        alone = run(h.core, inductive(2, [], features[1:], lists[1:]))[2].rows
        np.testing.assert_allclose(alone, want[-2:], atol=1e-5, rtol=1e-5)
        assert h.core.num_nodes == NUM_NODES, "nothing was added"

        # node 1 (an in-neighbour) gains an in-edge: its rows are pending, not refreshed
        version = h.apply({"op": "edges", "add": [[7, 1]]})
        h.follow(version)
        edge_index = torch.cat([base.edge_index(), torch.tensor([[7], [1]])], 1)
        edge_index, x = with_nodes(edge_index, base.x, features, lists)
        want = pyg_rows(cfg, x, edge_index).numpy()[[NUM_NODES, NUM_NODES + 1, NUM_NODES + 2]]
        counted = h.table.counters.from_table
        got = run(h.core, inductive(3, [], features, lists))[3]
        np.testing.assert_allclose(got.rows, want, atol=1e-5, rtol=1e-5)
        assert h.table.counters.from_table == counted, "a pending in-neighbour: on the fly"
    finally:
        h.close()

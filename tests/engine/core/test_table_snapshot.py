"""A start maps the exact table's snapshot (quiver_serve/engine/core/table_snapshot.py): not
computed again, the rows the log changed since refreshed, every row then equal to PyG's
full-graph output on the current graph; another model's weights never read it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quiver_serve.config import ServeConfig
from quiver_serve.engine.core.build import build_core
from quiver_serve.engine.core.exact_table import ExactTable
from quiver_serve.graph.living import LiveGraphArgs
from quiver_serve.graph.snapshot import write_first_snapshot
from quiver_serve.graph.stream import StreamMix, apply_reference, hold_out
from quiver_serve.graph.update_log import UpdateLog
from quiver_serve.graph.writer import GraphWriter
from tests.engine.core.test_exact_table import awkward_graph, pyg_rows, table_cfg
from tests.graph.test_writer import apply


def _core(cfg: ServeConfig, base, writer: GraphWriter, directory: Path):
    live = LiveGraphArgs(str(directory), 0, writer.caps, writer.state.tensor)
    return build_core(cfg, base, 0, None, progress=False, live=live)


def _writer(cfg: ServeConfig, base, directory: Path) -> GraphWriter:
    log = UpdateLog(directory)
    log.open()
    return GraphWriter(cfg.graph, base, 0, log)


@pytest.mark.parametrize(("cls", "kwargs"), [("GraphSAGE", {}), ("GCN", {})])
def test_a_restart_maps_the_table_and_refreshes_what_changed(tmp_path: Path, cls: str,
                                                            kwargs: dict, monkeypatch) -> None:
    base, stream = hold_out(awkward_graph(11), 0.3, seed=2,
                            mix=StreamMix(edges_per_call=20, nodes_every=3, features_every=2))
    cfg = table_cfg(tmp_path, cls, kwargs)
    directory = tmp_path / "log"
    directory.mkdir()
    assert write_first_snapshot(directory, base, "test")  # the base a daemon's start writes
    writer = _writer(cfg, base, directory)
    first = _core(cfg, base, writer, directory)  # computes the table and snapshots it
    first.exact_table.stop()
    assert list((directory / "tables").rglob("layer0.npy"))
    edge_index, x = base.edge_index(), base.x.clone()
    ops = list(stream)[:6]  # updates after the snapshot
    for op in ops:
        edge_index, x, _ = apply_reference(edge_index, x, op)
    apply(writer, ops)

    def computed(self: ExactTable, *args: object, **kw: object) -> None:
        raise AssertionError("the table was computed again instead of mapped")

    monkeypatch.setattr(ExactTable, "build", computed)
    second = _core(cfg, base, writer, directory)  # a restart over the same folder
    table = second.exact_table
    try:
        assert table.ready
        assert table.refresher.wait_idle(30)
        assert table.counters.rows_refreshed > 0  # what the log changed since: refreshed
        assert not table.stale[:x.size(0)].any()
        torch.testing.assert_close(table.layers[-1][:x.size(0)], pyg_rows(cfg, x, edge_index),
                                   atol=1e-5, rtol=1e-5)
    finally:
        table.stop()


def test_other_weights_never_read_the_snapshot(tmp_path: Path) -> None:
    base = awkward_graph(12)
    cfg = table_cfg(tmp_path, "GraphSAGE", {})
    directory = tmp_path / "log"
    directory.mkdir()
    write_first_snapshot(directory, base, "test")
    writer = _writer(cfg, base, directory)
    _core(cfg, base, writer, directory).exact_table.stop()
    cfg.model.random_init_seed = 7  # another model
    core = _core(cfg, base, writer, directory)
    try:
        torch.testing.assert_close(core.exact_table.layers[-1][:base.num_nodes],
                                   pyg_rows(cfg, base.x, base.edge_index()), atol=1e-5,
                                   rtol=1e-5)
    finally:
        core.exact_table.stop()

"""Admin calls that change the graph are logged with what they changed (docs/architecture.md, "Admin
plane")."""

from __future__ import annotations

import logging

import pytest

from quiver_serve.engine.procs.graph_service import UpdateLog


def test_graph_updates_are_summarised_and_compactions_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    log = UpdateLog(every_s=0.0)
    with caplog.at_level(logging.INFO, "quiver_serve.engine.procs.graph_service"):
        log.record("add_edges", {"version": 7, "added": 3, "removed": 1, "missing": 0})
        log.record("add_nodes", {"version": 8, "node_ids": [10, 11]})
        log.record("compact", {"version": 8})
        log.record("info", {"version": 8})
    lines = [r.getMessage() for r in caplog.records]
    assert any("added 3" in line and "removed 1" in line and "version 7" in line
               for line in lines), lines
    assert any("node_ids 2" in line and "version 8" in line for line in lines), lines
    assert any("compaction requested at version 8" in line for line in lines)
    assert len(lines) == 3  # reads are not admin changes

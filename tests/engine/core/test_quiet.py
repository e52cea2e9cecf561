"""Background table work runs when the engine loop is quiet (docs/decisions/0068-quiet-gate.md):
the exact table's refresh and a new model version's table build wait while the loop has serving
work, run at once when it has none, and still progress under a load that never lets it be quiet
(after ``exact.quiet_wait_ms``); what they leave stale is exact on the fly meanwhile."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from quiver_serve.engine.core.quiet import QuietGate
from quiver_serve.graph.csc import GraphData
from tests.engine.core.test_engine_core import make_core, mb, run
from tests.engine.core.test_exact_table import Harness, awkward_graph, table_cfg
from tests.engine.core.test_model_slots import SAGE_KW, save_weights, spec


def test_the_gate_lets_work_through_when_quiet_and_after_the_longest_wait() -> None:
    gate = QuietGate(0.2)
    t0 = time.monotonic()
    assert gate.wait_turn() and time.monotonic() - t0 < 0.05  # quiet from the start
    gate.note(False)
    t0 = time.monotonic()
    assert not gate.wait_turn()  # never quiet: runs anyway after the longest wait
    assert 0.19 <= time.monotonic() - t0 < 1.0
    assert (gate.quiet_turns, gate.waited_turns) == (1, 1)
    threading.Timer(0.05, gate.note, args=(True,)).start()
    t0 = time.monotonic()
    assert gate.wait_turn() and time.monotonic() - t0 < 0.15  # the loop went quiet meanwhile
    gate.note(False)
    stop = threading.Event()
    stop.set()
    slow = QuietGate(30.0)
    slow.note(False)
    t0 = time.monotonic()
    assert not slow.wait_turn(stop) and time.monotonic() - t0 < 0.5  # a stop ends the wait
    assert gate.due(True, 0.0, 0.0) and not gate.due(False, 10.0, 10.1)
    assert gate.due(False, 10.0, 10.25)
    with pytest.raises(ValueError, match="max_wait_s"):
        QuietGate(-1.0)


def _busy_loop(h: Harness) -> None:
    """From now on every step of the core ends with serving work left (a load that never
    lets the loop be quiet)."""
    h.core.serving_quiet = lambda: False  # type: ignore[method-assign]
    h.core.quiet.note(False)


def test_the_refresh_waits_for_a_quiet_loop(tmp_path: Path) -> None:
    cfg = table_cfg(tmp_path, "GraphSAGE", {})
    cfg.exact.quiet_wait_ms = 60_000.0
    h = Harness(tmp_path, cfg, awkward_graph(3))
    try:
        _busy_loop(h)
        version = h.apply({"op": "edges", "add": [[0, 1], [2, 3]]})
        h.follow(version)
        time.sleep(0.5)
        assert h.table.version < version and h.table.counters.rows_refreshed == 0
        ids = np.arange(20)  # stale rows are exact on the fly meanwhile: never held back
        fly = run(h.core, mb(1, [ids.tolist()], exact=True))[1]
        assert fly.done.stats.route != "table" and not fly.done.errors
        h.core.quiet.note(True)  # the loop goes quiet: the round runs
        h.settle()
        assert h.table.version == version and h.table.counters.rows_refreshed > 0
        assert h.core.quiet.quiet_turns > 0 and h.core.quiet.waited_turns == 0
    finally:
        h.close()


def test_the_refresh_progresses_under_a_load_that_never_lets_the_loop_be_quiet(
        tmp_path: Path) -> None:
    cfg = table_cfg(tmp_path, "GraphSAGE", {})
    cfg.exact.quiet_wait_ms = 20.0
    h = Harness(tmp_path, cfg, awkward_graph(4))
    try:
        _busy_loop(h)
        version = h.apply({"op": "edges", "add": [[5, 6]], "remove": []})
        h.follow(version)
        h.settle()
        assert h.table.version == version
        assert h.core.quiet.waited_turns > 0 and h.core.quiet.quiet_turns == 0
    finally:
        h.close()


def test_a_new_versions_table_builds_only_when_the_loop_is_quiet(cora: GraphData,
                                                                tmp_path: Path) -> None:
    core = make_core(cora, exact__materialize="on", models__table_build_step_ms=0.05,
                     exact__quiet_wait_ms=60_000.0)
    path, _ = save_weights(tmp_path, "GraphSAGE", SAGE_KW, cora.num_features, 23)
    done: list[tuple[object, object]] = []
    core.loads.load(spec(core.primary.name, 2, "GraphSAGE", SAGE_KW, path),
                    lambda r, e: done.append((r, e)))
    core.serving_quiet = lambda: False  # type: ignore[method-assign]
    end = time.monotonic() + 60
    while not done and time.monotonic() < end:
        core.step()
        time.sleep(0.001)
    assert done and done[0][1] is None, done
    build = core.loads.table_builds()[0]
    for _ in range(50):
        core.step()
    assert build.steps == 0 and core.loads.building  # serving first: no table work
    del core.serving_quiet  # the loop is quiet again
    end = time.monotonic() + 60
    while core.loads.building and time.monotonic() < end:
        core.step()
    assert not core.loads.building and build.steps > 1

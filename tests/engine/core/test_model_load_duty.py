"""A model load does not wait for the new version's exact table (docs/decisions/0040): the
version serves at once, its exact requests are answered on the fly (equal to PyG's full-graph
output for its weights) while the loop builds its table a budget per step, and once built the
table answers them. The budget holds per step; a load under concurrent requests fails none.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from quiver_serve.engine.core.exact_table import new_exact_table
from quiver_serve.engine.core.table_build import PROBE_UNITS, StepwiseBuild
from quiver_serve.engine.procs.table_metrics import TableWatch
from quiver_serve.graph.csc import GraphData
from tests.engine.core.test_engine_core import make_core, run
from tests.engine.core.test_model_slots import SAGE_KW, pinned, save_weights, spec

IDS = [0, 5, 17, 1200, 2707]


def _pyg(model: torch.nn.Module, cora: GraphData) -> np.ndarray:
    with torch.no_grad():
        return model(cora.x, cora.edge_index())[IDS].numpy()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_new_version_answers_exact_on_the_fly_while_its_table_builds_then_from_it(
        cora: GraphData, tmp_path: Path, device: str) -> None:
    core = make_core(cora, device, exact__materialize="on", models__table_build_step_ms=0.05)
    name = core.primary.name
    old_table = core.exact_table
    path, model = save_weights(tmp_path, "GraphSAGE", SAGE_KW, cora.num_features, 21)
    done: list[tuple[object, object]] = []
    seen: list[tuple[int, float]] = []  # what the metrics get: chunks of a step, progress
    core.loads.on_build_step = lambda chunk_s, progress: seen.append((len(chunk_s), progress))
    core.loads.load(spec(name, 2, "GraphSAGE", SAGE_KW, path), lambda r, e: done.append((r, e)))
    end = time.monotonic() + 60
    while not done and time.monotonic() < end:
        core.step()
        time.sleep(0.001)
    assert done and done[0][1] is None, done
    assert "exact_table_s" not in done[0][0]["load_s"]  # answered before the table is built
    assert core.loads.building and core.updates_held == 1
    core.models.set_traffic(name, {2: 1.0})
    core.loads.follow_table(name)  # v2 is the main version, its table still building
    assert core.exact_table is old_table and core.loads.building
    want = _pyg(model, cora)
    during = run(core, pinned(0, IDS, exact=True))[0]
    assert during.done.version == 2 and during.done.stats.route != "table"
    np.testing.assert_allclose(during.rows, want, atol=1e-4, rtol=1e-4)
    build = core.loads.table_builds()[0]
    end = time.monotonic() + 60
    while core.loads.building and time.monotonic() < end:
        core.step()
    assert not core.loads.building and build.steps > 1
    assert len(seen) == build.steps and all(n >= 1 for n, _ in seen)
    progress = [p for _, p in seen]
    assert progress == sorted(progress) and progress[-1] == 1.0 and progress[0] < 1.0
    assert core.exact_table is not old_table and core.updates_held == 0
    assert core.exact_table.model.served is core.models.get(name, 2).served
    assert "exact_table_s" in core.models.get(name, 2).load_s
    before = core.exact_table.counters.from_table
    after = run(core, pinned(1, IDS, exact=True))[1]
    assert after.done.version == 2 and after.done.stats.route == "table"
    assert core.exact_table.counters.from_table == before + 1
    watch = TableWatch(core, 0)
    watch()
    assert watch.table is core.exact_table  # the metrics read the swapped-in table
    np.testing.assert_allclose(after.rows, want, atol=1e-4, rtol=1e-4)


def test_a_table_built_a_budget_per_step_equals_one_built_at_once(cora: GraphData) -> None:
    core = make_core(cora, exact__materialize="on")
    args = core.tables.args
    at_once = core.exact_table
    stepped = new_exact_table(args.cfg, core.model, core.features, core.device, args.capacity,
                              core.tables.graph_of(core), progress=False, build=False)
    build = StepwiseBuild(stepped, budget_s=1e-4)
    while not build.step():
        pass
    assert stepped.ready and not stepped.stale[:cora.num_nodes].any()
    for mine, want in zip(stepped.layers, at_once.layers, strict=True):
        np.testing.assert_allclose(mine[:cora.num_nodes].numpy(),
                                   want[:cora.num_nodes].numpy(), atol=1e-5, rtol=1e-5)
    assert build.progress() == 1.0


def test_each_step_spends_at_most_its_budget_on_the_build(cora: GraphData) -> None:
    """On a clock that advances by each chunk's work units (1 us per in-edge or row): after the
    first (probe) chunk, no step runs more table work than the budget, and the build takes about
    total work / budget steps (not one step, not one chunk a step)."""
    core = make_core(cora, exact__materialize="on")
    args = core.tables.args
    table = new_exact_table(args.cfg, core.model, core.features, core.device, args.capacity,
                            core.tables.graph_of(core), progress=False, build=False)
    now = [0.0]
    graph = table.graph_of()
    compute = table.compute_rows

    def costed(layer: int, targets: torch.Tensor, g: object) -> None:
        compute(layer, targets, g)  # type: ignore[arg-type]
        now[0] += 1e-6 * (int(graph.in_degree(targets).sum()) + int(targets.numel()))

    table.compute_rows = costed  # type: ignore[method-assign]
    budget_s = 2e-3
    build = StepwiseBuild(table, budget_s, clock=lambda: now[0])
    spent: list[float] = []
    while True:
        t0 = now[0]
        finished = build.step()
        spent.append(now[0] - t0)
        if finished:
            break
    assert spent[0] <= budget_s + PROBE_UNITS * 1e-6
    assert max(spent[1:]) <= budget_s * (1 + 1e-9)
    total_s = build.total_units * 1e-6
    assert len(spent) <= total_s / budget_s * 1.5 + 2
    assert len(spent) >= (total_s - spent[0]) / budget_s
    assert table.ready


def test_no_request_fails_across_a_load_under_concurrent_requests(cora: GraphData,
                                                                  tmp_path: Path) -> None:
    """Sampled and exact requests keep arriving through the load, the swap and the table's
    build: every one is answered, none with an error, each by the version it resolved to."""
    core = make_core(cora, exact__materialize="on", models__table_build_step_ms=0.2,
                     exact__quiet_wait_ms=1.0)  # never quiet here: a step after each 1 ms
    name = core.primary.name
    path, _ = save_weights(tmp_path, "GraphSAGE", SAGE_KW, cora.num_features, 22)
    done: list[tuple[object, object]] = []
    core.loads.load(spec(name, 2, "GraphSAGE", SAGE_KW, path), lambda r, e: done.append((r, e)))
    seq, answered, versions = 0, 0, set()
    swapped_at = None
    end = time.monotonic() + 90
    while time.monotonic() < end:
        if done and swapped_at is None:
            assert done[0][1] is None, done
            core.models.set_traffic(name, {2: 1.0})
            core.loads.follow_table(name)
            swapped_at = seq
        batch = [pinned(seq + k, [(seq * 7 + k) % cora.num_nodes], exact=bool(k % 2))
                 for k in range(4)]
        seq += 4
        for reply in run(core, *batch).values():
            assert not reply.done.errors, reply.done.errors
            versions.add(reply.done.version)
            answered += 1
        if swapped_at is not None and not core.loads.building and seq > swapped_at + 40:
            break
    assert answered == seq and versions == {1, 2}
    assert core.exact_table.model.served is core.models.get(name, 2).served

"""How an engine core applies the update log (docs/architecture.md, "The living graph"): the
writer's plans instead of planning in the loop, at least one record per step within the step's
budget while requests wait, and what depends on the changed nodes (degrees, PSGS entries) once
per step for all of them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from quiver_serve.config import ServeConfig
from quiver_serve.engine.core.build import build_core
from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.living import LiveGraphArgs
from quiver_serve.graph.update_log import UpdateLog
from quiver_serve.graph.writer import GraphWriter


def _setup(tmp: Path, log_name: str = "log", device: str = "cpu") -> tuple:
    g = torch.Generator().manual_seed(0)
    base = GraphData.from_edge_index(torch.randint(0, 200, (2, 1500), generator=g),
                                     torch.randn(200, 8, generator=g), "g")
    cfg = ServeConfig.default()
    cfg.graph.update_log_dir = str(tmp / log_name)
    cfg.model.weights = None
    cfg.model.kwargs = {"hidden_channels": 8, "num_layers": 2, "out_channels": 4}
    cfg.sampling.fanouts = [3, 3]
    cfg.sampling.calibration = "off"
    cfg.inference.device = device  # type: ignore[assignment]
    cfg.exact.materialize = "off"
    directory = tmp / log_name
    directory.mkdir(parents=True)
    log = UpdateLog(directory)
    log.open()
    writer = GraphWriter(cfg.graph, base, 0, log)
    live = LiveGraphArgs(str(directory), 0, writer.caps, writer.state.tensor)
    core = build_core(cfg, base, 0, None, progress=False, live=live)
    return writer, core


def _write(writer: GraphWriter, calls: int, seed: int = 1) -> None:
    rng = np.random.default_rng(seed)
    for i in range(calls):
        add = rng.integers(0, 200, (30, 2))
        remove = add[:3] if i % 4 == 3 else np.empty((0, 2), np.int64)  # added edges go again
        writer.add_edges(add.tolist(), remove.tolist())


def test_a_busy_core_applies_one_record_per_step_within_a_zero_budget(tmp_path: Path) -> None:
    writer, core = _setup(tmp_path)
    _write(writer, 12)
    sync = core.graph_sync
    assert sync is not None
    seen: list[tuple[dict, int]] = []
    sync.on_poll = lambda stages, n: seen.append((stages, n))
    versions = []
    while sync.version < writer.acked:
        sync.poll(core, budget_s=0.0)
        versions.append(sync.version)
    assert versions == list(range(1, 13))  # one per step, none skipped, in order
    assert [n for _, n in seen] == [1] * 12
    assert {"read", "overlay", "degrees", "total"} <= set(seen[0][0])  # "device" on a GPU
    # every record came with the writer's plan and was applied without planning here
    assert sync.overlay.records_applied == {"writer": 12, "here": 0}


def test_a_busy_core_reads_applies_and_updates_psgs_in_separate_steps(tmp_path: Path) -> None:
    """While requests wait, each gap between batches holds one stage: reading the records, then
    applying them, then the PSGS entries of the nodes they changed; the entries end as an idle
    core's that applied everything at once."""
    writer_a, busy = _setup(tmp_path, "a")
    writer_b, idle = _setup(tmp_path, "b")
    for writer in (writer_a, writer_b):
        _write(writer, 6, seed=3)
    sync = busy.graph_sync
    assert sync is not None and busy.psgs is not None and idle.psgs is not None
    seen: list[tuple[set, int]] = []
    sync.on_poll = lambda stages, n: seen.append((set(stages), n))

    def entries(core: object) -> list[float]:  # each node's PSGS entry as the router reads it
        return [core.psgs.draws(np.array([v])) for v in range(200)]  # type: ignore[attr-defined]

    before = entries(busy)
    busy.waiting.append(object())  # a request waits (poll only asks whether one does)
    try:
        sync.poll(busy)
        assert sync.version == 0 and len(sync.pending) == 6 and seen[-1][1] == 0
        assert "read" in seen[-1][0] and "overlay" not in seen[-1][0]
        sync.poll(busy)
        applied = sync.version
        assert applied >= 1 and seen[-1][1] == applied and "overlay" in seen[-1][0]
        assert entries(busy) == before  # the routing sizes lag a step
        sync.poll(busy)
        assert seen[-1] == ({"psgs"}, 0) and sync.version == applied
        assert entries(busy) != before
        while sync.version < writer_a.acked or sync._psgs_due:
            sync.poll(busy)
        for i in range(5):  # a record per few steps while busy: none waits for more to come
            _write(writer_a, 1, seed=10 + i)
            for _ in range(3):  # read, apply, PSGS
                sync.poll(busy)
            assert sync.version == writer_a.acked
    finally:
        busy.waiting.clear()
    for i in range(5):
        _write(writer_b, 1, seed=10 + i)  # the same calls as the busy core's
    idle.graph_sync.poll(idle)  # idle: read, applied and PSGS in one step
    assert idle.graph_sync.version == sync.version == 11
    assert entries(busy) == entries(idle)


def test_grouped_application_equals_one_record_at_a_time(tmp_path: Path) -> None:
    writer_a, one = _setup(tmp_path, "a")
    writer_b, grouped = _setup(tmp_path, "b")
    for writer in (writer_a, writer_b):
        _write(writer, 20, seed=5)
    while one.graph_sync.version < writer_a.acked:
        one.graph_sync.poll(one, budget_s=0.0)
    grouped.graph_sync.poll(grouped)  # idle: everything read, in one step
    assert grouped.graph_sync.version == one.graph_sync.version == 20
    nodes = np.arange(200)
    assert np.array_equal(one.graph_sync.overlay.degree(nodes),
                          grouped.graph_sync.overlay.degree(nodes))
    assert one.psgs is not None and grouped.psgs is not None
    for v in range(200):  # each node's PSGS entry as the router reads it
        assert one.psgs.draws(np.array([v])) == grouped.psgs.draws(np.array([v]))
    ids = torch.arange(0, 200, 7)
    a = one.local_sampler.sample(ids, [3, 3], seed=11)
    b = grouped.local_sampler.sample(ids, [3, 3], seed=11)
    assert torch.equal(a.n_id, b.n_id) and torch.equal(a.edge_index, b.edge_index)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_device_copy_after_a_grouped_step_equals_the_host_overlay(tmp_path: Path) -> None:
    """Several records' arena writes (some rewriting the same entries: removals of edges added
    just before) reach the device copy as one patch of the host's entries."""
    writer, core = _setup(tmp_path, device="cuda")
    _write(writer, 16, seed=9)
    sync = core.graph_sync
    assert sync is not None and core.gpu_sampler is not None
    sync.poll(core)  # idle: every record in one step
    assert sync.version == 16 and sync.device_overlay is not None
    host, dev = sync.overlay.view(), sync.device_overlay.view()
    assert host is not None
    top = sync.overlay.top
    assert torch.equal(host.start, dev.start.cpu()) and torch.equal(host.length, dev.length.cpu())
    assert torch.equal(host.tail[:top], dev.tail[:top].cpu())
    ids = torch.arange(0, 200, 3)
    a = core.local_sampler.sample(ids, [3, 3], seed=2)
    b = core.gpu_sampler.sample(ids, [3, 3], seed=2)
    assert torch.equal(a.n_id, b.n_id.cpu()) and torch.equal(a.edge_index, b.edge_index.cpu())

"""The living graph end to end through the real daemon processes (docs/architecture.md, "The living
graph"), on the CPU.

A held-out update stream (edge adds and removes, new nodes, feature writes) is applied through the
writer while the pipeline serves; then exact answers read at the last version equal PyG's
``model(x, edge_index)`` on the updated graph, on the engine core's own sampler and on the CPU
sampler pool; a restart replays the log to the same graph; inductive rows equal the rows of the
same nodes once actually added.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from quiver_serve.config import ServeConfig
from quiver_serve.engine.client.pipeline import Pipeline
from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.stream import StreamMix, hold_out
from quiver_serve.models.served import build_model

NUM_NODES, NUM_FEATURES = 120, 8


def awkward_graph(seed: int) -> GraphData:
    """Self loops, duplicate edges and isolated nodes."""
    g = torch.Generator().manual_seed(seed)
    edges = torch.randint(0, NUM_NODES - 3, (2, 700), generator=g)
    loops = torch.arange(0, 20).expand(2, -1)
    edge_index = torch.cat([edges, loops, edges[:, :40]], dim=1)
    x = torch.randn(NUM_NODES, NUM_FEATURES, generator=g)
    return GraphData.from_edge_index(edge_index, x, "awkward")


def living_cfg(tmp: Path, cls: str, route: str, kwargs: dict | None = None) -> ServeConfig:
    cfg = ServeConfig.default()
    cfg.graph.update_log_dir = str(tmp / "log")
    cfg.graph.max_new_nodes = 64
    cfg.model.pyg_class = cls  # type: ignore[assignment]
    cfg.model.weights = None
    cfg.model.kwargs = {"hidden_channels": 16, "num_layers": 2, "out_channels": 8,
                        **(kwargs or {})}
    cfg.sampling.fanouts = [3, 2]
    cfg.sampling.route = route  # type: ignore[assignment]
    cfg.sampling.num_cpu_workers = 1 if route == "cpu" else 0
    cfg.sampling.calibration = "off"
    cfg.inference.device = "cpu"
    cfg.server.standby_processes = 0
    return cfg


def run_stream(pipeline: Pipeline, stream: object) -> int:
    writer = pipeline.supervisor.graph_writer  # type: ignore[union-attr]
    assert writer is not None
    version = 0
    for op, expected in zip(stream.ops, stream.expected, strict=True):  # type: ignore[attr-defined]
        if op["op"] == "edges":
            got = writer.add_edges(op.get("add", []), op.get("remove", []))
            assert {k: got[k] for k in ("added", "removed", "missing")} == \
                {k: expected[k] for k in ("added", "removed", "missing")}
        elif op["op"] == "nodes":
            got = writer.add_nodes(op["features"])
            assert got["node_ids"] == expected["node_ids"]
        else:
            got = writer.put_features(op["node_ids"], op["features"])
        version = got["version"]
    return version


def full_graph_rows(cfg: ServeConfig, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
    model = build_model(cfg.model, NUM_FEATURES).eval()
    with torch.no_grad():
        return model(x, edge_index)


@pytest.mark.parametrize(("cls", "kwargs", "route"), [
    ("GraphSAGE", {}, "local"),
    ("GraphSAGE", {}, "cpu"),
    ("GCN", {}, "local"),
    ("GCN", {"add_self_loops": False}, "cpu"),
    ("GAT", {}, "local"),
])
def test_exact_after_updates_equals_pyg_and_survives_a_restart(
        tmp_path: Path, cls: str, kwargs: dict, route: str) -> None:
    base, stream = hold_out(awkward_graph(1), 0.3, seed=2,
                            mix=StreamMix(edges_per_call=40, nodes_every=2, features_every=2))
    cfg = living_cfg(tmp_path, cls, route, kwargs)
    final_x, final_edges = stream.final_x(), stream.final_edge_index()
    want = full_graph_rows(cfg, final_x, final_edges)
    n = stream.final_num_nodes()
    ids = torch.arange(n)
    pipeline = Pipeline(cfg, graph=base).start()
    try:
        version = run_stream(pipeline, stream)
        got = pipeline.embed(ids, exact=True, min_version=version)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    finally:
        pipeline.stop()
    again = Pipeline(cfg, graph=base).start()  # replays the log over the base
    try:
        assert again.supervisor.graph_writer.acked == version  # type: ignore[union-attr]
        torch.testing.assert_close(again.embed(ids, exact=True), want,
                                   atol=1e-5, rtol=1e-5)
    finally:
        again.stop()


def test_a_node_that_lost_every_in_edge_reads_only_its_new_ones(tmp_path: Path) -> None:
    """All in-edges of a node removed and new ones added: its exact row equals the row a fresh
    daemon serves whose base already is the updated graph (the overlay's list replaces the
    base list entirely)."""
    graph = awkward_graph(3)
    cfg = living_cfg(tmp_path, "GraphSAGE", "local")
    target = 5
    old_src = graph.indices[graph.indptr[target]:graph.indptr[target + 1]].unique()
    remove = np.stack([old_src.numpy(), np.full(old_src.numel(), target)], 1)
    add = np.array([[7, target], [8, target], [9, target], [7, target]])
    pipeline = Pipeline(cfg, graph=graph).start()
    try:
        got = pipeline.add_edges(add.tolist(), remove.tolist())
        assert got["removed"] == int(graph.degree()[target]) and got["missing"] == 0
        rows = pipeline.embed(torch.tensor([target, 7]), exact=True, min_version=got["version"])
    finally:
        pipeline.stop()
    ei = graph.edge_index()
    new_ei = torch.cat([ei[:, ei[1] != target], torch.from_numpy(add.T)], dim=1)
    want = full_graph_rows(cfg, graph.x, new_ei)[[target, 7]]
    torch.testing.assert_close(rows, want, atol=1e-5, rtol=1e-5)


def test_compaction_while_serving_moves_every_process_to_the_new_base(tmp_path: Path) -> None:
    """Compact half-way through the stream: the engine core and the CPU sampler move onto the
    new base while serving, then the writer; the overlay empties; answers stay exact."""
    import time

    base, stream = hold_out(awkward_graph(4), 0.4, seed=5,
                            mix=StreamMix(edges_per_call=30, nodes_every=2, features_every=3))
    cfg = living_cfg(tmp_path, "GraphSAGE", "cpu")
    cfg.graph.compact_interval_s = 0
    half = len(stream.ops) // 2
    pipeline = Pipeline(cfg, graph=base).start()
    try:
        writer = pipeline.supervisor.graph_writer  # type: ignore[union-attr]
        run_ops(writer, stream.ops[:half])
        used_before = writer.overlay.top
        done = writer.compact()
        assert done["compacted"]
        deadline = time.monotonic() + 30
        while writer.base_version != done["version"] and time.monotonic() < deadline:
            pipeline.embed(torch.arange(4))  # keeps the engine stepping
            time.sleep(0.2)
        assert writer.base_version == done["version"], "the writer never moved to the new base"
        assert writer.overlay.top < used_before
        version = run_ops(writer, stream.ops[half:])
        want = full_graph_rows(cfg, stream.final_x(), stream.final_edge_index())
        got = pipeline.embed(torch.arange(stream.final_num_nodes()), exact=True,
                             min_version=version)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert writer.acked == version
    finally:
        pipeline.stop()


def run_ops(writer: object, ops: list[dict]) -> int:
    version = 0
    for op in ops:
        if op["op"] == "edges":
            got = writer.add_edges(op.get("add", []), op.get("remove", []))  # type: ignore[attr-defined]
        elif op["op"] == "nodes":
            got = writer.add_nodes(op["features"])  # type: ignore[attr-defined]
        else:
            got = writer.put_features(op["node_ids"], op["features"])  # type: ignore[attr-defined]
        version = got["version"]
    return version


KILL_SCRIPT = r'''
import json, sys, torch
from pathlib import Path
from quiver_serve.config import ServeConfig
from quiver_serve.engine.client.pipeline import Pipeline
from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.stream import StreamMix, hold_out
sys.path.insert(0, sys.argv[2])
from tests.engine.test_living_graph import awkward_graph, living_cfg
base, stream = hold_out(awkward_graph(6), 0.5, seed=7, mix=StreamMix(edges_per_call=10))
cfg = living_cfg(Path(sys.argv[1]), "GraphSAGE", "cpu")
p = Pipeline(cfg, graph=base).start()
w = p.supervisor.graph_writer
for op in stream.ops:
    if op["op"] == "edges":
        got = w.add_edges(op.get("add", []), op.get("remove", []))
    elif op["op"] == "nodes":
        got = w.add_nodes(op["features"])
    else:
        got = w.put_features(op["node_ids"], op["features"])
    print(json.dumps(got["version"]), flush=True)
print("done", flush=True)
import time; time.sleep(60)
'''


def test_kill_9_of_the_whole_daemon_loses_no_acknowledged_update(tmp_path: Path) -> None:
    """The daemon (main process, engine core, CPU sampler) is killed with SIGKILL right after
    some acknowledgements; a restart on the same log has every acknowledged version, and serves
    exactly the graph of the last one."""
    import os
    import signal
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(tmp_path), str(root)],
                            stdout=subprocess.PIPE, text=True, cwd=root, start_new_session=True)
    acked = []
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == "done":
            break
        acked.append(int(line))
        if len(acked) == 7:
            break
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert len(acked) >= 7
    base, stream = hold_out(awkward_graph(6), 0.5, seed=7, mix=StreamMix(edges_per_call=10))
    cfg = living_cfg(tmp_path, "GraphSAGE", "cpu")
    again = Pipeline(cfg, graph=base).start()
    try:
        writer = again.supervisor.graph_writer  # type: ignore[union-attr]
        assert writer.acked >= acked[-1]  # nothing acknowledged is lost
        # the graph served is the stream's prefix up to the recovered version
        edge_index, x = base.edge_index(), base.x
        from quiver_serve.graph.stream import apply_reference

        for op in stream.ops[:writer.acked]:
            edge_index, x, _ = apply_reference(edge_index, x, op)
        want = full_graph_rows(cfg, x, edge_index)
        got = again.embed(torch.arange(x.size(0)), exact=True)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    finally:
        again.stop()


def test_updates_under_concurrent_load_lose_no_request(tmp_path: Path) -> None:
    """Sampled and exact requests in flight from many coroutines while updates (edges, nodes,
    features) are acknowledged: every request is answered with its rows, none fails."""
    import asyncio
    import threading

    base, stream = hold_out(awkward_graph(10), 0.5, seed=11,
                            mix=StreamMix(edges_per_call=8, nodes_every=3, features_every=3))
    cfg = living_cfg(tmp_path, "GraphSAGE", "cpu")
    pipeline = Pipeline(cfg, graph=base).start()
    errors_seen: list[BaseException] = []
    try:
        writer = pipeline.supervisor.graph_writer  # type: ignore[union-attr]

        def update() -> None:
            try:
                run_ops(writer, stream.ops)
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                errors_seen.append(exc)

        updater = threading.Thread(target=update)
        updater.start()

        async def load() -> list[torch.Tensor]:
            gen = torch.Generator().manual_seed(0)
            calls = [pipeline.embed_async(torch.randint(0, base.num_nodes, (int(n),), generator=gen),
                                          exact=bool(i % 3 == 0))
                     for i, n in enumerate(torch.randint(1, 12, (300,), generator=gen))]
            return await asyncio.gather(*calls)

        rows = asyncio.run(load())
        updater.join(timeout=120)
        assert not errors_seen and not updater.is_alive()
        assert len(rows) == 300 and all(r.shape[1] == 8 and torch.isfinite(r).all() for r in rows)
        assert writer.acked == len(stream.ops)
    finally:
        pipeline.stop()


def test_two_engine_cores_apply_the_same_versions(tmp_path: Path) -> None:
    """With two engine cores (the layout of two GPUs, here on the CPU), requests spread over
    both after a stream of updates: every answer is exact, and both report the last version."""
    import time

    base, stream = hold_out(awkward_graph(12), 0.3, seed=13,
                            mix=StreamMix(edges_per_call=40, nodes_every=2, features_every=2))
    cfg = living_cfg(tmp_path, "GCN", "local")
    cfg.inference.num_workers = 2
    want = full_graph_rows(cfg, stream.final_x(), stream.final_edge_index())
    pipeline = Pipeline(cfg, graph=base).start()
    try:
        writer = pipeline.supervisor.graph_writer  # type: ignore[union-attr]
        version = run_ops(writer, stream.ops)
        for _ in range(4):  # several requests: the client spreads them over both cores
            got = pipeline.embed(torch.arange(stream.final_num_nodes()), exact=True,
                                 min_version=version)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            engines = writer.info(2)["engines"]
            if all(e["version"] == version for e in engines):
                break
            time.sleep(0.05)
        assert [e["version"] for e in engines] == [version, version]
    finally:
        pipeline.stop()


def test_kill_9_of_the_engine_core_during_a_table_refresh(tmp_path: Path) -> None:
    """The exact table (docs/architecture.md, "The exact table") is refreshing after a burst of
    updates when its engine core is killed with SIGKILL: the restarted core rebuilds it over the
    replayed log, and exact answers (from the table) equal PyG's on the acknowledged graph."""
    import os
    import signal
    import time

    base, stream = hold_out(awkward_graph(14), 0.3, seed=15,
                            mix=StreamMix(edges_per_call=40, nodes_every=2, features_every=2))
    cfg = living_cfg(tmp_path, "GAT", "local")
    cfg.exact.materialize = "on"
    cfg.exact.refresh_interval_ms = 50.0  # the kill lands while marks wait for a round
    want = full_graph_rows(cfg, stream.final_x(), stream.final_edge_index())
    pipeline = Pipeline(cfg, graph=base).start()
    try:
        writer = pipeline.supervisor.graph_writer  # type: ignore[union-attr]
        version = run_ops(writer, stream.ops)
        handle = pipeline.supervisor.engines[0]  # type: ignore[union-attr]
        victim = handle.pid
        os.kill(victim, signal.SIGKILL)
        end = time.monotonic() + 60
        while (handle.pid == victim or not handle.ready) and time.monotonic() < end:
            time.sleep(0.05)
        assert handle.pid != victim, "the engine core was not restarted"
        n = stream.final_num_nodes()
        got = pipeline.embed(torch.arange(n), exact=True, min_version=version)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        table = pipeline.graph_info()["engines"][0]["exact_table"]
        assert table is not None and table["version"] == version and table["stale_rows"] == 0
    finally:
        pipeline.stop()

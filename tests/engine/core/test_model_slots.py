"""Several models and versions in one engine core (docs/architecture.md, "Models and versions"),
driven directly: resolution and traffic splits, loads built beside serving, failed loads, drains,
and memory across cycles."""

from __future__ import annotations

import gc
import resource
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch_geometric.nn import models as pyg_models

from quiver_serve.engine.core.core import EngineCore, MicroBatch
from quiver_serve.engine.core.model_slots import DRAINING, ModelSlot, ModelTable, Refusal
from quiver_serve.graph.csc import GraphData
from quiver_serve.models.served import ServedModel
from quiver_serve.models.spec import ModelSpec
from tests.engine.core.test_engine_core import make_core, mb, run

SAGE_KW = {"hidden_channels": 128, "num_layers": 2, "out_channels": 64}
GAT_KW = {"hidden_channels": 16, "num_layers": 2, "out_channels": 32, "heads": 2}


def spec(name: str, version: int, cls: str, kwargs: dict, weights: Path | None = None,
         **extra: object) -> ModelSpec:
    return ModelSpec(name, version, cls, dict(kwargs), int(kwargs.get("num_layers", 2)),
                     weights=str(weights) if weights is not None else None,
                     random_init_seed=version, **extra)  # type: ignore[arg-type]


def save_weights(tmp_path: Path, cls: str, kwargs: dict, in_channels: int, seed: int,
                 nan: bool = False) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(seed)
    model = getattr(pyg_models, cls)(in_channels=in_channels, **kwargs).eval()
    state = model.state_dict()
    if nan:
        first = next(k for k, v in state.items() if v.is_floating_point())
        state[first] = state[first].clone()
        state[first][0] = float("nan")
    path = tmp_path / f"{cls}-{seed}{'-nan' if nan else ''}.pt"
    torch.save(state, path)
    return path, model


def load(core: EngineCore, s: ModelSpec, timeout_s: float = 60.0) -> tuple[dict | None, str | None]:
    """Start a load and step the core until it answers."""
    out: list[tuple[dict | None, str | None]] = []
    core.loads.load(s, lambda result, error: out.append((result, error)))
    end = time.monotonic() + timeout_s
    while not out and time.monotonic() < end:
        core.step()
        time.sleep(0.001)
    assert out, "the load did not answer"
    return out[0]


def pinned(seq: int, ids: list[int], model: str = "", version: int = 0,
           exact: bool = False) -> MicroBatch:
    m = mb(seq, [ids], exact=exact)
    m.model, m.version = model, version
    return m


# ---- resolution and splits -------------------------------------------------------------------------
def _slot(name: str, version: int) -> ModelSlot:
    served = ServedModel(pyg_models.GraphSAGE(4, 8, 1, 2).eval())
    return ModelSlot(spec(name, version, "GraphSAGE", {"num_layers": 1}), served, [3])


def test_resolution_names_what_is_missing() -> None:
    table = ModelTable("sage")
    for v in (1, 2):
        table.add(_slot("sage", v))
    assert table.resolve("", 0, 1).version == 2  # no split set: the newest
    assert table.resolve("sage", 1, 1).version == 1
    missing = table.resolve("gat", 0, 1)
    assert isinstance(missing, Refusal) and missing.status == 404 and "'gat'" in missing.message
    gone = table.resolve("sage", 7, 1)
    assert isinstance(gone, Refusal) and gone.code == "model_version_not_found" \
        and "[1, 2]" in gone.message
    table.get("sage", 1).state = DRAINING  # type: ignore[union-attr]
    draining = table.resolve("sage", 1, 1)
    assert isinstance(draining, Refusal) and draining.status == 503


@pytest.mark.parametrize("weights", [{1: 0.9, 2: 0.1}, {1: 0.5, 2: 0.5}, {1: 0.99, 2: 0.01}])
def test_a_canary_split_of_10k_requests_is_within_2_percent_of_its_weights(
        weights: dict[int, float]) -> None:
    table = ModelTable("sage")
    for v in (1, 2):
        table.add(_slot("sage", v))
    table.set_traffic("sage", weights)
    rng = np.random.default_rng(0)
    got = {1: 0, 2: 0}
    total = 0
    while total < 10_000:
        n = int(rng.integers(1, 65))  # requests per micro-batch, as front-end ticks make them
        slot = table.resolve("sage", 0, n)
        assert isinstance(slot, ModelSlot)
        got[slot.version] += n
        total += n
    for v, w in weights.items():
        assert abs(got[v] / total - w) <= 0.02, (got, weights)


# ---- several models in one core ------------------------------------------------------------------
def test_two_models_over_one_graph_each_equal_their_own_full_graph_output(
        cora: GraphData, tmp_path: Path) -> None:
    core = make_core(cora, exact__materialize="off")
    path, gat = save_weights(tmp_path, "GAT", GAT_KW, cora.num_features, 3)
    result, error = load(core, spec("gat", 1, "GAT", GAT_KW, path))
    assert error is None and result is not None and result["dim"] == 32
    ids = [0, 5, 2707, 1200]
    replies = run(core, pinned(0, ids, "gat", exact=True), pinned(1, ids, exact=True))
    with torch.no_grad():
        want_gat = gat(cora.x, cora.edge_index())[ids]
    gat_reply = replies[0]
    assert (gat_reply.done.model, gat_reply.done.version) == ("gat", 1)
    np.testing.assert_allclose(gat_reply.rows, want_gat.numpy(), atol=1e-4, rtol=1e-4)
    sage_reply = replies[1]
    assert sage_reply.done.model == core.primary.name and sage_reply.rows.shape == (4, 64)


def test_sampled_answers_of_a_second_model_equal_a_core_serving_it_alone(
        cora: GraphData, tmp_path: Path) -> None:
    path, _ = save_weights(tmp_path, "GAT", GAT_KW, cora.num_features, 4)
    s = spec("gat", 1, "GAT", GAT_KW, path)
    shared = make_core(cora, exact__materialize="off")
    assert load(shared, s)[1] is None
    alone = make_core(cora, exact__materialize="off")
    alone.models.remove(alone.primary)
    assert load(alone, s)[1] is None
    ids = [3, 17, 400, 2500]
    a = mb(0, [ids], seed=1234)
    a.model = "gat"
    b = mb(0, [ids], seed=1234)
    b.model = "gat"
    np.testing.assert_allclose(run(shared, a)[0].rows, run(alone, b)[0].rows, atol=1e-5)


def test_a_failed_load_names_the_cause_and_the_old_version_keeps_serving(
        cora: GraphData, tmp_path: Path) -> None:
    core = make_core(cora, exact__materialize="off")
    name = core.primary.name
    before = run(core, pinned(0, [1, 2], exact=True))[0].rows
    nan_path, _ = save_weights(tmp_path, "GraphSAGE", SAGE_KW, cora.num_features, 1, nan=True)
    cases = {
        "NaN": spec(name, 2, "GraphSAGE", SAGE_KW, nan_path),
        "not exist": spec(name, 3, "GraphSAGE", SAGE_KW, tmp_path / "missing.pt"),
        "size mismatch": spec(name, 4, "GraphSAGE", {**SAGE_KW, "hidden_channels": 64},
                              save_weights(tmp_path, "GraphSAGE", SAGE_KW,
                                           cora.num_features, 2)[0]),
        "no_such_module": spec(name, 5, "no_such_module:Model", {"num_layers": 2}),
    }
    for word, s in cases.items():
        result, error = load(core, s)
        assert result is None and error is not None and word.lower() in error.lower(), error
        assert core.models.get(name, s.version) is None
    after = run(core, pinned(1, [1, 2], exact=True))[1]
    assert after.done.version == 1 and not after.done.errors
    np.testing.assert_array_equal(before, after.rows)


def test_unload_drains_in_flight_requests_on_their_version(cora: GraphData,
                                                           tmp_path: Path) -> None:
    core = make_core(cora, exact__materialize="off")
    name = core.primary.name
    path, _ = save_weights(tmp_path, "GraphSAGE", SAGE_KW, cora.num_features, 9)
    assert load(core, spec(name, 2, "GraphSAGE", SAGE_KW, path))[1] is None
    core.models.set_traffic(name, {2: 1.0})
    queued = [pinned(i, [i, i + 1], name, 1) for i in range(4)]
    for m in queued:
        assert core.add(m) is None
    released: list[dict | None] = []
    core.loads.unload(name, 1, lambda result, error: released.append(result))
    late = core.add(pinned(99, [1], name, 1))
    assert late is not None and late.done.errors[0].status == 503  # draining: nothing new
    replies: dict[int, object] = {}
    end = time.monotonic() + 30
    while (len(replies) < 4 or not released) and time.monotonic() < end:
        for r in core.step():
            replies[r.done.seq] = r
    assert released and released[0]["released"]
    assert all(replies[m.seq].done.version == 1 and not replies[m.seq].done.errors  # type: ignore[attr-defined]
               for m in queued)
    assert core.models.get(name, 1) is None
    unpinned = run(core, pinned(100, [4]))[100]
    assert unpinned.done.version == 2


def cycle(core: EngineCore, name: str, version: int, path: Path) -> None:
    """Load ``version``, answer one request pinned to it, unload it."""
    assert load(core, spec(name, version, "GraphSAGE", SAGE_KW, path))[1] is None
    assert run(core, pinned(version, [1, 2, 3], name, version))[version].done.version == version
    done: list[object] = []
    core.loads.unload(name, version, lambda r, e: done.append(r))
    while not done:
        core.step()


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def test_load_unload_cycles_leave_host_memory_flat(cora: GraphData, tmp_path: Path) -> None:
    core = make_core(cora, exact__materialize="off")
    name = core.primary.name
    path, _ = save_weights(tmp_path, "GraphSAGE", SAGE_KW, cora.num_features, 5)

    for v in range(2, 12):  # warm: allocator pools, lazy imports
        cycle(core, name, v, path)
    gc.collect()
    start = _rss_mb()
    for v in range(12, 112):
        cycle(core, name, v, path)
    gc.collect()
    grown = _rss_mb() - start
    assert grown < 40, f"host memory grew {grown:.1f} MiB over 100 load/unload cycles"
    assert [s.version for s in core.models.each()] == [1]
    assert core.loads._thread is not None and core.loads._thread.is_alive()  # one, reused


@pytest.mark.gpu
def test_gpu_loads_beside_serving_and_cycles_leave_gpu_memory_and_threads_flat(
        cora: GraphData, tmp_path: Path) -> None:
    """On the GPU: a version built (CUDA graphs captured thread-locally) while the core serves
    answers every request; 100 load/unload cycles leave device memory, CUDA graphs and threads
    where they were."""
    import threading

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    core = make_core(cora, "cuda", exact__materialize="off")
    name = core.primary.name
    path, _ = save_weights(tmp_path, "GraphSAGE", SAGE_KW, cora.num_features, 5)
    out: list[tuple[dict | None, str | None]] = []
    core.loads.load(spec(name, 2, "GraphSAGE", SAGE_KW, path), lambda r, e: out.append((r, e)))
    seq = 0
    while not out:  # serve while the new version builds
        reply = run(core, pinned(seq, [seq % 2000, 7], name))[seq]
        assert not reply.done.errors and reply.done.version == 1
        seq += 1
    assert out[0][1] is None and out[0][0]["cuda_graphs"] > 0, out[0]
    assert run(core, pinned(seq, [1, 2], name, 2))[seq].done.version == 2

    for v in range(3, 13):
        cycle(core, name, v, path)
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    threads = threading.active_count()
    for v in range(13, 113):
        cycle(core, name, v, path)
    torch.cuda.synchronize()
    grown_mb = (torch.cuda.memory_allocated() - allocated) / 2**20
    assert grown_mb < 1, f"GPU memory allocated grew {grown_mb:.1f} MiB over 100 cycles"
    assert torch.cuda.memory_reserved() <= reserved + (8 << 20)
    assert threading.active_count() <= threads


def test_the_exact_table_follows_a_new_version_of_its_model(cora: GraphData,
                                                            tmp_path: Path) -> None:
    """A new version of the table's model is loaded with a table of its own (built beside
    serving); when it takes the traffic the tables swap, and exact answers come from the new
    table."""
    core = make_core(cora, exact__materialize="on")
    name = core.primary.name
    old_table = core.exact_table
    path, model = save_weights(tmp_path, "GraphSAGE", SAGE_KW, cora.num_features, 11)
    result, error = load(core, spec(name, 2, "GraphSAGE", SAGE_KW, path))
    assert error is None
    end = time.monotonic() + 60
    while core.loads.building and time.monotonic() < end:
        core.step()
    assert "exact_table_s" in core.models.get(name, 2).load_s
    assert core.exact_table is old_table  # v2 has no traffic yet: v1 keeps the table
    core.models.set_traffic(name, {2: 1.0})
    core.loads.follow_table(name)
    assert core.exact_table is not old_table and core.exact_table.model.served \
        is core.models.get(name, 2).served and core.updates_held == 0
    reply = run(core, pinned(0, [0, 5, 2707], exact=True))[0]
    assert reply.done.version == 2 and reply.done.stats.route == "table"
    with torch.no_grad():
        want = model(cora.x, cora.edge_index())[[0, 5, 2707]]
    np.testing.assert_allclose(reply.rows, want.numpy(), atol=1e-4, rtol=1e-4)
    pinned_v1 = run(core, pinned(1, [0, 5], name, 1, exact=True))[1]
    assert pinned_v1.done.version == 1 and pinned_v1.done.stats.route != "table"


def test_an_unload_during_the_build_cancels_the_load(cora: GraphData, tmp_path: Path) -> None:
    """The main process gave up on a slow load and unloads it: the version never serves."""
    core = make_core(cora, exact__materialize="off")
    name = core.primary.name
    path, _ = save_weights(tmp_path, "GraphSAGE", SAGE_KW, cora.num_features, 12)
    loaded: list[tuple[object, object]] = []
    unloaded: list[tuple[object, object]] = []
    core.loads.load(spec(name, 2, "GraphSAGE", SAGE_KW, path), lambda r, e: loaded.append((r, e)))
    core.loads.unload(name, 2, lambda r, e: unloaded.append((r, e)))
    assert unloaded and unloaded[0][1] is None
    end = time.monotonic() + 30
    while not loaded and time.monotonic() < end:
        core.step()
        time.sleep(0.001)
    assert loaded and loaded[0][0] is None and "cancelled" in str(loaded[0][1])
    assert core.models.get(name, 2) is None


@pytest.mark.parametrize("num_layers", [2, 3])
def test_a_custom_model_by_import_path_is_served_and_exact_equals_pyg(
        cora: GraphData, tmp_path: Path, num_layers: int) -> None:
    """A user's own MessagePassing model (``tests/models/custom_gnn.py``), named by import path,
    loaded beside the default model: exact answers (the full L-hop subgraph, on the fly: no
    table for it) equal its full-graph output to 1e-5."""
    from tests.models.custom_gnn import WeightedGIN

    torch.manual_seed(num_layers)
    model = WeightedGIN(cora.num_features, 32, 16, num_layers=num_layers).eval()
    path = tmp_path / "gin.pt"
    torch.save(model.state_dict(), path)
    core = make_core(cora, exact__materialize="on")
    kwargs = {"hidden_channels": 32, "out_channels": 16, "num_layers": num_layers}
    s = ModelSpec("gin", 1, "tests.models.custom_gnn:WeightedGIN", kwargs, num_layers,
                  fanouts=[5] * num_layers, weights=str(path))
    result, error = load(core, s)
    assert error is None and result["dim"] == 16 and not result["fast_layers"]
    ids = [0, 5, 2707, 1200, 5]
    reply = run(core, pinned(0, ids, "gin", exact=True))[0]
    assert (reply.done.model, reply.done.version) == ("gin", 1)
    with torch.no_grad():
        want = model(cora.x, cora.edge_index())[ids]
    np.testing.assert_allclose(reply.rows, want.numpy(), atol=1e-5, rtol=1e-5)
    sampled = run(core, pinned(1, ids, "gin"))[1]  # its own fanouts, the generic forward
    assert not sampled.done.errors and np.isfinite(sampled.rows).all()


def test_a_gcn_loaded_later_normalises_by_the_graph_degrees(cora: GraphData,
                                                            tmp_path: Path) -> None:
    kwargs = {"hidden_channels": 16, "num_layers": 2, "out_channels": 8}
    path, gcn = save_weights(tmp_path, "GCN", kwargs, cora.num_features, 13)
    core = make_core(cora, exact__materialize="off")
    assert load(core, spec("gcn", 1, "GCN", kwargs, path))[1] is None
    assert core.updates_held == 0  # the hold for reading degrees was given back at install
    ids = [0, 5, 2707, 1200]
    reply = run(core, pinned(0, ids, "gcn", exact=True))[0]
    with torch.no_grad():
        want = gcn(cora.x, cora.edge_index())[ids]
    np.testing.assert_allclose(reply.rows, want.numpy(), atol=1e-4, rtol=1e-4)

"""PSGS (per-node tables, union-aware batch estimate), the cost model, the router and their metrics.

Accuracy is checked against the measured mean unique node count of real samples (C++ sampler) on
Cora, a generated heterophilous graph and a synthetic power-law graph, at 1, 48 and 512 seeds.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from quiver_serve.config import GraphConfig
from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.synthetic import generate_synthetic
from quiver_serve.messages import BatchStats
from quiver_serve.routing import psgs
from quiver_serve.routing.cost import CostModel, cost_key
from quiver_serve.routing.router import EngineRouter, EngineRouteState
from quiver_serve.sampling import make_cpu_sampler
from tests.conftest import small_config

FANOUTS = [25, 10]
TOLOKERS = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "heterophilous" / \
    "tolokers.npz"


def heterophilous_graph(num_nodes: int = 3000, seed: int = 0) -> GraphData:
    """Edges mostly between nodes of different classes, heavy-tailed degrees (as Tolokers),
    both directions, a few self loops."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, num_nodes)
    weight = rng.pareto(1.8, num_nodes) + 1.0
    p = weight / weight.sum()
    src = rng.choice(num_nodes, 60_000, p=p)
    dst = rng.choice(num_nodes, 60_000, p=p)
    keep = (y[src] != y[dst]) | (rng.random(src.size) < 0.1)  # heterophily: ~90% cross-class
    src, dst = src[keep], dst[keep]
    edges = np.concatenate([np.stack([src, dst]), np.stack([dst, src]), [[5, 9], [5, 9]]], 1)
    x = torch.zeros(num_nodes, 4)
    return GraphData.from_edge_index(torch.from_numpy(edges), x, "hetero", torch.from_numpy(y))


def power_law_graph() -> GraphData:
    return generate_synthetic(GraphConfig(format="synthetic", synthetic_preset="custom",
                                          synthetic_num_nodes=5000, synthetic_num_edges=100_000,
                                          synthetic_num_features=4))


def mean_abs_rel_error(graph: GraphData, table: psgs.PsgsTable, size: int,
                       batches: int = 8, draws: int = 4) -> float:
    sampler = make_cpu_sampler(graph.indptr, graph.indices)
    rng = np.random.default_rng(size)
    errs = []
    for _ in range(batches):
        seeds = rng.integers(0, graph.num_nodes, size, dtype=np.int64)
        measured = np.mean([sampler.sample(torch.from_numpy(seeds), FANOUTS,
                                           int(rng.integers(0, 2**62))).num_nodes
                            for _ in range(draws)])
        errs.append(abs(table.estimate(seeds) - measured) / measured)
    return float(np.mean(errs))


def build_table(graph: GraphData) -> psgs.PsgsTable:
    table = psgs.load_or_build(graph.indptr, graph.indices, FANOUTS, rounds=8, use_cache=False,
                               progress=False)
    psgs.calibrate_union(table, make_cpu_sampler(graph.indptr, graph.indices))
    return table


GRAPHS = {"cora": None, "heterophilous": heterophilous_graph, "power_law": power_law_graph}


@pytest.mark.parametrize("name", list(GRAPHS))
def test_batch_estimate_within_10_percent_of_measured(name: str, cora: GraphData) -> None:
    graph = cora if name == "cora" else GRAPHS[name]()
    table = build_table(graph)
    for size in (1, 48, 512):
        err = mean_abs_rel_error(graph, table, size)
        assert err <= 0.10, f"{name} at {size} seeds: mean |relative error| {err:.3f}"
    # the plain sum of per-node sizes (what a union-blind estimate does) is far off at 512
    seeds = np.random.default_rng(0).integers(0, graph.num_nodes, 512)
    plain, _ = table.estimate_parts(seeds)
    assert plain > 1.5 * table.estimate(seeds)


@pytest.mark.skipif(not TOLOKERS.exists(), reason="no shared data folder beside the checkout")
def test_batch_estimate_on_tolokers() -> None:
    from quiver_serve.graph.datasets import load_npz

    graph = load_npz(TOLOKERS, "tolokers")
    table = build_table(graph)
    for size in (1, 48, 512):
        assert mean_abs_rel_error(graph, table, size, batches=4, draws=2) <= 0.10


def test_one_seed_is_its_table_entry_and_repeats_count_once(cora: GraphData) -> None:
    table = build_table(cora)
    v = int(np.argmax(cora.degree().numpy()))
    assert table.estimate(np.array([v])) == pytest.approx(float(table.mean_size[v]), rel=1e-6)
    many = np.array([3, 3, 3, 10, 10])
    assert table.estimate(many) == pytest.approx(table.estimate(np.array([3, 10])))
    assert table.quiver_sum(many) == 3 * table.one_draw[3] + 2 * table.one_draw[10]


def test_psgs_table_is_cached_by_graph_fanouts_and_version(cora: GraphData, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(psgs, "cache_dir", lambda: tmp_path)
    calls = []
    real = psgs.node_sample_sizes
    monkeypatch.setattr(psgs, "node_sample_sizes", lambda *a, **k: calls.append(a) or real(*a, **k))
    a = psgs.load_or_build(cora.indptr, cora.indices, FANOUTS, rounds=2, progress=False)
    b = psgs.load_or_build(cora.indptr, cora.indices, FANOUTS, rounds=2, progress=False)
    assert len(calls) == 1 and np.array_equal(a.mean_size, b.mean_size)
    psgs.load_or_build(cora.indptr, cora.indices, [5, 5], rounds=2, progress=False)
    edited = cora.indices.clone()
    edited[::97] = (edited[::97] + 1) % cora.num_nodes
    assert psgs.graph_key(cora.indptr, edited) != psgs.graph_key(cora.indptr, cora.indices)
    psgs.load_or_build(cora.indptr, edited, FANOUTS, rounds=2, progress=False)
    monkeypatch.setattr(psgs, "PSGS_VERSION", psgs.PSGS_VERSION + 1)
    psgs.load_or_build(cora.indptr, cora.indices, FANOUTS, rounds=2, progress=False)
    assert len(calls) == 4  # new fanouts, a changed graph, a new version: recomputed


# ---- router decisions over a hand-written cost model --------------------------------------------
def hand_model() -> CostModel:
    """local: 20 us + 1 us/node; pool: 200 us + 1 us/node; GPU: 100 us + 0.01 us/node."""
    return CostModel({"local": (2e-5, 1e-6), "cpu": (2e-4, 1e-6), "gpu": (1e-4, 1e-8)},
                     compute=(1e-3, 1e-7))


def decide(mode: str = "auto", **kw: object) -> str:
    base: dict = {"num_seeds": 48, "waiting_micro_batches": 0, "pool_outstanding": [0, 0],
                  "on_gpu": True}
    router = EngineRouter(mode, hand_model(), quiver_threshold=800)
    return router.decide(EngineRouteState(**{**base, **kw})).route


def test_auto_sends_each_batch_to_the_path_predicted_to_finish_first() -> None:
    assert decide(psgs=10) == "local"  # 30 us here vs 100 us on the GPU
    assert decide(psgs=500) == "gpu"  # 520 us here vs 105 us on the GPU
    assert decide(psgs=79) == "local" and decide(psgs=82) == "gpu"  # the crossover at ~81 nodes
    # nothing waits: the pool's hop makes it last; much waits: the engine thread is the queue
    assert decide(psgs=50, on_gpu=False) == "local"
    assert decide(psgs=50, on_gpu=False, waiting_batches=8) == "cpu"
    # ... unless the pool's own queue is longer
    assert decide(psgs=50, on_gpu=False, waiting_batches=8, pool_queued_s=[1.0, 1.0]) == "local"
    assert decide(psgs=50, on_gpu=False, waiting_batches=8, pool_outstanding=[2, 2]) == "local"


def test_fixed_modes_and_torch_quivers_rule() -> None:
    assert decide("gpu", psgs=1) == "gpu" and decide("local", psgs=1e6) == "local"
    assert decide("cpu", psgs=1e6) in ("local", "cpu")
    assert decide("cpu", psgs=1e6, waiting_batches=4) == "cpu"
    assert decide("quiver", quiver_size=799, psgs=1e5) == "cpu"  # under the threshold: CPU
    assert decide("quiver", quiver_size=800, psgs=1) == "gpu"
    assert decide("quiver", quiver_size=10, pool_outstanding=[]) == "local"  # no pool
    with pytest.raises(ValueError, match="quiver"):
        EngineRouter("fastest")


def test_auto_on_a_cpu_only_engine_is_cpu_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    router = EngineRouter("auto", hand_model())
    state = EngineRouteState(48, 0, [0], on_gpu=False, psgs=1e6)
    with caplog.at_level(logging.INFO):
        routes = {router.decide(state).route for _ in range(3)}
    assert routes <= {"local", "cpu"}
    assert caplog.text.count("auto is cpu") == 1
    assert router.paths(on_gpu=False, has_pool=True) == ("local", "cpu")
    assert router.paths(on_gpu=True, has_pool=False) == ("local", "gpu")


def test_cost_model_sizes_batches_to_the_deadline() -> None:
    model = hand_model()
    # local: 1 ms + 20 us + 1.1 us/node; GPU: 1.1 ms + 0.11 us/node -> GPU allows far more
    assert model.max_psgs_within(5e-3, ("local",)) == pytest.approx((5e-3 - 1.02e-3) / 1.1e-6)
    assert model.max_psgs_within(5e-3, ("local", "gpu")) == pytest.approx((5e-3 - 1.1e-3) / 1.1e-7)


# ---- the measured curve: predictions where a line cannot follow --------------------------------
#: the gather + model time of a Cora batch on a 2-vCPU box, by sampled nodes (ms): the time per
#: node jumps 2.7x between 862 and 1,766 nodes, where the gathered features leave the cache
CLIFF = [(21, 0.227), (70, 0.295), (247, 0.507), (651, 1.275), (862, 1.781), (1766, 9.769),
         (2492, 12.515)]


def cliff_model() -> CostModel:
    from quiver_serve.routing.cost import fit_line

    points = [(x, ms * 1e-3) for x, ms in CLIFF]
    return CostModel({"local": (0.0, 0.0)}, compute=fit_line(points), x_range=(21.0, 2492.0),
                     points={"compute": points})


def test_predictions_follow_the_calibrated_curve_where_a_line_misses() -> None:
    from quiver_serve.routing.cost import fit_line

    model = cliff_model()
    a, b = fit_line([(x, ms * 1e-3) for x, ms in CLIFF])
    line_err = [abs((a + b * x) / (ms * 1e-3) - 1) for x, ms in CLIFF]
    curve_err = [abs(model.compute.predict_s(x) / (ms * 1e-3) - 1) for x, ms in CLIFF]
    assert max(line_err) > 0.5  # the line is off by half or more somewhere
    assert max(curve_err) < 0.01
    # between points: on the segment; past the largest: the line's slope from the last point
    mid = model.compute.predict_s((862 + 1766) / 2)
    assert mid == pytest.approx((1.781 + 9.769) / 2 * 1e-3, rel=1e-6)
    far = model.compute.predict_s(4492)
    assert far == pytest.approx(12.515e-3 + model.compute.per_seed_s * 2000, rel=1e-6)
    # below the smallest: the line's shape, scaled to the smallest point (positive, smaller)
    assert 0 < model.compute.predict_s(1) <= model.compute.predict_s(21)


def test_measured_batches_move_only_their_own_size() -> None:
    model = cliff_model()
    before = {x: model.compute.predict_s(x) for x, _ in CLIFF}
    for _ in range(40):  # one-node-class batches twice as slow as calibrated
        model.observe_compute(70, 0.59e-3)
    assert model.compute.predict_s(70) == pytest.approx(0.59e-3, rel=0.02)
    for x in (651, 862, 1766, 2492):  # another bucket's point is untouched
        assert model.compute.predict_s(x) == pytest.approx(before[x], rel=1e-9)
    # one stalled batch moves its size's point by at most the clip, and a few batches undo it
    model.observe_compute(651, 10.0)
    assert model.compute.predict_s(651) < before[651] * 2
    for _ in range(30):
        model.observe_compute(651, 1.275e-3)
    assert model.compute.predict_s(651) == pytest.approx(1.275e-3, rel=0.02)


def test_batch_sizing_inverts_the_curve() -> None:
    model = cliff_model()
    # local sampling is free here: the compute curve alone meets the budget
    for budget_ms in (0.3, 1.0, 1.781, 5.0, 12.0):
        x = model.max_psgs_within(budget_ms * 1e-3, ("local",))
        assert model.compute.predict_s(x) <= budget_ms * 1e-3 * (1 + 1e-9)
        assert model.compute.predict_s(x * 1.02) > budget_ms * 1e-3
    assert model.max_psgs_within(1e-5, ("local",)) == 0.0  # not even one node in 10 us
    seeds = model.compute  # the seed-count model the engine sizes CPU-only batches with
    assert seeds.max_seeds_within(1.781e-3, cap=4096) == pytest.approx(862, abs=2)
    assert seeds.max_seeds_within(1.0, cap=4096) == 4096
    assert seeds.max_seeds_within(0.0, cap=4096) == 1


# ---- calibration: save, reload when the key matches, recalibrate when not ----------------------
def test_cost_model_round_trips_and_is_refused_for_another_key(tmp_path: Path) -> None:
    key = cost_key("g1", FANOUTS, "cpu")
    model = hand_model()
    model.key = key
    path = tmp_path / "cost.json"
    model.save(path)
    again = CostModel.load(path, key)
    assert again is not None and again.key == key
    for name, line in model.to_dict()["paths"].items():
        assert again.to_dict()["paths"][name] == pytest.approx(line, rel=1e-6, abs=1e-12)
    curved = cliff_model()
    curved.key = key
    curved.save(path)
    again = CostModel.load(path, key)
    assert again is not None
    for x, _ in CLIFF:  # the calibrated points come back: the same curve
        assert again.compute.predict_s(x) == pytest.approx(curved.compute.predict_s(x), rel=1e-9)
    for other in (cost_key("g2", FANOUTS, "cpu"), cost_key("g1", [5, 5], "cpu"),
                  {**key, "device": "NVIDIA H200"}, {**key, "cpus": (key["cpus"] or 1) + 1},
                  {**key, "torch": "0.0"}):
        assert CostModel.load(path, other) is None
    path.write_text("{not json")
    assert CostModel.load(path, key) is None


def test_engine_reuses_a_matching_calibration_and_recalibrates_otherwise(
        cora: GraphData, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from quiver_serve.engine.core import calibrate
    from quiver_serve.engine.core.build import build_core

    monkeypatch.setattr(psgs, "cache_dir", lambda: tmp_path / "psgs")
    timed = []
    real = calibrate.calibrate_paths
    monkeypatch.setattr(calibrate, "calibrate_paths",
                        lambda core, *a, **k: timed.append(1) or real(core, 2.0, False))
    cfg = small_config(model__weights=None)
    first = build_core(cfg, cora, 0, None, progress=False)
    assert len(timed) == 1 and first.cost.calibrated and first.psgs is not None
    second = build_core(cfg, cora, 0, None, progress=False)
    assert len(timed) == 1  # same graph, fanouts, hardware: loaded
    for path, line in first.cost.to_dict()["paths"].items():
        assert second.cost.to_dict()["paths"][path] == pytest.approx(line, rel=1e-6, abs=1e-12)
    build_core(small_config(model__weights=None, sampling__fanouts=[10, 5]), cora, 0, None,
               progress=False)
    assert len(timed) == 2  # other fanouts: timed again
    build_core(cfg, cora, 0, None, calibration="startup", progress=False)
    assert len(timed) == 3


# ---- predicted vs measured batch latency, and the metrics ---------------------------------------
def _calibrate_and_measure(cora: GraphData) -> tuple[list[float], list[BatchStats]]:
    """A core calibrated at start-up, then 80 batches of five sizes: per size, median measured
    over median predicted latency (the first 10 batches skipped), and every batch's stats."""
    from quiver_serve.engine.core.build import build_core
    from tests.engine.core.test_engine_core import mb, run

    core = build_core(small_config(model__weights=None, sampling__route="local",
                                   sampling__calibration="startup"), cora, 0, None,
                      progress=False)
    stats: list[BatchStats] = []
    core.on_stats = stats.append
    rng = np.random.default_rng(0)
    sizes = [1, 16, 48, 256, 1024]
    for i in range(80):
        size = sizes[i % len(sizes)]
        run(core, mb(i, [rng.integers(0, cora.num_nodes, size).tolist()]))
    assert all(s.route == "local" and s.psgs > 0 for s in stats)
    ratios = []  # per batch size: median measured / median predicted
    for size in sizes:
        mine = [s for s in stats[10:] if s.num_seeds == size]
        ratios.append(float(np.median([s.sample_s + s.compute_s for s in mine])
                            / np.median([s.predicted_s for s in mine])))
    return ratios, stats


def test_predicted_batch_latency_within_20_percent_at_the_median(
        cora: GraphData, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine times batches with perf_counter; on a shared CI box other processes' load makes
    wall time meaningless, so here both calibration and batches are timed in this thread's CPU
    time (torch_threads is 1: the model runs on this thread). Cora's compute time per node jumps
    between 862 and 1,766 nodes on a 2-vCPU box (the features leave the cache): a line through
    the calibration predicted one-seed batches 5x short and 48-seed ones 1.8x long (medians
    0.56-0.79, the CI failure this test exists for); the predictions follow the measured curve.
    CPU time still stretches when the other vCPU (often the other thread of one core) is busy
    during the calibration alone: a second calibration is allowed, and both must miss."""
    monkeypatch.setattr(psgs, "cache_dir", lambda: tmp_path / "psgs")
    monkeypatch.setattr(time, "perf_counter", time.thread_time)
    attempts = []
    for _ in range(2):
        ratios, stats = _calibrate_and_measure(cora)
        attempts.append(ratios)
        if abs(float(np.median(ratios)) - 1.0) <= 0.20:
            break
    assert abs(float(np.median(attempts[-1])) - 1.0) <= 0.20, \
        f"measured / predicted, per attempt: {attempts}"
    psgs_err = [abs(s.psgs - s.num_sampled_nodes) / s.num_sampled_nodes for s in stats]
    assert float(np.mean(psgs_err)) <= 0.10


def test_routing_metrics_move() -> None:
    from prometheus_client import generate_latest

    from quiver_serve.metrics.prometheus import EngineMetrics, Metrics

    front, engine = Metrics(), EngineMetrics()

    def sample(name: str, labels: str = "") -> float:
        text = generate_latest(front.registry).decode()
        for line in text.splitlines():
            if line.startswith(f"quiver_serve_{name}{labels} "):
                return float(line.split()[-1])
        return 0.0

    before = (sample("psgs_count"), sample("psgs_relative_error_count"),
              sample("batch_latency_ratio_count", '{route="gpu"}'),
              sample("route_total", '{route="gpu"}'))
    engine.observe(BatchStats(batch_id=1, route="gpu", worker=0, num_requests=1, num_seeds=48,
                              num_sampled_nodes=1000, sample_s=1e-3, compute_s=2e-3,
                              psgs=1100.0, predicted_s=2.5e-3))
    after = (sample("psgs_count"), sample("psgs_relative_error_count"),
             sample("batch_latency_ratio_count", '{route="gpu"}'),
             sample("route_total", '{route="gpu"}'))
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1, 1, 1]
    assert sample("psgs_relative_error_bucket", '{le="0.1"}') >= 1  # |1100 - 1000| / 1000


def test_the_batch_estimate_is_cheap_next_to_sampling(cora: GraphData) -> None:
    """Per batch of 48: the estimate's cost against the C++ sampler's (both timed here). On this
    small graph the sample is cheap (~80-150 us) and the estimate ~6-10% of it; the 5% target is
    for the served Reddit-scale graph, where ``python -m bench.routing.routing`` reports the ratio."""
    graph = power_law_graph()
    table = build_table(graph)
    sampler = make_cpu_sampler(graph.indptr, graph.indices)
    seeds = np.random.default_rng(0).integers(0, graph.num_nodes, 48)
    t_seeds = torch.from_numpy(seeds)
    best_est, best_sample = float("inf"), float("inf")
    for _ in range(5):  # best of five rounds: a shared box's noise only adds time
        t0 = time.perf_counter()
        for _ in range(200):
            table.estimate(seeds)
        best_est = min(best_est, (time.perf_counter() - t0) / 200)
        t0 = time.perf_counter()
        for i in range(20):
            sampler.sample(t_seeds, FANOUTS, i)
        best_sample = min(best_sample, (time.perf_counter() - t0) / 20)
    assert best_est <= 0.15 * best_sample, f"estimate {best_est * 1e6:.1f} us, " \
        f"sample {best_sample * 1e6:.1f} us"

"""Bench plumbing: ``--set section.key=value`` config overrides and result names
(``loadtest/results.py``), the routing mixes of ``loadtest/workloads.py``, the tail trace, the daemon
benches' point merge (``loadtest/engine_probe.py``), and the GPU runner (``python -m bench.gpu``)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

from loadtest.results import add_set_option, load_config
from loadtest.workloads import draw_requests, hot_set
from quiver_serve.config import ConfigError, ServeConfig


def test_set_overrides_are_applied_and_validated() -> None:
    ap = argparse.ArgumentParser()
    add_set_option(ap)
    args = ap.parse_args(["--set", "sampling.route=gpu", "--set", "batching.max_batch_nodes=512"])
    cfg = load_config("quiver_serve/defaults/default.yaml", args.sets)
    assert (cfg.sampling.route, cfg.batching.max_batch_nodes) == ("gpu", 512)
    base = ServeConfig.default()
    over = base.with_overrides(["sampling.route=gpu"])
    assert over.sampling.route == "gpu" and base.sampling.route == "auto"  # a copy, not in place


@pytest.mark.parametrize(("item", "names"), [
    ("sampling.nope=1", "sampling.nope"),  # no such field
    ("route=gpu", "route=gpu"),  # no section
    ("sampling.route", "sampling.route"),  # no value
    ("sampling.route=fast", "sampling.route"),  # not an allowed value
    ("batching.max_batch_nodes=-3", "batching.max_batch_nodes"),  # out of range
    ("sampling.fanouts=[1, 2", "sampling.fanouts"),  # not YAML
])
def test_a_bad_set_names_what_was_wrong(item: str, names: str) -> None:
    with pytest.raises(ConfigError, match=names.replace("[", r"\[")):
        ServeConfig.default().with_overrides([item])


def test_routing_mixes_draw_the_low_and_high_degree_halves_of_the_hot_set() -> None:
    rng = np.random.default_rng(0)
    degree = rng.integers(0, 1000, 20_000)
    hot = hot_set(degree)
    half = hot.size // 2
    low, high = set(hot[:half].tolist()), set(hot[half:].tolist())
    assert max(degree[list(low)]) <= min(degree[list(high)])
    light = draw_requests("light", 10, 48, degree.size, hot, rng)
    heavy = draw_requests("heavy", 10, 48, degree.size, hot, rng)
    mixed = draw_requests("mixed", 11, 48, degree.size, hot, rng)
    assert light.shape == heavy.shape == (10, 48) and mixed.shape == (11, 48)
    assert set(light.ravel().tolist()) <= low and set(heavy.ravel().tolist()) <= high
    # a caller walks consecutive rows: light and heavy alternate
    assert all(set(row.tolist()) <= (low if i % 2 == 0 else high) for i, row in enumerate(mixed))


def test_tail_trace_puts_slow_trips_down_to_their_largest_part() -> None:
    """``loadtest/tail_trace.py``: only trips inside the window count; a slow trip goes to the part
    that took longest; slow requests beyond the slow round trips are the client's own."""
    from loadtest.tail_trace import TripLog, merge_reports, process_report
    from quiver_serve.messages import BatchStats

    log = TripLog()
    log.add_trip(0.0, 0.001, 0.2, 0.201)  # before the window: ignored
    log.start()
    log.add_trip(10.0, 10.001, 10.002, 10.003)  # 3 ms: fast
    log.add_trip(20.0, 20.001, 20.100, 20.101)  # 101 ms, engine
    log.add_trip(30.0, 30.050, 30.051, 30.052)  # 52 ms, to_engine
    for sent_s, received_s in ((10.0, 10.003), (20.0, 20.101), (30.0, 30.052), (40.0, 40.002)):
        log.add_round_trip(sent_s, received_s)
    log.add_batch(BatchStats(1, "gpu", 0, 2, 96, compute_s=0.004, sample_s=0.001, queue_s=0.002))
    log.add_batch(BatchStats(2, "cpu", 0, 90, 4320, sample_s=0.036, predicted_s=0.009, psgs=9e4))
    log.add_batch(BatchStats(3, "cpu", 0, 2, 96, sample_s=0.002, predicted_s=0.002, psgs=2e3))
    log.stop()
    lat_s = np.array([0.003, 0.101, 0.052, 0.090, 0.002])  # one slow request had a fast trip
    part = process_report(log, lat_s, [1.0, 30.0], [(2, 0.025), (0, 0.0001)], tail_ms=20.0)
    assert (part["trips"], part["slow_trips"]) == (3, 2)
    assert part["slow_trips_by_part"] == {"engine": 1, "to_engine": 1}
    assert (part["round_trips"], part["slow_round_trips"]) == (4, 2)
    assert part["worst_trips"][0]["engine"] == pytest.approx(99.0, abs=0.01)
    assert (part["loop_lag_over_tail"], part["gc_full"]) == (1, 1)
    assert part["batch_max_ms"]["compute_s"] == pytest.approx(4.0)
    slow_cpu = part["slowest_sample_by_route"]["cpu"]
    assert (slow_cpu["seeds"], slow_cpu["sample_ms"]) == (4320, pytest.approx(36.0))
    point = merge_reports([part, part], np.concatenate([lat_s, lat_s]), 20.0, None)
    assert (point["slow_requests"], point["slow_trips"]) == (6, 4)
    assert point["slow_trips_by_part"] == {"engine": 2, "to_engine": 2}
    assert point["slowest_sample_by_route"]["cpu"]["predicted_ms"] == pytest.approx(9.0)


def test_daemon_gc_diff_counts_the_pauses_of_the_point() -> None:
    from loadtest.tail_trace import daemon_gc_diff
    from quiver_serve.metrics.prometheus import GC_PAUSE_BUCKETS_S

    n = len(GC_PAUSE_BUCKETS_S) + 1  # cumulative buckets, +Inf last
    before = {("engine 0", "2"): np.zeros(n)}
    after_cum = np.zeros(n)
    # 3 pauses under 1 ms, 2 over 50 ms
    after_cum[[i for i, le in enumerate(GC_PAUSE_BUCKETS_S) if le >= 0.001]] = 3
    after_cum[[i for i, le in enumerate(GC_PAUSE_BUCKETS_S) if le >= 0.1]] = 5
    after_cum[-1] = 5
    diff = daemon_gc_diff(before, {("engine 0", "2"): after_cum}, tail_ms=20.0)
    assert diff == {"engine 0 gen2": {"pauses": 5, "over_tail": 2}}


def test_routing_bench_reads_throughput_where_p99_crosses_the_bound() -> None:
    """``bench.routing.routing_daemon.at_bound``: linear between the last point under the bound and the
    next over it; never below the best point under; 0 with no point under; and the median over
    repeated sweeps."""
    from bench.routing.routing_daemon import at_bound, summarise_rounds

    def row(callers: int, seeds_per_s: float, p99_ms: float | None, errors: dict | None = None) -> dict:
        return {"callers": callers, "seeds_per_s": seeds_per_s, "p99_ms": p99_ms,
                "errors": errors or {}}

    rows = [row(64, 1.0e6, 5.0), row(128, 1.4e6, 8.0), row(256, 2.4e6, 13.0)]
    assert at_bound(rows, 10.0) == pytest.approx(1.4e6 + 0.4 * 1.0e6)  # 2 of the 5 ms gap
    assert at_bound(rows, 20.0) == pytest.approx(2.4e6)  # every point under: the best
    assert at_bound([row(64, 1.0e6, 12.0)], 10.0) == 0.0
    falling = [row(64, 1.5e6, 9.0), row(128, 1.2e6, 11.0)]  # more callers, less throughput
    assert at_bound(falling, 10.0) == pytest.approx(1.5e6)
    errored = [row(64, 1.0e6, 5.0), row(128, 2.0e6, 12.0, {"503": 3})]
    assert at_bound(errored, 10.0) == pytest.approx(1.0e6)  # no line towards a refused point
    out = summarise_rounds([rows, [row(64, 0.9e6, 11.0)], falling], 10.0)
    assert out["at_bound"] == [pytest.approx(1.8e6), 0.0, pytest.approx(1.5e6)]
    assert out["at_bound_median"] == pytest.approx(1.5e6)
    assert out["best"]["seeds_per_s"] == pytest.approx(1.5e6)  # the median round's best point


def test_feature_bench_variants_and_their_ratios() -> None:
    """``bench/features/features_e2e.py``: variants parse (budget share or all, storage dtype),
    and each 20% variant is compared at the bound with the all-GPU daemon of its own storage
    dtype."""
    from bench.features import features_e2e as fe

    assert fe.parse_variant("20%-fp16=0.2:fp16") == ("20%-fp16", 0.2, "fp16")
    assert fe.parse_variant("all-gpu=all:fp32") == ("all-gpu", None, "fp32")
    with pytest.raises(ValueError, match="label=budget:dtype"):
        fe.parse_variant("x=0.2:int8")

    def run(rate: float) -> dict:
        points = [{"workload": w, "callers": c, "seeds_per_s": rate * c, "p99_ms": p99,
                   "errors": {}} for w in ("a", "b") for c, p99 in ((10, 5.0), (20, 15.0))]
        summary = [{"workload": w, "within_bound": True, "daemon": {
            "seeds_per_s": rate * 10, "p99_ms": 5.0, "callers": 10, "mean_batch_seeds": 480}}
            for w in ("a", "b")]
        return {"summary": summary, "daemon": points}

    runs = {"all-gpu": run(1000.0), "20%": run(400.0), "20%-fp16": run(600.0),
            "all-gpu-fp16": run(800.0)}
    rows = fe.daemon_rows(runs)
    assert rows[0]["all-gpu"]["at_bound"] == pytest.approx(15000.0)  # halfway to 20 callers
    assert rows[0]["ratio"] == pytest.approx(0.4)
    assert rows[0]["ratios_at_bound"] == {"20%": pytest.approx(0.4),
                                          "20%-fp16": pytest.approx(0.75)}  # 600 / 800


def test_result_names_carry_bench_machine_date_and_variant(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    from loadtest.results import machine_name, result_name, result_path

    assert machine_name(["NVIDIA H200"]) == "h200"
    assert machine_name(["NVIDIA H100 80GB HBM3"] * 2) == "h100x2"
    assert machine_name([], cores=2) == "cpu2"
    assert result_name("pipeline", "h200", "gate", date="2026-11-23") == \
        "pipeline_h200_2026-11-23_gate.json"
    assert result_name("routing", "cpu2", None, date="2026-11-23") == "routing_cpu2_2026-11-23.json"
    assert result_name("front_door", "cpu2", "Fast On_r1", "2026-11-23") == \
        "front_door_cpu2_2026-11-23_fast-on-r1.json"
    monkeypatch.setenv("OUT", str(tmp_path))
    args = argparse.Namespace(out=None, machine="h200", variant=None)
    assert result_path("model", args).parent == tmp_path
    assert result_path("model", args, "smoke").name.startswith("model_h200_")
    # a bare name goes in the results folder (not wherever the bench was started); a path not
    assert result_path("model", argparse.Namespace(out="x.json")) == tmp_path / "x.json"
    assert result_path("model", argparse.Namespace(out="x.json", out_dir="elsewhere")) == \
        Path("elsewhere") / "x.json"
    assert str(result_path("model", argparse.Namespace(out="sub/x.json"))) == "sub/x.json"


def test_daemon_point_merges_the_probe_reports_of_the_load_processes() -> None:
    """``loadtest/engine_probe.py``: the driver's parts (latencies, statuses, CPU) and the engine
    probe's reports (batches, routes, per-engine counts) make one daemon row."""
    from collections import Counter

    from loadtest.engine_probe import merge_point
    from loadtest.tail_trace import TripLog, process_report

    def part(lat_s: list[float], ok: int, errors: dict[str, int]) -> dict:
        tail = process_report(TripLog(), np.array(lat_s), [], [], 20.0)
        probe = {"tail": tail, "batches": 4, "seeds": 192, "sampled": 4000, "compute_s": 0.02,
                 "sample_s": 0.01, "routes": Counter({"cpu": 3, "engine0": 4}),
                 "sent_per_engine": [5], "answered_per_engine": [5], "load_per_engine": [0]}
        return {"lat_s": np.array(lat_s), "status": {"200": ok, **errors}, "cpu_frac": 0.5,
                "probe": probe, "index": 0}

    row = merge_point([part([0.001, 0.002], 2, {}), part([0.003], 1, {"503": 1})], "a", 48, 4,
                      2.0, 1)
    assert (row["ok"], row["errors"], row["load_procs"]) == (3, {"503": 1}, 2)
    assert row["seeds_per_s"] == pytest.approx(3 * 48 / 2.0)
    assert row["engine_batches"] == 8 and row["mean_batch_seeds"] == pytest.approx(48.0)
    assert row["routes"] == {"cpu": 6, "engine0": 8} and row["sent_per_engine"] == [10]
    assert row["p50_ms"] == pytest.approx(2.0)

"""The load generator (loadtest/): arrival rate, percentiles, trace order, the /metrics diff, and a
short run against the real daemon over HTTP JSON and npy."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from loadtest import promdiff
from loadtest.driver import arrival_times, closed_loop, open_loop
from loadtest.stats import merge_point, percentiles_ms, summary
from loadtest.workloads import hot_set, load_trace, process_requests


def run_open(rate: float, seconds: float, arrivals: str, delay_s: float = 0.0) -> tuple[dict, list]:
    """The real open-loop sender against a stub call that answers after ``delay_s``."""
    sent: list[float] = []

    async def call(i: int) -> str:
        sent.append(time.time())
        await asyncio.sleep(delay_s)
        return "200"

    t0 = time.time() + 0.2
    times = arrival_times(rate, t0, t0 + seconds, seed=3, arrivals=arrivals)
    sizes = np.full(64, 48)
    res = asyncio.run(open_loop(call, sizes, times, t0, t0 + seconds, 100_000, 5.0))
    return res, sent


@pytest.mark.parametrize("arrivals", ["poisson", "uniform"])
def test_open_loop_rate_within_5_percent(arrivals: str) -> None:
    rate, seconds = 2000.0, 2.0
    res, sent = run_open(rate, seconds, arrivals, delay_s=0.005)  # ~10 requests in flight
    assert abs(len(sent) / seconds - rate) / rate < 0.05
    assert abs(res["status"]["200"] / seconds - rate) / rate < 0.05
    # measured on the wall clock: the sends spread over the whole window, at the set rate
    span_s = max(sent) - min(sent)
    assert abs(span_s - seconds) / seconds < 0.05
    assert abs(len(sent) / span_s - rate) / rate < 0.05
    # the sender kept to its schedule: never early, and mostly within a few ms
    assert res["lag_s"].min() > -0.002 and np.percentile(res["lag_s"], 50) < 0.02


def test_open_loop_latency_counts_from_the_schedule() -> None:
    """A server slower than the arrival rate: latency grows with the backlog (no coordinated
    omission), and the send rate does not drop."""
    busy = asyncio.Lock()

    async def call(i: int) -> str:
        async with busy:  # one at a time, 10 ms each: capacity 100/s
            await asyncio.sleep(0.01)
        return "200"

    t0 = time.time() + 0.1
    times = arrival_times(200.0, t0, t0 + 1.0, seed=0, arrivals="uniform")
    res = asyncio.run(open_loop(call, np.ones(8, np.int64), times, t0, t0 + 1.0, 10_000, 5.0))
    lat = np.sort(res["lat_s"])
    assert res["status"]["200"] == 200
    assert lat[-1] > 0.8  # the last request waited behind ~100 earlier ones


def test_percentiles_merge_equals_numpy_on_the_whole_list() -> None:
    rng = np.random.default_rng(7)
    lat = rng.lognormal(-5, 1, 20_000)
    parts = [{"index": i, "lat_s": chunk, "lag_s": np.zeros(1), "status": {"200": chunk.size},
              "seeds": 48 * chunk.size, "cpu_frac": 0.1} for i, chunk in enumerate(np.split(lat, 4))]
    cmd = {"seconds": 2.0, "mode": "closed", "callers": 8, "rate": None,
           "target": {"protocol": "http-json"}}
    p = merge_point(parts, cmd)
    want = np.percentile(lat, [50, 90, 99, 99.9]) * 1e3
    np.testing.assert_allclose([p["p50_ms"], p["p90_ms"], p["p99_ms"], p["p999_ms"]], want)
    assert p["req_per_s"] == 10_000 and p["seed_nodes_per_s"] == 48 * 10_000
    assert percentiles_ms(np.zeros(0))["p99_ms"] is None
    s = summary([p], [1.0, 1e6])
    assert s["p99<=1ms"] is None and s["p99<=1e+06ms"]["seed_nodes_per_s"] == 480_000


def test_trace_format_and_replay_order(tmp_path: Path) -> None:
    padded = np.array([[5, 6, -1], [7, -1, -1], [1, 2, 3], [9, -1, -1], [4, 4, -1]])
    np.save(tmp_path / "t.npy", padded)
    rows = load_trace(tmp_path / "t.npy")
    assert [r.tolist() for r in rows] == [[5, 6], [7], [1, 2, 3], [9], [4, 4]]
    obj = np.empty(2, dtype=object)
    obj[0], obj[1] = np.array([3, 1]), np.array([8])
    np.save(tmp_path / "o.npy", obj, allow_pickle=True)
    with pytest.raises(ValueError, match="--trace-allow-pickle"):
        load_trace(tmp_path / "o.npy")
    assert [r.tolist() for r in load_trace(tmp_path / "o.npy", allow_pickle=True)] == [[3, 1], [8]]
    np.save(tmp_path / "bad.npy", np.array([[1, -2]]))
    with pytest.raises(ValueError, match="negative id -2"):
        load_trace(tmp_path / "bad.npy")

    # closed loop, several callers in one process: requests leave in trace order
    spec = {"workload": "trace", "trace": [np.array([i]) for i in range(50)]}
    reqs = process_requests(spec, 0, 1)
    seen: list[int] = []

    async def call(i: int) -> str:
        seen.append(int(reqs[i][0]))
        await asyncio.sleep(0.001)
        return "200"

    t0 = time.time()
    asyncio.run(closed_loop(call, np.ones(len(reqs), np.int64), 4, t0, t0 + 0.3))
    assert len(seen) > 50 and seen[:50] == list(range(50))
    # two processes share the arrival schedule: process p sends rows p, p + 2, ...
    assert [int(r[0]) for r in process_requests(spec, 1, 2)][:3] == [1, 3, 5]


def test_open_loop_replays_trace_in_order() -> None:
    order: list[int] = []

    async def call(i: int) -> str:
        order.append(i)
        return "200"

    t0 = time.time() + 0.05
    times = arrival_times(500.0, t0, t0 + 0.2, seed=1)
    asyncio.run(open_loop(call, np.ones(1000, np.int64), times, t0, t0 + 0.2, 100, 1.0))
    assert order == list(range(len(times)))


def test_hot_set_half_low_half_high_degree() -> None:
    deg = np.arange(10_000)
    hot = hot_set(deg, 100)
    assert sorted(hot[:50]) == list(range(50)) and sorted(hot[50:]) == list(range(9950, 10_000))


METRICS_BEFORE = """\
# HELP quiver_serve_compute_duration_seconds gather + model time per batch (GPU: device time)
# TYPE quiver_serve_compute_duration_seconds histogram
quiver_serve_compute_duration_seconds_bucket{le="0.001"} 2.0
quiver_serve_compute_duration_seconds_bucket{le="0.002"} 5.0
quiver_serve_compute_duration_seconds_bucket{le="0.005"} 10.0
quiver_serve_compute_duration_seconds_bucket{le="+Inf"} 10.0
quiver_serve_compute_duration_seconds_count 10.0
quiver_serve_compute_duration_seconds_sum 0.02
# HELP quiver_serve_sample_duration_seconds sampling time per batch
# TYPE quiver_serve_sample_duration_seconds histogram
quiver_serve_sample_duration_seconds_bucket{le="0.001",route="cpu"} 1.0
quiver_serve_sample_duration_seconds_bucket{le="+Inf",route="cpu"} 1.0
quiver_serve_sample_duration_seconds_count{route="cpu"} 1.0
quiver_serve_sample_duration_seconds_sum{route="cpu"} 0.0005
# HELP quiver_serve_request_duration_seconds HTTP request latency
# TYPE quiver_serve_request_duration_seconds histogram
quiver_serve_request_duration_seconds_bucket{endpoint="/v1/embed",le="0.01",status="200"} 3.0
quiver_serve_request_duration_seconds_bucket{endpoint="/v1/embed",le="+Inf",status="200"} 3.0
quiver_serve_request_duration_seconds_count{endpoint="/v1/embed",status="200"} 3.0
quiver_serve_request_duration_seconds_sum{endpoint="/v1/embed",status="200"} 0.015
# HELP quiver_serve_pending_requests admitted requests not yet answered
# TYPE quiver_serve_pending_requests gauge
quiver_serve_pending_requests 0.0
"""


def test_metrics_diff_parser() -> None:
    after = (METRICS_BEFORE
             .replace('le="0.001"} 2.0', 'le="0.001"} 2.0')
             .replace('le="0.002"} 5.0', 'le="0.002"} 55.0')
             .replace('le="0.005"} 10.0', 'le="0.005"} 110.0')
             .replace('le="+Inf"} 10.0', 'le="+Inf"} 110.0')
             .replace("seconds_count 10.0", "seconds_count 110.0")
             .replace("seconds_sum 0.02", "seconds_sum 0.27")
             .replace('le="0.001",route="cpu"} 1.0', 'le="0.001",route="cpu"} 4.0')
             .replace('le="+Inf",route="cpu"} 1.0', 'le="+Inf",route="cpu"} 4.0')
             .replace('count{route="cpu"} 1.0', 'count{route="cpu"} 4.0')
             .replace('sum{route="cpu"} 0.0005', 'sum{route="cpu"} 0.002'))
    b = promdiff.breakdown(METRICS_BEFORE, after)
    # 100 new compute observations: 50 in (1, 2] ms, 50 in (2, 5] ms; mean 2.5 ms
    assert b["compute"]["count"] == 100
    assert b["compute"]["mean_ms"] == pytest.approx(2.5)
    assert b["compute"]["p50_ms"] == pytest.approx(2.0)
    assert b["compute"]["p99_ms"] == pytest.approx(2.0 + 3.0 * 49 / 50)
    assert b["sample"]["count"] == 3 and b["sample[cpu]"]["mean_ms"] == pytest.approx(0.5)
    assert "request" not in b  # nothing new
    assert promdiff.bucket_quantile({0.001: 0.0, float("inf"): 0.0}, 0.5) is None


@pytest.mark.e2e
def test_generator_against_the_real_daemon(server) -> None:  # noqa: ANN001 - conftest fixture
    """~2 s of load processes over HTTP JSON and npy against server.py: every answer 200, open-loop
    send rate as set, the stage breakdown read from /metrics."""
    from loadtest.gen import Generator, probe

    model, num_nodes = probe(server.url)
    assert model == "cora-graphsage" and num_nodes == 2708
    spec = {"workload": "b", "hot": None, "num_nodes": num_nodes, "seed": 0, "ids_per_request": 8}
    gen = Generator(procs=2, warm_s=0.2, seconds=1.0)
    try:
        for protocol in ("http-json", "http-npy"):
            target = {"protocol": protocol, "url": server.url, "model": model, "timeout_s": 10.0}
            closed = gen.point(target, spec, "closed", 4, metrics=server.url)
            assert closed["errors"] == {} and closed["ok"] > 10, closed
            assert closed["seed_nodes_per_s"] == pytest.approx(8 * closed["req_per_s"])
            assert len(closed["load_cpu_cores"]) == 2
            assert closed["stages"]["request"]["count"] >= closed["ok"] // 2  # windows differ a little
            assert closed["stages"]["compute"]["count"] > 0
            opened = gen.point(target, spec, "open", 40.0)
            assert opened["errors"] == {} and opened["ok"] == opened["requests"]
            assert 20 <= opened["sent_per_s"] <= 60  # 40/s Poisson over 1 s
        # the KServe binary tensor extension: ids as raw INT64, binary output asked for
        target = {"protocol": "kserve-binary", "url": server.url, "model": model, "timeout_s": 10.0}
        kserve = gen.point(target, spec, "closed", 2)
        assert kserve["errors"] == {} and kserve["ok"] > 5, kserve
        # a bad model name is counted by status, not hidden
        bad = gen.point(dict(target, model="nope"), spec, "closed", 1)
        assert bad["ok"] == 0 and set(bad["errors"]) == {"404"}
    finally:
        gen.close()


def test_metrics_diff_on_prometheus_client_output() -> None:
    """Text written by prometheus_client itself (the library the daemon exports with), with the
    daemon's metric names and buckets: differenced counts and means are exact."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from quiver_serve.metrics.prometheus import LATENCY_BUCKETS_S

    reg = CollectorRegistry()
    sample = Histogram("quiver_serve_sample_duration_seconds", "s", ["route"],
                       buckets=LATENCY_BUCKETS_S, registry=reg)
    queue = Histogram("quiver_serve_queue_duration_seconds", "q", buckets=LATENCY_BUCKETS_S,
                      registry=reg)
    for v in (0.003, 0.004):
        sample.labels("gpu").observe(v)
    before = generate_latest(reg).decode()
    rng = np.random.default_rng(0)
    gpu, cpu, q = rng.uniform(0.001, 0.002, 30), rng.uniform(0.006, 0.009, 10), rng.uniform(0, 1e-3, 40)
    for v in gpu:
        sample.labels("gpu").observe(v)
    for v in cpu:
        sample.labels("cpu").observe(v)
    for v in q:
        queue.observe(v)
    b = promdiff.breakdown(before, generate_latest(reg).decode())
    assert b["sample"]["count"] == 40 and b["sample[gpu]"]["count"] == 30
    assert b["sample[cpu]"]["mean_ms"] == pytest.approx(cpu.mean() * 1e3)
    assert b["sample"]["mean_ms"] == pytest.approx(np.concatenate([gpu, cpu]).mean() * 1e3)
    assert 1.0 <= b["sample[gpu]"]["p50_ms"] <= 2.0 and 5.0 <= b["sample[cpu]"]["p99_ms"] <= 10.0
    assert b["queue"]["count"] == 40 and b["queue"]["p99_ms"] <= 1.0
